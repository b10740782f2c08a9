// The SDK's training state: its layout, its commit record, and the two versions on a
// volume (Note [train state versions] in memascend/training_state.h).
#include <cstring>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memascend/training_state.h>

#include "storage/volume_test_util.h"
#include "store/store_test_util.h"
#include "testing/status_matchers.h"
#include "train/state_test_util.h"

namespace memascend {
namespace {

using ::memascend::testing::ScratchPath;
using ::memascend::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

StateLayout Layout() {
  StateLayout l;
  l.groups = {{"embed", 5000, false}, {"block.0", 3000, true}, {"head", 7000, true}};
  l.param_dtype = l.grad_dtype = DType::kBF16;
  l.part_elements = 2048;
  return l;
}

TEST(StateLayout, PartsCoverEachGroupAndBadLayoutsAreRefused) {
  StateLayout l = Layout();
  ASSERT_OK(l.Validate());
  EXPECT_EQ(l.Parts(0), 3u);
  EXPECT_EQ(l.PartRange(0, 2), std::make_pair(std::size_t{4096}, std::size_t{5000}));
  EXPECT_EQ(l.MaxPartElements(), 2048u);
  EXPECT_EQ(l.TotalElements(), 15000u);
  EXPECT_FALSE(l.Stored(StateKind::kParameters, 0));
  EXPECT_TRUE(l.Stored(StateKind::kMaster, 0));
  EXPECT_EQ(l.ElementBytes(StateKind::kExpAvg), 4u);
  l.part_elements = SIZE_MAX;
  EXPECT_EQ(l.Parts(2), 1u);
  EXPECT_EQ(l.PartRange(2, 0).second, 7000u);

  StateLayout bad = Layout();
  bad.groups.clear();
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no groups")));
  bad = Layout();
  bad.groups[1].name = "head";
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("twice")));
  bad = Layout();
  bad.groups[1].name = "a/b";
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a/b")));
  bad = Layout();
  bad.groups[1].elements = 0;
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  bad = Layout();
  bad.part_elements = 0;
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(Layout().Fingerprint(), bad.Fingerprint());
  // Counts from a negative int64, or beyond any byte count's range: refused, not walked
  // (a walk over 4e12 parts hung) nor allocated (std::length_error aborted).
  for (std::size_t n :
       {std::size_t{1} << 62, std::numeric_limits<std::size_t>::max(), std::size_t{1} << 61}) {
    bad = Layout();
    bad.groups[1].elements = n;
    EXPECT_THAT(bad.Validate(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2^48 elements")));
  }
  bad = Layout();
  bad.part_elements = std::size_t{1} << 30;
  bad.groups[0].elements = bad.groups[1].elements = std::size_t{1} << 47;  // each fits, not both
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2^48")));
  bad = Layout();
  bad.part_elements = 1;
  bad.groups[1].elements = std::size_t{1} << 40;
  EXPECT_THAT(bad.Validate(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2^28 parts")));
  bad = Layout();
  bad.grad_dtype = static_cast<DType>(7);  // read from a file, say
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gradient")));
}

TEST(CommitRecord, RoundTripsAndRefusesAnythingButAWholeRecord) {
  CommitRecord r;
  r.step = 1234;
  r.version = 1;
  r.adam_step = 1200;
  r.scaler = {512.0f, 17, 1, 34};
  r.fingerprint = 0xfeedfacecafebeefull;
  r.layout = 42;
  r.user = std::string("user\0bytes", 10);
  const std::string bytes = EncodeCommitRecord(r);
  ASSERT_OK_AND_ASSIGN(CommitRecord back, DecodeCommitRecord(bytes));
  EXPECT_EQ(back.step, r.step);
  EXPECT_EQ(back.version, 1);
  EXPECT_EQ(back.adam_step, 1200);
  EXPECT_EQ(back.scaler.scale, 512.0f);
  EXPECT_EQ(back.scaler.good_steps, 17);
  EXPECT_EQ(back.scaler.hysteresis_left, 1);
  EXPECT_EQ(back.scaler.skipped, 34);
  EXPECT_EQ(back.fingerprint, r.fingerprint);
  EXPECT_EQ(back.layout, 42u);
  EXPECT_EQ(back.user, r.user);

  for (std::size_t i = 0; i < bytes.size(); i += 7) {  // any flipped bit
    std::string damaged = bytes;
    damaged[i] = static_cast<char>(damaged[i] ^ 0x10);
    EXPECT_THAT(DecodeCommitRecord(damaged), StatusIs(absl::StatusCode::kDataLoss)) << i;
  }
  EXPECT_THAT(DecodeCommitRecord(bytes.substr(0, bytes.size() - 1)),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(DecodeCommitRecord("step=3;version=0"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not a commit record")));
  EXPECT_THAT(DecodeCommitRecord(""), StatusIs(absl::StatusCode::kDataLoss));
}

using Opened = ::memascend::testing::OpenedState;

// A store far below the state (evictions write back) and the state in two versions (Note
// [train state versions]: what most of these tests are about), over a file volume;
// reopened as a new process would.
void Open(const std::string& path, const StateLayout& layout, Opened* o, bool format,
          bool in_place = false) {
  TensorStoreOptions so;
  so.host_budget_bytes = 64 * 1024;
  VersionedTrainingStateOptions vo;
  vo.in_place = in_place;
  ASSERT_OK(::memascend::testing::OpenState(path, format ? 16 << 20 : 0, layout, so, o, vo));
}

// Every stored element of kind k of every part set to `value`, in the current (next ==
// false) or next version.
void Fill(TrainingStateStorage* s, StateKind k, float value, bool next) {
  const StateLayout& l = s->layout();
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    if (!l.Stored(k, g)) continue;
    for (std::size_t p = 0; p < l.Parts(g); ++p) {
      auto b = s->Overwrite(k, g, p, next);
      ASSERT_OK(b.status());
      for (float& f : b->as<float>()) f = value + static_cast<float>(g * 100 + p);
    }
  }
}
void Expect(TrainingStateStorage* s, StateKind k, float value) {
  const StateLayout& l = s->layout();
  for (std::size_t g = 0; g < l.groups.size(); ++g) {
    for (std::size_t p = 0; p < l.Parts(g); ++p) {
      auto b = s->Read(k, g, p, false);
      ASSERT_OK(b.status());
      const auto [begin, end] = l.PartRange(g, p);
      ASSERT_EQ(b->bytes, (end - begin) * 4);
      for (float f : b->as<float>())
        ASSERT_EQ(f, value + static_cast<float>(g * 100 + p)) << g << "." << p;
    }
  }
}

TEST(VersionedTrainingState, ACommitIsWhatAReopenFindsAndTheNextVersionIsNotSeenBeforeIt) {
  ScratchPath path("train_state");
  const StateLayout layout = Layout();
  {
    Opened o;
    Open(path.path(), layout, &o, true);
    ASSERT_OK_AND_ASSIGN(auto none, o.state->Resume(7));
    EXPECT_FALSE(none.has_value());
    Fill(o.state.get(), StateKind::kMaster, 1.0f, false);
    CommitRecord r;
    r.step = 0;
    r.fingerprint = 7;
    r.user = "epoch=0";
    ASSERT_OK(o.state->Commit(r));
    ASSERT_OK(o.state->Settle());
    // The next version, made from the current one, then left uncommitted.
    for (std::size_t p = 0; p < layout.Parts(1); ++p) {
      ASSERT_OK_AND_ASSIGN(StateBuffer b, o.state->Update(StateKind::kMaster, 1, p));
      EXPECT_EQ(b.as<float>()[0], 1.0f + static_cast<float>(100 + p));  // a copy of the current
      for (float& f : b.as<float>()) f = -1;
    }
    ASSERT_OK(o.store->Flush());  // written, but no commit record names it
  }
  {
    Opened o;
    Open(path.path(), layout, &o, false);
    ASSERT_OK_AND_ASSIGN(auto last, o.state->Resume(7));
    ASSERT_TRUE(last.has_value());
    EXPECT_EQ(last->step, 0u);
    EXPECT_EQ(last->user, "epoch=0");
    EXPECT_EQ(o.state->current_version(), 0);
    Expect(o.state.get(), StateKind::kMaster, 1.0f);
    // Now a whole next version, committed as step 1.
    Fill(o.state.get(), StateKind::kMaster, 2.0f, true);
    CommitRecord r;
    r.step = 1;
    r.version = 1;
    r.fingerprint = 7;
    ASSERT_OK(o.state->Commit(r));
    Expect(o.state.get(), StateKind::kMaster, 2.0f);  // seen at once, before durable
  }
  {
    Opened o;
    Open(path.path(), layout, &o, false);
    ASSERT_OK_AND_ASSIGN(auto last, o.state->Resume(7));
    ASSERT_TRUE(last.has_value());
    EXPECT_EQ(last->step, 1u);
    EXPECT_EQ(o.state->current_version(), 1);
    Expect(o.state.get(), StateKind::kMaster, 2.0f);
    // Derived parameters are not stored at all.
    EXPECT_THAT(o.state->Tensor(StateKind::kParameters, 0, 0, 0),
                StatusIs(absl::StatusCode::kNotFound));
    EXPECT_THAT(o.state->Tensor(StateKind::kMaster, 0, 9, 0),
                StatusIs(absl::StatusCode::kOutOfRange));
  }
}

TEST(VersionedTrainingState, ResumingAtMostAStepGoesBackToThePreviousCommitWhole) {
  // Note [previous commit]: after commits of steps 1, 2 and 3, a rank that must agree
  // with a rank left at step 2 goes back to step 2, whose version is whole; step 1 is
  // gone; and the step gone back to is the last from then on.
  ScratchPath path("train_state_previous");
  const StateLayout layout = Layout();
  {
    Opened o;
    Open(path.path(), layout, &o, true);
    Fill(o.state.get(), StateKind::kMaster, 0.0f, false);
    CommitRecord r;
    r.fingerprint = 7;
    ASSERT_OK(o.state->Commit(r));
    for (std::uint64_t step = 1; step <= 3; ++step) {
      Fill(o.state.get(), StateKind::kMaster, 10.0f * static_cast<float>(step), true);
      r.step = step;
      r.version = 1 - o.state->current_version();
      ASSERT_OK(o.state->Commit(r));
    }
    ASSERT_OK(o.state->Settle());
  }
  {
    Opened o;
    Open(path.path(), layout, &o, false);
    EXPECT_THAT(o.state->ResumeAtMost(7, 1),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("step 3 and step 2")));
    ASSERT_OK_AND_ASSIGN(auto at3, o.state->ResumeAtMost(7, 5));
    EXPECT_EQ(at3->step, 3u);
    Expect(o.state.get(), StateKind::kMaster, 30.0f);
    EXPECT_THAT(o.state->ResumeAtMost(8, 2), StatusIs(absl::StatusCode::kFailedPrecondition));
    ASSERT_OK_AND_ASSIGN(auto at2, o.state->ResumeAtMost(7, 2));
    EXPECT_EQ(at2->step, 2u);
    Expect(o.state.get(), StateKind::kMaster, 20.0f);
  }
  {
    Opened o;
    Open(path.path(), layout, &o, false);
    ASSERT_OK_AND_ASSIGN(auto last, o.state->Resume(7));
    EXPECT_EQ(last->step, 2u);  // step 3 is dropped for good
    Expect(o.state.get(), StateKind::kMaster, 20.0f);
    // Going on from step 2 overwrites step 3's version; step 2 stays the previous.
    Fill(o.state.get(), StateKind::kMaster, 25.0f, true);
    CommitRecord r;
    r.fingerprint = 7;
    r.step = 3;
    r.version = 1 - o.state->current_version();
    ASSERT_OK(o.state->Commit(r));
    ASSERT_OK(o.state->Settle());
  }
  {
    Opened o;
    Open(path.path(), layout, &o, false);
    ASSERT_OK_AND_ASSIGN(auto again, o.state->ResumeAtMost(7, 2));
    EXPECT_EQ(again->step, 2u);
    Expect(o.state.get(), StateKind::kMaster, 20.0f);
  }
}

// Note [state in place]: a volume an earlier release wrote in two versions goes on in two
// versions when opened with the default options; a step's write before BeginUpdate is
// refused in place.
TEST(VersionedTrainingState, ATwoVersionVolumeStaysInTwoVersionsAndInPlaceStepsNeedAnIntent) {
  ScratchPath path("train_state_two_then_default");
  const StateLayout layout = Layout();
  {
    Opened o;
    Open(path.path(), layout, &o, true, /*in_place=*/false);
    Fill(o.state.get(), StateKind::kMaster, 3.0f, false);
    CommitRecord r;
    r.fingerprint = 7;
    ASSERT_OK(o.state->Commit(r));
  }
  {
    Opened o;
    Open(path.path(), layout, &o, false, /*in_place=*/true);
    ASSERT_OK_AND_ASSIGN(auto last, o.state->Resume(7));
    ASSERT_TRUE(last.has_value());
    Expect(o.state.get(), StateKind::kMaster, 3.0f);
    EXPECT_OK(o.state->Tensor(StateKind::kMaster, 0, 0, 1).status());  // both versions
    EXPECT_FALSE(o.state->options().in_place);  // the options it runs with, not those asked
    ASSERT_OK_AND_ASSIGN(TensorId v0, o.state->Tensor(StateKind::kMaster, 0, 0, 0));
    ASSERT_OK_AND_ASSIGN(TensorId v1, o.state->Tensor(StateKind::kMaster, 0, 0, 1));
    EXPECT_NE(v0, v1);
  }
  ScratchPath fresh("train_state_in_place_intent");
  Opened o;
  Open(fresh.path(), layout, &o, true, /*in_place=*/true);
  ASSERT_OK_AND_ASSIGN(TensorId v0, o.state->Tensor(StateKind::kMaster, 0, 0, 0));
  ASSERT_OK_AND_ASSIGN(TensorId v1, o.state->Tensor(StateKind::kMaster, 0, 0, 1));
  EXPECT_EQ(v0, v1);  // one tensor: both versions name it
  EXPECT_TRUE(o.state->options().in_place);
  EXPECT_THAT(o.state->Update(StateKind::kMaster, 0, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("BeginUpdate")));
  EXPECT_THAT(o.state->Overwrite(StateKind::kParameters, 1, 0, true).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("BeginUpdate")));
  Fill(o.state.get(), StateKind::kMaster, 1.0f, false);  // outside a step: Initialize's way
  Expect(o.state.get(), StateKind::kMaster, 1.0f);
}

// A trainer's options: the staging bound kept only for a state in place, committed every
// step, a step at a time in batches; every other field as default.
TEST(VersionedTrainingStateOptions, ATrainersOptionsStageWholeWhereTheyMust) {
  const VersionedTrainingStateOptions defaults;
  const auto bounded = VersionedTrainingStateOptions::ForTrainer(false, 1, false);
  EXPECT_TRUE(bounded.in_place);
  EXPECT_EQ(bounded.max_staged_bytes, defaults.max_staged_bytes);
  EXPECT_EQ(bounded.commit_every, 1u);
  EXPECT_EQ(bounded.record_name, defaults.record_name);
  EXPECT_FALSE(bounded.replace_existing);
  const auto whole = VersionedTrainingStateOptions::ForTrainer(false, 1, true);
  EXPECT_TRUE(whole.in_place);
  EXPECT_EQ(whole.max_staged_bytes, 0u);
  const auto interval = VersionedTrainingStateOptions::ForTrainer(false, 4, false);
  EXPECT_TRUE(interval.in_place);
  EXPECT_EQ(interval.max_staged_bytes, 0u);
  EXPECT_EQ(interval.commit_every, 4u);
  const auto ranks = VersionedTrainingStateOptions::ForTrainer(true, 1, false);
  EXPECT_FALSE(ranks.in_place);
  EXPECT_EQ(ranks.max_staged_bytes, 0u);
}

TEST(VersionedTrainingState, AnotherRunsOrAnotherLayoutsStateIsRefusedAndLeftAlone) {
  ScratchPath path("train_state_refuse");
  {
    Opened o;
    Open(path.path(), Layout(), &o, true);
    Fill(o.state.get(), StateKind::kMaster, 5.0f, false);
    CommitRecord r;
    r.fingerprint = 1;
    ASSERT_OK(o.state->Commit(r));
  }
  {
    Opened o;
    Open(path.path(), Layout(), &o, false);
    EXPECT_THAT(o.state->Resume(2),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another run")));
  }
  {
    StateLayout other = Layout();
    other.groups[2].elements = 7001;
    Opened o;
    o.volume = *Volume::Open(path.path(), {});
    TensorStoreOptions so;
    so.host_budget_bytes = 64 * 1024;
    ASSERT_OK_AND_ASSIGN(o.store, TensorStore::Open(o.volume.get(), so));
    // Refused at Open as another layout (Note [state ownership]), not as a size mismatch.
    EXPECT_THAT(VersionedTrainingState::Open(o.store.get(), o.volume.get(), other),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr("another layout"), HasSubstr("replace_existing"))));
  }
  {
    StateLayout other = Layout();
    other.groups[0].store_parameters = true;  // same sizes, another layout
    Opened o;
    o.volume = *Volume::Open(path.path(), {});
    TensorStoreOptions so;
    so.host_budget_bytes = 64 * 1024;
    ASSERT_OK_AND_ASSIGN(o.store, TensorStore::Open(o.volume.get(), so));
    EXPECT_THAT(VersionedTrainingState::Open(o.store.get(), o.volume.get(), other),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another layout")));
  }
  {
    Opened o;
    Open(path.path(), Layout(), &o, false);
    ASSERT_OK_AND_ASSIGN(auto last, o.state->Resume(1));
    ASSERT_TRUE(last.has_value());
    Expect(o.state.get(), StateKind::kMaster, 5.0f);  // nothing lost to the refusals
  }
}

TEST(VersionedTrainingState, BadArgumentsAreRefused) {
  ScratchPath path("train_state_args");
  Opened o;
  Open(path.path(), Layout(), &o, true);
  CommitRecord r;
  r.version = 2;
  EXPECT_THAT(o.state->Commit(r), StatusIs(absl::StatusCode::kInvalidArgument));
  r.version = 0;
  r.user.assign((1u << 20) + 1, 'x');
  EXPECT_THAT(o.state->Commit(r), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(VersionedTrainingState::Open(nullptr, o.volume.get(), Layout()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // A second owner of the volume in this process (Note [state ownership]), whatever its
  // names, unless both share it on purpose.
  EXPECT_THAT(VersionedTrainingState::Open(o.store.get(), o.volume.get(), Layout()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already in use")));
  VersionedTrainingStateOptions prefixed;
  prefixed.tensor_prefix = "second.";
  prefixed.record_name = "second.record";
  prefixed.share_volume = true;
  // A state in place orders its volume's commits: it shares the volume with no other.
  EXPECT_THAT(VersionedTrainingState::Open(o.store.get(), o.volume.get(), Layout(), prefixed),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot share the volume")));
  prefixed.in_place = false;  // shared states keep two versions
  EXPECT_THAT(VersionedTrainingState::Open(o.store.get(), o.volume.get(), Layout(), prefixed),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already in use")));
  EXPECT_THAT(o.state->ReadOnDevice(StateKind::kParameters, 1, 0, {}),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  o.state.reset();
  o.store.reset();
  TensorStoreOptions so;
  so.host_budget_bytes = 64 * 1024;
  ASSERT_OK_AND_ASSIGN(o.store, TensorStore::Open(o.volume.get(), so));
  VersionedTrainingStateOptions first;
  first.share_volume = true;
  first.in_place = false;
  ASSERT_OK_AND_ASSIGN(
      auto a, VersionedTrainingState::Open(o.store.get(), o.volume.get(), Layout(), first));
  ASSERT_OK_AND_ASSIGN(
      auto b, VersionedTrainingState::Open(o.store.get(), o.volume.get(), Layout(), prefixed));
  // The same names twice in one store.
  EXPECT_THAT(VersionedTrainingState::Open(o.store.get(), o.volume.get(), Layout(), prefixed),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("second.record")));
}

TEST(VersionedTrainingState, AVolumeHoldingAnotherStateIsRefusedUnlessReplaced) {
  ScratchPath path("train_state_owner");
  {
    Opened o;
    Open(path.path(), Layout(), &o, true);
    Fill(o.state.get(), StateKind::kMaster, 5.0f, false);
    ASSERT_OK(o.state->Commit(CommitRecord{}));
  }
  StateLayout mine;
  mine.groups = {{"w", 1000}};
  mine.param_dtype = mine.grad_dtype = DType::kBF16;
  VersionedTrainingStateOptions theirs;
  theirs.record_name = "train.checkpoint";  // another program's record on the same volume
  for (bool replace : {false, true}) {
    auto volume = Volume::Open(path.path(), {});
    ASSERT_OK(volume.status());
    TensorStoreOptions so;
    so.host_budget_bytes = 64 * 1024;
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume->get(), so));
    const std::size_t objects = (*volume)->List().size();
    theirs.replace_existing = replace;
    auto s = VersionedTrainingState::Open(store.get(), volume->get(), mine, theirs);
    if (!replace) {
      EXPECT_THAT(s, StatusIs(absl::StatusCode::kFailedPrecondition,
                              AllOf(HasSubstr("'memascend.train_state'"),
                                    HasSubstr("overwrite=True"), HasSubstr("--force"))));
      EXPECT_EQ((*volume)->List().size(), objects);  // nothing added, nothing removed
      continue;
    }
    ASSERT_OK(s.status());
    for (const ObjectInfo& info : (*volume)->List())
      EXPECT_EQ(info.name.rfind("w.", 0), 0u) << info.name << " left behind";
  }
}

// Note [bounded staging]: at a step's first write of the next version the previous record
// becomes the last one (no record then names the version being written), and the staged
// tensors are committed past the bound: a volume of the state, the bound and the journal
// suffices, and what waits staged stays near the bound.
TEST(VersionedTrainingState, BoundedStagingFitsAVolumeOfTheStateAndTheBound) {
  StateLayout l;
  l.groups = {{"a", 1 << 20, true}, {"b", 1 << 20, true}};
  l.param_dtype = l.grad_dtype = DType::kBF16;
  l.part_elements = 1 << 16;
  const std::uint64_t part_bytes = (1u << 16) * 14;  // master, moments, parameters
  for (std::uint64_t bound : {std::uint64_t{1} << 20, std::uint64_t{0}}) {
    ScratchPath path("train_state_bounded");
    VolumeFormatOptions f;
    // The state, the bound, a part's tensors, 4 MiB of journal and a unit per object.
    f.size = VersionedTrainingState::StoredBytes(l, false) + (4u << 20) + (4u << 20);
    ASSERT_OK(Volume::Format(path.path(), f));
    ASSERT_OK_AND_ASSIGN(auto volume, Volume::Open(path.path(), {}));
    TensorStoreOptions so;
    so.host_budget_bytes = 2 << 20;  // far below a version: evictions stage mid-step
    ASSERT_OK_AND_ASSIGN(auto store, TensorStore::Open(volume.get(), so));
    VersionedTrainingStateOptions vo;
    vo.in_place = false;  // Note [bounded staging]: two versions
    vo.max_staged_bytes = bound;
    ASSERT_OK_AND_ASSIGN(auto state,
                         VersionedTrainingState::Open(store.get(), volume.get(), l, vo));
    std::uint64_t most_staged = 0;
    for (std::uint64_t step = 1; step <= 3; ++step) {
      for (std::size_t g = 0; g < 2; ++g) {
        for (std::size_t p = 0; p < l.Parts(g); ++p) {
          for (StateKind k : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
            ASSERT_OK_AND_ASSIGN(StateBuffer b, state->Update(k, g, p));
            for (float& x : b.as<float>()) x = static_cast<float>(step);
          }
          ASSERT_OK(state->Overwrite(StateKind::kParameters, g, p, true).status());
          most_staged = std::max(most_staged, volume->staged_bytes());
          if (step == 3 && g == 0 && p == 0) {
            // The next version is being written: the previous record no longer names it.
            ASSERT_OK_AND_ASSIGN(ObjectInfo info, volume->Stat("memascend.train_state.previous"));
            std::string bytes(info.size, '\0');
            ASSERT_OK(
                volume->Get(info.name, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()})
                    .status());
            ASSERT_OK_AND_ASSIGN(CommitRecord previous, DecodeCommitRecord(bytes));
            EXPECT_EQ(previous.step, bound != 0 ? 2u : 1u);
          }
        }
      }
      CommitRecord r;
      r.step = step;
      r.version = 1 - state->current_version();
      ASSERT_OK(state->Commit(r));
      ASSERT_OK(state->Settle());
    }
    if (bound != 0) {
      EXPECT_LE(most_staged, bound + 4 * part_bytes);
    }
    ASSERT_OK_AND_ASSIGN(auto last, state->Resume(0));
    ASSERT_TRUE(last.has_value());
    EXPECT_EQ(last->step, 3u);
  }
  // The sizing rule holds what it says: never twice the state.
  EXPECT_LT(VersionedTrainingState::VolumeBytes(l),
            VersionedTrainingState::StoredBytes(l) + (384u << 20));
}

TEST(InMemoryTrainingState, OneVersionUpdatedInPlace) {
  ASSERT_OK_AND_ASSIGN(auto s, InMemoryTrainingState::Create(Layout()));
  Fill(s.get(), StateKind::kExpAvg, 3.0f, false);
  ASSERT_OK_AND_ASSIGN(StateBuffer b, s->Update(StateKind::kExpAvg, 2, 1));
  EXPECT_EQ(b.as<float>()[0], 3.0f + 201.0f);
  ASSERT_OK_AND_ASSIGN(auto none, s->Resume(1));
  EXPECT_FALSE(none.has_value());
  CommitRecord r;
  r.step = 4;
  r.fingerprint = 9;
  ASSERT_OK(s->Commit(r));
  EXPECT_THAT(s->Resume(1), StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK_AND_ASSIGN(auto last, s->Resume(9));
  EXPECT_EQ(last->step, 4u);
  EXPECT_THAT(s->Read(StateKind::kMaster, 3, 0, false), StatusIs(absl::StatusCode::kOutOfRange));
}

}  // namespace
}  // namespace memascend

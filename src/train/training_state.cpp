#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>

#include <memascend/status.h>
#include <memascend/training_state.h>
#include <memascend/volume.h>

#include "prim/os.h"
#include "util/crc32c.h"

namespace memascend {
namespace {

constexpr std::array<StateKind, 5> kKinds = {StateKind::kParameters, StateKind::kGradient,
                                             StateKind::kMaster, StateKind::kExpAvg,
                                             StateKind::kExpAvgSq};
// Versions of a kind on the volume: two of all but the gradients, unless in place.
int Versions(StateKind k, bool in_place) { return in_place || k == StateKind::kGradient ? 1 : 2; }

Use UseOf(StateKind k) {
  switch (k) {
    case StateKind::kParameters:
      return Use::kParameters;
    case StateKind::kGradient:
      return Use::kGradients;
    default:
      return Use::kOptimizerState;
  }
}

bool GoodName(std::string_view name) {
  if (name.empty() || name.size() > 200) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == '-';
  });
}

void Mix(std::uint64_t* h, std::uint64_t v) {
  *h ^= v + 0x9e3779b97f4a7c15ull + (*h << 6) + (*h >> 2);
}

// The record's encoding: magic, format, fixed fields (little-endian), the user's bytes,
// then a CRC-32C of everything before it.
constexpr char kRecordMagic[8] = {'M', 'A', 'T', 'S', 'T', 'A', 'T', 'E'};
constexpr std::uint32_t kRecordFormat = 1;
constexpr std::size_t kMaxUserBytes = 1u << 20;

template <typename T>
void Append(std::string* out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out->append(b, sizeof(T));
}
template <typename T>
bool Take(std::string_view* in, T* v) {
  if (in->size() < sizeof(T)) return false;
  std::memcpy(v, in->data(), sizeof(T));
  in->remove_prefix(sizeof(T));
  return true;
}

// The body of `bytes` between its 8-byte magic and its trailing CRC-32C, both checked;
// kDataLoss naming `what` otherwise.
absl::StatusOr<std::string_view> CheckedBody(std::string_view bytes, const char (&magic)[8],
                                             std::string_view what) {
  const auto bad = [&](std::string_view why) {
    return absl::DataLossError(
        fmt::format("training-state {} ({} bytes) unreadable: {}", what, bytes.size(), why));
  };
  if (bytes.size() < sizeof(magic) + 4 || std::memcmp(bytes.data(), magic, sizeof(magic)) != 0)
    return bad(fmt::format("not a {} (no magic)", what));
  std::uint32_t crc = 0;
  std::memcpy(&crc, bytes.data() + bytes.size() - 4, 4);
  if (crc != util::Crc32c(bytes.data(), bytes.size() - 4)) return bad("checksum mismatch");
  return bytes.substr(sizeof(magic), bytes.size() - sizeof(magic) - 4);
}

// The whole object `name` of `volume`; nullopt when there is none.
absl::StatusOr<std::optional<std::string>> ReadObject(ObjectStore* volume,
                                                      const std::string& name) {
  auto info = volume->Stat(name);
  if (!info.ok()) {
    if (info.status().code() == absl::StatusCode::kNotFound) return std::nullopt;
    return info.status();
  }
  std::string bytes(info->size, '\0');
  MEMASCEND_RETURN_IF_ERROR(
      volume->Get(name, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()}).status());
  return bytes;
}

}  // namespace

std::string_view ToString(StateKind k) noexcept {
  switch (k) {
    case StateKind::kParameters:
      return "param";
    case StateKind::kGradient:
      return "grad";
    case StateKind::kMaster:
      return "master";
    case StateKind::kExpAvg:
      return "exp_avg";
    case StateKind::kExpAvgSq:
      return "exp_avg_sq";
  }
  return "?";
}

// ---- StateLayout ------------------------------------------------------------------------

absl::Status StateLayout::Validate() const {
  if (groups.empty()) return absl::InvalidArgumentError("state layout: no groups");
  if (part_elements == 0) return absl::InvalidArgumentError("state layout: zero part size");
  const auto floating = [](DType d) {
    return d == DType::kF16 || d == DType::kBF16 || d == DType::kF32;
  };
  if (!floating(param_dtype))
    return absl::InvalidArgumentError("state layout: bad parameter dtype");
  if (!floating(grad_dtype)) return absl::InvalidArgumentError("state layout: bad gradient dtype");
  // Bounds that keep every byte count of the state (16 bytes an element at most, summed
  // over the groups) and every walk over its parts finite: a count from a negative
  // int64 (2^63 and more) hung in the walk over its parts or aborted in an allocation.
  constexpr std::uint64_t kMostElements = std::uint64_t{1} << 48;  // 256 T
  constexpr std::uint64_t kMostParts = std::uint64_t{1} << 28;
  std::uint64_t elements = 0, parts = 0;
  std::vector<std::string_view> names;
  for (const StateGroup& g : groups) {
    if (!GoodName(g.name)) {
      return absl::InvalidArgumentError(
          fmt::format("state layout: group name '{}' is not 1..200 of [A-Za-z0-9_.-]", g.name));
    }
    if (g.elements == 0)
      return absl::InvalidArgumentError(fmt::format("state layout: group '{}' is empty", g.name));
    if (g.elements > kMostElements - elements) {
      return absl::InvalidArgumentError(fmt::format(
          "state layout: group '{}' of {} elements makes the state over 2^48 elements (a "
          "count gone negative?)",
          g.name, g.elements));
    }
    elements += g.elements;
    parts += g.elements / part_elements + 1;
    if (parts > kMostParts) {
      return absl::InvalidArgumentError(fmt::format(
          "state layout: over 2^28 parts of {} elements at group '{}': a larger part_elements",
          part_elements, g.name));
    }
    names.push_back(g.name);
  }
  std::sort(names.begin(), names.end());
  if (auto dup = std::adjacent_find(names.begin(), names.end()); dup != names.end())
    return absl::InvalidArgumentError(fmt::format("state layout: group '{}' twice", *dup));
  return absl::OkStatus();
}

std::size_t StateLayout::Parts(std::size_t group) const {
  const std::size_t n = groups[group].elements;
  return part_elements >= n ? 1 : (n + part_elements - 1) / part_elements;
}

std::pair<std::size_t, std::size_t> StateLayout::PartRange(std::size_t group,
                                                           std::size_t part) const {
  const std::size_t n = groups[group].elements;
  if (part_elements >= n) return {0, n};
  return {std::min(n, part * part_elements), std::min(n, (part + 1) * part_elements)};
}

std::size_t StateLayout::ElementBytes(StateKind k) const {
  if (k == StateKind::kParameters) return SizeOf(param_dtype);
  if (k == StateKind::kGradient) return SizeOf(grad_dtype);
  return 4;
}

bool StateLayout::Stored(StateKind k, std::size_t group) const {
  return k != StateKind::kParameters || groups[group].store_parameters;
}

std::size_t StateLayout::MaxGroupElements() const {
  std::size_t n = 0;
  for (const StateGroup& g : groups) n = std::max(n, g.elements);
  return n;
}

std::size_t StateLayout::MaxPartElements() const {
  return std::min(MaxGroupElements(), part_elements);
}

std::uint64_t StateLayout::TotalElements() const {
  std::uint64_t n = 0;
  for (const StateGroup& g : groups) n += g.elements;
  return n;
}

std::uint64_t StateLayout::Fingerprint() const {
  std::uint64_t h = 1469598103934665603ull;
  for (const StateGroup& g : groups) {
    for (char c : g.name) Mix(&h, static_cast<unsigned char>(c));
    Mix(&h, g.elements);
    Mix(&h, g.store_parameters ? 1 : 0);
  }
  Mix(&h, static_cast<std::uint64_t>(param_dtype));
  Mix(&h, static_cast<std::uint64_t>(grad_dtype));
  Mix(&h, part_elements == SIZE_MAX ? ~0ull : part_elements);
  return h;
}

// ---- LayoutShard (Note [layout shards]) --------------------------------------------------

absl::StatusOr<LayoutShard> ShardLayout(const StateLayout& whole, int rank, int world) {
  MEMASCEND_RETURN_IF_ERROR(whole.Validate());
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        fmt::format("layout shard: rank {} of a world of {} ranks", rank, world));
  }
  LayoutShard s;
  s.rank = rank;
  s.world = world;
  s.layout.param_dtype = whole.param_dtype;
  s.layout.grad_dtype = whole.grad_dtype;
  s.layout.part_elements = whole.part_elements;
  // Each part's rank, in order: the one whose share of the elements holds its middle, then
  // held to a run without gaps in which every rank gets a part (given enough parts).
  std::size_t parts = 0;
  for (std::size_t g = 0; g < whole.groups.size(); ++g) parts += whole.Parts(g);
  if (parts < static_cast<std::size_t>(world)) {
    return absl::InvalidArgumentError(fmt::format(
        "layout shard: {} parts of up to {} elements cannot be shared among {} ranks (some "
        "would own none); use smaller parts",
        parts, whole.MaxPartElements(), world));
  }
  const auto total = static_cast<double>(whole.TotalElements());
  std::uint64_t before = 0;  // elements of the whole before the part in hand
  std::size_t index = 0;     // of the part in hand, in order
  int previous = 0;
  for (std::size_t g = 0; g < whole.groups.size(); ++g) {
    std::vector<int>& owners = s.owner.emplace_back();
    std::pair<std::size_t, std::size_t> mine{0, 0};
    for (std::size_t part = 0; part < whole.Parts(g); ++part, ++index) {
      const auto [begin, end] = whole.PartRange(g, part);
      const double middle = static_cast<double>(before + (end - begin) / 2);
      int r = std::min(world - 1, static_cast<int>(middle / total * world));
      r = std::clamp(r, previous, index == 0 ? 0 : previous + 1);
      r = std::max(r, world - static_cast<int>(std::min<std::size_t>(parts - index, world)));
      owners.push_back(previous = r);
      if (r == rank) mine = {mine.second == mine.first ? begin : mine.first, end};
      before += end - begin;
    }
    s.range.push_back(mine);
    if (mine.second > mine.first) {
      s.local.emplace_back(s.layout.groups.size());
      s.layout.groups.push_back(
          {whole.groups[g].name, mine.second - mine.first, whole.groups[g].store_parameters});
    } else {
      s.local.emplace_back(std::nullopt);
    }
  }
  return s;
}

// ---- CommitRecord -----------------------------------------------------------------------

std::string EncodeCommitRecord(const CommitRecord& r) {
  std::string out(kRecordMagic, sizeof(kRecordMagic));
  Append(&out, kRecordFormat);
  Append(&out, r.step);
  Append(&out, static_cast<std::int32_t>(r.version));
  Append(&out, r.adam_step);
  Append(&out, r.scaler.scale);
  Append(&out, r.scaler.good_steps);
  Append(&out, static_cast<std::int32_t>(r.scaler.hysteresis_left));
  Append(&out, r.scaler.skipped);
  Append(&out, r.fingerprint);
  Append(&out, r.layout);
  Append(&out, static_cast<std::uint64_t>(r.user.size()));
  out += r.user;
  Append(&out, util::Crc32c(out.data(), out.size()));
  return out;
}

absl::StatusOr<CommitRecord> DecodeCommitRecord(std::string_view bytes) {
  const auto bad = [&](std::string_view why) {
    return absl::DataLossError(
        fmt::format("training-state commit record ({} bytes) unreadable: {}", bytes.size(), why));
  };
  MEMASCEND_ASSIGN_OR_RETURN(std::string_view in,
                             CheckedBody(bytes, kRecordMagic, "commit record"));
  CommitRecord r;
  std::uint32_t format = 0;
  std::int32_t version = 0, hysteresis = 0;
  std::uint64_t user = 0;
  if (!Take(&in, &format) || format != kRecordFormat) return bad("unknown format");
  if (!Take(&in, &r.step) || !Take(&in, &version) || !Take(&in, &r.adam_step) ||
      !Take(&in, &r.scaler.scale) || !Take(&in, &r.scaler.good_steps) || !Take(&in, &hysteresis) ||
      !Take(&in, &r.scaler.skipped) || !Take(&in, &r.fingerprint) || !Take(&in, &r.layout) ||
      !Take(&in, &user))
    return bad("truncated");
  if (user != in.size() || user > kMaxUserBytes) return bad("user bytes do not fit");
  if (version != 0 && version != 1) return bad(fmt::format("version {}", version));
  r.version = version;
  r.scaler.hysteresis_left = hysteresis;
  r.user.assign(in.data(), in.size());
  return r;
}

// ---- InMemoryTrainingState --------------------------------------------------------------

InMemoryTrainingState::InMemoryTrainingState(StateLayout layout) : layout_(std::move(layout)) {
  state_.resize(kKinds.size());
  for (StateKind k : kKinds) {
    for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
      state_[static_cast<int>(k)].emplace_back(layout_.groups[g].elements *
                                               layout_.ElementBytes(k));
    }
  }
}

absl::StatusOr<std::unique_ptr<InMemoryTrainingState>> InMemoryTrainingState::Create(
    const StateLayout& layout) {
  MEMASCEND_RETURN_IF_ERROR(layout.Validate());
  return std::unique_ptr<InMemoryTrainingState>(new InMemoryTrainingState(layout));
}

absl::StatusOr<StateBuffer> InMemoryTrainingState::At(StateKind k, std::size_t g,
                                                      std::size_t part) {
  if (g >= layout_.groups.size() || part >= layout_.Parts(g))
    return absl::OutOfRangeError(fmt::format("group {} part {}: no such part", g, part));
  auto& v = state_[static_cast<int>(k)][g];
  const auto [begin, end] = layout_.PartRange(g, part);
  StateBuffer b;
  b.data = v.data() + begin * layout_.ElementBytes(k);
  b.bytes = (end - begin) * layout_.ElementBytes(k);
  return b;
}
absl::StatusOr<StateBuffer> InMemoryTrainingState::Read(StateKind k, std::size_t g,
                                                        std::size_t part, bool) {
  return At(k, g, part);
}
absl::StatusOr<StateBuffer> InMemoryTrainingState::Overwrite(StateKind k, std::size_t g,
                                                             std::size_t part, bool) {
  return At(k, g, part);
}
absl::StatusOr<StateBuffer> InMemoryTrainingState::Update(StateKind k, std::size_t g,
                                                          std::size_t part) {
  return At(k, g, part);
}
absl::Status InMemoryTrainingState::Commit(const CommitRecord& r) {
  committed_ = r;
  committed_->layout = layout_.Fingerprint();
  return absl::OkStatus();
}
absl::StatusOr<std::optional<CommitRecord>> TrainingStateStorage::ResumeAtMost(
    std::uint64_t fingerprint, std::uint64_t step) {
  MEMASCEND_ASSIGN_OR_RETURN(std::optional<CommitRecord> last, Resume(fingerprint));
  if (last.has_value() && last->step > step) {
    return absl::FailedPreconditionError(fmt::format(
        "this training state keeps only its last commit (step {}), not step {}", last->step, step));
  }
  return last;
}

absl::StatusOr<std::optional<CommitRecord>> InMemoryTrainingState::Resume(
    std::uint64_t fingerprint) {
  if (committed_.has_value() && committed_->fingerprint != fingerprint)
    return absl::FailedPreconditionError("the training state belongs to another run");
  return committed_;
}

// ---- VersionedTrainingState -------------------------------------------------------------

namespace {

constexpr const char* kRecordMetadata = "memascend training state";
constexpr const char* kProgressMetadata = "memascend training step";

// What a record names as its layout: the layout's fingerprint, and whether it is in place
// (a state in two versions has other tensors).
std::uint64_t LayoutId(const StateLayout& layout, bool in_place) {
  std::uint64_t h = layout.Fingerprint();
  if (in_place) Mix(&h, 0x1ace);
  return h;
}

// The progress object of a step updated in place (Note [state in place]): magic, the
// parts done, the intent's commit record and redo bytes (each with its length), CRC-32C.
constexpr char kProgressMagic[8] = {'M', 'A', 'S', 'T', 'E', 'P', '0', '1'};

std::string EncodeProgress(const StepIntent& intent, std::uint64_t done) {
  std::string out(kProgressMagic, sizeof(kProgressMagic));
  Append(&out, done);
  const std::string record = EncodeCommitRecord(intent.record);
  Append(&out, static_cast<std::uint64_t>(record.size()));
  out += record;
  Append(&out, static_cast<std::uint64_t>(intent.redo.size()));
  out += intent.redo;
  Append(&out, util::Crc32c(out.data(), out.size()));
  return out;
}

absl::StatusOr<UnfinishedStep> DecodeProgress(std::string_view bytes) {
  const auto bad = [&](std::string_view why) {
    return absl::DataLossError(
        fmt::format("training-state progress object ({} bytes) unreadable: {}", bytes.size(), why));
  };
  MEMASCEND_ASSIGN_OR_RETURN(std::string_view in,
                             CheckedBody(bytes, kProgressMagic, "progress object"));
  UnfinishedStep u;
  std::uint64_t done = 0, record = 0, redo = 0;
  if (!Take(&in, &done) || !Take(&in, &record) || record > in.size()) return bad("truncated");
  MEMASCEND_ASSIGN_OR_RETURN(u.intent.record, DecodeCommitRecord(in.substr(0, record)));
  in.remove_prefix(record);
  if (!Take(&in, &redo) || redo != in.size()) return bad("truncated");
  u.intent.redo.assign(in.data(), in.size());
  u.parts_done = done;
  return u;
}

// Note [state ownership]: the training states open in this process, by volume.
struct OpenStates {
  std::mutex mu;
  // volume -> (record_name, share_volume)
  std::multimap<const ObjectStore*, std::pair<std::string, bool>> records;
};
OpenStates& Registry() {
  static OpenStates* r = new OpenStates();  // never destroyed: states may outlive statics
  return *r;
}

// Whether `name` is a tensor of some training state: "<anything>.<kind>.p<N>[.v0|.v1]".
bool IsStateTensorName(std::string_view name) {
  std::size_t end = name.size();
  if (end > 3 && name[end - 3] == '.' && name[end - 2] == 'v' &&
      (name[end - 1] == '0' || name[end - 1] == '1'))
    end -= 3;
  std::size_t digits = end;
  while (digits > 0 && name[digits - 1] >= '0' && name[digits - 1] <= '9') --digits;
  if (digits == end || digits < 2 || name[digits - 1] != 'p' || name[digits - 2] != '.')
    return false;
  const std::string_view head = name.substr(0, digits - 2);
  for (StateKind k : kKinds) {
    const std::string suffix = "." + std::string(ToString(k));
    if (head.size() > suffix.size() && head.substr(head.size() - suffix.size()) == suffix)
      return true;
  }
  return false;
}

}  // namespace

struct VersionedTrainingState::Impl {
  TensorStore* store = nullptr;
  ObjectStore* volume = nullptr;
  VersionedTrainingStateOptions options;
  // [kind][group][part * versions + version]
  std::array<std::vector<std::vector<TensorId>>, kKinds.size()> ids;
  std::array<std::vector<std::vector<std::string>>, kKinds.size()> names;  // the ids' objects
  std::thread committer;       // the commit in progress (Note [background commit])
  absl::Status commit_status;  // the last commit's; written by committer before it ends
  std::string last_record;     // as stored: the one a commit keeps as the previous
  bool writing_next = false;   // this step wrote the next version (Note [bounded staging])
  bool previous_written = false;
  // Note [state in place]: the parts in layout order, and the step being updated.
  std::vector<std::pair<std::size_t, std::size_t>> order;
  std::uint64_t state_bytes = 0;     // of every part's kinds but the gradient
  std::uint64_t largest_part = 0;    // the most a part's kinds but the gradient take
  std::optional<StepIntent> intent;  // the step being updated, once BeginUpdate ran
  bool batched = false;              // its parts are committed in batches
  std::size_t done = 0;              // parts updated, in order
  std::size_t batch_from = 0;        // the first part not yet committed
  std::size_t committed = 0;         // the first part not known durable
  std::uint64_t since_batch = 0;     // bytes of the parts updated since
  std::uint64_t batch_bytes = 0;     // a batch commits past this (Note [batch overlap])
  bool batch_overlap = false;        // and in the background
  // Note [commit interval]: steps committed in memory since the last durable one.
  std::uint64_t deferred = 0;
  std::uint64_t durable_step = 0;            // known durable (a commit settled)
  std::uint64_t committing_step = 0;         // of the commit in flight, durable once it settles
  std::uint64_t last_step = 0;               // last_record's step
  std::optional<UnfinishedStep> unfinished;  // found by Resume
  // Note [gradient write-behind]: the gradients queued and perhaps not written yet, with
  // their bytes, and whether the commit in flight is a drain of them.
  std::vector<std::pair<TensorId, std::uint64_t>> behind;
  std::uint64_t behind_bytes = 0;
  bool draining = false;
  std::uint64_t drain_bytes = 0;           // what the drain in flight commits, at most
  std::vector<TensorId> drain_ids;         // and the gradients it writes
  std::uint64_t commit_bytes = 0;          // what the step's commit in flight may stage yet
  std::atomic<bool> committer_done{true};  // the committer's work ended (not yet joined)

  // A part's kinds but the gradient (or its gradient alone), in the volume's 64 KiB units
  // (what staging them takes).
  std::uint64_t PartBytes(const StateLayout& l, std::size_t g, std::size_t part,
                          bool gradient = false) const {
    constexpr std::uint64_t kUnit = 64 * 1024;
    const auto [begin, end] = l.PartRange(g, part);
    std::uint64_t b = 0;
    for (StateKind k : kKinds) {
      if ((k == StateKind::kGradient) == gradient && l.Stored(k, g))
        b += ((end - begin) * l.ElementBytes(k) + kUnit - 1) / kUnit * kUnit;
    }
    return b;
  }
};

VersionedTrainingState::VersionedTrainingState(std::unique_ptr<Impl> impl, StateLayout layout)
    : layout_(std::move(layout)), impl_(std::move(impl)) {}

VersionedTrainingState::~VersionedTrainingState() {
  (void)Settle();
  // Note [state in place]: a step left half updated (an error, or a caller that stopped)
  // is committed as torn, for Resume to finish, before the store's own commit at its close
  // could commit its parts without their progress object.
  Impl& m = *impl_;
  absl::Status final_commit = absl::OkStatus();
  if (m.options.in_place && m.intent.has_value() && m.done > m.committed) {
    // A batch that failed (its error is the state's) is committed again with the rest:
    // a failed commit leaves what it wrote staged, and writing it back again is harmless.
    m.commit_status = absl::OkStatus();
    m.batch_from = m.committed;
    if (!m.batched && m.deferred > 0) {
      // Note [commit interval]: the parts not yet updated hold the steps committed in
      // memory, whose record this commit carries.
      final_commit = WriteBackParts(m.done, m.order.size(), false);
      if (final_commit.ok()) {
        final_commit = m.volume->PutStaged(
            m.options.record_name,
            {reinterpret_cast<const std::byte*>(m.last_record.data()), m.last_record.size()},
            kRecordMetadata);
      }
    }
    if (final_commit.ok() && !m.batched)
      final_commit = WriteBackParts(m.done, m.order.size(), true);
    if (final_commit.ok()) final_commit = CommitBatch(false);  // one journal commit
  } else if (m.options.in_place && m.deferred > 0 && m.commit_status.ok()) {
    final_commit = CommitWhole(m.last_record, m.last_step, false);
  }
  // Note [commit when full] in tensor_store.h: after a failed last commit the store's close
  // commits nothing either (the volume keeps the last durable step, or the torn one a
  // progress object names); after a good one it may again.
  if (m.options.in_place && final_commit.ok() && m.commit_status.ok()) {
    m.store->SetCommitAtClose(true);
  } else if (m.options.in_place) {
    // What the failed commits left (parts of steps the volume's record does not name,
    // dirty in the store or staged on the volume) is forgotten, so that no later commit
    // on this volume (a Flush of the store, another state's) carries it.
    std::vector<TensorId> ids;
    std::vector<std::string> names = {m.options.record_name, ProgressName()};
    for (bool gradient : {false, true})
      (void)PartTensors(0, m.order.size(), gradient, &ids, &names);
    for (TensorId id : ids) (void)m.store->Discard(id);
    (void)m.volume->DropStaged(names);
  }
  {  // every state Open made is in Registry() (Note [state ownership])
    OpenStates& r = Registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto [first, last] = r.records.equal_range(impl_->volume);
    for (auto it = first; it != last; ++it) {
      if (it->second.first == impl_->options.record_name) {
        r.records.erase(it);
        break;
      }
    }
  }
}

std::uint64_t VersionedTrainingState::StoredBytes(const StateLayout& layout, bool in_place) {
  constexpr std::uint64_t kUnit = 64 * 1024;
  std::uint64_t need = 0;
  for (StateKind k : kKinds) {
    for (std::size_t g = 0; g < layout.groups.size(); ++g) {
      if (!layout.Stored(k, g)) continue;
      for (std::size_t part = 0; part < layout.Parts(g); ++part) {
        const auto [begin, end] = layout.PartRange(g, part);
        const std::uint64_t bytes = (end - begin) * layout.ElementBytes(k);
        need += Versions(k, in_place) * ((bytes + kUnit - 1) / kUnit * kUnit);
      }
    }
  }
  return need;
}

std::uint64_t VersionedTrainingState::DataBytes(const StateLayout& layout,
                                                const VersionedTrainingStateOptions& options) {
  constexpr std::uint64_t kUnit = 64 * 1024;
  const auto round = [](std::uint64_t b) { return (b + kUnit - 1) / kUnit * kUnit; };
  // One version's bytes; the largest part's tensors. In place, the gradients are written
  // back too (Note [state in place]).
  std::uint64_t version = 0, part = 0;
  for (std::size_t g = 0; g < layout.groups.size(); ++g) {
    for (std::size_t p = 0; p < layout.Parts(g); ++p) {
      const auto [begin, end] = layout.PartRange(g, p);
      std::uint64_t here = 0;
      for (StateKind k : kKinds) {
        if (layout.Stored(k, g) && (options.in_place || k != StateKind::kGradient))
          here += round((end - begin) * layout.ElementBytes(k));
      }
      version += here;
      part = std::max(part, here);
    }
  }
  // Never more than a version: a tensor staged again replaces its staged copy.
  const std::uint64_t in_flight = options.max_staged_bytes == 0
                                      ? version
                                      : std::min(version, round(options.max_staged_bytes) + part);
  return StoredBytes(layout, options.in_place) + in_flight;
}

std::uint64_t VersionedTrainingState::VolumeBytes(const StateLayout& layout,
                                                  const VersionedTrainingStateOptions& options) {
  constexpr std::uint64_t kUnit = 64 * 1024;
  const std::uint64_t data = DataBytes(layout, options);
  // Volume::Format's journal: capacity / 512 in [2 MiB, 256 MiB].
  const std::uint64_t journal =
      std::clamp<std::uint64_t>(data / 511, std::uint64_t{2} << 20, std::uint64_t{256} << 20);
  // The records' room (a commit record holds up to 1 MiB of the caller's bytes, and the
  // progress object as much again); free space cannot fragment a part (an object may take
  // up to kMaxExtents extents).
  return (data + journal + (std::uint64_t{16} << 20) + kUnit - 1) / kUnit * kUnit;
}

absl::StatusOr<std::unique_ptr<VersionedTrainingState>> VersionedTrainingState::Open(
    TensorStore* store, ObjectStore* volume, const StateLayout& layout,
    const VersionedTrainingStateOptions& requested) {
  if (store == nullptr || volume == nullptr)
    return absl::InvalidArgumentError("versioned training state: null store or volume");
  MEMASCEND_RETURN_IF_ERROR(layout.Validate());
  if (requested.record_name.empty())
    return absl::InvalidArgumentError("versioned training state: empty record name");
  if (requested.in_place && requested.share_volume) {
    return absl::InvalidArgumentError(
        "versioned training state: a state updated in place orders its volume's commits "
        "(Note [state in place]) and cannot share the volume: in_place false, or a volume "
        "of its own");
  }
  // Note [commit interval].
  if (requested.commit_every < 1 || requested.commit_every > 1'000'000) {
    return absl::InvalidArgumentError(fmt::format(
        "versioned training state: commit_every {} is out of range [1, 1000000] (1: every step "
        "durable)",
        requested.commit_every));
  }
  if (requested.commit_every > 1 && (!requested.in_place || requested.max_staged_bytes != 0)) {
    return absl::InvalidArgumentError(fmt::format(
        "versioned training state: commit_every {} needs a state in place with max_staged_bytes "
        "0 (the steps in between are staged whole, never committed in batches: Note [commit "
        "interval]); this one is {}",
        requested.commit_every,
        requested.in_place ? fmt::format("bounded at {} bytes", requested.max_staged_bytes)
                           : std::string("in two versions")));
  }
  VersionedTrainingStateOptions options = requested;
  if (options.in_place) {
    // A volume written in two versions (an earlier release, or a state opened so) goes on
    // in two versions: its record says which, by its layout id.
    if (auto bytes = ReadObject(volume, options.record_name); bytes.ok() && bytes->has_value()) {
      auto r = DecodeCommitRecord(**bytes);
      if (r.ok() && r->layout == LayoutId(layout, false)) options.in_place = false;
      if (!options.in_place && options.commit_every > 1) {
        return absl::FailedPreconditionError(fmt::format(
            "versioned training state: the volume holds '{}' in two versions (an earlier "
            "release's), which commits every step; commit_every {} needs a state in place: "
            "commit_every 1, or a new volume",
            options.record_name, options.commit_every));
      }
    }
  }
  auto impl = std::make_unique<Impl>();
  impl->store = store;
  impl->volume = volume;
  impl->options = options;
  // Note [state ownership]: one state of a record name per volume in this process, and,
  // unless shared, no other state's record or tensors on the volume.
  OpenStates& registry = Registry();
  std::unique_lock<std::mutex> lock(registry.mu);
  {
    auto [first, last] = registry.records.equal_range(volume);
    for (auto it = first; it != last; ++it) {
      if (it->second.first == options.record_name || !options.share_volume || !it->second.second) {
        return absl::FailedPreconditionError(fmt::format(
            "the volume is already in use by a training state open in this process (record "
            "'{}'): close it first, or give each state a volume of its own",
            it->second.first));
      }
    }
  }
  std::set<std::string> ours;
  const auto versions = [&](StateKind k) { return Versions(k, options.in_place); };
  const auto tensor_name = [&](StateKind k, std::size_t g, std::size_t part, int v) {
    return fmt::format("{}{}.{}.p{}{}", options.tensor_prefix, layout.groups[g].name, ToString(k),
                       part, versions(k) == 2 ? fmt::format(".v{}", v) : "");
  };
  for (StateKind k : kKinds) {
    for (std::size_t g = 0; g < layout.groups.size(); ++g) {
      if (!layout.Stored(k, g)) continue;
      for (std::size_t part = 0; part < layout.Parts(g); ++part) {
        for (int v = 0; v < versions(k); ++v) ours.insert(tensor_name(k, g, part, v));
      }
    }
  }
  {
    const std::string previous = options.record_name + ".previous";
    std::vector<std::string> foreign;  // what another state left: records, then tensors
    std::string why, tensors_why;
    for (const ObjectInfo& o : volume->List()) {
      if (o.metadata == kProgressMetadata) {
        // A step in progress: this record's (checked by Resume), or another state's.
        if (o.name != options.record_name + ".step" && !options.share_volume) {
          if (why.empty()) why = fmt::format("another training state's step, '{}'", o.name);
          foreign.insert(foreign.begin(), o.name);
        }
      } else if (o.metadata == kRecordMetadata) {
        if (o.name == options.record_name || o.name == previous) {
          // Ours by name: of this layout, or another one (a changed model or part size).
          std::string bytes(o.size, '\0');
          auto got =
              volume->Get(o.name, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()});
          auto r =
              got.ok() ? DecodeCommitRecord(bytes) : absl::StatusOr<CommitRecord>(got.status());
          if (r.ok() && r->layout == LayoutId(layout, options.in_place)) continue;
          if (why.empty()) {
            why = r.ok() ? fmt::format(
                               "the training state '{}' of another layout (groups, sizes, "
                               "dtypes or part size), at step {}",
                               o.name, r->step)
                         : fmt::format("the training state '{}', unreadable: {}", o.name,
                                       std::string(r.status().message()));
          }
          foreign.insert(foreign.begin(), o.name);
        } else if (!options.share_volume) {
          if (why.empty()) why = fmt::format("another training state, '{}'", o.name);
          foreign.insert(foreign.begin(), o.name);
        }
      } else if (!options.share_volume && IsStateTensorName(o.name) && !ours.count(o.name)) {
        if (tensors_why.empty())
          tensors_why = fmt::format("another training state's tensors ('{}')", o.name);
        foreign.push_back(o.name);
      }
    }
    if (why.empty()) why = tensors_why;  // a record says more than a tensor
    if (!foreign.empty() && !options.replace_existing) {
      return absl::FailedPreconditionError(
          fmt::format("the volume holds {} ({} object{} in all): give this training state a volume "
                      "of its own, or "
                      "replace what it holds (Python: overwrite=True; C++: "
                      "VersionedTrainingStateOptions::replace_existing; memascend-train: --force)",
                      why, foreign.size(), foreign.size() == 1 ? "" : "s"));
    }
    if (!foreign.empty()) {
      // Replacing: what was found goes, records first (no record ever names a tensor that
      // is gone); this record's state of another layout takes its tensors with it.
      if (std::find(foreign.begin(), foreign.end(), options.record_name) != foreign.end()) {
        for (const ObjectInfo& o : volume->List()) {
          if (ours.count(o.name) || o.name == options.record_name + ".step")
            foreign.push_back(o.name);
        }
      }
      for (const std::string& name : foreign) MEMASCEND_RETURN_IF_ERROR(volume->Delete(name));
      MEMASCEND_RETURN_IF_ERROR(volume->Sync());
    }
  }
  // Note [commit interval]: a volume made for a bounded state (an earlier run's) may lack
  // the room to stage a whole version, as a state in place unbounded does (commit_every
  // above 1, or max_staged_bytes 0); refused here, not by a write mid-step.
  if (const auto* v = dynamic_cast<const Volume*>(volume);
      v != nullptr && options.in_place && options.max_staged_bytes == 0) {
    const std::uint64_t unit = std::max<std::uint64_t>(1, v->stats().unit_bytes);
    std::uint64_t present = 0;  // what the state's tensors already take
    for (const ObjectInfo& o : volume->List())
      if (ours.count(o.name)) present += (o.size + unit - 1) / unit * unit;
    const std::uint64_t need = DataBytes(layout, options);
    const std::uint64_t room = v->stats().free_bytes + present;
    if (room < need) {
      return absl::ResourceExhaustedError(fmt::format(
          "versioned training state: unbounded (commit_every {}, max_staged_bytes 0), it "
          "stages up to a whole version, and the volume has {} bytes for the state where it "
          "needs {} (VolumeBytes with max_staged_bytes 0): a larger volume (a new one is made "
          "so), or commit_every 1 with a bound (staging bounded)",
          options.commit_every, room, need));
    }
  }
  for (StateKind k : kKinds) {
    auto& ids = impl->ids[static_cast<int>(k)];
    auto& names = impl->names[static_cast<int>(k)];
    ids.resize(layout.groups.size());
    names.resize(layout.groups.size());
    for (std::size_t g = 0; g < layout.groups.size(); ++g) {
      if (!layout.Stored(k, g)) continue;
      for (std::size_t part = 0; part < layout.Parts(g); ++part) {
        for (int v = 0; v < versions(k); ++v) {
          const auto [begin, end] = layout.PartRange(g, part);
          TensorSpec spec;
          spec.name = tensor_name(k, g, part, v);
          spec.dtype = k == StateKind::kParameters ? layout.param_dtype
                       : k == StateKind::kGradient ? layout.grad_dtype
                                                   : DType::kF32;
          spec.bytes = (end - begin) * layout.ElementBytes(k);
          spec.shape = {static_cast<std::int64_t>(end - begin)};
          spec.use = UseOf(k);
          // In place, the gradients are the redo record: durable (Note [state in place]).
          spec.durability =
              versions(k) == 2 || options.in_place ? Durability::kDurable : Durability::kScratch;
          MEMASCEND_ASSIGN_OR_RETURN(TensorId id, store->Register(spec));
          ids[g].push_back(id);
          names[g].push_back(spec.name);
        }
      }
    }
  }
  if (options.in_place) {
    for (std::size_t g = 0; g < layout.groups.size(); ++g) {
      for (std::size_t part = 0; part < layout.Parts(g); ++part) {
        impl->order.emplace_back(g, part);
        const std::uint64_t bytes = impl->PartBytes(layout, g, part);
        impl->state_bytes += bytes;
        impl->largest_part = std::max(impl->largest_part, bytes);
      }
    }
    store->SetCommitWhenFull(false);  // only the state's commits (Note [state in place])
    store->SetCommitAtClose(false);   // and the last one too (Note [commit interval])
  }
  registry.records.emplace(volume, std::make_pair(options.record_name, options.share_volume));
  return std::unique_ptr<VersionedTrainingState>(
      new VersionedTrainingState(std::move(impl), layout));
}

absl::StatusOr<TensorId> VersionedTrainingState::Tensor(StateKind k, std::size_t g,
                                                        std::size_t part, int version) const {
  if (g >= layout_.groups.size() || part >= layout_.Parts(g) || (version != 0 && version != 1))
    return absl::OutOfRangeError(
        fmt::format("group {} part {} version {}: no such part", g, part, version));
  if (!layout_.Stored(k, g))
    return absl::NotFoundError(
        fmt::format("{} of group '{}' are not stored", ToString(k), layout_.groups[g].name));
  const int versions = Versions(k, impl_->options.in_place);
  return impl_->ids[static_cast<int>(k)][g][part * static_cast<std::size_t>(versions) +
                                            static_cast<std::size_t>(versions == 2 ? version : 0)];
}

namespace {
StateBuffer Wrap(TensorLease lease) {
  StateBuffer b;
  b.data = lease.data();
  b.bytes = lease.size();
  b.hold = std::make_shared<TensorLease>(std::move(lease));
  return b;
}
}  // namespace

absl::StatusOr<StateBuffer> VersionedTrainingState::Read(StateKind k, std::size_t g,
                                                         std::size_t part, bool next) {
  MEMASCEND_ASSIGN_OR_RETURN(TensorId id, Tensor(k, g, part, next ? 1 - current_ : current_));
  // A read lease: a part being written back by a commit is read at once (Note [reads
  // during write-back] in tensor_store.h).
  MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease, impl_->store->AcquireForRead(id));
  return Wrap(std::move(lease));
}

// Note [bounded staging]: before the step's first write of the next version, the last
// record becomes the previous; after, what waits staged is committed past the bound.
absl::Status VersionedTrainingState::WritingNext() {
  MEMASCEND_RETURN_IF_ERROR(Settle());  // the old version is about to be written
  Impl& m = *impl_;
  if (m.options.max_staged_bytes == 0) return absl::OkStatus();
  if (!m.writing_next) {
    m.writing_next = true;
    if (!m.last_record.empty()) {
      MEMASCEND_RETURN_IF_ERROR(PutRecord(PreviousName(), m.last_record));
      m.previous_written = true;
    }
  }
  if (m.volume->staged_bytes() > m.options.max_staged_bytes)
    MEMASCEND_RETURN_IF_ERROR(m.volume->Sync());
  return absl::OkStatus();
}

// Note [state in place]: what waits for a write in place. The previous commit, but for a
// gradient; in the backward pass, a commit of the gradients written back past the bound,
// after the previous commit (the state on the volume is whole then, so committing
// gradients is safe).
// Outside a step (the gradients of the backward pass; Initialize and WriteState), writes
// staged past the bound are committed too; a step's own writes (Update, Overwrite of the
// next version) come between BeginUpdate and Commit only, whose commits the state orders.
absl::Status VersionedTrainingState::WritingInPlace(StateKind k, bool step_write) {
  Impl& m = *impl_;
  // Inside a step the only commit in flight is a batch's (BeginUpdate settled the last
  // step's), which the parts still to update need not wait for (Note [batch overlap]).
  if (m.intent.has_value()) return absl::OkStatus();
  // Unbounded, the gradients are no redo record (no step is committed in batches) and
  // nothing commits them but the state's commit, which writes back the other kinds: the
  // backward pass need not wait for it (Note [commit interval]).
  if (k == StateKind::kGradient && m.options.max_staged_bytes == 0) return absl::OkStatus();
  if (k == StateKind::kGradient && !step_write) {
    // A gradient does not wait for the commit in flight (the last step's, or a drain of
    // gradients written behind): staged, it reaches the volume only with a commit, and
    // each that can take it comes after the last step is whole (that step's own, which
    // takes it with its record, or one of gradients, which settles the last first). The
    // backward pass computes while the last step's writes finish.
    if (m.volume->staged_bytes() <= m.options.max_staged_bytes) return absl::OkStatus();
    MEMASCEND_RETURN_IF_ERROR(Settle());
    return m.volume->Sync();
  }
  MEMASCEND_RETURN_IF_ERROR(Settle());
  if (step_write) {
    return absl::FailedPreconditionError(fmt::format(
        "training state: {} written as a step's update before BeginUpdate: a state updated in "
        "place is updated through BeginUpdate and PartUpdated (OffloadedAdam does so)",
        ToString(k)));
  }
  if (m.options.max_staged_bytes != 0 && m.volume->staged_bytes() > m.options.max_staged_bytes)
    return m.volume->Sync();
  return absl::OkStatus();
}

absl::StatusOr<StateBuffer> VersionedTrainingState::Overwrite(StateKind k, std::size_t g,
                                                              std::size_t part, bool next) {
  if (impl_->options.in_place) {
    MEMASCEND_RETURN_IF_ERROR(WritingInPlace(k, next && k != StateKind::kGradient));
  } else if (next) {
    MEMASCEND_RETURN_IF_ERROR(WritingNext());
  }
  MEMASCEND_ASSIGN_OR_RETURN(TensorId id, Tensor(k, g, part, next ? 1 - current_ : current_));
  if (k == StateKind::kGradient) MEMASCEND_RETURN_IF_ERROR(RewritingGradient(id));
  MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease, impl_->store->AcquireForOverwrite(id));
  return Wrap(std::move(lease));
}

// Note [gradient write-behind]: a gradient written again in a step (a caller's second
// SetGradient of a part) must not be written back while leased, which would stage a
// half-written part and leave it clean: it leaves the queue, and a drain writing it is
// waited for.
absl::Status VersionedTrainingState::RewritingGradient(TensorId id) {
  Impl& m = *impl_;
  std::erase_if(m.behind, [&](const std::pair<TensorId, std::uint64_t>& b) {
    if (b.first != id) return false;
    m.behind_bytes -= b.second;
    return true;
  });
  if (m.draining && std::find(m.drain_ids.begin(), m.drain_ids.end(), id) != m.drain_ids.end())
    return Settle();
  return absl::OkStatus();
}

absl::StatusOr<StateBuffer> VersionedTrainingState::Update(StateKind k, std::size_t g,
                                                           std::size_t part) {
  if (impl_->options.in_place) {
    MEMASCEND_RETURN_IF_ERROR(WritingInPlace(k, true));
    MEMASCEND_ASSIGN_OR_RETURN(TensorId id, Tensor(k, g, part, 0));
    MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease, impl_->store->AcquireForWrite(id));
    return Wrap(std::move(lease));
  }
  // The current version's block becomes the next version's (read straight into it if
  // cold): one block per state, never both versions at once.
  MEMASCEND_RETURN_IF_ERROR(WritingNext());
  MEMASCEND_ASSIGN_OR_RETURN(TensorId from, Tensor(k, g, part, current_));
  MEMASCEND_ASSIGN_OR_RETURN(TensorId to, Tensor(k, g, part, 1 - current_));
  MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease, impl_->store->AcquireCopy(from, to));
  return Wrap(std::move(lease));
}

void VersionedTrainingState::Prefetch(StateKind k, std::size_t g, std::size_t part) {
  if (auto id = Tensor(k, g, part, current_); id.ok()) (void)impl_->store->Prefetch(*id);
}

absl::Status VersionedTrainingState::Keep(StateKind k, std::size_t g, std::size_t part) {
  for (int v = 0; v < Versions(k, impl_->options.in_place); ++v) {
    MEMASCEND_ASSIGN_OR_RETURN(TensorId id, Tensor(k, g, part, v));
    MEMASCEND_RETURN_IF_ERROR(impl_->store->SetRetention(id, Retention::kKeep));
  }
  return absl::OkStatus();
}

absl::Status VersionedTrainingState::Discard(StateKind k, std::size_t g, std::size_t part) {
  MEMASCEND_ASSIGN_OR_RETURN(TensorId id, Tensor(k, g, part, current_));
  return impl_->store->Discard(id);
}

absl::StatusOr<TensorLease> VersionedTrainingState::ReadOnDevice(StateKind k, std::size_t g,
                                                                 std::size_t part,
                                                                 CudaStreamView stream) {
  MEMASCEND_ASSIGN_OR_RETURN(TensorId id, Tensor(k, g, part, current_));
  return impl_->store->Acquire(id, Tier::kGpu, stream);
}

// ---- Note [state in place] ---------------------------------------------------------------

absl::Status VersionedTrainingState::BeginUpdate(const StepIntent& intent) {
  Impl& m = *impl_;
  if (!m.options.in_place) return absl::OkStatus();
  MEMASCEND_RETURN_IF_ERROR(Settle());
  if (m.intent.has_value())
    return absl::FailedPreconditionError("training state: a step's update began twice");
  // Note [gradient write-behind]: the gradients in flight are staged before the room for
  // the rest is reckoned.
  if (!m.behind.empty()) {
    std::vector<TensorId> behind;
    for (const auto& b : std::exchange(m.behind, {})) behind.push_back(b.first);
    m.behind_bytes = 0;
    MEMASCEND_RETURN_IF_ERROR(m.store->WriteBack(behind));
  }
  StepIntent i = intent;
  i.record.layout = LayoutId(layout_, true);
  i.record.version = 0;
  i.record.step = 1;
  i.record.user.clear();
  if (!m.last_record.empty()) {  // the step after the last commit, with its user bytes
    MEMASCEND_ASSIGN_OR_RETURN(CommitRecord last, DecodeCommitRecord(m.last_record));
    i.record.step = last.step + 1;
    i.record.user = std::move(last.user);
  }
  m.done = m.batch_from = m.committed = 0;
  m.since_batch = 0;
  if (m.unfinished.has_value()) {  // finishing a torn step: its first parts are durable
    if (m.unfinished->intent.record.step != i.record.step)
      return absl::FailedPreconditionError("training state: the torn step is not finished first");
    m.done = m.batch_from = m.committed = m.unfinished->parts_done;
    m.unfinished.reset();
  }
  m.intent = std::move(i);
  m.batched = m.options.max_staged_bytes != 0 && m.state_bytes > m.options.max_staged_bytes;
  // Note [batch overlap]: two batches in flight (one committing, the next one's parts
  // written back as the budget evicts them) stay within the bound plus a part, as one
  // batch at a time did, when each is under half the bound less a part; a bound too
  // small for that commits one batch at a time, as it comes.
  const std::uint64_t bound = m.options.max_staged_bytes;
  m.batch_overlap = m.batched && bound >= 4 * m.largest_part;
  m.batch_bytes = m.batch_overlap ? (bound - m.largest_part) / 2 : bound;
  const auto gradient_bytes = [&](std::size_t n) {
    return m.PartBytes(layout_, m.order[n].first, m.order[n].second, true);
  };
  std::uint64_t gradients = 0;
  for (std::size_t n = m.done; n < m.order.size(); ++n) gradients += gradient_bytes(n);
  if (!m.batched && (bound == 0 || m.state_bytes + gradients <= bound)) {
    // The gradients the backward pass staged are committed now (no part is written yet):
    // the commit then stages the state, and the gradients the update evicts from host
    // memory (each written beside its committed copy), within the bound. Unbounded,
    // nothing need be: and steps committed in memory (Note [commit interval]) may have
    // staged parts.
    return bound != 0 && m.volume->staged_bytes() > 0 ? m.volume->Sync() : absl::OkStatus();
  }
  // The redo record of a batched step, and a step whose state fits the bound and whose
  // gradients with it do not: every gradient durable before any part of the step is
  // written back (the parts on the volume are still whole), so the update stages the
  // state alone. Unbatched, the gradients the update evicted were staged beside their
  // committed copies, past the bound and past the room VolumeBytes leaves (252 MiB of
  // state and 84 MiB of gradients under a bound of 256 MiB filled the volume at step 2).
  // The gradients go several parts at a time (Note [write-back depth] in
  // tensor_store.h), as many as the bound has room for, and at least one: the bound is
  // passed by at most a part, as one part at a time would.
  for (std::size_t n = m.done; n < m.order.size();) {
    const std::uint64_t staged = m.volume->staged_bytes();
    const std::uint64_t room = bound > staged ? bound - staged : 0;
    std::size_t end = n + 1;
    for (std::uint64_t bytes = gradient_bytes(n);
         end < m.order.size() && bytes + gradient_bytes(end) <= room; ++end)
      bytes += gradient_bytes(end);
    MEMASCEND_RETURN_IF_ERROR(WriteBackParts(n, end, true));
    n = end;
    if (m.volume->staged_bytes() > bound) MEMASCEND_RETURN_IF_ERROR(m.volume->Sync());
  }
  return m.volume->Sync();
}

// The tensors of the parts order[from, to), with their objects' names where asked: their
// gradients, or every other kind of them.
absl::Status VersionedTrainingState::PartTensors(std::size_t from, std::size_t to, bool gradient,
                                                 std::vector<TensorId>* ids,
                                                 std::vector<std::string>* names) const {
  const Impl& m = *impl_;
  for (std::size_t n = from; n < to; ++n) {
    const auto [g, part] = m.order[n];
    for (StateKind k : kKinds) {
      if ((k == StateKind::kGradient) != gradient || !layout_.Stored(k, g)) continue;
      MEMASCEND_ASSIGN_OR_RETURN(TensorId id, Tensor(k, g, part, 0));
      ids->push_back(id);
      if (names != nullptr) names->push_back(m.names[static_cast<int>(k)][g][part]);
    }
  }
  return absl::OkStatus();
}

// Writes back the parts order[from, to): their gradients, or every other kind of them,
// several tensors at once (Note [write-back depth] in tensor_store.h).
absl::Status VersionedTrainingState::WriteBackParts(std::size_t from, std::size_t to,
                                                    bool gradient) {
  std::vector<TensorId> ids;
  MEMASCEND_RETURN_IF_ERROR(PartTensors(from, to, gradient, &ids, nullptr));
  return impl_->store->WriteBack(ids);
}

// Note [gradient write-behind].
absl::Status VersionedTrainingState::GradientWritten(std::size_t g, std::size_t part) {
  Impl& m = *impl_;
  const std::uint64_t bound = m.options.max_staged_bytes;
  if (!m.options.in_place || bound == 0 || m.state_bytes <= bound || m.intent.has_value())
    return absl::OkStatus();
  MEMASCEND_ASSIGN_OR_RETURN(TensorId id, Tensor(StateKind::kGradient, g, part, 0));
  const std::uint64_t bytes = m.PartBytes(layout_, g, part, true);
  // What will be staged: what is (a drain's bytes too, until it has committed them), and
  // the gradients queued and not written yet (those written are among the staged:
  // dropped from the queue first, so none is counted twice). Past half the bound, beyond
  // what a drain still running commits, a drain commits it in the background while the
  // gradients after it take the other half; a drain in flight is waited for first (Note
  // [batch overlap] bounds a step's batches so). What is staged stays within the bound
  // and a part.
  std::erase_if(m.behind, [&](const std::pair<TensorId, std::uint64_t>& b) {
    if (m.store->WritePending(b.first)) return false;
    m.behind_bytes -= b.second;
    return true;
  });
  const std::uint64_t staged = m.volume->staged_bytes();
  const bool running = m.committer.joinable() && !m.committer_done.load(std::memory_order_acquire);
  if (running && !m.draining) {
    // The last step's commit may stage its last parts yet: counted (perhaps twice), and
    // not overlapped by a drain, which waits for it.
    if (staged + m.commit_bytes + m.behind_bytes + bytes > bound)
      MEMASCEND_RETURN_IF_ERROR(DrainGradients());
  } else if (staged + m.behind_bytes + bytes > bound / 2 + (running ? m.drain_bytes : 0)) {
    MEMASCEND_RETURN_IF_ERROR(DrainGradients());
  }
  MEMASCEND_RETURN_IF_ERROR(m.store->WriteBehind(id));
  m.behind.emplace_back(id, bytes);
  m.behind_bytes += bytes;
  return absl::OkStatus();
}

// Commits the gradients written behind so far, and whatever else is staged, on the
// committer thread (Note [background commit]) after the last drain: its writes still
// queued are waited for there. The next gradient's Overwrite does not wait for it
// (WritingInPlace); the next drain, the step's update and every commit do (Settle).
absl::Status VersionedTrainingState::DrainGradients() {
  Impl& m = *impl_;
  MEMASCEND_RETURN_IF_ERROR(Settle());
  std::vector<TensorId> ids;
  for (const auto& b : std::exchange(m.behind, {})) ids.push_back(b.first);
  m.drain_bytes = m.volume->staged_bytes() + m.behind_bytes;  // at most what it commits
  m.behind_bytes = 0;
  m.draining = true;
  m.drain_ids = ids;
  m.committer_done.store(false, std::memory_order_relaxed);
  m.committer = prim::StartThread("ma-drain", [this, ids = std::move(ids)] {
    absl::Status s = impl_->store->WriteBack(ids);
    if (s.ok()) s = impl_->volume->Sync();
    impl_->commit_status = std::move(s);
    impl_->committer_done.store(true, std::memory_order_release);
  });
  return absl::OkStatus();
}

absl::Status VersionedTrainingState::PartUpdated(std::size_t g, std::size_t part) {
  Impl& m = *impl_;
  if (!m.options.in_place) return absl::OkStatus();
  if (!m.intent.has_value())
    return absl::FailedPreconditionError("training state: a part updated before BeginUpdate");
  if (m.done >= m.order.size() || m.order[m.done] != std::make_pair(g, part)) {
    return absl::FailedPreconditionError(
        fmt::format("training state: group {} part {} updated out of layout order", g, part));
  }
  ++m.done;
  m.since_batch += m.PartBytes(layout_, g, part);
  if (m.batched && m.since_batch > m.batch_bytes) return CommitBatch(m.batch_overlap);
  return absl::OkStatus();
}

// Commits the parts updated since the last batch with the progress object, in one journal
// commit: each part's kinds are written back first, so none commits half updated.
//
// Note [batch overlap]: with `background`, the batch is written back and committed on the
// committer thread (Note [background commit]) while the caller updates the next parts;
// the next batch, the step's commit and BeginUpdate settle it first. Its journal commit
// takes the batch's objects and the progress object alone (SyncOnly, Note [selective
// commit] in object_store.h): a later part that the budget evicts meanwhile is staged,
// perhaps a kind of it only, and must not be committed before its batch is whole. A
// batch that fails is known at the next batch or the step's commit (Settle); `committed`
// moves only past batches known durable, and a state destroyed with a failed batch
// commits it again with the parts after it as a torn step. If that fails too, the
// store's own commit at its close can still commit parts beyond the progress object (as
// before the overlap): a store switch that stops it is not built.
absl::Status VersionedTrainingState::CommitBatch(bool background) {
  Impl& m = *impl_;
  MEMASCEND_RETURN_IF_ERROR(Settle());  // batches commit one at a time, in order
  m.committed = m.batch_from;           // the batch before this one is durable
  std::vector<TensorId> ids;
  std::vector<std::string> names;
  MEMASCEND_RETURN_IF_ERROR(PartTensors(m.batch_from, m.done, false, &ids, &names));
  names.push_back(ProgressName());
  m.batch_from = m.done;
  m.since_batch = 0;
  // In the foreground every staged object is committed: the torn step a destroyed state
  // leaves commits the gradients it wrote back with its parts.
  auto commit = [this, background, ids = std::move(ids), names = std::move(names),
                 progress = EncodeProgress(*m.intent, m.done)] {
    absl::Status s = impl_->store->WriteBack(ids);
    if (s.ok()) {
      s = impl_->volume->PutStaged(
          ProgressName(), {reinterpret_cast<const std::byte*>(progress.data()), progress.size()},
          kProgressMetadata);
    }
    if (s.ok()) s = background ? impl_->volume->SyncOnly(names) : impl_->volume->Sync();
    return s;
  };
  if (!background) {
    const std::size_t end = m.batch_from;
    absl::Status s = commit();
    if (s.ok()) m.committed = end;
    return s;
  }
  m.committer_done.store(false, std::memory_order_relaxed);
  m.committer = prim::StartThread("ma-commit", [this, commit = std::move(commit)] {
    impl_->commit_status = commit();
    impl_->committer_done.store(true, std::memory_order_release);
  });
  return absl::OkStatus();
}

// The record `bytes` of step `step` and every part's kinds but the gradient, in one
// journal commit with a progress object of no step in progress (any earlier one is then
// stale), in the background or not. The gradients are not written: no part of this step
// needs them (a torn step's are written by the state's destruction).
absl::Status VersionedTrainingState::CommitWhole(std::string bytes, std::uint64_t step,
                                                 bool background) {
  Impl& m = *impl_;
  std::vector<TensorId> ids;
  MEMASCEND_RETURN_IF_ERROR(PartTensors(0, m.order.size(), false, &ids, nullptr));
  m.deferred = 0;
  auto commit = [this, ids = std::move(ids), bytes = std::move(bytes)] {
    auto decoded = DecodeCommitRecord(bytes);
    if (!decoded.ok()) return decoded.status();
    const std::string progress = EncodeProgress({*decoded, {}}, 0);
    absl::Status s = impl_->store->WriteBack(ids);
    if (s.ok()) {
      s = impl_->volume->PutStaged(
          ProgressName(), {reinterpret_cast<const std::byte*>(progress.data()), progress.size()},
          kProgressMetadata);
    }
    if (s.ok()) {
      s = impl_->volume->PutStaged(impl_->options.record_name,
                                   {reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()},
                                   kRecordMetadata);
    }
    if (s.ok()) s = impl_->volume->Sync();
    return s;
  };
  if (!background) {
    MEMASCEND_RETURN_IF_ERROR(commit());
    m.durable_step = step;
    return absl::OkStatus();
  }
  m.committing_step = step;
  m.committer_done.store(false, std::memory_order_relaxed);
  m.committer = prim::StartThread("ma-commit", [this, commit = std::move(commit)] {
    impl_->commit_status = commit();
    impl_->committer_done.store(true, std::memory_order_release);
  });
  return absl::OkStatus();
}

absl::Status VersionedTrainingState::Persist() {
  MEMASCEND_RETURN_IF_ERROR(Settle());
  Impl& m = *impl_;
  if (!m.options.in_place || m.deferred == 0) return absl::OkStatus();
  if (m.intent.has_value()) {
    return absl::FailedPreconditionError(fmt::format(
        "training state: Persist during a step's update, with {} step(s) committed in memory "
        "before it: after the step's Commit (the state's destruction commits them with the "
        "step torn)",
        m.deferred));
  }
  MEMASCEND_RETURN_IF_ERROR(CommitWhole(m.last_record, m.last_step, true));
  return Settle();
}

std::uint64_t VersionedTrainingState::durable_step() const noexcept { return impl_->durable_step; }
std::uint64_t VersionedTrainingState::deferred_steps() const noexcept { return impl_->deferred; }
const VersionedTrainingStateOptions& VersionedTrainingState::options() const noexcept {
  return impl_->options;
}

VersionedTrainingStateOptions VersionedTrainingStateOptions::ForTrainer(bool two_versions,
                                                                        std::uint32_t commit_every,
                                                                        bool stage_whole_step) {
  VersionedTrainingStateOptions o;
  if (two_versions) {
    o.in_place = false;
    o.max_staged_bytes = 0;
  }
  o.commit_every = commit_every;
  if (commit_every > 1 || stage_whole_step) o.max_staged_bytes = 0;
  return o;
}

std::optional<UnfinishedStep> VersionedTrainingState::Unfinished() const {
  return impl_->unfinished;
}

std::string VersionedTrainingState::ProgressName() const {
  return impl_->options.record_name + ".step";
}

absl::Status VersionedTrainingState::Commit(const CommitRecord& r) {
  if (r.version != 0 && r.version != 1)
    return absl::InvalidArgumentError(fmt::format("commit: version {}", r.version));
  if (r.user.size() > kMaxUserBytes)
    return absl::InvalidArgumentError(
        fmt::format("commit: {} user bytes, more than {}", r.user.size(), kMaxUserBytes));
  MEMASCEND_RETURN_IF_ERROR(Settle());
  CommitRecord record = r;
  if (impl_->options.in_place) {
    Impl& m = *impl_;
    if (m.unfinished.has_value())
      return absl::FailedPreconditionError("training state: the torn step is not finished first");
    if (m.intent.has_value() && m.done != m.order.size()) {
      return absl::FailedPreconditionError(fmt::format(
          "training state: commit with {} of {} parts updated", m.done, m.order.size()));
    }
    if (m.intent.has_value() && r.step != m.intent->record.step) {
      return absl::FailedPreconditionError(fmt::format(
          "training state: an update in place commits as step {} (the last commit's plus "
          "one, as Resume finishes a torn step), not {}",
          m.intent->record.step, r.step));
    }
    // Note [commit interval]: a step's update between the interval's commits stays in
    // memory (and what was evicted of it, staged); so does a step skipped (no update: the
    // loss scaler's), which commits the step after the last one.
    const bool next_step =
        m.intent.has_value() || (!m.last_record.empty() && record.step == m.last_step + 1);
    // The parts since the last batch are what its commit writes yet (Note [gradient
    // write-behind]); a step skipped wrote none, and the gradients it queued are dropped.
    m.commit_bytes = m.intent.has_value() ? m.since_batch + m.largest_part : 0;
    m.behind.clear();
    m.behind_bytes = 0;
    m.intent.reset();
    record.version = 0;
    record.layout = LayoutId(layout_, true);
    // The steps that follow number from this one (BeginUpdate), durable or not; a failed
    // commit fails the state.
    m.last_record = EncodeCommitRecord(record);
    m.last_step = record.step;
    if (next_step && m.deferred + 1 < m.options.commit_every) {
      ++m.deferred;
      return absl::OkStatus();
    }
    return CommitWhole(m.last_record, record.step, true);
  }
  current_ = r.version;
  record.layout = LayoutId(layout_, false);
  impl_->committing_step = r.step;
  const bool previous_written = impl_->previous_written;
  impl_->writing_next = impl_->previous_written = false;
  impl_->committer_done.store(false, std::memory_order_relaxed);
  impl_->committer =
      prim::StartThread("ma-commit", [this, previous_written, record = std::move(record)] {
        // Note [previous commit]: the last record becomes the previous one first (unless the
        // step did so already, Note [bounded staging]).
        absl::Status s = absl::OkStatus();
        if (!impl_->last_record.empty() && !previous_written) {
          // Only a record of an earlier step (a run started over keeps none of the old one's).
          auto last = DecodeCommitRecord(impl_->last_record);
          if (last.ok() && last->step < record.step)
            s = PutRecord(PreviousName(), impl_->last_record);
        }
        if (s.ok()) s = impl_->store->Flush();
        std::string bytes = EncodeCommitRecord(record);
        if (s.ok()) s = PutRecord(impl_->options.record_name, bytes);
        if (s.ok()) impl_->last_record = std::move(bytes);
        impl_->commit_status = std::move(s);
        impl_->committer_done.store(true, std::memory_order_release);
      });
  return absl::OkStatus();
}

std::string VersionedTrainingState::PreviousName() const {
  return impl_->options.record_name + ".previous";
}

absl::Status VersionedTrainingState::PutRecord(const std::string& name, const std::string& bytes) {
  return impl_->volume->Put(name, {reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()},
                            Durability::kDurable, kRecordMetadata);
}

// The record stored under `name` (nullopt when there is none), checked as Resume checks.
absl::StatusOr<std::optional<std::pair<CommitRecord, std::string>>>
VersionedTrainingState::ReadRecord(const std::string& name, std::uint64_t fingerprint) const {
  MEMASCEND_ASSIGN_OR_RETURN(std::optional<std::string> stored, ReadObject(impl_->volume, name));
  if (!stored.has_value()) return std::nullopt;
  std::string bytes = std::move(*stored);
  MEMASCEND_ASSIGN_OR_RETURN(CommitRecord r, DecodeCommitRecord(bytes));
  if (r.layout != LayoutId(layout_, impl_->options.in_place)) {
    return absl::FailedPreconditionError(fmt::format(
        "the volume's training state '{}' has another layout (groups, sizes, dtypes or parts)",
        name));
  }
  if (r.fingerprint != fingerprint) {
    return absl::FailedPreconditionError(fmt::format(
        "the volume's training state '{}' belongs to another run (fingerprint {:#x}, not {:#x})",
        name, r.fingerprint, fingerprint));
  }
  return std::make_pair(std::move(r), std::move(bytes));
}

absl::Status VersionedTrainingState::Settle() {
  Impl& m = *impl_;
  if (m.committer.joinable()) {
    m.committer.join();
    m.draining = false;
    m.drain_ids.clear();
    if (m.commit_status.ok() && m.committing_step != 0) m.durable_step = m.committing_step;
    m.committing_step = 0;
  }
  return m.commit_status;  // once failed, the state stays failed
}

bool VersionedTrainingState::in_update() const noexcept { return impl_->intent.has_value(); }

absl::StatusOr<std::optional<CommitRecord>> VersionedTrainingState::Resume(
    std::uint64_t fingerprint) {
  // Steps committed in memory are made durable first: the volume is then what this
  // process holds (Note [commit interval]).
  if (impl_->deferred > 0) {
    if (impl_->intent.has_value()) {
      return absl::FailedPreconditionError(fmt::format(
          "training state: Resume during a step's update, with {} step(s) committed in memory "
          "before it: destroy the state (it commits them with the step torn) and reopen it",
          impl_->deferred));
    }
    MEMASCEND_RETURN_IF_ERROR(Persist());
  }
  MEMASCEND_RETURN_IF_ERROR(Settle());
  MEMASCEND_ASSIGN_OR_RETURN(auto last, ReadRecord(impl_->options.record_name, fingerprint));
  impl_->unfinished.reset();
  impl_->intent.reset();
  impl_->deferred = 0;  // Note [commit interval]: steps a crash lost are the caller's to redo
  impl_->durable_step = impl_->last_step = last.has_value() ? last->first.step : 0;
  if (!last.has_value()) return std::nullopt;
  current_ = last->first.version;
  impl_->last_record = std::move(last->second);
  if (impl_->options.in_place) {
    // Note [state in place]: a progress object of the step after the last commit names a
    // torn step; one of an earlier step is stale (its step was committed).
    MEMASCEND_ASSIGN_OR_RETURN(std::optional<std::string> bytes,
                               ReadObject(impl_->volume, ProgressName()));
    if (bytes.has_value()) {
      MEMASCEND_ASSIGN_OR_RETURN(UnfinishedStep u, DecodeProgress(*bytes));
      // Torn: this run's and layout's, the step after the last commit, some parts done.
      // Anything else is stale (a step since committed, or a state since replaced).
      if (u.intent.record.step == last->first.step + 1 && u.parts_done > 0 &&
          u.parts_done <= impl_->order.size() &&
          u.intent.record.layout == LayoutId(layout_, true) &&
          u.intent.record.fingerprint == fingerprint)
        impl_->unfinished = std::move(u);
    }
  }
  return std::move(last->first);
}

absl::StatusOr<std::optional<CommitRecord>> VersionedTrainingState::ResumeAtMost(
    std::uint64_t fingerprint, std::uint64_t step) {
  MEMASCEND_ASSIGN_OR_RETURN(std::optional<CommitRecord> last, Resume(fingerprint));
  if (impl_->options.in_place) {  // the last commit only, and a torn step goes forward
    if (last.has_value() && (last->step > step || (impl_->unfinished.has_value() &&
                                                   impl_->unfinished->intent.record.step > step))) {
      return absl::FailedPreconditionError(fmt::format(
          "the volume's training state, updated in place, holds step {}{}, not step {}", last->step,
          impl_->unfinished.has_value() ? " and a step it will finish" : "", step));
    }
    return last;
  }
  if (!last.has_value() || last->step <= step) return last;
  MEMASCEND_ASSIGN_OR_RETURN(auto previous, ReadRecord(PreviousName(), fingerprint));
  if (!previous.has_value() || previous->first.step > step || previous->first.step >= last->step) {
    return absl::FailedPreconditionError(fmt::format(
        "the volume's training state holds step {}{}, not step {} or one before it", last->step,
        previous.has_value() ? fmt::format(" and step {}", previous->first.step) : std::string(),
        step));
  }
  // The previous record becomes the last (Note [previous commit]).
  MEMASCEND_RETURN_IF_ERROR(PutRecord(impl_->options.record_name, previous->second));
  impl_->durable_step = impl_->last_step = previous->first.step;
  current_ = previous->first.version;
  impl_->last_record = std::move(previous->second);
  return std::move(previous->first);
}

std::uint64_t VersionedTrainingState::io_read_bytes() const {
  return impl_->store->stats().bytes_read;
}
std::uint64_t VersionedTrainingState::io_write_bytes() const {
  return impl_->store->stats().bytes_written;
}
std::optional<TensorStoreStats> VersionedTrainingState::store_stats() const {
  return impl_->store->stats();
}

}  // namespace memascend

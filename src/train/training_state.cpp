#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>

#include <memascend/status.h>
#include <memascend/training_state.h>

#include "util/crc32c.h"

namespace memascend {
namespace {

constexpr std::array<StateKind, 5> kKinds = {StateKind::kParameters, StateKind::kGradient,
                                             StateKind::kMaster, StateKind::kExpAvg,
                                             StateKind::kExpAvgSq};
bool Versioned(StateKind k) { return k != StateKind::kGradient; }

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
  if (param_dtype != DType::kF16 && param_dtype != DType::kBF16 && param_dtype != DType::kF32)
    return absl::InvalidArgumentError("state layout: bad parameter dtype");
  std::vector<std::string_view> names;
  for (const StateGroup& g : groups) {
    if (!GoodName(g.name)) {
      return absl::InvalidArgumentError(
          fmt::format("state layout: group name '{}' is not 1..200 of [A-Za-z0-9_.-]", g.name));
    }
    if (g.elements == 0)
      return absl::InvalidArgumentError(fmt::format("state layout: group '{}' is empty", g.name));
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
  auto bad = [&](std::string_view why) {
    return absl::DataLossError(
        fmt::format("training-state commit record ({} bytes) unreadable: {}", bytes.size(), why));
  };
  if (bytes.size() < sizeof(kRecordMagic) + 4 ||
      std::memcmp(bytes.data(), kRecordMagic, sizeof(kRecordMagic)) != 0)
    return bad("not a commit record (no magic)");
  std::uint32_t crc = 0;
  std::memcpy(&crc, bytes.data() + bytes.size() - 4, 4);
  if (crc != util::Crc32c(bytes.data(), bytes.size() - 4)) return bad("checksum mismatch");
  std::string_view in = bytes.substr(sizeof(kRecordMagic), bytes.size() - sizeof(kRecordMagic) - 4);
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
  std::thread committer;       // the commit in progress (Note [background commit])
  absl::Status commit_status;  // the last commit's; written by committer before it ends
  std::string last_record;     // as stored: the one a commit keeps as the previous
  bool writing_next = false;   // this step wrote the next version (Note [bounded staging])
  bool previous_written = false;
};

VersionedTrainingState::VersionedTrainingState(std::unique_ptr<Impl> impl, StateLayout layout)
    : layout_(std::move(layout)), impl_(std::move(impl)) {}

VersionedTrainingState::~VersionedTrainingState() {
  (void)Settle();
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

std::uint64_t VersionedTrainingState::StoredBytes(const StateLayout& layout) {
  constexpr std::uint64_t kUnit = 64 * 1024;
  std::uint64_t need = 0;
  for (StateKind k : kKinds) {
    for (std::size_t g = 0; g < layout.groups.size(); ++g) {
      if (!layout.Stored(k, g)) continue;
      for (std::size_t part = 0; part < layout.Parts(g); ++part) {
        const auto [begin, end] = layout.PartRange(g, part);
        const std::uint64_t bytes = (end - begin) * layout.ElementBytes(k);
        need += (Versioned(k) ? 2 : 1) * ((bytes + kUnit - 1) / kUnit * kUnit);
      }
    }
  }
  return need;
}

std::uint64_t VersionedTrainingState::DataBytes(const StateLayout& layout,
                                                const VersionedTrainingStateOptions& options) {
  constexpr std::uint64_t kUnit = 64 * 1024;
  const auto round = [](std::uint64_t b) { return (b + kUnit - 1) / kUnit * kUnit; };
  std::uint64_t version = 0, part = 0;  // one version's bytes; the largest part's tensors
  for (std::size_t g = 0; g < layout.groups.size(); ++g) {
    for (std::size_t p = 0; p < layout.Parts(g); ++p) {
      const auto [begin, end] = layout.PartRange(g, p);
      std::uint64_t here = 0;
      for (StateKind k : kKinds) {
        if (layout.Stored(k, g) && Versioned(k))
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
  return StoredBytes(layout) + in_flight;
}

std::uint64_t VersionedTrainingState::VolumeBytes(const StateLayout& layout,
                                                  const VersionedTrainingStateOptions& options) {
  constexpr std::uint64_t kUnit = 64 * 1024;
  const std::uint64_t data = DataBytes(layout, options);
  // Volume::Format's journal: capacity / 512 in [2 MiB, 256 MiB].
  const std::uint64_t journal =
      std::clamp<std::uint64_t>(data / 511, std::uint64_t{2} << 20, std::uint64_t{256} << 20);
  return (data + journal + data / 64 + (std::uint64_t{64} << 20) + kUnit - 1) / kUnit * kUnit;
}

absl::StatusOr<std::unique_ptr<VersionedTrainingState>> VersionedTrainingState::Open(
    TensorStore* store, ObjectStore* volume, const StateLayout& layout,
    const VersionedTrainingStateOptions& options) {
  if (store == nullptr || volume == nullptr)
    return absl::InvalidArgumentError("versioned training state: null store or volume");
  MEMASCEND_RETURN_IF_ERROR(layout.Validate());
  auto impl = std::make_unique<Impl>();
  impl->store = store;
  impl->volume = volume;
  impl->options = options;
  if (options.record_name.empty())
    return absl::InvalidArgumentError("versioned training state: empty record name");
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
  const auto tensor_name = [&](StateKind k, std::size_t g, std::size_t part, int v) {
    return fmt::format("{}{}.{}.p{}{}", options.tensor_prefix, layout.groups[g].name, ToString(k),
                       part, Versioned(k) ? fmt::format(".v{}", v) : "");
  };
  for (StateKind k : kKinds) {
    for (std::size_t g = 0; g < layout.groups.size(); ++g) {
      if (!layout.Stored(k, g)) continue;
      for (std::size_t part = 0; part < layout.Parts(g); ++part) {
        for (int v = 0; v < (Versioned(k) ? 2 : 1); ++v) ours.insert(tensor_name(k, g, part, v));
      }
    }
  }
  {
    const std::string previous = options.record_name + ".previous";
    std::vector<std::string> foreign;  // what another state left: records, then tensors
    std::string why, tensors_why;
    for (const ObjectInfo& o : volume->List()) {
      if (o.metadata == kRecordMetadata) {
        if (o.name == options.record_name || o.name == previous) {
          // Ours by name: of this layout, or another one (a changed model or part size).
          std::string bytes(o.size, '\0');
          auto got =
              volume->Get(o.name, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()});
          auto r =
              got.ok() ? DecodeCommitRecord(bytes) : absl::StatusOr<CommitRecord>(got.status());
          if (r.ok() && r->layout == layout.Fingerprint()) continue;
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
          if (ours.count(o.name)) foreign.push_back(o.name);
        }
      }
      for (const std::string& name : foreign) MEMASCEND_RETURN_IF_ERROR(volume->Delete(name));
      MEMASCEND_RETURN_IF_ERROR(volume->Sync());
    }
  }
  for (StateKind k : kKinds) {
    auto& ids = impl->ids[static_cast<int>(k)];
    ids.resize(layout.groups.size());
    for (std::size_t g = 0; g < layout.groups.size(); ++g) {
      if (!layout.Stored(k, g)) continue;
      for (std::size_t part = 0; part < layout.Parts(g); ++part) {
        for (int v = 0; v < (Versioned(k) ? 2 : 1); ++v) {
          const auto [begin, end] = layout.PartRange(g, part);
          TensorSpec spec;
          spec.name = tensor_name(k, g, part, v);
          spec.dtype = k == StateKind::kParameters ? layout.param_dtype
                       : k == StateKind::kGradient ? layout.grad_dtype
                                                   : DType::kF32;
          spec.bytes = (end - begin) * layout.ElementBytes(k);
          spec.shape = {static_cast<std::int64_t>(end - begin)};
          spec.use = UseOf(k);
          spec.durability = Versioned(k) ? Durability::kDurable : Durability::kScratch;
          MEMASCEND_ASSIGN_OR_RETURN(TensorId id, store->Register(spec));
          ids[g].push_back(id);
        }
      }
    }
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
  const std::size_t versions = Versioned(k) ? 2 : 1;
  return impl_->ids[static_cast<int>(k)][g]
                   [part * versions + static_cast<std::size_t>(Versioned(k) ? version : 0)];
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
  MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease, impl_->store->Acquire(id));
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

absl::StatusOr<StateBuffer> VersionedTrainingState::Overwrite(StateKind k, std::size_t g,
                                                              std::size_t part, bool next) {
  if (next) MEMASCEND_RETURN_IF_ERROR(WritingNext());
  MEMASCEND_ASSIGN_OR_RETURN(TensorId id, Tensor(k, g, part, next ? 1 - current_ : current_));
  MEMASCEND_ASSIGN_OR_RETURN(TensorLease lease, impl_->store->AcquireForOverwrite(id));
  return Wrap(std::move(lease));
}

absl::StatusOr<StateBuffer> VersionedTrainingState::Update(StateKind k, std::size_t g,
                                                           std::size_t part) {
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
  for (int v = 0; v < (Versioned(k) ? 2 : 1); ++v) {
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

absl::Status VersionedTrainingState::Commit(const CommitRecord& r) {
  if (r.version != 0 && r.version != 1)
    return absl::InvalidArgumentError(fmt::format("commit: version {}", r.version));
  if (r.user.size() > kMaxUserBytes)
    return absl::InvalidArgumentError(
        fmt::format("commit: {} user bytes, more than {}", r.user.size(), kMaxUserBytes));
  MEMASCEND_RETURN_IF_ERROR(Settle());
  current_ = r.version;
  CommitRecord record = r;
  record.layout = layout_.Fingerprint();
  const bool previous_written = impl_->previous_written;
  impl_->writing_next = impl_->previous_written = false;
  impl_->committer = std::thread([this, previous_written, record = std::move(record)] {
    // Note [previous commit]: the last record becomes the previous one first (unless the
    // step did so already, Note [bounded staging]).
    absl::Status s = absl::OkStatus();
    if (!impl_->last_record.empty() && !previous_written) {
      // Only a record of an earlier step (a run started over keeps none of the old one's).
      auto last = DecodeCommitRecord(impl_->last_record);
      if (last.ok() && last->step < record.step) s = PutRecord(PreviousName(), impl_->last_record);
    }
    if (s.ok()) s = impl_->store->Flush();
    std::string bytes = EncodeCommitRecord(record);
    if (s.ok()) s = PutRecord(impl_->options.record_name, bytes);
    if (s.ok()) impl_->last_record = std::move(bytes);
    impl_->commit_status = std::move(s);
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
  auto info = impl_->volume->Stat(name);
  if (!info.ok()) {
    if (info.status().code() == absl::StatusCode::kNotFound) return std::nullopt;
    return info.status();
  }
  std::string bytes(info->size, '\0');
  MEMASCEND_RETURN_IF_ERROR(
      impl_->volume->Get(name, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()})
          .status());
  MEMASCEND_ASSIGN_OR_RETURN(CommitRecord r, DecodeCommitRecord(bytes));
  if (r.layout != layout_.Fingerprint()) {
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
  if (impl_->committer.joinable()) impl_->committer.join();
  return impl_->commit_status;  // once failed, the state stays failed
}

absl::StatusOr<std::optional<CommitRecord>> VersionedTrainingState::Resume(
    std::uint64_t fingerprint) {
  MEMASCEND_RETURN_IF_ERROR(Settle());
  MEMASCEND_ASSIGN_OR_RETURN(auto last, ReadRecord(impl_->options.record_name, fingerprint));
  if (!last.has_value()) return std::nullopt;
  current_ = last->first.version;
  impl_->last_record = std::move(last->second);
  return std::move(last->first);
}

absl::StatusOr<std::optional<CommitRecord>> VersionedTrainingState::ResumeAtMost(
    std::uint64_t fingerprint, std::uint64_t step) {
  MEMASCEND_ASSIGN_OR_RETURN(std::optional<CommitRecord> last, Resume(fingerprint));
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

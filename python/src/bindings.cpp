// memascend._core: the extension under the Python package. Thin over the public API:
// a failed absl::Status becomes a StatusError, turned by the translator below into the
// exception class of memascend.errors for its code (the only place a status becomes an
// exception). Tensors cross as addresses, element counts and dtype names, so the
// extension does not link libtorch and serves any PyTorch version; the Python layer
// (the memascend.torch package) checks that an address names a contiguous tensor of that size.
//
// Every call that does I/O or arithmetic releases the GIL. Lifetimes: a TensorStore
// holds its Volume (Python reference), an optimizer its TensorStore, a lease its store;
// closing one that something still uses is refused (kFailedPrecondition).
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <string>
#include <string_view>
#include <unistd.h>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <memascend/memascend.h>

#include "sim/plan.h"

namespace py = pybind11;

namespace memascend::python {
namespace {

struct StatusError {
  absl::Status status;
};

void Check(const absl::Status& s) {
  if (!s.ok()) throw StatusError{s};
}
template <typename T>
T Take(absl::StatusOr<T> v) {
  Check(v.status());
  return *std::move(v);
}

DType ParseDType(const std::string& name) {
  if (name == "float32" || name == "f32") return DType::kF32;
  if (name == "float16" || name == "f16") return DType::kF16;
  if (name == "bfloat16" || name == "bf16") return DType::kBF16;
  throw StatusError{absl::InvalidArgumentError(
      fmt::format("dtype '{}' is not one of float32, float16, bfloat16", name))};
}

StateKind ParseKind(const std::string& name) {
  if (name == "param") return StateKind::kParameters;
  if (name == "master") return StateKind::kMaster;
  if (name == "exp_avg") return StateKind::kExpAvg;
  if (name == "exp_avg_sq") return StateKind::kExpAvgSq;
  throw StatusError{absl::InvalidArgumentError(
      fmt::format("state kind '{}' is not one of param, master, exp_avg, exp_avg_sq", name))};
}

void* Address(std::uintptr_t a) { return reinterpret_cast<void*>(a); }

ArenaBacking ParseBacking(const std::string& name) {
  if (name == "auto") return ArenaBacking::kAuto;
  if (name == "cuda") return ArenaBacking::kCudaRegistered;
  if (name == "mlock") return ArenaBacking::kMlock;
  if (name == "unlocked") return ArenaBacking::kUnlocked;
  throw StatusError{absl::InvalidArgumentError(
      fmt::format("host_backing '{}' is not one of auto, cuda, mlock, unlocked", name))};
}

CudaStreamView Stream(std::uintptr_t handle) {
  return CudaStreamView(reinterpret_cast<void*>(handle));
}

// Note [forked child]: a volume, a store and an optimizer run threads of their own (I/O,
// kernels, commits), which fork() does not copy, over a volume the parent still writes. A
// forked child (a DataLoader worker, multiprocessing) that closed or destroyed its copy
// would wait for threads it does not have, or for locks they held at the fork, or commit
// into its parent's volume: in a child a copy is never torn down. close() refuses, and
// the destructor leaves it (the child's memory goes with the child).
class MadeHere {
 public:
  bool forked() const { return ::getpid() != pid_; }
  void RefuseInChild(std::string_view what) const {
    if (forked()) {
      throw StatusError{absl::FailedPreconditionError(
          fmt::format("{} was opened by process {}, which this one was forked from: closed "
                      "here it would write into that process's volume; close it there",
                      what, pid_))};
    }
  }

 private:
  pid_t pid_ = ::getpid();
};

// ---- Volume -------------------------------------------------------------------------------

class PyVolume {
 public:
  explicit PyVolume(std::unique_ptr<Volume> v, std::string path)
      : volume_(std::move(v)), path_(std::move(path)) {}
  ~PyVolume() {
    if (made_.forked()) (void)volume_.release();  // Note [forked child]
  }
  PyVolume(const PyVolume&) = delete;
  PyVolume& operator=(const PyVolume&) = delete;

  Volume* get() const {
    if (!volume_) throw StatusError{absl::FailedPreconditionError("the volume is closed")};
    return volume_.get();
  }
  const std::string& path() const { return path_; }
  bool closed() const { return volume_ == nullptr; }
  void close() {
    if (!volume_) return;
    made_.RefuseInChild("the volume");
    if (users_ > 0) {
      throw StatusError{absl::FailedPreconditionError(fmt::format(
          "volume {}: {} tensor store(s) still open on it; close them first", path_, users_))};
    }
    py::gil_scoped_release nogil;
    volume_.reset();
  }
  int users_ = 0;

 private:
  MadeHere made_;
  std::unique_ptr<Volume> volume_;
  std::string path_;
};

py::dict VolumeStatsDict(const VolumeStats& s) {
  py::dict d;
  d["uuid"] = s.uuid;
  d["capacity_bytes"] = s.capacity_bytes;
  d["data_bytes"] = s.data_bytes;
  d["used_bytes"] = s.used_bytes;
  d["free_bytes"] = s.free_bytes;
  d["largest_free_extent_bytes"] = s.largest_free_extent_bytes;
  d["unit_bytes"] = s.unit_bytes;
  d["objects"] = s.objects;
  d["durable_objects"] = s.durable_objects;
  d["commits"] = s.commits;
  return d;
}

// ---- TensorStore --------------------------------------------------------------------------

class PyStore {
 public:
  PyStore(py::object volume, const TensorStoreOptions& options) : volume_obj_(std::move(volume)) {
    volume_ = volume_obj_.cast<PyVolume*>();
    Volume* v = volume_->get();
    {
      py::gil_scoped_release nogil;
      store_ = Take(TensorStore::Open(v, options));
    }
    ++volume_->users_;
    budget_ = options.host_budget_bytes;
    locked_ = options.host_backing != ArenaBacking::kUnlocked;
  }
  ~PyStore() {
    if (made_.forked()) {  // Note [forked child]
      (void)store_.release();
      return;
    }
    if (store_) {
      try {
        close();
      } catch (...) {  // the store's destructor reports what it could not write back
      }
    }
  }
  TensorStore* get() const {
    if (!store_) throw StatusError{absl::FailedPreconditionError("the tensor store is closed")};
    return store_.get();
  }
  PyVolume* volume() const { return volume_; }
  std::size_t budget() const { return budget_; }
  bool locked() const { return locked_; }
  bool closed() const { return store_ == nullptr; }

  void close() {
    if (!store_) return;
    made_.RefuseInChild("the tensor store");
    if (leases_ > 0 || users_ > 0) {
      throw StatusError{absl::FailedPreconditionError(
          fmt::format("tensor store: {} lease(s) and {} optimizer(s) still use it; release and "
                      "close them first",
                      leases_, users_))};
    }
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = store_->Close();
      store_.reset();
    }
    --volume_->users_;
    Check(s);
  }

  int leases_ = 0;
  int users_ = 0;

 private:
  MadeHere made_;
  py::object volume_obj_;
  PyVolume* volume_ = nullptr;
  std::unique_ptr<TensorStore> store_;
  std::size_t budget_ = 0;
  bool locked_ = true;  // page-locked or CUDA-registered; false: ordinary memory
};

py::dict StoreStatsDict(const TensorStoreStats& s) {
  py::dict d;
  d["tensors"] = s.tensors;
  d["resident"] = s.resident;
  d["resident_bytes"] = s.resident_bytes;
  d["bytes_read"] = s.bytes_read;
  d["bytes_written"] = s.bytes_written;
  d["read_seconds"] = s.read_seconds;
  d["write_seconds"] = s.write_seconds;
  // Time callers waited in Acquire (a read, room, a part being written back).
  d["stall_seconds"] = s.stall_seconds;
  d["prefetch_hits"] = s.prefetch_hits;
  d["prefetch_misses"] = s.prefetch_misses;
  d["evictions"] = s.evictions;
  d["write_backs"] = s.write_backs;
  d["discards"] = s.discards;
  d["gpu_resident_bytes"] = s.gpu_resident_bytes;
  d["bytes_to_gpu"] = s.bytes_to_gpu;
  // Page-locked host bytes the store holds (the arena), now and at most: within the budget.
  const LedgerCounters& pinned = s.ledger.tier(Tier::kPinnedHost);
  d["pinned_bytes"] = pinned.reserved;
  d["pinned_peak_bytes"] = pinned.reserved_peak;
  d["pinned_live_peak_bytes"] = pinned.live_peak;
  return d;
}

// A tensor held resident; its bytes are a Python buffer while it is held.
class PyLease {
 public:
  PyLease(py::object store, TensorLease lease, bool writable)
      : store_obj_(std::move(store)), lease_(std::move(lease)), writable_(writable) {
    store_ = store_obj_.cast<PyStore*>();
    ++store_->leases_;
  }
  ~PyLease() {
    if (held_ && made_.forked()) {  // Note [forked child]: its store is left as it is
      held_ = false;
      (void)new TensorLease(std::move(lease_));
    }
    release();
  }
  void release() {
    if (!held_) return;
    made_.RefuseInChild("the lease's tensor store");
    held_ = false;
    lease_.Release();
    --store_->leases_;
  }
  bool held() const { return held_; }
  std::byte* data() const {
    if (!held_) throw StatusError{absl::FailedPreconditionError("the lease was released")};
    return lease_.data();
  }
  std::size_t size() const { return lease_.size(); }
  bool writable() const { return writable_; }

 private:
  py::object store_obj_;
  PyStore* store_ = nullptr;
  MadeHere made_;
  TensorLease lease_;
  bool writable_;
  bool held_ = true;
};

// ---- the offloaded optimizer --------------------------------------------------------------

// The layout of (name, elements) groups as memascend.torch gives them. fp32 parameters are
// their master weights: derived, not stored twice, unless asked for (the device path
// copies stored parameters to the GPU).
StateLayout PyLayout(const std::vector<std::pair<std::string, std::size_t>>& groups,
                     const std::string& param_dtype, const std::string& grad_dtype,
                     std::size_t part_elements, std::optional<bool> store_parameters) {
  StateLayout layout;
  for (const auto& [name, n] : groups) layout.groups.push_back({name, n, true});
  layout.param_dtype = ParseDType(param_dtype);
  layout.grad_dtype = ParseDType(grad_dtype);
  layout.part_elements = part_elements;
  if (!store_parameters.value_or(layout.param_dtype != DType::kF32)) {
    for (StateGroup& g : layout.groups) g.store_parameters = false;
  }
  return layout;
}

// memascend Note [global gradient check] through a Python callable (torch.distributed's
// all-reduce): fn(overflow, sum_squares) -> (overflow, sum_squares). EndBackward calls it
// without the GIL; the callable is called, and let go of, with it. A Python exception
// becomes a failed status: a memascend error keeps its code, anything else is kInternal.
std::function<absl::StatusOr<GradientCheck>(const GradientCheck&)> ReduceThroughPython(
    py::object fn) {
  std::shared_ptr<py::object> held(new py::object(std::move(fn)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
  return [held](const GradientCheck& mine) -> absl::StatusOr<GradientCheck> {
    py::gil_scoped_acquire gil;
    try {
      const py::tuple r = (*held)(mine.overflow, mine.sum_squares);
      if (r.size() != 2) {
        return absl::InternalError("reduce_gradient_check returned a tuple of " +
                                   std::to_string(r.size()) + ", not (overflow, sum_squares)");
      }
      return GradientCheck{r[0].cast<bool>(), r[1].cast<double>()};
    } catch (py::error_already_set& e) {
      // Ctrl-C in a stuck collective: kCancelled (CancelledError), not an internal error.
      if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit))
        return absl::CancelledError(std::string("the ranks' gradient check: ") + e.what());
      absl::StatusCode code = absl::StatusCode::kInternal;
      if (py::hasattr(e.value(), "code")) {
        const py::object c = e.value().attr("code");
        if (py::isinstance<py::int_>(c)) {  // a memascend error's StatusCode
          const long v = c.cast<long>();
          if (v > 0 && v <= 16) code = static_cast<absl::StatusCode>(v);
        }
      }
      return absl::Status(code, std::string("the ranks' gradient check: ") + e.what());
    } catch (const std::exception& e) {  // a result that is not (bool, float)
      return absl::InternalError(std::string("reduce_gradient_check's result: ") + e.what());
    }
  };
}

class PyAdam {
 public:
  PyAdam(py::object store, const std::vector<std::pair<std::string, std::size_t>>& groups,
         const std::string& param_dtype, const std::string& grad_dtype, std::size_t part_elements,
         const std::vector<float>& lrs, const std::vector<float>& weight_decays, float beta1,
         float beta2, float eps, float max_grad_norm, bool dynamic_loss_scale, float initial_scale,
         std::uint64_t fingerprint, std::size_t read_ahead_bytes, int threads,
         std::optional<bool> store_parameters, bool replace_existing, bool data_parallel,
         std::uint32_t commit_every, py::object reduce_gradient_check, bool stage_whole_step)
      : store_obj_(std::move(store)) {
    store_ = store_obj_.cast<PyStore*>();
    const StateLayout layout =
        PyLayout(groups, param_dtype, grad_dtype, part_elements, store_parameters);
    Check(layout.Validate());
    const std::size_t minimum = OffloadedAdam::MinimumHostBudget(layout);
    if (store_->budget() < minimum) {
      throw StatusError{absl::InvalidArgumentError(fmt::format(
          "host budget {} bytes is below the least, {} bytes: twice what one part needs at "
          "once (gradient, parameters, master weights and both moments of {} elements; the "
          "second set is room against fragmentation); raise host_budget or lower "
          "part_elements",
          store_->budget(), minimum, layout.MaxPartElements()))};
    }
    if (lrs.size() != groups.size() || weight_decays.size() != groups.size())
      throw StatusError{absl::InvalidArgumentError("one lr and weight decay per group")};
    OffloadedAdamOptions o;
    for (std::size_t g = 0; g < groups.size(); ++g) o.groups.push_back({lrs[g], weight_decays[g]});
    o.beta1 = beta1;
    o.beta2 = beta2;
    o.eps = eps;
    o.max_grad_norm = max_grad_norm;
    o.fingerprint = fingerprint;
    o.read_ahead_bytes = read_ahead_bytes;
    if (!reduce_gradient_check.is_none()) {
      o.reduce_gradient_check = ReduceThroughPython(std::move(reduce_gradient_check));
    }
    if (dynamic_loss_scale) {
      o.scaler = DynamicLossScaler::Options{};
      o.scaler.initial_scale = initial_scale;
    } else {  // a fixed scale of 1: gradients as they are, or scaled by an outside scaler
      o.scaler.initial_scale = 1.0f;
      o.scaler.min_scale = 1.0f;
      o.scaler.growth_interval = INT64_MAX;
    }
    if (threads < 1) throw StatusError{absl::InvalidArgumentError("threads must be >= 1")};
    TensorStore* s = store_->get();
    Volume* v = store_->volume()->get();
    {
      py::gil_scoped_release nogil;
      threads_ = std::make_unique<KernelThreads>(threads);
      VersionedTrainingStateOptions vo =
          VersionedTrainingStateOptions::ForTrainer(data_parallel, commit_every, stage_whole_step);
      vo.replace_existing = replace_existing;  // Note [state ownership]
      state_ = Take(VersionedTrainingState::Open(s, v, layout, vo));
      adam_ = Take(OffloadedAdam::Create(state_.get(), o, threads_.get()));
    }
    ++store_->users_;
  }
  ~PyAdam() {
    if (made_.forked()) {  // Note [forked child]
      (void)adam_.release();
      (void)state_.release();
      (void)threads_.release();
      return;
    }
    try {
      close();
    } catch (...) {  // a failed commit was reported by settle(); nothing more to say here
    }
  }
  void close() {
    if (!adam_) return;
    made_.RefuseInChild("the optimizer's state");
    if (device_users_ > 0) {
      throw StatusError{absl::FailedPreconditionError(fmt::format(
          "the optimizer: {} device parameter or gradient object(s) still use it; close them "
          "first",
          device_users_))};
    }
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      // Note [commit interval]: every step durable; mid-update (a failed update) the
      // state's destruction commits the steps in memory with the step torn.
      s = state_->in_update() ? adam_->Settle() : adam_->Persist();
      adam_.reset();
      state_.reset();
      threads_.reset();
    }
    --store_->users_;
    Check(s);
  }
  OffloadedAdam* get() const {
    if (!adam_) throw StatusError{absl::FailedPreconditionError("the optimizer is closed")};
    return adam_.get();
  }

  // The last commit, or the newest at or before `at_most` (a data-parallel rank's).
  std::optional<py::dict> resume(std::optional<std::uint64_t> at_most) {
    std::optional<CommitRecord> r;
    OffloadedAdam* a = get();
    {
      py::gil_scoped_release nogil;
      r = Take(at_most ? a->ResumeAtMost(*at_most) : a->Resume());
    }
    if (!r) return std::nullopt;
    py::dict d;
    d["step"] = r->step;
    d["adam_step"] = r->adam_step;
    d["loss_scale"] = r->scaler.scale;
    d["user"] = py::bytes(r->user);
    return d;
  }

  py::dict end_backward(double lr_factor) {
    OffloadedAdam* a = get();
    StepPlan plan;
    {
      py::gil_scoped_release nogil;
      plan = Take(a->EndBackward(lr_factor));
    }
    py::dict d;
    d["skipped"] = plan.skipped;
    d["grad_norm"] = plan.grad_norm;
    d["loss_scale"] = plan.loss_scale;
    d["adam_step"] = plan.adam.step;
    return d;
  }

  py::dict stats() const {
    OffloadedAdam* a = get();
    py::dict d;
    d["io_read_bytes"] = a->storage()->io_read_bytes();
    d["io_write_bytes"] = a->storage()->io_write_bytes();
    if (auto s = a->storage()->store_stats()) d["store"] = StoreStatsDict(*s);
    d["skipped_steps"] = a->scaler().skipped_steps();
    d["durable_step"] = state_->durable_step();  // Note [commit interval]
    d["deferred_steps"] = state_->deferred_steps();
    // 0: a version staged whole (Note [commit interval])
    d["max_staged_bytes"] = state_->options().max_staged_bytes;
    const OffloadedAdam::Times& t = a->times();  // Note [step times]
    py::dict seconds;
    seconds["gradients"] = t.gradients;
    seconds["end_backward"] = t.end_backward;
    seconds["update"] = t.update;
    seconds["update_kernels"] = t.update_kernels;
    seconds["commit"] = t.commit;
    d["seconds"] = seconds;
    return d;
  }

  int device_users_ = 0;

 private:
  MadeHere made_;
  py::object store_obj_;
  PyStore* store_ = nullptr;
  std::unique_ptr<KernelThreads> threads_;
  std::unique_ptr<VersionedTrainingState> state_;
  std::unique_ptr<OffloadedAdam> adam_;
};

// Runs `f` on the optimizer without the GIL, raising its status.
template <typename F>
void NoGil(PyAdam& self, F&& f) {
  OffloadedAdam* a = self.get();
  absl::Status s;
  {
    py::gil_scoped_release nogil;
    s = f(a);
  }
  Check(s);
}

// ---- the device paths (memascend/device_training.h) ------------------------------------

// Holds its optimizer (a Python reference) and is counted as one of its users, so the
// optimizer cannot close under it.
template <typename Sdk>
class PyDevice {
 public:
  explicit PyDevice(py::object adam) : adam_obj_(std::move(adam)) {
    adam_ = adam_obj_.cast<PyAdam*>();
    ++adam_->device_users_;
  }
  ~PyDevice() {
    if (made_.forked()) (void)sdk_.release();  // Note [forked child]
    close();
  }
  PyDevice(const PyDevice&) = delete;
  PyDevice& operator=(const PyDevice&) = delete;
  Sdk* get() const {
    if (!sdk_) throw StatusError{absl::FailedPreconditionError("closed")};
    return sdk_.get();
  }
  OffloadedAdam* adam() const { return adam_->get(); }
  void set(std::unique_ptr<Sdk> sdk) { sdk_ = std::move(sdk); }
  void close() {
    if (sdk_) {
      made_.RefuseInChild("the device path");
      py::gil_scoped_release nogil;
      sdk_.reset();  // waits for its copies
    }
    if (counted_) {  // also when Create failed: the object never worked
      counted_ = false;
      --adam_->device_users_;
    }
  }
  bool closed() const { return sdk_ == nullptr; }

 private:
  MadeHere made_;
  py::object adam_obj_;
  PyAdam* adam_ = nullptr;
  bool counted_ = true;
  std::unique_ptr<Sdk> sdk_;
};
using PyDeviceParameters = PyDevice<DeviceParameters>;
using PyDeviceGradients = PyDevice<DeviceGradients>;

template <typename F>
auto NoGilTake(F&& f) {
  py::gil_scoped_release nogil;
  return f();
}

}  // namespace
}  // namespace memascend::python

PYBIND11_MODULE(_core, m) {
  using namespace memascend;          // NOLINT(google-build-using-namespace)
  using namespace memascend::python;  // NOLINT(google-build-using-namespace)
  m.doc() = "MemAscend's C++ SDK (the extension under the memascend package)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object errors = py::module_::import("memascend.errors");
      py::object exc = errors.attr("from_status")(static_cast<int>(e.status.code()),
                                                  std::string(e.status.message()));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def("version", [] { return std::string(VersionString()); });
  m.def("system_info_json", [] {
    py::gil_scoped_release nogil;
    return ToJson(ProbeSystem());
  });
  // memascend Note [default host budget]: a dict {bytes, locked, given, reason, warning}.
  m.def(
      "choose_host_budget",
      [](std::uint64_t minimum, std::uint64_t maximum, std::uint64_t other, bool cuda,
         std::uint64_t given) {
        HostBudgetRequest r;
        r.minimum_bytes = minimum;
        r.maximum_bytes = maximum;
        r.other_bytes = other;
        r.backing = cuda ? HostBackingKind::kCudaRegistered : HostBackingKind::kMlock;
        r.given_bytes = given;
        HostBudget b;
        {
          py::gil_scoped_release nogil;
          b = Take(ChooseHostBudget(r));
        }
        py::dict d;
        d["bytes"] = b.bytes;
        d["locked"] = b.locked;
        d["given"] = b.given;
        d["reason"] = b.reason;
        d["warning"] = b.warning;
        return d;
      },
      py::arg("minimum"), py::arg("maximum"), py::arg("other"), py::arg("cuda") = false,
      py::arg("given") = 0);
  m.def("dtype_size", [](const std::string& d) { return SizeOf(ParseDType(d)); });
  // tools/sim/plan.h: MakePlan, as `memascend plan --json` prints it (memascend.plan()).
  m.def(
      "plan_json",
      [](const std::string& config_json, std::uint64_t params, std::uint64_t layers,
         std::uint64_t hidden, std::uint64_t heads, std::uint64_t vocab, std::uint64_t seq,
         std::uint64_t batch, const std::string& dtype, std::uint64_t part_elements,
         bool checkpoint_activations, std::uint64_t host_limit, std::uint64_t host_budget,
         std::uint64_t gpu_memory, std::uint64_t base_rss) {
        PlanRequest r;
        if (!config_json.empty()) {
          r.model = Take(ParsePlanConfig(config_json, "config"));
        } else {
          if (params != 0) {
            r.model.arch = PlanArch::kParams;
            r.model.params = params;
            r.model.layers = 1;
            r.model.vocab = 0;
          }
          if (layers != 0) r.model.layers = layers;
          if (hidden != 0) r.model.hidden = hidden;
          if (heads != 0) r.model.heads = heads;
          if (vocab != 0) r.model.vocab = vocab;
        }
        r.seq = seq;
        r.batch = batch;
        const DType d = ParseDType(dtype);
        r.dtype = d;
        r.part_elements = static_cast<std::size_t>(part_elements);
        r.checkpoint_activations = checkpoint_activations;
        r.host_limit_bytes = host_limit;
        r.host_budget_bytes = host_budget;
        r.gpu_memory_bytes = gpu_memory;
        r.base_rss_bytes = base_rss;
        py::gil_scoped_release nogil;
        return PlanJson(Take(MakePlan(r)));
      },
      py::arg("config_json") = "", py::arg("params") = 0, py::arg("layers") = 0,
      py::arg("hidden") = 0, py::arg("heads") = 0, py::arg("vocab") = 0, py::arg("seq") = 64,
      py::arg("batch") = 8, py::arg("dtype") = "float16", py::arg("part_elements") = 1u << 20,
      py::arg("checkpoint_activations") = false, py::arg("host_limit") = 0,
      py::arg("host_budget") = 0, py::arg("gpu_memory") = 0,
      py::arg("base_rss") = std::uint64_t{256} << 20);

  // ---- Volume
  py::class_<PyVolume>(m, "Volume")
      .def_static(
          "open_or_create",
          [](const std::string& path, std::uint64_t size, std::uint32_t unit_bytes) {
            VolumeFormatOptions f;
            f.size = size;
            f.unit_bytes = unit_bytes;
            std::unique_ptr<Volume> v;
            {
              py::gil_scoped_release nogil;
              v = Take(Volume::OpenOrCreate(path, f));
            }
            return std::make_unique<PyVolume>(std::move(v), path);
          },
          py::arg("path"), py::arg("size"), py::arg("unit_bytes") = 64 * 1024)
      .def_static(
          "open",
          [](const std::string& path, bool verify_checksums, bool allow_data_loss) {
            VolumeOpenOptions o;
            o.verify_checksums = verify_checksums;
            o.allow_data_loss = allow_data_loss;
            std::unique_ptr<Volume> v;
            {
              py::gil_scoped_release nogil;
              v = Take(Volume::Open(path, o));
            }
            return std::make_unique<PyVolume>(std::move(v), path);
          },
          py::arg("path"), py::arg("verify_checksums") = true, py::arg("allow_data_loss") = false)
      .def_static(
          "format",
          [](const std::string& path, std::uint64_t size, bool force) {
            VolumeFormatOptions f;
            f.size = size;
            f.force = force;
            py::gil_scoped_release nogil;
            Check(Volume::Format(path, f));
          },
          py::arg("path"), py::arg("size"), py::arg("force") = false)
      .def_property_readonly("path", &PyVolume::path)
      .def_property_readonly("closed", &PyVolume::closed)
      .def("stats", [](const PyVolume& v) { return VolumeStatsDict(v.get()->stats()); })
      .def("objects",
           [](const PyVolume& v) {
             py::list out;
             for (const ObjectInfo& o : v.get()->List()) {
               py::dict d;
               d["name"] = o.name;
               d["size"] = o.size;
               d["durable"] = o.durability == Durability::kDurable;
               out.append(d);
             }
             return out;
           })
      .def(
          "fsck",
          [](const PyVolume& v, bool verify_data) {
            FsckReport r;
            Volume* vol = v.get();
            {
              py::gil_scoped_release nogil;
              r = Take(vol->Fsck(verify_data));
            }
            py::dict d;
            d["clean"] = r.clean;
            d["objects"] = r.objects;
            d["errors"] = r.errors;
            d["warnings"] = r.warnings;
            return d;
          },
          py::arg("verify_data") = false)
      .def("close", &PyVolume::close);

  // ---- TensorStore
  py::class_<PyStore>(m, "TensorStore")
      .def(py::init([](py::object volume, std::size_t host_budget, std::size_t gpu_budget,
                       bool defer_prefetches, bool write_behind, const std::string& host_backing,
                       std::size_t write_back_depth, int prefetch_threads) {
             TensorStoreOptions o;
             o.prefetch_threads = prefetch_threads;
             o.host_budget_bytes = host_budget;
             o.gpu_budget_bytes = gpu_budget;
             o.defer_prefetches = defer_prefetches;
             o.write_behind = write_behind;
             o.write_back_depth = write_back_depth;
             // Note [store backing]: auto past RLIMIT_MEMLOCK is unlocked, with one
             // MemlockWarning; an explicit mlock past it is refused here.
             StoreBacking b =
                 Take(ChooseStoreBacking(ParseBacking(host_backing), host_budget, gpu_budget > 0));
             o.host_backing = b.backing;
             if (!b.warning.empty()) {
               py::object category = py::module_::import("memascend.errors").attr("MemlockWarning");
               if (PyErr_WarnEx(category.ptr(), b.warning.c_str(), 1) != 0)
                 throw py::error_already_set();
             }
             return std::make_unique<PyStore>(std::move(volume), o);
           }),
           py::arg("volume"), py::arg("host_budget"), py::arg("gpu_budget") = 0,
           py::arg("defer_prefetches") = true, py::arg("write_behind") = false,
           py::arg("host_backing") = "auto", py::arg("write_back_depth") = 0,
           py::arg("prefetch_threads") = TensorStoreOptions{}.prefetch_threads,
           "host_backing: 'auto' (registered with CUDA when the store has a GPU tier and a "
           "device is present, else mlock'ed; when RLIMIT_MEMLOCK, without CAP_IPC_LOCK, is "
           "below host_budget, ordinary unlocked memory and one "
           "memascend.errors.MemlockWarning), 'cuda' (registered with CUDA: copies to and "
           "from a GPU are true DMA), 'mlock' (refused with ResourceExhaustedError when "
           "host_budget is above RLIMIT_MEMLOCK) or 'unlocked' (ordinary memory). "
           "write_back_depth: tensors a flush or commit writes back at once (0: the SDK's "
           "default, 8; at most 256).")
      .def_property_readonly("closed", &PyStore::closed)
      .def_property_readonly("host_budget", &PyStore::budget)
      .def_property_readonly("host_budget_locked", &PyStore::locked)
      .def(
          "register",
          [](PyStore& s, const std::string& name, std::size_t nbytes, const std::string& dtype,
             std::vector<std::int64_t> shape, bool durable) {
            TensorSpec spec;
            spec.name = name;
            spec.bytes = nbytes;
            spec.dtype = ParseDType(dtype);
            spec.shape = std::move(shape);
            spec.use = durable ? Use::kParameters : Use::kActivations;
            spec.durability = durable ? Durability::kDurable : Durability::kScratch;
            return Take(s.get()->Register(spec));
          },
          py::arg("name"), py::arg("nbytes"), py::arg("dtype") = "float32",
          py::arg("shape") = std::vector<std::int64_t>{}, py::arg("durable") = true)
      .def("find",
           [](const PyStore& s, const std::string& name) { return Take(s.get()->Find(name)); })
      .def("nbytes", [](const PyStore& s, TensorId id) { return Take(s.get()->Spec(id)).bytes; })
      .def("stored_tensors", [](const PyStore& s) { return s.get()->StoredTensors(); })
      .def(
          "acquire",
          [](py::object self, TensorId id, bool write, bool overwrite) {
            PyStore* s = self.cast<PyStore*>();
            TensorStore* store = s->get();
            TensorLease lease;
            {
              py::gil_scoped_release nogil;
              lease = Take(overwrite ? store->AcquireForOverwrite(id)
                           : write   ? store->AcquireForWrite(id)
                                     : store->AcquireForRead(id));
            }
            return std::make_unique<PyLease>(self, std::move(lease), write || overwrite);
          },
          py::arg("id"), py::arg("write") = false, py::arg("overwrite") = false,
          "A lease on the tensor's pinned bytes. write: they will change (written back before "
          "reuse); overwrite: every byte will be written, so a cold tensor is not read first. "
          "Without either the lease is for reading (its buffer is read-only): it does not wait "
          "for a write-back under way, whose put may still be reading the bytes, so nothing may "
          "be written at its address.")
      .def(
          "write_from",
          [](const PyStore& s, TensorId id, std::uintptr_t address, std::size_t nbytes) {
            TensorStore* store = s.get();
            py::gil_scoped_release nogil;
            TensorLease lease = Take(store->AcquireForOverwrite(id));
            if (lease.size() != nbytes) {
              throw StatusError{absl::InvalidArgumentError(
                  fmt::format("tensor {} holds {} bytes, not {}", id, lease.size(), nbytes))};
            }
            std::memcpy(lease.data(), Address(address), nbytes);
          },
          py::arg("id"), py::arg("address"), py::arg("nbytes"),
          "Copies `nbytes` at host `address` into the tensor (every byte).")
      .def(
          "read_into",
          [](const PyStore& s, TensorId id, std::uintptr_t address, std::size_t nbytes) {
            TensorStore* store = s.get();
            py::gil_scoped_release nogil;
            TensorLease lease = Take(store->AcquireForRead(id));
            if (lease.size() != nbytes) {
              throw StatusError{absl::InvalidArgumentError(
                  fmt::format("tensor {} holds {} bytes, not {}", id, lease.size(), nbytes))};
            }
            std::memcpy(Address(address), lease.data(), nbytes);
          },
          py::arg("id"), py::arg("address"), py::arg("nbytes"),
          "Copies the tensor's bytes to host `address`.")
      .def("write",
           [](const PyStore& s, TensorId id, py::buffer b) {
             py::buffer_info info = b.request();
             const std::size_t n = static_cast<std::size_t>(info.size * info.itemsize);
             TensorStore* store = s.get();
             const void* src = info.ptr;
             py::gil_scoped_release nogil;
             TensorLease lease = Take(store->AcquireForOverwrite(id));
             if (lease.size() != n) {
               throw StatusError{absl::InvalidArgumentError(
                   fmt::format("tensor {} holds {} bytes, the buffer {}", id, lease.size(), n))};
             }
             std::memcpy(lease.data(), src, n);
           })
      .def("read",
           [](const PyStore& s, TensorId id) {
             TensorStore* store = s.get();
             std::string out;
             {
               py::gil_scoped_release nogil;
               TensorLease lease = Take(store->AcquireForRead(id));
               out.assign(reinterpret_cast<const char*>(lease.data()), lease.size());
             }
             return py::bytes(out);
           })
      .def("prefetch", [](const PyStore& s, TensorId id) { s.get()->Prefetch(id); })
      .def("evict", [](const PyStore& s, TensorId id) { Check(s.get()->Evict(id)); })
      .def("discard", [](const PyStore& s, TensorId id) { Check(s.get()->Discard(id)); })
      .def("flush",
           [](const PyStore& s) {
             TensorStore* store = s.get();
             py::gil_scoped_release nogil;
             Check(store->Flush());
           })
      .def("stats", [](const PyStore& s) { return StoreStatsDict(s.get()->stats()); })
      .def("close", &PyStore::close);

  py::class_<PyLease>(m, "Lease", py::buffer_protocol())
      .def_buffer([](PyLease& l) {
        return py::buffer_info(l.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(l.size())}, {1}, !l.writable());
      })
      .def_property_readonly(
          "address", [](const PyLease& l) { return reinterpret_cast<std::uintptr_t>(l.data()); })
      .def_property_readonly("nbytes", &PyLease::size)
      .def_property_readonly("held", &PyLease::held)
      .def("release", &PyLease::release);

  // ---- the offloaded optimizer (memascend.torch.OffloadedAdamW drives it)
  py::class_<PyAdam>(m, "OffloadedAdam")
      .def(py::init<py::object, const std::vector<std::pair<std::string, std::size_t>>&,
                    const std::string&, const std::string&, std::size_t, const std::vector<float>&,
                    const std::vector<float>&, float, float, float, float, bool, float,
                    std::uint64_t, std::size_t, int, std::optional<bool>, bool, bool, std::uint32_t,
                    py::object, bool>(),
           py::arg("store"), py::arg("groups"), py::arg("param_dtype"), py::arg("grad_dtype"),
           py::arg("part_elements"), py::arg("lrs"), py::arg("weight_decays"), py::arg("beta1"),
           py::arg("beta2"), py::arg("eps"), py::arg("max_grad_norm"),
           py::arg("dynamic_loss_scale"), py::arg("initial_scale"), py::arg("fingerprint"),
           py::arg("read_ahead_bytes"), py::arg("threads"),
           py::arg("store_parameters") = std::nullopt, py::arg("replace_existing") = false,
           py::arg("data_parallel") = false, py::arg("commit_every") = 1,
           py::arg("reduce_gradient_check") = py::none(), py::arg("stage_whole_step") = false,
           "reduce_gradient_check: None, or fn(overflow, sum_squares) -> (overflow, "
           "sum_squares) of every rank together (memascend Note [global gradient check]), "
           "called by end_backward on every rank. stage_whole_step: each step staged whole "
           "and committed once (Note [commit interval]), not in batches within a bound.")
      .def_static("minimum_host_budget",
                  [](std::size_t max_group_elements, std::size_t part_elements,
                     const std::string& param, const std::string& grad) {
                    StateLayout l;
                    l.groups = {{"g", max_group_elements, true}};
                    l.param_dtype = ParseDType(param);
                    l.grad_dtype = ParseDType(grad);
                    l.part_elements = part_elements;
                    return OffloadedAdam::MinimumHostBudget(l);
                  })
      .def_static(
          "stored_bytes",
          [](const std::vector<std::pair<std::string, std::size_t>>& groups,
             const std::string& param, const std::string& grad, std::size_t part,
             std::optional<bool> store_parameters, bool data_parallel) {
            const StateLayout l = PyLayout(groups, param, grad, part, store_parameters);
            // In place (Note [state in place]), but for data-parallel ranks: two versions.
            return VersionedTrainingState::StoredBytes(l, !data_parallel);
          },
          py::arg("groups"), py::arg("param_dtype"), py::arg("grad_dtype"),
          py::arg("part_elements"), py::arg("store_parameters") = std::nullopt,
          py::arg("data_parallel") = false)
      .def_static(
          "volume_bytes",
          [](const std::vector<std::pair<std::string, std::size_t>>& groups,
             const std::string& param, const std::string& grad, std::size_t part,
             std::optional<bool> store_parameters, bool data_parallel, std::uint32_t commit_every,
             bool stage_whole_step) {
            const StateLayout l = PyLayout(groups, param, grad, part, store_parameters);
            return VersionedTrainingState::VolumeBytes(  // Note [volume size]
                l, VersionedTrainingStateOptions::ForTrainer(data_parallel, commit_every,
                                                             stage_whole_step));
          },
          py::arg("groups"), py::arg("param_dtype"), py::arg("grad_dtype"),
          py::arg("part_elements"), py::arg("store_parameters") = std::nullopt,
          py::arg("data_parallel") = false, py::arg("commit_every") = 1,
          py::arg("stage_whole_step") = false)
      .def("resume", &PyAdam::resume, py::arg("at_most") = std::nullopt)
      .def("initialize",
           [](PyAdam& self, std::size_t g, std::uintptr_t address, std::size_t n,
              const std::string& dtype) {
             const DType d = ParseDType(dtype);
             NoGil(self, [&](OffloadedAdam* a) {
               return a->InitializeFrom(g, TensorView{Address(address), n, d});
             });
           })
      .def(
          "begin_backward", [](PyAdam& self, float scale) { self.get()->BeginBackward(scale); },
          py::arg("gradient_scale") = 0.0f)
      .def("set_gradient",
           [](PyAdam& self, std::size_t g, std::uintptr_t address, std::size_t n,
              const std::string& dtype) {
             const DType d = ParseDType(dtype);
             NoGil(self, [&](OffloadedAdam* a) -> absl::Status {
               const StateLayout& l = a->layout();
               if (g >= l.groups.size())
                 return absl::OutOfRangeError(fmt::format("no group {}", g));
               if (n != l.groups[g].elements) {
                 return absl::InvalidArgumentError(
                     fmt::format("group '{}' has {} elements, the gradient {}", l.groups[g].name,
                                 l.groups[g].elements, n));
               }
               for (std::size_t p = 0; p < l.Parts(g); ++p) {
                 const auto [begin, end] = l.PartRange(g, p);
                 MEMASCEND_RETURN_IF_ERROR(a->SetGradient(
                     g, p,
                     {static_cast<const std::byte*>(Address(address)) + begin * SizeOf(d),
                      end - begin, d}));
               }
               return absl::OkStatus();
             });
           })
      .def("set_gradient_scale",
           [](PyAdam& self, float scale) { self.get()->SetGradientScale(scale); })
      .def("end_backward", &PyAdam::end_backward, py::arg("lr_factor") = 1.0)
      .def("read_ahead", [](PyAdam& self) { self.get()->ReadAheadForUpdate(); })
      .def(
          "update_group",
          [](PyAdam& self, std::size_t g, std::uintptr_t address, std::size_t n,
             const std::string& dtype) {
            const DType d = ParseDType(dtype);
            NoGil(self, [&](OffloadedAdam* a) {
              return a->UpdateGroup(g, MutableTensorView{Address(address), address ? n : 0, d});
            });
          },
          py::arg("group"), py::arg("address") = 0, py::arg("n") = 0, py::arg("dtype") = "float32")
      .def(
          "commit",
          [](PyAdam& self, std::uint64_t step, const py::bytes& user) {
            std::string u = user;
            // In the background (Note [commit durability]): settle() or the next commit waits.
            NoGil(self, [&](OffloadedAdam* a) { return a->CommitAsync(step, u).status(); });
          },
          py::arg("step"), py::arg("user") = py::bytes())
      .def("settle",
           [](PyAdam& self) { NoGil(self, [](OffloadedAdam* a) { return a->Settle(); }); })
      .def("persist",
           [](PyAdam& self) { NoGil(self, [](OffloadedAdam* a) { return a->Persist(); }); })
      .def("load_parameters",
           [](PyAdam& self, std::size_t g, std::uintptr_t address, std::size_t n,
              const std::string& dtype) {
             const DType d = ParseDType(dtype);
             NoGil(self, [&](OffloadedAdam* a) {
               return a->LoadParameters(g, MutableTensorView{Address(address), n, d});
             });
           })
      .def("prefetch_parameters",
           [](PyAdam& self, std::size_t g) {
             OffloadedAdam* a = self.get();
             py::gil_scoped_release nogil;
             a->PrefetchParameters(g);
           })
      .def("read_state",
           [](PyAdam& self, const std::string& kind, std::size_t g, std::uintptr_t address,
              std::size_t n, const std::string& dtype) {
             const StateKind k = ParseKind(kind);
             const DType d = ParseDType(dtype);
             NoGil(self, [&](OffloadedAdam* a) {
               return a->ReadState(k, g, MutableTensorView{Address(address), n, d});
             });
           })
      .def("write_state",
           [](PyAdam& self, const std::string& kind, std::size_t g, std::uintptr_t address,
              std::size_t n, const std::string& dtype) {
             const StateKind k = ParseKind(kind);
             const DType d = ParseDType(dtype);
             NoGil(self, [&](OffloadedAdam* a) {
               return a->WriteState(k, g, TensorView{Address(address), n, d});
             });
           })
      .def("set_adam_step",
           [](PyAdam& self, std::int64_t step) { Check(self.get()->SetAdamStep(step)); })
      .def("start_over", [](PyAdam& self) { Check(self.get()->StartOver()); })
      .def("set_group_options",
           [](PyAdam& self, std::size_t g, float lr, float weight_decay) {
             Check(self.get()->SetGroupOptions(g, {lr, weight_decay}));
           })
      .def_property_readonly("loss_scale",
                             [](const PyAdam& self) { return self.get()->loss_scale(); })
      .def_property_readonly("adam_step",
                             [](const PyAdam& self) { return self.get()->adam_step(); })
      .def_property_readonly("update_pending",
                             [](const PyAdam& self) { return self.get()->update_pending(); })
      .def("stats", &PyAdam::stats)
      .def("close", &PyAdam::close);

  // ---- the device paths (memascend.torch on CUDA drives them)
  py::class_<PyDeviceParameters>(m, "DeviceParameters")
      .def(py::init([](py::object adam, std::size_t device_budget, std::size_t read_ahead,
                       std::uintptr_t copy_stream, int device, bool emulate) {
             auto self = std::make_unique<PyDeviceParameters>(std::move(adam));
             DeviceParametersOptions o;
             o.device = device;
             o.device_budget_bytes = device_budget;
             o.read_ahead_bytes = read_ahead;
             o.copy_stream = Stream(copy_stream);
             o.emulate_on_host = emulate;
             OffloadedAdam* a = self->adam();
             self->set(Take(NoGilTake([&] { return DeviceParameters::Create(a, o); })));
             return self;
           }),
           py::arg("optimizer"), py::arg("device_budget"), py::arg("read_ahead") = 0,
           py::arg("copy_stream") = 0, py::arg("device") = 0, py::arg("emulate") = false)
      .def(
          "acquire",
          [](PyDeviceParameters& self, std::size_t g, std::uintptr_t stream, bool backward) {
            DeviceParameters* d = self.get();
            const DeviceView v = Take(NoGilTake([&] {
              return d->Acquire(g, Stream(stream),
                                backward ? PassDirection::kBackward : PassDirection::kForward);
            }));
            return py::make_tuple(reinterpret_cast<std::uintptr_t>(v.data), v.elements,
                                  std::string(ToString(v.dtype)));
          },
          py::arg("group"), py::arg("stream") = 0, py::arg("backward") = false,
          "(address, elements, dtype) of the group's parameters on the device, for work "
          "queued on `stream` after this call.")
      .def(
          "release",
          [](PyDeviceParameters& self, std::size_t g, std::uintptr_t stream) {
            DeviceParameters* d = self.get();
            Check(NoGilTake([&] { return d->Release(g, Stream(stream)); }));
          },
          py::arg("group"), py::arg("stream") = 0)
      .def("invalidate",
           [](PyDeviceParameters& self, std::size_t g) {
             DeviceParameters* d = self.get();
             Check(NoGilTake([&] { return d->Invalidate(g); }));
           })
      .def(
          "copy_to",
          [](PyDeviceParameters& self, std::size_t g, std::uintptr_t address,
             std::uintptr_t stream) {
            DeviceParameters* d = self.get();
            Check(NoGilTake([&] {
              return d->CopyTo(g, static_cast<std::byte*>(Address(address)), Stream(stream));
            }));
          },
          py::arg("group"), py::arg("address"), py::arg("stream") = 0)
      .def("synchronize",
           [](PyDeviceParameters& self) {
             DeviceParameters* d = self.get();
             Check(NoGilTake([&] { return d->Synchronize(); }));
           })
      .def("stats",
           [](const PyDeviceParameters& self) {
             const DeviceParametersStats s = self.get()->stats();
             py::dict d;
             d["acquires"] = s.acquires;
             d["hits"] = s.hits;
             d["misses"] = s.misses;
             d["read_ahead"] = s.read_ahead;
             d["evictions"] = s.evictions;
             d["invalidations"] = s.invalidations;
             d["bytes_to_device"] = s.bytes_to_device;
             d["copies"] = s.copies;
             d["resident_bytes"] = s.resident_bytes;
             d["peak_resident_bytes"] = s.peak_resident_bytes;
             d["recorded_groups"] = s.recorded_groups;
             d["copy_seconds"] = s.copy_seconds;
             d["acquire_seconds"] = s.acquire_seconds;
             d["read_seconds"] = s.read_seconds;
             d["copy_wait_seconds"] = s.copy_wait_seconds;
             return d;
           })
      .def_property_readonly("closed", &PyDeviceParameters::closed)
      .def("close", &PyDeviceParameters::close);

  py::class_<PyDeviceGradients>(m, "DeviceGradients")
      .def(py::init([](py::object adam, std::uintptr_t copy_stream, std::size_t max_inflight,
                       int device, bool emulate) {
             auto self = std::make_unique<PyDeviceGradients>(std::move(adam));
             DeviceGradientsOptions o;
             o.device = device;
             o.copy_stream = Stream(copy_stream);
             o.max_inflight_bytes = max_inflight;
             o.emulate_on_host = emulate;
             OffloadedAdam* a = self->adam();
             self->set(Take(NoGilTake([&] { return DeviceGradients::Create(a, o); })));
             return self;
           }),
           py::arg("optimizer"), py::arg("copy_stream") = 0, py::arg("max_inflight") = 0,
           py::arg("device") = 0, py::arg("emulate") = false)
      .def(
          "offload",
          [](PyDeviceGradients& self, std::size_t g, std::uintptr_t address, std::size_t n,
             const std::string& dtype, std::uintptr_t stream) {
            DeviceGradients* d = self.get();
            const DType t = ParseDType(dtype);
            Check(NoGilTake([&] {
              return d->Offload(g, TensorView{Address(address), n, t}, Stream(stream)).status();
            }));
          },
          py::arg("group"), py::arg("address"), py::arg("elements"), py::arg("dtype"),
          py::arg("stream") = 0,
          "Queues the group's gradient (device memory, made by work on `stream`) out to the "
          "store; keep the memory until `stream`'s later work or the copy stream has done.")
      .def("finish",
           [](PyDeviceGradients& self) {
             DeviceGradients* d = self.get();
             Check(NoGilTake([&] { return d->Finish(); }));
           })
      .def("stats",
           [](const PyDeviceGradients& self) {
             const DeviceGradientsStats s = self.get()->stats();
             py::dict d;
             d["groups"] = s.groups;
             d["parts"] = s.parts;
             d["bytes_from_device"] = s.bytes_from_device;
             d["waits"] = s.waits;
             return d;
           })
      .def_property_readonly("closed", &PyDeviceGradients::closed)
      .def("close", &PyDeviceGradients::close);
}

// memascend/device_training.h: training on a GPU with the state offloaded. Parameters go
// to the device and gradients come back asynchronously, on a copy stream the caller gives,
// through the pinned blocks of the optimizer's store, fenced by CUDA events.
//
//   cudaStream_t compute = ..., copy = ...;                    // the caller's streams
//   memascend::DeviceParametersOptions po;
//   po.device_budget_bytes = 2ull << 30;
//   po.copy_stream = memascend::CudaStreamView(copy);
//   MEMASCEND_ASSIGN_OR_RETURN(auto params, memascend::DeviceParameters::Create(adam, po));
//   MEMASCEND_ASSIGN_OR_RETURN(auto grads, memascend::DeviceGradients::Create(adam, go));
//   // forward, group by group:
//   MEMASCEND_ASSIGN_OR_RETURN(memascend::DeviceView w, params->Acquire(g, view, kForward));
//   Layer(w.data, ...);                                       // kernels on `compute`
//   MEMASCEND_RETURN_IF_ERROR(params->Release(g, view));
//   // backward, as each group's gradient is made on `compute`:
//   MEMASCEND_ASSIGN_OR_RETURN(auto fence, grads->Offload(g, {d_grad, n, kBF16}, view));
//   // d_grad may be reused once fence->Ready() (or by stream order, below)
//   MEMASCEND_RETURN_IF_ERROR(grads->Finish());               // then EndBackward, the update
//   for (g ...) params->Invalidate(g);                         // the update wrote new ones
//
// Note [device parameters]: the device tier of a training run. One device allocation of
// device_budget_bytes (cudaMalloc synchronises the device, so it is taken once) holds
// groups' 16-bit parameters, each group whole and contiguous, so a caller can use it as
// its weights. Acquire() makes a group resident: its stored parameter parts, in the
// store's pinned blocks (CUDA-registered when the store's arena is), are copied with
// cudaMemcpyAsync on the copy stream, an event is recorded after them, and the caller's
// compute stream waits for that event: the host never blocks on a copy. The host blocks
// are held until their copy's event completes. Release() records an event on the compute
// stream; the block may be reused once it completes, and a later copy into that memory
// first makes the copy stream wait for it (stream order again, no host wait).
//
// Note [parameter read-ahead]: the groups acquired in the first forward pass, in the order
// acquired and with their repeats (an output head tied to the embedding uses it twice), are
// the recorded pass (the first step's, as DeepSpeed's trace). The recording ends at the
// first backward acquire, or where a forward pass repeats it (its first two groups again:
// forward passes alone, an evaluation); a group a later forward pass meets that it does not
// hold (a first pass cut short) is added where it is met. The passes then move a cursor
// along it: forward, to the next position holding the acquired group (one found only
// behind begins a new pass); backward, to the previous one, staying for the groups after
// the one acquired last (a unit's groups come in their forward order in the backward pass
// too); a pass that turns starts from its end. Each Acquire starts the copies of the
// groups ahead of the cursor in the pass's direction, as long as the bytes read ahead and
// not yet used stay within read_ahead_bytes. A group read ahead stays until acquired, or
// until the pass turns or begins anew; no read-ahead evicts it. Eviction takes the released
// group whose next use is furthest, counting along the recorded pass forward and then
// back (at batch 1 under a cap a tied head's group was evicted, least recently used, for
// the layers after it, and the head waited for it: docs/gpu.md, "The fourth
// measurement"), groups the recording does not hold first; an acquire that finds no other
// room takes that of groups read ahead (the budget's blocks are contiguous: bytes that
// fit can be in pieces). So the budget must hold the groups leased at once plus the
// read-ahead: Acquire reports kResourceExhausted, naming both, when it cannot.
//
// Note [device gradients]: Offload() takes a group's gradient in device memory, produced
// by work queued on `producer`: the copy stream waits for an event recorded on the
// producer, then each part goes to the part's stored gradient buffer in the store
// (OffloadedAdam::BeginGradient) with cudaMemcpyAsync. A part is handed to the optimizer
// (EndGradient: overflow check, norm) when its copy has completed: polled without blocking
// on each Offload, and waited for (on its event) by Finish() or when the parts in flight
// pass max_inflight_bytes of pinned memory. The returned fence completes when every copy
// out of that device memory has: then it may be freed or reused. A gradient in another
// dtype than the layout's gradient dtype is refused: convert it on the device first.
//
// Without a GPU, options.emulate_on_host runs the same scheduling over host memory (the
// "device" is an allocation of host memory, copies are memcpy on the calling thread and
// every event is complete when recorded): for tests and CPU-only development. Otherwise
// Create() reports kFailedPrecondition without a CUDA device or a CUDA build.
//
// Thread-safety: each object is used by one thread at a time (calls may come from
// different threads, as a framework's forward and backward hooks do, but not at once).
// Lifetime: the optimizer (and its storage and store) and the streams must outlive the
// objects; destroying one waits for its copies' events. A DeviceView is valid until the
// group is released.
#ifndef MEMASCEND_DEVICE_TRAINING_H_
#define MEMASCEND_DEVICE_TRAINING_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include <absl/status/statusor.h>

#include <memascend/offloaded_optimizer.h>
#include <memascend/types.h>

namespace memascend {

enum class PassDirection { kForward, kBackward };

struct DeviceParametersOptions {
  int device = 0;
  // The device allocation; 0: none, for a caller that only wants CopyTo (its parameters
  // stay on the device in its own memory): Acquire then reports kFailedPrecondition.
  std::size_t device_budget_bytes = 0;
  // Bytes of groups read ahead and not yet acquired, at most; 0: half the budget.
  std::size_t read_ahead_bytes = 0;
  CudaStreamView copy_stream;  // the copies' stream (the caller's; not the compute stream)
  bool emulate_on_host = false;
};

struct DeviceView {
  std::byte* data = nullptr;  // device memory: the group's elements, contiguous
  std::size_t elements = 0;
  DType dtype = DType::kBF16;
};

struct DeviceParametersStats {
  std::uint64_t acquires = 0;
  std::uint64_t hits = 0;        // the group was resident or being copied when acquired
  std::uint64_t misses = 0;      // ... its copy started at the acquire
  std::uint64_t read_ahead = 0;  // groups whose copy the read-ahead started
  std::uint64_t evictions = 0;   // groups dropped for room
  std::uint64_t invalidations = 0;
  std::uint64_t bytes_to_device = 0;
  // Host-to-device copies queued: a group's parts whose host blocks are adjacent go as
  // one (bytes_to_device over copies is the mean copy).
  std::uint64_t copies = 0;
  std::size_t resident_bytes = 0;  // device bytes holding groups now
  std::size_t peak_resident_bytes = 0;
  std::size_t recorded_groups = 0;  // acquires in the recorded pass, Note [parameter read-ahead]
  // Time the copy stream spent on the copies that have completed (CUDA events around
  // each group's copies): bytes_to_device over it is the loads' bandwidth. 0 emulated.
  double copy_seconds = 0;
  // The calling threads' time (wall clock, summed): in Acquire, whole (the loads it queues
  // and the read-ahead's); in the store's reads of the parts, for Acquire's loads (then
  // part of acquire_seconds) and CopyTo's (a part not resident is read from the volume);
  // waiting for earlier copies to end, when the store's budget was held by their parts
  // (in Acquire or CopyTo) or in Synchronize.
  double acquire_seconds = 0;
  double read_seconds = 0;
  double copy_wait_seconds = 0;
};

class DeviceParameters {
 public:
  // kInvalidArgument for a budget smaller than the largest group;
  // kFailedPrecondition without a CUDA device (and no emulation), or for a layout with
  // derived parameters (StateGroup::store_parameters false: nothing stored to copy).
  static absl::StatusOr<std::unique_ptr<DeviceParameters>> Create(
      OffloadedAdam* optimizer, const DeviceParametersOptions& options);
  ~DeviceParameters();
  DeviceParameters(const DeviceParameters&) = delete;
  DeviceParameters& operator=(const DeviceParameters&) = delete;

  // Group g's current parameters on the device, for work queued on `compute` after this
  // call (Note [device parameters]); starts the read-ahead (Note [parameter read-ahead]).
  // The group stays resident until as many Release calls. kOutOfRange for a bad group;
  // kResourceExhausted when leased and read-ahead groups fill the budget; the store's
  // and CUDA's errors otherwise.
  absl::StatusOr<DeviceView> Acquire(std::size_t group, CudaStreamView compute,
                                     PassDirection direction = PassDirection::kForward);
  // The work that reads the group was queued on `compute` before this call.
  // kFailedPrecondition for a group not acquired.
  absl::Status Release(std::size_t group, CudaStreamView compute);
  // The group's stored parameters changed (an update): its device copy is dropped, and
  // the next Acquire copies the new ones. kFailedPrecondition while it is acquired.
  absl::Status Invalidate(std::size_t group);
  // Group g's current parameters copied into the caller's device memory (its elements in
  // the layout's dtype), for work on `compute` after this call: for parameters the caller
  // keeps on the device itself, after an update.
  absl::Status CopyTo(std::size_t group, std::byte* device_memory, CudaStreamView compute);
  // Waits for every copy this object queued (their events).
  absl::Status Synchronize();

  DeviceParametersStats stats() const;

 private:
  struct Impl;
  explicit DeviceParameters(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct DeviceGradientsOptions {
  int device = 0;
  CudaStreamView copy_stream;  // the copies' stream (the caller's; not the compute stream)
  // Pinned bytes of gradient parts whose copies are in flight, at most; 0: a quarter of
  // the store's host budget.
  std::size_t max_inflight_bytes = 0;
  bool emulate_on_host = false;
};

struct DeviceGradientsStats {
  std::uint64_t groups = 0;  // Offload calls
  std::uint64_t parts = 0;
  std::uint64_t bytes_from_device = 0;
  std::uint64_t waits = 0;  // parts waited for (Finish, or max_inflight_bytes)
};

class DeviceGradients {
 public:
  // kFailedPrecondition without a CUDA device (and no emulation).
  static absl::StatusOr<std::unique_ptr<DeviceGradients>> Create(
      OffloadedAdam* optimizer, const DeviceGradientsOptions& options);
  ~DeviceGradients();
  DeviceGradients(const DeviceGradients&) = delete;
  DeviceGradients& operator=(const DeviceGradients&) = delete;

  // Note [device gradients]. Between OffloadedAdam::BeginBackward and Finish(); each
  // group at most once per step. kInvalidArgument for a wrong element count or dtype;
  // kOutOfRange for a bad group; kFailedPrecondition for a group offloaded twice.
  absl::StatusOr<std::shared_ptr<ReuseFence>> Offload(std::size_t group, TensorView device_gradient,
                                                      CudaStreamView producer);
  // Every queued part's copy waited for and handed to the optimizer. A group never
  // offloaded gets no gradient here: the caller sets it (SetGradient) or it keeps zeros.
  absl::Status Finish();

  DeviceGradientsStats stats() const;

 private:
  struct Impl;
  explicit DeviceGradients(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace memascend

#endif  // MEMASCEND_DEVICE_TRAINING_H_

// The ZeRO-Infinity baseline as a TrainingStateStorage (Note [zero rules] in zero_infinity.h);
// its swap files and buffer sizes are zero_infinity_swap.h's.
#include "zero_infinity.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <sys/stat.h>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <memascend/host_arena.h>
#include <memascend/pinned_pool.h>
#include <memascend/status.h>

#include "zero_infinity_swap.h"

namespace offload_train {
namespace {

using memascend::DType;
using memascend::Tier;
using memascend::Use;
using zero_infinity::Aio;
using zero_infinity::Layout;
using zero_infinity::MakeLayout;
using zero_infinity::Pow2;
using zero_infinity::Round4k;
using zero_infinity::SwapPath;

// One page-locked swap buffer: through torch's caching host allocator (a pow2 block) up
// to 0.16.5, or from 0.19.5 new_cpu_locked_tensor's posix_memalign and mlock at its exact
// size (an arena allocation of its own). Move-only; frees what it holds.
class SwapBuffer {
 public:
  SwapBuffer() = default;
  explicit SwapBuffer(memascend::PinnedBlock block) : block_(std::move(block)) {}
  SwapBuffer(memascend::HostArena* arena, memascend::ArenaAllocation a)
      : arena_(arena), exact_(a.data) {}
  SwapBuffer(SwapBuffer&& o) noexcept
      : block_(std::move(o.block_)),
        arena_(std::exchange(o.arena_, nullptr)),
        exact_(std::exchange(o.exact_, nullptr)) {}
  SwapBuffer& operator=(SwapBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      block_ = std::move(o.block_);
      arena_ = std::exchange(o.arena_, nullptr);
      exact_ = std::exchange(o.exact_, nullptr);
    }
    return *this;
  }
  SwapBuffer(const SwapBuffer&) = delete;
  SwapBuffer& operator=(const SwapBuffer&) = delete;
  ~SwapBuffer() { Reset(); }

  std::byte* data() const { return exact_ != nullptr ? exact_ : block_.data(); }
  void Reset() {
    block_.Reset();
    if (exact_ != nullptr) (void)arena_->Free(exact_);
    exact_ = nullptr;
    arena_ = nullptr;
  }

 private:
  memascend::PinnedBlock block_;
  memascend::HostArena* arena_ = nullptr;
  std::byte* exact_ = nullptr;
};

class ZeroBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<ZeroBackend>> Create(
      const TrainOptions& o, const memascend::StateLayout& state_layout,
      memascend::MemoryLedger* ledger) {
    auto b = std::unique_ptr<ZeroBackend>(new ZeroBackend(o, ledger));
    b->state_layout_ = state_layout;
    MEMASCEND_RETURN_IF_ERROR(b->Init());
    return b;
  }

  ~ZeroBackend() override {
    for (auto& [g, p] : prefetched_) (void)Aio::Wait(p.op);
    prefetched_.clear();
    param_pool_.Reset();
    optimizer_buffers_.clear();
    flat_grads_.Reset();
    flat_params_.Reset();
    partitioned_swap_.Reset();
    pinned_params_.clear();
    pool_.reset();
    if (ledger_ != nullptr) {
      for (const auto& [use, bytes] : pageable_)
        ledger_->Update(Tier::kPageableHost, {{use, -bytes, -bytes}});
    }
  }

  absl::StatusOr<Buf> Read(Kind k, std::size_t g, std::size_t, bool) override {
    MEMASCEND_RETURN_IF_ERROR(deferred_);
    if (k == Kind::kGradient) return GradView(g, /*written=*/false);
    if (k != Kind::kParameters)
      return absl::UnimplementedError("zero-infinity reads states itself");
    if (!Swapped(Kind::kParameters, g)) return MemoryView(Kind::kParameters, g);
    auto it = prefetched_.find(g);
    if (it != prefetched_.end()) {
      Pending p = std::move(it->second);
      prefetched_.erase(it);
      MEMASCEND_RETURN_IF_ERROR(Aio::Wait(p.op));
      return ParamSlotBuf(p.slot, g, /*write_on_release=*/false);
    }
    MEMASCEND_ASSIGN_OR_RETURN(std::size_t slot, TakeParamSlot());
    auto op = aio_.Submit(Path(Kind::kParameters, g), ParamSlot(slot),
                          FileBytes(Kind::kParameters, g), false);
    absl::Status s = Aio::Wait(op);
    if (!s.ok()) {
      param_busy_[slot] = false;
      return s;
    }
    return ParamSlotBuf(slot, g, false);
  }

  absl::StatusOr<Buf> Overwrite(Kind k, std::size_t g, std::size_t, bool next) override {
    MEMASCEND_RETURN_IF_ERROR(deferred_);
    if (k == Kind::kGradient) return GradView(g, /*written=*/true);
    if (next) return absl::UnimplementedError("zero-infinity writes new states itself");
    // Initialisation: fill, then swap out when released.
    if (!Swapped(k, g)) return MemoryView(k, g);
    if (k == Kind::kParameters) {
      MEMASCEND_ASSIGN_OR_RETURN(std::size_t slot, TakeParamSlot());
      return ParamSlotBuf(slot, g, /*write_on_release=*/true);
    }
    // Outside the optimizer step the optimizer buffers are free: one per kind of state.
    std::byte* buf = optimizer_buffers_[static_cast<std::size_t>(k) - 2].data();
    Buf b;
    b.data = buf;
    b.bytes = numel(g) * 4;
    b.hold = std::shared_ptr<void>(buf, [this, k, g](void* p) {
      Note(Aio::Wait(aio_.Submit(Path(k, g), static_cast<std::byte*>(p), FileBytes(k, g), true)));
    });
    return b;
  }

  absl::StatusOr<Buf> Update(Kind, std::size_t, std::size_t) override {
    return absl::UnimplementedError("zero-infinity runs its own optimizer step");
  }

  void Prefetch(Kind k, std::size_t g, std::size_t) override {
    if (k != Kind::kParameters || !Swapped(Kind::kParameters, g) || prefetched_.contains(g)) return;
    // A prefetch never takes the last free buffer: the layer about to run needs one.
    if (std::count(param_busy_.begin(), param_busy_.end(), false) < 2) return;
    auto slot = TakeParamSlot();
    if (!slot.ok()) return;  // every buffer busy: it is read when needed
    prefetched_.emplace(g, Pending{*slot, aio_.Submit(Path(Kind::kParameters, g), ParamSlot(*slot),
                                                      FileBytes(Kind::kParameters, g), false)});
  }

  absl::Status Discard(Kind, std::size_t, std::size_t) override { return absl::OkStatus(); }
  // ZeRO-Infinity keeps no crash-consistent state: nothing to commit or resume.
  absl::Status Commit(const memascend::CommitRecord&) override { return deferred_; }
  absl::StatusOr<std::optional<memascend::CommitRecord>> Resume(std::uint64_t) override {
    return std::nullopt;
  }
  std::uint64_t io_read_bytes() const override {
    return aio_.read_bytes() + (write_aio_ != nullptr ? write_aio_->read_bytes() : 0);
  }
  std::uint64_t io_write_bytes() const override {
    return aio_.write_bytes() + (write_aio_ != nullptr ? write_aio_->write_bytes() : 0);
  }
  const memascend::StateLayout& layout() const override { return state_layout_; }

  bool ChecksOverflowAfterBackward() const override { return true; }

  // isinf(flat).any(), then isnan(flat).any(): each a 1-byte temporary per element; fp16
  // only (_overflow_check_and_loss_scale_update checks nothing in bf16).
  absl::StatusOr<bool> CheckOverflow() override {
    // The end of the backward pass (independent_gradient_partition_epilogue): the last
    // bucket's gradients partitioned and swapped out, then the step's check.
    MEMASCEND_RETURN_IF_ERROR(FlushBucket());
    MEMASCEND_RETURN_IF_ERROR(deferred_);
    if (o_.dtype != DType::kF16) return false;
    const std::uint16_t exp_mask = o_.dtype == DType::kF16 ? 0x7c00 : 0x7f80;
    const std::uint16_t man_mask = o_.dtype == DType::kF16 ? 0x03ff : 0x007f;
    const auto* flat = reinterpret_cast<const std::uint16_t*>(grads_);
    // ATen runs both kernels, isinf/isnan and any(), on its intra-op threads.
    const std::size_t nthreads =
        o_.threads > 0 ? static_cast<std::size_t>(o_.threads)
                       : std::max<std::size_t>(1, std::thread::hardware_concurrency());
    const auto parallel = [&](const auto& body) {  // body(begin, end) over [0, total)
      std::vector<std::thread> pool;
      const std::size_t n = layout_.total;
      for (std::size_t t = 1; t < nthreads; ++t)
        pool.emplace_back([&, t] { body(n * t / nthreads, n * (t + 1) / nthreads); });
      body(0, n / nthreads);
      for (std::thread& th : pool) th.join();
    };
    for (int pass = 0; pass < 2; ++pass) {
      Account(Use::kStaging, static_cast<std::int64_t>(layout_.total));
      std::vector<std::uint8_t> temp(layout_.total);
      parallel([&](std::size_t begin, std::size_t end) {
        for (std::size_t i = begin; i < end; ++i) {
          const bool special = (flat[i] & exp_mask) == exp_mask;
          const bool mantissa = (flat[i] & man_mask) != 0;
          temp[i] = special && (pass == 0 ? !mantissa : mantissa);
        }
      });
      std::atomic<bool> any{false};
      parallel([&](std::size_t begin, std::size_t end) {
        bool mine = false;
        for (std::size_t i = begin; i < end; ++i) mine |= temp[i] != 0;
        if (mine) any = true;
      });
      temp.clear();
      temp.shrink_to_fit();
      Account(Use::kStaging, -static_cast<std::int64_t>(layout_.total));
      if (any) return true;
    }
    return false;
  }

  bool OwnsUpdate() const override { return true; }

  // stage3.py's step: sub-group by sub-group, swap in, Adam, the new 16-bit parameters
  // out, swap out. With pipeline_read the next sub-group is read while this one steps;
  // with pipeline_write this one is written while the next one steps
  // (pipelined_optimizer_swapper.py), each sub-group in flight holding a set of four
  // optimizer buffers.
  absl::Status UpdateAll(const memascend::AdamConfig& adam,
                         memascend::KernelThreads* threads) override {
    MEMASCEND_RETURN_IF_ERROR(deferred_);
    absl::Status s = StepSubGroups(adam, threads);
    // Whatever failed, every request finishes before the step returns: they point into
    // the swap buffers.
    for (std::size_t k = 0; k < sets_.size(); ++k) {
      const absl::Status w = FinishSet(k);
      if (s.ok()) s = w;
    }
    const absl::Status w = Aio::WaitAll(&param_writes_);
    return s.ok() ? w : s;
  }

 private:
  struct Pending {
    std::size_t slot;
    std::shared_ptr<Aio::Op> op;
  };
  // Four optimizer buffers (master weights, both moments, the fp32 gradient) of one
  // sub-group, and the requests in flight into or out of them.
  struct BufferSet {
    bool busy = false;
    std::vector<std::shared_ptr<Aio::Op>> ops;
  };

  absl::Status StepSubGroups(const memascend::AdamConfig& adam, memascend::KernelThreads* threads) {
    const std::size_t n = layout_.sub_groups.size();
    constexpr std::size_t kNone = SIZE_MAX;
    std::size_t ahead = kNone;   // the next sub-group's set, read ahead
    std::size_t behind = kNone;  // the previous sub-group's set, written behind
    for (std::size_t i = 0; i < n; ++i) {
      // swap_in_optimizer_state: the sub-group read ahead, or read now; then the next
      // one read ahead into another set.
      std::size_t cur = 0;
      if (ahead != kNone) {
        cur = std::exchange(ahead, kNone);
      } else {
        MEMASCEND_ASSIGN_OR_RETURN(cur, TakeSet());
        MEMASCEND_RETURN_IF_ERROR(SwapIn(i, cur, threads));
      }
      MEMASCEND_RETURN_IF_ERROR(Aio::WaitAll(&sets_[cur].ops));
      if (o_.zero.pipeline_read && i + 1 < n) {
        MEMASCEND_ASSIGN_OR_RETURN(std::size_t next, TakeSet());
        ahead = next;
        MEMASCEND_RETURN_IF_ERROR(SwapIn(i + 1, next, threads));
      }
      MEMASCEND_RETURN_IF_ERROR(Adam(i, cur, adam, threads));
      // swap_out_optimizer_state: the previous sub-group's writes finish first; this
      // one's are waited now, or (pipeline_write, a sub-group after it) behind the next.
      if (behind != kNone) MEMASCEND_RETURN_IF_ERROR(FinishSet(std::exchange(behind, kNone)));
      MoveStates(i, cur, /*out=*/true);  // swap_out_optimizer_state
      if (o_.zero.pipeline_write && i + 1 < n) {
        behind = cur;
      } else {
        MEMASCEND_RETURN_IF_ERROR(FinishSet(cur));
      }
    }
    return absl::OkStatus();
  }

  std::byte* SetBuffer(std::size_t set, int which) {
    return optimizer_buffers_[4 * set + static_cast<std::size_t>(which)].data();
  }
  absl::StatusOr<std::size_t> TakeSet() {
    for (std::size_t k = 0; k < sets_.size(); ++k) {
      if (!sets_[k].busy) {
        sets_[k].busy = true;
        return k;
      }
    }
    return absl::ResourceExhaustedError(fmt::format(
        "zero-infinity: all {} optimizer buffers are in use", optimizer_buffers_.size()));
  }
  absl::Status FinishSet(std::size_t k) {
    absl::Status s = Aio::WaitAll(&sets_[k].ops);
    sets_[k].busy = false;
    return s;
  }

  static constexpr Kind kStateKinds[3] = {Kind::kMaster, Kind::kExpAvg, Kind::kExpAvgSq};

  // Sub-group i's master weights and moments read into set k; its gradient as fp32
  // (read back, or converted from the flat 16-bit buffer when it was not swapped out).
  absl::Status SwapIn(std::size_t i, std::size_t k, memascend::KernelThreads* threads) {
    MoveStates(i, k, /*out=*/false);
    const std::size_t half = memascend::SizeOf(o_.dtype);
    auto* grad32 = reinterpret_cast<float*>(SetBuffer(k, 3));
    std::size_t off = 0;
    for (std::size_t g : layout_.sub_groups[i]) {
      if (Swapped(Kind::kGradient, g)) {  // swapped out in the backward pass
        sets_[k].ops.push_back(aio_.Submit(Path(Kind::kGradient, g),
                                           reinterpret_cast<std::byte*>(grad32 + off),
                                           FileBytes(Kind::kGradient, g), false));
      } else {
        MEMASCEND_RETURN_IF_ERROR(
            memascend::Convert({grads_ + layout_.offset[g] * half, numel(g), o_.dtype},
                               {grad32 + off, numel(g), DType::kF32}, {threads}));
      }
      off += Round4k(numel(g) * 4) / 4;
    }
    return absl::OkStatus();
  }

  // Sub-group i's master weights and moments between set k and their files, or the
  // memory they live in when too small to swap: in (reads) before its step, out (writes)
  // after. The requests go to the set's list.
  void MoveStates(std::size_t i, std::size_t k, bool out) {
    std::size_t off = 0;
    for (std::size_t g : layout_.sub_groups[i]) {
      for (int s = 0; s < 3; ++s) {
        const Kind kind = kStateKinds[s];
        std::byte* buf = SetBuffer(k, s) + off * 4;
        std::byte* mem = Swapped(kind, g) ? nullptr : memory_[static_cast<int>(kind)][g].data();
        if (mem == nullptr) {
          sets_[k].ops.push_back(
              (out ? Writer() : aio_).Submit(Path(kind, g), buf, FileBytes(kind, g), out));
        } else {
          std::memcpy(out ? mem : buf, out ? buf : mem, numel(g) * 4);
        }
      }
      off += Round4k(numel(g) * 4) / 4;
    }
  }

  // Adam over sub-group i in set k, tensor by tensor; the new 16-bit parameters to the
  // flat CPU buffer, or (a sub-group on NVMe) out through the partitioned swap buffer,
  // whose previous writes finish first (swap_out_partitioned_params'
  // synchronize_writes).
  absl::Status Adam(std::size_t i, std::size_t k, const memascend::AdamConfig& adam,
                    memascend::KernelThreads* threads) {
    MEMASCEND_RETURN_IF_ERROR(Aio::WaitAll(&param_writes_));
    auto* grad32 = reinterpret_cast<float*>(SetBuffer(k, 3));
    std::size_t off = 0;
    std::size_t poff = 0;  // bytes into the partitioned swap buffer
    for (std::size_t g : layout_.sub_groups[i]) {
      const std::size_t n = numel(g);
      std::byte* param = Swapped(Kind::kParameters, g) ? partitioned_swap_.data() + poff
                                                       : MemoryView(Kind::kParameters, g).data;
      MEMASCEND_RETURN_IF_ERROR(
          memascend::FusedAdam(adam, {reinterpret_cast<float*>(SetBuffer(k, 0) + off * 4), n},
                               {reinterpret_cast<float*>(SetBuffer(k, 1) + off * 4), n},
                               {reinterpret_cast<float*>(SetBuffer(k, 2) + off * 4), n},
                               {grad32 + off, n, DType::kF32}, {param, n, o_.dtype}, {threads}));
      if (Swapped(Kind::kParameters, g)) {
        param_writes_.push_back(Writer().Submit(Path(Kind::kParameters, g), param,
                                                FileBytes(Kind::kParameters, g), true));
        poff += FileBytes(Kind::kParameters, g);
      }
      off += Round4k(n * 4) / 4;
    }
    return absl::OkStatus();
  }

  // The pipelined swapper writes through a handle of its own; the other through the one.
  Aio& Writer() { return write_aio_ != nullptr ? *write_aio_ : aio_; }

  ZeroBackend(const TrainOptions& o, memascend::MemoryLedger* ledger)
      : o_(o),
        ledger_(ledger),
        layout_(MakeLayout(o)),
        aio_(o.zero.aio_block_bytes, o.zero.aio_queue_depth) {}

  absl::Status Init() {
    if (o_.zero.param_buffer_count < 1) {
      return absl::ResourceExhaustedError("zero-infinity: param_buffer_count must be at least 1");
    }
    // Sub-groups in flight at once: the one stepping, the next read ahead
    // (pipeline_read), the previous written behind (pipeline_write); DeepSpeed's swapper
    // asserts "ran out of swap buffers" when it cannot have them.
    const std::size_t in_flight = 1 + o_.zero.pipeline_read + o_.zero.pipeline_write;
    if (o_.zero.optimizer_buffer_count < 4 * in_flight) {
      return absl::ResourceExhaustedError(fmt::format(
          "zero-infinity: a sub-group's step swaps in master weights, both moments and the "
          "gradient{}: {} optimizer buffers needed, {} given",
          in_flight == 1 ? ""
                         : fmt::format(", {} sub-groups at once with pipeline_read {} and "
                                       "pipeline_write {}",
                                       in_flight, o_.zero.pipeline_read, o_.zero.pipeline_write),
          4 * in_flight, o_.zero.optimizer_buffer_count));
    }
    sets_.resize(o_.zero.optimizer_buffer_count / 4);
    if (in_flight > 1) {
      write_aio_ = std::make_unique<Aio>(o_.zero.aio_block_bytes, o_.zero.aio_queue_depth);
    }
    std::string dir = o_.zero.nvme_path.empty() ? o_.volume_path + ".zero" : o_.zero.nvme_path;
    root_ = dir + "/zero_stage_3";
    std::error_code ec;
    for (const char* sub : {"/params/rank0", "/optimizer/rank0"}) {
      std::filesystem::create_directories(root_ + sub, ec);
      if (ec) return absl::InternalError(fmt::format("mkdir {}{}: {}", root_, sub, ec.message()));
    }
    memascend::HostArenaOptions ao;
    ao.backing = memascend::ArenaBacking::kMlock;
    ao.budget_bytes = ZeroPinnedBytes(o_) + (1u << 20);
    ao.chunk_bytes = 0;  // each block its own region, as cudaHostAlloc gives
    ao.ledger = ledger_;
    MEMASCEND_ASSIGN_OR_RETURN(arena_, memascend::HostArena::Create(ao));
    memascend::PinnedPoolOptions po;
    po.policy = memascend::PoolPolicy::kPow2;
    MEMASCEND_ASSIGN_OR_RETURN(pool_, memascend::PinnedPool::Create(arena_.get(), po));
    MEMASCEND_ASSIGN_OR_RETURN(
        param_pool_,
        PinSwapBuffer(layout_.param_buffer_bytes * o_.zero.param_buffer_count, Use::kParameters));
    param_busy_.assign(o_.zero.param_buffer_count, false);
    for (std::size_t i = 0; i < o_.zero.optimizer_buffer_count; ++i) {
      const std::size_t bytes = layout_.optimizer_buffer_bytes + 4096 * layout_.groups;
      if (exact_swap_buffers()) {  // new_cpu_locked_tensor(n).zero_(): zeroed in place
        MEMASCEND_ASSIGN_OR_RETURN(SwapBuffer b, PinSwapBuffer(bytes, Use::kOptimizerState));
        std::memset(b.data(), 0, bytes);
        optimizer_buffers_.push_back(std::move(b));
        continue;
      }
      // SwapBufferManager: pin_memory(torch.zeros(n)): a zeroed pageable tensor, then its
      // pinned copy; both exist until the copy is made.
      std::vector<std::byte> zeros(bytes);
      Account(Use::kStaging, static_cast<std::int64_t>(bytes));
      MEMASCEND_ASSIGN_OR_RETURN(SwapBuffer b, PinSwapBuffer(bytes, Use::kOptimizerState));
      std::memcpy(b.data(), zeros.data(), bytes);
      zeros = {};
      Account(Use::kStaging, -static_cast<std::int64_t>(bytes));
      optimizer_buffers_.push_back(std::move(b));
    }
    const std::size_t grad_bytes = layout_.total * memascend::SizeOf(o_.dtype);
    if (o_.zero.optimizer_pin_memory) {
      MEMASCEND_ASSIGN_OR_RETURN(flat_grads_, pool_->Allocate(grad_bytes, Use::kGradients));
      grads_ = flat_grads_.data();
    } else {
      // torch.zeros: pageable, and every page touched.
      pageable_grads_ = std::make_unique<std::byte[]>(grad_bytes);
      grads_ = pageable_grads_.get();
      Account(Use::kGradients, static_cast<std::int64_t>(grad_bytes));
    }
    if (layout_.flat_param_elements > 0) {
      MEMASCEND_ASSIGN_OR_RETURN(
          flat_params_, pool_->Allocate(layout_.flat_param_elements * memascend::SizeOf(o_.dtype),
                                        Use::kParameters));
    }
    if (layout_.partitioned_swap_bytes > 0) {
      MEMASCEND_ASSIGN_OR_RETURN(partitioned_swap_,
                                 PinSwapBuffer(layout_.partitioned_swap_bytes, Use::kParameters));
    }
    // Start-up's pageable fp32 buffer of the largest sub-group: _create_fp32_partitions'
    // (a sub-group on NVMe: its parameters swapped in and converted) and
    // initialize_optimizer_states' gradient_buffer (torch.zeros(largest), both tags); one
    // of them at a time.
    {
      std::vector<float> fp32(layout_.largest_sub_group, 0.0f);
      Account(Use::kStaging, static_cast<std::int64_t>(fp32.size() * 4));
      fp32 = {};
      Account(Use::kStaging, -static_cast<std::int64_t>(layout_.largest_sub_group * 4));
    }
    // Tensors under the swap threshold stay in memory: pageable, but parameters with
    // offload_param.pin_memory, each pinned through torch's allocator.
    pinned_params_.resize(layout_.groups);
    for (Kind k : {Kind::kParameters, Kind::kMaster, Kind::kExpAvg, Kind::kExpAvgSq}) {
      auto& mem = memory_[static_cast<int>(k)];
      mem.resize(layout_.groups);
      for (std::size_t g = 0; g < layout_.groups; ++g) {
        if (Swapped(k, g) || (k == Kind::kParameters && layout_.param_in_cpu[g])) continue;
        if (k == Kind::kParameters && o_.zero.param_pin_memory) {
          MEMASCEND_ASSIGN_OR_RETURN(pinned_params_[g],
                                     pool_->Allocate(numel(g) * Element(k), Use::kParameters));
          continue;
        }
        mem[g].resize(numel(g) * Element(k));
        Account(k == Kind::kParameters ? Use::kParameters : Use::kOptimizerState,
                static_cast<std::int64_t>(mem[g].size()));
      }
    }
    return absl::OkStatus();
  }

  // From 0.19.5 the swap buffers are page-locked at their exact size (Note [zero rules]).
  bool exact_swap_buffers() const { return o_.zero.release >= ZeroRelease::k0_19_5; }
  absl::StatusOr<SwapBuffer> PinSwapBuffer(std::size_t bytes, Use use) {
    if (exact_swap_buffers()) {
      MEMASCEND_ASSIGN_OR_RETURN(memascend::ArenaAllocation a, arena_->Allocate(bytes, use));
      return SwapBuffer(arena_.get(), a);
    }
    MEMASCEND_ASSIGN_OR_RETURN(memascend::PinnedBlock b, pool_->Allocate(bytes, use));
    return SwapBuffer(std::move(b));
  }

  std::size_t numel(std::size_t g) const { return layout_.numel[g]; }
  // Bytes per element as swapped: the gradient in fp32 (partition_grads' copy).
  std::size_t Element(Kind k) const {
    return k == Kind::kParameters ? memascend::SizeOf(o_.dtype) : 4;
  }
  bool Swapped(Kind k, std::size_t g) const {
    if (k == Kind::kParameters && layout_.param_in_cpu[g]) return false;  // max_in_cpu
    return numel(g) * Element(k) >= o_.zero.SwapThresholdBytes();
  }
  std::size_t FileBytes(Kind k, std::size_t g) const { return Round4k(numel(g) * Element(k)); }
  std::string Path(Kind k, std::size_t g) const { return SwapPath(root_, k, g); }
  std::byte* ParamSlot(std::size_t slot) const {
    return param_pool_.data() + slot * layout_.param_buffer_bytes;
  }
  absl::StatusOr<std::size_t> TakeParamSlot() {
    for (std::size_t i = 0; i < param_busy_.size(); ++i) {
      if (!param_busy_[i]) {
        param_busy_[i] = true;
        return i;
      }
    }
    return absl::ResourceExhaustedError(
        fmt::format("zero-infinity: all {} parameter swap buffers are in use", param_busy_.size()));
  }
  Buf ParamSlotBuf(std::size_t slot, std::size_t g, bool write_on_release) {
    Buf b;
    b.data = ParamSlot(slot);
    b.bytes = numel(g) * memascend::SizeOf(o_.dtype);
    b.hold = std::shared_ptr<void>(b.data, [this, slot, g, write_on_release](void* p) {
      if (write_on_release) {
        Note(Aio::Wait(aio_.Submit(Path(Kind::kParameters, g), static_cast<std::byte*>(p),
                                   FileBytes(Kind::kParameters, g), true)));
      }
      param_busy_[slot] = false;
    });
    return b;
  }
  // Group g's 16-bit gradient in the flat buffer; once `written` (the backward pass's),
  // into the bucket when released.
  Buf GradView(std::size_t g, bool written) {
    Buf b;
    b.data = grads_ + layout_.offset[g] * memascend::SizeOf(o_.dtype);
    b.bytes = numel(g) * memascend::SizeOf(o_.dtype);
    if (written) {
      b.hold = std::shared_ptr<void>(b.data, [this, g](void*) {
        bucket_.push_back(g);
        bucket_elements_ += numel(g);
        if (bucket_elements_ >= o_.zero.reduce_bucket_size) Note(FlushBucket());
      });
    }
    return b;
  }
  // partition_grads: the bucket's gradients made fp32 (grad_buffer.float(), on the GPU,
  // where the bucket's copies live: no host memory), then each swapped out, staged
  // through the optimizer buffers (free outside the step).
  absl::Status FlushBucket() {
    if (bucket_.empty()) return absl::OkStatus();
    const std::size_t half = memascend::SizeOf(o_.dtype);
    absl::Status s;
    std::vector<std::shared_ptr<Aio::Op>> staged(optimizer_buffers_.size());
    for (std::size_t i = 0; i < bucket_.size() && s.ok(); ++i) {
      const std::size_t g = bucket_[i];
      if (!Swapped(Kind::kGradient, g)) continue;
      const std::size_t slot = i % staged.size();
      if (staged[slot] != nullptr) s = Aio::Wait(staged[slot]);
      if (!s.ok()) break;
      std::byte* buf = optimizer_buffers_[slot].data();
      s = memascend::Convert({grads_ + layout_.offset[g] * half, numel(g), o_.dtype},
                             {reinterpret_cast<float*>(buf), numel(g), DType::kF32});
      if (!s.ok()) break;
      staged[slot] =
          aio_.Submit(Path(Kind::kGradient, g), buf, FileBytes(Kind::kGradient, g), true);
    }
    for (const auto& op : staged) {
      if (op != nullptr) {
        const absl::Status w = Aio::Wait(op);
        if (s.ok()) s = w;
      }
    }
    bucket_.clear();
    bucket_elements_ = 0;
    return s;
  }
  Buf MemoryView(Kind k, std::size_t g) {
    Buf b;
    if (k == Kind::kParameters && layout_.param_in_cpu[g]) {
      b.data = flat_params_.data() + layout_.offset[g] * memascend::SizeOf(o_.dtype);
      b.bytes = numel(g) * memascend::SizeOf(o_.dtype);
      return b;
    }
    if (k == Kind::kParameters && pinned_params_[g].data() != nullptr) {
      b.data = pinned_params_[g].data();
      b.bytes = numel(g) * memascend::SizeOf(o_.dtype);
      return b;
    }
    b.data = memory_[static_cast<int>(k)][g].data();
    b.bytes = memory_[static_cast<int>(k)][g].size();
    return b;
  }
  void Note(absl::Status s) {
    if (!s.ok() && deferred_.ok()) deferred_ = std::move(s);
  }
  void Account(Use use, std::int64_t bytes) {
    if (ledger_ == nullptr) return;
    ledger_->Update(Tier::kPageableHost, {{use, bytes, bytes}});
    pageable_[use] += bytes;
  }

  TrainOptions o_;
  memascend::MemoryLedger* ledger_;
  Layout layout_;
  memascend::StateLayout state_layout_;
  Aio aio_;
  std::unique_ptr<Aio> write_aio_;  // the pipelined optimizer swapper's write handle
  std::string root_;
  std::unique_ptr<memascend::HostArena> arena_;
  std::unique_ptr<memascend::PinnedPool> pool_;
  SwapBuffer param_pool_;
  std::vector<bool> param_busy_;
  std::vector<SwapBuffer> optimizer_buffers_;
  std::vector<BufferSet> sets_;                         // optimizer_buffers_ by fours
  std::vector<std::shared_ptr<Aio::Op>> param_writes_;  // the last sub-group's parameters
  memascend::PinnedBlock flat_grads_;                   // with optimizer_pin_memory
  std::unique_ptr<std::byte[]> pageable_grads_;         // without it
  std::byte* grads_ = nullptr;                          // the flat 16-bit gradients, either way
  memascend::PinnedBlock flat_params_;                  // max_in_cpu's
  SwapBuffer partitioned_swap_;                         // a sub-group's new parameters, to NVMe
  std::vector<memascend::PinnedBlock> pinned_params_;   // offload_param.pin_memory's, by group
  std::vector<std::size_t> bucket_;                     // gradients written, not yet partitioned
  std::uint64_t bucket_elements_ = 0;
  std::array<std::vector<std::vector<std::byte>>, 5> memory_;
  std::map<std::size_t, Pending> prefetched_;
  std::map<Use, std::int64_t> pageable_;
  absl::Status deferred_;  // a swap-out that failed in a release
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeZeroInfinityBackend(
    const TrainOptions& options, const memascend::StateLayout& state_layout,
    memascend::MemoryLedger* ledger) {
  MEMASCEND_ASSIGN_OR_RETURN(auto b, ZeroBackend::Create(options, state_layout, ledger));
  return std::unique_ptr<Backend>(std::move(b));
}

}  // namespace offload_train

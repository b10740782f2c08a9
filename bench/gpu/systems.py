"""bench/gpu/compare.py's worker: one system trains the model in this process and writes
its record. Every system gets the same model (built from the same seed), the same token
stream and the same loop: per step, `accum` micro-batches of `batch` sequences, each
micro-batch's loss divided by `accum` before its backward pass, then the update.

  torch-gpu               everything on the device; torch.optim.AdamW over fp32 master
                          copies of the bf16 parameters (fused where torch has it for the
                          device, else foreach): the speed ceiling and the reference
  fsdp2-offload           fully_shard per decoder layer and the root, world size 1,
                          CPUOffloadPolicy(pin_memory=True), MixedPrecisionPolicy (bf16
                          compute over fp32 sharded parameters), torch.optim.AdamW on the
                          CPU (fused where it runs, else foreach; the record says which)
  deepspeed-zero-infinity ZeRO-3, offload_param and offload_optimizer on NVMe, bf16
  memascend               memascend.torch: OffloadedAdamW (state on the volume, in a host
                          budget) and offload_parameters; offload_activations on request
"""
import json
import os
import socket
import statistics
import sys
import time
import traceback

from common import BETAS, EPS, LR, WD, build_llama, counts, cpu_seconds, device_name, \
    matmul_ceiling, offload_units, proc_io, proc_status, reset_peak_rss, rss_bytes, steady_step, \
    token_stream, train_flops
import cgroup

SYSTEMS = ("torch-gpu", "fsdp2-offload", "deepspeed-zero-infinity", "memascend")


class Skip(Exception):
    """The system cannot run here; the message says why."""


BUILT = {}  # the model's construction: its peak RSS, and whether VmHWM was reset after it


def build(a, device, init_device=None):
    """build_llama, then VmHWM reset: peak_rss_bytes is the system's own peak from here on
    (what it keeps of the model, its setup and its training), not the harness's
    construction of the model, which every system shares (build_peak_rss_bytes)."""
    t0 = time.time()
    model, impl = build_llama(a.layers, a.shapes, device, a.checkpointing,
                              init_device=init_device)
    BUILT["build_seconds"] = round(time.time() - t0, 2)
    BUILT["build_peak_rss_bytes"], why = reset_peak_rss()
    BUILT["peak_rss_scope"] = ("VmHWM from after the model was built on its device" if why is None
                               else f"VmHWM of the whole process (not reset: {why})")
    return model, impl


def make_adamw(params, device):
    """(torch.optim.AdamW, which implementation): fused where torch accepts it for the
    device, else foreach."""
    import torch
    try:
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                 fused=True), "fused"
    except (TypeError, RuntimeError, ValueError) as e:
        opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                foreach=True)
        return opt, f"foreach (fused refused on {device}: {str(e).splitlines()[0][:160]})"


class TorchGPU:
    def __init__(self, a, device):
        import torch
        self.model, self.impl = build(a, device)
        self.counts = counts(self.model)
        self.params = list(self.model.parameters())
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt, self.optimizer = make_adamw(self.master, device)
        self.torch = torch

    def update(self):
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float()
            p.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with self.torch.no_grad():
            for m, p in zip(self.master, self.params):
                p.copy_(m)

    def finish(self):
        return {"optimizer": f"torch.optim.AdamW ({self.optimizer}) over fp32 master weights"}


def init_world(backend):
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist


class FSDP2:
    def __init__(self, a, device):
        import torch
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        except Exception as e:  # noqa: BLE001 - ImportError, or what the import raised
            raise Skip(f"torch {torch.__version__} has no FSDP2: from torch.distributed.fsdp "
                       f"import fully_shard, CPUOffloadPolicy: {type(e).__name__}: {e}")
        self.dist = init_world("nccl" if device.startswith("cuda") else "gloo")
        # Built in bf16 (on the run's device, as every system's: build_llama) and
        # widened, so its fp32 master weights are the reference's.
        model, self.impl = build(a, "cpu", init_device=device)
        model.float()
        self.counts = counts(model)
        kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=True),
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32))
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        self.model = model
        self.opt, self.optimizer = make_adamw(list(model.parameters()), "cpu")
        self.fallback = None

    def update(self):
        try:
            self.opt.step()
        except Exception as e:  # noqa: BLE001 - fused accepted at construction, refused at the step
            if self.optimizer != "fused":
                raise
            import torch
            self.opt = torch.optim.AdamW(list(self.model.parameters()), lr=LR, betas=BETAS,
                                         eps=EPS, weight_decay=WD, foreach=True)
            self.optimizer = f"foreach (fused failed at the first step: {str(e)[:160]})"
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def finish(self):
        self.dist.destroy_process_group()
        return {"optimizer": f"torch.optim.AdamW ({self.optimizer}) on the CPU",
                "fsdp": "fully_shard per decoder layer and the root, CPUOffloadPolicy("
                        "pin_memory=True), MixedPrecisionPolicy(param_dtype=bfloat16, "
                        "reduce_dtype=float32)"}


def deepspeed_config(a, largest, nvme):
    """ZeRO-3 with parameters and optimizer state on NVMe: DeepSpeed's defaults where
    ANCHORS-style tuning leaves them (buffer counts 5 and 4, max_in_cpu and sub_group_size
    1e9), the parameter buffer raised past the largest parameter (DeepSpeed asserts a
    parameter's elements are fewer than the buffer's), the aio block and queue depth of this run (a point of ds_nvme_tune's grid)."""
    block, qd = a.ds_aio_point
    return {
        "train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": a.accum,
        "bf16": {"enabled": True}, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WD}},
        "zero_optimization": {
            "stage": 3, "sub_group_size": a.ds_sub_group_size,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": bool(a.ds_pin),
                              "buffer_count": a.ds_param_buffers,
                              # DeepSpeed asserts numel < buffer_size (strictly)
                              "buffer_size": max(a.ds_param_buffer_size, largest + 1),
                              "max_in_cpu": a.ds_max_in_cpu},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": bool(a.ds_pin),
                                  "buffer_count": a.ds_optimizer_buffers,
                                  "pipeline_read": bool(a.ds_pipeline),
                                  "pipeline_write": bool(a.ds_pipeline)},
        },
        "aio": {"block_size": block, "queue_depth": qd, "thread_count": a.ds_threads,
                "single_submit": False, "overlap_events": True},
    }


class DeepSpeed:
    def __init__(self, a, device):
        # Its ops (cpu_adam, async_io) are built on first use (JIT, ninja). 0.14.5 refuses to
        # build when nvcc's CUDA minor differs from torch's outside its table, which stops
        # at 12.5 (op_builder/builder.py, assert_no_cuda_mismatch); cpu_adam is host code.
        self.env = {"DS_SKIP_CUDA_CHECK": os.environ.setdefault("DS_SKIP_CUDA_CHECK", "1")}
        try:
            import deepspeed
        except Exception as e:  # noqa: BLE001 - ImportError, or what its import raised
            raise Skip(f"import deepspeed: {type(e).__name__}: {e}")
        if not device.startswith("cuda"):
            raise Skip("ZeRO-Infinity needs a CUDA device")
        init_world("nccl")
        deepspeed.init_distributed(dist_backend="nccl")
        model, self.impl = build(a, "cpu", init_device=device)
        self.counts = counts(model)
        nvme = os.path.join(a.scratch, "deepspeed")
        os.makedirs(nvme, exist_ok=True)
        self.config = deepspeed_config(a, max(p.numel() for p in model.parameters()), nvme)
        self.engine, _, _, _ = deepspeed.initialize(model=model, config=self.config,
                                                    model_parameters=model.parameters())
        self.model = self.engine
        self.version = deepspeed.__version__
        self.origin = os.path.dirname(deepspeed.__file__)  # .device/deepspeed's, or installed

    def backward(self, loss):
        self.engine.backward(loss)  # divides by the accumulation steps itself
        self.engine.step()  # steps the optimizer at the accumulation boundary only

    def update(self):
        pass

    def finish(self):
        in_cpu = self.config["zero_optimization"]["offload_param"]["max_in_cpu"]
        return {"deepspeed": self.version, "deepspeed_from": self.origin, "ds_config": self.config,
                "ds_env": self.env,
                # offload_param's max_in_cpu (DeepSpeed's default 1e9): the 16-bit parameters
                # of up to that many elements stay in pinned host memory, not on NVMe.
                "ds_params_in_host_memory": self.counts[0] <= in_cpu,
                "optimizer": type(self.engine.optimizer).__name__ + " over " +
                type(getattr(self.engine.optimizer, "optimizer", None)).__name__}


class MemAscend:
    def __init__(self, a, device):
        import torch
        import memascend
        import memascend.torch as mt
        from memascend import _core
        self.model, self.impl = build(a, device)
        self.counts = counts(self.model)
        # Accumulating micro-batches, the gradients stay in p.grad until step()
        # (docs/python.md, "On a GPU"); else each leaves during backward.
        self.offload_gradients = a.accum == 1
        params = list(self.model.parameters())
        layout = [(f"p{i}", p.numel()) for i, p in enumerate(params)]
        state = _core.OffloadedAdam.stored_bytes(layout, "bfloat16", "bfloat16",
                                                 mt.DEFAULT_PART_ELEMENTS,
                                                 True if device.startswith("cuda") else None)
        least = mt.OffloadedAdamW.min_host_budget(max(p.numel() for p in params),
                                                  dtype=torch.bfloat16)
        wanted = int(state * a.budget / 100)
        self.budget = {"percent_of_state": a.budget, "state_bytes": state,
                       "bytes": max(wanted, least), "raised_to_minimum": wanted < least}
        os.makedirs(a.scratch, exist_ok=True)
        self.opt = mt.OffloadedAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                     volume=os.path.join(a.scratch, "memascend.vol"),
                                     host_budget=self.budget["bytes"], overwrite=True,
                                     commit_every=getattr(a, "commit_every_point", 1),
                                     io_threads=getattr(a, "io_threads_point", 0) or None,
                                     staging=getattr(a, "staging_point", "bounded"),
                                     offload_gradients=None if self.offload_gradients else False)
        self.units = getattr(a, "units", "layer")
        self.offload = mt.offload_parameters(self.model, self.opt,
                                             units=offload_units(self.model, self.units))
        self.activations = None
        if a.offload_activations:
            vol = memascend.Volume.open_or_create(os.path.join(a.scratch, "activations.vol"),
                                                  size=a.activation_volume)
            # On a GPU, CUDA-registered so the copies are DMA (docs/python.md, "On a GPU").
            self.act_store = memascend.TensorStore(
                vol, host_budget=a.activation_budget,
                host_backing="cuda" if device.startswith("cuda") else "auto")
            self.activations = mt.offload_activations(self.act_store)

    def context(self):
        return self.activations

    def phases(self):
        """Seconds so far by phase (memascend Note [step times]), the parameters' copies to
        the device (their stream's time, from events), and the bytes read and written."""
        stats = self.opt.stats()
        out = dict(stats.get("seconds", {}), io_read_bytes=stats["io_read_bytes"],
                   io_write_bytes=stats["io_write_bytes"])
        copies = (stats.get("device_parameters") or {}).get("copy_seconds")
        if copies is not None:
            out["parameter_copies"] = copies
        return out

    def update(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def finish(self):
        import torch
        self.opt.settle()
        stats = self.opt.stats()
        out = {"optimizer": "memascend.torch.OffloadedAdamW + offload_parameters",
               "units": self.units,
               "update_threads": torch.get_num_threads(),  # OffloadedAdamW's default
               "offload_gradients": self.offload_gradients,
               "host_budget_bytes": self.opt.host_budget,
               "host_budget_locked": self.opt.host_budget_locked,
               "memascend_pinned_peak_bytes": stats["store"]["pinned_peak_bytes"],
               "memascend_stats": stats}
        cuda = getattr(self.opt, "_cuda", None)
        if cuda is not None:
            out["device_budget_bytes"] = cuda.budget
        if self.activations is not None:
            out["activations"] = {"saved_bytes": self.activations.saved_bytes,
                                  "peak_bytes": self.activations.peak_bytes,
                                  "store": self.act_store.stats()}
        self.offload.remove()
        self.opt.close()
        return out


CLASSES = {"torch-gpu": TorchGPU, "fsdp2-offload": FSDP2,
           "deepspeed-zero-infinity": DeepSpeed, "memascend": MemAscend}


def is_oom(torch, e):
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(e, oom)) or "out of memory" in str(e).lower()


def train(a, device, record):
    import contextlib
    import torch
    t0 = time.time()
    s = CLASSES[a.system](a, device)
    record["setup_seconds"] = round(time.time() - t0, 2)  # the model's build_seconds inside
    record["model_impl"] = s.impl
    record["budget"] = getattr(s, "budget", None)
    if a.system == "memascend":  # Note [commit interval]: every N-th step durable
        record["commit_every"] = getattr(a, "commit_every_point", 1)
        record["io_threads"] = getattr(a, "io_threads_point", 0) or None  # None: the default
        record["staging"] = getattr(a, "staging_point", "bounded")
    model = s.model
    record["parameters"], record["matmul_parameters"] = s.counts
    tokens = token_stream(a.steps, a.accum, a.batch, a.seq, a.shapes["vocab_size"])
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:  # the GPU peak is the training's: not what the set-up left in torch's cache
        torch.cuda.empty_cache()  # (a model moved off it, offloaded parameters)
        torch.cuda.reset_peak_memory_stats()
    ctx = getattr(s, "context", lambda: None)() or contextlib.nullcontext()
    backward = getattr(s, "backward", None) or \
        (lambda loss: (loss / a.accum if a.accum > 1 else loss).backward())
    losses, times, rss, io = [], [], [], [proc_io()]
    # Each step's forward and backward passes, apart: on a GPU the compute stream's time
    # from the step's start to its last backward (CUDA events, no added synchronisation);
    # torch-gpu's is "the same run's forward+backward alone" the other systems' steps are
    # measured against. A system's own phases per step where it reports them (memascend:
    # Note [step times]).
    event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else None
    fb, fb_host, phases, cpu = [], [], [], []
    offload = getattr(s, "offload", None)  # memascend's: one step's timeline (StepTrace)
    trace = None
    phase_of = getattr(s, "phases", None)
    last = phase_of() if phase_of else None
    for step in range(a.steps):
        sync()
        if offload is not None and step == getattr(a, "trace_step", -1):
            from memascend.torch import StepTrace
            trace = offload.trace = StepTrace(device)
            trace.start()
        t0, c0 = time.perf_counter(), cpu_seconds()
        if cuda:
            begin, end = event(), event()
            begin.record()
        micro = []
        for k in range(a.accum):
            x = tokens[step, k].to(device)
            with ctx:
                loss = model(input_ids=x, labels=x).loss
            backward(loss)
            micro.append(loss.detach())  # read once a step (Note [one sync a step], path.py)
        if cuda:
            end.record()
        fb_host.append(time.perf_counter() - t0)
        s.update()
        if trace is not None and offload.trace is trace:
            trace.host("step", "opt.step()", t0 + fb_host[-1], time.perf_counter())
        sync()
        times.append(time.perf_counter() - t0)
        cpu.append(cpu_seconds() - c0)
        if trace is not None and offload.trace is trace:
            offload.trace = None
            record["trace"] = {"step": step, "seconds": times[-1], "spans": trace.finish()}
        fb.append(begin.elapsed_time(end) / 1e3 if cuda else fb_host[-1])
        if phase_of:
            now = phase_of()
            phases.append({k: round(v - last.get(k, 0.0), 6) for k, v in now.items()})
            last = now
        micro = torch.stack(micro).double().tolist()
        losses.append(sum(micro) / len(micro))
        rss.append(rss_bytes())
        io.append(proc_io())
        # The parent reads these lines back from a run it had to kill (compare.py, partial).
        print(f"[{a.system}] step {step}: loss {losses[-1]:.5f}, {times[-1]:.3f} s, "
              f"VmHWM {proc_status('VmHWM')}", flush=True)
        stall(a)  # a step done: the next one has its own a.stall_dump seconds
    record.update(losses=losses, step_seconds=times, cpu_seconds=cpu, rss_bytes=rss,
                  gpu_peak_bytes=None,
                  torch_pinned_peak_bytes=None, forward_backward_seconds=fb,
                  forward_backward_host_seconds=fb_host,
                  forward_backward_basis=("CUDA events on the compute stream, the step's start "
                                          "to its last backward's end" if cuda else
                                          "perf_counter, the step's start to its last "
                                          "backward's return") + (
                                          " (DeepSpeed's optimizer step inside: its backward "
                                          "steps)" if a.system == "deepspeed-zero-infinity"
                                          else ""))
    if phases:
        record["step_phases"] = phases
    if cuda:
        record["torch_gpu_peak_bytes"] = torch.cuda.max_memory_reserved()
        stats = getattr(torch.cuda, "host_memory_stats", None)
        if stats is not None:
            h = stats()
            record["torch_pinned"] = h
            record["torch_pinned_peak_bytes"] = next(
                (h[k] for k in ("allocated_bytes.peak", "reserved_bytes.peak",
                                "allocated_bytes.all.peak") if k in h), None)
    if None not in io:
        reads = [b[0] - a_[0] for a_, b in zip(io, io[1:])]
        writes = [b[1] - a_[1] for a_, b in zip(io, io[1:])]
        record["io_read_bytes"], record["io_write_bytes"] = reads, writes
        steady = slice(1, None) if a.steps > 2 else slice(None)
        record["io_bytes_per_step"] = {"read": statistics.median(reads[steady]),
                                       "write": statistics.median(writes[steady]),
                                       "source": "/proc/self/io read_bytes, write_bytes"}
    if phases and "io_write_bytes" in phases[0]:
        # The system's own count: /proc/self/io misses O_DIRECT writes (counted when pages
        # are dirtied, which direct I/O never does). The mean over the steps tokens/s is
        # over (steady_step's window: with a commit interval, whole intervals, so the steps
        # that commit write for those that do not).
        steady_phases = phases[1:] if len(phases) > 2 else phases
        every = record.get("commit_every") or 1
        if every > 1 and len(steady_phases) >= every:
            steady_phases = steady_phases[:len(steady_phases) // every * every]
        record["proc_io_bytes_per_step"] = record.get("io_bytes_per_step")
        record["io_bytes_per_step"] = {
            k: statistics.mean(p[f"io_{k}_bytes"] for p in steady_phases)
            for k in ("read", "write")}
        record["io_bytes_per_step"]["source"] = "the system's own counters, the mean over " \
            f"the {len(steady_phases)} steps tokens/s is over"
    t0 = time.time()
    record.update(s.finish())
    record["finish_seconds"] = round(time.time() - t0, 2)
    if cuda:
        record["gpu_peak_bytes"] = record["torch_gpu_peak_bytes"] + record.get(
            "device_budget_bytes", 0)
    steady = times[1:] if len(times) > 2 else times
    step, record["step_basis"] = steady_step(steady, record.get("commit_every") or 1)
    tokens_per_step = a.accum * a.batch * a.seq
    record["tokens_per_step"] = tokens_per_step
    record["tokens_per_s"] = tokens_per_step / step
    layers, hidden = a.layers, a.shapes["hidden_size"]
    flops = train_flops(record["matmul_parameters"], layers, hidden, a.seq, tokens_per_step)
    record["flops_per_step"] = flops
    if a.ceiling_flops:
        record["mfu"] = flops / step / a.ceiling_flops


def pinned_ceiling(torch, size=1 << 30, reps=5):
    """Host-to-device copies of `size` bytes of page-locked memory (CUDA events, one warm-up):
    the ceiling a system's parameter loads are judged against (h2d_ratio)."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    rates = []
    for _ in range(reps + 1):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(size / (begin.elapsed_time(end) / 1e3) / (1 << 30))
    del host, dev
    return {"h2d_gib_per_s": max(rates[1:]), "h2d_gib_per_s_median": statistics.median(rates[1:]),
            "h2d_label": f"{size >> 20} MiB from page-locked host memory (torch pin_memory), "
                         f"CUDA events, best of {reps} after a warm-up"}


def ceiling(a, device):
    """The matrix-product ceiling of this device: bf16 8192^3 with CUDA events on a GPU
    (tools/device/matmul.py); a float32 1024^3 product timed with perf_counter on the CPU."""
    import torch
    if device.startswith("cuda"):
        return {**matmul_ceiling(), **pinned_ceiling(torch),
                "torch_threads": torch.get_num_threads()}
    n = 1024
    x, y = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        x @ y
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        x @ y
        times.append(time.perf_counter() - t0)
    return {"flops": 2 * n ** 3 / statistics.median(times),
            "label": f"CPU float32 matmul {n}^3, perf_counter, median of 10 "
                     f"({torch.get_num_threads()} threads)",
            "torch_threads": torch.get_num_threads()}


def stall(a, done=False):
    """(Re)arms the stack dump of a worker that makes no progress for a.stall_dump seconds
    (faulthandler, every Python thread, to stderr; DeepSpeed's 8M:32 run on the fourth lease
    stood 226 s after its swapper's set-up with no word of where); `done` disarms it."""
    import faulthandler
    faulthandler.cancel_dump_traceback_later()
    if not done and getattr(a, "stall_dump", 0) > 0:
        faulthandler.dump_traceback_later(a.stall_dump, repeat=True)


def worker(a):
    """Runs a.system and writes its record to a.record; the exit status is 0 unless the
    record could not be written."""
    record = {"system": a.system, "run_index": a.run_index, "command": " ".join(
        [sys.executable] + sys.argv), "pid": os.getpid()}
    t0 = time.time()
    try:
        import torch
        record["import_seconds"] = round(time.time() - t0, 2)  # where a run's time goes
        device = a.device if a.device != "auto" else (
            "cuda" if torch.cuda.is_available() else "cpu")
        record.update(device=device_name(device), device_kind=device, torch=torch.__version__)
        if a.system == "ceiling":
            record.update(ceiling(a, device))
        else:
            record["model"] = a.model_name
            stall(a)  # from here to the first step: DeepSpeed's set-up, the build
            try:
                train(a, device, record)
                record["fits"] = True
            except Skip as e:
                record.update(skipped=True, reason=str(e))
            except Exception as e:  # noqa: BLE001 - the record says what happened
                if not is_oom(torch, e):
                    raise
                record.update(fits=False, reason=f"out of memory: {str(e).splitlines()[0]}")
    except Exception as e:  # noqa: BLE001
        record.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    stall(a, done=True)
    record["seconds"] = round(time.time() - t0, 2)
    record["peak_rss_bytes"] = proc_status("VmHWM")
    record.update(BUILT)
    if a.own_cgroup:
        record["cgroup_scope"] = "a group of this run's own"
    else:
        peak, where = cgroup.enclosing_peak()
        record["cgroup_peak_bytes"] = peak
        record["cgroup_scope"] = f"the enclosing group {where}, shared" if peak else where
    tmp = a.record + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(tmp, a.record)
    return 0

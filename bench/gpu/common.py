"""What the GPU benchmarks (bench/gpu/path.py, bench/gpu/compare.py) share: the model
(Llama-3.2-1B's shapes, layers as an option), the token stream, the optimizer's
hyperparameters, and the probes of the process and the machine each record names."""
import json
import os
import resource
import statistics
import subprocess
import sys

ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".."))

# Llama-3.2-1B's shapes (its config.json): the layers are the variable.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=131072)
LR, BETAS, EPS, WD = 1e-5, (0.9, 0.95), 1e-8, 0.01


def parse_bytes(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)


def steady_step(times, every=1):
    """(seconds, basis): the step time a run's tokens/s is over, from `times` (the steady
    steps). The median step; with a commit interval (every > 1, memascend Note [commit
    interval]) the mean over whole intervals, the first k * every steps: any such window
    holds k of the steps that wait for an interval's commit, which a median would leave
    out. Fewer steps than an interval: the mean of all, said in the basis."""
    if every <= 1:
        return statistics.median(times), "median step"
    k = len(times) // every
    window = times[:k * every] if k else times
    basis = (f"mean of {len(window)} steps, {k} whole commit interval(s) of {every}" if k
             else f"mean of {len(window)} steps, under one commit interval of {every}")
    return sum(window) / len(window), basis


def cpu_seconds():
    """The process's CPU time so far (user and system, every thread): a step's share beside
    its wall time says how busy the host was (docs/gpu.md: the steps a background commit
    ran behind were slower)."""
    t = os.times()
    return t.user + t.system


def thread_cpu_seconds():
    """{thread id: (name, CPU seconds so far)} of the process's live threads
    (/proc/self/task/*/stat: user and system). MemAscend names its threads "ma-..." (the
    store's I/O, the kernels' pool, the commit, io_uring's completions); torch's and the
    CUDA driver's have their own names."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
        except OSError:  # ended meanwhile
            continue
        close = st.rindex(")")
        fields = st[close + 2:].split()  # from the state on: utime, stime are the 12th, 13th
        out[int(tid)] = (st[st.index("(") + 1:close], (int(fields[11]) + int(fields[12])) / tick)
    return out


def thread_cpu_delta(before, after, total=None):
    """CPU seconds between two thread_cpu_seconds() by thread name, busiest first (threads of
    one name summed; one started since `before` counted from its start). A thread that ended
    in between (a commit's, which ends before the commit is waited for) is in neither: with
    `total`, the process's CPU seconds over the same span (cpu_seconds), what no live thread
    accounts for is "(ended threads)". Names under 10 ms are left out."""
    by = {}
    for tid, (name, sec) in after.items():
        was = before.get(tid)
        by[name] = by.get(name, 0.0) + sec - (was[1] if was is not None and was[0] == name else 0.0)
    if total is not None:
        by["(ended threads)"] = total - sum(by.values())
    return {k: round(v, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v >= 0.01}


def host_counters():
    """What the machine took from the process, so far: the CPUs' steal time (seconds, every
    CPU: a hypervisor running something else on this VM's CPUs, such as a virtual disk's
    I/O), the process's involuntary and voluntary context switches (preempted; blocked on
    I/O, a lock or an event). A step slow with little CPU time of its own says which."""
    steal = None
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()  # cpu user nice system idle iowait irq softirq steal
        if fields[0] == "cpu" and len(fields) > 8:
            steal = int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        pass
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"host.steal_seconds": steal, "host.involuntary_switches": r.ru_nivcsw,
            "host.voluntary_switches": r.ru_nvcsw}


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def proc_status(key):
    """A /proc/self/status figure in bytes (VmHWM: the peak resident set), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss():
    """Resets VmHWM to the current RSS (/proc/self/clear_refs, "5"): (VmHWM before, None),
    or (VmHWM, why it could not be reset)."""
    before = proc_status("VmHWM")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        return before, f"/proc/self/clear_refs: {e}"
    return before, None


def proc_io():
    """(read_bytes, write_bytes) of /proc/self/io (storage I/O of the whole process, every
    thread), or None where the kernel does not account it."""
    try:
        with open("/proc/self/io") as f:
            d = dict(line.split(": ") for line in f.read().splitlines())
        return int(d["read_bytes"]), int(d["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def commit():
    """The commit measured: $MEMASCEND_COMMIT where whoever launched the bench knows it (the
    device check sets it from the bundle's manifest: the binaries it imports are the
    bundle's, whatever the tree), else git, else the bundle's manifest (a copied tree run
    by hand). A checkout's stale .device/ never names the commit of a build/ it did not make;
    a $MEMASCEND_COMMIT left exported in a shell does, so the variable is for launchers."""
    if os.environ.get("MEMASCEND_COMMIT"):
        return os.environ["MEMASCEND_COMMIT"]
    try:  # this tree's own checkout, not one it was copied under
        r = subprocess.run(["git", "-C", ROOT, "rev-parse", "--show-toplevel", "HEAD"],
                           capture_output=True, text=True, timeout=30)
        top, _, head = r.stdout.strip().partition("\n")
        if r.returncode == 0 and head and os.path.realpath(top) == os.path.realpath(ROOT):
            return head
    except (OSError, subprocess.TimeoutExpired):
        pass
    manifest = os.path.join(ROOT, ".device", "manifest.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            return json.load(f).get("commit")
    return None


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def device_name(device):
    import torch
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    return f"CPU: {cpu_model()} ({os.cpu_count()} cores)"


def llama_shapes(overrides=None):
    """Llama-3.2-1B's shapes with the given ones (hidden_size, ...) replaced; None keeps."""
    shapes = dict(LLAMA_1B)
    shapes.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return shapes


def causal_lm_loss(model, input_ids, chunk=0):
    """The causal-LM loss of a LlamaForCausalLM (transformers' or llama.py's) on `input_ids`,
    its own labels (each token predicts the next): the mean cross-entropy, in fp32, over the
    predicted tokens.

    chunk 0: the model's own (model(input_ids, labels).loss), which makes the whole
    micro-batch's logits, their fp32 copy and its gradient: with Llama-3's 128,256-entry
    vocabulary about 2.6 GB a 2,048-token sequence, the largest tensors of a step under
    activation checkpointing, and what kept the path's micro-batch at one sequence under an
    8 GiB cap. chunk N: the head and the loss N tokens at a time, each piece recomputed in
    backward (torch.utils.checkpoint), so at most N tokens' logits exist at once; the same
    loss up to the order of the additions.

    The body runs inside the root's forward (the model called with logits_to_keep=1, its
    final hidden states taken by a hook on model.model, the one token's logits unused): a
    wrapper's hooks on the root (offload_parameters' saved-tensor hooks, which save a view
    of an offloaded parameter as how to remake it; its direction of the pass) see a forward
    pass as with the model's own loss. The pieces call model.lm_head after it; under the
    checkpoint a piece saves nothing in forward, and its recomputation's tensors are used at
    once by its backward."""
    if chunk <= 0:
        return model(input_ids=input_ids, labels=input_ids).loss
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    def piece(head, h, t):
        return F.cross_entropy(head(h).float(), t, reduction="sum")

    body = {}

    def keep(module, inputs, output):
        body["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") \
            else output[0]

    handle = model.model.register_forward_hook(keep)
    try:
        model(input_ids=input_ids, logits_to_keep=1)
    finally:
        handle.remove()
    hidden = body["hidden"]
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    t = input_ids[:, 1:].reshape(-1)
    total = None
    for i in range(0, t.numel(), chunk):
        s = checkpoint(piece, model.lm_head, h[i:i + chunk], t[i:i + chunk], use_reentrant=False)
        total = s if total is None else total + s
    return total / t.numel()


def matmul_ceiling():
    """The bf16 matrix-product ceiling of GPU 0 (tools/device/matmul.py: 8192^3, CUDA
    events, median of 20), as {"flops", "label", "detail"}: what MFU is measured against."""
    sys.path.insert(0, os.path.join(ROOT, "tools", "device"))
    import matmul
    r = matmul.measure()
    return {"flops": r["median_tflops"] * 1e12, "label": "bf16 matmul 8192^3, CUDA events, "
            "median of 20 (tools/device/matmul.py)", "detail": r}


def counts(model):
    """(parameters, those that take part in matrix products: every 2-D one, the input
    embedding only where it is the head's weight too, a lookup costing no products)."""
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    params = list(model.parameters())
    return (sum(p.numel() for p in params),
            sum(p.numel() for p in params if p.dim() >= 2 and (tied or p is not embed)))


def train_flops(matmul_parameters, layers, hidden, seq, tokens):
    """Model FLOPs of training on `tokens` tokens (forward and backward, recomputation not
    counted): 6 a matrix-product parameter a token, and attention's 12 * layers * hidden *
    seq a token (compare.py's MFU)."""
    return 6 * matmul_parameters * tokens + 12 * layers * hidden * seq * tokens


def build_llama(layers, shapes, device, checkpointing=True, dtype="bfloat16", seed=0,
                init_device=None):
    """(model, implementation): transformers' LlamaForCausalLM built from a config (no
    download), seeded, in `dtype` on `device`; where transformers cannot be imported,
    bench/gpu/llama.py's, which keeps its structure and loss.

    Built with `dtype` the default dtype, so the parameters are made and initialised in
    `dtype`: no float32 copy of the whole model passes through host memory (4 bytes a
    parameter, which would set the peak RSS of a system that holds little on the host,
    and fill a host cap). Made on `init_device` (default `device`), then moved to
    `device`: on a CUDA device (torch's default device, torch >= 2.0), seeded, in a second
    or two, where the CPU took 36 s for 0.5 B bf16 parameters (the third H200 lease: most
    of each run's set-up). The weights depend on where they are made (each device's random
    generator), so every process of a comparison makes them on the run's device, a system
    that holds its model on the CPU included. On the CPU, or an older torch, on the CPU."""
    import contextlib
    import torch
    torch.manual_seed(seed)
    init_device = str(init_device or device)
    on_device = init_device.startswith("cuda") and hasattr(torch.device, "__enter__")
    here = torch.device(init_device) if on_device else contextlib.nullcontext()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:  # imported before the device is made the default: nothing of theirs lands there
        from transformers import LlamaConfig, LlamaForCausalLM
        import transformers
        config = LlamaConfig(num_hidden_layers=layers, **shapes)
        impl = f"transformers {transformers.__version__} LlamaForCausalLM"
    except ImportError as e:
        from llama import LlamaForCausalLM
        config = dict(shapes, num_hidden_layers=layers)
        impl = f"bench/gpu/llama.py LlamaForCausalLM (transformers: {e})"
    try:
        with here:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    impl += f", built on {next(model.parameters()).device}"
    model = model.to(getattr(torch, dtype)).to(device)
    if on_device and not str(device).startswith("cuda"):
        torch.cuda.empty_cache()  # what the build held there is not the system's GPU peak
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, impl


def offload_units(model, units):
    """offload_parameters' `units` for a bench run's --units: "layer", the decoder layer's
    class (transformers' or bench/gpu/llama.py's, at model.model.layers), the unit FSDP2
    is sharded by in the comparison; "module": None, each module with parameters of its
    own loaded by itself."""
    return None if units == "module" else type(model.model.layers[0])


def token_stream(steps, accum, batch, seq, vocab, seed=1):
    """Every step's micro-batches of token ids, [steps, accum, batch, seq]: the same in
    every process and for every system."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, accum, batch, seq), generator=g)

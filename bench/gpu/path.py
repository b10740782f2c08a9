#!/usr/bin/env python3
"""The GPU training path, measured: a transformers Llama with Llama-3.2-1B's shapes fine-
tuned in bf16 through memascend.torch with the GPU's memory capped, against the same
model trained with everything on the GPU (torch.optim.AdamW over fp32 master weights).

    python3 bench/gpu/path.py --out DIR [--layers 16] [--seq 2048] [--batch 1] [--accum 1]
                              [--steps 20]

`--accum N` makes a step N micro-batches of `--batch` sequences (each micro-batch's loss
divided by N), so a step's compute can exceed the update under the GPU cap, where a
larger batch does not fit (the logits alone of 8 sequences of 2048 tokens are 4 GiB in
bf16); memascend's gradients then stay in p.grad until step() (offload_gradients=False).

Run by `./run device bench-gpu-path` (docs/gpu.md). Each system runs in a process of its
own, in a random order; the parent measures the pinned host-to-device ceiling first
(`memascend bench pcie`) and writes one JSON record (DIR/gpu-path-*.json) with the
device, the model, the commit, the command and the figures:

  h2d_ratio                 parameter loads' bandwidth (bytes over the copy stream's
                            time, CUDA events) over the pinned ceiling of the same call
  h2d_ratio_at_part_size    the same over the ceiling of copies of one part's bytes
                            queued back to back (`bench pcie --chunk`; --part-elements,
                            the SDK's default): what the copies' granularity costs
                            (param_mean_copy_bytes: a group's adjacent parts go as one)
  step_over_forward_backward  the step (median; with a commit interval the mean over
                            whole intervals) over the reference's median forward+backward
                            alone, steps 5 to the end (with an interval, the last whole
                            intervals: step_window): what the update and the I/O add
                            (memascend's own forward pass runs the previous step's update,
                            Note [optimizer overlap], so its forward+backward is not "alone")
  between_commits_over_forward_backward  the same with the step that waits for no commit
                            (step_between_commits_seconds: the window's median less its
                            slowest step an interval; none when every step commits)
  cpu_seconds               each run's CPU time a step (every thread, user and system)
  thread_cpu_seconds        the same by thread name, each step (common.thread_cpu_seconds:
                            MemAscend's threads are "ma-...", torch's main and autograd
                            threads and the CUDA driver's have theirs; "(ended threads)":
                            those gone by the step's end, a commit's): whose CPU it was
  host_profile              where the launching thread's time went in one step's
                            forward+backward (--profile-step, outside the window; cProfile:
                            each function's own and cumulative seconds), for both runs
  step_phases, trace        memascend's seconds by phase per step (Note [step times]) and
                            one step's spans (StepTrace, --trace-step), drawn as
                            gpu-path-*-timeline.svg
  step_counters             per step, the store's and the device parameters' counters
                            that say where a slow step waited (COUNTERS: the store's
                            stall and I/O seconds, the acquires' host time, of which in
                            the store's reads and in waits for copies, the copies' own;
                            the CPUs' steal time and the process's context switches)
  loss_rel_diff_max         the largest |loss - reference| / reference over the steps
  rss_growth                host RSS from step 5 to the last, as a fraction
  peak_rss_bytes, peak_pinned_bytes (the store's page-locked arena), gpu_peak_bytes
  (torch's reserved peak plus the device budget of the parameters, which torch's
  allocator is capped to leave: within_gpu_cap, true by construction for a run that
  ends; device_used_bytes_max, the whole device's use at the step ends, CUDA context
  included, says what that count leaves out), tokens_per_s
  mfu, reference_mfu        model FLOPs a step (compare.py's count) over memascend's step,
                            and over the reference's forward+backward alone (its update
                            not counted), against the bf16 matrix-product ceiling the
                            reference's process measures (none without the reference)
  --loss-chunk N            both runs' head and loss N tokens at a time
                            (common.causal_lm_loss): larger micro-batches under the cap
"""
import argparse
import datetime
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time

import timeline
from common import (LLAMA_1B, LR, BETAS, EPS, WD, ROOT, build_llama, causal_lm_loss, commit,
                    counts, cpu_seconds, matmul_ceiling,
                    host_counters, offload_units, parse_bytes, rss_bytes, steady_step,
                    thread_cpu_delta, thread_cpu_seconds, token_stream, train_flops)


def build(a):
    model, _ = build_llama(a.layers, LLAMA_1B, "cuda", bool(a.checkpointing))
    tokens = token_stream(a.steps, a.accum, a.batch, a.seq, LLAMA_1B["vocab_size"])
    return model, tokens


def forward_backward(model, tokens, accum, loss_chunk=0):
    """A step's micro-batches, forward and backward; their mean loss.

    Note [one sync a step]: the losses stay on the GPU until the step's micro-batches are
    all launched, then are read at once, as a loop that logs once a step does (Hugging
    Face's Trainer adds them up on the device). A float(loss) a micro-batch, which this did
    before, made the host wait for each micro-batch's backward to finish, so the next
    forward's first launches (and, under offload_parameters, its first loads) met an idle
    GPU. compare.py's systems (systems.train) read their losses the same way."""
    import torch
    losses = []
    for x in tokens:
        x = x.cuda()
        loss = causal_lm_loss(model, x, loss_chunk)
        (loss / accum if accum > 1 else loss).backward()
        losses.append(loss.detach())
    return sum(torch.stack(losses).double().tolist()) / accum


def host_profile(fn, top=40):
    """fn() under cProfile (the calling thread: the one that launches the GPU's work): its
    result and the `top` functions by their own time, as [function, calls, own seconds,
    cumulative seconds]."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    try:
        result = fn()
    finally:
        prof.disable()
    rows = [[f"{os.path.basename(file)}:{line}({name})", calls, own, cum]
            for (file, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items()]
    rows.sort(key=lambda r: -r[2])
    return result, rows[:top]


def profiled_forward_backward(a, step, model, tokens):
    """forward_backward, under host_profile at --profile-step: (loss, profile or None)."""
    if step != a.profile_step:
        return forward_backward(model, tokens, a.accum, a.loss_chunk), None
    loss, rows = host_profile(lambda: forward_backward(model, tokens, a.accum, a.loss_chunk))
    return loss, {"step": step, "top_by_own_seconds": rows}


def step_window(steps, every):
    """The steps the step time is over: from step 5 to the last, or with a commit interval
    (every > 1) the last whole intervals from step 5 on, reaching back before step 5 for
    one whole interval where fewer steps are left (8 steps, every 4: steps 4 to 7), never
    to step 0 (the first, with its set-up) unless it is the only one. A window of part of
    an interval holds its commit at the wrong weight (steps 5-7 of 8: one commit in three
    steps, not in four)."""
    first = min(5, max(steps - 1, 0))
    if every > 1:
        whole = (steps - first) // every * every
        first = steps - whole if whole else max(min(first, 1), steps - every)
    return slice(first, None)


def between_commits(times, every):
    """The step that waits for no commit: the median of `times` (a window of whole
    intervals, step_window's) less its slowest step in each interval; None without an
    interval (every step commits)."""
    if every <= 1:
        return None
    k = max(1, len(times) // every)
    rest = sorted(times)[:len(times) - k]
    return statistics.median(rest) if rest else None


# Per-step deltas of these counters of opt.stats() (memascend's run): a step that is slow
# because its acquires waited for the store (a part being written back by a commit), for
# earlier copies, or for a host-to-device bandwidth shared with the disk's writes says so.
COUNTERS = {
    "store": ("stall_seconds", "read_seconds", "write_seconds", "bytes_read", "bytes_written"),
    "device_parameters": ("acquire_seconds", "read_seconds", "copy_wait_seconds", "copy_seconds",
                          "bytes_to_device", "copies", "misses"),
}


def counters(stats):
    """The COUNTERS of an opt.stats(), flat ("store.stall_seconds": ...), and the host's
    (common.host_counters: steal time, context switches)."""
    c = {f"{k}.{n}": stats[k][n] for k, names in COUNTERS.items() for n in names}
    c.update(host_counters())
    return c


def child_reference(a):
    import torch
    ceiling = matmul_ceiling()  # in this process, which has the whole device
    torch.cuda.empty_cache()  # the product's matrices are not the reference's peak
    torch.cuda.reset_peak_memory_stats()
    model, tokens = build(a)
    matmul_parameters = counts(model)[1]
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    losses, fb, cpu, threads, profile = [], [], [], [], None
    for step in range(a.steps):
        torch.cuda.synchronize()
        th0 = thread_cpu_seconds()  # its /proc scan outside the timed span
        t0, c0 = time.perf_counter(), cpu_seconds()
        loss, prof = profiled_forward_backward(a, step, model, tokens[step])
        profile = prof or profile
        torch.cuda.synchronize()
        fb.append(time.perf_counter() - t0)  # forward+backward alone: what the path's step
        cpu.append(cpu_seconds() - c0)
        threads.append(thread_cpu_delta(th0, thread_cpu_seconds(), cpu[-1]))
        for m, p in zip(master, params):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)
        losses.append(loss)
    return {"system": "torch-gpu", "losses": losses, "forward_backward_seconds": fb,
            "cpu_seconds": cpu, "thread_cpu_seconds": threads,
            "gpu_peak_bytes": torch.cuda.max_memory_reserved(), "host_profile": profile,
            "matmul_ceiling": ceiling, "matmul_parameters": matmul_parameters}


def child_memascend(a):
    import torch
    import memascend.torch as mt
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, a.gpu_cap / total))
    model, tokens = build(a)
    opt = mt.OffloadedAdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            volume=os.path.join(a.volume_dir, "gpu_path.vol"),
                            host_budget=a.host_budget, overwrite=True,
                            commit_every=a.commit_every, part_elements=a.part_elements,
                            offload_gradients=False if a.accum > 1 else None)
    offload = mt.offload_parameters(model, opt, units=offload_units(model, a.units))
    torch.cuda.empty_cache()
    # The device budget is the SDK's own cudaMalloc, outside torch's allocator and its
    # fraction: torch gets the cap less it, so the two together stay under --gpu-cap (the
    # fifth lease's run gave torch the whole cap, 6.97 GB of it reserved beside 2.10 GB).
    torch_cap = a.gpu_cap - opt._cuda.budget
    if torch_cap <= 0:
        raise SystemExit(f"--gpu-cap {a.gpu_cap} leaves nothing beside the device budget "
                         f"{opt._cuda.budget}")
    torch.cuda.set_per_process_memory_fraction(min(1.0, torch_cap / total))
    torch.cuda.reset_peak_memory_stats()
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    pinned_before = host_stats() if host_stats else None
    losses, fb, steps, rss, phases, cpu, threads, device_used = [], [], [], [], [], [], [], []
    traced = profile = None
    first = opt.stats()
    last, last_counters, step_counters = first["seconds"], counters(first), []
    for step in range(a.steps):
        torch.cuda.synchronize()
        if step == min(a.trace_step, a.steps - 1):  # its timeline (memascend.torch.StepTrace)
            offload.trace = mt.StepTrace("cuda")
            offload.trace.start()
        th0 = thread_cpu_seconds()  # its /proc scan outside the timed span
        t0, c0 = time.perf_counter(), cpu_seconds()
        loss, prof = profiled_forward_backward(a, step, model, tokens[step])
        profile = prof or profile
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if offload.trace is not None:
            offload.trace.host("step", "opt.step()", t1, t2)
            traced = {"step": step, "seconds": t2 - t0, "spans": offload.trace.finish()}
            offload.trace = None
        stats = opt.stats()
        now, now_counters = stats["seconds"], counters(stats)  # Note [step times]
        phases.append({k: now[k] - last[k] for k in now})
        step_counters.append({k: None if now_counters[k] is None or last_counters[k] is None
                              else now_counters[k] - last_counters[k] for k in now_counters})
        last, last_counters = now, now_counters
        losses.append(loss)
        fb.append(t1 - t0)
        steps.append(t2 - t0)
        cpu.append(cpu_seconds() - c0)
        threads.append(thread_cpu_delta(th0, thread_cpu_seconds(), cpu[-1]))
        free, whole = torch.cuda.mem_get_info()  # the device's, the CUDA context included
        device_used.append(whole - free)
        rss.append(rss_bytes())
        print(f"[memascend] step {step}: loss {losses[-1]:.4f}, forward+backward {fb[-1]:.3f} s, "
              f"step {steps[-1]:.3f} s, CPU {cpu[-1]:.2f} s", flush=True)
    opt.settle()
    stats = opt.stats()
    pinned_after = host_stats() if host_stats else None
    dp = stats["device_parameters"]
    out = {
        "system": "memascend", "losses": losses, "forward_backward_seconds": fb,
        "offload_gradients": a.accum == 1,  # accumulating: each gradient leaves at step()
        "update_threads": torch.get_num_threads(),
        "forward_backward_basis": "host, synchronised: the previous step's update runs in the "
                                  "forward pass (Note [optimizer overlap])",
        "step_phases": phases, "step_counters": step_counters, "trace": traced, "host_profile": profile,
        "step_seconds": steps, "cpu_seconds": cpu, "thread_cpu_seconds": threads,
        "rss_bytes": rss,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_pinned_bytes": stats["store"]["pinned_peak_bytes"],
        "torch_gpu_peak_bytes": torch.cuda.max_memory_reserved(),
        "device_budget_bytes": opt._cuda.budget, "torch_gpu_cap_bytes": torch_cap,
        "device_used_bytes_at_step_ends": device_used,
        "param_bytes_to_device": dp["bytes_to_device"],
        "param_copy_seconds": dp["copy_seconds"],
        "device_parameters": dp, "device_gradients": stats["device_gradients"],
        "store": stats["store"],
        "torch_pinned_cache_before": pinned_before, "torch_pinned_cache_after": pinned_after,
    }
    offload.remove()
    opt.close()
    return out


def run_child(mode, a):
    """One child, its output passed on line by line as it comes (a call cut short keeps
    the steps that ran), killed after a.timeout seconds; its record is its last JSON line."""
    cmd = [sys.executable, "-u", os.path.abspath(__file__), "--child", mode] + a.forward
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    expired = threading.Event()
    timer = threading.Timer(a.timeout, lambda: (expired.set(), p.kill()))
    timer.start()
    lines = []
    try:
        for line in p.stdout:
            print(f"[{mode}] {line}", end="", flush=True)
            lines.append(line)
        p.wait()
    finally:
        timer.cancel()
    if p.returncode != 0:
        why = f"killed after {a.timeout} s" if expired.is_set() else f"exit {p.returncode}"
        return {"system": mode, "error": why, "seconds": time.time() - t0}
    last = next((x for x in reversed(lines) if x.startswith("{")), None)  # stderr merged
    if last is None:
        return {"system": mode, "error": "exit 0 without its record", "seconds": time.time() - t0}
    r = json.loads(last)
    r["seconds"] = round(time.time() - t0, 1)
    return r


# memascend.torch's default part_elements (_common.DEFAULT_PART_ELEMENTS; a test checks):
# the parent process does not import memascend.
PART_ELEMENTS = 1 << 20


def pcie_ceiling(cli, chunk=0):
    """`memascend bench pcie` over 1 GiB (and, with `chunk` under it, in copies of `chunk`
    bytes); without the chunked figure when that fails (a CLI without --chunk)."""
    if 0 < chunk < 1 << 30:
        r = _pcie(cli, ["--chunk", str(chunk)])
        if r is not None:
            return r
    return _pcie(cli, [])


def _pcie(cli, extra):
    p = subprocess.run([cli, "bench", "pcie", "--size", "1G", "--reps", "5", "--json"] + extra,
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", choices=["reference", "memascend"])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches of --batch a step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--gpu-cap", type=parse_bytes, default=parse_bytes("8G"))
    ap.add_argument("--host-budget", type=parse_bytes, default=parse_bytes("24G"))
    ap.add_argument("--checkpointing", type=int, default=1)
    ap.add_argument("--units", default="layer", choices=["layer", "module"],
                    help="what offload_parameters loads whole: each decoder layer, or each "
                    "module with parameters of its own")
    ap.add_argument("--commit-every", type=int, default=1,
                    help="every N-th step durable (docs/python.md, 'Commit interval')")
    ap.add_argument("--volume-dir", default=os.path.join(ROOT, "build", "device-scratch"))
    ap.add_argument("--cli", default=os.path.join(ROOT, "build", "device", "tools", "memascend"))
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "build")))
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--loss-chunk", type=int, default=0, help="the head and the loss this "
                    "many tokens at a time, recomputed in backward (common.causal_lm_loss; 0: "
                    "the model's own loss over the whole micro-batch's logits)")
    ap.add_argument("--part-elements", type=int, default=PART_ELEMENTS,
                    help="elements of a state part (OffloadedAdamW part_elements): the "
                         "chunked ceiling copies one part's bytes at a time (a group's "
                         "adjacent parts go as one copy: param_mean_copy_bytes)")
    ap.add_argument("--trace-step", type=int, default=2,
                    help="the step whose spans memascend's run records (StepTrace: trace)")
    ap.add_argument("--profile-step", type=int, default=1,
                    help="the step whose forward+backward runs under cProfile in both runs "
                         "(host_profile; -1: none); keep it out of the timed window")
    a = ap.parse_args()
    if a.accum < 1 or a.batch < 1:
        ap.error("--batch and --accum must be at least 1")
    if a.child:
        r = child_reference(a) if a.child == "reference" else child_memascend(a)
        print(json.dumps(r))
        return 0
    os.makedirs(a.volume_dir, exist_ok=True)
    a.forward = [f"--layers={a.layers}", f"--seq={a.seq}", f"--batch={a.batch}",
                 f"--accum={a.accum}",
                 f"--steps={a.steps}", f"--gpu-cap={a.gpu_cap}", f"--host-budget={a.host_budget}",
                 f"--checkpointing={a.checkpointing}", f"--volume-dir={a.volume_dir}",
                 f"--commit-every={a.commit_every}", f"--units={a.units}",
                 f"--profile-step={a.profile_step}", f"--trace-step={a.trace_step}",
                 f"--part-elements={a.part_elements}", f"--loss-chunk={a.loss_chunk}"]
    ceiling = pcie_ceiling(a.cli, chunk=2 * a.part_elements)  # bf16 parameters
    order = ["reference", "memascend"]
    random.Random(time.time_ns()).shuffle(order)
    results = {}
    os.makedirs(a.out, exist_ok=True)
    for mode in order:
        results[mode] = run_child(mode, a)
        # Kept as each run ends: a call cut before the record keeps the finished run's.
        with open(os.path.join(a.out, f"gpu-path-{a.layers}l-{mode}-run.json"), "w") as f:
            json.dump(results[mode], f, indent=1)
    ref, mem = results["reference"], results["memascend"]
    record = {
        "kind": "gpu-path", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "command": " ".join([sys.executable] + sys.argv), "order": order,
        "model": f"llama-3.2-1b-shapes-{a.layers}-layers", "seq": a.seq, "batch": a.batch,
        "accum": a.accum, "tokens_per_step": a.accum * a.batch * a.seq,
        "commit_every": a.commit_every, "part_elements": a.part_elements,
        "units": a.units,
        "steps": a.steps, "gpu_cap_bytes": a.gpu_cap, "host_budget_bytes": a.host_budget,
        "checkpointing": bool(a.checkpointing), "pcie": ceiling, "runs": results,
    }
    try:
        import torch
        record["device"] = torch.cuda.get_device_name(0)
        record["torch"] = torch.__version__
    except Exception as e:  # noqa: BLE001 - the record says why
        record["device"] = f"unknown ({e})"
    record["commit"] = commit()
    if "error" not in mem:
        tail = slice(min(5, a.steps - 1), None)
        window = step_window(a.steps, a.commit_every)
        st, record["step_basis"] = steady_step(mem["step_seconds"][window], a.commit_every)
        between = between_commits(mem["step_seconds"][window], a.commit_every)
        record["step_between_commits_seconds"] = between
        if "error" not in ref:  # the model's forward+backward alone, on the GPU
            fb = statistics.median(ref["forward_backward_seconds"][window])
            record["forward_backward_seconds"] = fb
            record["step_over_forward_backward"] = st / fb
            if between is not None:
                record["between_commits_over_forward_backward"] = between / fb
            # MFU (compare.py's): model FLOPs a step over the step, against the ceiling.
            flops = train_flops(ref["matmul_parameters"], a.layers, LLAMA_1B["hidden_size"],
                                a.seq, a.accum * a.batch * a.seq)
            record["flops_per_step"] = flops
            record["matmul_ceiling"] = ref["matmul_ceiling"]
            record["mfu"] = flops / st / ref["matmul_ceiling"]["flops"]
            record["reference_mfu"] = flops / fb / ref["matmul_ceiling"]["flops"]
        if mem.get("trace"):
            timeline.svg(mem["trace"]["spans"], f"llama-3.2-1b-shapes-{a.layers}-layers, batch "
                         f"{a.batch} x {a.accum}: step {mem['trace']['step']}", os.path.join(
                             a.out, f"gpu-path-{a.layers}l-timeline.svg"))
        record["tokens_per_s"] = a.accum * a.batch * a.seq / st
        rss = mem["rss_bytes"][tail]
        record["rss_growth"] = (rss[-1] - rss[0]) / rss[0]
        record["peak_rss_bytes"] = mem["peak_rss_bytes"]
        record["peak_pinned_bytes"] = mem["peak_pinned_bytes"]
        record["gpu_peak_bytes"] = mem["torch_gpu_peak_bytes"] + mem["device_budget_bytes"]
        record["within_gpu_cap"] = record["gpu_peak_bytes"] <= a.gpu_cap
        record["device_used_bytes_max"] = max(mem["device_used_bytes_at_step_ends"])
        if mem["param_copy_seconds"] > 0 and ceiling:
            h2d = mem["param_bytes_to_device"] / mem["param_copy_seconds"] / 2**30
            record["param_h2d_gib_per_s"] = h2d
            record["h2d_ratio"] = h2d / ceiling["h2d_gib_per_s"]
            if ceiling.get("h2d_chunked_gib_per_s"):
                record["h2d_ratio_at_part_size"] = h2d / ceiling["h2d_chunked_gib_per_s"]
            copies = mem["device_parameters"].get("copies")
            if copies:  # parts go as runs of adjacent blocks: the copies' mean size
                record["param_mean_copy_bytes"] = mem["param_bytes_to_device"] / copies
        if "error" not in ref:
            record["loss_rel_diff_max"] = max(
                abs(m - r) / abs(r) for m, r in zip(mem["losses"], ref["losses"]))
    name = f"gpu-path-{a.layers}l-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(record, f, indent=1)
    keys = ["model", "device", "h2d_ratio", "h2d_ratio_at_part_size", "param_h2d_gib_per_s",
            "step_over_forward_backward",
            "between_commits_over_forward_backward", "loss_rel_diff_max", "rss_growth", "peak_rss_bytes", "peak_pinned_bytes",
            "gpu_peak_bytes", "within_gpu_cap", "tokens_per_s", "mfu", "reference_mfu"]
    print(json.dumps({k: record.get(k) for k in keys}, indent=1))
    return 0 if "error" not in mem and "error" not in ref else 1


if __name__ == "__main__":
    sys.exit(main())

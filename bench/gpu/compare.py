#!/usr/bin/env python3
"""MemAscend against what a GPU user runs instead, side by side on one machine (issue 40):
one model, one token stream, one sequence length and batch, several systems, each in a
process of its own, in a random order (seeded; the order is recorded).

    python3 bench/gpu/compare.py --out DIR [--systems torch-gpu,fsdp2-offload,...]
        [--budgets 5,10,...] [--layers 16] [--seq 2048] [--batch 1] [--accum 1] [--steps 20]
    python3 bench/gpu/compare.py --fit --out DIR ...   # what each system trains under a cap

Run by `./run device bench-gpu` (docs/gpu.md). The systems (bench/gpu/systems.py): torch-gpu
(everything on the device, torch.optim.AdamW over fp32 master weights: the reference, where
it fits), fsdp2-offload (FSDP2 with CPUOffloadPolicy(pin_memory=True), world size 1),
deepspeed-zero-infinity (ZeRO-3, parameters and optimizer state on NVMe; one run per aio
point of --ds-aio), memascend (memascend.torch at each budget of --budgets, percent of the
training state, fixed before any run: the CPU frontier's list). A system that cannot run
here (no FSDP2 in torch 1.13, no deepspeed importable) is recorded skipped, with the reason.

The model: transformers' LlamaForCausalLM from a config (Llama-3.2-1B's shapes, --layers;
bench/gpu/llama.py's where transformers is missing), bf16, activation checkpointing.

Every run writes its record, DIR/compare-NN-SYSTEM[-BUDGET].json, as soon as it ends (a
call cut short keeps what finished; a run past --run-timeout is killed and recorded so):
system, model, device, commit, command, budget, peak_rss_bytes (the worker's VmHWM),
cgroup_peak_bytes (a cgroup of the run's own where one can be made, else the enclosing
group's, said in cgroup_scope), torch_pinned_peak_bytes (torch.cuda.host_memory_stats),
memascend_pinned_peak_bytes (the store's page-locked arena), gpu_peak_bytes (torch's
reserved peak plus memascend's device budget), losses and step_seconds per step,
io_threads (memascend: the store's I/O threads, --io-threads; null: the SDK's default),
tokens_per_s (over the median step, the first left out; a memascend row with
--commit-every N > 1, over the mean of whole intervals of N steps: step_basis says which),
io_bytes_per_step (/proc/self/io deltas, median), mfu, run_index. At the end each record
gains loss_rel_diff_max against the reference (torch-gpu; where it did not fit, fsdp2-offload, whose update is the same AdamW
over fp32 master weights; `reference` names it) and `void` (true where any step's loss
differs from the reference's by more than 1e-2 relatively), and DIR/compare-summary.json
holds the table.

MFU: FLOPs per step = 6 * P * T + 12 * L * d * s * T, over the median step time and the
matrix-product ceiling the parent measures first in the same call (bf16 8192^3 on a GPU;
float32 1024^3 on the CPU, labelled). P: parameters in matrix products (the input embedding
only where tied to the head), T: tokens per step, L: layers, d: hidden size, s: sequence
length. Recomputation under activation checkpointing is not counted (model FLOPs).
"""
import argparse
import datetime
import glob
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import cgroup  # noqa: E402
from common import ROOT, commit, llama_shapes, parse_bytes  # noqa: E402
from frontier import BUDGETS  # noqa: E402  (the CPU frontier's budgets, percent of the state)
import systems  # noqa: E402
import timeline  # noqa: E402

VOID_REL = 1e-2
# Options every worker gets as the parent has them (dest names).
SHARED = ["layers", "seq", "batch", "accum", "steps", "hidden", "heads", "kv_heads",
          "intermediate", "vocab", "checkpointing", "device", "offload_activations",
          "activation_budget", "activation_volume", "ds_param_buffers", "ds_param_buffer_size",
          "ds_optimizer_buffers", "ds_sub_group_size", "ds_max_in_cpu", "ds_pipeline",
          "ds_pin", "ds_threads", "trace_step", "units", "stall_dump"]


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "build", "gpu-compare"))
    add("--systems", default=",".join(systems.SYSTEMS))
    add("--budgets", default=",".join(map(str, BUDGETS)), help="memascend's, percent of the state")
    add("--io-threads", default="", help="memascend: the store's I/O threads (OffloadedAdamW "
        "io_threads), a row per count at each budget; empty: the SDK's default")
    add("--commit-every", default="1", help="memascend's commit intervals, a row per budget and "
        "interval (1: every step durable, the default; N: every N-th, the steps between in "
        "memory: docs/python.md, 'Commit interval')")
    add("--staging", default="bounded", help="memascend durable every step: 'bounded' (batches "
        "within a bound, the state's disk), 'step' (the step staged whole, a version more disk: "
        "docs/python.md, 'A step staged whole'), or both, a row each at commit interval 1")
    add("--layers", type=int, default=16)
    add("--seq", type=int, default=2048)
    add("--batch", type=int, default=1)
    add("--accum", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    add("--steps", type=int, default=20)
    for name in ("hidden", "heads", "kv-heads", "intermediate", "vocab"):
        add(f"--{name}", type=int, help="replaces Llama-3.2-1B's (tiny models for tests)")
    add("--checkpointing", type=int, default=1)
    add("--trace-step", type=int, default=2, help="memascend: the step (from 0) whose timeline "
        "is recorded (memascend.torch.StepTrace) and drawn, timeline-*.svg (-1: none)")
    add("--device", default="auto", choices=["auto", "cuda", "cpu"])
    add("--offload-activations", type=int, default=0, help="memascend: offload_activations")
    add("--units", default="layer", choices=["layer", "module"], help="memascend: what "
        "offload_parameters loads whole: each decoder layer (units=its class, the unit "
        "FSDP2 is sharded by here) or each module with parameters of its own")
    add("--activation-budget", type=parse_bytes, default=parse_bytes("512M"))
    add("--activation-volume", type=parse_bytes, default=parse_bytes("8G"))
    add("--nvme-path", help="where the volumes and DeepSpeed's swap files go (default OUT/"
        "scratch; each run's removed after it)")
    add("--keep-scratch", action="store_true")
    add("--seed", type=int, help="the order's (default: from the clock; recorded)")
    add("--run-timeout", type=int, default=900, help="seconds per run")
    add("--stall-dump", type=int, default=60, help="a worker with no step done for this many "
        "seconds prints every Python thread's stack to its stderr, again each time it passes "
        "(the record's log_tail keeps the last: where a run that never stepped stood; 0: off)")
    add("--cli", default=None, help="the memascend CLI, for the CPU update's ceiling (`bench "
        "kernels`; default: $MEMASCEND_CLI, else the device bundle's or a build's)")
    add("--cpu-kernels-elements", default="32M", help="elements of that measurement")
    add("--time-budget", type=int, default=0, help="seconds for the whole call (0: none): "
        "no run starts with under a minute of it left, and none runs past it")
    # DeepSpeed: DeepSpeed's defaults, the parameter buffer raised past the largest tensor;
    # one run per aio point (block:queue depth): its default and ds_nvme_tune's corner.
    add("--ds-aio", default="1M:8,8M:32")
    add("--ds-param-buffers", type=int, default=5)
    add("--ds-param-buffer-size", type=int, default=100_000_000)
    add("--ds-optimizer-buffers", type=int, default=4)
    add("--ds-sub-group-size", type=int, default=1_000_000_000)
    add("--ds-max-in-cpu", type=int, default=1_000_000_000)
    add("--ds-pipeline", type=int, default=0, help="pipeline_read and pipeline_write")
    add("--ds-pin", type=int, default=1, help="pin_memory of both offloads")
    add("--ds-threads", type=int, default=1)
    # --fit: under a host memory cap
    add("--fit", action="store_true")
    add("--host-cap", type=parse_bytes, default=parse_bytes("16G"))
    add("--fit-layers", default="2,4,8,16,24,32,48,64", help="decoder layers at the model's "
        "widths; from 2, since FSDP2 holds 16 bytes a parameter and the 1B (16) is over 16 GiB")
    add("--fit-seqs", default="2048,4096,8192,16384,32768,65536,131072")
    add("--fit-steps", type=int, default=3)
    add("--fit-budget", type=float, default=10.0, help="memascend's budget in --fit")
    add("--summarize", nargs="+", metavar="PATH", help="no run: the records of earlier calls "
        "(their --out directories, or a file of calls) in one table and one plot, into --out")
    # the worker's
    add("--system", help=argparse.SUPPRESS)
    add("--budget", type=float, help=argparse.SUPPRESS)
    add("--commit-every-point", type=int, default=1, help=argparse.SUPPRESS)
    add("--io-threads-point", type=int, default=0, help=argparse.SUPPRESS)
    add("--staging-point", default="bounded", help=argparse.SUPPRESS)
    add("--ds-aio-point", help=argparse.SUPPRESS)
    add("--record", help=argparse.SUPPRESS)
    add("--scratch", help=argparse.SUPPRESS)
    add("--ceiling-flops", type=float, default=0.0, help=argparse.SUPPRESS)
    add("--run-index", type=int, default=0, help=argparse.SUPPRESS)
    add("--own-cgroup", type=int, default=0, help=argparse.SUPPRESS)
    return ap


def shapes_of(a):
    return llama_shapes({"hidden_size": a.hidden, "num_attention_heads": a.heads,
                         "num_key_value_heads": a.kv_heads, "intermediate_size": a.intermediate,
                         "vocab_size": a.vocab})


def model_name(a):
    s = shapes_of(a)
    base = "llama-3.2-1b-shapes" if s == llama_shapes() else \
        f"llama-h{s['hidden_size']}-i{s['intermediate_size']}-v{s['vocab_size']}"
    return f"{base}-{a.layers}-layers"


def aio_point(text):
    block, qd = text.split(":")
    return parse_bytes(block), int(qd)


def plan(a):
    runs = []
    for name in a.systems.split(","):
        if name not in systems.SYSTEMS:
            sys.exit(f"compare: unknown system '{name}' (known: {', '.join(systems.SYSTEMS)})")
        if name == "memascend":
            counts = [int(t) for t in a.io_threads.split(",")] if a.io_threads else [0]
            stagings = list(dict.fromkeys(a.staging.split(",")))
            if not set(stagings) <= {"bounded", "step"}:
                sys.exit(f"compare: --staging takes bounded and step, not '{a.staging}'")
            # A commit interval above 1 stages whole versions anyway: one row.
            runs += [{"system": name, "budget": float(b), "commit_every": int(n),
                      **({"staging": "step"} if st == "step" else {}),
                      **({"io_threads": t} if t else {})}
                     for b in a.budgets.split(",") for n in a.commit_every.split(",")
                     for st in (stagings if int(n) == 1 else ["bounded"]) for t in counts]
        elif name == "deepspeed-zero-infinity":
            runs += [{"system": name, "ds_aio_point": p} for p in a.ds_aio.split(",")]
        else:
            runs.append({"system": name})
    return runs


def label(run):
    if "budget" in run:
        every = run.get("commit_every", 1)
        return f"{run['system']}-{run['budget']:g}pct" + (f"-c{every}" if every > 1 else "") + \
            ("-staged" if run.get("staging") == "step" else "") + \
            (f"-t{run['io_threads']}" if run.get("io_threads") else "")
    if "ds_aio_point" in run:
        return f"{run['system']}-{run['ds_aio_point'].replace(':', 'x')}"
    return run["system"]


class Parent:
    def __init__(self, a):
        self.a = a
        self.started = time.time()
        self.scratch_root = a.nvme_path or os.path.join(a.out, "scratch")
        self.group_why = None

    def worker_cmd(self, run, record, index, overrides=None, own_cgroup=False):
        a, cmd = self.a, [sys.executable, os.path.abspath(__file__)]
        for dest in SHARED:
            v = (overrides or {}).get(dest, getattr(a, dest))
            if v is not None:
                cmd.append(f"--{dest.replace('_', '-')}={v}")
        cmd += [f"--system={run['system']}", f"--record={record}", f"--run-index={index}",
                f"--scratch={os.path.join(self.scratch_root, os.path.basename(record)[:-5])}",
                f"--ceiling-flops={self.ceiling.get('flops') or 0}", f"--own-cgroup={int(own_cgroup)}"]
        if "budget" in run:
            cmd.append(f"--budget={run['budget']}")
        if "commit_every" in run:
            cmd.append(f"--commit-every-point={run['commit_every']}")
        if run.get("io_threads"):
            cmd.append(f"--io-threads-point={run['io_threads']}")
        if run.get("staging"):
            cmd.append(f"--staging-point={run['staging']}")
        if "ds_aio_point" in run:
            cmd.append(f"--ds-aio-point={run['ds_aio_point']}")
        return cmd

    def launch(self, run, name, index, overrides=None, limit=None):
        """Runs one worker; returns its record (written by it, or here when it left none)."""
        a = self.a
        record_path = os.path.join(a.out, name + ".json")
        group, why = cgroup.make(f"memascend-compare-{os.getpid()}-{index}", limit)
        self.group_why = why
        cmd = self.worker_cmd(run, record_path, index, overrides, group is not None)
        t0 = time.time()
        status, tail = None, ""
        timeout = a.run_timeout
        if a.time_budget:
            timeout = max(1, min(timeout, int(a.time_budget - (t0 - self.started))))
        # A session of its own, killed whole on a timeout: a compiler or ninja the worker
        # started (DeepSpeed builds its ops on first use) would hold the pipes open.
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, preexec_fn=group.join if group else None)
        try:
            out, err = p.communicate(timeout=timeout)
            status = p.returncode
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            out, err = p.communicate()
            status = "timeout"
        tail = (out or "")[-6000:] + "\n--- stderr ---\n" + (err or "")[-6000:]
        print(f"[compare] {name}: exit {status} in {time.time() - t0:.1f} s", flush=True)
        try:
            with open(record_path) as f:
                r = json.load(f)
        except (OSError, ValueError):
            r = {"system": run["system"], "run_index": index, "command": " ".join(cmd),
                 "error": f"the worker left no record (exit {status})", "log_tail": tail,
                 "fits": False if group is not None and limit else None}
            if status == "timeout":
                r["error"] = f"killed after {timeout} s (--run-timeout, --time-budget)"
            r.update(partial(out))
        if status != 0 or r.get("error"):
            r.setdefault("log_tail", tail)  # the compiler's or the library's own words
        r.update({k: v for k, v in run.items() if k not in r or r[k] is None})
        r.update(model=r.get("model") or model_name(a), commit=self.commit, order=self.order,
                 exit=status, parent_command=" ".join([sys.executable] + sys.argv),
                 ceiling=self.ceiling)
        if group is not None:
            r.update(cgroup_peak_bytes=group.peak(), cgroup_scope="a group of this run's own",
                     cgroup_limit_bytes=limit, cgroup_oom_kills=group.oom_kills())
            group.remove()
        elif "cgroup_scope" not in r:
            r["cgroup_peak_bytes"], r["cgroup_scope"] = None, why
        r["cgroup_why_none"] = why
        r["record_file"] = os.path.basename(record_path)
        write(record_path, r)
        if not a.keep_scratch:
            shutil.rmtree(os.path.join(self.scratch_root, name), ignore_errors=True)
        return r

    def measure_ceiling(self):
        self.ceiling = {}
        r = self.launch({"system": "ceiling"}, "compare-ceiling", -1)
        self.ceiling = {k: r.get(k) for k in ("flops", "label", "device", "error", "h2d_gib_per_s",
                                              "h2d_gib_per_s_median", "h2d_label") if k in r}
        # at the update's thread count (torch's default, OffloadedAdamW's), not every CPU
        self.ceiling.update(cpu_update_ceiling(self.a.cli, self.a.cpu_kernels_elements,
                                               r.get("torch_threads")))
        return r


def find_cli(given):
    if given or os.environ.get("MEMASCEND_CLI"):
        return given or os.environ["MEMASCEND_CLI"]
    for build in (os.path.join(ROOT, ".device", "unpacked", "build"),
                  os.path.join(ROOT, "build", "device"), os.path.join(ROOT, "build", "release"),
                  os.path.join(ROOT, "build", "test")):
        cli = os.path.join(build, "tools", "memascend")
        if os.access(cli, os.X_OK):
            return cli
    return None


def cpu_update_ceiling(given, elements, threads=None):
    """The CPU update's ceiling in this call: `memascend bench kernels`: the
    fused Adam over one call and part by part (2^20 elements, as memascend.torch updates),
    and the copy ceiling, on `threads` threads (the update's: torch's default, as the
    ceiling worker reported it); what memascend's update_kernels time per step is read
    against (path_figures). Said why not where no CLI is at hand or it fails."""
    cli = find_cli(given)
    if cli is None:
        return {"cpu_kernels_error": "no memascend CLI found (--cli)"}
    cmd = [cli, "bench", "kernels", "--elements", elements, "--reps", "3", "--json"] + (
        ["--threads", str(threads)] if threads else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        r = json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return {"cpu_kernels_error": f"{' '.join(cmd)}: {e}"}
    if r is None:
        return {"cpu_kernels_error": f"{' '.join(cmd)}: rc {out.returncode}: "
                                     f"{(out.stderr or out.stdout)[-300:]}"}
    return {"cpu_threads": r.get("threads"), "cpu_simd": r.get("simd"),
            "cpu_copy_gbps": r.get("copy_ceiling_gbps"), "cpu_adam_gbps": r.get("adam_fused_gbps"),
            "cpu_adam_parts_gbps": r.get("adam_parts_gbps"),
            "cpu_adam_part_elements": r.get("adam_part_elements"),
            "cpu_adam_bytes_per_element": r.get("adam_fused_bytes_per_element"),
            "cpu_kernels_command": " ".join(cmd)}


def write(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


STEP_LINE = re.compile(r"^\[[\w-]+\] step (\d+): loss (\S+), ([0-9.]+) s(?:, VmHWM (\d+))?$")


def partial(out):
    """What a worker that left no record printed of its steps (systems.train's lines): the
    steps it finished, their losses and seconds, and its VmHWM at the last (a peak so far,
    not the run's). Nothing when it finished none."""
    steps = [m.groups() for m in map(STEP_LINE.match, (out or "").splitlines()) if m]
    if not steps:
        return {}
    hwm = [int(h) for *_, h in steps if h]
    return {"partial": {"steps_done": len(steps), "losses": [float(x) for _, x, _, _ in steps],
                        "step_seconds": [float(t) for _, _, t, _ in steps],
                        "peak_rss_bytes_so_far": hwm[-1] if hwm else None,
                        "why": "read from the step lines of a run that left no record"}}


def compare_losses(records):
    """Picks the reference and marks each row void or not. Returns (reference name, why)."""
    ran = {r["system"]: r for r in records if r.get("losses") and not r.get("error")}
    if "torch-gpu" in ran:
        ref, why = ran["torch-gpu"], "torch-gpu: everything on the device"
    elif "fsdp2-offload" in ran:
        ref, why = ran["fsdp2-offload"], ("fsdp2-offload: torch-gpu did not run or fit; its "
                                          "update is the same AdamW over fp32 master weights")
    else:
        ref, why = None, "none: neither torch-gpu nor fsdp2-offload ran"
    for r in records:
        r["reference"] = ref["system"] if ref else None
        if not r.get("losses") or r.get("error"):
            r["void"], r["void_reason"] = None, "did not train"
            continue
        if ref is None:
            r["void"], r["void_reason"] = None, why
            continue
        if len(r["losses"]) != len(ref["losses"]):
            r["void"], r["void_reason"] = True, "a different number of steps than the reference"
            continue
        diff = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], ref["losses"]))
        r["loss_rel_diff_max"] = diff
        r["void"] = diff > VOID_REL
        r["void_reason"] = (f"a loss differs from {ref['system']}'s by {diff:.3g} relatively "
                            f"(over {VOID_REL:g})") if r["void"] else None
    return (ref["system"] if ref else None), why


def path_figures(records, ceiling):
    """The GPU path's figures (the GPU training path's issue) for each memascend row:
    its parameter loads' rate over the pinned ceiling of this call (h2d_ratio), and its
    step (as tokens/s takes it: step_basis) over torch-gpu's median forward+backward in
    this call, the first step left out (step_over_forward_backward)."""
    ref = next((r for r in records if r.get("system") == "torch-gpu"
                and r.get("forward_backward_seconds") and not r.get("error")), None)
    ref_fb = statistics.median(ref["forward_backward_seconds"][1:] or
                               ref["forward_backward_seconds"]) if ref else None
    for r in records:
        if r.get("system") != "memascend" or not r.get("step_seconds"):
            continue
        dev = (r.get("memascend_stats") or {}).get("device_parameters") or {}
        if dev.get("copy_seconds"):
            rate = dev["bytes_to_device"] / dev["copy_seconds"] / (1 << 30)
            r["param_h2d_gib_per_s"] = rate
            if (ceiling or {}).get("h2d_gib_per_s"):
                r["h2d_ratio"] = rate / ceiling["h2d_gib_per_s"]
        update_figures(r, ceiling or {})
        if ref_fb and r.get("tokens_per_s"):  # the step of tokens/s (step_basis says which)
            r["step_over_forward_backward"] = r["tokens_per_step"] / r["tokens_per_s"] / ref_fb
            r["forward_backward_reference_seconds"] = ref_fb


def update_figures(r, ceiling):
    """The CPU update's rate in a memascend row: the bytes the fused Adam moves per step
    (the kernel bench's count per element, times the parameters) over the median of the
    steps' update_kernels seconds (the first step left out), and that over the same call's
    per-part kernel rate (`update_over_cpu_adam_parts`: 1.0 is the update at the kernel's
    ceiling; below, time lost between parts or threads left idle). On a GPU the update
    writes its parameters to the store only; on the CPU update_kernels also holds their
    copy out to the model (4 bytes more a parameter, not counted)."""
    kernels = [p.get("update_kernels") for p in (r.get("step_phases") or [])[1:]]
    kernels = [k for k in kernels if k]
    per_element = ceiling.get("cpu_adam_bytes_per_element") or 28
    if not kernels or not r.get("parameters"):
        return
    r["update_kernels_seconds"] = statistics.median(kernels)
    r["update_gbps"] = per_element * r["parameters"] / r["update_kernels_seconds"] / 1e9
    if ceiling.get("cpu_adam_parts_gbps"):
        r["update_over_cpu_adam_parts"] = r["update_gbps"] / ceiling["cpu_adam_parts_gbps"]


def table(records):
    keys = ["system", "budget", "commit_every", "staging", "io_threads", "ds_aio_point", "fits", "skipped", "reason", "error",
            "peak_rss_bytes", "cgroup_peak_bytes", "torch_pinned_peak_bytes",
            "memascend_pinned_peak_bytes", "gpu_peak_bytes", "tokens_per_s", "mfu",
            "io_bytes_per_step", "loss_rel_diff_max", "void", "void_reason", "h2d_ratio",
            "step_over_forward_backward"]
    return [{k: r.get(k) for k in keys} for r in records]


def point(r, tokens_per_step):
    """(peak host RSS, tokens/s, partial?) of a record, or None: a finished run's figures,
    else those of the steps a killed run printed (the median after its first step)."""
    if r.get("tokens_per_s") and r.get("peak_rss_bytes"):
        return r["peak_rss_bytes"], r["tokens_per_s"], False
    part = r.get("partial") or {}
    times = part.get("step_seconds") or []
    if len(times) >= 2 and tokens_per_step:
        return (part.get("peak_rss_bytes_so_far"),
                tokens_per_step / statistics.median(times[1:]), True)
    return None


def row_label(r):
    b = r.get("budget")
    if isinstance(b, dict):
        b = b.get("percent_of_state")
    every = r.get("commit_every") or 1
    return r["system"] + (f" {b:g}%" if b is not None else "") + \
        (f" every {every}" if every > 1 else "") + \
        (" staged" if r.get("staging") == "step" else "") + \
        (f" io {r['io_threads']}" if r.get("io_threads") else "") + \
        (f" {r['ds_aio_point']}" if r.get("ds_aio_point") else "")


def plot(records, tokens_per_step, path, title):
    """tokens/s against peak host RSS, one mark per run (hand-written SVG); a run known
    only from the steps it printed before it was killed is hollow."""
    pts = [(row_label(r), *p) for r in records
           if (p := point(r, tokens_per_step)) and p[0] is not None]
    if not pts:
        return False
    w, h, pad = 560, 340, 60
    x1 = max(x for _, x, _, _ in pts) / 2**30 * 1.15
    y1 = max(y for _, _, y, _ in pts) * 1.15
    sx = lambda x: pad + x / x1 * (w - 2 * pad)  # noqa: E731
    sy = lambda y: h - pad - y / y1 * (h - 2 * pad)  # noqa: E731
    colors = {"torch-gpu": "#7f7f7f", "fsdp2-offload": "#2ca02c",
              "deepspeed-zero-infinity": "#d62728", "memascend": "#1f77b4"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           'font-family="sans-serif" font-size="10">',
           f'<text x="{w / 2}" y="16" text-anchor="middle">{title}</text>',
           f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(x1)}" y2="{sy(0)}" stroke="black"/>',
           f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(0)}" y2="{sy(y1)}" stroke="black"/>',
           f'<text x="{w / 2}" y="{h - 14}" text-anchor="middle">peak host RSS (GiB)</text>',
           f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" '
           'text-anchor="middle">tokens/s</text>']
    for k in range(5):
        out.append(f'<text x="{sx(x1 * k / 4)}" y="{sy(0) + 12}" text-anchor="middle">'
                   f'{x1 * k / 4:.1f}</text>')
        out.append(f'<text x="{sx(0) - 4}" y="{sy(y1 * k / 4) + 3}" text-anchor="end">'
                   f'{y1 * k / 4:,.0f}</text>')
    for label_, x, y, partial_ in pts:
        c = colors.get(label_.split()[0], "black")
        fill = "none" if partial_ else c
        out.append(f'<circle cx="{sx(x / 2**30):.1f}" cy="{sy(y):.1f}" r="4" fill="{fill}" '
                   f'stroke="{c}"><title>{label_}</title></circle>')
        out.append(f'<text x="{sx(x / 2**30) + 6:.1f}" y="{sy(y) - 6:.1f}">{label_}'
                   f'{" (partial)" if partial_ else ""}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return True


def markdown(records, tokens_per_step):
    """The table docs/benchmarks.md shows: one line per run."""
    lines = ["| run | tokens/s | peak host RSS | pinned (torch; memascend) | GPU peak | "
             "disk written per step | loss vs reference |", "|---|---|---|---|---|---|---|"]
    gb = lambda b: "-" if b is None else f"{b / 1e9:.2f} GB"  # noqa: E731
    for r in records:
        p = point(r, tokens_per_step)
        io = (r.get("io_bytes_per_step") or {}).get("write")
        diff = r.get("loss_rel_diff_max")
        lines.append(
            f"| {row_label(r)} | {f'{p[1]:,.0f}' if p else '-'}{' (partial)' if p and p[2] else ''}"
            f" | {gb(p[0]) if p else '-'} | {gb(r.get('torch_pinned_peak_bytes'))}; "
            f"{gb(r.get('memascend_pinned_peak_bytes'))} | {gb(r.get('gpu_peak_bytes'))} | "
            f"{gb(io) if io is not None else '-'} | "
            f"{f'{diff:.1e}' if diff is not None else (r.get('error') or r.get('void_reason') or '-')} |")
    return "\n".join(lines)


def summarize(paths, out):
    """--summarize: the records of one or more calls (their --out directories, or a file of
    calls as docs/benchmarks-data/gpu/ keeps them) in one table and one plot."""
    records = []
    for path in paths:
        if os.path.isdir(path):
            records += [json.load(open(f)) for f in sorted(glob.glob(
                os.path.join(path, "compare-[0-9]*.json")))]
        else:
            for call in json.load(open(path)).get("calls", []):
                records += call["records"]
    records = [r for r in records if r.get("system") != "ceiling"]
    for r in records:  # a killed run recorded before the worker's lines were kept
        if "partial" not in r and r.get("log_tail") and not r.get("losses"):
            r.update(partial(r["log_tail"]))
    tokens = next((r["tokens_per_step"] for r in records if r.get("tokens_per_step")), None)
    models = sorted({r.get("model") for r in records if r.get("model")})
    os.makedirs(out, exist_ok=True)
    plot(records, tokens, os.path.join(out, "compare.svg"),
         f"{', '.join(models)}: tokens/s against peak host memory")
    text = markdown(records, tokens)
    with open(os.path.join(out, "compare-table.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


def compare(a):
    p = Parent(a)
    p.commit = commit()
    runs = plan(a)
    seed = a.seed if a.seed is not None else time.time_ns() % (1 << 31)
    random.Random(seed).shuffle(runs)
    p.order = [label(r) for r in runs]
    p.measure_ceiling()
    print(f"[compare] ceiling {p.ceiling}; order (seed {seed}): {', '.join(p.order)}", flush=True)
    records, not_run = [], []
    for i, run in enumerate(runs):
        if a.time_budget and time.time() - p.started > a.time_budget - 60:
            not_run.append(label(run))
            continue
        records.append(p.launch(run, f"compare-{i:02d}-{label(run)}", i))
    ref, why = compare_losses(records)
    path_figures(records, p.ceiling)
    for r in records:  # the records again, with the comparison
        write(os.path.join(a.out, r["record_file"]), r)
        if (r.get("trace") or {}).get("spans"):
            timeline.svg(r["trace"]["spans"], f"{r['model']}, {row_label(r)}: step "
                         f"{r['trace']['step']}, {r['trace']['seconds']:.3f} s",
                         os.path.join(a.out, "timeline-" + r["record_file"][8:-5] + ".svg"))
    summary = {"kind": "gpu-compare", "date": datetime.datetime.now(datetime.timezone.utc)
               .isoformat(timespec="seconds"), "command": " ".join([sys.executable] + sys.argv),
               "commit": p.commit, "model": model_name(a), "seq": a.seq, "batch": a.batch,
               "accum": a.accum, "steps": a.steps, "seed": seed, "order": p.order,
               "not_run": not_run, "ceiling": p.ceiling, "reference": ref,
               "reference_why": why, "void_threshold": VOID_REL, "rows": table(records),
               "wall_seconds": round(time.time() - p.started, 1)}
    write(os.path.join(a.out, "compare-summary.json"), summary)
    tokens = a.accum * a.batch * a.seq
    plot(records, tokens, os.path.join(a.out, "compare.svg"),
         f"{model_name(a)}: tokens/s against peak host memory")
    print(json.dumps(summary["rows"], indent=1, default=str))
    print(markdown(records, tokens))
    return 0


def main():
    a = parser().parse_args()
    if a.summarize:
        return summarize(a.summarize, a.out)
    a.shapes, a.model_name = shapes_of(a), model_name(a)
    if a.ds_aio_point:
        a.ds_aio_point = aio_point(a.ds_aio_point)
    if a.system:
        rc = systems.worker(a)  # the record is written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # no teardown (NCCL, DeepSpeed's I/O threads) to hang the call on
    os.makedirs(a.out, exist_ok=True)
    if a.fit:
        import fit_under_cap
        return fit_under_cap.fit(a, Parent, plan, label)
    return compare(a)


if __name__ == "__main__":
    sys.exit(main())

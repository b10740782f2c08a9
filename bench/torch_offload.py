#!/usr/bin/env python3
"""memascend.torch against torch.optim.AdamW on this machine's CPU: peak RSS and step time.

    PYTHONPATH=build/test/python /usr/bin/python3 bench/torch_offload.py [--reps 3] [--steps 4]

Trains tests/python/gpt.py's GPT (plain PyTorch, fp32, batch 2, seq 128) at two sizes,
30m (vocab 16384, d 512, 6 layers: 27.4 M parameters) and 100m (vocab 32768, d 768,
10 layers: 96.1 M), in three configurations:

  adamw        torch.optim.AdamW, everything in memory (the baseline)
  offloaded    OffloadedAdamW: master weights and moments in its store, on a volume file
  +parameters  ... and offload_parameters(): parameters in use are views of store blocks

Each run is a fresh process, `--reps` per configuration and size, all of them in random
order; glibc's allocator as it is by default (no MALLOC_ variables). OffloadedAdamW's
host budget is the machine's choice (--host-budget to fix one), the same for both of its
configurations. Reported per size: peak RSS (the child's ru_maxrss) and step time (the
median of the steps after the first), median [min, max] over the runs, each as a ratio
to adamw; the parameter bytes; and the target of issue 43: the peak RSS with
offload_parameters at most OffloadedAdamW's alone less 70% of the parameter bytes
(medians; also the worst pair: the highest +parameters run against the lowest offloaded).
--check makes a missed target the exit status. The volumes go in --dir (default: a
temporary directory on the disk of the current directory).
"""
import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

SIZES = {
    "30m": dict(vocab=16384, d=512, layers=6, heads=8, seq=128),
    "100m": dict(vocab=32768, d=768, layers=10, heads=12, seq=128),
    "tiny": dict(vocab=256, d=64, layers=2, heads=4, seq=32),  # the smoke test's
}
BATCH = 2
CONFIGS = ["adamw", "offloaded", "+parameters"]
TARGET = 0.7  # of the parameter bytes, off OffloadedAdamW's peak RSS


def child(size, config, steps, directory, host_budget):
    import torch
    import gpt
    import memascend.torch as mt

    model = gpt.make(seed=0, **SIZES[size])
    seq, vocab = SIZES[size]["seq"], SIZES[size]["vocab"]
    info = {}
    if config == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    else:
        opt = mt.OffloadedAdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                volume=os.path.join(directory, "opt.vol"), host_budget=host_budget)
        info["host_budget"] = opt.host_budget
        offload = mt.offload_parameters(model, opt) if config == "+parameters" else None
    times, losses = [], []
    for step in range(steps):
        x, y = gpt.batch(step, vocab=vocab, seq=seq, batch_size=BATCH)
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if config != "adamw":
        opt.settle()
        if offload is not None:
            info["fetches"] = offload.fetches
            info["heap_fetches"] = getattr(offload, "heap_fetches", None)  # an older build: none
    print(json.dumps({"size": size, "config": config, "times": times, "losses": losses,
                      "params": sum(p.numel() for p in opt.param_groups[0]["params"]),
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      **info}))


def spread(values, fmt):
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}, " \
           f"{format(max(values), fmt)}]"


def commit():
    def git(*args):
        return subprocess.run(["git", "-C", HERE, *args], capture_output=True,
                              text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" (with uncommitted changes)" if git("status", "--porcelain") else "")


def report(size, results):
    MiB = 1 << 20
    params = results["adamw"][0]["params"]
    pbytes = 4 * params
    print(f"\n{size}: {params / 1e6:.1f} M parameters, {pbytes / MiB:.0f} MiB (fp32); "
          f"{len(results['adamw'])} runs per configuration")
    base_m = statistics.median(r["peak_rss"] for r in results["adamw"])
    base_t = statistics.median(statistics.median(r["times"][1:] or r["times"])
                               for r in results["adamw"])
    print(f"  {'configuration':<14}{'peak RSS MiB':>26}{'x adamw':>9}{'step s':>26}{'x adamw':>9}")
    for c in CONFIGS:
        ms = [r["peak_rss"] / MiB for r in results[c]]
        ts = [statistics.median(r["times"][1:] or r["times"]) for r in results[c]]
        print(f"  {c:<14}{spread(ms, '.0f'):>26}{statistics.median(ms) * MiB / base_m:>9.2f}"
              f"{spread(ts, '.2f'):>26}{statistics.median(ts) / base_t:>9.2f}")
    for r in results["+parameters"][:1]:
        print(f"  host budget {r.get('host_budget', 0) / MiB:.0f} MiB; fetches per run "
              f"{r.get('fetches')}, of them into tensors of their own {r.get('heap_fetches')}")
    off = [r["peak_rss"] for r in results["offloaded"]]
    par = [r["peak_rss"] for r in results["+parameters"]]
    saved = statistics.median(off) - statistics.median(par)
    worst = min(off) - max(par)
    ok = saved >= TARGET * pbytes
    print(f"  target: +parameters <= offloaded - {TARGET:.0%} of the parameter bytes "
          f"({TARGET * pbytes / MiB:.0f} MiB): saved {saved / MiB:.0f} MiB "
          f"({saved / pbytes:.0%} of them; worst pair {worst / MiB:.0f} MiB, "
          f"{worst / pbytes:.0%}): {'met' if ok else 'MISSED'}")
    same = all(r["losses"] == results["offloaded"][0]["losses"]
               for c in ("offloaded", "+parameters") for r in results[c])
    print(f"  losses: every OffloadedAdamW run, with or without offload_parameters, the same: "
          f"{same}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="30m,100m", help="of " + ", ".join(SIZES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--host-budget", type=int, default=None, help="bytes (default: chosen)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--child", nargs=2, metavar=("SIZE", "CONFIG"))
    a = ap.parse_args()
    if a.child:
        child(*a.child, a.steps, a.dir, a.host_budget)
        return 0
    sizes = a.sizes.split(",")
    for s in sizes:
        if s not in SIZES:
            ap.error(f"unknown size {s!r}")
    runs = [(s, c) for s in sizes for c in CONFIGS for _ in range(a.reps)]
    random.Random(a.seed).shuffle(runs)
    results = {s: {c: [] for c in CONFIGS} for s in sizes}
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    for n, (size, config) in enumerate(runs):
        cmd = [sys.executable, __file__, "--child", size, config, "--steps", str(a.steps)]
        if a.host_budget is not None:
            cmd += ["--host-budget", str(a.host_budget)]
        with tempfile.TemporaryDirectory(dir=a.dir or os.getcwd()) as d:
            p = subprocess.run(cmd + ["--dir", d], env=env, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{size} {config} failed ({p.returncode}):\n{p.stderr}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        results[size][config].append(r)
        print(f"[{n + 1}/{len(runs)}] {size} {config}: peak RSS {r['peak_rss'] >> 20} MiB, "
              f"step {statistics.median(r['times'][1:] or r['times']):.2f} s", file=sys.stderr)
    print(f"commit {commit()}; {os.cpu_count()} CPUs; batch {BATCH}; {a.steps} steps a run; "
          f"runs in random order (seed {a.seed}); glibc's default allocator")
    print("command: PYTHONPATH=" + os.environ.get("PYTHONPATH", "") + " " +
          " ".join([sys.executable] + sys.argv))
    met = [report(s, results[s]) for s in sizes]
    return 1 if a.check and not all(met) else 0


if __name__ == "__main__":
    sys.exit(main())

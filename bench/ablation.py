#!/usr/bin/env python3
"""bench/ablation.py: memascend with one component at a time replaced by ZeRO-Infinity's
(issue 25), memory and time, side by side in one run.

Variants, each against the unchanged SDK at the same budget:
  - pool pow2:       the store's pinned pool rounds every block to a power of two, as
                     PyTorch's caching host allocator does (--pool pow2);
  - check unfused:   each gradient part checked for inf/NaN PyTorch's way, a
                     byte-per-element temporary per pass (--overflow-check temporaries);
  - overlap off:     the optimizer's update runs after the backward pass, not under the
                     next forward pass (--overlap-optimizer 0);
  - files:           the extent volume replaced by a directory with a file per tensor,
                     ZeRO-Infinity's layout: each transfer opens its file with O_DIRECT,
                     scratch tensors written in place, durable ones through a renamed file
                     (--storage files; FileObjectStore in memascend/object_store.h). Both
                     checksum the data, so the layout is all that differs.
The volume file and the directory are on the same file system (--work).

Operating point, fixed before any run: the 56 M Llama shape at --seq 256, batch 1, bf16,
5 steps (the step time: the median of steps 2 to 4, frontier.steady_step), memascend's budget 25% of the training
state. Per repeat a Williams-design row (each variant follows each other equally often),
at least --repeats rows; medians with bootstrap 95% intervals, ratios to the unchanged SDK.

One JSON object per run in OUT/ablation.jsonl; the table on stdout.

  /usr/bin/python3 bench/ablation.py --train build/release/examples/offload_train/memascend-train

About 10 minutes on 2 cores.
"""
import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from frontier import ROOT, LADDER, bootstrap, steady_step, tokens_file, williams  # noqa: E402

VARIANTS = {
    "memascend (unchanged)": [],
    "pool pow2": ["--pool", "pow2"],
    "check unfused": ["--overflow-check", "temporaries"],
    "overlap off": ["--overlap-optimizer", "0"],
    "files": ["--storage", "files"],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", default=os.path.join(ROOT, "build/release/examples/offload_train/memascend-train"))
    ap.add_argument("--work", default="/tmp/memascend-ablation")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/benchmarks-data"))
    ap.add_argument("--model", default="llama-56m", choices=list(LADDER))
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5, help="at least this many rows")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    rng = random.Random(a.seed)
    tokens = tokens_file(a.work)
    vol = os.path.join(a.work, "run.vol")
    files = os.path.join(a.work, "run.files")  # --storage files: a directory
    names = list(VARIANTS)
    rows = []
    while len(rows) < a.repeats:
        rows += williams(len(names), rng)
    out = open(os.path.join(a.out, "ablation.jsonl"), "w")
    results = {n: [] for n in names}
    for rep, order in enumerate(rows, 1):
        for i in order:
            name = names[i]
            cmd = [a.train, "--config", os.path.join(ROOT, LADDER[a.model]), "--tokens", tokens,
                   "--seq", "256", "--batch", "1", "--steps", str(a.steps), "--dtype", "bf16",
                   "--json", "--quiet", "--sample", "0", "--force",
                   "--volume", files if "--storage" in VARIANTS[name] else vol,
                   "--matmul", "blas", "--policy", "memascend", "--host-budget", a.budget,
                   *VARIANTS[name]]
            if os.path.exists(vol):
                os.remove(vol)
            shutil.rmtree(files, ignore_errors=True)
            p = subprocess.run(cmd, capture_output=True, text=True)
            row = {"variant": name, "model": a.model, "repeat": rep, "fits": p.returncode == 0,
                   "command": cmd}
            try:
                s = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("{")))
                row.update(peak_rss_bytes=s["peak_rss_bytes"], peak_pinned_bytes=s["peak_pinned_bytes"],
                           step_seconds=steady_step(s["step_seconds"]),
                           steps_seconds=s["step_seconds"], losses=s["losses"])
                results[name].append(row)
            except StopIteration:
                row["error"] = p.stderr.strip().splitlines()[-1:]
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"  {rep} {name}: rss={row.get('peak_rss_bytes', 0) / 2**20:.0f} MiB "
                  f"step={row.get('step_seconds', 0):.3f} s", file=sys.stderr, flush=True)
    base = results[names[0]]
    base_t = statistics.median(r["step_seconds"] for r in base)
    base_m = statistics.median(r["peak_rss_bytes"] for r in base)
    losses = {tuple(r["losses"]) for rs in results.values() for r in rs}
    print(f"{a.model}, budget {a.budget}, {len(rows)} rows; {len(losses)} distinct loss sequence(s)")
    print("| variant | step s (95% CI) | x unchanged | peak RSS MiB (95% CI) | x unchanged | peak pinned MiB |")
    print("|---|---|---|---|---|---|")
    for name in names:
        rs = results[name]
        if not rs:
            print(f"| {name} | did not run | | | | |")
            continue
        t = bootstrap([r["step_seconds"] for r in rs], rng)
        m = bootstrap([r["peak_rss_bytes"] for r in rs], rng)
        pin = statistics.median(r["peak_pinned_bytes"] for r in rs)
        print(f"| {name} | {t['median']:.3f} ({t['lo']:.3f}-{t['hi']:.3f}) | {t['median'] / base_t:.2f} | "
              f"{m['median'] / 2**20:.0f} ({m['lo'] / 2**20:.0f}-{m['hi'] / 2**20:.0f}) | "
              f"{m['median'] / base_m:.2f} | {pin / 2**20:.0f} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""memascend.torch against torch.optim.AdamW on this machine's CPU: step time and peak RSS.

    PYTHONPATH=build/release/python /usr/bin/python3 bench/torch_offload.py [--reps 3] [--steps 5]

Trains tests/python/gpt.py's GPT at a fixed operating point (41 M parameters: vocab 16384,
d 768, 4 layers, batch 2, seq 64, fp32; OffloadedAdamW with host_budget 64 MiB and parts
of 2^20 elements; activations kept once they are 64 KiB) in four configurations, each in
a fresh process, the runs in random order, `--reps` times each:

  adamw        torch.optim.AdamW, everything in memory (the baseline)
  offloaded    OffloadedAdamW: master weights and moments on a volume file
  +parameters  ... and offload_parameters(): parameters loaded per module
  +activations ... and offload_activations(): saved tensors in a TensorStore (64 MiB)

Step time is the median of the steps after the first (which pays for warm-up); RSS is
the process's peak. Reported: median [min, max] over the repetitions, and each
configuration's ratio to adamw. The volumes go in --dir (default: a temporary directory
on the disk of the current directory).
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

MODEL = dict(vocab=16384, d=768, layers=4, heads=12, seq=64)
BATCH = 2
HOST_BUDGET = 64 << 20
PART = 1 << 20
CONFIGS = ["adamw", "offloaded", "+parameters", "+activations"]


def child(config, steps, directory):
    import torch
    import gpt
    import memascend
    import memascend.torch as mt

    torch.set_num_threads(os.cpu_count())
    model = gpt.make(seed=0, **MODEL)
    acts = None
    if config == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    else:
        opt = mt.OffloadedAdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                volume=os.path.join(directory, "opt.vol"),
                                host_budget=HOST_BUDGET, part_elements=PART)
        if config in ("+parameters", "+activations"):
            mt.offload_parameters(model, opt)
        if config == "+activations":
            vol = memascend.Volume.open_or_create(os.path.join(directory, "act.vol"), 1 << 30)
            store = memascend.TensorStore(vol, host_budget=HOST_BUDGET)
            acts = mt.offload_activations(store)
    times, losses = [], []
    for step in range(steps):
        x, y = gpt.batch(step, vocab=MODEL["vocab"], seq=MODEL["seq"], batch_size=BATCH)
        t0 = time.perf_counter()
        if acts is not None:
            with acts:
                loss = model(x, y)
        else:
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if config != "adamw":
        opt.settle()
    print(json.dumps({"config": config, "times": times, "losses": losses,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--child", choices=CONFIGS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.steps, a.dir)
        return
    runs = [c for c in CONFIGS for _ in range(a.reps)]
    random.Random(a.seed).shuffle(runs)
    results = {c: [] for c in CONFIGS}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")  # the same for every run
    for i, config in enumerate(runs):
        with tempfile.TemporaryDirectory(dir=a.dir or os.getcwd()) as d:
            out = subprocess.run([sys.executable, __file__, "--child", config, "--steps",
                                  str(a.steps), "--dir", d], env=env, check=True,
                                 capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        results[config].append(r)
        print(f"[{i + 1}/{len(runs)}] {config}: step {statistics.median(r['times'][1:]):.2f} s, "
              f"peak RSS {r['peak_rss'] >> 20} MiB", file=sys.stderr)
    params = 0
    import gpt
    params = sum(p.numel() for p in gpt.make(seed=0, **MODEL).parameters())
    print(f"model: {params / 1e6:.1f} M parameters (fp32), batch {BATCH}, seq {MODEL['seq']}; "
          f"{a.reps} runs of {a.steps} steps per configuration, in random order")
    base_t = statistics.median(statistics.median(r["times"][1:]) for r in results["adamw"])
    base_m = statistics.median(r["peak_rss"] for r in results["adamw"])
    print(f"{'configuration':<14}{'step s (median [min, max])':<30}{'x adamw':>8}"
          f"{'peak RSS MiB (median [min, max])':>36}{'x adamw':>9}")
    for c in CONFIGS:
        ts = [statistics.median(r["times"][1:]) for r in results[c]]
        ms = [r["peak_rss"] / (1 << 20) for r in results[c]]
        t, m = statistics.median(ts), statistics.median(ms)
        print(f"{c:<14}{f'{t:.2f} [{min(ts):.2f}, {max(ts):.2f}]':<30}{t / base_t:>8.2f}"
              f"{f'{m:.0f} [{min(ms):.0f}, {max(ms):.0f}]':>36}{m * (1 << 20) / base_m:>9.2f}")
    same = all(r["losses"] == results["adamw"][0]["losses"] for r in results["adamw"])
    worst = max(abs(x - y) for c in CONFIGS[1:] for r in results[c]
                for x, y in zip(r["losses"], results["adamw"][0]["losses"]))
    print(f"losses: adamw runs identical: {same}; largest difference of any offloaded run "
          f"from adamw: {worst:.2e}")


if __name__ == "__main__":
    main()

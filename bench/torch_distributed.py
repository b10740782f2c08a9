#!/usr/bin/env python3
"""OffloadedAdamW under torch.distributed (gloo, CPU) at 1, 2 and 4 ranks on this machine:
per-rank peak RSS, step time and bytes put into collectives per step.

    PYTHONPATH=build/test/python /usr/bin/python3 bench/torch_distributed.py [--reps 2] [--steps 5]

The operating point is fixed: tests/python/gpt.py's GPT at 16.8 M parameters (vocab 8192,
d 512, 4 layers, seq 64, fp32), a global batch of 4 rows split among the ranks, host
budget 32 MiB per rank, each rank's volume a file of its own. Every configuration runs
`--reps` times, the runs in random order; step time is the median of the steps after the
first. This machine has 2 cores: 4 ranks (and 2, with their kernel threads) oversubscribe
it, so step times measure contention as much as the method; RSS and bytes do not.
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

MODEL = dict(vocab=8192, d=512, layers=4, heads=8, seq=64)
GLOBAL_BATCH = 4


def child(rank, world, init, directory, steps):
    import torch
    import torch.distributed as dist
    import gpt
    import memascend.torch as mt

    torch.set_num_threads(max(1, os.cpu_count() // world))
    if world > 1:
        dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    model = gpt.make(seed=0, **MODEL)
    opt = mt.OffloadedAdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                            volume=os.path.join(directory, "r{rank}.vol"), host_budget=32 << 20,
                            part_elements=1 << 20)
    rows = GLOBAL_BATCH // world
    times, losses = [], []
    for step in range(steps):
        x, y = gpt.batch(step, vocab=MODEL["vocab"], seq=MODEL["seq"], batch_size=GLOBAL_BATCH)
        t0 = time.perf_counter()
        loss = model(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    opt.settle()
    owned = sum(e - b for k, b, e in opt._shards if k is not None)
    print(json.dumps({"rank": rank, "times": times, "comm_bytes": opt.comm_bytes / steps,
                      "owned": owned, "losses": losses,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    opt.close()
    if world > 1:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--child", nargs=4, metavar=("RANK", "WORLD", "INIT", "DIR"))
    a = ap.parse_args()
    if a.child:
        child(int(a.child[0]), int(a.child[1]), a.child[2], a.child[3], a.steps)
        return
    worlds = [int(w) for w in a.worlds.split(",")]
    runs = [w for w in worlds for _ in range(a.reps)]
    random.Random(a.seed).shuffle(runs)
    results = {w: [] for w in worlds}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    for i, world in enumerate(runs):
        with tempfile.TemporaryDirectory(dir=os.getcwd()) as d:
            procs = [subprocess.Popen([sys.executable, __file__, "--steps", str(a.steps),
                                       "--child", str(r), str(world), os.path.join(d, "init"), d],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env) for r in range(world)]
            outs = [p.communicate() for p in procs]
            for p, (out, err) in zip(procs, outs):
                if p.returncode != 0:
                    sys.exit(f"a rank failed:\n{err}")
        ranks = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
        results[world].append(ranks)
        print(f"[{i + 1}/{len(runs)}] {world} rank(s): step "
              f"{statistics.median(ranks[0]['times'][1:]):.2f} s", file=sys.stderr)
    import gpt
    params = sum(p.numel() for p in gpt.make(seed=0, **MODEL).parameters())
    print(f"model: {params / 1e6:.1f} M parameters (fp32), global batch {GLOBAL_BATCH}, "
          f"seq {MODEL['seq']}; {a.reps} runs of {a.steps} steps per configuration, random "
          f"order; {os.cpu_count()} cores")
    print(f"{'ranks':>5} {'step s median [min, max]':>26} {'peak RSS MiB/rank [min, max]':>30} "
          f"{'state elems/rank':>17} {'MiB to collectives/step/rank':>29}")
    for w in worlds:
        steps = [statistics.median(r["times"][1:]) for run in results[w] for r in run[:1]]
        rss = [r["peak_rss"] / (1 << 20) for run in results[w] for r in run]
        comm = [r["comm_bytes"] / (1 << 20) for run in results[w] for r in run]
        owned = [r["owned"] for run in results[w] for r in run]
        print(f"{w:>5} {f'{statistics.median(steps):.2f} [{min(steps):.2f}, {max(steps):.2f}]':>26}"
              f" {f'{statistics.median(rss):.0f} [{min(rss):.0f}, {max(rss):.0f}]':>30}"
              f" {max(owned):>17,} {statistics.median(comm):>29.1f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""OffloadedAdamW's step on the CPU, by phase: N bf16 parameters of 4M elements each, their
gradients made beforehand, the whole state in the host budget and no step made durable
within the run (commit_every above --steps), so what is timed is the intake of the
gradients and the update (opt.stats()["seconds"], Note [step times]), not the disk.

    PYTHONPATH=build/test/python python3 bench/update_step.py [--params 32] [--threads 2]
"""
import argparse
import os
import tempfile
import time

import torch

from memascend.torch import OffloadedAdamW


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=32, help="parameters of 4M elements")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=5)
    # Room for the whole state (page-locked: RLIMIT_MEMLOCK must allow it, or the
    # optimizer says so), so nothing is evicted and the disk stays out of the figures.
    ap.add_argument("--host-budget", type=int, default=None, help="bytes (default: 40 a "
                    "parameter)")
    a = ap.parse_args()
    elements = 4 << 20
    params = [torch.nn.Parameter(torch.randn(elements, dtype=torch.bfloat16))
              for _ in range(a.params)]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    with tempfile.TemporaryDirectory() as d:
        opt = OffloadedAdamW(params, lr=1e-3, volume=os.path.join(d, "update.vol"),
                             host_budget=a.host_budget or a.params * elements * 40,
                             commit_every=a.steps + 1,
                             threads=a.threads)
        opt.settle()  # the initial state's commit, written in the background, out of the way
        last = opt.stats()["seconds"]
        for step in range(a.steps):
            for p, g in zip(params, grads):
                p.grad = g
            t0 = time.perf_counter()
            opt.step()
            seconds = time.perf_counter() - t0
            now = opt.stats()["seconds"]
            phase = {k: now[k] - last[k] for k in now}
            last = now
            # Adam's 28 bytes a parameter and the new bf16 parameters copied out (4 more)
            rate = a.params * elements * 32 / phase["update_kernels"] / 1e9
            print(f"step {step}: {seconds:.3f} s; gradients {phase['gradients']:.3f} s, update "
                  f"{phase['update']:.3f} s (kernels {phase['update_kernels']:.3f} s, "
                  f"{rate:.1f} GB/s at 32 B a parameter)", flush=True)
        opt.close()


if __name__ == "__main__":
    main()

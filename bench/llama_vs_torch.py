#!/usr/bin/env python3
"""memascend-train's Llama compute against PyTorch's on this machine: tokens per second of
one forward and backward pass, fp32, the same model and threads.

The model: Llama-3.2-1B's shapes (bench/configs/llama-3.2-1b.json) with --layers of its 16
layers (default 4, so that PyTorch's fp32 model and gradients fit in memory beside
ours), --seq 256, --batch 1. Our side: memascend-train --mode reference (the state in
ordinary memory, no offload: compute alone), --matmul blas and --matmul exact, its
forward + backward phase seconds per step. PyTorch's side (Debian's python3-torch, whose
matrix products go through OpenBLAS when libopenblas0-pthread provides libblas.so.3): the
reference implementation of tests/python/test_llama_reference.py (Hugging Face's
definitions written as tensor operations), fp32, forward and backward, timed per pass.

Each repeat runs them in a fresh random order (the exact loops, slow at this size, in the
first repeat only); the report gives medians, the spread (min-max) and the ratios of
medians. PyTorch's settings to try for its best: --torch-zero-grads, and the environment
variables OMP_WAIT_POLICY=PASSIVE and OPENBLAS_NUM_THREADS=1. Run with Debian's
interpreter:

  /usr/bin/python3 bench/llama_vs_torch.py --train build/release/examples/offload_train/memascend-train
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
import test_llama_reference as ref  # noqa: E402


def torch_pass_seconds(cfg, seq, batch, threads, passes, zero_grads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    params = {k: (v * 0.25).requires_grad_() for k, v in ref.make(cfg, seed=1).items()}
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq + 1), generator=g)
    out = []
    for _ in range(passes + 1):  # the first pass warms up
        for p in params.values():  # PyTorch 1.13's zero_grad() zeroes in place; 2.x drops
            if zero_grads and p.grad is not None:
                p.grad.zero_()
            else:
                p.grad = None
        t = time.perf_counter()
        ref.forward(cfg, params, ids).backward()
        out.append(time.perf_counter() - t)
    return out[1:]


def ours_pass_seconds(train, config_path, seq, batch, threads, matmul, steps, work):
    ids = os.path.join(work, "ids.u32")
    if not os.path.exists(ids):
        r = random.Random(2)
        with open(ids, "wb") as f:
            f.write(b"".join(r.randrange(128256).to_bytes(4, "little") for _ in range(20000)))
    cmd = [train, "--config", config_path, "--tokens", ids, "--mode", "reference",
           "--matmul", matmul, "--seq", str(seq), "--batch", str(batch), "--steps", str(steps),
           "--threads", str(threads), "--dtype", "bf16", "--json", "--quiet",
           "--volume", os.path.join(work, "unused.vol")]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    s = json.loads(r.stdout)
    ph = s["phase_seconds"]
    return (ph["forward"] + ph["backward"]) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", required=True, help="memascend-train")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="our steps (passes) per repeat")
    ap.add_argument("--torch-zero-grads", action="store_true",
                    help="PyTorch zeroes its gradients in place (default: set to None)")
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(ROOT, "bench", "configs", "llama-3.2-1b.json")))
    cfg["num_hidden_layers"] = a.layers
    cfg["rope_scaling"] = dict(cfg["rope_scaling"])
    tokens = a.seq * a.batch
    results = {"pytorch": [], "memascend-blas": [], "memascend-exact": []}
    with tempfile.TemporaryDirectory() as work:
        config_path = os.path.join(work, "config.json")
        json.dump(cfg, open(config_path, "w"))
        for rep in range(a.repeats):
            # The exact loops are slow at this size: measured in the first repeat only.
            order = [n for n in results if rep == 0 or n != "memascend-exact"]
            random.Random(rep).shuffle(order)
            for name in order:
                if name == "pytorch":
                    t = statistics.median(torch_pass_seconds(cfg, a.seq, a.batch, a.threads, a.steps,
                                                            a.torch_zero_grads))
                else:
                    t = ours_pass_seconds(a.train, config_path, a.seq, a.batch, a.threads,
                                          name.split("-")[1], a.steps, work)
                results[name].append(tokens / t)
                print(f"repeat {rep + 1} {name}: {tokens / t:.1f} tokens/s", file=sys.stderr)
    h, hd, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    params = cfg["vocab_size"] * h + h + a.layers * (2 * h + 2 * q * h + 2 * kv * h + 3 * i * h)
    print(f"Llama-3.2-1B shapes with {a.layers} layers ({params / 1e6:.0f} M parameters), "
          f"seq {a.seq}, batch {a.batch}, {a.threads} threads, fp32 forward + backward; "
          f"torch {torch.__version__}")
    print(f"{'':18} {'tokens/s (median)':>18} {'min-max':>16} {'vs PyTorch':>11}")
    base = statistics.median(results["pytorch"])
    for name, v in results.items():
        m = statistics.median(v)
        print(f"{name:18} {m:18.1f} {min(v):7.1f}-{max(v):<8.1f} {m / base:10.2f}x")
    print(json.dumps({k: v for k, v in results.items()}))


if __name__ == "__main__":
    main()

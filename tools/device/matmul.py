#!/usr/bin/env python3
"""The bf16 matrix-product ceiling of GPU 0, through PyTorch: C = A @ B with A, B of
8192 x 8192 random bf16 values (not zeros, which run faster than real data), three
warm-up products, then 20 timed with CUDA events. Prints one JSON object."""
import json
import statistics

import torch

N = 8192


def measure(n=N, reps=20):
    """The figures as a dict (bench/gpu/compare.py measures its ceiling with it)."""
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b, out=c)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    # Checked against a float32 product of a corner, so a wrong result is not timed.
    ref = a[:256].float() @ b[:, :256].float()
    err = ((c[:256, :256].float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        raise SystemExit(f"bf16 product off by {err} relative")
    flop = 2 * n ** 3
    return {"shape": [n, n, n], "device": torch.cuda.get_device_name(0),
            "median_tflops": flop / statistics.median(times) / 1e12,
            "best_tflops": flop / min(times) / 1e12, "relative_error": err,
            "torch": torch.__version__}


def main():
    print(json.dumps(measure()))


if __name__ == "__main__":
    main()

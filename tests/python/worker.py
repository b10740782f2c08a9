"""Trains the test GPT in a process of its own, for the tests that measure RSS or kill it.

    worker.py adamw|offloaded STEPS [--volume PATH] [--resume] [--model small|rss]
              [--offload-parameters] [--kill-after N] [--no-close]

Prints one line per step: "step N loss L", and at the end "peak_rss_bytes B".
With --kill-after N it SIGKILLs itself right after step N's commit was started; with
--no-close it ends without closing the optimizer (as transformers' Trainer does).
"""
import argparse
import os
import resource
import signal

import torch

import gpt
import memascend.torch as mt

MODELS = {
    "small": dict(vocab=256, d=64, layers=2, heads=4, seq=32),
    # 41 M parameters: AdamW's moments are 330 MB, far above the noise of RSS
    "rss": dict(vocab=16384, d=768, layers=4, heads=12, seq=64),
}


KEPT = []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["adamw", "offloaded"])
    ap.add_argument("steps", type=int)
    ap.add_argument("--volume")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--model", default="small")
    ap.add_argument("--offload-parameters", action="store_true")
    ap.add_argument("--kill-after", type=int, default=0)
    ap.add_argument("--commit-every", type=int, default=1)
    ap.add_argument("--staging", default="bounded")
    ap.add_argument("--no-close", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(2)
    shape = MODELS[a.model]
    model = gpt.make(seed=0, **shape)
    params = list(model.parameters())
    if a.mode == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        start = 0
    else:
        opt = mt.OffloadedAdamW(params, lr=1e-3, weight_decay=0.01, volume=a.volume,
                                host_budget=32 << 20, part_elements=1 << 18, resume=a.resume,
                                commit_every=a.commit_every, staging=a.staging)
        start = opt.resumed_step or 0
        if a.offload_parameters:
            mt.offload_parameters(model, opt)
    for step in range(start, a.steps):
        x, y = gpt.batch(step, vocab=shape["vocab"], seq=shape["seq"], batch_size=2)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step + 1} loss {loss.item():.9g}", flush=True)
        if a.mode == "offloaded" and a.commit_every > 1:
            print(f"durable {opt.stats()['durable_step']}", flush=True)
        if a.kill_after and step + 1 == a.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    if a.mode == "offloaded" and not a.no_close:
        opt.close()
    KEPT.append((model, opt))  # alive to the interpreter's end, as a script's globals are
    print(f"peak_rss_bytes {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}", flush=True)


if __name__ == "__main__":
    main()

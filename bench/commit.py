#!/usr/bin/env python3
"""How fast a commit writes a whole training state held in memory, at several write-back
depths, against the disk's write ceiling measured in the same run.

    python3 bench/commit.py --dir DIR [--params 512M] [--depths 8,16,32] [--reps 2]
                            [--cli build/release/tools/memascend] [--out FILE]

A commit of a state in memory (OffloadedAdamW with the whole state in its host budget and
a commit interval, memascend Note [commit interval]) writes back every part of the state
(master weights, moments, 16-bit parameters: 14 bytes a parameter) and commits them in one
journal commit; on the GPU machines that write is what a commit step waits for (docs/gpu.md,
"The third measurement"). Each run makes the state, then `--commits` times takes two steps
(committed in memory only) and times settle(), which makes them durable: the bytes it wrote
(the optimizer's own counter) over its seconds. The first commit writes extents never
written before (slower on a file system that converts them: ext4's unwritten extents);
the run's rate is its last commit's, the first's is kept beside it. `--depths` are the
store's write_back_depth (state parts written at once, Note [write-back depth] in
tensor_store.h; 8 is the SDK's default), each run in a process of its own, in a random
order, `--reps` times each. The ceiling: `memascend bench io --rw write --block 1M --qd 32`
through io_uring and through threads, on a file in DIR of a commit's size, fresh and
written again (the best is the ceiling), measured first. One JSON record (--out, else
printed), written after the ceiling and after each run (a call cut short keeps what ran):
the device's name (the host's), the commit, the command, every run and each depth's
median rate over the ceiling.
"""
import argparse
import datetime
import glob
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from fit import parse_bytes  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))
from common import commit as measured_commit  # noqa: E402  the commit a record names
CHUNK = 1 << 21  # elements a parameter tensor holds


def child(a):
    """One run: the state, then `a.commits` times two steps in memory and the timed commit
    (settle)."""
    import torch
    import memascend.torch as mt
    params = [torch.nn.Parameter(torch.zeros(CHUNK, dtype=torch.bfloat16))
              for _ in range(max(1, a.params // CHUNK))]
    n = sum(p.numel() for p in params)
    volume = os.path.join(a.dir, f"commit-{os.getpid()}.vol")
    commits = []
    try:
        t0 = time.perf_counter()
        opt = mt.OffloadedAdamW(params, lr=1e-3, volume=volume, host_budget=20 * n + (64 << 20),
                                overwrite=True, commit_every=1000, write_back_depth=a.depth)
        made = time.perf_counter() - t0
        try:
            g = torch.Generator().manual_seed(0)
            grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in params]
            for _ in range(a.commits):
                for _ in range(2):  # the same gradients each step: the commit is what is timed
                    for p, grad in zip(params, grads):
                        p.grad = grad
                    opt.step()
                before = opt.stats()
                t1 = time.perf_counter()
                opt.settle()
                seconds = time.perf_counter() - t1
                written = opt.stats()["io_write_bytes"] - before["io_write_bytes"]
                commits.append({"bytes": written, "seconds": seconds,
                                "gb_per_s": written / seconds / 1e9})
        finally:
            opt.close()
    finally:
        if os.path.exists(volume):
            os.unlink(volume)
    # The volume's first version is written when it is made; the first commit writes
    # extents never written, and from the second a commit may write freed ones again.
    return {"depth": a.depth, "params": n, "commits": commits, "bytes": commits[-1]["bytes"],
            "gb_per_s": commits[-1]["gb_per_s"], "first_gb_per_s": commits[0]["gb_per_s"],
            "setup_seconds": made}


def ceiling(a, size, backend):
    """The raw engine's write rate into a file of `size` bytes in DIR: a fresh file (its
    extents written for the first time, as a commit's new extents are, Note [staged puts])
    and the same file written again; each a record of `memascend bench io`."""
    target = os.path.join(a.dir, "ceiling.bin")
    out = []
    try:
        for again in (False, True):
            cmd = [a.cli, "bench", "io", "--target", target, "--rw", "write", "--block", "1M",
                   "--qd", "32", "--size", str(size), "--backend", backend, "--json"]
            if again:
                cmd.append("--destroy-data")
            if not again and os.path.exists(target):
                os.unlink(target)  # fresh: a file a killed run left would be a rewrite
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if p.returncode != 0:
                out.append({"backend": backend, "rewrite": again,
                            "error": (p.stderr or p.stdout)[-500:]})
                break
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r.update(gb_per_s=r["bytes"] / r["seconds"] / 1e9, rewrite=again)
            out.append(r)
    finally:
        if os.path.exists(target):
            os.unlink(target)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the volumes go (the disk measured)")
    ap.add_argument("--params", type=parse_bytes, default=parse_bytes("512M"))
    ap.add_argument("--depths", default="8,16,32")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--commits", type=int, default=3, help="commits a run times, each after "
                    "two steps (the depth's rate: its last)")
    ap.add_argument("--cli", default=os.environ.get("MEMASCEND_CLI"),
                    help="the memascend CLI for the ceiling (none: not measured)")
    ap.add_argument("--out", help="the record's file (default: printed)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--run-timeout", type=int, default=600, help="seconds a run may take")
    ap.add_argument("--depth", type=int, help=argparse.SUPPRESS)  # the child's
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    if a.depth is not None:
        print(json.dumps(child(a)), flush=True)
        return 0
    depths = [int(d) for d in a.depths.split(",")]
    if not all(1 <= d <= 256 for d in depths):
        ap.error(f"--depths: each from 1 to 256 (the store's write_back_depth), not {a.depths}")
    for stale in glob.glob(os.path.join(a.dir, "commit-*.vol")) + [
            os.path.join(a.dir, "ceiling.bin")]:
        if os.path.exists(stale):  # a killed run's
            os.unlink(stale)
    seed = a.seed if a.seed is not None else int(time.time())
    order = [d for d in depths for _ in range(a.reps)]
    random.Random(seed).shuffle(order)
    commit = measured_commit()
    record = {"kind": "commit-depth", "date": datetime.datetime.now(datetime.timezone.utc)
              .isoformat(timespec="seconds"), "device": socket.gethostname(),
              "commit": commit, "command": " ".join([sys.executable] + sys.argv),
              "seed": seed, "order": order, "runs": [], "ceilings": [],
              "ceiling_gb_per_s": 0.0, "by_depth": {}}

    def save():  # after each measurement: a call cut short keeps what ran
        best = max((c.get("gb_per_s", 0) for c in record["ceilings"]), default=0)
        record["ceiling_gb_per_s"] = best
        for d in depths:
            ran = [r for r in record["runs"] if r.get("depth") == d and "gb_per_s" in r]
            if ran:
                rates = [r["gb_per_s"] for r in ran]
                record["by_depth"][str(d)] = {
                    "median_gb_per_s": statistics.median(rates), "min": min(rates),
                    "max": max(rates), "first_commit_median_gb_per_s": statistics.median(
                        r["first_gb_per_s"] for r in ran),
                    "over_ceiling": statistics.median(rates) / best if best else None}
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump(record, f, indent=1)
            os.replace(a.out + ".tmp", a.out)

    # The ceiling first, at a commit's size (14 bytes a parameter), so that a call cut
    # short has it for what ran.
    size = 14 * max(1, a.params // CHUNK) * CHUNK
    if a.cli:
        record["ceilings"] = [r for b in ("uring", "threads") for r in ceiling(a, size, b)]
        save()
    for d in order:
        cmd = [sys.executable, os.path.abspath(__file__), "--dir", a.dir, "--params",
               str(a.params), "--commits", str(a.commits), "--depth", str(d)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        try:
            out, err = p.communicate(timeout=a.run_timeout)
            run = (json.loads(out.strip().splitlines()[-1]) if p.returncode == 0 else
                   {"depth": d, "error": err[-2000:]})
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            run = {"depth": d, "error": f"killed after {a.run_timeout} s (--run-timeout)"}
        record["runs"].append(run)
        save()
        print(f"[commit] depth {d}: {run.get('gb_per_s', run.get('error'))}", flush=True)
    print(json.dumps({"by_depth": record["by_depth"],
                      "ceiling_gb_per_s": record["ceiling_gb_per_s"]}, indent=1))
    return 0 if all("error" not in r for r in record["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

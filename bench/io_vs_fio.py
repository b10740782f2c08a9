#!/usr/bin/env python3
"""memascend bench io vs fio (--ioengine=io_uring --direct=1), side by side.

Same file, block size, queue depth and size; sequential reads and writes at
1 MiB / QD 32 and 128 KiB / QD 64; each pair interleaved (fio, memascend io_uring,
memascend threads), repeated, median reported, with the ratios to fio.

    bench/io_vs_fio.py [--cli build/release/tools/memascend] [--file PATH]
                       [--size 2G] [--repeat 3] [--json]

Installs fio from Debian when it is missing (root), or says how to.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

SETTINGS = [("write", "1M", 32), ("read", "1M", 32), ("write", "128K", 64), ("read", "128K", 64)]


def ensure_fio():
    if shutil.which("fio"):
        return
    if os.geteuid() != 0:
        sys.exit("fio is missing: apt-get install fio")
    print("[io_vs_fio] installing fio from Debian", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], check=True, env=env)


def fio(path, rw, bs, qd, size):
    out = subprocess.run(
        ["fio", "--name=memascend-cmp", f"--filename={path}", "--ioengine=io_uring", "--direct=1",
         f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}", f"--size={size}", "--numjobs=1",
         "--output-format=json"], check=True, capture_output=True, text=True).stdout
    job = json.loads(out)["jobs"][0][rw]
    return job["io_bytes"] / (job["runtime"] / 1000.0) / 2**30


def ours(cli, path, rw, bs, qd, size, backend):
    # The file is this script's scratch, which fio fills with its own data between runs.
    out = subprocess.run([cli, "bench", "io", "--target", path, "--rw", rw, "--block", bs,
                          "--qd", str(qd), "--size", size, "--backend", backend, "--json",
                          "--destroy-data"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["gib_per_s"]


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", default=os.path.join(root, "build/release/tools/memascend"))
    ap.add_argument("--file", default=os.path.join(root, "build/io_vs_fio.dat"))
    ap.add_argument("--size", default="2G")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ensure_fio()
    rows = []
    for rw, bs, qd in SETTINGS:
        f, u, t = [], [], []
        for _ in range(args.repeat):
            f.append(fio(args.file, rw, bs, qd, args.size))
            u.append(ours(args.cli, args.file, rw, bs, qd, args.size, "uring"))
            t.append(ours(args.cli, args.file, rw, bs, qd, args.size, "threads"))
        fm, um, tm = statistics.median(f), statistics.median(u), statistics.median(t)
        rows.append({"rw": rw, "block": bs, "qd": qd, "fio_gib_per_s": fm, "uring_gib_per_s": um,
                     "threads_gib_per_s": tm, "uring_over_fio": um / fm, "threads_over_fio": tm / fm})
    if args.json:
        print(json.dumps({"file": args.file, "size": args.size, "repeat": args.repeat, "rows": rows}))
        return
    print(f"file {args.file}, {args.size} per run, median of {args.repeat} interleaved runs (GiB/s)")
    print("| rw | block | qd | fio io_uring | memascend io_uring | ratio | memascend threads | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rw']} | {r['block']} | {r['qd']} | {r['fio_gib_per_s']:.3f} | "
              f"{r['uring_gib_per_s']:.3f} | {r['uring_over_fio']:.2f} | "
              f"{r['threads_gib_per_s']:.3f} | {r['threads_over_fio']:.2f} |")


if __name__ == "__main__":
    main()

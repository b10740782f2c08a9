#!/usr/bin/env python3
"""Prints the pool-sim table (markdown) for workload files: live and reserved peak per
policy, and the ratios the host-memory targets are about.

    bench/pool_sim_table.py [--cli build/release/tools/memascend] [FILE ...]

Without files it covers every file in data/workloads.
"""
import argparse
import glob
import json
import os
import subprocess
import sys


def gib(b):
    return f"{b / 2**30:.2f} GiB"


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", default=os.path.join(root, "build/release/tools/memascend"))
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    files = args.files or sorted(glob.glob(os.path.join(root, "data/workloads/*.tsv")))
    if not os.access(args.cli, os.X_OK):
        sys.exit(f"no CLI at {args.cli}: build it (./run demo) or pass --cli")
    print("| workload | params | live peak | memascend | pow2 | zero | memascend / live "
          "| memascend / zero | pow2 / live | zero buffers (param x bytes, optim x bytes) "
          "| regions mapped per steady step (memascend) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for f in files:
        out = subprocess.run([args.cli, "pool-sim", "--workload", f, "--policy", "all",
                              "--steps", "2", "--json"], check=True, capture_output=True,
                             text=True).stdout
        rows = {r["policy"]: r for r in map(json.loads, out.splitlines())}
        m, p, z = rows["memascend"], rows["pow2"], rows["zero"]
        zb = z["zero"]
        print(f"| {m['workload']} | {m['parameters'] / 1e9:.2f} B | {gib(m['live_peak_bytes'])} "
              f"| {gib(m['reserved_peak_bytes'])} | {gib(p['reserved_peak_bytes'])} "
              f"| {gib(z['reserved_peak_bytes'])} "
              f"| {m['reserved_peak_bytes'] / m['live_peak_bytes']:.3f} "
              f"| {m['reserved_peak_bytes'] / z['reserved_peak_bytes']:.3f} "
              f"| {p['reserved_peak_bytes'] / p['live_peak_bytes']:.3f} "
              f"| {zb['param_buffers']} x {zb['param_buffer_bytes'] / 1e6:.0f} MB, "
              f"{zb['optimizer_buffers']} x {zb['optimizer_buffer_bytes'] / 1e9:.2f} GB "
              f"| {m['regions_mapped_last_step']} |")


if __name__ == "__main__":
    main()

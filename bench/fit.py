#!/usr/bin/env python3
"""bench/fit.py: what trains under a hard memory cap (issue 25): each run in a memory
cgroup the kernel enforces (bench/memcap.sh: v2 memory.max or v1 memory.limit_in_bytes),
at 2, 4 and 8 GiB, for memascend and ZeRO-Infinity (its complete rules, Note [zero rules]).

Per cap and policy:
  - the largest model of the ladder (bench/configs/: 56 M, 250 M, 1.2 B parameters) that
    trains 3 steps at --seq 256;
  - the longest sequence of the 1B model that trains, activations checkpointed
    (memascend through its store, ZeRO in host memory: cpu_checkpointing);
  - the largest batch of the 1B model at --seq 256, checkpointed likewise.
A run the kernel kills counts as "does not fit"; one past --timeout or that fails with an
error of its own is "not measured" (it neither fits nor fails), and the table says so.
The ladders are walked upwards and stop at the first rung that does not fit. Caps are taken smallest first: a rung that fitted under a
smaller cap fits under a larger one (the same run, less constrained) and is recorded as
implied, not run again.

The sequence and batch ladders stop at 2048 tokens a step (--seqs, --batches), fixed
before any run: on 2 cores a 1B step of 4096 tokens takes over five minutes. Their runs
train 2 steps (--ladder-steps): the second step's forward pass overlaps the first's
update, the steady state's peak.

Operating points, fixed here before any run: memascend's pinned budget is a quarter of
the cap (at most 40% of the model's training state); ZeRO runs DeepSpeed's defaults and
its smallest configuration (one parameter buffer raised to the largest parameter, four
optimizer buffers, one tensor per sub-group, max_in_cpu 0: every parameter on NVMe).

One JSON object per run in OUT/fit.jsonl: policy, settings, cap_bytes, model, parameters,
seq, batch, fits, peak_rss_bytes (the trainer's VmHWM), cgroup_peak_bytes, oom_kills,
command; then a table on stdout.

  sudo /usr/bin/python3 bench/fit.py --train build/release/examples/offload_train/memascend-train
  /usr/bin/python3 bench/fit.py --caps 1G --models llama-56m --seqs 256 --batches 1   # quick

About an hour on 2 cores for the full ladders (the 1B runs dominate); needs root for the
cgroup and disk for one volume of the 1B model (about 40 GiB).
"""
import argparse
import json
import os
import re
import struct
import subprocess
import sys
import random
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LADDER = [("llama-56m", "bench/configs/llama-dp-56m.json"),
          ("llama-250m", "bench/configs/llama-250m.json"),
          ("llama-1b", "bench/configs/llama-3.2-1b.json")]
ZERO_SMALLEST = ["--zero-param-buffers", "1", "--zero-param-buffer-size", "1",
                 "--zero-optimizer-buffers", "4", "--zero-sub-group-size", "1",
                 "--zero-max-in-cpu", "0"]
# ZeRO under 0.16.5's rules and under 0.19.5's (swap buffers at their size, both
# pin_memory flags on; Note [zero rules]): each configuration under both.
POLICIES = {
    "memascend": None,  # --host-budget: a quarter of the cap (below)
    "zero-default": ["--policy", "zero-infinity", "--zero-release", "0.16.5"],
    "zero-smallest": ["--policy", "zero-infinity", "--zero-release", "0.16.5", *ZERO_SMALLEST],
    "zero-default-0.19.5": ["--policy", "zero-infinity", "--zero-release", "0.19.5"],
    "zero-smallest-0.19.5": ["--policy", "zero-infinity", "--zero-release", "0.19.5",
                             *ZERO_SMALLEST],
}


def parse_bytes(s):
    m = re.fullmatch(r"(\d+)([KMG]?)", s)
    if not m:
        raise SystemExit(f"fit: '{s}' is not a size")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def wait_for_space(path, need, seconds=300):
    """The blocks of a volume just removed come back once the run the kernel killed has
    let go of it, some seconds later: without the wait the next run found the disk full
    and was not measured (docs/benchmarks.md, the 2 GiB rung)."""
    for _ in range(seconds):
        st = os.statvfs(path)
        if st.f_bavail * st.f_frsize >= need:
            return
        time.sleep(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", default=os.path.join(ROOT, "build/release/examples/offload_train/memascend-train"))
    ap.add_argument("--work", default="/tmp/memascend-fit")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/benchmarks-data"))
    ap.add_argument("--caps", default="2G,4G,8G")
    ap.add_argument("--models", default=",".join(n for n, _ in LADDER))
    ap.add_argument("--seqs", default="256,512,1024,2048")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--steps", type=int, default=3, help="steps of the model ladder's runs")
    ap.add_argument("--ladder-steps", type=int, default=2,
                    help="steps of the sequence and batch ladders' runs")
    ap.add_argument("--timeout", type=int, default=1500)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    tokens = os.path.join(a.work, "train.u32")
    if not os.path.exists(tokens):
        r = random.Random(1)
        with open(tokens, "wb") as f:
            f.write(struct.pack("<400000I", *(r.randrange(32000) for _ in range(400000))))
    out = open(os.path.join(a.out, "fit.jsonl"), "w")
    models = [m for m in LADDER if m[0] in a.models.split(",")]
    table = {}

    fitted = {}  # (policy, ladder, rung) -> the smallest cap it fitted under
    failed = {}  # (policy, ladder, rung) -> the largest cap it did not fit under

    def record(row):
        out.write(json.dumps(row) + "\n")
        out.flush()
        return row

    def run(policy, cap, model, seq, batch, checkpoint, rung):
        name, cfg = model
        row = {"policy": policy, "settings": POLICIES[policy] or ["--host-budget", "cap/4"],
               "cap_bytes": cap, "model": name, "seq": seq, "batch": batch,
               "checkpoint_activations": checkpoint}
        if rung in failed and failed[rung] >= cap:  # did not fit under as much or more
            return record(dict(row, fits=False, implied_by_cap_bytes=failed[rung]))
        if rung in fitted and fitted[rung] <= cap:  # fitted under as much or less
            return record(dict(row, fits=True, implied_by_cap_bytes=fitted[rung]))
        steps = a.steps if rung[1] == "model" else a.ladder_steps
        vol = os.path.join(a.work, "run.vol")
        if os.path.exists(vol):
            os.remove(vol)
        subprocess.run(["rm", "-rf", vol + ".zero"], check=False)
        if name == "llama-1b":
            wait_for_space(a.work, 40 << 30)
        cmd = [a.train, "--config", os.path.join(ROOT, cfg), "--tokens", tokens, "--seq", str(seq),
               "--batch", str(batch), "--steps", str(steps), "--dtype", "bf16", "--json", "--quiet",
               "--sample", "0", "--force", "--volume", vol, "--matmul", "blas"]
        if checkpoint:
            cmd.append("--checkpoint-activations")
        if name == "llama-1b":  # the default (twice what the run needs) is more than the disk
            cmd += ["--volume-size", "40G"]
        if policy == "memascend":
            # A quarter of the cap, at most 40% of the state (applied by the trainer's
            # cap of a budget above the state it can ever hold).
            cmd += ["--host-budget", str(cap // 4 // 4096 * 4096)]
        else:
            cmd += POLICIES[policy]
        try:
            p = subprocess.run([os.path.join(ROOT, "bench/memcap.sh"), str(cap), *cmd],
                               capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            subprocess.run(["pkill", "-f", vol], check=False)
            print(f"  {policy} cap {cap >> 20} MiB {name} seq {seq} batch {batch}: timed out",
                  file=sys.stderr, flush=True)
            return record(dict(row, fits=None, not_measured=f"past the {a.timeout} s timeout",
                               command=cmd))
        m = re.search(r"memcap: limit_bytes=(\d+) peak_bytes=(\d+) oom_kills=(\d+)", p.stderr)
        row.update(fits=p.returncode == 0, cgroup_peak_bytes=int(m.group(2)) if m else None,
                   oom_kills=int(m.group(3)) if m else None, command=cmd)
        try:
            s = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("{")))
            row.update(parameters=s["params"], peak_rss_bytes=s["peak_rss_bytes"],
                       step_seconds=s["step_seconds"])
        except StopIteration:
            row["error"] = (p.stderr.strip().splitlines() or [""])[-2:]
        if p.returncode != 0 and not row["oom_kills"] and p.returncode != 137:
            # Not the kernel's cap: a setup or training error, which says nothing of the fit.
            row["fits"] = None
            row["not_measured"] = "failed: " + " ".join(row["error"])
        if row["fits"]:
            fitted[rung] = min(cap, fitted.get(rung, cap))
        elif row["fits"] is False:
            failed[rung] = max(cap, failed.get(rung, cap))
        record(row)
        print(f"  {policy} cap {cap >> 20} MiB {name} seq {seq} batch {batch}: fits={row['fits']} "
              f"oom_kills={row['oom_kills']} rss={row.get('peak_rss_bytes', 0) >> 20} MiB",
              file=sys.stderr, flush=True)
        return row

    for cap in sorted(map(parse_bytes, a.caps.split(","))):
        for policy in a.policies.split(","):
            t = table.setdefault((cap, policy), {})
            for model in models:  # the largest model that trains
                r = run(policy, cap, model, 256, 1, False, (policy, "model", model[0]))
                if not r["fits"]:
                    t["model_stop"] = "error" if r["fits"] is None else "no"
                    break
                t["model"] = model[0]
            big = models[-1]
            for seq in map(int, a.seqs.split(",")):  # the longest sequence, checkpointed
                r = run(policy, cap, big, seq, 1, True, (policy, "seq", seq))
                if not r["fits"]:
                    t["seq_stop"] = "error" if r["fits"] is None else "no"
                    break
                t["seq"] = seq
            for batch in map(int, a.batches.split(",")):  # the largest batch, checkpointed
                # batch 1 is the sequence ladder's first rung: the same run
                rung = (policy, "seq", 256) if batch == 1 else (policy, "batch", batch)
                r = run(policy, cap, big, 256, batch, True, rung)
                if not r["fits"]:
                    t["batch_stop"] = "error" if r["fits"] is None else "no"
                    break
                t["batch"] = batch
    print(f"| cap | policy | largest model | longest seq ({models[-1][0]}) | largest batch ({models[-1][0]}, seq 256) |")
    print("|---|---|---|---|---|")
    tops = {"seq": a.seqs.split(",")[-1], "batch": a.batches.split(",")[-1],
            "model": models[-1][0]}

    def cell(t, k):  # "the top rung" when the ladder ran out before the memory did
        v = t.get(k, "none")
        if str(v) == tops[k] and f"{k}_stop" not in t:
            return f"{v} (the ladder's top)"
        return f"{v} (next rung not measured)" if t.get(f"{k}_stop") == "error" else str(v)
    for (cap, policy), t in table.items():
        print(f"| {cap >> 30} GiB | {policy} | {cell(t, 'model')} | {cell(t, 'seq')} | "
              f"{cell(t, 'batch')} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# bench/data_parallel.sh: memascend-train data-parallel under mpirun at 1, 2 and 4 ranks
# (Note [data parallel] in examples/offload_train/data_parallel.cpp) on one machine: per-rank peak
# RSS, step time, bytes each rank sends per step, volume I/O per step.
#
# The operating point is fixed here, before any run: a Llama-shaped model of 56 M
# parameters (bench/configs/llama-dp-56m.json: hidden 512, 8 layers, GQA 8/4, vocab 32000,
# untied), --seq 128, global --batch 4, bf16, each rank's default pinned budget (40% of its
# shard), 4 steps; the machine's cores split among the ranks (--threads cores/N, at least
# 1: 4 ranks on 2 cores are oversubscribed). Each rank count runs REPEATS times (default
# 5), in a random order per repeat. One JSON object per run goes to $OUT (default
# docs/benchmarks-data/data_parallel.jsonl); a table of medians and ranges follows.
#
# Environment: BUILD (with an MPI build of memascend-train; default build/release),
# WORK (scratch: the volumes, ~3 GiB; default /tmp/memascend-dp), REPEATS, SEED.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${BUILD:-$ROOT/build/release}
WORK=${WORK:-/tmp/memascend-dp}
OUT=${OUT:-$ROOT/docs/benchmarks-data/data_parallel.jsonl}
REPEATS=${REPEATS:-5}
SEED=${SEED:-1}
TRAIN=$BUILD/examples/offload_train/memascend-train
CONFIG=$ROOT/bench/configs/llama-dp-56m.json
[ -x "$TRAIN" ] || { echo "data_parallel: no $TRAIN (./run bench builds it)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "data_parallel: no mpirun (apt-get install openmpi-bin)" >&2; exit 2; }
CORES=$(nproc)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

mkdir -p "$WORK" "$(dirname "$OUT")"
: > "$OUT"
python3 - "$WORK" <<'PY'
import random, struct, sys
r = random.Random(1)
with open(f"{sys.argv[1]}/train.u32", "wb") as f:
    f.write(struct.pack("<100000I", *(r.randrange(32000) for _ in range(100000))))
PY

order=$(python3 -c "
import random
r = random.Random($SEED)
for _ in range($REPEATS):
    n = [1, 2, 4]; r.shuffle(n); print(' '.join(map(str, n)))")
repeat=0
while read -r line; do
  repeat=$((repeat + 1))
  for n in $line; do
    threads=$(( CORES / n )); [ "$threads" -ge 1 ] || threads=1
    rm -f "$WORK"/rank*.vol
    cmd=(mpirun --oversubscribe -np "$n" "$TRAIN" --config "$CONFIG" --tokens "$WORK/train.u32"
         --dtype bf16 --seq 128 --batch 4 --steps 4 --threads "$threads" --json --quiet
         --volume "$WORK/rank{rank}.vol")
    echo "data_parallel: repeat $repeat, $n ranks: ${cmd[*]}" >&2
    "${cmd[@]}" > "$WORK/run.json" < /dev/null  # mpirun would read the loop's input
    python3 - "$WORK/run.json" "$OUT" "$n" "$repeat" "$threads" "${cmd[*]}" <<'PY'
import json, sys
src, out, n, repeat, threads, cmd = sys.argv[1:7]
s = json.loads(next(l for l in open(src) if l.startswith("{")))
ranks = s.get("ranks") or [{
    "peak_rss_bytes": s["peak_rss_bytes"], "peak_pinned_bytes": s["peak_pinned_bytes"],
    "mean_step_seconds": sum(s["step_seconds"]) / len(s["step_seconds"]),
    "comm_bytes_per_step": 0, "io_bytes_per_step": sum(s["step_io_bytes"]) / len(s["step_io_bytes"]),
    "state_elements": s["params"]}]
row = {"ranks": int(n), "repeat": int(repeat), "threads_per_rank": int(threads),
       "params": s["params"], "losses": s["losses"], "step_seconds": s["step_seconds"],
       "host_budget_bytes": s["host_budget_bytes"], "per_rank": ranks, "command": cmd}
with open(out, "a") as f:
    f.write(json.dumps(row) + "\n")
PY
  done
done <<< "$order"

python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| ranks | step time (steps 2-4, s) | peak RSS per rank (MiB) | sent per rank per step (MiB) | volume I/O per rank per step (MiB) | state per rank (M elements) |")
print("|---|---|---|---|---|---|")
for n in (1, 2, 4):
    rs = [r for r in rows if r["ranks"] == n]
    if not rs:
        continue
    def spread(vals, scale=1.0, fmt="{:.2f}"):
        vals = sorted(v / scale for v in vals)
        return f"{fmt.format(statistics.median(vals))} ({fmt.format(vals[0])}-{fmt.format(vals[-1])})"
    step = [statistics.median(r["step_seconds"][1:]) for r in rs]
    rss = [max(p["peak_rss_bytes"] for p in r["per_rank"]) for r in rs]
    sent = [max(p["comm_bytes_per_step"] for p in r["per_rank"]) for r in rs]
    io = [max(p["io_bytes_per_step"] for p in r["per_rank"]) for r in rs]
    state = [max(p["state_elements"] for p in r["per_rank"]) for r in rs]
    print(f"| {n} | {spread(step)} | {spread(rss, 2**20, '{:.0f}')} | {spread(sent, 2**20, '{:.1f}')} | "
          f"{spread(io, 2**20, '{:.0f}')} | {spread(state, 1e6, '{:.1f}')} |")
PY

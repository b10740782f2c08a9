#!/usr/bin/env bash
# bench/llama_1b.sh: a model with Llama-3.2-1B's shapes (bench/configs/llama-3.2-1b.json:
# hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocab 128256, tied
# embeddings; 1.236 B parameters) through memascend-train on this machine, each run in a
# memory cgroup the kernel caps (bench/memcap.sh):
#
#   1. export: the config's random weights written as a Hugging Face checkpoint (BF16,
#      --steps 0 --export): the checkpoint the next runs start from;
#   2. import: that checkpoint imported (--init-from, --steps 0) under a 1 GiB cap;
#   3. train: imported, 3 steps at --seq 256 --batch 1, evaluated and exported again,
#      under a 4 GiB cap; once as is, once with --checkpoint-activations.
#
# The operating points are fixed here, before any run: a 1 GiB pinned host budget for
# training (5% of the 18.4 GiB training state), 256 MiB for the import; caps of 4 GiB and
# 1 GiB. One JSON object per run goes to $OUT (default docs/benchmarks-data/llama1b.jsonl):
# the trainer's --json summary plus the cgroup's cap, peak and OOM kills and the command.
#
# Environment: BUILD (a build directory with memascend-train; default build/release, made
# by ./run bench), WORK (scratch directory, ~45 GiB free: the volume and two checkpoints;
# default /tmp/memascend-llama1b), THREADS (default: all cores). About 8 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=${BUILD:-$ROOT/build/release}
WORK=${WORK:-/tmp/memascend-llama1b}
OUT=${OUT:-$ROOT/docs/benchmarks-data/llama1b.jsonl}
THREADS=${THREADS:-0}
TRAIN=$BUILD/examples/offload_train/memascend-train
CONFIG=$ROOT/bench/configs/llama-3.2-1b.json
[ -x "$TRAIN" ] || { echo "llama_1b: no $TRAIN (./run bench builds it)" >&2; exit 2; }

mkdir -p "$WORK" "$(dirname "$OUT")"
: > "$OUT"
# Token ids: a fixed pseudo-random stream below the vocabulary (training), and 3 windows
# of 257 for the evaluation.
python3 - "$WORK" <<'EOF'
import random, struct, sys
r = random.Random(1)
for name, n in (("train.u32", 100000), ("eval.u32", 3 * 257)):
    with open(f"{sys.argv[1]}/{name}", "wb") as f:
        f.write(struct.pack(f"<{n}I", *(r.randrange(128256) for _ in range(n))))
EOF

# run NAME CAP ARGS...: one capped run, its summary and the cgroup's figures to $OUT.
run() {
  local name=$1 cap=$2; shift 2
  local cmd=("$TRAIN" --volume "$WORK/run.vol" --volume-size 40G --force --json --quiet
             --threads "$THREADS" "$@")
  echo "llama_1b: $name under $cap: ${cmd[*]}" >&2
  local status=0
  "$ROOT/bench/memcap.sh" "$cap" "${cmd[@]}" > "$WORK/$name.json" 2> "$WORK/$name.err" || status=$?
  python3 - "$name" "$WORK/$name.json" "$WORK/$name.err" "$OUT" "$status" "${cmd[@]}" <<'EOF'
import json, re, sys
name, summary, err, out, status = sys.argv[1:6]
cmd = sys.argv[6:]
cap = re.search(r"memcap: limit_bytes=(\d+) peak_bytes=(\d+) oom_kills=(\d+)", open(err).read())
try:
    s = json.load(open(summary))
except ValueError:
    s = {}
row = {"run": name, "fits": status == "0", "cap_bytes": int(cap.group(1)),
       "cgroup_peak_bytes": int(cap.group(2)), "oom_kills": int(cap.group(3)),
       "command": cmd}
for k in ("params", "steps", "losses", "step_seconds", "step_io_bytes", "peak_rss_bytes", "host_budget_bytes",
          "model_state_bytes", "io_read_bytes", "io_write_bytes", "activation_bytes",
          "phase_seconds", "eval_loss", "eval_tokens", "export_bytes", "seconds"):
    if k in s:
        row[k] = s[k]
with open(out, "a") as f:
    f.write(json.dumps(row) + "\n")
print(f"  {name}: fits={row['fits']} peak RSS {s.get('peak_rss_bytes', 0) / 2**30:.2f} GiB, "
      f"cgroup peak {row['cgroup_peak_bytes'] / 2**30:.2f} GiB of {row['cap_bytes'] / 2**30:.0f}"
      + (f", steps {[round(t, 1) for t in s['step_seconds']]} s" if s.get("step_seconds") else ""),
      file=sys.stderr)
EOF
  [ "$status" = 0 ] || tail -3 "$WORK/$name.err" >&2
}

rm -rf "$WORK/ckpt" "$WORK/out" "$WORK/out-ckpt"
run export 8G --config "$CONFIG" --tokens "$WORK/train.u32" --steps 0 --seq 256 --batch 1 \
  --host-budget 1G --export "$WORK/ckpt" --export-dtype BF16
run import 1G --init-from "$WORK/ckpt" --tokens "$WORK/train.u32" --steps 0 --seq 256 \
  --batch 1 --host-budget 256M
for ck in "" --checkpoint-activations; do
  run "train${ck:+-checkpointed}" 4G --init-from "$WORK/ckpt" --tokens "$WORK/train.u32" \
    --eval "$WORK/eval.u32" --steps 3 --seq 256 --batch 1 --dtype bf16 --lr 1e-5 --warmup 0 \
    --host-budget 1G --export "$WORK/out${ck:+-ckpt}" $ck
done
rm -f "$WORK/run.vol"
echo "llama_1b: $(wc -l < "$OUT") runs in $OUT" >&2

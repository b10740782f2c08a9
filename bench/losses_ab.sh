#!/usr/bin/env bash
# Do two builds of memascend-train train alike? Runs six configurations with each binary
# (the headline's small model under both policies, the demo's model with sampling, bf16
# with weight decay and kept state and the update not overlapped, reference mode, and a
# run resumed from a volume) and compares the losses and the sampled text bit for bit.
#
#   bench/losses_ab.sh OLD_BINARY NEW_BINARY [SCRATCH_DIR]
#
# Used when the offload machinery moved into the SDK (docs/training-components.md).
set -euo pipefail
A=$1; B=$2; DIR=${3:-${TMPDIR:-/tmp}/memascend-losses-ab}
mkdir -p "$DIR"
V=$DIR/vol
S="--vocab 8192 --channels 256 --layers 4 --heads 4 --seq 32 --batch 2 --lr 1e-3 --steps 20 --sample 0 --json --threads 2"
run() {  # binary out-dir
  local bin=$1 out=$2
  mkdir -p "$out"
  rm -rf "$V"*; "$bin" $S --volume "$V" --optimizer-chunk 262144 --host-budget 35% > "$out/a.json" 2>/dev/null
  rm -rf "$V"*; "$bin" $S --volume "$V" --policy zero-infinity > "$out/b.json" 2>/dev/null
  rm -rf "$V"*; "$bin" --steps 30 --sample 20 --json --volume "$V" --threads 2 > "$out/c.json" 2>/dev/null
  rm -rf "$V"*; "$bin" --steps 25 --json --sample 0 --volume "$V" --overlap-optimizer 0 \
    --weight-decay 0.1 --dtype bf16 --keep 1M --optimizer-chunk 262144 --threads 2 > "$out/d.json" 2>/dev/null
  rm -rf "$V"*; "$bin" --steps 25 --json --sample 0 --mode reference --weight-decay 0.1 --threads 2 > "$out/e.json" 2>/dev/null
  rm -rf "$V"*; "$bin" --steps 10 --json --sample 0 --volume "$V" --threads 2 --quiet > /dev/null 2>&1
  "$bin" --steps 20 --resume --json --sample 10 --volume "$V" --threads 2 > "$out/f.json" 2>/dev/null
  rm -rf "$V"*
}
run "$A" "$DIR/a"
run "$B" "$DIR/b"
status=0
for f in a b c d e f; do
  python3 - "$DIR/a/$f.json" "$DIR/b/$f.json" "$f" <<'PY' || status=1
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
# Older builds printed losses with 9 significant digits: compare at that precision.
la = [float('%.9g' % x) for x in a['losses']]
lb = [float('%.9g' % x) for x in b['losses']]
same = la == lb and a.get('sample') == b.get('sample')
print(f"{sys.argv[3]}: {len(la)} losses, last {la[-1]:.9g}: {'equal' if same else 'DIFFERENT'}")
sys.exit(0 if same else 1)
PY
done
exit $status

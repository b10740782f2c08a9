#!/usr/bin/env bash
# tools/device/lease.sh WHAT: one device call of a GPU lease, run from the repository root on
# the GPU machine with .device/ carried (./run device-prep, ./run device-prep --deepspeed).
# Everything it makes lands in /tmp/lease-out and goes back as one archive, $OUT/all.tgz
# (a call returns at most 8 files), also when a step is cut at the deadline.
#
#   DEADLINE=S   seconds from the start by which the call ends (default 540; give the
#                device tool's timeout_s some 20 s more)
#   tests        DeepSpeed's two ops built beside the device tests (./run device tests),
#                which use the GPU but not all the cores
#   compare      DeepSpeed's two ops built first, both at once (a fresh machine has none:
#                no row's time may hold a compiler), then ./run device bench-gpu with
#                CMP_ARGS, its time budget the rest of the deadline
#   path         ./run device bench-gpu-path with PATH_ARGS
#   commit       ./run device bench-commit with COMMIT_ARGS (bench/commit.py)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
DEADLINE=${DEADLINE:-540}
T0=$(date +%s)
O=/tmp/lease-out
rm -rf "$O" && mkdir -p "$O"
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/all.tgz" -C "$O" . 2>/dev/null; ls -la "$O"; }
trap pack EXIT
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
at() { echo "[lease] $* at $(( $(date +%s) - T0 )) s"; }
nvidia-smi > "$O/nvidia-smi.txt" 2>&1
DS=.device/deepspeed

build_ops() {  # both ops at once, into torch's extension cache
  [ -d "$DS" ] || { echo "no $DS: DeepSpeed rows will be skipped"; return 0; }
  ( . "$DS/env.sh"; export DS_SKIP_CUDA_CHECK=1
    for op in CPUAdamBuilder AsyncIOBuilder; do
      timeout 150 python3 -c "import time; from deepspeed.ops.op_builder import $op as B; \
t = time.time(); B().load(); print('$op built in', round(time.time() - t, 1), 's')" \
        > "$O/ds-$op.log" 2>&1 &
    done
    wait )
  tail -qn1 "$O"/ds-*.log
}

case "${1:-}" in
  tests)
    build_ops > "$O/ds-ops.txt" 2>&1 &
    timeout "$(left)" ./run device tests --out "$O/tests" > "$O/tests.log" 2>&1
    at "tests rc $?"
    wait
    cat "$O/ds-ops.txt"
    grep "\[device\]" "$O/tests.log" | tail -40
    ;;
  compare)
    build_ops
    at "ops built"
    R=$(left)
    timeout "$R" ./run device bench-gpu --out "$O/cmp" \
      --compare-args "${CMP_ARGS:-} --time-budget $((R - 15))" > "$O/cmp.log" 2>&1
    at "compare rc $?"
    tail -40 "$O/cmp.log"
    ;;
  path)
    timeout "$(left)" ./run device bench-gpu-path --out "$O/path" \
      --path-args "${PATH_ARGS:-}" > "$O/path.log" 2>&1
    at "path rc $?"
    tail -30 "$O/path.log"
    ;;
  commit)
    timeout "$(left)" ./run device bench-commit --out "$O/commit" \
      --commit-args "${COMMIT_ARGS:-}" > "$O/commit.log" 2>&1
    at "commit rc $?"
    tail -30 "$O/commit.log"
    ;;
  *)
    echo "usage: [DEADLINE=S] [CMP_ARGS=...] [PATH_ARGS=...] [COMMIT_ARGS=...] tools/device/lease.sh tests|compare|path|commit" >&2
    exit 2
    ;;
esac

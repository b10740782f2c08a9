#!/usr/bin/env bash
# tests/cli/train_defaults.sh memlock|cgroup TRAIN WORKDIR: memascend-train with no
# --host-budget (memascend Note [default host budget]).
#   memlock: under an 8 MiB RLIMIT_MEMLOCK without CAP_IPC_LOCK (as user nobody when run
#            as root, the most faithful stand-in for a Debian user), it trains on unlocked
#            memory and warns once, naming what to raise.
#   cgroup:  inside a 512 MiB memory cgroup (bench/memcap.sh) it picks a budget that the
#            cgroup decides and trains without an OOM kill.
# Prints "skipped: <why>" and exits 0 where the machine cannot do it (ctest skips on it).
set -u
mode=$1 train=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "FAILED: $*"; exit 1; }
mkdir -p "$work"
dir=$(mktemp -d "$work/train-defaults.XXXXXX")
trap 'rm -rf "$dir"' EXIT
chmod 777 "$dir"
# The demo's GPT (0.87 M parameters: a stored state of ~28 MiB, above 8 MiB) for memlock;
# 14 M parameters (a state above what 512 MiB leaves) for the cgroup.
case $mode in
  memlock)
    args=(--seq 16 --batch 2 --steps 3 --sample 0 --json --quiet --force --volume "$dir/run.vol")
    run=()
    if [ "$(id -u)" = 0 ]; then
      command -v setpriv >/dev/null || { echo "skipped: root, and no setpriv to drop to nobody"; exit 0; }
      run=(setpriv --reuid=65534 --regid=65534 --clear-groups --bounding-set=-ipc_lock --)
    fi
    out=$( (ulimit -l 8192 && exec "${run[@]}" "$train" "${args[@]}") 2>"$dir/err")
    rc=$?
    cat "$dir/err"
    [ $rc = 0 ] || fail "exit $rc"
    n=$(grep -c "RLIMIT_MEMLOCK" "$dir/err")
    [ "$n" = 1 ] || fail "$n warnings about RLIMIT_MEMLOCK, not one"
    for want in "ulimit -l" "LimitMEMLOCK=" "--ulimit memlock=-1"; do
      grep -qF -- "$want" "$dir/err" || fail "the warning does not say '$want'"
    done
    echo "$out" | grep -q '"host_budget_locked":false' || fail "budget locked: $out"
    echo "$out" | grep -q '"host_budget_default":true' || fail "not the default: $out"
    echo "$out" | grep -q '"steps":3' || fail "did not train 3 steps: $out"
    echo "ok: trained 3 steps on an unlocked default budget under RLIMIT_MEMLOCK 8 MiB"
    ;;
  cgroup)
    args=(--channels 384 --layers 8 --heads 4 --seq 16 --batch 2 --steps 3 --sample 0 --json
          --quiet --force --threads 2 --volume "$dir/run.vol")
    out=$(bash "$here/../../bench/memcap.sh" 512M "$train" "${args[@]}" 2>"$dir/err")
    rc=$?
    cat "$dir/err"
    if [ $rc = 2 ] && grep -q "memcap:.*\(cannot make\|no cgroup\)" "$dir/err"; then
      echo "skipped: cannot make a memory cgroup here ($(grep memcap: "$dir/err" | head -1))"
      exit 0
    fi
    [ $rc = 0 ] || fail "exit $rc"
    grep -q "oom_kills=0 " "$dir/err" || fail "OOM kill in the cgroup"
    echo "$out" | grep -q '"host_budget_default":true' || fail "not the default: $out"
    echo "$out" | grep -q '"host_budget_reason":"cgroup memory' ||
      fail "the cgroup did not decide the budget: $out"
    echo "$out" | grep -q '"steps":3' || fail "did not train 3 steps: $out"
    echo "ok: $(echo "$out" | grep -o '"host_budget_bytes":[0-9]*') inside 512 MiB"
    ;;
  *) fail "mode $mode is not memlock or cgroup" ;;
esac

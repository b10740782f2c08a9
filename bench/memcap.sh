#!/usr/bin/env bash
# bench/memcap.sh LIMIT COMMAND...: runs COMMAND in a memory cgroup the kernel caps at
# LIMIT bytes (a number with an optional K, M or G suffix, powers of 1024), made under this
# process's own cgroup and removed afterwards, whatever happens.
#
# cgroup v2 (memory.max, swap off with memory.swap.max 0) or v1 (memory.limit_in_bytes, and
# memory.memsw.limit_in_bytes where the kernel accounts swap), whichever the machine has.
# The cap counts everything the kernel charges the group: anonymous and page-locked
# memory, and the page cache of what the command reads or writes through it.
#
# Prints, on stderr, one line:
#   memcap: limit_bytes=N peak_bytes=N oom_kills=N exit=N
# and exits with the command's status (137 when the kernel killed it).
# Needs root (or a delegated cgroup).
set -euo pipefail

die() { echo "memcap: $*" >&2; exit 2; }
[ $# -ge 2 ] || die "usage: memcap.sh LIMIT COMMAND..."
limit=$1; shift
case $limit in
  *[Kk]) bytes=$(( ${limit%?} * 1024 )) ;;
  *[Mm]) bytes=$(( ${limit%?} * 1024 * 1024 )) ;;
  *[Gg]) bytes=$(( ${limit%?} * 1024 * 1024 * 1024 )) ;;
  *[!0-9]*|'') die "LIMIT '$limit' is not a number of bytes (K, M, G suffixes)" ;;
  *) bytes=$limit ;;
esac
[ "$bytes" -gt 0 ] || die "LIMIT must be positive"

if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  version=2
  own=$(awk -F: '$1 == "0" { print $3 }' /proc/self/cgroup)
  parent=/sys/fs/cgroup${own%/}
else
  version=1
  own=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ { print $3 }' /proc/self/cgroup)
  parent=/sys/fs/cgroup/memory${own%/}
fi
[ -d "$parent" ] || die "no cgroup directory $parent (is the memory controller mounted?)"
group=$parent/memascend-cap-$$
mkdir "$group" || die "cannot make $group (root or a delegated cgroup is needed)"
cleanup() {
  # Whatever is left in the group goes back to the parent before the group is removed.
  if [ -f "$group/cgroup.procs" ]; then
    while read -r pid; do echo "$pid" > "$parent/cgroup.procs" 2>/dev/null || true; done \
      < "$group/cgroup.procs"
  fi
  rmdir "$group" 2>/dev/null || true
}
trap cleanup EXIT

# A group can be made where the memory controller is not enabled for children (cgroup v2
# without "+memory" in the parent's cgroup.subtree_control; a sandbox's read-only files):
# no cap then, said as a group that cannot be made.
if [ $version = 2 ]; then
  echo "$bytes" 2>/dev/null > "$group/memory.max" ||
    die "cannot make a capped group: $group/memory.max cannot be written (is +memory in $parent/cgroup.subtree_control?)"
  [ -f "$group/memory.swap.max" ] && echo 0 > "$group/memory.swap.max"
else
  echo "$bytes" 2>/dev/null > "$group/memory.limit_in_bytes" ||
    die "cannot make a capped group: $group/memory.limit_in_bytes cannot be written"
  [ -f "$group/memory.memsw.limit_in_bytes" ] &&
    echo "$bytes" > "$group/memory.memsw.limit_in_bytes" 2>/dev/null || true
fi

# The command runs in a child that joins the group first.
status=0
bash -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' memcap "$group" "$@" || status=$?

if [ $version = 2 ]; then
  peak=$(cat "$group/memory.peak" 2>/dev/null || echo 0)
  kills=$(awk '$1 == "oom_kill" { print $2 }' "$group/memory.events" 2>/dev/null || echo 0)
else
  peak=$(cat "$group/memory.max_usage_in_bytes")
  kills=$(awk '$1 == "oom_kill" { print $2 }' "$group/memory.oom_control" 2>/dev/null || echo 0)
fi
echo "memcap: limit_bytes=$bytes peak_bytes=$peak oom_kills=${kills:-0} exit=$status" >&2
exit $status

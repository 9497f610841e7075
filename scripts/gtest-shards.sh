#!/bin/sh
# Runs a GoogleTest binary as JOBS shards at once (GoogleTest's own
# sharding: GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX, every test in exactly
# one shard), each shard's output to its own log, printed whole after the
# shards end, one after the other (never interleaved); then the slowest
# tests and, on failure, the failing tests by name.
#
#   scripts/gtest-shards.sh BIN JOBS [gtest options...]
#
# WRAP (environment): a command the binary runs under (valgrind ...).
# LOGDIR (environment): where the shards' logs go (default BIN.shards).
set -u
bin=$1; jobs=$2; shift 2
[ "$jobs" -ge 1 ] 2>/dev/null || jobs=1
logdir=${LOGDIR:-$bin.shards}
rm -rf "$logdir"; mkdir -p "$logdir"
wrap=${WRAP:-}

i=0
while [ $i -lt "$jobs" ]; do
  ( GTEST_TOTAL_SHARDS=$jobs GTEST_SHARD_INDEX=$i $wrap "$bin" "$@" \
      > "$logdir/shard$i.log" 2>&1; echo $? > "$logdir/shard$i.rc" ) &
  i=$((i + 1))
done
wait

fail=0; ran=0
i=0
while [ $i -lt "$jobs" ]; do
  echo "---- shard $((i + 1)) of $jobs ----"
  cat "$logdir/shard$i.log"
  rc=$(cat "$logdir/shard$i.rc" 2>/dev/null || echo 1)
  [ "$rc" = 0 ] || fail=1
  n=$(sed -n 's/^\[==========\] \([0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' "$logdir/shard$i.log" | tail -1)
  ran=$((ran + ${n:-0}))
  [ -n "$n" ] || { echo "gtest-shards: shard $((i + 1)) did not finish (exit $rc)"; fail=1; }
  i=$((i + 1))
done
echo "---- $(basename "$bin"): the 10 slowest tests ----"
cat "$logdir"/shard*.log | sed -n 's/^\[       OK \] \([^ ]*\) (\([0-9]*\) ms)$/\2 \1/p' |
  sort -rn | head -10 | awk '{ printf "  %8.1f s  %s\n", $1 / 1000, $2 }'
if [ $fail != 0 ]; then
  echo "---- $(basename "$bin"): FAILED ----"
  grep -h -E '^\[  FAILED  \] [A-Za-z_]' "$logdir"/shard*.log | sort -u
  exit 1
fi
echo "gtest-shards: $ran tests passed in $jobs shards"

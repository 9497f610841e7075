#!/bin/sh
# Runs each libFuzzer target over a copy of its seed corpus.
# Usage: scripts/fuzz.sh SECONDS TARGET...   (binaries in build/fuzz/bin/)
# SECONDS: every target's time, or a file of "target seconds" lines (its
# other lines, comments and blank ones, ignored; a target it does not
# name gets the file's "default" line, else 60).  libFuzzer replays the
# whole corpus first (the committed seeds and regressions), then runs new
# inputs for the rest of the time.
# Committed corpora (test/fuzz/corpus/<t>/) and regressions
# (test/fuzz/regressions/<t>/) are only read; new inputs go to
# build/fuzz/<t>/corpus, crash files to build/fuzz/<t>/.  A summary line per
# target goes to build/fuzz/summary.txt.  Exits 1 if any target crashed.
# FUZZ_JOBS targets run at once (default: the number of CPUs), each on
# one core: the longest first, each next one on the lane that frees first.
set -u
secs_arg=$1; shift
# A target's seconds.
secs_of() {
  case $secs_arg in
  *[!0-9]*)
    v=$(awk -v t="$1" '$1 == t { print $2; f = 1; exit }
                       $1 == "default" { d = $2 } END { if (!f) print (d ? d : 60) }' "$secs_arg")
    echo "$v" ;;
  *) echo "$secs_arg" ;;
  esac
}
summary=build/fuzz/summary.txt
mkdir -p build/fuzz
: > "$summary"
jobs_max=${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 1)}
[ "$jobs_max" -ge 1 ] 2>/dev/null || jobs_max=1

# One target: its log, summary line and exit status under build/fuzz/<t>/.
fuzz_one() {
  t=$1
  secs=$(secs_of "$t")
  bin=build/fuzz/bin/$t
  work=build/fuzz/$t
  rm -rf "$work"; mkdir -p "$work/corpus"
  # Scratch files (targets that read files write each input to one) go to
  # memory when /dev/shm exists: the speed is then the parser's, not the
  # disk's.
  scratch=$(mktemp -d /dev/shm/bico-fuzz-XXXXXX 2>/dev/null) || {
    scratch=$(pwd)/$work/tmp; mkdir -p "$scratch"; }
  seeds=0
  if [ -d "test/fuzz/corpus/$t" ]; then
    cp test/fuzz/corpus/"$t"/* "$work/corpus/" 2>/dev/null || true
    seeds=$(ls "test/fuzz/corpus/$t" | wc -l)
  fi
  extra=""
  [ -d "test/fuzz/regressions/$t" ] && extra="test/fuzz/regressions/$t"
  dict=""
  [ -f "test/fuzz/$t.dict" ] && dict="-dict=test/fuzz/$t.dict"
  echo "fuzz: $t for ${secs}s ($seeds seeds)"
  # rss/malloc limits turn an attacker-sized allocation into a failure.
  TMPDIR=$scratch "$bin" -max_total_time="$secs" -timeout=10 \
    -rss_limit_mb=2048 -malloc_limit_mb=1024 -print_final_stats=1 \
    -artifact_prefix="$work/" $dict "$work/corpus" $extra \
    > "$work/log.txt" 2>&1
  rc=$?
  rm -rf "$scratch"
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/log.txt" | tail -1)
  corpus=$(ls "$work/corpus" | wc -l)
  cov=$(grep -o 'cov: [0-9]*' "$work/log.txt" | tail -1 | sed 's/cov: //')
  echo "$t: rc=$rc seconds=$secs executions=${execs:-?} seeds=$seeds corpus_after=$corpus coverage_edges=${cov:-?}" > "$work/summary"
  echo $rc > "$work/rc"
}

# Lanes: targets longest first, each to the lane with the least time so
# far (a lane runs its targets one after the other).
lanes=$(for t in "$@"; do echo "$(secs_of "$t") $t"; done | sort -rn |
  awk -v n="$jobs_max" '{ best = 0; for (i = 1; i < n; i++) if (load[i] < load[best]) best = i;
                          load[best] += $1; lane[best] = lane[best] " " $2 }
                        END { for (i = 0; i < n; i++) if (lane[i] != "") print lane[i] }')
# (the loop reads a pipe, so it runs in a subshell: it waits for its lanes)
echo "$lanes" | {
  while read -r lane; do
    [ -n "$lane" ] || continue
    ( for t in $lane; do fuzz_one "$t"; done ) &
  done
  wait
}
failed=""
for t in "$@"; do
  work=build/fuzz/$t
  if [ -f "$work/summary" ]; then tee -a "$summary" < "$work/summary"
  else echo "$t: no result (its run did not finish)" | tee -a "$summary"; fi
  rc=$(cat "$work/rc" 2>/dev/null || echo 1)
  if [ "$rc" -ne 0 ]; then
    failed="$failed $t"
    tail -n 60 "$work/log.txt"
    ls "$work"/crash-* "$work"/leak-* "$work"/oom-* "$work"/timeout-* 2>/dev/null
  fi
done
if [ -n "$failed" ]; then
  echo "fuzz: FAILED:$failed (crash inputs under build/fuzz/<target>/; add each to test/fuzz/regressions/<target>/ once fixed)"
  exit 1
fi
echo "fuzz: no crash in $# targets (summary in $summary)"

#!/bin/sh
# Runs the stages of a check and says where the time went and what failed.
#
#   scripts/stage.sh begin  LOG            a new record (LOG.times, LOG.d/)
#   scripts/stage.sh run    LOG NAME CMD…  runs CMD as stage NAME: its output
#                                          goes to the terminal and to
#                                          LOG.d/NAME.log, its wall time and
#                                          status to LOG.times
#   scripts/stage.sh report LOG [TITLE]    the table of stage times
#
# A stage that fails ends the check: `run` prints the table so far, the
# failing tests its log names (GoogleTest's "[  FAILED  ]" lines, pytest's
# "FAILED"/"ERROR" lines, a sanitizer's or valgrind's summary line) and the
# log's path, last, where a reader of a long CI log looks first; then it
# exits with the stage's status.
set -u
cmd=$1; log=$2; shift 2

now() { date +%s.%N; }

report() {
  title=${1:-stages}
  [ -f "$log.times" ] || return 0
  echo "---- $title: wall time by stage ----"
  awk -F'\t' '{ printf "  %-22s %8.1f s  %s\n", $1, $2, ($3 == 0 ? "ok" : "FAILED (exit " $3 ")"); t += $2 }
              END { printf "  %-22s %8.1f s  (%.1f min)\n", "total", t, t / 60 }' "$log.times"
}

case $cmd in
begin)
  rm -rf "$log.d" "$log.times"
  mkdir -p "$log.d"
  : > "$log.times"
  ;;
run)
  name=$1; shift
  mkdir -p "$log.d"
  echo "==== stage $name: $* ===="
  t0=$(now)
  # The stage's status, not tee's: the status travels through a file.
  rcf="$log.d/$name.rc"
  { "$@"; echo $? > "$rcf"; } 2>&1 | tee "$log.d/$name.log"
  rc=$(cat "$rcf" 2>/dev/null || echo 1)
  t1=$(now)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\n' "$name" "$secs" "$rc" >> "$log.times"
  echo "==== stage $name: ${secs} s, $( [ "$rc" = 0 ] && echo ok || echo "FAILED (exit $rc)") ===="
  if [ "$rc" != 0 ]; then
    report "$(basename "$log")"
    echo "---- FAILED: stage $name (exit $rc); its whole output: $log.d/$name.log ----"
    named=$(grep -a -E '^\[  FAILED  \] [A-Za-z_]|^(FAILED|ERROR) [^ ]|^SUMMARY: [A-Za-z]+Sanitizer|ERROR SUMMARY: [1-9]|definitely lost: [1-9]|^ThreadSanitizer|^==[0-9]+==ERROR|^fuzz: FAILED|^abi-check: FAILED|^[a-z-]+: FAILED|broken rule|^cycle: |\*\*\* \[' \
      "$log.d/$name.log" | sort -u | tail -n 60)
    # nothing named: the end of the stage's output says what happened
    if [ -n "$named" ]; then echo "$named"; else tail -n 25 "$log.d/$name.log"; fi
    exit "$rc"
  fi
  ;;
report)
  report "${1:-$(basename "$log")}"
  ;;
*)
  echo "stage.sh: unknown command $cmd (begin, run, report)" >&2
  exit 2
  ;;
esac

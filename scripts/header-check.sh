#!/bin/sh
# Header hygiene: every public header compiles on its own, as C99 and as
# C++11, pedantic and warning-free (experimental.h also with its section
# turned on); public headers include only <stddef.h>, <stdint.h> and each
# other; the shared library exports only bico_* symbols, the experimental
# section's in the version node BICO_EXPERIMENTAL and every other in a
# BICO_<major>.<minor> node.
# Usage: scripts/header-check.sh SHLIB [CC] [CXX]
set -eu
shlib=$1
cc=${2:-cc}
cxx=${3:-c++}
out=build/header-check
mkdir -p "$out"
fail=0
cflags="-std=c99 -pedantic -Werror -Wall -Wextra -fsyntax-only -Iinclude"
cxxflags="-std=c++11 -pedantic -Werror -Wall -Wextra -fsyntax-only -Iinclude"
n=0
for h in include/bico/*.h; do
  b=$(basename "$h" .h)
  # Alone, then twice (the include guard works).
  printf '#include <bico/%s.h>\n' "$b" > "$out/$b.c"
  printf '#include <bico/%s.h>\n#include <bico/%s.h>\n' \
    "$b" "$b" > "$out/${b}_twice.c"
  for src in "$out/$b.c" "$out/${b}_twice.c"; do
    $cc $cflags -x c "$src" || { echo "header-check: $h fails as C99 ($src)"; fail=1; }
    $cxx $cxxflags -x c++ "$src" || { echo "header-check: $h fails as C++11 ($src)"; fail=1; }
    # The experimental section, turned on (it is empty otherwise).
    if [ "$b" = experimental ] || [ "$b" = bico ]; then
      $cc $cflags -DBICO_EXPERIMENTAL -x c "$src" || { echo "header-check: $h fails as C99 with BICO_EXPERIMENTAL ($src)"; fail=1; }
      $cxx $cxxflags -DBICO_EXPERIMENTAL -x c++ "$src" || { echo "header-check: $h fails as C++11 with BICO_EXPERIMENTAL ($src)"; fail=1; }
    fi
  done
  # Only the two standard headers and sibling headers may be included, so
  # that FFI generators and C++ users see nothing else.
  bad=$(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*//p' "$h" |
        grep -v -e '^<stddef\.h>' -e '^<stdint\.h>' -e '^"[a-z_0-9]*\.h"' || true)
  if [ -n "$bad" ]; then
    echo "header-check: $h includes $bad (only <stddef.h>, <stdint.h>, sibling headers)"
    fail=1
  fi
  # A C++ translation unit must see the declarations with C linkage.
  if grep -q 'BICO_API' "$h" && ! grep -q 'extern "C"' "$h"; then
    echo "header-check: $h declares functions without an extern \"C\" block"
    fail=1
  fi
  n=$((n + 1))
done
# The compile-checks kept in test/headers/ (they use the declarations).
for src in test/headers/*.c; do
  [ -e "$src" ] || continue
  $cc $cflags -x c "$src" || { echo "header-check: $src fails as C99"; fail=1; }
  $cxx $cxxflags -x c++ "$src" || { echo "header-check: $src fails as C++11"; fail=1; }
  # ... and as a C programmer compiles it: the compiler's default dialect
  # and warnings, made errors (GCC 14 refuses incompatible pointer types).
  $cc -Werror -fsyntax-only -Iinclude -x c "$src" ||
    { echo "header-check: $src fails with $cc's default flags and -Werror"; fail=1; }
done
# Exports: only bico_* (the version script's node names are not symbols).
extra=$(nm -D --defined-only "$shlib" | awk '{print $3}' | grep -v '^bico_' |
        grep -v -e '^BICO_[0-9.]*$' -e '^BICO_EXPERIMENTAL$' || true)
if [ -n "$extra" ]; then
  echo "header-check: $shlib exports non-bico symbols:"; echo "$extra"; fail=1
fi
# Every exported symbol is declared in a public header.
for s in $(nm -D --defined-only "$shlib" | awk '{print $3}' | grep '^bico_'); do
  s=${s%%@*}
  grep -qw "$s" include/bico/*.h || { echo "header-check: $s is exported but declared in no public header"; fail=1; }
done
# Every function a public header declares is exported: a declaration
# missing from lib/libbico.vers would link in no program.
for s in $(sed -n 's/.*BICO_API[^;(]*[^a-z_]\(bico_[a-z0-9_]*\) *(.*/\1/p' include/bico/*.h); do
  nm -D --defined-only "$shlib" | awk '{print $3}' | grep -q "^$s@" ||
    { echo "header-check: $s is declared but not exported (add it to lib/libbico.vers)"; fail=1; }
done
# Version nodes: the experimental header's functions, and only they, are in
# BICO_EXPERIMENTAL (no ABI promise); all others in a release node.
experimental=$(sed -n 's/.*BICO_API[^;(]*[^a-z_]\(bico_[a-z0-9_]*\) *(.*/\1/p' include/bico/experimental.h)
for v in $(nm -D --defined-only "$shlib" | awk '{print $3}' | grep '^bico_'); do
  s=${v%%@*}
  node=${v##*@}
  if printf '%s\n' $experimental | grep -qx "$s"; then
    [ "$node" = BICO_EXPERIMENTAL ] ||
      { echo "header-check: $s is declared in experimental.h but in node $node (lib/libbico.vers: BICO_EXPERIMENTAL)"; fail=1; }
  else
    case $node in
      BICO_[0-9]*.[0-9]*) ;;
      *) echo "header-check: $s is in node $node; only experimental.h's functions may leave the release nodes"; fail=1 ;;
    esac
  fi
done
[ $fail = 0 ] || exit 1
echo "header-check: $n public headers compile alone as C99 and C++11 (-pedantic -Werror); exports are bico_* only"

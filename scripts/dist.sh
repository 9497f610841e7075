#!/bin/sh
# make dist: libbico-VERSION.tar.gz, the source release.
#
#   sh scripts/dist.sh VERSION [OUTDIR]
#
# The files are those git tracks (in a git checkout) or, in an unpacked
# release, those its MANIFEST lists: a release can make the same release
# again.  The archive is reproducible (sorted names, one owner, every
# mtime the last commit's or SOURCE_DATE_EPOCH), written to a temporary
# name and renamed into place when complete: an interrupted run leaves no
# half archive under the final name.
set -eu
ver=${1:?usage: dist.sh VERSION [OUTDIR]}
out=${2:-.}
name=libbico-$ver
tmp=$(mktemp -d "${TMPDIR:-/tmp}/bico-dist.XXXXXX")
part="$out/.$name.tar.gz.tmp"
trap 'rm -rf "$tmp" "$part"' EXIT
trap 'exit 130' INT TERM

# git's list only when this folder is a checkout's top (an unpacked
# release inside another checkout, as distcheck's, is not one)
if [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$(pwd -P)" ]; then
  git ls-files > "$tmp/list"
  : "${SOURCE_DATE_EPOCH:=$(git log -1 --format=%ct)}"
elif [ -f MANIFEST ]; then
  cp MANIFEST "$tmp/list"
  : "${SOURCE_DATE_EPOCH:=$(stat -c %Y MANIFEST)}"
else
  echo "dist: not a git checkout and no MANIFEST: which files make the release?" >&2
  exit 1
fi
grep -vx MANIFEST "$tmp/list" > "$tmp/files" || true
missing=$(while IFS= read -r f; do [ -e "$f" ] || echo "$f"; done < "$tmp/files")
if [ -n "$missing" ]; then
  echo "dist: listed but missing (commit or restore them):" >&2
  echo "$missing" | sed 's/^/  /' >&2
  exit 1
fi
{ cat "$tmp/files"; echo MANIFEST; } | LC_ALL=C sort > "$tmp/MANIFEST"
mkdir -p "$tmp/$name"
tar -cf - -T "$tmp/files" | tar -xf - -C "$tmp/$name"
cp "$tmp/MANIFEST" "$tmp/$name/MANIFEST"
mkdir -p "$out"
tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 \
    --numeric-owner --format=gnu -C "$tmp" -cf - "$name" |
  gzip -n -9 > "$part"
mv "$part" "$out/$name.tar.gz"
echo "dist: $out/$name.tar.gz ($(wc -l < "$tmp/MANIFEST") files)"

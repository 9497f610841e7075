#!/usr/bin/python3
"""Writes test/headers/frozen_values.c: one compile-time assertion per
enumerator of the public headers, pinning its value.  Run at a release
(with `make abi-baseline`); afterwards `make header-check` fails if a value
changes.  Lines for enumerators that exist in the file are kept as they
are, so a renumbering is caught rather than silently re-frozen; new ones
are appended.  Usage: scripts/gen-frozen-values.py
"""
import glob
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "test", "headers", "frozen_values.c")
HEAD = """/* Compile-time check (C99 and C++11, run by `make header-check`) that the
 * public enumerators keep their released values.  abidiff only sees the
 * enums that appear in function signatures; most options travel as int, so
 * their values are pinned here.  Written by scripts/gen-frozen-values.py:
 * new enumerators are appended; an existing line never changes. */
#include <bico/bico.h>

#define FROZEN(name, value) \\
  typedef char frozen_##name[((int)(name) == (value)) ? 1 : -1]

/* The version macros agree with each other. */
typedef char frozen_version_number[
    (BICO_VERSION_NUMBER == BICO_VERSION_MAJOR * 10000 +
                                BICO_VERSION_MINOR * 100 +
                                BICO_VERSION_PATCH) ? 1 : -1];

"""

enum_re = re.compile(r"typedef\s+enum\s+\w*\s*\{(.*?)\}", re.S)
item_re = re.compile(r"\b(BICO_[A-Z0-9_]+)\s*=\s*(-?\d+)")

kept = []
if os.path.exists(OUT):
    kept = re.findall(r"^FROZEN\((BICO_[A-Z0-9_]+), (-?\d+)\);$",
                      open(OUT).read(), re.M)
have = {name for name, _ in kept}
new = []
for h in sorted(glob.glob(os.path.join(ROOT, "include", "bico", "*.h"))):
    text = re.sub(r"/\*.*?\*/", "", open(h).read(), flags=re.S)
    for body in enum_re.findall(text):
        for name, value in item_re.findall(body):
            if name not in have:
                new.append((name, value))
                have.add(name)
with open(OUT, "w") as f:
    f.write(HEAD)
    for name, value in kept + new:
        f.write("FROZEN(%s, %s);\n" % (name, value))
print("frozen_values.c: %d kept, %d added" % (len(kept), len(new)))

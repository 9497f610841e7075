#!/usr/bin/env python3
"""check-layers: the library's house, checked from its object files.

    python3 scripts/check-layers.py OBJDIR [COMMAND]

OBJDIR is the build's lib object tree (build/obj/lib), one sub-folder per
folder of lib/.  A file *calls* another when one of its undefined symbols
(`nm`) is defined there: these are the real links, not guesses from the
text.  The rules, from lib/README.md's layer table:

  1. no cycle among lib/ files;
  2. a file calls only files of its own folder or of a folder of a lower
     layer (folders of one layer do not call each other);
  3. nothing of lib/ calls up into the command: no undefined symbol of a
     lib object is defined by COMMAND (the `bico` executable) alone, and
     no lib source includes a header of tools/.

Prints every broken rule with the names that tie the files; exit status 1
if any, 0 otherwise.  Standard library and binutils' nm only.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def nm(path, defined):
    args = ["nm", "--defined-only" if defined else "--undefined-only", path]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    names = set()
    for line in out.splitlines():
        f = line.split()
        if defined:
            # value type name; code, data and read-only data, global only
            if len(f) == 3 and f[1] in "TDBRVWG":
                names.add(f[2])
        elif f and f[0] == "U":
            names.add(f[1])
    return names


def layers():
    """{folder: layer} from lib/README.md's table rows `| N | folder/ | ...`."""
    table = {}
    with open(os.path.join(ROOT, "lib", "README.md"), encoding="utf-8") as fh:
        for line in fh:
            m = re.match(r"\|\s*(\d+)\s*\|\s*`?([a-z_]+)/`?\s*\|", line)
            if m:
                table[m.group(2)] = int(m.group(1))
    if not table:
        sys.exit("check-layers: lib/README.md has no layer table")
    return table


def cycles(graph):
    """Strongly connected components of more than one file (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv):
    if len(argv) not in (2, 3):
        sys.exit(__doc__.strip().splitlines()[2].strip())
    objdir = argv[1]
    table = layers()
    defs, undef = {}, {}
    for folder in sorted(os.listdir(objdir)):
        sub = os.path.join(objdir, folder)
        if not os.path.isdir(sub):
            continue
        for name in sorted(os.listdir(sub)):
            # only objects of today's sources: a stale object of a removed
            # file would draw arrows that no longer exist
            if name.endswith(".o") and os.path.isfile(
                    os.path.join(ROOT, "lib", folder, name[:-2] + ".c")):
                key = folder + "/" + name[:-2]
                defs[key] = nm(os.path.join(sub, name), True)
                undef[key] = nm(os.path.join(sub, name), False)
    if not defs:
        sys.exit("check-layers: no object files under %s (build first)" % objdir)
    owner = {}
    for f, names in defs.items():
        for s in names:
            owner.setdefault(s, f)
    graph = {f: set() for f in defs}
    ties = {}
    for f, names in undef.items():
        for s in names:
            g = owner.get(s)
            if g and g != f:
                graph[f].add(g)
                ties.setdefault((f, g), set()).add(s)

    def tie(f, g):
        names = sorted(ties[(f, g)])
        more = " and %d more" % (len(names) - 4) if len(names) > 4 else ""
        return ", ".join(names[:4]) + more

    bad = 0
    for f in sorted(defs):
        folder = f.split("/")[0]
        if folder not in table:
            print("check-layers: lib/%s/ is not in lib/README.md's layer table" % folder)
            bad += 1
    for comp in cycles(graph):
        bad += 1
        print("cycle: " + " <-> ".join("lib/%s.c" % c for c in comp))
        for f in comp:
            for g in sorted(graph[f] & set(comp)):
                print("  lib/%s.c -> lib/%s.c: %s" % (f, g, tie(f, g)))
    for f in sorted(graph):
        a = f.split("/")[0]
        for g in sorted(graph[f]):
            b = g.split("/")[0]
            if a == b or a not in table or b not in table:
                continue
            if table[b] >= table[a]:
                bad += 1
                how = "up" if table[b] > table[a] else "sideways"
                print("%s: lib/%s.c (layer %d) -> lib/%s.c (layer %d): %s"
                      % (how, f, table[a], g, table[b], tie(f, g)))
    if len(argv) == 3:
        command = nm(argv[2], True)
        lib_defined = set(owner)
        for f in sorted(undef):
            up = sorted((undef[f] & command) - lib_defined)
            if up:
                bad += 1
                print("into the command: lib/%s.c uses %s" % (f, ", ".join(up)))
    tool_headers = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "tools")):
        tool_headers.update(n for n in files if n.endswith(".h"))
    lib_headers = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "lib")):
        lib_headers.update(n for n in files if n.endswith(".h"))
    for dirpath, _, files in os.walk(os.path.join(ROOT, "lib")):
        for n in sorted(files):
            if not n.endswith((".c", ".h")):
                continue
            path = os.path.join(dirpath, n)
            with open(path, encoding="utf-8") as fh:
                for i, line in enumerate(fh, 1):
                    m = re.match(r'\s*#\s*include\s*"([^"]+)"', line)
                    if m and os.path.basename(m.group(1)) in tool_headers - lib_headers:
                        bad += 1
                        print("into the command: %s:%d includes %s"
                              % (os.path.relpath(path, ROOT), i, m.group(1)))
    files = len(defs)
    arrows = sum(len(v) for v in graph.values())
    if bad:
        print("check-layers: %d broken rule(s) among %d files, %d arrows" % (bad, files, arrows))
        return 1
    print("check-layers: %d files in %d folders, %d arrows, no cycle, none up"
          % (files, len({f.split('/')[0] for f in defs}), arrows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

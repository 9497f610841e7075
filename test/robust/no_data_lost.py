#!/usr/bin/python3
"""Nothing on disk is lost: `bico transfer` interrupted or refused leaves the
previous output byte-identical and no half-written file under its name.

  1. SIGKILL at random moments of a run (reading, computing, writing,
     fsync, rename): afterwards the output is byte-identical either to the
     previous file or to the complete new result, never anything else; a
     leftover temporary file is named ".<output>.bico-tmp.<pid>.XXXXXX"
     and the next run removes it.  SIGTERM and SIGINT leave no temporary
     file at all.
  2. A file-size limit (RLIMIT_FSIZE, `ulimit -f`) below the output's size:
     the run fails with a message, the previous output is intact and no
     temporary file remains.
  3. A read-only output folder: the run fails with a message naming the
     output, nothing in the folder changes.
  4. Inputs are opened read-only: a run by an unprivileged user whose
     inputs are mode 0444 (someone else's) succeeds.
  5. Model folders: SIGKILL at random moments, and at the moment the
     output folder's listing first changes, of runs writing a folder of
     hundreds of shards (--max-shard-size) over an existing folder that
     holds an older model (one model.safetensors and an index naming
     user files) and the user's own files (a sub-folder, a dot file):
     afterwards the folder holds exactly the old files or exactly the new
     ones, byte for byte, the user's files intact; the only leftovers are
     ".out.bico-tmp.<pid>.*" siblings and the folder's lock file
     ".out.bico-lock" (held by no one once its run is dead), which the
     next run removes.  A
     folder the run creates is absent or complete.  SIGTERM leaves no
     temporary folder at all.
When run as root (permissions do not bind root), 3 and 4 run the command
as the user nobody, from a copy of the command and its library in the
test's own folder: the checkout may lie where nobody cannot enter (/root,
a 0700 home).  If nobody still cannot run it, 3 and 4 are skipped with a
message.  Usage: no_data_lost.py BICO_BINARY [KILLS]
The models are written here with numpy, not with libbico.
"""
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

BICO = os.path.abspath(sys.argv[1])
KILLS = int(sys.argv[2]) if len(sys.argv) > 2 else 12
NOBODY = 65534
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def write_st(path, tensors):
    """A safetensors file from {name: float32 array} (the format's spec)."""
    header, off, blobs = {}, 0, []
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def listing(d):
    return sorted(os.listdir(d))


def as_nobody():
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def reachable_copy(root):
    """The command and its library copied under root (mode 0755), where
    the user nobody can run them (the binary finds the library through
    its $ORIGIN/../lib run path); None if nobody still cannot run it."""
    tool = os.path.join(root, "tool")
    for sub in ("bin", "lib"):
        os.makedirs(os.path.join(tool, sub), mode=0o755, exist_ok=True)
    binary = os.path.join(tool, "bin", "bico")
    shutil.copy2(BICO, binary)
    libdir = os.path.join(os.path.dirname(os.path.dirname(BICO)), "lib")
    for name in os.listdir(libdir):
        if name.startswith("libbico.so"):
            shutil.copyfile(os.path.join(libdir, name),
                            os.path.join(tool, "lib", name))
    for dirpath, dirnames, filenames in os.walk(tool):
        for n in dirnames + filenames:
            os.chmod(os.path.join(dirpath, n), 0o755)
    p = subprocess.run([binary, "--version"], preexec_fn=as_nobody,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if p.returncode != 0:
        print("skip read-only folder and read-only inputs as nobody: the "
              "copied command does not run as uid %d (%s)" %
              (NOBODY, p.stderr.decode().strip()[:200]))
        return None
    return binary


def run(args, alpha, out, preexec=None, binary=None, **kw):
    cmd = [binary or BICO, "transfer", "--method", "naive", "--quiet",
           "--source-base", args["A"], "--task-vector", args["tau"],
           "--target-base", args["B"], "--alpha", str(alpha), "--output", out]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=preexec, **kw)


def snapshot(d):
    """Every entry under d: relative path -> content digest (files), link
    target (links) or "dir"; None when d is absent."""
    if not os.path.isdir(d):
        return None
    snap = {}
    for dirpath, dirnames, filenames in os.walk(d):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, d)
            if os.path.islink(p):
                snap[rel] = "-> " + os.readlink(p)
            elif os.path.isdir(p):
                snap[rel] = "dir %o" % stat.S_IMODE(os.stat(p).st_mode)
            else:
                snap[rel] = sha(p)
    return snap


def run_folder(tgt, src, alpha, out):
    cmd = [BICO, "transfer", "--method", "naive", "--quiet",
           "--source-base", src["A"], "--task-vector", src["tau"],
           "--target-base", tgt, "--alpha", str(alpha), "--output", out,
           "--max-shard-size", "40KB"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def kill_when_changed(p, watch, before, sig, extra):
    """Sends sig extra seconds after the visible listing of watch (names
    not starting with '.') first differs from before (unless the run ended
    first): a commit that renames file by file is caught in the middle.
    Returns when the process ended."""
    before = [n for n in before if not n.startswith(".")]
    while p.poll() is None:
        try:
            now = [n for n in sorted(os.listdir(watch)) if not n.startswith(".")]
        except OSError:
            now = None
        if now != before:
            if extra > 0:
                time.sleep(extra)
            break
    if p.poll() is None:
        p.send_signal(sig)
    p.communicate()


def folder_commits(root, rnd):
    """5. Model folders under SIGKILL and SIGTERM (see the docstring)."""
    inputs = os.path.join(root, "fin")
    os.mkdir(inputs)
    rng = np.random.default_rng(5)
    # 320 tensors of 32 KiB: with --max-shard-size 40KB one shard each.
    names = ["layers.%d.mlp.weight" % i for i in range(320)]
    src = {}
    for key in ("A", "tau", "B"):
        src[key] = os.path.join(inputs, key + ".safetensors")
        write_st(src[key], {n: rng.standard_normal((32, 256), dtype=np.float32)
                            for n in names})
    tgt = os.path.join(inputs, "tgt")
    os.mkdir(tgt)
    os.rename(src.pop("B"), os.path.join(tgt, "model.safetensors"))
    with open(os.path.join(tgt, "config.json"), "w") as f:
        f.write('{"model_type": "mlp", "new": true}')
    parent = os.path.join(root, "fparent")
    os.mkdir(parent)
    out = os.path.join(parent, "out")
    # The old folder: an older model in one file, an index naming the
    # user's files, the user's own files.
    old = os.path.join(root, "fold_old")
    os.mkdir(old)
    write_st(os.path.join(old, "model.safetensors"),
             {n: np.zeros((32, 256), np.float32) for n in names[:4]})
    with open(os.path.join(old, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"x": "notes.txt", "y": "config.json"}}, f)
    with open(os.path.join(old, "config.json"), "w") as f:
        f.write('{"old": true}')
    with open(os.path.join(old, "notes.txt"), "w") as f:
        f.write("the user's notes")
    with open(os.path.join(old, ".hidden"), "w") as f:
        f.write("dot file")
    os.makedirs(os.path.join(old, "eval", "runs"))
    with open(os.path.join(old, "eval", "runs", "r1.json"), "w") as f:
        f.write("{}")

    def reset():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(old, out, symlinks=True)

    old_snap = snapshot(old)
    reset()
    t0 = time.monotonic()
    p = run_folder(tgt, src, 0.5, out)
    _, err = p.communicate()
    full = time.monotonic() - t0
    check(p.returncode == 0, "folder run over an existing folder succeeds "
          "(%.2fs) %s" % (full, err.decode()[-300:]))
    new_snap = snapshot(out)
    shards = [n for n in new_snap if n.startswith("model-")]
    check(len(shards) >= 300, "the new folder has %d shards" % len(shards))
    user = ["notes.txt", ".hidden", "eval/runs/r1.json"]
    check(all(new_snap.get(n) == old_snap[n] for n in user) and
          "model.safetensors" not in new_snap and
          new_snap.get("config.json") == sha(os.path.join(tgt, "config.json")),
          "the new folder: the user's files kept, the old weights gone, the "
          "target's config")
    outcomes = {"old": 0, "new": 0}
    for k in range(KILLS):
        reset()
        before = listing(out)
        p = run_folder(tgt, src, 0.5, out)
        if k % 2 == 0:
            time.sleep(rnd.uniform(0.0, full * 1.1))
            p.send_signal(signal.SIGKILL)
            p.communicate()
            how = "at random"
        else:
            kill_when_changed(p, out, before, signal.SIGKILL,
                              rnd.choice([0, 0, 0.001, 0.005]))
            how = "when the folder changed"
        now = snapshot(out)
        state = "old" if now == old_snap else "new" if now == new_snap else None
        if state is None and now is not None:
            diff = sorted(n for n in set(now) ^ set(old_snap)
                          if not n.startswith("."))
            print("     %d visible names differ from the old folder, %d from "
                  "the new one, e.g. %s" % (
                      len(diff), len([n for n in set(now) ^ set(new_snap)
                                      if not n.startswith(".")]), diff[:3]))
        check(state is not None,
              "kill %d %s: the folder is exactly the old or the new one" % (k, how))
        if state:
            outcomes[state] += 1
        left = [n for n in listing(parent) if n != "out"]
        check(all(n.startswith(".out.bico-tmp.") or n == ".out.bico-lock"
                  for n in left),
              "kill %d: leftovers are recognisable temporaries %s" % (k, left[:4]))
    print("folder kills: %d, old kept %d, new complete %d" %
          (KILLS, outcomes["old"], outcomes["new"]))
    p = run_folder(tgt, src, 0.5, out)
    p.communicate()
    check(p.returncode == 0 and snapshot(out) == new_snap and
          listing(parent) == ["out"],
          "a folder run after the kills is complete and removes their "
          "leftovers %s" % listing(parent)[:4])
    # A folder the run creates: absent or complete.
    fresh = os.path.join(parent, "fresh")
    fresh_snap = {n: v for n, v in new_snap.items()
                  if n not in user and n not in ("eval", "eval/runs")}
    for k in range(max(4, KILLS // 2)):
        shutil.rmtree(fresh, ignore_errors=True)
        p = run_folder(tgt, src, 0.5, fresh)
        if k % 2 == 0:
            time.sleep(rnd.uniform(0.0, full * 1.1))
            p.send_signal(signal.SIGKILL)
            p.communicate()
        else:
            kill_when_changed(p, parent, listing(parent), signal.SIGKILL,
                              rnd.uniform(0.0, full))
        now = snapshot(fresh)
        check(now is None or now == fresh_snap,
              "kill %d of a run creating its folder: absent or complete "
              "(%s entries)" % (k, None if now is None else len(now)))
    p = run_folder(tgt, src, 0.5, fresh)
    p.communicate()
    check(p.returncode == 0 and snapshot(fresh) == fresh_snap and
          listing(parent) == ["fresh", "out"],
          "a run creating the folder after the kills is complete and removes "
          "their leftovers %s" % listing(parent)[:4])
    shutil.rmtree(fresh, ignore_errors=True)
    # SIGTERM: the folder old or new, no temporary folder left.
    for k in range(max(4, KILLS // 2)):
        reset()
        before = listing(out)
        p = run_folder(tgt, src, 0.5, out)
        if k % 2 == 0:
            time.sleep(rnd.uniform(0.0, full * 1.1))
            p.send_signal(signal.SIGTERM)
            p.communicate()
        else:
            kill_when_changed(p, out, before, signal.SIGTERM, 0)
        now = snapshot(out)
        check(now in (old_snap, new_snap) and listing(parent) == ["out"],
              "SIGTERM %d: the folder old or new, no temporary left %s" %
              (k, listing(parent)[:4]))


def main():
    root = tempfile.mkdtemp(prefix="bico-robust-")
    try:
        os.chmod(root, 0o755)
        inputs = os.path.join(root, "in")
        os.mkdir(inputs)
        rng = np.random.default_rng(7)
        # 8 tensors of 512 x 1024 floats: a 16 MiB output, so that a run
        # spends measurable time in each phase.
        names = ["blocks.%d.fc.weight" % i for i in range(8)]
        shapes = {n: (512, 1024) for n in names}
        files = {}
        for key in ("A", "tau", "B"):
            files[key] = os.path.join(inputs, key + ".safetensors")
            write_st(files[key], {n: rng.standard_normal(shapes[n], dtype=np.float32)
                                  for n in names})
            os.chmod(files[key], 0o444)
        os.chmod(inputs, 0o555)
        input_sha = {key: sha(path) for key, path in files.items()}

        outdir = os.path.join(root, "out")
        os.mkdir(outdir)
        out = os.path.join(outdir, "B_ft.safetensors")
        # The previous output (alpha 1) and the new one (alpha 0.5), from
        # complete runs.
        newfile = os.path.join(root, "new.safetensors")
        t0 = time.monotonic()
        p = run(files, 0.5, newfile)
        _, err = p.communicate()
        full = time.monotonic() - t0
        check(p.returncode == 0, "complete run succeeds (%.2fs)" % full)
        if p.returncode != 0:
            print(err.decode())
            return
        p = run(files, 1.0, out)
        p.communicate()
        check(p.returncode == 0, "previous output written")
        old_sha, new_sha = sha(out), sha(newfile)
        saved = os.path.join(root, "old.safetensors")
        shutil.copyfile(out, saved)

        # 1. SIGKILL at random moments.
        rnd = random.Random(int(os.environ.get("BICO_ROBUST_SEED", "1")))
        outcomes = {"old": 0, "new": 0}
        leftovers = 0
        for k in range(KILLS):
            shutil.copyfile(saved, out)
            for name in listing(outdir):
                if name != os.path.basename(out):
                    os.unlink(os.path.join(outdir, name))
            delay = rnd.uniform(0.0, full * 1.1)
            p = run(files, 0.5, out)
            time.sleep(delay)
            p.send_signal(signal.SIGKILL)
            p.communicate()
            h = sha(out)
            state = "old" if h == old_sha else "new" if h == new_sha else None
            check(state is not None,
                  "kill %d at %.3fs: output is the previous or the complete new file" % (k, delay))
            if state:
                outcomes[state] += 1
            others = [n for n in listing(outdir) if n != os.path.basename(out)]
            check(all(n.startswith(".B_ft.safetensors.bico-tmp.") for n in others),
                  "kill %d: leftovers are recognisable temporaries %s" % (k, others))
            leftovers += len(others)
        print("kills: %d, previous output kept %d times, new output complete %d "
              "times, %d recognisable temporaries left" %
              (KILLS, outcomes["old"], outcomes["new"], leftovers))
        check(outcomes["old"] > 0, "some kills landed before the rename")
        # The next run works and gives the right answer despite leftovers.
        p = run(files, 0.5, out)
        p.communicate()
        check(p.returncode == 0 and sha(out) == new_sha,
              "a run after the kills writes the complete new output")
        # ... and removes the temporaries the killed processes left.
        check(leftovers == 0 or listing(outdir) == [os.path.basename(out)],
              "a run after the kills removes their stale temporaries %s" %
              listing(outdir))
        for name in listing(outdir):
            if name != os.path.basename(out):
                os.unlink(os.path.join(outdir, name))

        # 1b. SIGTERM and SIGINT at random moments: the command removes its
        # temporaries before it dies; the output is old or new.
        for k, sig in enumerate([signal.SIGTERM, signal.SIGINT] * (KILLS // 4 + 1)):
            shutil.copyfile(saved, out)
            delay = rnd.uniform(0.0, full * 1.1)
            p = run(files, 0.5, out)
            time.sleep(delay)
            p.send_signal(sig)
            p.communicate()
            h = sha(out)
            check(h in (old_sha, new_sha) and
                  listing(outdir) == [os.path.basename(out)],
                  "%s %d at %.3fs: output old or new, no temporary left %s" %
                  (signal.Signals(sig).name, k, delay, listing(outdir)))

        # 1b'. The same into an output folder the run creates: after the
        # signal the folder is gone (or complete, when the run won the
        # race), never left empty or holding temporaries.
        newdir = os.path.join(root, "newfolder")
        p = run(files, 0.5, newdir + "/")
        p.communicate()
        folder_sha = sha(os.path.join(newdir, "model.safetensors"))
        shutil.rmtree(newdir, ignore_errors=True)
        for k, sig in enumerate([signal.SIGTERM, signal.SIGINT] * (KILLS // 8 + 1)):
            delay = rnd.uniform(0.0, full * 1.1)
            p = run(files, 0.5, newdir + "/")
            time.sleep(delay)
            p.send_signal(sig)
            p.communicate()
            left = sorted(os.listdir(newdir)) if os.path.isdir(newdir) else None
            # complete: the new result's bytes, whatever the exit status (a
            # signal that lands after the one-step commit, while the
            # command exits, kills a run whose output is already in place)
            check(left is None or (left == ["model.safetensors"] and
                                   sha(os.path.join(newdir, "model.safetensors"))
                                   == folder_sha),
                  "%s %d at %.3fs into a new folder: gone or complete, found %s "
                  "(exit %d)" % (signal.Signals(sig).name, k, delay, left, p.returncode))
            shutil.rmtree(newdir, ignore_errors=True)

        # 1c. --alpha beyond float range is a usage error (exit 2), not a
        # run that writes +Inf or fails late.
        p = run(files, "1e39", os.path.join(root, "inf.safetensors"))
        _, err = p.communicate()
        check(p.returncode == 2 and b"--alpha" in err and
              not os.path.exists(os.path.join(root, "inf.safetensors")),
              "--alpha 1e39: usage error (exit %d) %r" % (p.returncode, err[:120]))

        # 2. A file-size limit below the output's size.
        shutil.copyfile(saved, out)
        limit = os.path.getsize(saved) // 2

        def fsize_limit():
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        p = run(files, 0.5, out, preexec=fsize_limit)
        _, err = p.communicate()
        err = err.decode()
        check(p.returncode not in (0, -signal.SIGXFSZ),
              "file-size limit: the run fails with an error, not a signal "
              "(exit %d)" % p.returncode)
        check(err.strip() != "", "file-size limit: message %r" % err.strip()[:200])
        check(sha(out) == old_sha, "file-size limit: previous output byte-identical")
        check(listing(outdir) == [os.path.basename(out)],
              "file-size limit: no temporary left %s" % listing(outdir))

        # 3. A read-only output folder (as nobody when root).
        root_user = os.getuid() == 0
        pre = as_nobody if root_user else None
        binary = reachable_copy(root) if root_user else BICO
        if binary is not None:
            os.chmod(outdir, 0o555)
            before = listing(outdir)
            p = run(files, 0.5, out, preexec=pre, binary=binary)
            _, err = p.communicate()
            err = err.decode()
            check(p.returncode != 0, "read-only folder: the run fails (exit %d)" % p.returncode)
            check(os.path.basename(out) in err or outdir in err,
                  "read-only folder: message names the output: %r" % err.strip()[:200])
            check(sha(out) == old_sha and listing(outdir) == before,
                  "read-only folder: nothing changed")

            # 4. Inputs opened read-only: someone else's 0444 files suffice.
            writable = os.path.join(root, "w")
            os.mkdir(writable)
            os.chmod(writable, 0o777)
            p = run(files, 0.5, os.path.join(writable, "o.safetensors"), preexec=pre,
                    binary=binary)
            _, err = p.communicate()
            check(p.returncode == 0 and sha(os.path.join(writable, "o.safetensors")) == new_sha,
                  "read-only inputs (mode 0444%s): the run succeeds %s" %
                  (", user nobody" if root_user else "", err.decode().strip()[:200]))
        # 5. Model folders.
        folder_commits(root, rnd)
        for key in files:
            check(stat.S_IMODE(os.stat(files[key]).st_mode) == 0o444 and
                  sha(files[key]) == input_sha[key],
                  "input %s untouched after every run" % key)
    finally:
        for dirpath, dirnames, _ in os.walk(root):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o755)
        shutil.rmtree(root, ignore_errors=True)
    if failures:
        print("no_data_lost: %d FAILED" % len(failures))
        sys.exit(1)
    print("no_data_lost: all checks passed")


if __name__ == "__main__":
    main()

"""The bico command's output folders (issue 32): two runs into one folder,
a process writing into the folder during runs, `--output .`, a dangling
link, messages without the library's function names.  Each test drives
build/bin/bico as a user would and looks at the folder afterwards."""
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
import planted as pl  # noqa: E402

from cli import BICO, bico  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("outfolder")
    rng = np.random.default_rng(32)
    shapes = {"l0.weight": (8, 6), "l0.bias": (8,), "l1.weight": (4, 8)}
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    ft = {k: v + 0.1 for k, v in base.items()}
    pl.save(str(d / "A.safetensors"), base, {"format": "pt"})
    pl.save(str(d / "Aft.safetensors"), ft, {"format": "pt"})
    return d


def run_args(m, out, *extra):
    return ["transfer", "--method", "naive", "--quiet", "--alpha", "1",
            "--source-base", m / "A.safetensors",
            "--source-tuned", m / "Aft.safetensors",
            "--target-base", m / "A.safetensors", *extra, "--output", out]


def user_files(out, n):
    """n files of the user's (half in a sub-folder), each holding its
    name; {relative path: text}."""
    os.makedirs(os.path.join(out, "sub"), exist_ok=True)
    files = {}
    for k in range(n):
        rel = ("sub/" if k % 2 else "") + "u%d.txt" % k
        with open(os.path.join(out, rel), "w") as f:
            f.write(rel)
        files[rel] = rel
    return files


def intact(out, files):
    ok = 0
    for rel, text in files.items():
        try:
            with open(os.path.join(out, rel)) as f:
                ok += f.read() == text
        except OSError:
            pass
    return ok


@pytest.mark.parametrize("wait", [None, "600"])
def test_two_runs_into_one_folder_keep_every_user_file(models, tmp_path, wait):
    """Before: both runs exited 0 and 1360 of 3000 user files were gone.
    Now the second run is refused naming the first (or, with --wait,
    waits for it); every file survives."""
    out = str(tmp_path / "out") + "/"
    files = user_files(out, 3000)
    extra = ["--wait", wait] if wait else []
    procs = [subprocess.Popen([BICO, *map(str, run_args(models, out, *extra))],
                              stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for p in procs:
        p.stderr.close()
    codes = sorted(rc for rc, _ in results)
    assert codes in ([0, 0], [0, 1]), results
    if wait:
        assert codes == [0, 0], results
    for rc, err in results:
        if rc == 1:
            other = [p.pid for p in procs if p.returncode == 0][0]
            assert "--output: the output folder" in err, err
            assert "is being written by another run (pid %d" % other in err
            assert "--wait SECONDS" in err, err
            assert "folder_wait" not in err, err
    assert intact(out, files) == 3000
    assert sorted(os.listdir(str(tmp_path))) == ["out"]


def test_a_process_writing_into_a_sub_folder_loses_nothing(models, tmp_path):
    """Before: a process creating files in the output's sub-folder during
    three runs lost 86 of them.  Now each is in the new folder (or in an
    old tree kept beside it, named by a warning)."""
    out = str(tmp_path / "out")
    user_files(out, 20)
    made, stop = [], threading.Event()

    def maker():
        i = 0
        while (not stop.is_set() or len(made) < 30) and len(made) < 3000:
            name = "f%d" % i
            i += 1
            try:
                fd = os.open(os.path.join(out, "sub", name),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except OSError:
                continue
            os.write(fd, name.encode())
            os.close(fd)
            made.append(name)

    t = threading.Thread(target=maker)
    t.start()
    warnings = ""
    try:
        for _ in range(3):
            warnings += bico(*run_args(models, out + "/")).stderr
    finally:
        stop.set()
        t.join()
    homes = [os.path.join(out, "sub")]
    for n in os.listdir(str(tmp_path)):
        if n != "out":
            assert ".out.bico-kept." in n, n
            assert n in warnings, warnings
            homes.append(os.path.join(str(tmp_path), n, "sub"))
    found = 0
    for name in made:
        for h in homes:
            try:
                with open(os.path.join(h, name)) as f:
                    if f.read() == name:
                        found += 1
                        break
            except OSError:
                pass
    assert found == len(made), (found, len(made))


def test_output_dot_is_refused_naming_the_option(models, tmp_path):
    """Before: `--output .` swapped the caller's folder out and deleted
    it, exit 0."""
    work = tmp_path / "work"
    files = user_files(str(work), 4)
    for out, cwd in ((".", work), ("./", work), ("..", work / "sub"),
                     (str(work), work / "sub")):
        r = subprocess.run([BICO, *map(str, run_args(models, out))], cwd=cwd,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, r.stderr
        assert "--output: the output folder" in r.stderr, r.stderr
        assert "the working directory" in r.stderr, r.stderr
        assert intact(str(work), files) == 4
        assert sorted(os.listdir(str(work))) == sorted(
            ["sub"] + [f for f in files if "/" not in f])
    assert sorted(os.listdir(str(tmp_path))) == ["work"]


def test_a_dangling_output_link_is_named_with_its_target(models, tmp_path):
    dl = tmp_path / "dl"
    os.symlink("gone/away", str(dl))
    r = bico(*run_args(models, str(dl) + "/"), ok=False, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "--output: the output folder" in r.stderr, r.stderr
    assert "dangling symbolic link (to gone/away" in r.stderr, r.stderr
    assert "another type" not in r.stderr
    assert sorted(os.listdir(str(tmp_path))) == ["dl"]


def chattr(path, on):
    if shutil.which("chattr") is None:
        return False
    r = subprocess.run(["chattr", "+i" if on else "-i", str(path)],
                       capture_output=True)
    return r.returncode == 0


def test_messages_name_no_library_function(models, tmp_path):
    """Before: "bico transfer: bico_stwriter_create_folder: cannot write the
    output folder ...".  The folder's parent refuses new entries (chattr
    +i: root is refused too; skipped where chattr is unavailable)."""
    parent = tmp_path / "locked"
    parent.mkdir()
    if not chattr(parent, True):
        pytest.skip("chattr +i is not available here (root on ext4 or alike)")
    try:
        r = bico(*run_args(models, str(parent / "out") + "/"), ok=False,
                 timeout=60)
    finally:
        chattr(parent, False)
    assert r.returncode == 1, r.stderr
    assert "--output: cannot write the output folder" in r.stderr, r.stderr
    assert "stwriter_create_folder" not in r.stderr, r.stderr
    assert os.listdir(str(parent)) == []


def test_wait_is_a_number_of_seconds(models, tmp_path):
    r = bico(*run_args(models, tmp_path / "o/", "--wait", "soon"), ok=False)
    assert r.returncode == 2 and "--wait soon: expected a number of seconds" \
        in r.stderr, r.stderr
    r = bico(*run_args(models, tmp_path / "o/", "--wait", "-1"), ok=False)
    assert r.returncode == 2 and "--wait -1:" in r.stderr and \
        "folder_wait = -1 is outside [0, 1e+09]" in r.stderr, r.stderr
    assert os.listdir(str(tmp_path)) == []

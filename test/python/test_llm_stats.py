"""`python3 -m bico.llm stats` (bico-llm stats): the statistics file of
the C route from folders and text, without Python of the user's.  End to
end on test/e2e/llm_pair.py's folders: the subcommand's file equals the
one bico.torch.collect_statistics writes on the same windows, and `bico
transfer --stats` with it writes what bico.transfer_files writes with
the Python-collected file."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import bico
import bico.llm
import bico.safetensors as st
import bico.llm as bl
import bico.torch as bt

HERE = os.path.dirname(os.path.abspath(__file__))
import llm_pair  # noqa: E402

torch.set_num_threads(1)
BICO = os.path.join(os.environ.get("BICO_BUILD", "build"), "bin", "bico")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("stats")
    llm_pair.make(str(d))
    return d


def test_stats_then_bico_transfer_equals_the_python_route(pair, tmp_path):
    # compared at 1e-9 with this process's statistics below: the child
    # runs BLIS's own kernels, as this process does (bico._blis would
    # choose others on a CPU BLIS does not know)
    env = dict(os.environ, OMP_NUM_THREADS="1", BICO_BLIS_ARCH="auto")
    r = subprocess.run([sys.executable, "-m", "bico.llm", "stats",
                        "--source", "A", "--target", "B", "--text",
                        "task.txt", "--window", "32", "--threads", "1",
                        "--output", str(tmp_path / "s.safetensors")],
                       cwd=str(pair), env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bico transfer --method bico" in r.stdout
    # the Python route on the same windows (all of them, none held out)
    src, tgt = (bl.load_model(pair / f, dtype=torch.float32)
                for f in ("A", "B"))
    cal = bl.text_batches(str(pair / "task.txt"), 32, n=256, holdout=0,
                          tokenizer=str(pair / "B"), seed=0)
    col = bt.collect_statistics(src, tgt, cal.batches, bl.next_token_loss,
                                path=str(tmp_path / "ref.safetensors"),
                                show_progress=False)
    col.close()
    got = st.read(str(tmp_path / "s.safetensors"), dtype=np.float64)
    want = st.read(str(tmp_path / "ref.safetensors"), dtype=np.float64)
    assert sorted(got) == sorted(want) and len(got) >= 2 * 21
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-9,
                                   atol=1e-9 * np.abs(want[k]).max(),
                                   err_msg=k)
    # the C command with the subcommand's file, the binding with Python's
    subprocess.run([BICO, "transfer", "--method", "bico", "--source-base",
                    "A", "--source-tuned", "A_ft", "--target-base", "B",
                    "--stats", str(tmp_path / "s.safetensors"), "--alpha",
                    "0.5", "--output", str(tmp_path / "c.safetensors"),
                    "--quiet"], cwd=str(pair), check=True, timeout=300)
    bico.transfer_files(str(pair / "A"), str(pair / "B"),
                        str(tmp_path / "py.safetensors"),
                        source_tuned=str(pair / "A_ft"),
                        stats=str(tmp_path / "ref.safetensors"),
                        method="bico", alpha=0.5)
    c = st.read(str(tmp_path / "c.safetensors"), dtype=np.float64)
    p = st.read(str(tmp_path / "py.safetensors"), dtype=np.float64)
    assert sorted(c) == sorted(p)
    base = st.read(str(pair / "B" / "model.safetensors.index.json"),
                   dtype=np.float64)
    # The two files agree to 1e-9, not bit for bit (sums in another
    # order), and the outputs are rounded to the target's bfloat16: where
    # the exact value lies that close to a rounding boundary the two round
    # apart, by one bfloat16 step (seen on one CPU: 1 element of 1536 in
    # one tensor).  So: equal up to one step at the element's magnitude,
    # and such elements rare.
    moved = apart = total = 0
    for k in p:
        mag = np.maximum(np.abs(c[k]), np.abs(p[k]))
        step = np.exp2(np.floor(np.log2(np.where(mag > 0, mag, 1.0))) - 7)
        d = np.abs(c[k] - p[k])
        assert (d <= step * (1 + 1e-12)).all(), (k, float(d.max()))
        apart += int((d > 0).sum())
        total += d.size
        moved += not np.array_equal(p[k], base[k])
    assert apart <= max(2, total // 1000), (apart, total)
    assert moved >= 10   # the transfer carried the fine-tune


@pytest.mark.parametrize("args,word", [
    (["--windows", "0"], "--windows"),
    (["--text", "nothere.txt"], "--text"),
    (["--target", "nothere"], "--target"),
    (["--window", "1000"], "--window"),
])
def test_stats_mistakes_are_one_line_exit_2(pair, tmp_path, capsys, args,
                                            word):
    base = {"--source": "A", "--target": "B", "--text": "task.txt",
            "--window": "32", "--output": str(tmp_path / "s.safetensors")}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    old = os.getcwd()
    os.chdir(str(pair))
    try:
        argv = ["stats", "--quiet"] + [x for kv in base.items() for x in kv]
        try:
            status = bico.llm.main(argv)
        except SystemExit as e:
            status = e.code
    finally:
        os.chdir(old)
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert status == 2 and len(err) == 1 and word in err[0], err
    assert "stats" in err[0]
    assert not os.path.exists(tmp_path / "s.safetensors")


def _run_stats(pair, argv):
    """bico.llm.main in the pair's folder: (status, stderr lines)."""
    old = os.getcwd()
    os.chdir(str(pair))
    try:
        try:
            status = bico.llm.main(["stats", "--quiet"] + argv)
        except SystemExit as e:
            status = e.code
    finally:
        os.chdir(old)
    return status


def _snapshot(pair):
    """Every file of B and the task text: name -> bytes."""
    out = {"task.txt": (pair / "task.txt").read_bytes()}
    for n in sorted(os.listdir(pair / "B")):
        out["B/" + n] = (pair / "B" / n).read_bytes()
    return out


def test_stats_output_that_is_an_input_is_refused(pair, tmp_path, capsys):
    # issue 45: --output naming a shard of the target (however spelt),
    # the task text or the target's config.json replaced it (exit 0); a
    # FIFO was opened.  Now the library's rule for output files
    # (bico_folder_add_file) refuses each before anything is loaded.
    shard = sorted(n for n in os.listdir(pair / "B")
                   if n.startswith("model-"))[0]
    link = tmp_path / "link.safetensors"
    os.symlink(str(pair / "B" / shard), str(link))
    hard = tmp_path / "hard.txt"
    os.link(str(pair / "task.txt"), str(hard))
    fifo = tmp_path / "fifo"
    os.mkfifo(str(fifo))
    before = _snapshot(pair)
    cases = [("B/" + shard, ["--target", "B/" + shard]),
             (str(link), ["--target", str(link)]),
             ("B/../B/" + shard, ["--target", "B/../B/" + shard]),
             ("task.txt", ["--text", "task.txt", "same file"]),
             (str(hard), ["--text", str(hard), "same file"]),
             ("B/config.json", ["--target", "B/config.json"]),
             (str(fifo), [str(fifo), "FIFO"]),
             (str(tmp_path), ["a folder"])]
    for out, words in cases:
        status = _run_stats(pair, ["--source", "A", "--target", "B", "--text",
                                   "task.txt", "--window", "32", "--windows",
                                   "2", "--output", out])
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert status == 2 and len(err) == 1, (out, status, err)
        assert "--output" in err[0] and out in err[0], (out, err)
        for w in words:
            assert w in err[0], (out, w, err)
        assert "nothing was written" in err[0], err
        assert _snapshot(pair) == before, out
    assert os.path.islink(str(link)) and stat_is_fifo(fifo)
    assert sorted(os.listdir(tmp_path)) == ["fifo", "hard.txt",
                                            "link.safetensors"]
    # a good --output still works
    status = _run_stats(pair, ["--source", "A", "--target", "B", "--text",
                               "task.txt", "--window", "32", "--windows", "2",
                               "--threads", "1", "--output",
                               str(tmp_path / "s.safetensors")])
    assert status == 0, capsys.readouterr().err
    assert len(st.read(str(tmp_path / "s.safetensors"))) >= 2
    assert _snapshot(pair) == before


def stat_is_fifo(p):
    import stat
    return stat.S_ISFIFO(os.lstat(str(p)).st_mode)

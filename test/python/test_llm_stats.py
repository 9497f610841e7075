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
import bico.torch as bt

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
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
    src, tgt = (bt.load_model(pair / f, dtype=torch.float32)
                for f in ("A", "B"))
    cal = bt.text_batches(str(pair / "task.txt"), 32, n=256, holdout=0,
                          tokenizer=str(pair / "B"), seed=0)
    col = bt.collect_statistics(src, tgt, cal.batches, bt.next_token_loss,
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

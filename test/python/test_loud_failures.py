"""Loud failures: a prefix rename offered (and applied with
--source-rename) when names differ by a prefix, votes with a method that
ignores them refused, a checkpoint given as the task vector warned about,
both shapes in shape errors, no temporary path in any message."""
import os
import resource
import signal

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
import planted as pl  # noqa: E402

from cli import BICO, bico  # noqa: E402


def _model(prefix, rng, blocks):
    """Blocks pair by their index whatever their prefix; tensors outside
    them pair by name alone."""
    sd = {}
    if blocks:
        for i in range(3):
            sd[f"{prefix}encoder.layer.{i}.dense.weight"] = rng.standard_normal((4, 4)).astype(np.float32)
            sd[f"{prefix}encoder.layer.{i}.dense.bias"] = rng.standard_normal(4).astype(np.float32)
        sd[f"{prefix}pooler.weight"] = rng.standard_normal((4, 4)).astype(np.float32)
    else:
        for n in ("embed.weight", "encoder.weight", "encoder.bias", "pooler.weight"):
            sd[prefix + n] = rng.standard_normal((4, 4) if n.endswith("weight") else 4).astype(np.float32)
    return sd


def _case(tmp_path, src_prefix, tgt_prefix, blocks=False):
    rng = np.random.default_rng(3)
    a = _model(src_prefix, rng, blocks)
    aft = {k: v + 0.01 for k, v in a.items()}
    b = {tgt_prefix + k[len(src_prefix):]: v.copy() for k, v in a.items()}
    for n, sd in (("a", a), ("aft", aft), ("b", b)):
        pl.save(str(tmp_path / f"{n}.safetensors"), sd)
    return ["transfer", "--method", "naive", "--source-base", tmp_path / "a.safetensors",
            "--source-tuned", tmp_path / "aft.safetensors",
            "--target-base", tmp_path / "b.safetensors"]


def test_a_prefix_rename_is_offered_and_applies(tmp_path):
    """The three usual differences: DataParallel's module. on the source,
    a family prefix swapped, a prefix only the target has.  Each failure
    names the rename and how many tensors it pairs (all 4 here); with it,
    the run gives the target exactly base + tau."""
    for src, tgt, rule in (("module.", "", "module.="),
                           ("bert.", "roberta.", "bert.=roberta."),
                           ("", "model.", "=model.")):
        d = tmp_path / rule.replace("=", "_").replace(".", "")
        d.mkdir()
        args = _case(d, src, tgt)
        r = bico(*args, "--output", d / "o.safetensors", ok=False)
        assert r.returncode == 1, r.stderr
        assert f"--source-rename '{rule}'" in r.stderr, r.stderr
        assert "gives 4 of the target's 4 tensors" in r.stderr and "(0 now)" in r.stderr
        assert not (d / "o.safetensors").exists()
        r = bico(*args, "--source-rename", rule, "--output", d / "o.safetensors")
        out, _, _ = pl.load(str(d / "o.safetensors"))
        b, _, _ = pl.load(str(d / "b.safetensors"))
        assert set(out) == set(b)
        for k in b:
            assert np.allclose(out[k], b[k] + 0.01, atol=1e-6), k
        assert "note:" not in r.stderr


def test_a_partial_pairing_gets_a_note_and_bad_renames_are_refused(tmp_path):
    """The blocks pair by index (prefix or not), the pooler does not: the
    run passes the pairing threshold and notes the rename; with it the
    pooler is updated too."""
    args = _case(tmp_path, "module.", "", blocks=True)
    r = bico(*args, "--output", tmp_path / "o.safetensors")
    assert "note: the names differ by a prefix: --source-rename 'module.='" in r.stderr
    assert "unchanged: pooler.weight" in r.stderr
    r = bico(*args, "--source-rename", "module.=", "--output", tmp_path / "o2.safetensors")
    assert "note:" not in r.stderr and "unchanged" not in r.stderr.replace("0 unchanged", "")
    for bad in ("module.", "="):
        r = bico(*args, "--source-rename", bad, "--output", tmp_path / "x.safetensors", ok=False)
        assert r.returncode == 2 and "OLD=NEW" in r.stderr, r.stderr
    # two source tensors of one name after the rename
    a, _, _ = pl.load(str(tmp_path / "a.safetensors"))
    a["pooler.weight"] = a["module.pooler.weight"]
    pl.save(str(tmp_path / "a.safetensors"), a)
    r = bico(*args, "--source-rename", "module.=", "--output", tmp_path / "x.safetensors",
             ok=False)
    assert r.returncode == 1 and "two tensors become 'pooler.weight'" in r.stderr, r.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_votes_with_a_method_that_ignores_them_is_an_error(tmp_path):
    args = _case(tmp_path, "", "")
    for method in ("naive", "pad"):
        argv = list(args)
        argv[2] = method
        r = bico(*argv, "--target-votes", tmp_path / "a.safetensors",
                 "--output", tmp_path / "o.safetensors", ok=False)
        assert r.returncode == 2 and "gradfix only" in r.stderr, r.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_a_checkpoint_given_as_task_vector_is_warned_about(tmp_path):
    args = _case(tmp_path, "", "")
    a, _, _ = pl.load(str(tmp_path / "a.safetensors"))
    pl.save(str(tmp_path / "tau.safetensors"), {k: np.full_like(v, 0.01) for k, v in a.items()})
    base = ["transfer", "--method", "naive", "--source-base", tmp_path / "a.safetensors",
            "--target-base", tmp_path / "b.safetensors"]
    r = bico(*base, "--task-vector", tmp_path / "aft.safetensors",
             "--output", tmp_path / "o.safetensors")
    assert "warning: the task vector" in r.stderr and "whole checkpoint" in r.stderr
    assert "--source-tuned" in r.stderr
    r = bico(*base, "--task-vector", tmp_path / "tau.safetensors",
             "--output", tmp_path / "o2.safetensors")
    assert "warning" not in r.stderr, r.stderr


def test_shape_errors_state_both_shapes(tmp_path):
    pl.save(str(tmp_path / "a.safetensors"), {"fc.weight": np.ones((4, 3), np.float32)})
    pl.save(str(tmp_path / "aft.safetensors"), {"fc.weight": np.ones((4, 3), np.float32)})
    pl.save(str(tmp_path / "b.safetensors"), {"fc.weight": np.ones((5, 3), np.float32)})
    pl.save(str(tmp_path / "tau.safetensors"), {"fc.weight": np.ones((4, 2), np.float32)})
    r = bico("transfer", "--method", "naive", "--source-base", tmp_path / "a.safetensors",
             "--source-tuned", tmp_path / "aft.safetensors",
             "--target-base", tmp_path / "b.safetensors",
             "--output", tmp_path / "o.safetensors", ok=False)
    assert r.returncode == 1 and "[5, 3]" in r.stderr and "[4, 3]" in r.stderr, r.stderr
    r = bico("transfer", "--method", "pad", "--source-base", tmp_path / "a.safetensors",
             "--task-vector", tmp_path / "tau.safetensors",
             "--target-base", tmp_path / "b.safetensors",
             "--output", tmp_path / "o.safetensors", ok=False)
    assert r.returncode == 1, r.stderr
    assert "[4, 2]" in r.stderr and "[4, 3]" in r.stderr, r.stderr


def test_no_message_names_a_temporary_file(tmp_path):
    """A file-size limit makes the writes fail (bico ignores SIGXFSZ): the
    message names the output, never the temporary file it wrote."""
    args = _case(tmp_path, "", "")
    import subprocess

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
    for out in (tmp_path / "o.safetensors", tmp_path / "folder/"):
        r = subprocess.run([BICO, *map(str, args), "--output", str(out),
                            "--report", str(tmp_path / "r.json")],
                           capture_output=True, text=True, preexec_fn=limit)
        assert r.returncode == 1, r.stderr
        assert "bico-tmp" not in r.stderr and str(out).rstrip("/") in r.stderr, r.stderr
        assert not [f for f in os.listdir(tmp_path) if "bico-tmp" in f]
        assert not (tmp_path / "folder").exists()


FUNCTION_NAME = __import__("re").compile(r"(^|: )[a-z][a-z0-9]*(_[a-z0-9]+)+: ")


def _user_facing(stderr):
    """The error line (the last line): no library function name in it
    (issue 22: `stwriter_create_folder: cannot create ...`)."""
    line = [s for s in stderr.splitlines() if s.startswith("bico ")][-1]
    assert not FUNCTION_NAME.search(line.split(": ", 1)[1]), line
    return line


def test_messages_name_the_option_and_file_not_a_function(tmp_path):
    args = _case(tmp_path, "", "")
    cases = [
        (["--output", tmp_path / "no" / "such" / "out"], "--output", "out"),
        (["--output", tmp_path / "o.safetensors", "--report",
          tmp_path / "no" / "r.json"], "--report", "r.json"),
    ]
    args_missing = [str(a).replace("aft.safetensors", "missing.safetensors") for a in args]
    cases.append((["--output", tmp_path / "o2.safetensors"], "--source-tuned",
                  "missing.safetensors"))
    for k, (extra, option, name) in enumerate(cases):
        r = bico(*(args_missing if k == 2 else args), *extra, ok=False, timeout=60)
        assert r.returncode == 1, r.stderr
        line = _user_facing(r.stderr)
        assert option in line and name in line, line


def test_merge_overflowing_difference_names_tensor_and_input(tmp_path):
    """A tuned checkpoint whose difference from the base overflows float:
    the message named `merge_tensor: taus[t] holds Inf`; it names the
    tensor and the input file."""
    base = {"w": np.full((2, 2), -3e38, np.float32)}
    tuned = {"w": np.full((2, 2), 3e38, np.float32)}
    pl.save(str(tmp_path / "b.safetensors"), base)
    pl.save(str(tmp_path / "t.safetensors"), tuned)
    r = bico("merge", "--base", tmp_path / "b.safetensors", "--tuned",
             tmp_path / "t.safetensors", "--output", tmp_path / "o.safetensors",
             ok=False, timeout=60)
    assert r.returncode == 1, r.stderr
    line = _user_facing(r.stderr)
    assert "taus" not in line and "tensor w" in line and "t.safetensors" in line, line
    assert "--tuned" in line, line
    assert not (tmp_path / "o.safetensors").exists()


def test_the_librarys_file_rules_are_usage_errors_naming_options(tmp_path):
    """Which files go together is bico_transfer_check's rule (issue 25):
    every conflict it finds is a usage error (2) that names the command's
    options, never the library's slot words or function names, and writes
    nothing.  Two outputs on one path, and --source-rename with --lora,
    were failures (1) before the command asked the library."""
    args = _case(tmp_path, "", "")
    t = tmp_path
    o = ["--output", t / "o.safetensors"]
    cases = [
        (["--report", t / "o.safetensors"], ["--output", "--report"]),
        (["--method", "bico", "--source-calib", t / "a.safetensors"],
         ["--target-calib", "--source-calib"]),
        (["--method", "bico", "--stats", t / "a.safetensors", "--center"],
         ["--center", "--stats"]),
        (["--task-vector", t / "a.safetensors"], ["--source-tuned", "--task-vector"]),
        (["--output-lora", t / "ad_out"], ["--output-lora", "--lora"]),
    ]
    for extra, words in cases:
        argv = list(args)
        if "--method" in extra:  # replace the method, keep the rest
            argv[1:3] = extra[:2]
            extra = extra[2:]
        r = bico(*argv, *o, *extra, ok=False)
        assert r.returncode == 2, (extra, r.stderr)
        for w in words:
            assert w in r.stderr, (w, r.stderr)
        for w in ("transfer_run", "transfer_check", " file ", "calib file"):
            assert w not in r.stderr.splitlines()[0], (w, r.stderr)
        assert not (t / "o.safetensors").exists()
    lora = ["transfer", "--method", "naive", "--source-base", t / "a.safetensors",
            "--target-base", t / "b.safetensors", "--lora", t / "ad",
            "--output-lora", t / "ad_out", "--source-rename", "a=b"]
    r = bico(*lora, ok=False)
    assert r.returncode == 2 and "source rename" in r.stderr, r.stderr

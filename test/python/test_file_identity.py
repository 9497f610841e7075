"""Identity of every file a run reads and writes, for model folders
(issue 22): an output folder that is, or holds, an input of the run, or
that holds another output of the run, is refused before anything is
written, whatever the spelling (./x, x/, a symbolic link, the index file
instead of the folder).  Each refusal leaves every folder byte for byte as
it was."""
import json
import os

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
import planted as pl  # noqa: E402

from cli import bico  # noqa: E402

SHAPES = {"l0.weight": (6, 4), "l0.bias": (6,), "l1.weight": (3, 6),
          "l1.bias": (3,)}
SHARDS = {"model-00001-of-00002.safetensors": ["l0.weight", "l0.bias"],
          "model-00002-of-00002.safetensors": ["l1.weight", "l1.bias"]}
INDEX = "model.safetensors.index.json"


def _folder(d, sd, sharded):
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "mlp"}))
    (d / "notes.txt").write_text("the user's own notes\n")
    if not sharded:
        pl.save(str(d / "model.safetensors"), sd, {"format": "pt"})
        return d
    wm = {}
    for fn, keys in SHARDS.items():
        pl.save(str(d / fn), {k: sd[k] for k in keys}, {"format": "pt"})
        wm.update({k: fn for k in keys})
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d


def snapshot(root):
    """{relative path: bytes} of every file under root (links as their
    target's name)."""
    out = {}
    for dp, dns, fns in os.walk(root):
        for fn in fns + [x for x in dns if os.path.islink(os.path.join(dp, x))]:
            p = os.path.join(dp, fn)
            rel = os.path.relpath(p, root)
            out[rel] = ("link:" + os.readlink(p)) if os.path.islink(p) else \
                open(p, "rb").read()
    return out


@pytest.fixture()
def m(tmp_path):
    rng = np.random.default_rng(7)
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    ft = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
          for k, v in base.items()}
    tgt = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    r = {"dir": tmp_path,
         "src_sh": _folder(tmp_path / "src_sh", base, True),
         "srcft_sh": _folder(tmp_path / "srcft_sh", ft, True),
         "tgt": _folder(tmp_path / "tgt", tgt, False),
         "tgt_sh": _folder(tmp_path / "tgt_sh", tgt, True)}
    os.symlink("src_sh", tmp_path / "src_link")
    return r


def _transfer(m, *args, ok=False, source="src_sh", tuned="srcft_sh", target="tgt"):
    os.chdir(m["dir"])
    return bico("transfer", "--method", "naive", "--quiet",
                "--source-base", source, "--source-tuned", tuned,
                "--target-base", target, *args, ok=ok)


def _refused(m, r, *words):
    assert r.returncode != 0, r.stderr
    assert "nothing was written" in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)
    # the command's name, not the library function's
    assert "transfer_run" not in r.stderr and "merge_run" not in r.stderr, r.stderr


@pytest.mark.parametrize("out", ["src_sh", "./src_sh/", "src_sh/", "src_link",
                                 "src_link/", "{dir}/src_sh"])
def test_output_folder_is_a_sharded_source_base(m, out):
    before = snapshot(m["dir"])
    r = _transfer(m, "--output", out.format(dir=m["dir"]))
    _refused(m, r, "output folder")
    assert snapshot(m["dir"]) == before


@pytest.mark.parametrize("opt", ["--output", "--delta-output"])
def test_output_folder_is_the_source_tuned_folder(m, opt):
    before = snapshot(m["dir"])
    extra = [] if opt == "--output" else ["--output", "fresh/"]
    r = _transfer(m, opt, "./srcft_sh", *extra)
    _refused(m, r, "srcft_sh")
    assert snapshot(m["dir"]) == before and not (m["dir"] / "fresh").exists()


def test_target_given_as_a_file_of_the_output_folder(m):
    """--target-base tgt_sh/<index or a shard's folder> --output tgt_sh/:
    the target's own shards must not be overwritten (the folder check of
    the writer saw only a target given as a folder); the source given by
    its index likewise."""
    before = snapshot(m["dir"])
    target = "tgt_sh/" + INDEX
    r = _transfer(m, "--output", "tgt_sh/", target=target)
    _refused(m, r, "tgt_sh")
    assert snapshot(m["dir"]) == before
    # the source given by one of its shards' folder through a file of it
    r = _transfer(m, "--output", "./src_sh", source="src_sh/" + INDEX)
    _refused(m, r, "src_sh")
    assert snapshot(m["dir"]) == before


def test_an_input_file_inside_the_output_folder(m):
    """An input file kept in the output folder, named directly or through a
    symbolic link elsewhere, is refused: the commit would replace or remove
    it."""
    d = m["dir"]
    o = d / "o"
    o.mkdir()
    a, _, _ = pl.load(str(m["srcft_sh"] / "model-00001-of-00002.safetensors"))
    b, _, _ = pl.load(str(m["srcft_sh"] / "model-00002-of-00002.safetensors"))
    pl.save(str(o / "ft.safetensors"), {**a, **b}, {"format": "pt"})
    os.symlink(o / "ft.safetensors", d / "ft_link.safetensors")
    (o / "sub").mkdir()
    os.link(o / "ft.safetensors", o / "sub" / "deep.safetensors")
    before = snapshot(d)
    for tuned in ("o/ft.safetensors", "ft_link.safetensors",
                  "o/sub/deep.safetensors"):
        r = _transfer(m, "--output", "o/", tuned=tuned)
        _refused(m, r, "output folder o/", tuned)
        assert snapshot(d) == before


def test_merge_output_folder_is_an_input_or_the_base(m):
    os.chdir(m["dir"])
    before = snapshot(m["dir"])
    for args in (["--base", "src_sh", "--tuned", "srcft_sh", "--output", "srcft_sh/"],
                 ["--base", "src_sh/" + INDEX, "--tuned", "srcft_sh",
                  "--output", "src_sh/"],
                 ["--base", "src_sh", "--tuned", "srcft_sh", "--output", "fresh/",
                  "--delta-output", "src_link"]):
        r = bico("merge", "--quiet", *args, ok=False)
        _refused(m, r, "folder")
        assert snapshot(m["dir"]) == before, args
        assert not (m["dir"] / "fresh").exists()


@pytest.mark.parametrize("inside", ["--report o/config.json",
                                    "--report o/" + INDEX,
                                    "--report o/notes.txt",
                                    "--delta-output o/model-00001-of-00002.safetensors",
                                    "--delta-output o/d/"])
def test_outputs_of_one_run_inside_the_output_folder(m, inside):
    """Another output of the run inside the output folder would be
    overwritten, removed or left beside the new weights: refused."""
    d = m["dir"]
    _transfer(m, "--output", "o/", target="tgt_sh", ok=True)
    before = snapshot(d)
    r = _transfer(m, "--output", "o/", *inside.split(), target="tgt_sh")
    _refused(m, r, "inside the output folder")
    assert snapshot(d) == before


@pytest.mark.parametrize("inside", ["--report o/config.json",
                                    "--delta-output o/d/",
                                    "--delta-output ./o/d/e/",
                                    "--delta-output o/x.safetensors"])
def test_outputs_inside_a_new_output_folder(m, inside):
    """The same when the output folder does not exist yet: nothing is
    created."""
    d = m["dir"]
    before = snapshot(d)
    r = _transfer(m, "--output", "o/", *inside.split(), target="tgt_sh")
    assert r.returncode != 0, r.stderr
    assert "nothing was written" in r.stderr, r.stderr
    assert snapshot(d) == before and not (d / "o").exists()


def test_what_stays_allowed(m):
    """The rule refuses only what it must: a report beside the output
    folder and an output folder of a new name beside the inputs are
    written.  An output folder inside the target's folder is refused (issue
    32: one rule for the C command and bico.llm, an output never lies
    inside an input) before anything is written."""
    d = m["dir"]
    before = snapshot(d)
    r = _transfer(m, "--output", "tgt/out", target="tgt")
    assert r.returncode != 0 and "lies inside the target base folder" \
        in r.stderr, r.stderr
    assert snapshot(d) == before
    _transfer(m, "--output", "tgt_out", "--report", "r.json", target="tgt",
              ok=True)
    assert (d / "tgt_out" / "model.safetensors").exists()
    assert (d / "r.json").exists()
    bico("merge", "--quiet", "--base", "src_sh", "--tuned", "srcft_sh",
         "--output", "merged/", "--delta-output", "delta/")
    assert (d / "merged" / INDEX).exists() and (d / "delta" / INDEX).exists()


@pytest.mark.parametrize("spelling", ["./tgt", "tgt/", "tgt_link",
                                      "tgt/model.safetensors", "{dir}/tgt"])
def test_mergekit_base_among_models_is_skipped_by_identity(m, spelling):
    """A mergekit config lists the base among `models:`; written as ./tgt,
    tgt/, a link or the folder's weights file it is still the base: skipped,
    never merged as a zero task vector (which would halve the update under
    normalize)."""
    d = m["dir"]
    os.chdir(d)
    os.symlink("tgt", d / "tgt_link")
    a, _, _ = pl.load(str(d / "tgt" / "model.safetensors"))
    ft = {k: v + 0.25 for k, v in a.items()}
    pl.save(str(d / "ft.safetensors"), ft, {"format": "pt"})
    (d / "m.yaml").write_text(
        "merge_method: linear\nbase_model: tgt\nmodels:\n"
        f"  - model: {spelling.format(dir=d)}\n  - model: ft.safetensors\n"
        "parameters: {normalize: true}\noutput: yaml.safetensors\n")
    bico("merge", "--quiet", "--config", "m.yaml")
    bico("merge", "--quiet", "--base", "tgt", "--tuned", "ft.safetensors",
         "--normalize", "--output", "flags.safetensors")
    y, meta, _ = pl.load(str(d / "yaml.safetensors"))
    f, _, _ = pl.load(str(d / "flags.safetensors"))
    assert "bico.input.2" not in meta
    for k in a:
        assert np.array_equal(y[k], f[k]), k
        assert np.allclose(y[k], ft[k], atol=1e-6), k


def test_non_finite_updates_name_the_users_file_and_tensor(tmp_path):
    """An Inf in an input, or a difference tuned - base beyond float range,
    is reported with the user's file and tensor, never with the name of an
    internal function or argument (merge_tensor: taus[t], baseline_naive:
    tau, stfile_check_finite)."""
    os.chdir(tmp_path)
    base = {"x": np.full((3, 4), -3e38, np.float32), "y": np.ones(3, np.float32)}
    over = {k: v.copy() for k, v in base.items()}
    over["x"][1, 2] = 3e38                       # finite, difference is Inf
    inf = {k: v.copy() for k, v in base.items()}
    inf["x"][2, 1] = np.inf
    pl.save("B.safetensors", base)
    pl.save("B_over.safetensors", over)
    pl.save("B_inf.safetensors", inf)
    internal = ("merge_tensor", "taus[", "baseline_naive", "stfile_check_finite",
                "tau holds")
    runs = [
        (["merge", "--base", "B.safetensors", "--tuned", "B_over.safetensors"],
         ["B_over.safetensors", "tensor x", "Inf at element 6"]),
        (["merge", "--base", "B.safetensors", "--tuned", "B_inf.safetensors"],
         ["B_inf.safetensors", "'x'", "Inf at element 9"]),
    ]
    for method in ("naive", "pad"):
        runs.append((["transfer", "--method", method, "--source-base",
                      "B.safetensors", "--source-tuned", "B_over.safetensors",
                      "--target-base", "B.safetensors"],
                     ["B_over.safetensors", "B.safetensors", "tensor x",
                      "Inf at element 6"]))
    for args, words in runs:
        r = bico(*args, "--quiet", "--output", "o.safetensors", ok=False)
        assert r.returncode == 1, r.stderr
        for w in words:
            assert w in r.stderr, (args, w, r.stderr)
        for w in internal + ("transfer_run", "merge_run"):
            assert w not in r.stderr, (args, w, r.stderr)
        assert not os.path.exists("o.safetensors")


@pytest.mark.parametrize("out", ["--report src_sh/model.safetensors.index.json",
                                 "--report ./src_sh/config.json",
                                 "--report src_link/notes.txt",
                                 "--delta-output src_sh/model-00001-of-00002.safetensors",
                                 "--output tgt/model.safetensors.index.json"])
def test_an_output_file_inside_an_input_model_folder(m, out):
    """An output file written into a model folder the run reads (given as
    the folder or by its index) would replace that model's index, config,
    notes or a shard: refused (before, `--report src_sh/<index>` replaced
    the source's index with the report, exit 0)."""
    d = m["dir"]
    before = snapshot(d)
    r = _transfer(m, *out.split(), *(["--output", "x.safetensors"]
                                     if not out.startswith("--output") else []))
    _refused(m, r)
    assert "inside the model folder" in r.stderr or "same file" in r.stderr, r.stderr
    assert snapshot(d) == before
    r = _transfer(m, *out.split(), source="src_sh/" + INDEX,
                  *(["--output", "x.safetensors"]
                    if not out.startswith("--output") else []))
    assert r.returncode != 0 and snapshot(d) == before, r.stderr
    os.chdir(d)
    r = bico("merge", "--quiet", "--base", "tgt", "--tuned", "srcft_sh",
             "--output", "mm.safetensors", "--report", "tgt/config.json", ok=False)
    _refused(m, r, "inside the model folder of the base tgt")
    assert snapshot(d) == before

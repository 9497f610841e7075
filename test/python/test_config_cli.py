"""`bico transfer --config` and `bico merge --config`: a YAML file stands for
the command's own options.  The reference is the same run spelled out with
flags: outputs must be byte-identical.  Bad files are usage errors (exit 2)
that name the file and the line."""
import os

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
import planted as pl  # noqa: E402

from cli import bico, same_bytes  # noqa: E402


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg")
    rng = np.random.default_rng(3)
    shapes = {"l0.weight": (6, 4), "l0.bias": (6,), "l1.weight": (3, 6)}
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    files = {"B": d / "B.safetensors"}
    pl.save(str(files["B"]), base)
    for i in range(3):
        ft = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
              for k, v in base.items()}
        files[f"ft{i}"] = d / f"ft{i}.safetensors"
        pl.save(str(files[f"ft{i}"]), ft)
        tv = {k: ft[k] - base[k] for k in base}
        files[f"tv{i}"] = d / f"tv{i}.safetensors"
        pl.save(str(files[f"tv{i}"]), tv)
    return d, files


def write(path, text):
    path.write_text(text)
    return path


def test_merge_mergekit_schema_equals_flags(ckpts, tmp_path):
    d, f = ckpts
    cfg = write(tmp_path / "merge.yaml", f"""\
# a mergekit-style file: the base is listed among the models, dtype ignored
merge_method: ties
base_model: {f['B']}
models:
  - model: {f['B']}
  - model: {f['ft0']}
    parameters:
      weight: 0.7
      density: 0.5
  - model: {f['ft1']}
    parameters: {{weight: 0.3, density: 0.8}}
  - task_vector: {f['tv2']}
parameters:
  normalize: false
  lambda: 1.5
dtype: float16
output: {tmp_path / 'yaml.safetensors'}
""")
    r = bico("merge", "--config", cfg, "--quiet")
    assert "'dtype' ignored" in r.stderr
    bico("merge", "--quiet", "--method", "ties", "--base", f["B"],
         "--tuned", f["ft0"], "--weight", 0.7, "--density", 0.5,
         "--tuned", f["ft1"], "--weight", 0.3, "--density", 0.8,
         "--task-vector", f["tv2"], "--no-normalize", "--alpha", 1.5,
         "--output", tmp_path / "flags.safetensors")
    assert same_bytes(tmp_path / "yaml.safetensors", tmp_path / "flags.safetensors")
    # Not a no-op: the merged model differs from the base.
    a, _, _ = pl.load(str(tmp_path / "yaml.safetensors"))
    b, _, _ = pl.load(str(f["B"]))
    assert any(not np.array_equal(a[k], b[k]) for k in a)


def test_merge_config_then_command_line_options(ckpts, tmp_path):
    d, f = ckpts
    cfg = write(tmp_path / "m.yaml", f"base_model: {f['B']}\nmodels:\n"
                f"  - task_vector: {f['tv0']}\n")
    # --config=F form; --output from the command line after it.
    bico("merge", f"--config={cfg}", "--output", tmp_path / "a.safetensors", "--quiet")
    bico("merge", "--base", f["B"], "--task-vector", f["tv0"],
         "--output", tmp_path / "b.safetensors", "--quiet")
    assert same_bytes(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    # A repeat of a single-valued option is the parser's usual error.
    r = bico("merge", "--config", cfg, "--base", f["B"], "--output",
             tmp_path / "c.safetensors", ok=False)
    assert r.returncode == 2 and "--base given twice" in r.stderr


def test_transfer_generic_keys_equal_flags(ckpts, tmp_path):
    d, f = ckpts
    cfg = write(tmp_path / "t.yaml", f"""\
method: naive
source_base: {f['B']}
source_tuned: {f['ft0']}
target_base: {f['B']}
alpha: 0.5
quiet: true
output: {tmp_path / 'yaml.safetensors'}
""")
    bico("transfer", "--config", cfg)
    bico("transfer", "--method", "naive", "--source-base", f["B"],
         "--source-tuned", f["ft0"], "--target-base", f["B"], "--alpha", 0.5,
         "--quiet", "--output", tmp_path / "flags.safetensors")
    assert same_bytes(tmp_path / "yaml.safetensors", tmp_path / "flags.safetensors")


@pytest.mark.parametrize("text,needle", [
    ("merge_method: [ties\n", "line"),                  # not YAML
    ("- a\n- b\n", "top level must be a mapping"),
    ("base_model: B\nmodels: {a: 1}\n", "'models' is a list"),
    ("base_model: B\nmodels:\n  - model: x\n    colour: red\n", "unknown key 'colour'"),
    ("base_model: B\nmodels:\n  - model: x\n    parameters: {epsilon: 1}\n",
     "model parameter 'epsilon'"),
    ("config: other.yaml\n", "cannot name another"),
    ("bogus_option: 1\n", "unknown option --bogus-option"),
    ("", "empty"),
    ("base_model: B\nmodels:\n  - model: null\n", "names one path"),   # issue 22
    ("base_model: ~\nmodels:\n  - model: x\n", "base_model is a path"),
])
def test_bad_merge_configs_are_usage_errors(tmp_path, text, needle):
    cfg = write(tmp_path / "bad.yaml", text)
    r = bico("merge", "--config", cfg, "--output", tmp_path / "o.safetensors", ok=False)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr, r.stderr
    assert str(cfg) in r.stderr, r.stderr  # also an option the parser refuses
    assert not (tmp_path / "o.safetensors").exists()


def test_missing_config_file(tmp_path):
    r = bico("transfer", "--config", tmp_path / "nope.yaml", ok=False)
    assert r.returncode == 2 and "nope.yaml" in r.stderr and "cannot open" in r.stderr
    r = bico("merge", "--config", ok=False)
    assert r.returncode == 2 and "--config needs a value" in r.stderr


# ------------------------------------------------ issue 22: hostile files, rules

def naive_yaml(f, out, extra=""):
    return (f"method: naive\nsource_base: {f['B']}\nsource_tuned: {f['ft0']}\n"
            f"target_base: {f['B']}\noutput: {out}\n{extra}")


@pytest.mark.parametrize("text,needle", [
    ("alpha: " + "[" * 200000 + "\n", "nested deeper than 64"),   # never finished
    ("[\n" * 100000, "nested deeper than 64"),
    ("a: " + "{b: " * 100000 + "\n", "nested deeper than 64"),
    ("- " * 100000 + "x\n", "nested deeper than 64"),
    ("# " + "x" * (1 << 20) + "\nalpha: 1\n", "larger than 1 MiB"),
], ids=["flow-seq", "flow-seq-lines", "flow-map", "block-seq", "size"])
def test_hostile_config_files_are_refused_fast(tmp_path, text, needle):
    """issue 22: libyaml's loader is quadratic in the nesting depth (200 KB
    of '[' never finished); depth and size are bounded before loading."""
    cfg = write(tmp_path / "evil.yaml", text)
    r = bico("transfer", "--config", cfg, ok=False, timeout=20)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and str(cfg) in r.stderr, r.stderr


def test_config_that_is_not_a_regular_file(tmp_path):
    r = bico("merge", "--config", "/dev/zero", ok=False, timeout=20)
    assert r.returncode == 2 and "/dev/zero" in r.stderr, r.stderr


@pytest.mark.parametrize("where", ["cli-twice", "config-and-cli", "alias-keys"])
def test_single_valued_option_given_twice_is_an_error(ckpts, tmp_path, where):
    """docs/bico.1.md: a single-valued option given in both the file and
    the command line is an error; so is one given twice on the command
    line, or twice in the file under two spellings (alpha, lambda)."""
    d, f = ckpts
    out = tmp_path / "o.safetensors"
    if where == "cli-twice":
        r = bico("transfer", "--method", "naive", "--source-base", f["B"],
                 "--source-tuned", f["ft0"], "--target-base", f["B"],
                 "--alpha", 1, "--alpha", 2, "--output", out, ok=False, timeout=60)
        assert "--alpha given twice" in r.stderr, r.stderr
    elif where == "config-and-cli":
        cfg = write(tmp_path / "t.yaml", naive_yaml(f, out, "alpha: 5\n"))
        r = bico("transfer", "--config", cfg, "--alpha", 2, ok=False, timeout=60)
        assert "--alpha given twice" in r.stderr and str(cfg) in r.stderr, r.stderr
        assert "command line" in r.stderr, r.stderr
    else:
        cfg = write(tmp_path / "m.yaml", f"base_model: {f['B']}\nmodels:\n"
                    f"  - task_vector: {f['tv0']}\nparameters: {{alpha: 2, lambda: 3}}\n"
                    f"output: {out}\n")
        r = bico("merge", "--config", cfg, ok=False, timeout=60)
        assert "--alpha given twice" in r.stderr and str(cfg) in r.stderr, r.stderr
    assert r.returncode == 2, r.stderr
    assert not out.exists()


@pytest.mark.parametrize("args,option", [
    (("merge", "--method", "ties", "--method", "linear"), "--method"),
    (("merge", "--no-normalize", "--normalize"), "--normalize"),
    (("merge", "--max-shard-size", "1GB", "--max-shard-size", "2GB"), "--max-shard-size"),
    (("transfer", "--threads", "1", "--threads", "2"), "--threads"),
    (("transfer", "--method", "naive", "--method", "bico"), "--method"),
    (("stats", "-o", "a", "--output", "b"), "--output"),
    (("inspect", "--method", "bico", "--method", "naive", "x"), "--method"),
])
def test_other_single_valued_options_twice(args, option):
    r = bico(*args, ok=False, timeout=20)
    assert r.returncode == 2 and f"{option} given twice" in r.stderr, r.stderr


def test_merge_weight_twice_for_one_input_is_an_error(ckpts, tmp_path):
    d, f = ckpts
    out = tmp_path / "o.safetensors"
    r = bico("merge", "--base", f["B"], "--task-vector", f["tv0"], "--weight", 1,
             "--weight", 2, "--output", out, ok=False, timeout=60)
    assert r.returncode == 2 and "--weight given twice" in r.stderr, r.stderr
    # Repeatable options stay repeatable: inputs, and a weight per input.
    bico("merge", "--base", f["B"], "--task-vector", f["tv0"], "--weight", 1,
         "--task-vector", f["tv1"], "--weight", 2, "--output", out, "--quiet",
         timeout=60)
    assert out.exists()


@pytest.mark.parametrize("extra,needle", [
    ("alpha: 5\nalpha: 6\n", "key 'alpha' given twice"),
    ("---\nalpha: 6\n", "second YAML document"),
])
def test_duplicate_keys_and_second_documents_are_errors(ckpts, tmp_path, extra, needle):
    d, f = ckpts
    out = tmp_path / "o.safetensors"
    cfg = write(tmp_path / "t.yaml", naive_yaml(f, out, extra))
    r = bico("transfer", "--config", cfg, ok=False, timeout=60)
    assert r.returncode == 2 and needle in r.stderr and str(cfg) in r.stderr, r.stderr
    assert not out.exists()


def test_duplicate_key_inside_a_mapping(ckpts, tmp_path):
    d, f = ckpts
    cfg = write(tmp_path / "m.yaml", f"base_model: {f['B']}\nmodels:\n"
                f"  - task_vector: {f['tv0']}\n    parameters: {{weight: 1, weight: 3}}\n"
                f"output: {tmp_path / 'o.safetensors'}\n")
    r = bico("merge", "--config", cfg, ok=False, timeout=60)
    assert r.returncode == 2 and "key 'weight' given twice" in r.stderr, r.stderr
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("value", ["null", "~", "Null", "NULL"])
def test_a_null_path_is_an_error(ckpts, tmp_path, monkeypatch, value):
    """`output: null` wrote a folder named `null`."""
    d, f = ckpts
    monkeypatch.chdir(tmp_path)
    cfg = write(tmp_path / "t.yaml", naive_yaml(f, value))
    r = bico("transfer", "--config", cfg, ok=False, timeout=60)
    assert r.returncode == 2 and "'output' is null" in r.stderr, r.stderr
    assert str(cfg) in r.stderr
    assert os.listdir(tmp_path) == ["t.yaml"]
    cfg = write(tmp_path / "t.yaml", naive_yaml(f, tmp_path / "o.safetensors",
                                                f"report: {value}\n"))
    r = bico("transfer", "--config", cfg, ok=False, timeout=60)
    assert r.returncode == 2 and "'report' is null" in r.stderr, r.stderr

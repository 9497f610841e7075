"""docs/python.md runs as written: its Python blocks, in order, in one
session."""
import os
import re

from test_binding_models import float32_default  # noqa: F401 (autouse)


def test_walkthrough_runs(tmp_path, capsys, monkeypatch):
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs",
                       "python.md")
    blocks = re.findall(r"```python\n(.*?)```", open(doc).read(), re.S)
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    env = {"__name__": "__walkthrough__"}
    exec(compile("\n".join(blocks), doc, "exec"), env)
    out = capsys.readouterr().out
    assert "B + tau_B accuracy" in out and "updated, unchanged" in out
    assert os.path.exists(os.path.join(env["work"], "B_ft.safetensors"))
    # the walkthrough makes its folder with tempfile.mkdtemp, as a user's
    # script would: removed here so that test runs leave nothing in /tmp
    import shutil
    shutil.rmtree(env["work"])


def test_formats_snippets_use_the_project_writer(tmp_path, monkeypatch):
    """docs/formats.md's PyTorch recipes write with bico.safetensors (the
    `safetensors` package is not a dependency), and the calibration recipe
    runs: its file has one row per token for every Linear and LayerNorm."""
    import numpy as np
    import torch
    import bico
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs",
                       "formats.md")
    text = open(doc).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for b in blocks:
        assert not re.search(r"^\s*(from|import) safetensors", b, re.M), b
    calib = [b for b in blocks if "def calibration_file" in b]
    assert len(calib) == 1
    env = {}
    exec(compile(calib[0], doc, "exec"), env)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6),
                                torch.nn.Linear(6, 3))
    batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,)))
               for _ in range(2)]
    path = str(tmp_path / "calib.safetensors")
    env["calibration_file"](model, batches, torch.nn.functional.cross_entropy,
                            path)
    got = bico.safetensors.read(path)
    assert sorted(got) == ["0.input", "0.output_grad", "1.input",
                           "1.output_grad", "2.input", "2.output_grad"]
    x = torch.cat([b[0] for b in batches]).detach().numpy()
    assert np.array_equal(got["0.input"], x)
    assert got["2.output_grad"].shape == (10, 3)

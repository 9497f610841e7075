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

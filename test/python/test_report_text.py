"""The transfer report's text: written by the library's one JSON writer
(lib/base/json.c) with the report layout (one line per top-level key and per
tensor entry) and single-precision numbers in their shortest form."""
import json
import os
import re

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
import planted as pl  # noqa: E402

from cli import bico  # noqa: E402

NUMBER = re.compile(r'(?<![\w."])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w."])')


def significant(tok):
    m = tok.lstrip("-").lower().split("e")[0].replace(".", "").lstrip("0")
    return len(m.rstrip("0")) or 1


def test_report_layout_and_shortest_float_numbers(tmp_path):
    rng = np.random.default_rng(5)
    shapes = {"l0.weight": (6, 4), "l0.bias": (6,), "l1.weight": (3, 6),
              "l1.bias": (3,)}
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    ft = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
          for k, v in base.items()}
    pl.save(str(tmp_path / "A.st"), base)
    pl.save(str(tmp_path / "Aft.st"), ft)
    rep = tmp_path / "r.json"
    bico("transfer", "--method", "naive", "--quiet", "--alpha", "0.7",
         "--source-base", tmp_path / "A.st", "--source-tuned", tmp_path / "Aft.st",
         "--target-base", tmp_path / "A.st", "--output", tmp_path / "o.st",
         "--report", rep)
    text = rep.read_text()
    doc = json.loads(text)
    assert text.startswith("{\n  \"") and text.endswith("\n}\n")
    lines = text.splitlines()
    # one line per tensor entry, each a complete JSON object
    entries = [ln.strip().rstrip(",") for ln in lines if ln.startswith('    {"name"')]
    assert len(entries) == len(doc["tensors"]) == len(shapes)
    assert [json.loads(e)["name"] for e in entries] == [t["name"] for t in doc["tensors"]]
    assert '"alpha": 0.7' in text   # not 0.699999988
    floats = [t for t in NUMBER.findall(text) if re.search(r"[.eE]", t)]
    assert floats, text
    for tok in floats:
        x = np.float32(float(tok))
        assert np.isfinite(x), tok
        p = significant(tok)
        assert p <= 9, tok
        if p > 6:   # one digit fewer would not read back as the same float
            assert np.float32(float(f"{float(x):.{p - 1}g}")) != x, tok

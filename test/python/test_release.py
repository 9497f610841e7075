"""The release as users read it: CHANGELOG.md's newest release section is
the package's version (bico.__version__, include/bico/version.h's), dated,
and release notes rather than a log (at most 400 lines a release); above
it at most one "Unreleased" section (Keep a Changelog's: what the next
release will date); the frozen ABI and Python listings it names exist."""
import datetime
import os
import re

import bico

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_the_newest_section_is_this_version_and_dated():
    text = open(os.path.join(ROOT, "CHANGELOG.md")).read()
    heads = re.findall(r"^## (.+)$", text, re.M)
    if heads and heads[0] == "Unreleased":
        heads = heads[1:]
    assert heads, "no release section"
    assert "Unreleased" not in heads, "an Unreleased section below a release"
    m = re.match(r"(\d+\.\d+\.\d+) \((\d{4}-\d{2}-\d{2})\)$", heads[0])
    assert m, "the newest section is not 'X.Y.Z (YYYY-MM-DD)': %r" % heads[0]
    datetime.date.fromisoformat(m.group(2))
    assert m.group(1) == bico.__version__
    hdr = open(os.path.join(ROOT, "include", "bico", "version.h")).read()
    parts = [re.search(r"#define BICO_VERSION_%s (\d+)" % k, hdr).group(1)
             for k in ("MAJOR", "MINOR", "PATCH")]
    assert m.group(1) == ".".join(parts)
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    for sec in sections:
        assert len(sec.splitlines()) <= 400, sec.splitlines()[0]
    for f in ("abi/libbico.so.%s.abi" % parts[0],
              "abi/python-%s.txt" % parts[0]):
        assert os.path.isfile(os.path.join(ROOT, f)), f

"""The size options' one grammar (issue 25): --max-shard-size and
--solve-memory of `bico transfer` and --max-shard-size of `bico merge` take
the same byte counts (tools/bico/cli.c's cli_bytes: a number with K, M, G,
KiB, MiB, GiB or KB, MB, GB), and their range is the library's
(set_param), said in the option's words: a bad unit, an overflowing
count and a count out of the library's bounds are usage errors (exit 2)
naming the option and the value as given, never the library's function."""
import os

import pytest

from cli import bico  # noqa: E402


def _cmd(tmp_path, which, opt, value):
    missing = [str(tmp_path / n) for n in ("a.safetensors", "b.safetensors",
                                           "c.safetensors")]
    out = str(tmp_path / "out.safetensors")
    if which == "merge":
        args = ["merge", "--base", missing[0], "--tuned", missing[1],
                "--output", out]
    else:
        args = ["transfer", "--method", "naive", "--source-base", missing[0],
                "--source-tuned", missing[1], "--target-base", missing[2],
                "--output", out]
    return bico(*args, opt, value, "-q" if which == "transfer" else "--quiet",
                ok=False)


CASES = [("transfer", "--max-shard-size"), ("transfer", "--solve-memory"),
         ("merge", "--max-shard-size")]


@pytest.mark.parametrize("which,opt", CASES)
def test_every_size_option_takes_every_unit(tmp_path, which, opt):
    # Parsed and in range: the run goes on to the (missing) files, exit 1.
    for v in ("4096", "1.5K", "2M", "1G", "1KiB", "3MiB", "1GiB", "1KB",
              "5MB", "2GB", "8Kb", "0"):
        r = _cmd(tmp_path, which, opt, v)
        assert r.returncode == 1, (opt, v, r.stderr)
        assert "cannot open" in r.stderr, (opt, v, r.stderr)


@pytest.mark.parametrize("which,opt", CASES)
def test_bad_units_are_usage_errors_naming_the_option(tmp_path, which, opt):
    for v in ("12Q", "5XB", "GB", "1e3", "0x10", "1.2.3", "5 GB", ""):
        r = _cmd(tmp_path, which, opt, v)
        assert r.returncode == 2, (opt, v, r.stderr)
        assert "%s %s: expected bytes" % (opt, v) in r.stderr, r.stderr
        assert not os.path.exists(tmp_path / "out.safetensors")


@pytest.mark.parametrize("which,opt", CASES)
def test_the_range_is_the_librarys_said_with_the_option(tmp_path, which, opt):
    name = opt[2:].replace("-", "_")        # the library's parameter name
    for v in ("-3", "1.5",                    # below 0; a fraction of a byte
              "9000000000000K",               # 2^53 < 9.216e15 bytes
              "99999999999999999999G",        # overflows 64 bits
              "9" * 80):                      # overflows a double
        r = _cmd(tmp_path, which, opt, v)
        assert r.returncode == 2, (opt, v, r.stderr)
        assert "%s %s: %s = " % (opt, v, name) in r.stderr, r.stderr
        assert "is outside [0, 9.0072e+15]" in r.stderr, r.stderr
        assert "set_param" not in r.stderr, r.stderr
        assert not os.path.exists(tmp_path / "out.safetensors")

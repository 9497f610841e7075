"""The command's messages in the user's words (issue 25).  cli_user_message
strips the library's API names ("stfile_open: ", "transfer_run: ") and only
those: a user's file named like one (lowercase words joined by "_", no
dot: "task_a") stays in the message, with the option that named it.  And
no `bico transfer` message speaks of the library's lending calls (a
command line lends nothing)."""

from cli import BICO  # noqa: E402

import subprocess  # noqa: E402


def _run(cwd, *args):
    return subprocess.run([BICO, *args], capture_output=True, text=True,
                          cwd=cwd)


def test_a_file_named_like_a_function_stays_in_the_message(tmp_path):
    for args, opt in (
            (["merge", "--base", "task_a", "--tuned", "tuned_b.safetensors",
              "--output", "out.safetensors", "--quiet"], "--base"),
            (["merge", "--base", "base.safetensors", "--tuned", "task_b",
              "--output", "out.safetensors", "--quiet"], "--tuned"),
            (["transfer", "--method", "naive", "--source-base", "src_base",
              "--source-tuned", "b.safetensors", "--target-base",
              "c.safetensors", "--output", "out.safetensors", "-q"],
             "--source-base")):
        if opt != "--base":
            # the base must open for merge to reach its input
            import numpy as np
            from bico import safetensors as st
            st.write(str(tmp_path / "base.safetensors"),
                     {"l.weight": np.zeros((2, 2), np.float32)})
        r = _run(tmp_path, *args)
        assert r.returncode == 1, r.stderr
        name = args[args.index(opt) + 1]
        # merge names the option of the path; transfer's library names the
        # file by its slot ("the source base file NAME"), said as the option
        form = "%s %s: cannot open" if args[0] == "transfer" else \
            "%s: %s: cannot open"
        assert form % (opt, name) in r.stderr, r.stderr
        # the library's own function names are still stripped
        assert "stfile_open" not in r.stderr and "_run:" not in r.stderr, \
            r.stderr
        assert not (tmp_path / "out.safetensors").exists()


def test_the_missing_statistics_are_said_in_option_words(tmp_path):
    r = _run(tmp_path, "transfer", "--method", "bico", "--source-base",
             "a.safetensors", "--source-tuned", "b.safetensors",
             "--target-base", "c.safetensors", "--output", "o.safetensors")
    assert r.returncode == 2, r.stderr
    assert "--source-calib and --target-calib, or --stats" in r.stderr, \
        r.stderr
    assert "lent" not in r.stderr and "bico_" not in r.stderr, r.stderr

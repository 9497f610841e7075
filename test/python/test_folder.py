"""bico.folder (include/bico/folder.h, issue 32): a Python front end's
output folders by the library's rules.  Every check looks from outside:
the folders' names and bytes, another process holding the lock, and the
library's messages."""
import os
import subprocess
import sys
import textwrap

import pytest

bico = pytest.importorskip("bico")
import bico.folder as bf  # noqa: E402
import bico.safetensors as bst  # noqa: E402

np = pytest.importorskip("numpy")


def listing(d):
    return sorted(os.listdir(str(d)))


def tree(d):
    """{relative path: bytes} of every file under d."""
    out = {}
    for root, _, files in os.walk(str(d)):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, str(d))] = open(p, "rb").read()
    return out


def leftovers(d):
    return [n for n in listing(d) if ".bico-" in n]


@pytest.fixture()
def inputs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights")
    ad = tmp_path / "ad"
    ad.mkdir()
    (ad / "adapter_config.json").write_text('{"r": 4}')
    (ad / "adapter_model.safetensors").write_bytes(b"factors")
    return src, ad


@pytest.mark.parametrize("spelling", [
    lambda d: "ad", lambda d: "./ad", lambda d: "ad/", lambda d: "./ad/.",
    lambda d: str(d / "ad"), lambda d: "adlink", lambda d: "adlink/",
    lambda d: "src/../ad",
])
def test_an_output_that_is_an_input_is_refused_whatever_the_spelling(
        tmp_path, inputs, monkeypatch, spelling):
    src, ad = inputs
    os.symlink("ad", str(tmp_path / "adlink"))
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    ran = []
    with pytest.raises(bico.BicoError) as e:
        with bf.Output(spelling(tmp_path), inputs=[("--lora", "ad"),
                                                   ("--source", "src")],
                       replace=True, what="--output-lora"):
            ran.append(1)
    assert not ran, "the block ran: nothing may be loaded or written"
    assert e.value.status == bico.E_ARG
    assert "is the same folder as the --lora ad" in e.value.message
    assert "nothing was written" in e.value.message
    assert tree(tmp_path) == before
    assert leftovers(tmp_path) == []


def test_an_output_holding_an_input_or_an_input_file_is_refused(
        tmp_path, inputs, monkeypatch):
    src, ad = inputs
    monkeypatch.chdir(tmp_path)
    for out, inp, words in [
            (".", None, "the output folder . is the working directory"),
            ("./", None, "the output folder . is the working directory"),
            (".", "src/config.json", "holds the text src/config.json"),
            (str(tmp_path), "src/config.json", "holds the text"),
            ("src/config.json", "src", "is a file, not a folder")]:
        with pytest.raises(bico.BicoError) as e:
            with bf.Output(out, inputs=[("text", inp)] if inp else [],
                           replace=True):
                pass
        assert words in e.value.message, e.value.message
    assert tree(src) == {"config.json": b"{}", "model.safetensors": b"weights"}


def test_output_files_are_checked_by_the_rule_and_never_written(
        tmp_path, inputs, monkeypatch):
    # Run(files=...): bico_folder_add_file, checked at entry, before the
    # block runs; the run never creates the file.
    src, ad = inputs
    monkeypatch.chdir(tmp_path)
    os.symlink("src/model.safetensors", str(tmp_path / "wlink"))
    os.mkfifo(str(tmp_path / "fifo"))
    before = tree(tmp_path / "src")
    for out, words in [
            ("src/model.safetensors", "inside the model folder of the "
             "--source src"),
            ("wlink", "inside the model folder of the --source src"),
            ("src/../src/config.json", "inside the model folder"),
            ("ad/stats.safetensors", "inside the model folder of the --lora"),
            ("fifo", "is a FIFO"),
            ("out/s.safetensors", "inside the --output-lora folder out")]:
        ran = []
        with pytest.raises(bico.BicoError) as e:
            with bf.Run(inputs=[("--source", "src"), ("--lora", "ad")],
                        outputs=[("--output-lora", "out")],
                        files=[("--stats", out)]):
                ran.append(1)
        assert not ran and e.value.status == bico.E_ARG, out
        assert words in e.value.message and out in e.value.message, \
            e.value.message
    assert tree(tmp_path / "src") == before
    with bf.Run(inputs=[("--source", "src")], files=["s.safetensors"]):
        assert not os.path.exists("s.safetensors")
        bst.write("s.safetensors", {"t": np.ones(2, np.float32)})
    assert "s.safetensors" in listing(tmp_path) and leftovers(tmp_path) == []


def test_a_non_empty_folder_is_refused_unless_replace_or_carry(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "adapter_config.json").write_text("user's")
    with pytest.raises(bico.BicoError) as e:
        with bf.Output(out, what="--output-lora") as tmp:
            open(os.path.join(tmp, "x"), "w").close()
    assert e.value.status == bico.E_ARG
    assert "the --output-lora folder" in e.value.message
    assert "is not empty (it holds adapter_config.json" in e.value.message
    assert tree(out) == {"adapter_config.json": b"user's"}
    (out / "notes.txt").write_text("mine")
    with bf.Output(out, carry=True) as tmp:
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            f.write("new")
    assert tree(out) == {"adapter_config.json": b"new", "notes.txt": b"mine"}
    with bf.Output(out, replace=True) as tmp:
        with open(os.path.join(tmp, "adapter_model.safetensors"), "wb") as f:
            f.write(b"w")
    assert tree(out) == {"adapter_model.safetensors": b"w"}
    assert leftovers(tmp_path) == []
    with pytest.raises(ValueError):
        bf.Output(out, replace=True, carry=True)


def test_an_exception_inside_leaves_the_old_folder_whole(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "adapter_config.json").write_text('{"r": 4}')
    (out / "adapter_model.safetensors").write_bytes(b"rank 4")
    before = tree(out)
    seen = []
    with pytest.raises(RuntimeError, match="half-way"):
        with bf.Output(out, replace=True) as tmp:
            seen.append(tmp)
            assert os.path.dirname(tmp) == str(tmp_path)
            assert os.path.basename(tmp).startswith(".out.bico-tmp.")
            with open(os.path.join(tmp, "adapter_model.safetensors"), "wb") as f:
                f.write(b"rank 8")
            raise RuntimeError("failed half-way")
    assert tree(out) == before
    assert not os.path.exists(seen[0])
    assert leftovers(tmp_path) == []
    # and without one, the new folder replaces it whole
    with bf.Output(out, replace=True) as tmp:
        for n in ("adapter_config.json", "adapter_model.safetensors"):
            with open(os.path.join(tmp, n), "w") as f:
                f.write("new " + n)
    assert tree(out) == {n: ("new " + n).encode() for n in
                         ("adapter_config.json", "adapter_model.safetensors")}


HOLDER = textwrap.dedent("""
    import sys
    import bico.folder as bf
    with bf.Run(outputs=[("--output", sys.argv[1], "carry")]):
        print("held", flush=True)
        sys.stdin.readline()
""")


def test_a_second_process_is_refused_naming_the_holder_or_waits(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(bico.__file__))] +
        env.get("PYTHONPATH", "").split(os.pathsep))
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "held"
        assert (tmp_path / ".out.bico-lock").read_text().startswith(
            "%d\n" % p.pid)
        for spelling in (out, str(out) + "/", tmp_path / "." / "out"):
            with pytest.raises(bico.BicoError) as e:
                with bf.Output(spelling):
                    pass
            assert e.value.status == bico.E_IO
            m = e.value.message
            assert "being written by another run (pid %d" % p.pid in m, m
            assert "-c" in m and "bico.folder" in m, m  # its command line
        # the model folder writer is refused as well (another process)
        with pytest.raises(bico.BicoError) as e:
            bst.write(str(out) + "/", {"w": np.ones(3, np.float32)})
        assert "being written by another run" in e.value.message
        p.stdin.write("go\n")
        p.stdin.flush()
        # waiting: goes through once the holder lets go
        with bf.Output(out, carry=True, wait=600) as tmp:
            open(os.path.join(tmp, "done"), "w").close()
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    assert p.returncode == 0
    assert listing(out) == ["done"]
    assert leftovers(tmp_path) == []


def test_the_model_folder_writer_joins_the_runs_lock(tmp_path):
    """bico.safetensors.write into an output of an open Run is written
    under the run's lock (no deadlock, no refusal); a second Run of this
    process is refused."""
    src = tmp_path / "src"
    src.mkdir()
    out = tmp_path / "out"
    ad = tmp_path / "adapter"
    with bf.Run(inputs=[("--source", src)],
                outputs=[("--output", out, "carry"),
                         ("--output-lora", ad, "refuse")]) as run:
        bst.write(str(out) + "/", {"w": np.arange(3, dtype=np.float32)})
        assert (tmp_path / ".out.bico-lock").exists()
        with pytest.raises(bico.BicoError) as e:
            with bf.Output(out, carry=True):
                pass
        assert "already being written by this process" in e.value.message
        tmp = run.path(1)
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            f.write("{}")
        assert not ad.exists(), "not before the commit"
    assert run.kept == [None, None]
    assert listing(out) == ["model.safetensors"]
    assert listing(ad) == ["adapter_config.json"]
    assert leftovers(tmp_path) == []
    t = bst.read(str(out))
    assert np.array_equal(t["w"], np.arange(3, dtype=np.float32))


def test_policies_and_bad_arguments_are_named():
    assert set(bf.POLICIES) == {"refuse", "replace", "carry"}
    with pytest.raises(bico.BicoError) as e:
        bf.Run(outputs=[("o", "x", "keep")]).__enter__()
    assert "policy" in str(e.value)
    with pytest.raises(TypeError):
        bf.Run(inputs=[("a", "b", "c")])
    with pytest.raises(ValueError):
        bf.Run().path(0)
    c = bico.Context()
    c.folder_wait = 2.5
    assert c.folder_wait == 2.5
    with pytest.raises(bico.BicoError):
        c.folder_wait = -1

"""bico-mpi on a pair whose tokenizers differ (test/python/test_vocab_map.py's
plant): the assembled report, vocabulary counts included, is the single
process's byte for byte, and so is the checkpoint."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
import test_mpi as tm  # noqa: E402
import test_vocab_map as vm  # noqa: E402


def test_vocab_counts_in_the_assembled_report(tmp_path):
    vm._pair(tmp_path)
    common = ["transfer", "--alpha", "1", "--method", "bico", "--source-base", tmp_path / "A",
              "--source-tuned", tmp_path / "Aft", "--target-base", tmp_path / "B",
              "--source-calib", tmp_path / "calA.safetensors",
              "--target-calib", tmp_path / "calB.safetensors"]
    tm.serial(*common, "--output", tmp_path / "s.safetensors", "--report", tmp_path / "s.json",
              "--quiet")
    tm.mpi(2, *common, "--output", tmp_path / "m.safetensors", "--report", tmp_path / "m.json",
           env={"BICO_MPI_RANK0_SHARE": "0.5"})
    assert open(tmp_path / "m.json", "rb").read() == open(tmp_path / "s.json", "rb").read()
    assert open(tmp_path / "m.safetensors", "rb").read() == open(tmp_path / "s.safetensors", "rb").read()
    assert b'"vocab"' in open(tmp_path / "m.json", "rb").read()

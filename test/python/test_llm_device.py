"""The distillation's device path, run on the CPU (no GPU here): the code
that runs on a GPU creates its tensors on the model's device and reads
nothing back to the host while it trains.

Two independent witnesses, neither part of the code under test:
PyTorch's "meta" device (tensors with shapes and no values: an operation
that mixes a meta tensor with a CPU one, or reads a value back to the
host, raises), and PyTorch's dispatcher (every host read of a tensor's
value, float(t), t.item(), t.tolist() of a device tensor, goes through
aten::_local_scalar_dense, which a TorchDispatchMode sees).  Each
witness's power is shown on a planted host read."""
import os
import subprocess
import sys
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bico.llm as llm
from bico.llm import distill as LD
from bico.llm import runtime as rt
from bico.llm.command.arguments import _parser
from bico.llm.command.inputs import _streamed, _streamed_teacher
from bico.llm.stream import teacher as stream_teacher
from bico.torch import distill as D

import llm_pair  # noqa: E402,F401  (test/e2e, on the path: conftest.py)

torch.set_num_threads(1)
META = torch.device("meta")
# the meta witness raises PyTorch's C++ exceptions on purpose; preloaded
# into an uninstrumented Python (make check SANITIZE=1), AddressSanitizer's
# __cxa_throw interceptor has no real function to call and aborts the
# process there.  The plain run checks these.
_CXX_THROWS = pytest.mark.skipif(
    "asan" in os.environ.get("LD_PRELOAD", ""),
    reason="a C++ exception under preloaded AddressSanitizer")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("device")
    llm_pair.make(str(d))
    cal = llm.text_batches(str(d / "task.txt"), 32, n=12,
                          tokenizer=str(d / "B"), batch_size=4)
    return d, cal


class _HostReads(TorchDispatchMode):
    """Counts the operations that read a tensor's value back to the host,
    but PyTorch's optimizers' own: Adam keeps its step count in a CPU
    tensor on every device (its non-capturable mode) and reads that."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "_local_scalar_dense" in str(func) and not any(
                os.sep + os.path.join("torch", "optim") + os.sep in
                f.filename for f in traceback.extract_stack(limit=8)):
            self.n += 1
        return func(*args, **(kwargs or {}))


@_CXX_THROWS
def test_the_witnesses_see_a_host_read():
    """The planted host read: meta refuses it, the dispatcher counts it,
    and a CPU tensor mixed into a meta computation is refused."""
    with pytest.raises((NotImplementedError, RuntimeError)):
        float(torch.ones((), device=META))
    with pytest.raises(RuntimeError):
        torch.ones(3, device=META) + torch.ones(3)
    with _HostReads() as h:
        float(torch.ones(()) * 2)
        torch.ones(3).sum().item()
    assert h.n == 2


def _teacher(d, xs, k):
    folders = [str(d / n) for n in ("A", "A_ft", "B")]
    return stream_teacher.build(*folders, xs, dtype=torch.float32, k=k)


@_CXX_THROWS
@pytest.mark.parametrize("k,checkpoint", [(None, False), (7, True)])
def test_a_training_step_runs_on_the_models_device(pair, k, checkpoint):
    """One step of the command's training (bico.torch.distill._step: the
    student's chunked logits, the teacher's KL, the text loss, the
    backward, with and without the layers checkpointed) and Adam's update
    with the target and its factors on the meta device: every tensor the
    step makes is made there (a CPU one would be refused) and nothing is
    read back (a read would be refused)."""
    d, cal = pair
    xs = [x for x, _ in cal.batches]
    ys = [y for _, y in cal.batches]
    teacher = _teacher(d, xs, k)
    try:
        tgt = llm.load_model(str(d / "B"), dtype=torch.float32).to(META)
        ad = D.Adapter(tgt, LD.lora_modules(tgt), 4)
        params = ad.parameters()
        assert all(p.device == META for p in params)
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=1e-3)
        for i in range(len(xs)):
            opt.zero_grad(set_to_none=True)
            v = D._step(tgt, teacher, [x.to(META) for x in xs],
                        [y.to(META) for y in ys], i, META, None, 5,
                        checkpoint, 0.5, 1.0, None)
            assert v.device == META and v.dim() == 0
            assert all(p.grad is not None and p.grad.device == META
                       for p in params)
            opt.step()
        assert all(p.device == META for p in params)
        # the host read that a step must not make is refused here
        with pytest.raises((NotImplementedError, RuntimeError)):
            float(v)
    finally:
        teacher.close()


def test_the_training_loop_reads_nothing_back_between_checks(pair):
    """bico.torch.distill.distill on the CPU, counted by the dispatcher:
    the steps between the held-out checks read no value back (the loss,
    its finiteness, the progress all stay on the device until a check);
    the checks themselves do (the held-out losses)."""
    d, cal = pair
    xs = [x for x, _ in cal.batches]
    ys = [y for _, y in cal.batches]
    held = [x for x, _ in cal.held_out]
    teacher = _teacher(d, xs, 7)
    tgt = llm.load_model(str(d / "B"), dtype=torch.float32)
    ad = D.Adapter(tgt, LD.lora_modules(tgt), 4)
    seen = []
    with _HostReads() as h:
        def held_losses(m):
            out = D.window_losses(m, [(x, y) for x, y in cal.held_out])
            seen.append(("checked", h.n))
            return out

        def progress(i, n, v):
            seen.append((i, h.n))
        D.distill(tgt, teacher, xs, len(held), held_losses, adapter=ad,
                  training=D.Training(steps=9, every=4, text_weight=0.5),
                  progress=progress, targets=ys, checkpoint=False)
    teacher.close()
    steps = [(i, n) for i, n in seen if i != "checked"]
    assert [i for i, _ in steps] == list(range(1, 10))
    before = dict(steps)
    before[0] = seen[0][1]          # after the untouched target's check
    for i in range(1, 10):
        grew = before[i] - before[i - 1]
        if i % 4 and i != 9:
            assert grew == 0, "step %d read %d values back" % (i, grew)
        else:
            assert grew > 0          # a check reads its losses
    # a loss that is not finite is still refused, at the next check
    tgt2 = llm.load_model(str(d / "B"), dtype=torch.float32)
    with torch.no_grad():
        tgt2.model.norm.weight.fill_(float("nan"))
    ad2 = D.Adapter(tgt2, LD.lora_modules(tgt2), 4)
    teacher = _teacher(d, xs, 7)
    try:
        with pytest.raises(Exception, match="the loss at step 1 is nan"):
            D.distill(tgt2, teacher, xs, len(held), lambda m: [1.0],
                      adapter=ad2, training=D.Training(steps=6, every=3),
                      checkpoint=False)
    finally:
        teacher.close()


def test_the_teacher_blocks_run_on_the_device_they_are_given(pair):
    """The streamed teacher's block loop (each model from its folder, a
    block at a time) on the meta device: the embedding rows, every block,
    the final norm run there and the boundary states stay there."""
    d, cal = pair
    xs = [x for x, _ in cal.batches]
    f = rt.Folder(str(d / "B"), torch.float32)
    ticks = []
    try:
        with rt.SpillStore(1 << 30) as store:
            stream_teacher._final_states(f, 0, xs, store, lambda:
                                         ticks.append(1), META)
            keys = store.keys()
            assert sorted(keys) == sorted((0, "n", b) for b in
                                          range(len(xs)))
            for key in keys:
                t = store.get(key)
                assert t.device == META
                assert t.shape == xs[key[2]].shape + (f.d,)
    finally:
        f.close()
    assert len(ticks) == f.L


def _args(*extra):
    return _parser("bico.llm").parse_args(
        ["--source", "A", "--source-tuned", "A_ft", "--target", "B",
         "--text", "t.txt", "--output-lora", "out"] + list(extra))


def test_the_distillation_on_a_device_streams_its_teacher():
    """--method distill on --device cuda takes the streamed teacher's
    route (the three models a block at a time, then the target alone),
    not the whole models; fit and auto on a GPU hold them whole."""
    assert _streamed_teacher(_args("--method", "distill", "--device",
                                   "cuda:0"))
    assert _streamed_teacher(_args("--method", "distill"))
    assert not _streamed_teacher(_args("--method", "distill", "--device",
                                       "cuda", "--in-memory"))
    assert not _streamed(_args("--method", "auto", "--device", "cuda"))
    assert _streamed(_args("--method", "auto"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_a_device_that_is_not_there_is_refused_before_anything(pair,
                                                                tmp_path):
    """--device cuda without CUDA: exit 2, saying so, nothing written."""
    d, _ = pair
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "bico.llm", "--method", "distill",
         "--device", "cuda", "--source", str(d / "A"), "--source-tuned",
         str(d / "A_ft"), "--target", str(d / "B"), "--text",
         str(d / "task.txt"), "--output-lora", str(out)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2, r.stderr
    assert "--device cuda" in r.stderr and "CUDA" in r.stderr
    assert not out.exists()

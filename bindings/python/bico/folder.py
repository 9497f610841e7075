"""include/bico/folder.h: output folders committed in one step, by the
library's rules (the same as `bico transfer`'s), so that a Python front end
keeps no copy of them.

One folder, written whole (an adapter, a converted model):

    import bico.folder
    with bico.folder.Output("out/adapter", inputs=[("--lora", "ad"),
                                                   ("--source", "src")]) as tmp:
        ...load the inputs, compute...
        save_files(tmp)        # adapter_model.safetensors, adapter_config.json
    # left without an exception: swapped in whole; with one: nothing changed

Several outputs, checked and locked before anything is loaded, some
written through the library's own writers (which join the run's lock):

    with bico.folder.Run(inputs=[("--source", src), ("--target", tgt)],
                         outputs=[("--output", out, "carry"),
                                  ("--output-lora", ad, "refuse")]) as run:
        ...
        bico.safetensors.write(out, tensors, like=tgt)   # under the lock
        save_adapter(run.path(1))                        # committed at exit

Output files the caller writes itself (a statistics file), checked by
the same rule before anything is loaded:

    with bico.folder.Run(inputs=[("--target", tgt), ("--text", txt)],
                         files=[("--output", "stats.safetensors")]):
        ...
        bico.safetensors.write("stats.safetensors", tensors)

What is refused (BicoError with the library's message naming the role
and path, nothing written; see folder.h): an output folder that is, or
holds at any depth, an input or another output, whatever the spelling
("./x", "x/", symbolic links); an output file that is an input or another
output, lies inside an output folder or an input folder (a shard,
config.json of a model folder the run reads), or is not a regular file
(a folder, a FIFO); an existing output that is not a folder; a
dangling link; a mount point or a folder holding one; the working
directory or a folder holding it; an existing folder that holds anything
under the policy "refuse" (the default: replace=True or "replace" drops the
old contents, "carry" keeps the old entries the new folder lacks); an
output folder another process is writing (the run's lock: its pid, how
long, its command), unless wait= seconds let it finish first.
"""
import ctypes
import os

from . import _args as A
from ._ctx import Context
from ._enums import FOLDER_POLICIES, choose
from ._handle import _Handle
from ._lib import fn, c_char_p, c_size_t, c_void_p
from ._status import check as _check

__all__ = ["Folder", "Run", "Output", "POLICIES"]

POLICIES = tuple(FOLDER_POLICIES)


def _enc(s, name):
    return A.cstr(s, name, path=True)


class Folder(_Handle):
    """bico_folder: the handle itself (Run and Output wrap it)."""
    _free = staticmethod(fn.folder_free)

    def __init__(self, ctx=None):
        ctx = Context() if ctx is None else ctx
        h = c_void_p()
        _check(fn.folder_create(ctx._alive(), ctypes.byref(h)), ctx)
        self._adopt(h.value, ctx)

    def add_input(self, path, what=None):
        """An input of the run: a file or a folder."""
        _check(fn.folder_add_input(
            self._alive(), None if what is None else _enc(what, "what"),
            _enc(path, "input path")), self.ctx)

    def add_file(self, path, what=None):
        """An output file of the run: checked at begin by the same rule
        (not an input, not inside an input model folder or an output
        folder, a regular file or nothing), never written by the handle:
        the caller writes it (bico.safetensors.write) once begun."""
        _check(fn.folder_add_file(
            self._alive(), None if what is None else _enc(what, "what"),
            _enc(path, "output file path")), self.ctx)

    def add_output(self, path, what=None, policy="refuse"):
        """An output folder; policy "refuse" (default), "replace" or
        "carry".  Returns its index."""
        p = choose(FOLDER_POLICIES, policy, "policy")
        k = c_size_t()
        _check(fn.folder_add_output(
            self._alive(), None if what is None else _enc(what, "what"),
            _enc(path, "output path"), p, ctypes.byref(k)), self.ctx)
        return k.value

    def begin(self):
        """The checks and the locks (held until close)."""
        _check(fn.folder_begin(self._alive()), self.ctx)

    def path(self, index=0):
        """The new hidden folder beside output `index` (made on the first
        call): write the whole folder into it."""
        out = c_char_p()
        _check(fn.folder_path(self._alive(), index, ctypes.byref(out)),
               self.ctx)
        return os.fsdecode(out.value)

    def commit(self):
        """Swaps in every output whose path() was asked for."""
        _check(fn.folder_commit(self._alive()), self.ctx)

    def kept(self, index=0):
        """After commit: where output `index`'s old tree was kept (entries
        that could not be placed in the new folder), or None."""
        out = c_char_p()
        _check(fn.folder_kept(self._alive(), index, ctypes.byref(out)),
               self.ctx)
        return None if out.value is None else os.fsdecode(out.value)


def _pair(item, default_what):
    """(what, path) from a path or a (what, path) pair."""
    if isinstance(item, (tuple, list)):
        if len(item) != 2:
            raise TypeError("an input is a path or a (what, path) pair, got "
                            "%r" % (item,))
        return item[0], item[1]
    return default_what, item


class Run(object):
    """A run's inputs and output folders: checked by identity and locked
    on entry (before the caller loads anything), committed on a clean exit,
    discarded on an exception; the locks are let go on exit either way.

    inputs:  paths, or (what, path) pairs (what names the role in
             messages: "--source", "source model").
    outputs: paths, or (what, path) / (what, path, policy) tuples; policy
             "refuse" (default), "replace" or "carry".
    files:   output files, paths or (what, path) pairs: checked on entry
             by the same rule (not an input, nor the same file as another
             output, nor inside an output folder or directly in an input
             model folder; a regular file or nothing), never written by
             the run: the caller writes them (bico.safetensors.write).
    wait:    seconds to wait for another process writing an output folder
             (default 0: refuse at once, naming it).
    Inside the block, path(i) is the new folder of output i; an output
    whose path() is never asked for is left as it is by the commit (the
    library's writers, bico.safetensors.write with a folder, write it under
    the run's lock).  After the block, kept[i] names output i's old tree
    when it had to be kept (else None)."""

    def __init__(self, inputs=(), outputs=(), wait=0, ctx=None, files=()):
        self._ctx = Context() if ctx is None else ctx
        self._inputs = [_pair(i, "input") for i in inputs]
        self._files = [_pair(i, "output file") for i in files]
        self._outputs = []
        for o in outputs:
            if isinstance(o, (tuple, list)):
                if len(o) not in (2, 3):
                    raise TypeError("an output is a path or a (what, path[, "
                                    "policy]) tuple, got %r" % (o,))
                self._outputs.append((o[0], o[1],
                                      o[2] if len(o) == 3 else "refuse"))
            else:
                self._outputs.append(("output", o, "refuse"))
        self._wait = wait
        self._f = None
        self.kept = [None] * len(self._outputs)

    def __enter__(self):
        if self._wait:
            self._ctx.folder_wait = self._wait
        f = Folder(self._ctx)
        try:
            for what, path in self._inputs:
                f.add_input(path, what)
            for what, path, policy in self._outputs:
                f.add_output(path, what, policy)
            for what, path in self._files:
                f.add_file(path, what)
            f.begin()
        except BaseException:
            f.close()
            raise
        self._f = f
        return self

    def path(self, index=0):
        """The new folder of output `index` (absolute; made on first use)."""
        if self._f is None:
            raise ValueError("Run.path: the run is not open (use `with`)")
        return self._f.path(index)

    def __exit__(self, exc_type, exc, tb):
        f, self._f = self._f, None
        try:
            if exc_type is None:
                f.commit()
                self.kept = [f.kept(i) for i in range(len(self._outputs))]
        finally:
            f.close()
        return False


class Output(object):
    """One output folder written whole: `with Output(dir, inputs=[...]) as
    tmp:` gives the new folder to write into; a clean exit swaps it in,
    an exception leaves the old folder as it was.  replace=True drops the
    old folder's contents; carry=True keeps its entries the new folder
    lacks; neither: an existing folder that holds anything is refused
    before the block runs.  what names the output in messages."""

    def __init__(self, path, inputs=(), replace=False, carry=False,
                 what="output", wait=0, ctx=None):
        if replace and carry:
            raise ValueError("Output: replace and carry exclude each other")
        policy = "replace" if replace else "carry" if carry else "refuse"
        self._run = Run(inputs, [(what, path, policy)], wait=wait, ctx=ctx)
        self.kept = None

    def __enter__(self):
        self._run.__enter__()
        try:
            return self._run.path(0)
        except BaseException as e:
            self._run.__exit__(type(e), e, e.__traceback__)
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            return self._run.__exit__(exc_type, exc, tb)
        finally:
            self.kept = self._run.kept[0]

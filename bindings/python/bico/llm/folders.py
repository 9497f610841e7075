"""bico.llm.folders: transfer_model on Hugging Face model folders.

    import bico.llm as bl
    cal = bl.text_batches("B/", "task.txt")
    bl.transfer_model("A/", "A_ft/", "B/", cal.batches, method="fit",
                      output="B_ft/")

bico.torch.transfer_model takes nn.Modules; this one takes model folders
too (bico.torch imports nothing of bico.llm, so the folders are read
here): method "fit" streams the models from the folders a block at a
time (stream.route), any other method, or stream=False, loads them whole
(load_model, float32) and runs bico.torch.transfer_model on them.
"""
from dataclasses import dataclass

from .._status import BicoError, E_ARG

__all__ = ["transfer_model", "Streaming"]

_MODELS = ("source", "source_tuned", "target")


@dataclass
class Streaming(object):
    """How the streamed fit holds what it keeps: spill_dir, where the
    calibration states and fitted blocks go beyond memory_budget bytes
    (a nameless temporary file; None: $TMPDIR and the default budget)."""
    spill_dir: object = None
    memory_budget: object = None


def transfer_model(source, source_tuned, target, batches, method="fit",
                   options=None, loss_fn=None, report=None,
                   show_progress=False, output=None, stream=True):
    """bico.torch.transfer_model (method, options, loss_fn, report,
    show_progress as documented there) with model folders for source,
    source_tuned and target.

    method "fit" on folders (stream=True, the default, or a Streaming)
    runs the models a block at a time from the folders: the statistics,
    the fit and the held-out choice never hold a whole model (Llama,
    Mistral, Qwen2 and Gemma folders, batches of token ids, the
    next-token loss); the fit equals the in-memory one's bit for bit on
    the same batches.
    output: a folder to write the result to (the library's folder writer,
    committed in one step; theta_B + alpha delta rounded once to each
    file's dtype); then the return value is a dict of what was chosen,
    else the new state dict, as bico.torch.transfer_model returns it.
    stream: Streaming(spill_dir, memory_budget) where and beyond how many
    bytes the calibration states and fitted blocks go to a nameless
    temporary file.
    Under torchrun (WORLD_SIZE > 1), called on every rank with the same
    arguments, the streamed fit shares the batches among the ranks (a
    gloo group, joined unless it is already; docs/scale-out.md): rank 0
    writes output, every rank returns the same value once it is written.
    Right after joining, every rank's arguments (the batches by their
    tensors' bytes; not threads, spill_dir, memory_budget, show_progress
    or output's path) and a sampled fingerprint of each folder's files
    are compared with rank 0's; a difference raises BicoError (E_ARG) on
    every rank, naming it (bico.llm.ranks.timeouts for the waits).
    stream=False, or another method: the folders are loaded whole
    (load_model, float32) and run in memory; output= is then refused
    (the state dict is returned).  nn.Modules for all three: the same as
    bico.torch.transfer_model."""
    from ..torch import options as _opts
    from ..torch.transfer import _is_folder, transfer_model as modules_route
    folders = [n for n, m in zip(_MODELS, (source, source_tuned, target))
               if _is_folder(m)]
    if stream is True:
        stream = Streaming()
    if stream is not False and not isinstance(stream, Streaming):
        raise BicoError(E_ARG, "transfer_model: stream must be True, False "
                        "or a bico.llm.Streaming, got %s"
                        % type(stream).__name__)
    streamed = method == "fit" and stream is not False
    if folders and len(folders) != len(_MODELS):
        raise BicoError(E_ARG, "transfer_model: %s %s model folders but %s "
                        "not: give three folders or three nn.Modules"
                        % (", ".join(folders),
                           "is a" if len(folders) == 1 else "are",
                           ", ".join(n for n in _MODELS
                                     if n not in folders)))
    if (not streamed or not folders) and output is not None:
        raise BicoError(E_ARG, "transfer_model: output= is the streamed "
                        "fit's (method 'fit' on model folders, stream on); "
                        "this run is in memory")
    if folders and streamed:
        from .stream.route import transfer_folders
        o = _opts.resolve(method, options)
        kw = dict(source=source, source_tuned=source_tuned, target=target,
                  batches=batches, method=method, loss_fn=loss_fn,
                  step=None, forward=None, report=report,
                  show_progress=show_progress, output=output,
                  spill_dir=stream.spill_dir,
                  memory_budget=stream.memory_budget)
        fields = _opts.flat(o)
        library = fields.pop("library")
        kw.update(fields)
        kw.update(library)
        return transfer_folders(kw)
    if folders:
        import torch
        from .families import load_model
        source, source_tuned, target = (
            load_model(m, dtype=torch.float32)
            for m in (source, source_tuned, target))
    return modules_route(source, source_tuned, target, batches,
                         method=method, options=options, loss_fn=loss_fn,
                         report=report, show_progress=show_progress)

"""bico.torch: the PyTorch front end of libbico, for any nn.Module.

    import bico.torch as bt
    col = bt.collect_statistics(source, target, batches, loss_fn,
                                path="stats.safetensors")
    new_sd = bt.transfer_state_dict(source.state_dict(), tuned_sd,
                                    target.state_dict(), col)
    new_sd = bt.transfer_model(source, source_tuned, target, batches,
                               loss_fn=loss_fn)

By concern, one module each:

  collect.py   hooks -> statistics: Collector, collect_statistics,
               default_modules, the nn.MultiheadAttention tap, GradFix's
               collect_votes / save_votes
  transfer.py  transfer_model (options checked, one function per route)
               and transfer_state_dict over a Collector
  choose.py    the held-out choice every route calls: held-out batches,
               per-batch losses, pick (with the standard-error rule),
               choose_alpha
  fit.py       the host of the library's sequential fit (bico_fit_run):
               fit_model, RidgeFit
  proxy.py     proxy-fit and proxy-distill (the proxy-tuned distribution)
  tied.py      tied weights (a head sharing the embedding), found once
  _common.py   progress, batches to a device, the default step / forward

The decoders read from model folders, text windows and adapters live in
bico.llm (families, text, adapters); their functions are also reachable
here (bt.load_model, bt.text_batches, bt.save_adapter, ...), imported on
first use so that bico.torch does not import bico.llm (bico.llm builds on
bico.torch, not the other way round).  Names of the former single module
bico/torch.py, private ones included, resolve to their new homes.
"""
import importlib

from ._common import progress
from .collect import (Collector, collect_statistics, collect_votes,
                      save_votes, default_modules)
from .choose import choose_alpha, HELDOUT_GRID  # noqa: F401
from .transfer import (transfer_state_dict, transfer_model,  # noqa: F401
                       MODEL_METHODS)

__all__ = ["Collector", "collect_statistics", "collect_votes", "save_votes",
           "transfer_state_dict", "transfer_model", "choose_alpha",
           "default_modules", "progress",
           "load_model", "tokenize", "text_batches", "next_token_loss",
           "lm_loss", "save_adapter", "input_covariances", "update_grams",
           "low_rank"]

# name -> the module (relative to this package) that holds it now
_MOVED = {}
for _where, _names in (
        ("..llm.families", ("load_model",)),
        ("..llm.text", ("tokenize", "text_batches", "next_token_loss",
                        "lm_loss")),
        ("..llm.adapters", ("save_adapter", "input_covariances",
                            "update_grams", "low_rank")),
        # the former bico/torch.py's other names, for code that reached in
        (".collect", ("_GradMode", "_NOT_LAST_DIM", "_Site", "_dims",
                      "_grads", "_is_norm", "_kind", "_mha_forward",
                      "_norm_width", "_rows_np", "_samples", "_split_for",
                      "Context", "Procrustes", "Votes", "XCov", "Pairing",
                      "DEFAULT_SPLIT", "BicoError", "E_ARG", "E_NOTFOUND",
                      "E_SHAPE", "E_STATE")),
        ("._common", ("_plain", "_to_device", "_device", "_default_step",
                      "_default_forward", "_output", "_on")),
        (".choose", ("_HELDOUT_METHODS", "_HOLDOUT_AUTO", "_alpha_grid",
                     "_batch_losses", "_choose_heldout", "_heldout_loss_fn",
                     "_loss_available", "_mean_loss", "_resolve_heldout",
                     "_scaled", "_token_ids", "_naive", "_as_numpy")),
        (".tied", ("_tied_groups", "_untied", "_retied", "_report_tied")),
        (".transfer", ("_PROCRUSTES_KEYS", "_apply", "_fit", "_C_METHODS",
                       "_transfer_np")),
        (".fit", ("_input_moments",))):
    for _n in _names:
        _MOVED[_n] = _where
del _where, _names, _n


def __getattr__(name):  # PEP 562: the names above, on first use
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError("module 'bico.torch' has no attribute %r"
                             % (name,))
    return getattr(importlib.import_module(where, __name__), name)


def __dir__():
    return sorted(set(globals()) | set(_MOVED))

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
               fit_model
  ridge.py     the fit's ridge in PyTorch: a prior, a penalty metric, a
               GCV choice (RidgeFit, GCV_GRID)
  proxy.py     proxy-fit and proxy-distill (the proxy-tuned distribution)
  distill.py   method "distill": LoRA factors (Adapter), the training loop
               with the held-out choice, distill_model
  teacher.py   the proxy-tuned teacher kept compactly, the KL to it
  augment.py   the augmentations a classifier's distillation draws
  logits.py    a model's logits a chunk of tokens at a time
  options.py   transfer_model's options, a dataclass per route family
  tied.py      tied weights (a head sharing the embedding), found once
  _common.py   progress, batches to a device, the default step / forward

Model folders, tokenizers, text windows and adapters are bico.llm's
(bico.llm.load_model, text_batches, save_adapter, transfer_model on
folders): bico.llm builds on bico.torch, and bico.torch imports nothing
of bico.llm, by statement or by name.
"""
from ._common import progress
from .collect import (Collector, collect_statistics, collect_votes,
                      save_votes, default_modules)
from .choose import (choose_alpha, choose_on_heldout, Choice,
                     HELDOUT, HOLDOUT, ALPHA_GRID)
from .transfer import (transfer_state_dict, transfer_model,  # noqa: F401
                       MODEL_METHODS)
from .options import (TransferOptions, MapOptions, FitOptions,
                      DistillOptions, options_for)

__all__ = ["Collector", "collect_statistics", "collect_votes", "save_votes",
           "transfer_state_dict", "transfer_model", "choose_alpha",
           "default_modules", "progress", "TransferOptions", "MapOptions",
           "FitOptions", "DistillOptions", "options_for",
           "choose_on_heldout", "Choice", "HELDOUT", "HOLDOUT", "ALPHA_GRID"]

"""bico.llm: decoders from Hugging Face model folders, on top of
bico.torch.

  families.py  config.json -> DecoderLM (Llama, Mistral, Qwen2, Gemma):
               load_model, model_config, RMSNorm, Attention, Mlp,
               DecoderLayer, Model
  text.py      tokenizer.json, tokenize, text_batches (calibration and
               held-out windows), Calibration, next_token_loss, lm_loss
  config.py    config.json checked against itself and the tensors'
               shapes before load_model reads a tensor (check_config)
  adapters.py  PEFT LoRA adapters from fitted updates: save_adapter,
               low_rank, update_grams, input_covariances
  options.py   what the command checks, and its exit status rule (2 a
               user mistake, 1 a failure while running)
  command.py   the command `python3 -m bico.llm` (main), installed as
               bico-llm by make install
  stats.py     its `stats` subcommand: the statistics file of `bico
               transfer --stats` from folders and text

bico.llm may import bico.torch's modules (the transfer, the held-out
choice, tied weights); bico.torch never imports bico.llm (its re-exports
of load_model, text_batches, save_adapter, ... are resolved on first
use).  The command is imported on first use of its names too (from
bico.llm import main), so that reading a folder does not load it.
"""
import importlib

__all__ = ["main"]

# the former single module bico/llm.py's names, now in bico.llm.command
_COMMAND = ("main", "GRID", "_log", "_FitProgress", "_apply",
            "_choose_alpha", "_transformers_loader", "_tuned_from_lora")


def __getattr__(name):  # PEP 562
    if name in _COMMAND:
        return getattr(importlib.import_module(".command", __name__), name)
    raise AttributeError("module 'bico.llm' has no attribute %r" % (name,))


def __dir__():
    return sorted(set(globals()) | set(_COMMAND))

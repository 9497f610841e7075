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
  command/     the command `python3 -m bico.llm` (main), installed as
               bico-llm by make install
  stats.py     its `stats` subcommand: the statistics file of `bico
               transfer --stats` from folders and text
  folders.py   transfer_model on model folders (streamed fit, output=)

The names users call are reachable from the package, each imported from
its module on first use (reading a folder does not load the command):

    import bico.llm as bl
    model = bl.load_model("B/")
    cal = bl.text_batches("B/", "task.txt")
    bl.transfer_model("A/", "A_ft/", "B/", cal.batches, output="B_ft/")

bico.llm builds on bico.torch (the transfer, the held-out choice, tied
weights); bico.torch imports nothing of bico.llm.
"""
import importlib

# public name -> its module in this package
_PUBLIC = {}
for _where, _names in (
        (".families", ("load_model", "model_config", "DecoderLM")),
        (".text", ("tokenize", "detokenize", "load_tokenizer", "text_batches",
                   "Calibration", "next_token_loss", "lm_loss")),
        (".adapters", ("save_adapter", "input_covariances", "update_grams",
                       "low_rank")),
        (".folders", ("transfer_model", "Streaming")),
        (".command", ("main",))):
    for _n in _names:
        _PUBLIC[_n] = _where
del _where, _names, _n

__all__ = sorted(_PUBLIC)


def __getattr__(name):  # PEP 562
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError("module 'bico.llm' has no attribute %r"
                             % (name,))
    return getattr(importlib.import_module(where, __name__), name)


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))

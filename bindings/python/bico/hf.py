"""bico.hf: the former home of the decoder folders, text windows and
adapter writer, kept so that old imports work.  The code lives in
bico.llm.families (load_model, model_config, DecoderLM and its layers),
bico.llm.text (tokenize, text_batches, Calibration, next_token_loss,
lm_loss) and bico.llm.adapters (save_adapter, low_rank, update_grams,
input_covariances); bico.torch re-exports the functions too."""
from .llm.families import (  # noqa: F401
    FAMILIES, _TORCH_DT, _ACT, RMSNorm, _linear, _rotate_half, Attention, Mlp,
    DecoderLayer, Model, _causal_mask, _inv_freq, DecoderLM, model_config,
    _weights_path, load_model, BicoError, E_FORMAT, E_NOTFOUND,
    E_UNSUPPORTED)
from .llm.text import (  # noqa: F401
    _bytes_to_unicode, _tokenizer_file, _byte_level, tokenize, Calibration,
    text_batches, next_token_loss, lm_loss, namedtuple, E_ARG)
from .llm.adapters import (  # noqa: F401
    input_covariances, update_grams, low_rank, _module_names, _tied, _short,
    save_adapter)

__all__ = ["load_model", "model_config", "DecoderLM", "tokenize",
           "text_batches", "Calibration", "next_token_loss", "lm_loss",
           "save_adapter", "input_covariances", "update_grams", "low_rank"]

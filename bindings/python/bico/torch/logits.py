"""bico.torch.logits: a model's logits a chunk of tokens at a time.

For a decoder with a `model` body and an `lm_head` (the Hugging Face
layout) the logits over a large vocabulary never exist for every token at
once: the body runs once, the head a chunk of rows at a time, bounded by
LOGIT_BYTES.  Any other module: its output as it is.
"""
import torch.nn as nn

TOKEN_CHUNK = 1024


def _split(model):
    """(body, head) of a decoder in the Hugging Face layout -- body(ids)
    gives the final hidden states, head a linear map to the vocabulary --
    or None when the model is not one (then the whole output is used)."""
    body, head = getattr(model, "model", None), getattr(model, "lm_head",
                                                         None)
    if isinstance(body, nn.Module) and isinstance(head, nn.Linear):
        return body, head
    return None


def _hidden(body, x):
    h = body(x)
    if hasattr(h, "last_hidden_state"):
        h = h.last_hidden_state
    elif isinstance(h, (tuple, list)):
        h = h[0]
    return h


def _logits_keep(out):
    """The logits of a model's output (.logits, a tuple's first)."""
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out


def _logits(out):
    return _logits_keep(out).float()


# the logits of one chunk stay under this many bytes (float32): at a
# 151 936-token vocabulary 55 tokens a chunk, at 256 the whole TOKEN_CHUNK.
# 32 MiB: a distillation step holds a few such tensors (the logits, their
# log-softmax, the gradient); at 64 MiB a 1.5B-shaped target's step peaked
# 217 MiB higher, past 1.2 x the target and its factors' state
# (docs/performance.md, section 11), for no gain in time.
LOGIT_BYTES = 32 << 20


def _bounded(chunk, head):
    """chunk, fewer tokens when the head's outputs would make one chunk's
    float32 logits larger than LOGIT_BYTES."""
    w = getattr(head, "weight", None)
    if w is None or w.dim() != 2:
        return chunk
    return max(1, min(chunk, LOGIT_BYTES // (4 * max(1, int(w.shape[0])))))


def _chunks(n, size):
    return [(s, min(n, s + size)) for s in range(0, n, size)]

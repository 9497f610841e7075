"""bico.llm.vocab: how the source's and the target's tokenizers relate,
for the distillation across tokenizers.

  "same"       one tokenizer (the same tokenizer.json, or the source folder
               holds none): the teacher softmax(z_B + z_A_ft - z_A) is
               computed token by token on one sequence;
  "grown"      the target's vocabulary extends the source's (every source
               token is a target token of the same id; the target adds
               tokens after them, as Mistral's 32 000 -> 32 768) and the
               task text tokenizes to the same ids with both: the teacher
               is exact on the shared ids, its arithmetic on the source's
               V columns of the target's logits, and the new tokens are
               left to the text's own next-token loss;
  "different"  anything else (a byte-level BPE of the target's own): the
               logits have no common axis, but text has.  The source side
               writes the task text (the fine-tuned source samples from
               prompts of the user's windows in its own tokens), the text
               is decoded and tokenized again with the target's tokenizer,
               and the target learns it with its own next-token loss
               (sequence-level distillation).
"""
import json
import os
from collections import namedtuple

import numpy as np

from .._inputs import read_input
from .text import TOKENIZER_LIMIT, load_tokenizer

__all__ = ["Relation", "relation", "RELATIONS"]

RELATIONS = ("same", "grown", "different")

Relation = namedtuple("Relation", "kind source target shared")


def _file(folder_or_file):
    p = str(folder_or_file)
    if os.path.isdir(p):
        p = os.path.join(p, "tokenizer.json")
    return p if os.path.isfile(p) else None


def _vocab(spec):
    """{token string: id} of a tokenizer.json (its model's vocabulary and
    its added tokens)."""
    model = spec.get("model") or {}
    v = dict(model.get("vocab") or {}) if isinstance(
        model.get("vocab"), dict) else {}
    for t in spec.get("added_tokens") or []:
        if isinstance(t, dict) and "content" in t and "id" in t:
            v[t["content"]] = t["id"]
    return v


def relation(source, target, text=None):
    """The Relation of the tokenizers of two model folders (or
    tokenizer.json files): kind (RELATIONS), the two tokenizers' files
    (None where a folder holds none) and shared, the number of leading
    ids the two share in the "grown" case (else None).  text: the task
    text, which must tokenize to the same ids with both for "grown"."""
    fa, fb = _file(source), _file(target)
    if fa is None or fb is None:
        return Relation("same", fa, fb, None)
    ra = read_input(fa, limit=TOKENIZER_LIMIT)
    rb = read_input(fb, limit=TOKENIZER_LIMIT)
    if ra == rb:
        return Relation("same", fa, fb, None)
    try:
        sa, sb = json.loads(ra), json.loads(rb)
        va, vb = _vocab(sa), _vocab(sb)
    except (ValueError, AttributeError):
        return Relation("different", fa, fb, None)
    # the same way of cutting text (merges, pre-tokenizer, normalizer),
    # and every source token at its id in the target's vocabulary
    same_rules = all((sa.get(k) or None) == (sb.get(k) or None) for k in
                     ("normalizer", "pre_tokenizer")) and \
        ((sa.get("model") or {}).get("merges") or []) == \
        ((sb.get("model") or {}).get("merges") or [])
    if same_rules and va and all(vb.get(t) == i for t, i in va.items()):
        n = max(va.values()) + 1
        if sorted(va.values()) == list(range(n)) and (
                text is None or np.array_equal(
                    np.asarray(load_tokenizer(fa).encode(text)),
                    np.asarray(load_tokenizer(fb).encode(text)))):
            return Relation("grown", fa, fb, n)
    return Relation("different", fa, fb, None)

"""Module, block and pairing rules on tensor names (the rules of
include/bico/model.h, so that Python and the C driver pair alike)."""
import re

from ._depthmap import depthmap

_INT = re.compile(r"^[0-9]+$")


# Modules whose 2-D weights the library takes as a vocabulary's rows
# (lib/model/vocab.c, bico__vocab_tensor): the rows are tokens, only an
# input map applies, so no output statistic is ever read for them
VOCABULARY_MODULES = ("embed_tokens", "wte", "word_embeddings",
                      "token_embedding", "lm_head", "embed_in", "embed_out")


def is_vocabulary(module):
    """Whether the library takes module's weight rows as tokens (its last
    name component, as the C driver matches it)."""
    return module.rsplit(".", 1)[-1] in VOCABULARY_MODULES


def split_for(module, split):
    """k when module ends in a suffix of split ({suffix: k}) at a dot
    boundary, as the C driver matches it; else 1."""
    for suffix, k in split.items():
        if module == suffix or module.endswith("." + suffix):
            return int(k)
    return 1


def _model(names, blocks=None):
    """The library's model graph (bico_model) of a name list or a
    {name: tensor or shape} mapping (a bare name counts as a vector)."""
    from .model import Model
    if hasattr(names, "items"):
        shapes = {n: tuple(getattr(v, "shape", v)) for n, v in names.items()}
    else:
        shapes = {n: (1,) for n in names}
    m = Model.from_shapes(shapes)
    if blocks is not None:
        m.set_blocks(blocks)
    return m


def detect_blocks(names):
    """The block container the library detects in these tensor names
    (bico_model_blocks: the prefix P for which most names read
    "P.<int>.<rest>"), or None."""
    prefix, count = _model(names).blocks()
    return prefix if count else None


def split_block(name, prefix):
    """(index, rest) when name is "<prefix>.<int>.<rest>" (or "<int>.<rest>"
    for an empty prefix, or exactly "<prefix>.<int>"), else None."""
    if prefix is None:
        return None
    if prefix:
        if not name.startswith(prefix + "."):
            return None
        tail = name[len(prefix) + 1:]
    else:
        tail = name
    head, _, rest = tail.partition(".")
    if not _INT.match(head):
        return None
    return int(head), rest


class Pairing(object):
    """Maps target names (tensors, modules, dotted keys) to source names by
    the library's pairing rule (bico_model_map_name: inside the blocks by
    the depth map, elsewhere by identical name), so that Python pairs as
    the C driver does.

    Pairing(source, target, source_blocks=None, target_blocks=None):
    source and target are the models' tensor names, or {name: tensor or
    shape} (a state dict), which lets the library see the shapes too; the
    block containers are detected unless given."""

    def __init__(self, source_names, target_names, source_blocks=None,
                 target_blocks=None):
        self._a = _model(source_names, source_blocks)
        self._b = _model(target_names, target_blocks)
        self.prefix_a, self.l_a = self._a.blocks()
        self.prefix_b, self.l_b = self._b.blocks()
        if not self.l_a:
            self.prefix_a = None
        if not self.l_b:
            self.prefix_b = None
        self.depth = depthmap(self.l_a, self.l_b) if self.l_a and self.l_b \
            else []

    def source_name(self, name):
        return self._b.source_name(self._a, name)

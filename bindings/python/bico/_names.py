"""Module, block and pairing rules on tensor names (the rules of
include/bico/model.h, so that Python and the C driver pair alike)."""
import re

from ._core import depthmap

_INT = re.compile(r"^[0-9]+$")


def split_for(module, split):
    """k when module ends in a suffix of split ({suffix: k}) at a dot
    boundary, as the C driver matches it; else 1."""
    for suffix, k in split.items():
        if module == suffix or module.endswith("." + suffix):
            return int(k)
    return 1


def module_of(name):
    """("blocks.3.mlp.fc1", "weight") for "blocks.3.mlp.fc1.weight"."""
    if "." not in name:
        return "", name
    m, p = name.rsplit(".", 1)
    return m, p


def detect_blocks(names):
    """The prefix P for which most names read "P.<int>.<rest>" (P may be
    ""), or None; a tie goes to the shorter prefix."""
    counts = {}
    for n in names:
        parts = n.split(".")
        seen = set()
        for k in range(len(parts) - 1):
            if _INT.match(parts[k]):
                p = ".".join(parts[:k])
                if p not in seen:
                    seen.add(p)
                    counts[p] = counts.get(p, 0) + 1
    if not counts:
        return None
    return min(counts, key=lambda p: (-counts[p], len(p), p))


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


def block_count(names, prefix):
    idx = [split_block(n, prefix) for n in names]
    idx = [i[0] for i in idx if i is not None]
    return max(idx) + 1 if idx else 0


class Pairing(object):
    """Maps target names (tensors, modules, dotted keys) to source names:
    inside the blocks by the depth map, elsewhere by identical name.

    Pairing(source_names, target_names, source_blocks=None,
    target_blocks=None): the name lists are the models' tensor names (the
    block containers are detected from them unless given)."""

    def __init__(self, source_names, target_names, source_blocks=None,
                 target_blocks=None):
        source_names = list(source_names)
        target_names = list(target_names)
        self.prefix_a = source_blocks if source_blocks is not None else \
            detect_blocks(source_names)
        self.prefix_b = target_blocks if target_blocks is not None else \
            detect_blocks(target_names)
        self.l_a = block_count(source_names, self.prefix_a)
        self.l_b = block_count(target_names, self.prefix_b)
        self.depth = depthmap(self.l_a, self.l_b) if self.l_a and self.l_b \
            else []

    def source_name(self, name):
        sb = split_block(name, self.prefix_b)
        if sb is None or not self.depth or sb[0] >= len(self.depth):
            return name
        i = self.depth[sb[0]]
        head = (self.prefix_a + "." if self.prefix_a else "") + str(i)
        return head + ("." + sb[1] if sb[1] else "")

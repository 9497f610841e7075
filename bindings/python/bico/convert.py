"""PyTorch pickles (.bin / .pt / .pth) to safetensors, through libbico's
writer.

    python3 -m bico.convert pytorch_model.bin model.safetensors
    python3 -m bico.convert pytorch_model.bin.index.json out_folder/
    python3 -m bico.convert hf_model_folder/ out_folder/

The pickle is read with torch.load(weights_only=True), which rebuilds
tensors and plain containers and refuses any other object (a pickle can
run code when loaded); --trust-pickle lifts that for files you made
yourself.  A checkpoint that wraps its state dict ({"state_dict": ...},
{"model": ...}, {"module": ...}) is unwrapped.  Entries that are not
tensors are refused (named), unless --skip-non-tensors.  Tensors are
written in their own dtype (bfloat16 as BF16, float16 as F16), shared
storage (tied weights) as separate copies, with the metadata
{"format": "pt"} that Hugging Face writes.

A sharded checkpoint's index (pytorch_model.bin.index.json) converts
shard by shard (one shard in memory at a time) into the output folder:
pytorch_model-00001-of-00002.bin becomes model-00001-of-00002.safetensors,
and model.safetensors.index.json maps every tensor to its new shard.  A
model folder (pytorch_model.bin or its index, config.json, tokenizer
files) converts into a model folder: the weights as above, the other
files copied.
"""
import argparse
import inspect
import json
import os
import sys

from . import safetensors as _st
from ._status import BicoError, E_ARG, E_FORMAT, E_IO, E_UNSUPPORTED

WRAPPERS = ("state_dict", "model", "module", "model_state_dict")


def _torch():
    try:
        import torch
    except ImportError:
        raise BicoError(E_UNSUPPORTED, "convert: reading a PyTorch pickle "
                        "needs PyTorch (import torch failed)")
    return torch


def load(path, trust_pickle=False):
    """torch.load of a pickle on the CPU, weights only unless trusted."""
    torch = _torch()
    kw = {"map_location": "cpu"}
    if "weights_only" in inspect.signature(torch.load).parameters:
        kw["weights_only"] = not trust_pickle
    elif not trust_pickle:
        raise BicoError(E_UNSUPPORTED, "convert: this PyTorch (%s) cannot "
                        "load weights only (1.13 or later can); pass "
                        "--trust-pickle if you trust %s" % (torch.__version__,
                                                            path))
    try:
        return torch.load(path, **kw)
    except Exception as e:  # UnpicklingError, RuntimeError, zip errors
        hint = "" if trust_pickle else (
            " (it may hold objects other than tensors: --trust-pickle "
            "loads those, but only for a file you trust)")
        raise BicoError(E_FORMAT, "convert: %s is not a PyTorch checkpoint "
                        "that loads: %s%s" % (path, e, hint))


def state_dict(obj, skip_non_tensors=False, where="checkpoint"):
    """{name: tensor} of a loaded checkpoint."""
    torch = _torch()
    if not isinstance(obj, dict):
        raise BicoError(E_FORMAT, "convert: the %s holds a %s, not a state "
                        "dict" % (where, type(obj).__name__))
    if not any(isinstance(v, torch.Tensor) for v in obj.values()):
        for k in WRAPPERS:
            if isinstance(obj.get(k), dict):
                return state_dict(obj[k], skip_non_tensors,
                                  "%s's %r" % (where, k))
    out, skipped = {}, []
    for k, v in obj.items():
        if not isinstance(k, str):
            raise BicoError(E_FORMAT, "convert: the %s has a key %r that is "
                            "not a string" % (where, k))
        if isinstance(v, torch.Tensor):
            out[k] = v.detach().contiguous()
        else:
            skipped.append(k)
    if skipped and not skip_non_tensors:
        raise BicoError(E_FORMAT, "convert: the %s has entries that are not "
                        "tensors: %s (--skip-non-tensors leaves them out)"
                        % (where, ", ".join(sorted(skipped)[:10])))
    if not out:
        raise BicoError(E_FORMAT, "convert: the %s holds no tensors" % where)
    return out


def convert_file(src, dst, trust_pickle=False, skip_non_tensors=False,
                 metadata=None):
    """One pickle to one safetensors file; returns the tensor names."""
    sd = state_dict(load(src, trust_pickle), skip_non_tensors,
                    os.path.basename(src))
    meta = {"format": "pt"}
    meta.update(metadata or {})
    _st.write(dst, sd, metadata=meta)
    return list(sd)


def _shard_name(name):
    base = os.path.basename(name)
    for ext in (".bin", ".pt", ".pth"):
        if base.endswith(ext):
            base = base[:-len(ext)]
            break
    if base.startswith("pytorch_model"):
        base = "model" + base[len("pytorch_model"):]
    return base + ".safetensors"


def convert_index(index, out_dir, trust_pickle=False, skip_non_tensors=False):
    """A sharded checkpoint (its .index.json) into out_dir; returns the
    path of the new index."""
    try:
        with open(index) as f:
            idx = json.load(f)
        wmap = idx["weight_map"]
        if not isinstance(wmap, dict) or not all(
                isinstance(v, str) for v in wmap.values()):
            raise ValueError("weight_map is not {tensor: file}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BicoError(E_FORMAT, "convert: %s is not a sharded checkpoint "
                        "index: %s" % (index, e))
    here = os.path.dirname(os.path.abspath(index))
    shards = sorted(set(wmap.values()))
    names = {s: _shard_name(s) for s in shards}
    if len(set(names.values())) != len(names):
        raise BicoError(E_FORMAT, "convert: shard names of %s collide once "
                        "renamed" % index)
    for s in shards:
        if os.path.basename(s) != s:
            raise BicoError(E_FORMAT, "convert: shard %r of %s is not a file "
                            "name beside the index" % (s, index))
    os.makedirs(out_dir, exist_ok=True)
    new_map = {}
    for s in shards:
        got = convert_file(os.path.join(here, s),
                           os.path.join(out_dir, names[s]), trust_pickle,
                           skip_non_tensors)
        want = sorted(k for k, v in wmap.items() if v == s)
        if sorted(got) != want:
            missing = sorted(set(want) - set(got))
            extra = sorted(set(got) - set(want))
            raise BicoError(E_FORMAT, "convert: shard %s does not hold what "
                            "the index says (missing: %s; not indexed: %s)"
                            % (s, ", ".join(missing[:5]) or "none",
                               ", ".join(extra[:5]) or "none"))
        new_map.update({k: names[s] for k in got})
    meta = dict(idx.get("metadata") or {})
    out = os.path.join(out_dir, "model.safetensors.index.json")
    tmp = out + ".tmp%d" % os.getpid()
    with open(tmp, "w") as f:
        json.dump({"metadata": meta, "weight_map": dict(sorted(
            new_map.items()))}, f, indent=2)
        f.write("\n")
    os.replace(tmp, out)
    return out


_WEIGHTS = (".bin", ".pt", ".pth", ".safetensors", ".index.json", ".tmp")


def copy_companions(src_dir, out_dir):
    """Copies the files of a model folder that are not weights (config.json,
    tokenizer and generation files) into out_dir, so that it is a complete
    model folder; existing files there are kept.  Each copy keeps its
    source's permission bits (never setuid, setgid or sticky).  Returns
    their names."""
    import shutil
    import stat
    copied = []
    for name in sorted(os.listdir(src_dir)):
        p = os.path.join(src_dir, name)
        if name.startswith(".") or name.endswith(_WEIGHTS) or \
                not os.path.isfile(p):
            continue
        q = os.path.join(out_dir, name)
        if os.path.lexists(q) or os.path.abspath(p) == os.path.abspath(q):
            continue
        mode = stat.S_IMODE(os.stat(p).st_mode) & 0o777
        # created private, then given the source's bits: a 0600 file is
        # never readable by others, not even for a moment
        fd = os.open(q, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as dst, open(p, "rb") as src:
            shutil.copyfileobj(src, dst)
            os.fchmod(dst.fileno(), mode)
        copied.append(name)
    return copied


def convert(src, dst, trust_pickle=False, skip_non_tensors=False):
    """src: a pickle, a pickle index (.json), or a model folder holding
    pytorch_model.bin or pytorch_model.bin.index.json; dst: a .safetensors
    file for a pickle (or a folder, which gets model.safetensors), a folder
    for an index or a model folder (which also gets the folder's other
    files: config.json, tokenizer files).  Returns what was written (the
    file or the index path)."""
    src, dst = os.fspath(src), os.fspath(dst)
    folder = None
    if os.path.isdir(src):
        folder = src
        for name in ("pytorch_model.bin.index.json", "pytorch_model.bin"):
            if os.path.isfile(os.path.join(src, name)):
                src = os.path.join(src, name)
                break
        else:
            raise BicoError(E_IO, "convert: %s holds neither "
                            "pytorch_model.bin nor "
                            "pytorch_model.bin.index.json" % src)
        if dst.endswith(".safetensors") or dst.endswith(".json"):
            raise BicoError(E_ARG, "convert: a model folder converts into a "
                            "folder, not %s" % dst)
    if not os.path.isfile(src):
        raise BicoError(E_IO, "convert: %s is not a file" % src)
    if src.endswith(".json"):
        if dst.endswith(".safetensors") or dst.endswith(".json"):
            raise BicoError(E_ARG, "convert: a sharded checkpoint converts "
                            "into a folder, not %s" % dst)
        out = convert_index(src, dst, trust_pickle, skip_non_tensors)
        copy_companions(os.path.dirname(os.path.abspath(src)), dst)
        return out
    if folder is not None or os.path.isdir(dst) or dst.endswith(os.sep):
        os.makedirs(dst, exist_ok=True)
        out_dir, dst = dst, os.path.join(dst, "model.safetensors")
    else:
        out_dir = None
    if dst.endswith(".json"):
        raise BicoError(E_ARG, "convert: %s names an index; give a "
                        ".safetensors file" % dst)
    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise BicoError(E_ARG, "convert: the output is the input (%s)" % src)
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    convert_file(src, dst, trust_pickle, skip_non_tensors)
    if folder is not None:
        copy_companions(folder, out_dir)
    return dst


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python3 -m bico.convert",
        description="Convert a PyTorch checkpoint (.bin/.pt pickle, or a "
        "sharded pytorch_model.bin.index.json) to safetensors.")
    ap.add_argument("input", help="a .bin/.pt/.pth file, a .index.json, or "
                    "a model folder holding them")
    ap.add_argument("output", help="a .safetensors file (a folder for an "
                    "index or a model folder)")
    ap.add_argument("--trust-pickle", action="store_true",
                    help="load any pickled object (runs code from the file: "
                    "only for files you trust)")
    ap.add_argument("--skip-non-tensors", action="store_true",
                    help="leave out entries that are not tensors")
    a = ap.parse_args(argv)
    try:
        out = convert(a.input, a.output, a.trust_pickle, a.skip_non_tensors)
    except BicoError as e:
        sys.stderr.write("bico.convert: %s\n" % e.message)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

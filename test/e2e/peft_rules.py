"""PEFT's loading rules for a LoRA adapter folder, emulated on a plain
nn.Module (PEFT itself cannot be installed here), from PEFT's documented
behaviour (LoraConfig and ModulesToSaveWrapper; PeftModel.from_pretrained
with the default adapter, inference mode, no ensure_weight_tying):

- a module gets a LoRA layer when its name equals an entry of
  target_modules or ends with "." + the entry (a string target_modules is
  a regular expression the whole name must match); its output becomes
  W x + (lora_alpha / r) B A x (use_rslora false, no rank or alpha
  pattern), with B and A the stored lora_B / lora_A factors;
- each module whose name equals an entry of modules_to_save or ends with
  "." + the entry is wrapped with a deep copy of itself; the adapter's
  base_model.model.<module>.<parameter> tensors are loaded into that copy
  (cast to the module's dtype); another module that shared a parameter
  with the original (a head tied to the embedding) keeps the original's,
  unchanged;
- tensors of other modules are ignored (unexpected keys).

Independent of libbico: the files are read here (read)."""
import json
import os
import re
import struct

import numpy as np
import torch
import torch.nn as nn


def _matches(name, entries):
    if isinstance(entries, str):
        return re.fullmatch(entries, name) is not None
    return any(name == e or name.endswith("." + e) for e in entries or ())


_DT = {"F32": (np.float32, None), "F16": (np.float16, None),
       "F64": (np.float64, None), "BF16": (np.int16, torch.bfloat16)}


def read(path):
    """{name: tensor} of a safetensors file (F32, F16, F64, BF16), read
    here from the format's description."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode())
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        np_dt, view = _DT[e["dtype"]]
        a = np.frombuffer(raw[8 + n + b:8 + n + end],
                          dtype=np.dtype(np_dt).newbyteorder("<"))
        t = torch.from_numpy(a.astype(np_dt).reshape(e["shape"]))
        out[name] = t.view(view) if view is not None else t
    return out


def load(model, folder):
    """model (an nn.Module with Hugging Face names) changed in place as
    PeftModel.from_pretrained(model, folder) would compute; returns
    {"lora": [modules], "saved": [modules]}."""
    cfg = json.load(open(os.path.join(folder, "adapter_config.json")))
    assert cfg.get("peft_type") == "LORA" and cfg.get("bias") == "none"
    assert not cfg.get("use_rslora") and not cfg.get("rank_pattern") and \
        not cfg.get("alpha_pattern")
    t = read(os.path.join(folder, "adapter_model.safetensors"))
    pre = "base_model.model."
    mods = dict(model.named_modules())
    done = {"lora": [], "saved": []}
    for name, m in mods.items():
        if name and _matches(name, cfg.get("modules_to_save")):
            for pn, p in list(m.named_parameters(recurse=False)):
                k = pre + name + "." + pn
                new = t[k].to(p.dtype) if k in t else p.detach().clone()
                # the copy: ties to the original are not carried over
                setattr(m, pn, nn.Parameter(new.clone()))
            done["saved"].append(name)
    s = cfg["lora_alpha"] / cfg["r"]
    for name, m in mods.items():
        a = t.get(pre + name + ".lora_A.weight")
        if a is None or not name or not _matches(
                name, cfg.get("target_modules")):
            continue
        b = t[pre + name + ".lora_B.weight"]
        with torch.no_grad():
            w = m.weight
            w.copy_((w.double() + s * b.double() @ a.double()).to(w.dtype))
        done["lora"].append(name)
    return done

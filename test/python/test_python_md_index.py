"""docs/python.md names every public function and class of the binding:
each module's __all__ (or, without one, its own public functions and
classes)."""
import os

import bico
import bico.convert
import bico.fit
import bico.folder
import bico.lora
import bico.merge
import bico.model
import bico.safetensors
import bico.torch
import bico.torch.choose
import bico.torch.collect
import bico.torch.fit
import bico.torch.proxy
import bico.torch.transfer
import bico.llm
import bico.llm.across
import bico.llm.bpe
import bico.llm.generate
import bico.llm.vocab
import bico.llm.adapters
import bico.llm.config
import bico.llm.families
import bico.llm.options
import bico.llm.stats
import bico.llm.text
import bico.llm.runtime
import bico.llm.stream.route
import bico.transfer
import bico.transport

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs",
                   "python.md")


def _public():
    """scripts/python-api.py's rule for a module's public names (the one
    the frozen listing uses)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "python_api", os.path.join(os.path.dirname(DOC), "..", "scripts",
                                   "python-api.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.public


public = _public()


def test_every_public_name_is_in_python_md():
    doc = open(DOC).read()
    missing = ["%s.%s" % (m.__name__, n)
               for m in (bico, bico.torch, bico.lora, bico.merge,
                         bico.safetensors, bico.model, bico.fit, bico.convert,
                         bico.folder, bico.transfer, bico.transport,
                         # the PyTorch front end's modules by concern
                         bico.torch.collect, bico.torch.transfer,
                         bico.torch.choose, bico.torch.fit,
                         bico.torch.proxy, bico.llm, bico.llm.families,
                         bico.llm.text, bico.llm.adapters,
                         bico.llm.runtime, bico.llm.stream.route,
                         bico.llm.config, bico.llm.options, bico.llm.stats,
                         bico.llm.across, bico.llm.bpe, bico.llm.generate,
                         bico.llm.vocab)
               for n in public(m) if "`%s" % n not in doc and
               ".%s" % n not in doc]
    assert not missing, "docs/python.md does not name: " + ", ".join(missing)

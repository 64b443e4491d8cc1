"""The architectures: one module per family, and the one table that names them.

Each module (qwen3.py, llama.py, gemma3.py) is a lesson in how its family differs from
the others and holds four things, in this order:

    hparams(r, base) -> dict     the ModelConfig fields its GGUF metadata sets
    TENSORS / LAYER_TENSORS      GGUF tensor name -> weight field, expected shape, required
    Layer (dataclass)            the typed weights of one layer (same fields on every back-end:
                                 numpy arrays, CPU weights or CUDA views)
    body(ops, w, s) / head(...)  the forward pass, written once against the op vocabulary
                                 of engine/models/ops.py; every back-end runs it

Adding an architecture is a new module here and a line in ARCHITECTURES; the back-ends
and the runtime do not change unless it needs a new op.
"""
from __future__ import annotations

from types import ModuleType

from ..gguf_file import GGUFError

_MODULES = {          # general.architecture -> module name in this package
    "qwen3": "qwen3",
    "llama": "llama",
    "gemma3": "gemma3",
}
ARCHITECTURES = tuple(_MODULES)


def architecture(arch: str, path=None) -> ModuleType:
    """The module of an architecture; GGUFError naming the file for one we do not run."""
    if arch not in _MODULES:
        where = f"{path}: " if path is not None else ""
        raise GGUFError(f"{where}architecture '{arch}' is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    import importlib
    return importlib.import_module(f"{__name__}.{_MODULES[arch]}")

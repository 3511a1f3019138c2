"""transformers' GDN model classes without fla's kernels, with fla left importable.

transformers binds fla's Triton kernels to its Qwen3.5 / Qwen3-Next GDN layers when their
modeling modules are imported, if fla imports. Those kernels need a GPU, and their backward is
refused on Hopper with older Triton (``train_target.fla_backward_usable``), so training and the
test oracle want transformers' plain-torch recurrence instead. Hiding fla from those imports only
(rather than for the whole process) keeps it importable for the serving kernels
(``common/ops/gdn/fla.py``) that run in the same process.
"""

from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager

MODELING_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next",
)


@contextmanager
def fla_hidden():
    """``import fla`` (and any ``fla.*``) raises ImportError inside the block; outside it, fla
    is as it was, already imported submodules included."""
    saved = {name: mod for name, mod in sys.modules.items()
             if name == "fla" or name.startswith("fla.")}
    for name in saved:
        del sys.modules[name]
    sys.modules["fla"] = None  # a None entry makes the import system raise ImportError
    try:
        yield
    finally:
        sys.modules.pop("fla", None)
        sys.modules.update(saved)


def import_modeling_without_fla() -> None:
    """Import transformers' GDN modeling modules with fla hidden. A module imported before keeps
    whatever it bound then, so call this before anything imports them."""
    with fla_hidden():
        for name in MODELING_MODULES:
            importlib.import_module(name)

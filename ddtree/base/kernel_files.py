"""Where the project's kernels are, whether ddtree runs from a plain checkout or an installed package.

The kernels live in the top-level `kernels/` folder: the Triton tree-attention kernel (`tree_attention.py`, with
its compile check) and the CPU kernels' C++ sources, compiled on first use (`ddtree/runtime/cpu/qlinear.py`). A wheel
installs that folder as `ddtree/kernels/` (pyproject's package-dir mapping); a checkout, plain or installed
editable, has it beside the package. `kernel_dir()` finds it in either place and `kernel_module()` imports its
Python files from there, so no import path depends on how ddtree was installed.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_PACKAGE = Path(__file__).resolve().parent.parent  # ddtree/
_PLACES = (_PACKAGE / "kernels", _PACKAGE.parent / "kernels")  # installed from a wheel; a checkout


def kernel_dir() -> Path:
    """The folder holding the kernels' sources (it has `tree.cpp`)."""
    for place in _PLACES:
        if (place / "tree.cpp").is_file():
            return place
    raise FileNotFoundError(
        f"ddtree's kernels are missing: neither {_PLACES[0]} nor {_PLACES[1]} holds tree.cpp. Reinstall the package "
        f"(pip install --force-reinstall ddtree) or restore the kernels/ folder of the checkout (git checkout kernels)")


def kernel_module(name: str) -> ModuleType:
    """The kernels' Python module `name` (e.g. "tree_attention"), imported once from kernel_dir() as
    `ddtree.kernels.<name>`."""
    qualified = f"ddtree.kernels.{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    path = kernel_dir() / f"{name}.py"
    if not path.is_file():
        raise ModuleNotFoundError(f"no kernel module {name!r}: {path} does not exist", name=qualified)
    spec = importlib.util.spec_from_file_location(qualified, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[qualified]  # a failed import (no triton, say) is retried, not cached half-done
        raise
    return module

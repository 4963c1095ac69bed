"""ddtree/base/kernel_files.py: the kernels folder is found, and it never shadows another package's import."""
import importlib.util
import subprocess
import sys
from pathlib import Path

from ddtree.base.kernel_files import kernel_dir, kernel_module

ROOT = Path(__file__).resolve().parent.parent


def test_kernel_dir_holds_the_sources_and_kernel_module_imports_from_it():
    assert (kernel_dir() / "tree.cpp").is_file() and (kernel_dir() / "int8_linear.cpp").is_file()
    assert kernel_module("tree_attention").__name__ == "ddtree.kernels.tree_attention"


def test_the_kernels_folder_does_not_shadow_the_hub_kernels_package():
    """transformers 5.25 and later import the Hugging Face `kernels` package when it is installed (they require
    it); a kernels/__init__.py made `import kernels` find this folder instead whenever Python ran from the
    checkout's root, and every load failed there (ImportError: cannot import name 'CUDAProperties')."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    code = ("import importlib.util as u; s = u.find_spec('kernels'); "
            "print('none' if s is None else s.origin or 'namespace')")
    found = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    if importlib.util.find_spec("kernels") is not None and found != "namespace":
        assert not found.startswith(str(ROOT / "kernels")), found  # the installed package wins
    assert found in ("none", "namespace") or "site-packages" in found or "dist-packages" in found, found

"""The project's kernels, installed as the package `ddtree.kernels` (pyproject maps it to this folder).

- `tree_attention.py`: the Triton tree-attention kernel and its PyTorch reference (GPU; the interpreter in tests).
  Import it as `ddtree.kernels.tree_attention`: this package itself imports nothing, so it loads without triton.
- `qlinear.cpp`, `decoder.cpp`, `int8_linear.cpp`, `tree.cpp`, `cpu_kernels.h`: the CPU kernels, compiled on first use
  by `ddtree.cpu.qlinear`.
"""
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent  # where the C++ sources are, installed or in a checkout

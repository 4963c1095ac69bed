"""The project's kernels. ddtree finds this folder wherever it is (`ddtree/base/kernel_files.py`): beside the package in
a checkout, or installed from a wheel as `ddtree/kernels/` (pyproject's package-dir mapping).

- `tree_attention.py`: the Triton tree-attention kernel and its PyTorch reference (GPU; the interpreter in tests),
  loaded with `ddtree.base.kernel_files.kernel_module("tree_attention")`; this file imports nothing, so it loads without
  triton.
- `row_attention.py`: the batched data generator's Triton decode attention (each row over its own keys) and its SDPA
  reference (`ddtree/train/static_batched.py`).
- `compile_check.py`: compiles the Triton kernels without a GPU (`python kernels/compile_check.py`).
- `qlinear.cpp`, `decoder.cpp`, `int8_linear.cpp`, `tree.cpp`, `cpu_kernels.h`: the CPU kernels, compiled on first use
  by `ddtree/runtime/cpu/qlinear.py`.
"""

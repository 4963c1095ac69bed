"""The CPU runtime (runtime.py) and what it is made of: the compiled kernels' loader and quantized weights
(qlinear.py), the C++ layer stack (stack.py), exact GGUF blocks (exact_blocks.py), the quantized target
(quant_target.py), the weight-change guard (weights_watch.py), and the integer-activation kernel (int8.py; no
target mode uses it yet). Nothing here is imported by the reference model files; importing this package changes
nothing in torch."""

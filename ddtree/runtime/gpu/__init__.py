"""The CUDA runtime (captured graphs of the reference models' passes): runtime.py."""

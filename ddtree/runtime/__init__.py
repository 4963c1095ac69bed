"""The runtimes: fast paths around the reference models, chosen once at load (cpu/: C++ kernels; gpu/: CUDA graphs).
The protocol a runtime implements is models/protocol.py."""

"""The one place a loaded pair gets its runtimes: the CPU runtime where the target is the own-code model in float32
on a CPU (cpu/runtime.py), else the CUDA-graph runtime where it is on CUDA with the Triton attention and the options
allow graphs (gpu/runtime.py), else none (the reference or transformers model runs as it is)."""
from __future__ import annotations

from ..base.options import LoadOptions
from .cpu import runtime as cpu_runtime
from .gpu import runtime as gpu_runtime


def attach(target, drafter, options: LoadOptions):
    """(target, drafter) as the pair runs them, the drafter bound to the target. Each is a protocol.Target /
    protocol.Drafter; a runtime holds its reference model as `.model`."""
    target, drafter = cpu_runtime.attach(target, drafter)
    if options.cuda_graphs:
        target, drafter = gpu_runtime.attach(target, drafter)
    return target, drafter

"""Compile the tree-attention kernels for an NVIDIA target without a GPU (Triton AOT + ptxas -v).

The interpreter (TRITON_INTERPRET=1) runs the kernel's Python, not its GPU lowering; this catches what only
the compiler sees (type/layout errors, shared-memory overflow, register spills). Run it without
TRITON_INTERPRET:  python kernels/compile_check.py.
Prints one line per config; exits non-zero when a config fails to compile, spills registers or needs
more shared memory than an H100 has. --quick: one config only (used by tests/test_kernels.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import triton

from ddtree.base.kernel_files import kernel_module

_tree_attention = kernel_module("tree_attention")
_row_attention_kernel = kernel_module("row_attention")._row_attention_kernel
_combine_kernel, _tree_attention_kernel = _tree_attention._combine_kernel, _tree_attention._tree_attention_kernel

_I32 = ["stride_qh", "stride_qn", "stride_kh", "stride_kt", "stride_vh", "stride_vt", "stride_bn", "stride_oh",
        "stride_on", "past_len", "n_nodes", "blocks_per_split"]
_UNIT = ["stride_qd", "stride_kd", "stride_vd", "stride_bw", "stride_od"]  # == 1: specialised like at runtime
_DIV16 = ["Q", "K", "V", "Bits", "Out", "PartO", "PartLse", "stride_qh", "stride_qn", "stride_kh", "stride_kt",
          "stride_vh", "stride_vt", "stride_oh", "stride_on"]
# (dtype, group, head_dim, block_m, block_n, num_warps, num_stages, split, causal): the H100 select_config picks
CONFIGS = [
    ("bf16", 4, 128, 16, 128, 4, 3, True, True),  # decode / small trees, flash-decoding split
    ("bf16", 4, 128, 64, 64, 4, 3, False, True),
    ("bf16", 4, 128, 128, 64, 8, 3, False, False),
    ("fp16", 8, 64, 128, 128, 8, 3, False, True),
    # fp32 (select_config(elem_bytes=4)): a 128-key block with 3 stages ran out of shared memory on an H100
    ("fp32", 2, 128, 16, 64, 4, 2, True, True),
    ("fp32", 4, 128, 64, 32, 8, 2, False, True),
    ("fp32", 8, 64, 64, 64, 8, 2, False, True),
    ("fp32", 1, 256, 16, 32, 4, 2, False, True),
]


def compile_tree_kernel(dtype, group, head_dim, block_m, block_n, num_warps, num_stages, split, causal,
                        arch: int = 90, past_on_device: bool = False):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _tree_attention_kernel
    sig = {name: f"*{dtype}" for name in ("Q", "K", "V", "Out")}
    sig.update(Bits="*i32", PastLen="*i32", PartO="*fp32", PartLse="*fp32", qk_scale="fp32", **{n: "i32" for n in _I32})
    consts = {n: 1 for n in _UNIT}
    consts.update(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split,
                  CAUSAL_TREE=causal, INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST=False,
                  PAST_ON_DEVICE=past_on_device)
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in fn.arg_names}  # argument order
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in _DIV16}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_combine_kernel(dtype="bf16", head_dim=128, block_s=64, arch: int = 90):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"PartO": "*fp32", "PartLse": "*fp32", "Out": f"*{dtype}", "n_splits": "i32", "n_nodes": "i32",
           "rows_per_split": "i32", "stride_oh": "i32", "stride_on": "i32", "stride_od": "constexpr",
           "HEAD_DIM": "constexpr", "BLOCK_D": "constexpr", "BLOCK_S": "constexpr"}
    consts = {"stride_od": 1, "HEAD_DIM": head_dim, "BLOCK_D": head_dim, "BLOCK_S": block_s}
    return triton.compile(ASTSource(_combine_kernel, sig, consts), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4})


def compile_row_kernel(dtype="bf16", group=3, head_dim=64, arch: int = 90):
    """The data generator's decode attention (kernels/row_attention.py) as row_attention launches it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _row_attention_kernel
    sig = {name: f"*{dtype}" for name in ("Q", "K", "V", "Out")}
    sig.update(Lengths="*i64", qk_scale="fp32")
    sig.update({n: "i32" for n in fn.arg_names if n.startswith("stride_")})
    consts = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=64,
                  INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32", UPCAST=False)
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4, "num_stages": 2})


def ptxas_report(kernel, arch: int = 90) -> str:
    """'ptxas -v' register/spill lines for a compiled kernel ('' when no ptxas ships with Triton)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):  # the newest one accepts Triton's PTX version
        ptxas = os.path.join(bin_dir, name)
        if not os.path.exists(ptxas):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(kernel.asm["ptx"])
            res = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", src, "-o", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True)
        if res.returncode == 0:
            return " | ".join(line.split(":", 1)[-1].strip() for line in res.stderr.splitlines()
                              if "registers" in line or "spill" in line)
    return ""


def spilled(report: str) -> bool:
    """Does a ptxas_report say the kernel spills registers?"""
    return "spill" in report and " 0 bytes spill stores" not in report


H100_SMEM_BYTES = 227 * 1024  # max dynamic shared memory per block on sm_90
QUICK = {("bf16", 4, 128, 16), ("fp32", 2, 128, 16)}  # --quick: decode-size bf16, and fp32 (once over the limit)


def main(quick: bool = False) -> int:
    failed = False
    # each config as an eager pass runs it (the past length an argument), the first also as a captured CUDA graph
    # does (the past length read on the device)
    runs = [(c, False) for c in CONFIGS if not quick or c[:4] in QUICK] + [(CONFIGS[0], True)]
    for cfg, past_on_device in runs:
        kernel = compile_tree_kernel(*cfg, past_on_device=past_on_device)
        report = ptxas_report(kernel)
        spills = spilled(report)
        too_big = kernel.metadata.shared > H100_SMEM_BYTES
        failed |= too_big or (spills and cfg[0] != "fp32")  # fp32 on a GPU: must fit, need not be fast
        print(f"{cfg}{' past on device' if past_on_device else ''}: smem={kernel.metadata.shared} B  {report}" + ("  <-- SPILLS" if spills else "")
              + ("  <-- SHARED MEMORY > 227 KB" if too_big else ""))
    compile_combine_kernel()
    print("combine kernel: ok")
    for dtype in ("bf16", "fp32"):  # the embedded target's shapes: 3 query heads per KV head, head dim 64
        kernel = compile_row_kernel(dtype)
        report = ptxas_report(kernel)
        spills = spilled(report)
        failed |= spills or kernel.metadata.shared > H100_SMEM_BYTES
        print(f"row attention {dtype}: smem={kernel.metadata.shared} B  {report}" + ("  <-- SPILLS" if spills else ""))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(quick="--quick" in sys.argv))

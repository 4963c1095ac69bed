"""The attention seam: every attention call of the target and the drafter goes through `attend`.

Queries are the N new tokens of a pass; keys/values are the cached rows [0, past_len + N): the committed
past (always visible) followed by the N new rows, whose visibility among themselves is described by a
`Visibility`. Backends: "sdpa" (PyTorch scaled_dot_product_attention, the CPU path) and "triton" (the
tree-attention kernel in kernels/tree_attention.py, used automatically on CUDA; a causal pass from position 0, a
prompt's prefill, runs SDPA's causal kernel there too). A model holds its backend already resolved
(`resolve_backend`, at load): passes never look at the environment.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..base.config import ConfigError
from ..base.kernel_files import kernel_module

BACKENDS = ("auto", "sdpa", "triton")


class Visibility:
    """Who sees whom among the N new rows of one pass, shared by all layers of that pass.

    ancestors: bool [N, N], ancestors[i, j] = new row j is visible to new row i (ancestor-or-self in a tree,
    j <= i for a causal chain). None means every new row sees every new row (the drafter's block, or N = 1).
    past: bool [N, past_len], which past rows each new row sees; None (the usual case) means all of them. Only a
    sliding-window drafter layer sets it, and such a pass runs on SDPA (the Triton kernel sees the whole past).
    """

    def __init__(self, past_len: int, ancestors: torch.Tensor | None, past: torch.Tensor | None = None,
                 chain: bool = False):
        self.past_len = past_len
        self.ancestors = ancestors
        self.past = past
        self.chain = chain  # ancestors is the full causal triangle (Visibility.causal): a prompt's prefill at past 0
        self._dense: dict[int, torch.Tensor] = {}
        self._bits: torch.Tensor | None = None

    @property
    def lower_triangular(self) -> bool:
        """Is the new rows' visibility lower-triangular (a tree or a chain: parents precede children)?"""
        return self.ancestors is not None

    @classmethod
    def causal(cls, past_len: int, n: int, device) -> "Visibility":
        if n == 1:
            return cls(past_len, None)
        return cls(past_len, torch.ones(n, n, dtype=torch.bool, device=device).tril_(), chain=True)

    def dense(self, group: int) -> torch.Tensor | None:
        """Boolean SDPA mask [group * N, past_len + N] for GQA queries folded as [Hkv, group * N, D]."""
        if self.ancestors is None and self.past is None:
            return None
        if group not in self._dense:
            ref = self.ancestors if self.ancestors is not None else self.past
            n, device = ref.shape[0], ref.device
            past = self.past if self.past is not None else torch.ones(n, self.past_len, dtype=torch.bool, device=device)
            new = self.ancestors if self.ancestors is not None else torch.ones(n, n, dtype=torch.bool, device=device)
            self._dense[group] = torch.cat([past, new], dim=1).repeat(group, 1)
        return self._dense[group]

    def bits(self, n: int, device) -> torch.Tensor:
        """Packed visibility bits int32 [N, ceil(N / 32)] for the Triton kernel (all set when ancestors is None)."""
        if self._bits is None:
            pack_ancestor_bits = kernel_module("tree_attention").pack_ancestor_bits
            vis = self.ancestors if self.ancestors is not None else torch.ones(n, n, dtype=torch.bool, device=device)
            self._bits = pack_ancestor_bits(vis)
        return self._bits


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor:
    """bool [Nq, Nk]: may the query at position q_pos[i] see the key at position k_pos[j], by position alone?
    Causal: k <= q. A sliding window keeps q - k < window, and for non-causal attention also k - q < window
    (Hugging Face's convention: a window of w spans w positions, the query's own included)."""
    d = q_pos[:, None] - k_pos[None, :]  # [Nq, Nk]
    visible = d >= 0 if causal else torch.ones_like(d, dtype=torch.bool)
    if window is not None:
        visible = visible & (d < window) if causal else visible & (d.abs() < window)
    return visible


def resolve_backend(name: str, device) -> str:
    """The backend every pass of a model on `device` will use, decided once when the model is loaded.
    'auto': the Triton kernel on CUDA (when triton imports) and SDPA elsewhere (load() puts $DDTREE_ATTENTION in
    `name` where no backend was asked for: ddtree/base/options.py). 'triton' where it cannot run is an error,
    never a silent fallback."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    cuda = torch.device(device).type == "cuda"
    if name == "auto":
        return "triton" if cuda and _triton_problem(cuda) is None else "sdpa"
    if name == "triton" and (problem := _triton_problem(cuda)):
        raise ConfigError(f"attention backend 'triton' cannot run here: {problem}. Use 'sdpa' (or 'auto').")
    return name


def _triton_problem(cuda: bool) -> str | None:
    """Why the Triton kernel cannot run on this device, or None when it can."""
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return ("it needs a CUDA GPU (on a CPU only Triton's interpreter runs it, slowly, for tests: set "
                "TRITON_INTERPRET=1 before triton is imported)")
    try:
        kernel_module("tree_attention")
    except ImportError as e:
        return f"triton does not import ({e}); pip install triton"
    return None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility, backend: str) -> torch.Tensor:
    """q [Hq, N, D]; k, v [Hkv, past_len + N, D] (views of the cache). Returns [Hq, N, D]."""
    hq, n, d = q.shape
    if backend == "triton" and vis.chain and vis.past_len == 0:
        # A causal pass from position 0 (a prompt's prefill): SDPA's flash kernel at GEMM speed, not the tree kernel
        # reading a dense N x N bit mask. Every method prefills this way, so their tokens stay the same.
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)
        return out[0]
    if backend == "triton" and vis.past is None:
        tree_attention = kernel_module("tree_attention").tree_attention
        # Trees and chains are lower-triangular (parents precede children), which lets the kernel skip key
        # blocks past each tile's last node; the drafter's all-visible block is not.
        return tree_attention(q, k, v, vis.past_len, vis.bits(n, q.device), causal_tree=vis.lower_triangular)
    if backend != "sdpa":
        raise ValueError(f"attention backend {backend!r} is not a resolved one ('sdpa' or 'triton'): resolve it once "
                         "with resolve_backend() when the model is built")
    hkv = k.shape[0]
    group = hq // hkv
    # Fold the query heads that share a KV head into the query axis: no copy of K/V for GQA.
    qf = q.reshape(hkv, group * n, d)
    out = F.scaled_dot_product_attention(qf[None], k[None], v[None], attn_mask=vis.dense(group))
    return out.reshape(hq, n, d)  # CUDA's SDPA kernels may return other strides than the CPU's: a view can fail

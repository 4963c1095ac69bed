"""A preallocated KV cache for one sequence, owned by the model that fills it."""
from __future__ import annotations

import torch


class KVCache:
    """Keys and values of all layers: k, v [layers, kv_heads, capacity, head_dim].

    `length` rows are committed. A forward pass writes its N new rows at [length, length + N) and reads
    [0, length + N); `commit` then keeps some of those rows (moving them to sit right after the committed
    ones) and drops the rest, so nothing is ever re-allocated during decoding.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    @property
    def room(self) -> int:
        return self.capacity - self.length

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the pass's new rows (k, v [kv_heads, N, head_dim]); return the visible [0, length + N) views. A
        cache of another dtype than the pass's (fp16 under float32: the integer mode's) rounds the rows as it stores
        them and returns them widened back to the pass's dtype (copies): what the C++ stack's attention reads."""
        end = self.length + k.shape[1]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        self.k[layer, :, self.length:end] = k
        self.v[layer, :, self.length:end] = v
        if self.k.dtype != k.dtype:
            return self.k[layer, :, :end].to(k.dtype), self.v[layer, :, :end].to(v.dtype)
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def commit(self, n: int, rows: torch.Tensor | None = None) -> None:
        """Commit n of the pending rows: the first n (rows=None), or pending rows `rows` (sorted, [n])."""
        if rows is not None:
            start = self.length
            # Gather makes a copy, so overlapping source/destination ranges are safe.
            self.k[:, :, start:start + n] = self.k[:, :, start + rows]
            self.v[:, :, start:start + n] = self.v[:, :, start + rows]
        self.length += n

    def reset(self) -> None:
        self.length = 0


class ContextCache(KVCache):
    """A drafter's cache, with the target features of committed tokens whose K/V are not computed yet
    (DFlashDrafter.add_context queues them; its next draft computes them all in one pass)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: list[torch.Tensor] = []  # [n_i, taps * hidden] each, in order

    def take_pending(self) -> torch.Tensor | None:
        """The queued features [sum n_i, taps * hidden] in order, now no longer queued; None when none are."""
        if not self.pending:
            return None
        features = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending)
        self.pending.clear()
        return features

    def reset(self) -> None:
        super().reset()
        self.pending.clear()


def add_context(cache: KVCache, features: torch.Tensor, context_pass) -> None:
    """A drafter's context for the next n committed tokens (features [n, taps * H]): queued on a ContextCache (its next
    draft computes all queued rows in one pass: steps that do not draft cost the drafter nothing), computed now by
    context_pass(cache, features) on any other cache."""
    if isinstance(cache, ContextCache):
        cache.pending.append(features)
    else:
        context_pass(cache, features)


def flush_context(cache: KVCache, context_pass) -> None:
    """Compute what add_context queued, in one context_pass (a draft does this first)."""
    if isinstance(cache, ContextCache) and (features := cache.take_pending()) is not None:
        context_pass(cache, features)

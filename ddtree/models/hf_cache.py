"""The target's KV cache on the Hugging Face backend: a transformers `Cache` whose layers keep K/V in
preallocated buffers, so that a tree verify writes its N pending rows in place and `commit` keeps only the
accepted path (every layer, sliding-window layers included), like ddtree.models.kv_cache.KVCache does for the
own-code model.

The model's attention layers call `cache.update(k, v, layer_idx)` and attend over what it returns; which of
those rows each query may see comes from the 4-D masks `TreeCache.masks` builds for the pass (the tree's
ancestor visibility and each layer's sliding window, by position).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import window_visible


def kept_rows(length: int, window: int | None) -> int:
    """Committed rows a layer holds after `length` tokens. A sliding layer (window w) needs only the newest
    w - 1: a pass's earliest query sits at position `length` and sees keys at positions > length - w."""
    return length if window is None else min(length, window - 1)


class TreeLayer(CacheLayerMixin):
    """One attention layer: keys/values [1, kv_heads, capacity, head_dim]; rows [0, kept) are committed (the
    tokens at positions [length - kept, length)), a pass's pending rows follow them."""

    is_compileable = False
    is_croppable = False

    def __init__(self, capacity: int, window: int | None):
        super().__init__()
        self.capacity, self.window = capacity, window
        self.is_sliding = window is not None
        self.length = 0  # committed tokens
        self.kept = 0  # committed rows held (kept_rows(length, window))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # shapes come from the first update: [1, kv_heads, N, head_dim] (values may have their own head_dim)
        b, h, _, dk = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty(b, h, self.capacity, dk)
        self.values = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write a pass's N new rows after the committed ones (overwriting an uncommitted earlier pass);
        return the rows it attends over: [0, kept + N)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.kept + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        self.keys[:, :, self.kept:end] = key_states
        self.values[:, :, self.kept:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def commit(self, n: int, rows: torch.Tensor | None) -> None:
        """Keep n pending rows (the first n, or pending rows `rows` [n], sorted), then, on a sliding layer,
        only the newest window - 1 committed rows (moved to the front of the buffer)."""
        if self.is_initialized:
            start = self.kept
            if rows is not None:  # gather copies first, so overlapping ranges are safe
                self.keys[:, :, start:start + n] = self.keys[:, :, start + rows]
                self.values[:, :, start:start + n] = self.values[:, :, start + rows]
            keep = kept_rows(self.length + n, self.window)
            drop = start + n - keep
            if drop > 0:
                self.keys[:, :, :keep] = self.keys[:, :, drop:drop + keep].clone()
                self.values[:, :, :keep] = self.values[:, :, drop:drop + keep].clone()
        self.length += n
        self.kept = kept_rows(self.length, self.window)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kept + query_length, self.length - self.kept  # (kv length, position of row 0)

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = self.kept = 0


class TreeCache(Cache):
    """All layers of one sequence. `length` tokens are committed; a forward pass adds pending rows to every
    layer and `commit` keeps some of them, exactly the own-code KVCache's contract (length, room, commit)."""

    def __init__(self, layer_types: list[str], windows: list[int | None], capacity: int):
        super().__init__(layers=[TreeLayer(capacity, w) for w in windows])
        self.layer_types, self.windows = list(layer_types), list(windows)
        self.capacity = capacity
        self.length = 0

    @property
    def room(self) -> int:
        return self.capacity - self.length

    @torch.inference_mode()  # the buffers were allocated inside the model's (inference-mode) forward
    def commit(self, n: int, rows: torch.Tensor | None = None) -> None:
        for layer in self.layers:
            layer.commit(n, rows)
        self.length += n

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.length = 0

    def masks(self, positions: torch.Tensor, ancestors: torch.Tensor | None, dtype: torch.dtype) -> dict:
        """Additive masks {layer type: [1, 1, N, kept + N]} for a pass over N new tokens at `positions` [N]:
        0 where visible, the dtype's minimum elsewhere (what eager and SDPA attention both add to the scores).
        A new row sees the committed rows the layer keeps and its ancestors (ancestors None: all new rows),
        both limited to the layer's window."""
        n = positions.shape[0]
        new = ancestors if ancestors is not None else torch.ones(n, n, dtype=torch.bool, device=positions.device)
        out = {}
        for kind, window in dict(zip(self.layer_types, self.windows)).items():
            kept = kept_rows(self.length, window)
            committed = torch.arange(self.length - kept, self.length, device=positions.device)
            visible = torch.cat([window_visible(positions, committed, window, causal=True),
                                 new & window_visible(positions, positions, window, causal=False)], dim=1)
            mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
            out[kind] = mask.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]
        return out

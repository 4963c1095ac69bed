"""The target model: a Llama/Qwen-family decoder with a preallocated KV cache and tap-layer capture."""
from __future__ import annotations

import torch
from torch import nn

from .attention import Visibility, attend
from ..base.config import ModelConfig
from .fused import fuse_layer, unfuse_layer
from .kv_cache import KVCache
from .layers import DecoderLayer, RMSNorm, Rotary
from .protocol import RowLogits, TargetOutput


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, loaded: bool = False):
        super().__init__()
        # loaded: an uninitialized table, whose values the caller loads next
        table = torch.empty(cfg.vocab_size, cfg.hidden_size) if loaded else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cfg.qk_norm) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(nn.Module):
    """The reference target, pure torch. Parameter names follow Hugging Face (model.layers.{i}..., lm_head) so HF
    state dicts load as they are. A loaded target on a float32 CPU runs inside the CPU runtime
    (ddtree/runtime/cpu/runtime.py: CPUTarget), which takes the passes it has fast paths for and hands it the rest."""

    backend = "own"  # the target backend (ddtree.models.hf_target.HFTarget is the generic one)
    quant = None  # the reference runs its float weights (a runtime may run quantized blocks: Target.quant)
    step_ops = None  # the engine's own step operations (a runtime may supply faster ones: Target.step_ops)
    host_inputs = False  # its passes take device tensors

    def __init__(self, cfg: ModelConfig, attention_backend: str = "sdpa", loaded: bool = False):
        """loaded: the weights are loaded right after (models/loading.py, on the meta device, where a random init or
        an arithmetic op imports torch's compiler stack): the embedding table is left uninitialized and the rotary
        table is the loader's to make."""
        super().__init__()
        self.cfg = cfg
        self.model = _Backbone(cfg, loaded)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = None if loaded else Rotary(cfg)  # loaded: the loader makes it (its table is derived, not stored)
        self.attention_backend = attention_backend  # "sdpa" or "triton", resolved at load (resolve_backend)

    @property
    def fused(self) -> bool:
        return self.model.layers[0].self_attn.qkv_proj is not None

    def fuse(self, on: bool = True) -> "TargetModel":
        """The inference weight layout (ddtree.models.fused: fused QKV and gate/up), or back to the separate-projection
        layout with on=False. Call after the final .to(device, dtype)."""
        for layer in self.model.layers:
            fuse_layer(layer) if on else unfuse_layer(layer)
        return self

    def _apply(self, fn, *args, **kwargs):
        # .to() / .float() / .cuda() copy parameters, which would cut the q/k/v views off the fused weights:
        # convert the separate layout and fuse again.
        if not self.fused:
            return super()._apply(fn, *args, **kwargs)
        self.fuse(False)
        super()._apply(fn, *args, **kwargs)
        return self.fuse()

    def refresh(self) -> "TargetModel":
        """Nothing to re-make: the reference keeps no copies of its weights (protocol.Target)."""
        return self

    def check_fresh(self) -> None:
        """The reference keeps no copies that could go stale (protocol.Target)."""

    def lazy_logits(self, rows: int) -> bool:
        """The reference computes all rows' logits at once (RowLogits pay where a runtime's 1-row head is fast)."""
        return False

    def describe(self) -> dict:
        """Nothing beyond its shape, dtype and device sets its passes' cost (protocol.Target)."""
        return {}

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def embed_table(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [N, H] -> logits [N, V]; the drafter shares this LM head."""
        return self.lm_head(hidden)

    def new_cache(self, capacity: int, dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache of kv_dtype, or of `dtype` (a runtime's: CPUTarget.kv_dtype)."""
        c = self.cfg
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, dtype or self.kv_dtype, self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, vis: Visibility,
                tap_layers: tuple[int, ...] = (), last_only: bool = False, row_logits: bool = False) -> TargetOutput:
        """One pass over N new tokens [N] at `positions` [N]; writes their K/V at cache rows
        [cache.length, cache.length + N) without committing them (the caller commits). row_logits: return
        the logits as RowLogits, computed per row when read (see RowLogits)."""
        hidden, features = self.hidden_states(tokens, positions, cache, vis, tap_layers, last_only)
        logits = RowLogits(self, hidden) if row_logits else self.logits(hidden)
        return TargetOutput(logits, features)

    @torch.inference_mode()
    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, vis: Visibility,
                      tap_layers: tuple[int, ...] = (), last_only: bool = False):
        """forward() up to the final norm: (hidden [N, H] ([1, H] with last_only), tap features
        [N, len(tap_layers) * H] or None)."""
        h = self.embed(tokens)  # [N, H]
        cos, sin = self.rotary(positions, h.dtype)
        h, features = self._layers(h, cos, sin, cache, vis, tap_layers)
        return self.model.norm(h[-1:] if last_only else h), features

    def _layers(self, h, cos, sin, cache: KVCache, vis: Visibility, tap_layers) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The eager layers (the reference): h [N, H] -> (h, tap features [N, len(tap_layers) * H] or None)."""
        backend = self.attention_backend
        taps = []
        for i, layer in enumerate(self.model.layers):
            # the new rows' K/V go to the cache; the queries see the cached past + the new rows (vis)
            h = layer(h, cos, sin, lambda q, k, v, i=i: attend(q, *cache.write(i, k, v), vis, backend))
            if i in tap_layers:
                taps.append(h)
        # Tap order follows tap_layers (the drafter's target_layer_ids order).
        by_layer = dict(zip(sorted(tap_layers), taps))
        return h, torch.cat([by_layer[l] for l in tap_layers], dim=-1) if tap_layers else None

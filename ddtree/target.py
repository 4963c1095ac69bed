"""The target model: a Llama/Qwen-family decoder with a preallocated KV cache and tap-layer capture."""
from __future__ import annotations

import torch
from torch import nn

from . import cpu_stack, exact_blocks, qlinear
from .attention import Visibility, attend
from .config import ConfigError, ModelConfig
from .fused import fuse_layer, fuse_model, unfuse_layer
from .kv_cache import KVCache
from .layers import DecoderLayer, RMSNorm, Rotary, project
from .protocol import RowLogits, TargetOutput


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cfg.qk_norm) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


ROW_LOGITS_MIN_ROWS = 12  # float32, one thread: from here RowLogits beat all rows at once (lazy_logits)


class TargetModel(nn.Module):
    """Parameter names follow Hugging Face (model.layers.{i}..., lm_head) so HF state dicts load as they are."""

    backend = "own"  # the target backend (ddtree.hf_target.HFTarget is the generic one)

    def __init__(self, cfg: ModelConfig, attention_backend: str = "sdpa"):
        super().__init__()
        self.cfg = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg)
        self.attention_backend = attention_backend  # "sdpa" or "triton", resolved at load (resolve_backend)
        self.head_t: torch.Tensor | None = None  # lm_head.weight.T contiguous [H, V] (fuse(); fp32 CPU only)
        self.quant: str | None = None  # e.g. "gguf Q4_1/Q8_0": linears on a GGUF's blocks (ddtree/quant_target.py)
        self.stack = None  # the layers as one C++ call (ddtree/cpu_stack.py; float32 CPU, set by fuse()), or None
        self.head_compact = None  # the LM head as 8-bit blocks or bf16 where its values all are (cpu_stack.compact_copy)
        self._copies_of: cpu_stack.WeightsWatch | None = None  # of the weights, when fuse() made copies of them
        self.blocks = None  # ddtree.exact_blocks.ExactBlocks: GGUF blocks equal to the float weights, or None

    @property
    def fused(self) -> bool:
        return self.model.layers[0].self_attn.qkv_weight is not None

    def fuse(self, on: bool = True) -> "TargetModel":
        """The inference weight layout (ddtree.fused: fused QKV and gate/up, a CPU LM head), or back to the
        separate-projection reference layout with on=False. Call after the final .to(device, dtype)."""
        if self.quant:
            raise ConfigError("a quantized target (quant='gguf') has no float layout to switch to; load it without quant")
        if on:
            with torch.inference_mode(False):  # copies made during a pass (_follow_weights) stay ordinary tensors
                # where the stack packs the layers, its packed copies serve their 1-row passes: no transposed
                # 1-row copies for the layers, made only if no stack can be built after all
                packed = cpu_stack.packs(self.model.layers)
                self.head_t = fuse_model(self, self.model.layers, self.lm_head, layer_copies=not packed)
                self.stack = cpu_stack.build(self.cfg, self.model.layers,
                                             self.blocks.layers if self.blocks is not None else None)
                if packed and self.stack is None and self.head_t is not None:
                    for layer in self.model.layers:
                        fuse_layer(layer, transposed=True)
                self.head_compact = cpu_stack.compact_copy(self.lm_head.weight) if self.stack is not None else None
            copies = self.head_t is not None or self.stack is not None
            self._copies_of = cpu_stack.WeightsWatch(self.parameters) if copies else None
        else:
            for layer in self.model.layers:
                unfuse_layer(layer)
            self.head_t = self.stack = self.head_compact = self._copies_of = self.blocks = None
        return self

    def attach_blocks(self, blocks) -> None:
        """Read narrow passes (exact_blocks.layer_max_rows(), head_max_rows() rows) from `blocks`
        (ddtree.exact_blocks.ExactBlocks, GGUF blocks that dequantize exactly to these float weights; same bits)."""
        self.blocks = blocks
        self.stack = cpu_stack.build(self.cfg, self.model.layers, blocks.layers)
        if blocks.head is not None:
            self.head_t = None  # its 1-row GEMV copy ([H, V] floats) would serve nothing now

    def _follow_weights(self) -> None:
        """fuse() copies weights (transposes for 1-row GEMVs, the stack's packed and bf16 copies). A weight changed
        in place since (a test's surgery, load_state_dict) would leave 1-row and many-row passes on different
        values, and the method's tokens no longer plain decoding's: re-make the copies then (cpu_stack.WeightsWatch:
        a few us per pass for SmolLM2's 272 parameters)."""
        if self._copies_of is not None and self._copies_of.changed():
            self.blocks = None  # they were these weights' values, not the new ones'
            self.fuse()

    def refresh(self) -> "TargetModel":
        """Re-make the copies of the weights (the stack's, the 1-row head's; the exact GGUF blocks are dropped) from
        their current values. Needed only after writes torch does not count: `p.data[...] = x`, `p.data.mul_()`, or
        a numpy view's elements. In-place torch ops, load_state_dict and assigning parameters are followed on
        every pass without it."""
        if self._copies_of is not None:
            self.blocks = None
            self.fuse()
        return self

    def check_fresh(self) -> None:
        """A ConfigError where the weights' values were written behind torch's back since their copies were made
        (cpu_stack.WeightsWatch.stale): decoding would mix the old and the new model."""
        if self._copies_of is not None and not self._copies_of.changed() and self._copies_of.stale():
            raise ConfigError(cpu_stack.STALE)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .float() / .cuda() copy parameters, which would cut the q/k/v views off the fused weights:
        # convert the reference layout and fuse again.
        if not self.fused:
            return super()._apply(fn, *args, **kwargs)
        if self.quant:
            raise ConfigError("a quantized target (quant='gguf') runs on the CPU in float32 only; load it without "
                              "quant to move or convert it")
        self.fuse(False)
        super()._apply(fn, *args, **kwargs)
        return self.fuse()

    @property
    def row_logits(self) -> bool:
        """Can a pass return RowLogits (forward(row_logits=True))? Where the 1-row LM head is fast: float32 CPU,
        and a quantized head (ddtree/qlinear.py)."""
        return (self.head_t is not None or self.blocks is not None and self.blocks.head is not None
                or self.quant is not None and not isinstance(self.lm_head, nn.Linear))

    def lazy_logits(self, rows: int) -> bool:
        """Should a verify of `rows` nodes return RowLogits? A walk reads about tau rows, each a 1-row head pass
        that streams the [V, H] head, where all rows at once take the row kernel in one pass over it. On two threads
        the kernel splits the head while torch's 1-row GEMV does not, so all rows at once win; on one thread lazy
        rows win from ROW_LOGITS_MIN_ROWS nodes (docs/cpu-speed.md). A quantized head (compute-bound at several
        rows) always reads lazily. A head with exact blocks (attach_blocks) takes them for up to
        exact_blocks.head_max_rows() rows at once, so it reads rows lazily only above that."""
        if not self.row_logits or rows < 2:
            return False
        if self.blocks is not None and self.blocks.head is not None:
            return rows > exact_blocks.head_max_rows()
        return self.quant is not None or (rows >= ROW_LOGITS_MIN_ROWS and torch.get_num_threads() == 1)

    def describe(self) -> dict:
        """The fast paths that set its passes' cost: the quantization it runs, the C++ layers on this kernel
        build, the exact GGUF blocks (the verify-cost curve's key; protocol.Target)."""
        out = {}
        if self.quant:
            out["quant"] = self.quant
        if self.stack is not None:
            out.update(cpu_layers=True, cpu_kernel=qlinear.kernel().isa)
        if self.blocks is not None:
            out["exact_blocks"] = True
        return out

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [N, H] -> logits [N, V]; the drafter shares this LM head."""
        head = self.blocks.head if self.blocks is not None else None
        if (head is not None and hidden.dim() == 2 and hidden.shape[0] <= exact_blocks.head_max_rows()
                and not (torch.is_grad_enabled() and hidden.requires_grad)):
            return head.matmul(hidden.contiguous())  # exact blocks (ddtree/exact_blocks.py): same bits, fewer bytes
        if self.head_compact is not None and hidden.dim() == 2 and not (torch.is_grad_enabled() and hidden.requires_grad):
            return cpu_stack.compact_linear(hidden, self.head_compact)  # same bits, fewer bytes
        return project(hidden, self.lm_head.weight, self.head_t)  # head_t: a 1-row fast path (ddtree.fused)

    def new_cache(self, capacity: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, vis: Visibility,
                tap_layers: tuple[int, ...] = (), last_only: bool = False, row_logits: bool = False) -> TargetOutput:
        """One pass over N new tokens [N] at `positions` [N]; writes their K/V at cache rows
        [cache.length, cache.length + N) without committing them (the caller commits). row_logits: return
        the logits as RowLogits, computed per row when read (see RowLogits)."""
        backend = self.attention_backend
        self._follow_weights()
        h = self.embed(tokens)  # [N, H]
        cos, sin = self.rotary(positions, h.dtype)
        norm = self.model.norm
        if cpu_stack.usable(self.stack, h.shape[0], backend, vis):  # all layers in one C++ call
            h, features = self.stack.forward(h, cos, sin, cache.k, cache.v, cache.length, vis.ancestors,
                                             list(tap_layers))
            hidden = qlinear.kernel().rms_norm(h[-1:] if last_only else h, norm.weight, norm.eps)
        else:
            h, features = self._layers(h, cos, sin, cache, vis, tap_layers)
            hidden = norm(h[-1:] if last_only else h)
        logits = RowLogits(self, hidden) if row_logits else self.logits(hidden)
        return TargetOutput(logits, features if tap_layers else None)

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

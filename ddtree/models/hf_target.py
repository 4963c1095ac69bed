"""The generic target backend: any Hugging Face causal LM with full and/or sliding-window attention
(Qwen3-MoE, gpt-oss, Gemma-2/3, Phi-3, Llama, ...), behind the same interface as the own-code TargetModel:
forward(tokens, positions, cache, vis, tap_layers, last_only) -> TargetOutput, new_cache, embed, logits, cfg.

- Tree visibility: a 4-D additive mask per attention type (TreeCache.masks) passed as the model's attention
  mask (a dict {layer type: mask} when the model mixes full and sliding layers, the convention transformers'
  own generate() uses), with position ids per node, so RoPE, sinks, soft-capping and MoE stay the model's own.
- The KV cache is a transformers Cache (hf_cache.TreeCache) compacted to the accepted path at commit.
- Tap features: forward hooks on just the tap layers (the decoder layer's output, before the final norm).
- Logits: the base model's last hidden states through the LM head, only for the rows asked for.
Recurrent / linear-attention layers are refused: a tree verify needs a separate recurrent state per node.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Visibility
from ..base.config import ConfigError, ModelConfig, read_config
from .hf_cache import TreeCache
from .protocol import TargetOutput

ATTENTION_TYPES = ("full_attention", "sliding_attention")
# Models whose layers carry a recurrent state (linear attention, SSM, RNN) instead of, or besides, a KV cache.
RECURRENT_MODELS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "mamba", "mamba2",
                    "falcon_mamba", "jamba", "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h",
                    "lfm2", "lfm2_moe", "recurrent_gemma", "rwkv", "xlstm", "minimax", "plamo2", "kimi_linear")
OPTIONS = ("the own-code backend runs llama / qwen2 / qwen3 / mistral without sliding windows; the hf backend "
           "runs any transformers causal LM whose layers are all full or sliding-window attention")


@dataclass(frozen=True)
class HFTargetConfig(ModelConfig):
    """The target's shape as the engine and drafters read it (ModelConfig's fields), for any architecture:
    transformers has validated the config, and only the fields' values are used, never the own-code model."""

    def __post_init__(self):
        pass

    @classmethod
    def from_transformers(cls, c) -> "HFTargetConfig":
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope.get("rope_theta"), (int, float)) else None
        eos = getattr(c, "eos_token_id", None)
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        # an untrained drafter for this target gets plain RoPE at this theta (rope_scaling None)
        return cls(arch=c.model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                   intermediate_size=getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
                   num_layers=c.num_hidden_layers, num_heads=heads,
                   num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                   rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
                   rope_theta=float(theta or getattr(c, "rope_theta", None) or 10000.0),
                   max_position_embeddings=getattr(c, "max_position_embeddings", None) or 4096,
                   eos_token_ids=eos)


def attention_layout(config) -> tuple[list[str], list[int | None]]:
    """Each layer's attention type and sliding window, read as transformers' own caches read them; a
    ConfigError naming the architecture for anything that is not plain full / sliding-window attention."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    c = config.get_text_config()
    arch = c.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"architecture {arch!r} is an encoder-decoder model; ddtree needs a decoder-only causal LM "
                          f"({OPTIONS})")
    try:
        types, kwargs = get_layer_types_and_kwargs(c)
    except Exception as e:  # noqa: BLE001 - an unusual config transformers itself cannot lay out
        raise ConfigError(f"cannot read the attention layout of architecture {arch!r} ({e}); {OPTIONS}") from e
    odd = sorted(set(types) - set(ATTENTION_TYPES))
    if arch in RECURRENT_MODELS or any(t in ("linear_attention", "conv", "hybrid", "hybrid_sliding") for t in odd):
        raise ConfigError(f"architecture {arch!r} is a hybrid / linear-attention model (layer types "
                          f"{sorted(set(types))}): its recurrent layers keep ONE state per sequence, but a tree verify needs a separate "
                          "state per tree node (each node continues a different path), which ddtree does not "
                          f"implement. Options: {OPTIONS}.")
    if odd:
        raise ConfigError(f"architecture {arch!r} has layer types {odd} that are not plain full or sliding-window "
                          f"attention; ddtree cannot verify a tree through them. Options: {OPTIONS}.")
    if isinstance(kwargs, dict):  # some transformers 5.x releases return one kwargs dict for all layers
        kwargs = [kwargs] * len(types)
    # a full-attention layer has no window, whatever its kwargs carry
    windows = [None if t == "full_attention" else kw.get("sliding_window") for t, kw in zip(types, kwargs)]
    if len({(t, w) for t, w in zip(types, windows)}) != len(set(types)):
        raise ConfigError(f"architecture {arch!r} has layers of one type with different windows; not supported")
    return list(types), windows


def _decoder_layers(model, n: int) -> nn.ModuleList:
    layers = getattr(model.base_model, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == n:
        return layers
    found = [m for m in model.base_model.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(found) != 1:
        raise ConfigError(f"cannot find the {n} decoder layers of architecture {model.config.model_type!r}")
    return found[0]


class HFTarget(nn.Module):
    """A transformers causal LM as a ddtree target (batch size 1; see the module docstring)."""

    def __init__(self, model, layer_types: list[str], windows: list[int | None], attention_backend: str = "auto"):
        super().__init__()
        self.hf = model
        text = model.config.get_text_config()
        self.cfg = HFTargetConfig.from_transformers(text)
        self.layer_types, self.windows = layer_types, windows
        self._layers = list(_decoder_layers(model, self.cfg.num_layers))  # a plain list: not re-registered
        self.backend = f"hf:{model.config._attn_implementation}"  # which backend, and the model's attention
        self.attention_backend = attention_backend  # ddtree's, for the drafter bound to this target
        # logit post-processing some architectures apply after the LM head (Gemma: tanh soft-capping)
        self._softcap = getattr(text, "final_logit_softcapping", None)
        self._scale = getattr(text, "logit_scale", None) or 1.0
        self._divide = getattr(text, "logits_scaling", None) or 1.0
        # the cache's keyword: `cache` in newer transformers, where `past_key_values` is deprecated for removal
        params = inspect.signature(model.base_model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The raw embedding rows [N, H] (no model-specific scaling: what a DFlash drafter is fed)."""
        return F.embedding(tokens, self.embed_table())

    def embed_table(self) -> torch.Tensor:
        return self.hf.get_input_embeddings().weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [N, H] -> logits [N, V], with the model's own post-processing."""
        logits = self.hf.get_output_embeddings()(hidden)
        if self._scale != 1.0 or self._divide != 1.0:
            logits = logits * self._scale / self._divide
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def new_cache(self, capacity: int) -> TreeCache:
        return TreeCache(self.layer_types, self.windows, capacity)

    quant = None  # the model's own weights, whatever they are
    step_ops = None  # the engine's own step operations
    host_inputs = False  # its passes take device tensors

    def lazy_logits(self, rows: int) -> bool:
        return False  # forward() has no row_logits: the model's head runs over all rows

    def describe(self) -> dict:
        return {}  # shape, dtype, device and backend say it all

    def refresh(self) -> "HFTarget":
        return self  # it keeps no copies of the weights: the model's own are the ones it runs

    def check_fresh(self) -> None:
        pass

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: TreeCache, vis: Visibility,
                tap_layers: tuple[int, ...] = (), last_only: bool = False) -> TargetOutput:
        """One pass over N new tokens [N] at `positions` [N]; their K/V are pending in `cache` until commit."""
        masks = cache.masks(positions, vis.ancestors, self.dtype)  # {type: [1, 1, N, kept + N]}
        mask = masks if len(masks) > 1 else next(iter(masks.values()))
        taps: dict[int, torch.Tensor] = {}

        def keep(layer):
            def hook(module, args, output):
                taps[layer] = (output[0] if isinstance(output, tuple) else output)[0]  # [N, H]
            return hook

        hooks = [self._layers[i].register_forward_hook(keep(i)) for i in set(tap_layers)]
        try:
            out = self.hf.base_model(input_ids=tokens[None], position_ids=positions[None], attention_mask=mask,
                                     use_cache=True, **{self._cache_arg: cache})
        finally:
            for h in hooks:
                h.remove()
        h = out.last_hidden_state[0]  # [N, H], after the final norm
        logits = self.logits(h[-1:] if last_only else h)
        features = torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers else None
        return TargetOutput(logits, features)

    @torch.inference_mode()
    def self_check(self, n: int = 24) -> None:
        """Refuse a model this backend does not reproduce: our cached, masked path (a prefill, a commit, then a
        causal chain) must give the model's own uncached forward's logits on a short random sequence."""
        n = max(2, min(n, self.cfg.max_position_embeddings))
        ids = torch.randint(0, self.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).to(self.device)
        ref = self.hf(input_ids=ids[None], use_cache=False).logits[0].float()
        cache, half = self.new_cache(n), n // 2
        a = self(ids[:half], torch.arange(half, device=self.device), cache, Visibility.causal(0, half, self.device))
        cache.commit(half)
        b = self(ids[half:], torch.arange(half, n, device=self.device), cache,
                 Visibility.causal(half, n - half, self.device))
        err = (torch.cat([a.logits, b.logits]).float() - ref).abs().max().item()
        tol = (1e-3 if self.dtype == torch.float32 else 5e-2) * (1.0 + ref.abs().max().item())
        if not err <= tol:
            raise ConfigError(f"the hf backend does not reproduce architecture {self.cfg.arch!r}: its tree-masked, "
                              f"cached pass differs from the model's own forward by {err:.3g} (tolerance {tol:.3g})")


def load_hf_target(directory: Path, dtype: torch.dtype, device, attention_backend: str = "auto") -> HFTarget:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    arch = read_config(directory).get("model_type")
    try:
        config = AutoConfig.from_pretrained(str(directory))
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"config.json has model_type {arch!r}, which transformers cannot read ({e}); "
                          f"{OPTIONS}") from e
    types, windows = attention_layout(config)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"architecture {arch!r} has no causal-LM class in transformers; {OPTIONS}")
    # Masks are 4-D tensors: SDPA or eager attention (flash / flex kernels would ignore or reject them).
    impl = "sdpa" if MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa else "eager"
    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, attn_implementation=impl)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for missing or corrupt weights
        raise ConfigError(f"cannot load the {arch!r} model in {directory} ({type(e).__name__}: {e}); are its weights "
                          "complete and matching config.json?") from e
    target = HFTarget(model.to(device).eval(), types, windows, attention_backend)
    target.self_check()
    return target

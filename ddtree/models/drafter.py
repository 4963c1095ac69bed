"""The DFlash block-diffusion drafter (published checkpoint format), sharing the target's embedding and LM head.

One pass drafts a whole block [bonus, MASK x (block_size - 1)]. Every draft layer attends, without a causal
mask, over [context K/V ; block K/V], where the context K/V are that layer's k_proj/v_proj of the fused
target features (fc + hidden_norm of the tap layers' hidden states) of the committed tokens. Context K/V are
projected once, when tokens are committed, and kept in the drafter's KVCache; block K/V are dropped.
"""
from __future__ import annotations

import json
import numbers
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from .attention import Visibility, attend, window_visible
from ..base.config import (RESTORE, SIZE_LIMITS, ConfigError, ModelConfig, config_index, config_size,
                     read_config)
from .kv_cache import ContextCache, KVCache, add_context, flush_context
from .layers import DecoderLayer, RMSNorm, Rotary
from .loading import check_weights, read_safetensors, safetensors_shapes
from .markov import CONFIG_KEY as MARKOV_KEY, MarkovHead
from .protocol import reference

WEIGHTS_NAME = "model.safetensors"


def default_tap_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """One draft layer: the middle target layer; otherwise evenly spaced from 1 to L - 3, rounded."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [round(lo + i * (hi - lo) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# dflash_config keys this drafter reads and applies; any other key may change the computation, so it is refused.
DFLASH_KEYS = ("mask_token_id", "target_layer_ids", "block_size", "use_swa", "swa_window_size", "causal")
# Published keys (reference DFlash code) that change the computation unless they hold the identity value.
IDENTITY_KEYS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
LAYER_TYPES = ("full_attention", "sliding_attention")
MAX_BLOCK_SIZE = 1024  # far above any published drafter's (16)


@dataclass(frozen=True)
class DrafterConfig:
    """Attention options of newer published drafters (all default to the original: every layer full and
    non-causal over [context ; block]). Two published conventions:
    - `layer_types` + `sliding_window` (a Qwen3 config, window in effect when `use_sliding_window`): a
      "sliding_attention" layer is CAUSAL and sees keys with q - k < window;
    - dflash_config `use_swa` + `swa_window_size`: sliding layers (all layers when `layer_types` is absent) see
      keys with |q - k| < window, NON-causal.
    dflash_config `causal` (or a top-level `is_causal`) overrides the causality of every layer."""
    model: ModelConfig  # the draft layers' shape (a Qwen3 decoder; hidden_size = the target's)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    draft_vocab_size: int | None = None  # a reduced draft vocabulary (own lm_head + d2t); None = the target's
    layer_types: tuple[str, ...] = ()  # one per draft layer; () = all "full_attention"
    sliding_window: int | None = None  # window of sliding layers (layer_types convention); None = no window
    swa_window: int | None = None  # use_swa's window (swa_window_size); None = use_swa off
    causal: bool | None = None  # override for every layer; None = each layer type's default
    markov: tuple[int, int] | None = None  # a Markov head's (rank, candidates) (ddtree/models/markov.py); None = none

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None and self.draft_vocab_size != self.model.vocab_size

    def __post_init__(self):
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.model.vocab_size:
            raise ConfigError(f"draft_vocab_size must be within 1..vocab_size ({self.model.vocab_size}), got "
                              f"{self.draft_vocab_size}")
        if self.block_size < 2:
            raise ConfigError(f"drafter block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ConfigError("drafter target_layer_ids is empty")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ConfigError(f"drafter target_layer_ids has duplicates: {list(self.target_layer_ids)}")
        if self.layer_types and len(self.layer_types) != self.model.num_layers:
            raise ConfigError(f"drafter layer_types has {len(self.layer_types)} entries for "
                              f"{self.model.num_layers} layers")
        if bad := sorted(set(self.layer_types) - set(LAYER_TYPES)):
            raise ConfigError(f"drafter layer_types {bad} are not supported; known: {', '.join(LAYER_TYPES)}")
        for name in ("sliding_window", "swa_window"):
            if (w := getattr(self, name)) is not None and (not isinstance(w, int) or w < 1):
                raise ConfigError(f"drafter {name} must be a positive integer, got {w!r}")
        if self.causal is not None and not isinstance(self.causal, bool):
            raise ConfigError(f"drafter causal must be true or false, got {self.causal!r}")
        if self.markov is not None and not (len(self.markov) == 2 and all(isinstance(v, int) and v >= 1
                                                                         for v in self.markov)):
            raise ConfigError(f"drafter {MARKOV_KEY} needs positive integers rank and candidates, got {self.markov!r}")

    def layer_attention(self, i: int) -> tuple[int | None, bool]:
        """(window or None, causal) of draft layer i over [context ; block]."""
        sliding = (self.layer_types[i] == "sliding_attention" if self.layer_types else self.swa_window is not None)
        window = (self.swa_window or self.sliding_window) if sliding else None
        causal = (sliding and self.swa_window is None) if self.causal is None else self.causal
        return window, causal

    @classmethod
    def from_hf(cls, cfg: dict) -> "DrafterConfig":
        dflash = cfg.get("dflash_config") or {}
        block_size = dflash.get("block_size", cfg.get("block_size"))
        if "mask_token_id" not in dflash or block_size is None or "num_target_layers" not in cfg:
            raise ConfigError("not a DFlash drafter config: config.json needs block_size, num_target_layers and "
                              "dflash_config.mask_token_id")
        model = ModelConfig.from_hf({**cfg, "model_type": "qwen3"})
        # every number checked before it shapes a tensor: an integer (576.0 or "576" is no size) in a sane range
        n_target = config_size("num_target_layers", cfg.get("num_target_layers"), SIZE_LIMITS["num_layers"])
        ids = dflash.get("target_layer_ids") or default_tap_layers(n_target, model.num_layers)
        if not isinstance(ids, (list, tuple)):
            raise ConfigError(f"config field dflash_config.target_layer_ids must be a list of layer numbers, got "
                              f"{ids!r}: {RESTORE}")
        ids = [config_index("dflash_config.target_layer_ids", i, n_target) for i in ids]
        block_size = config_size("block_size", block_size, MAX_BLOCK_SIZE)
        mask = config_index("dflash_config.mask_token_id", dflash["mask_token_id"], model.vocab_size)
        draft_vocab = cfg.get("draft_vocab_size")
        if draft_vocab is not None:
            draft_vocab = config_size("draft_vocab_size", draft_vocab, model.vocab_size)
        markov = cfg.get(MARKOV_KEY)
        if markov is not None and not (isinstance(markov, dict) and {"rank", "candidates"} <= set(markov)):
            raise ConfigError(f"drafter {MARKOV_KEY} must be {{\"rank\": r, \"candidates\": M}}, got {markov!r}")
        if markov is not None:  # its tensors are [hidden, rank] and [rank, draft vocab]: a low rank, by design
            markov = (markov["rank"], markov["candidates"])
            for name, value, limit in (("rank", markov[0], model.hidden_size),
                                       ("candidates", markov[1], draft_vocab or model.vocab_size)):
                if _is_int(value) and value > limit:  # not an integer, or < 1: __post_init__ says so
                    raise ConfigError(f"config field {MARKOV_KEY}.{name} must be within 1..{limit}, got {value}: "
                                      f"{RESTORE}")
        return cls(model, block_size, mask, tuple(ids), n_target, draft_vocab,
                   **_attention_options(cfg, dflash, model.num_layers), markov=markov)

    def to_hf(self) -> dict:
        out = self.model.to_hf()
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        for key in ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers", "is_causal"):
            out.pop(key, None)  # written below from the parsed options, never copied stale from the raw config
        if self.layer_types:
            out["layer_types"] = list(self.layer_types)
        if self.sliding_window is not None:
            out.update(sliding_window=self.sliding_window, use_sliding_window=True)
        if self.swa_window is not None:
            dflash.update(use_swa=True, swa_window_size=self.swa_window)
        if self.causal is not None:
            dflash["causal"] = self.causal
        out.update(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=self.block_size,
                   num_target_layers=self.num_target_layers, tie_word_embeddings=False, dflash_config=dflash)
        if self.reduced_vocab:  # EAGLE-3 / vLLM convention: own lm_head [draft_vocab_size, H] and d2t offsets
            out["draft_vocab_size"] = self.draft_vocab_size
        out.pop(MARKOV_KEY, None)
        if self.markov is not None:
            out[MARKOV_KEY] = {"rank": self.markov[0], "candidates": self.markov[1]}
        return out

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size if self.reduced_vocab else self.model.vocab_size

    def check_target(self, target: ModelConfig) -> None:
        """Raise a ConfigError naming the mismatch when this drafter cannot serve `target`."""
        problems = []
        if self.model.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.model.hidden_size} != target's {target.hidden_size}")
        if self.model.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.model.vocab_size} != target's {target.vocab_size}")
        if self.num_target_layers != target.num_layers:
            problems.append(f"num_target_layers {self.num_target_layers} != target's {target.num_layers} layers")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's layers 0..{target.num_layers - 1}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the target's vocab (0..{target.vocab_size - 1})")
        if problems:
            raise ConfigError("drafter does not match the target: " + "; ".join(problems) +
                              ". Use a drafter trained for this target.")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _attention_options(cfg: dict, dflash: dict, num_layers: int) -> dict:
    """The attention options of a published config.json (see DrafterConfig); refuses what it cannot apply."""
    if unknown := sorted(set(dflash) - set(DFLASH_KEYS) - set(IDENTITY_KEYS)):
        raise ConfigError(f"drafter dflash_config has keys ddtree does not understand: {unknown}. They may change "
                          f"the drafter's computation, so it is refused rather than run wrongly (understood: "
                          f"{', '.join(DFLASH_KEYS)})")
    for key, identity in IDENTITY_KEYS.items():
        value = dflash.get(key, cfg.get(key, identity))
        if value not in (identity, 0 if identity is None else identity):
            raise ConfigError(f"drafter option {key}={value!r} is not supported (only {identity!r})")
    types = cfg.get("layer_types")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if types is None and window is not None:  # Qwen3's rule: layers from max_window_layers on slide
        start = cfg.get("max_window_layers", num_layers)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    swa = dflash.get("swa_window_size") if dflash.get("use_swa") else None
    if dflash.get("use_swa") and swa is None:
        raise ConfigError("drafter dflash_config sets use_swa without swa_window_size")
    causal = dflash.get("causal", cfg.get("is_causal"))
    if "causal" in dflash and cfg.get("is_causal") not in (None, dflash["causal"]):
        raise ConfigError(f"drafter config has causal={dflash['causal']} but is_causal={cfg['is_causal']}")
    return dict(layer_types=tuple(types or ()), sliding_window=window, swa_window=swa, causal=causal)


class DFlashDrafter(nn.Module):
    label = ""  # what the stats call it: "shipped", "untrained" or the path it was loaded from (ddtree.load)

    def __init__(self, cfg: DrafterConfig, attention_backend: str = "sdpa", loaded: bool = False):
        """loaded: built on the meta device for fill() (on_meta), where a random init would import torch's compiler
        stack: the Markov head's projection is left uninitialized and the rotary table is fill()'s to make."""
        super().__init__()
        m = cfg.model
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * m.hidden_size, m.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(m, qk_norm=True) for _ in range(m.num_layers))
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        if cfg.reduced_vocab:
            # Its own head over the draft vocabulary; draft id j is target id j + d2t[j] (vLLM's key names).
            self.lm_head = nn.Linear(m.hidden_size, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        # parent-conditioned trees (ddtree/models/markov.py); None drafts exactly as the published drafter
        self.markov = (MarkovHead(m.hidden_size, cfg.draft_vocab, cfg.block_size - 1, *cfg.markov, loaded=loaded)
                       if cfg.markov is not None else None)
        self.rotary = None if loaded else Rotary(m)
        self.attention_backend = attention_backend
        self._target = ()  # the bound target, kept out of the module tree (its weights are not ours to save)

    def refresh(self) -> "DFlashDrafter":
        """Nothing to re-make: the reference keeps no copies of its weights (the CPU runtime's CPUDrafter does)."""
        return self

    def check_fresh(self) -> None:
        """The reference keeps no copies that could go stale."""

    def describe(self) -> dict:
        """What a draft pass streams of its layers' weights (protocol.Drafter): their dtype."""
        return {"storage": str(self.layers[0].mlp.gate_proj.weight.dtype).removeprefix("torch.")}

    # --- binding to the target --------------------------------------------------------------------------
    def bind(self, target) -> "DFlashDrafter":
        self.cfg.check_target(target.cfg)
        self._target = (target,)
        return self

    @property
    def target(self):
        if not self._target:
            raise RuntimeError("drafter is not bound to a target: call drafter.bind(target)")
        return self._target[0]

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def new_cache(self, capacity: int) -> ContextCache:
        m = self.cfg.model
        w = self.fc.weight
        return ContextCache(m.num_layers, m.num_kv_heads, m.head_dim, capacity, w.dtype, w.device)

    # --- decoding ---------------------------------------------------------------------------------------
    def add_context(self, cache: KVCache, features: torch.Tensor) -> None:
        """Commit context for the next n tokens: features [n, taps * H] from the target's tap layers. A
        ContextCache (new_cache) queues them for the next draft(), which computes all queued rows in one pass:
        steps that do not draft (budget="auto" declining on a slow verify) then cost the drafter nothing. Any
        other cache gets them now."""
        add_context(cache, features, self.context_pass)

    def flush_context(self, cache: KVCache) -> None:
        """Compute the context that add_context queued (draft() does this first)."""
        flush_context(cache, self.context_pass)

    @torch.inference_mode()
    def context_pass(self, cache: KVCache, features: torch.Tensor) -> None:
        """Project features [n, taps * H] to every layer's context K/V at the next n cache rows and commit them."""
        n = features.shape[0]
        cos, sin = self.rotary(torch.arange(cache.length, cache.length + n, device=features.device), features.dtype)
        ctx = self.hidden_norm(self.fc(features))  # [n, H]
        for i, layer in enumerate(self.layers):
            cache.write(i, *layer.self_attn.key_value(ctx, cos, sin))
        cache.commit(n)

    @torch.inference_mode()
    def draft(self, cache: KVCache, bonus: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """One pass over [bonus, MASK x (length - 1)] at positions cache.length + [0, length).
        bonus: LongTensor [1]. Returns logits [length - 1, V] for block positions 1..length-1."""
        self.flush_context(cache)
        h, cos, sin, visibility = self.block_inputs(cache, bonus, length)
        return self.logits(self.norm(self.block_layers(h, cos, sin, visibility, cache)[1:]))

    def block_inputs(self, cache: KVCache, bonus: torch.Tensor, length: int | None = None):
        """The block's embeddings h [B, H], cos / sin [B, D] at its positions, and per layer its Visibility."""
        length = length or self.block_size
        block = torch.full((length,), self.cfg.mask_token_id, dtype=torch.long, device=bonus.device)
        block[:1] = bonus
        h = self.target.embed(block)  # [B, H]
        positions = torch.arange(cache.length, cache.length + length, device=h.device)
        cos, sin = self.rotary(positions, h.dtype)
        return h, cos, sin, self._visibility(positions, cache.length)

    def block_layers(self, h, cos, sin, visibility: list[Visibility], cache: KVCache) -> torch.Tensor:
        """The draft layers over the block h [B, H] -> [B, H]; its K/V are written as pending rows after the
        context: dropped, never committed."""
        backend = self.attention_backend  # resolved at load
        for i, layer in enumerate(self.layers):
            vis = visibility[i]
            how = backend if vis.past is None else "sdpa"  # the Triton kernel sees the whole past
            h = layer(h, cos, sin, lambda q, k, v, i=i, vis=vis, how=how: attend(q, *cache.write(i, k, v), vis, how))
        return h

    def _visibility(self, positions: torch.Tensor, past_len: int) -> list[Visibility]:
        """Per draft layer, what the block (at `positions` [B]) sees of [context (positions 0..past_len-1) ; block].
        The original drafter: everything (non-causal, no window). Sliding / causal layers: by position."""
        by_kind: dict[tuple, Visibility] = {}
        out = []
        for i in range(len(self.layers)):
            kind = self.cfg.layer_attention(i)
            if kind not in by_kind:
                window, causal = kind
                if window is None and not causal:
                    by_kind[kind] = Visibility(past_len, None)
                else:
                    context = torch.arange(past_len, device=positions.device)
                    past = window_visible(positions, context, window, causal)  # [B, past_len]
                    by_kind[kind] = Visibility(past_len, window_visible(positions, positions, window, causal),
                                               None if window is None else past)
            out.append(by_kind[kind])
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [N, H] -> logits over the draft vocabulary [N, draft_vocab] (the target's
        vocabulary and LM head unless the drafter has a reduced one)."""
        return self.lm_head(hidden) if self.cfg.reduced_vocab else self.target.logits(hidden)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape) -> the target's token ids."""
        return ids + self.d2t[ids] if self.cfg.reduced_vocab else ids

    def set_markov_head(self, head: MarkovHead | None) -> None:
        """Give the drafter a Markov head (ddtree/models/markov.py), or take its head away (None): the module and the
        config's (rank, candidates) change together, so that save() writes what the drafter runs."""
        self.markov = head
        self.cfg = replace(self.cfg, markov=None if head is None else (head.rank, head.candidates))

    def set_draft_vocab(self, target_ids: torch.Tensor, head_weight: torch.Tensor) -> None:
        """Use the draft vocabulary `target_ids` [draft_vocab] (distinct target ids): d2t from them and the
        head's rows copied from the target's LM head `head_weight` [V, H]."""
        if not self.cfg.reduced_vocab or target_ids.numel() != self.cfg.draft_vocab_size:
            raise ConfigError(f"set_draft_vocab: the drafter's draft_vocab_size is {self.cfg.draft_vocab_size}, "
                              f"got {target_ids.numel()} ids")
        if target_ids.unique().numel() != target_ids.numel():
            raise ConfigError("set_draft_vocab: the draft vocabulary has repeated token ids")
        ids = target_ids.to(self.d2t.device, torch.long)
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
            self.lm_head.weight.copy_(head_weight[ids.to(head_weight.device)].to(self.lm_head.weight))

    # --- the published checkpoint format ---------------------------------------------------------------
    def save(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        """config.json + model.safetensors in the published format; dtype casts the weights (e.g. bf16 to ship)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.cfg.to_hf(), indent=2) + "\n")
        state = {k: v.detach().to(dtype if dtype is not None and v.is_floating_point() else v.dtype).contiguous().cpu()
                 for k, v in self.state_dict().items()}  # d2t stays int64
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def load(cls, directory: str | Path, dtype: torch.dtype = torch.float32, device="cpu",
             attention_backend: str = "sdpa", target=None) -> "DFlashDrafter":
        """With `target`, its config is checked against the drafter's before any weights are read (the
        mismatch named, not a size error), and the drafter comes back bound to it."""
        directory = Path(directory)
        try:
            cfg = DrafterConfig.from_hf(read_config(directory))
        except ConfigError as e:
            raise ConfigError(f"drafter {directory}: {e}") from None
        if target is not None:
            cfg.check_target(target.cfg)
        shared = ("embed_tokens.weight", "t2d") + (() if cfg.reduced_vocab else ("lm_head.weight",))

        def own(tensors: dict) -> dict:  # a "model." prefix tolerated; the target's tensors (and t2d, unused) dropped
            tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
            return {k: v for k, v in tensors.items() if k not in shared}

        # Built on the meta device and checked against the weights' header first: a config.json that does not
        # describe these weights (300 layers, a float size, a huge Markov rank) allocates nothing.
        drafter = cls.on_meta(cfg, attention_backend)
        check_weights(drafter, own(safetensors_shapes(directory)), directory)
        drafter.fill(own(read_safetensors(directory)), directory)
        drafter = drafter.to(device=device, dtype=dtype).eval()
        return drafter if target is None else drafter.bind(target)

    @classmethod
    def on_meta(cls, cfg: DrafterConfig, attention_backend: str = "sdpa") -> "DFlashDrafter":
        """A drafter of this config whose tensors have shapes but no memory yet (fill gives them their values)."""
        with torch.device("meta"):
            return cls(cfg, attention_backend, loaded=True)

    def fill(self, state: dict, source) -> "DFlashDrafter":
        """An on_meta drafter's tensors from `state` (taken as they are, no copy); a ConfigError when it does not
        match the config. The derived RoPE buffer is made anew."""
        check_weights(self, state, source)
        # a plain dict: load_state_dict(assign=True) marks a state_dict's own _metadata, and a later plain
        # load_state_dict of that same state_dict (Trainer.load_state) would then replace the parameters too
        self.load_state_dict(dict(state), strict=True, assign=True)
        self.rotary = Rotary(self.cfg.model)
        return self


def untrained_drafter(target, num_layers: int = 1, block_size: int = 16, seed: int = 0,
                      mask_token_id: int | None = None, draft_vocab: torch.Tensor | None = None) -> DFlashDrafter:
    """A seeded random drafter shaped for `target`: exercises the machinery, predicts nothing useful.
    draft_vocab: target ids of a reduced draft vocabulary (its head rows are copied from the target's)."""
    t = target.cfg
    model = ModelConfig(arch="qwen3", vocab_size=t.vocab_size, hidden_size=t.hidden_size,
                        intermediate_size=t.intermediate_size, num_layers=num_layers, num_heads=t.num_heads,
                        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps,
                        rope_theta=t.rope_theta, rope_scaling=t.rope_scaling,
                        max_position_embeddings=t.max_position_embeddings)
    mask = t.vocab_size - 1 if mask_token_id is None else mask_token_id
    cfg = DrafterConfig(model, block_size, mask, tuple(default_tap_layers(t.num_layers, num_layers)), t.num_layers,
                        None if draft_vocab is None else int(draft_vocab.numel()))
    gen = torch.Generator().manual_seed(seed)
    drafter = DFlashDrafter(cfg, target.attention_backend)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    if draft_vocab is not None:
        drafter.set_draft_vocab(draft_vocab, reference(target).lm_head.weight)
    return drafter.to(device=target.device, dtype=target.dtype).eval().bind(target)


def warn_untrained() -> None:
    warnings.warn("ddtree: no trained drafter for this target: using an UNTRAINED (random) drafter. Outputs stay "
                  "exact, but acceptance and speedups are meaningless. Pass draft=PATH to use a trained one.",
                  stacklevel=3)

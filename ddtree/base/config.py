"""Validated configuration dataclasses: the target architecture, the drafter, and sampling; reading a model
directory's config.json."""
from __future__ import annotations

import argparse
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


class ConfigError(ValueError):
    """A model or generation setting that cannot work; the message names the fix."""


# Numbers from users are checked, never coerced: True is not a count, 2.5 tokens is not a token count, and
# "0.9" is not a probability. Coercing would run a different setting than the one asked for.
def check_int(name: str, value, low: int | None = None) -> int:
    """`value` if it is an integer (>= low when given), else a ConfigError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if low is not None and value < low:
        raise ConfigError(f"{name} must be >= {low}, got {value}")
    return int(value)


def check_number(name: str, value) -> float:
    """`value` if it is a finite real number (not a bool or a string), else a ConfigError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r} ({type(value).__name__})")
    return float(value)


CPU_KERNELS = ("auto", "avx2", "avx512", "off")  # load(cpu_kernel=...): the CPU kernels' build, or none


def cli_int(low: int):
    """argparse type: an integer >= low (e.g. --threads -1 is refused with a usage error, not a traceback)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


RESTORE = "restore the config.json that came with the weights"
# Upper bounds far above any published model's, so that a damaged or hostile config.json is refused before it
# shapes (and allocates) tensors; each with a config.json field name where it differs from ours.
SIZE_LIMITS = {"vocab_size": 1 << 24, "hidden_size": 1 << 16, "intermediate_size": 1 << 20, "num_layers": 1024,
               "num_heads": 1024, "num_kv_heads": 1024, "head_dim": 4096,
               "max_position_embeddings": (1 << 31) - 1}  # no tensor is shaped by it: caches follow the prompt
HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads"}


def config_size(name: str, value, limit: int) -> int:
    """A size from a config.json: an integer (not 576.0, "576" or true) within 1..limit, else a ConfigError naming
    the field, the value and the fix."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"config field {name} must be an integer, got {value!r} ({type(value).__name__}): "
                          f"{RESTORE}")
    if not 1 <= value <= limit:
        raise ConfigError(f"config field {name} must be within 1..{limit}, got {value}: {RESTORE}")
    return int(value)


def config_index(name: str, value, n: int) -> int:
    """An index from a config.json (a token id, a layer number): an integer within 0..n-1, else a ConfigError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"config field {name} must be an integer, got {value!r} ({type(value).__name__}): "
                          f"{RESTORE}")
    if not 0 <= value < n:
        raise ConfigError(f"config field {name} must be within 0..{n - 1}, got {value}: {RESTORE}")
    return int(value)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama/Qwen-family decoder (target or drafter)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope parameters for non-default RoPE types (llama3, yarn, ...)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # the original config.json

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ConfigError(f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        for name, limit in SIZE_LIMITS.items():  # before any tensor is shaped by them
            object.__setattr__(self, name, config_size(HF_NAMES.get(name, name), getattr(self, name), limit))
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive number, got {value!r}: {RESTORE}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalizes each head's query and key (RMSNorm over head_dim) before RoPE."""
        return self.arch == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 always has q/k/v biases; Llama-style configs have them (and an o_proj bias) if attention_bias."""
        return self.attention_bias or self.arch == "qwen2"

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (transformers v4 or v5 layout)."""
        arch = cfg.get("model_type", "")
        if arch not in SUPPORTED_ARCHS:
            raise ConfigError(f"config.json has model_type {arch!r}; ddtree supports {', '.join(SUPPORTED_ARCHS)} "
                              "(Llama/Qwen-family decoders)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}: restore the model's original config.json")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings"):  # checked before any arithmetic
            if cfg.get(key) is not None:
                config_size(key, cfg[key], SIZE_LIMITS[next((k for k, v in HF_NAMES.items() if v == key), key)])
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        hidden = cfg.get("hidden_size")
        if not cfg.get("head_dim") and isinstance(heads, int) and heads > 0 and isinstance(hidden, int) and hidden % heads:
            raise ConfigError(f"hidden_size ({cfg['hidden_size']}) is not a multiple of num_attention_heads ({heads}) "
                              "and config.json gives no head_dim: restore the config.json that came with the weights "
                              "(or add head_dim)")
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        for t in eos:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
                raise ConfigError(f"config field eos_token_id must be a token id or a list of them, got "
                                  f"{cfg['eos_token_id']!r}: {RESTORE}")
        eos = tuple(int(t) for t in eos)
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta) if isinstance(theta, numbers.Real) and not isinstance(theta, bool) else theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=bool(cfg.get("attention_bias", False)) and arch != "qwen2",
            eos_token_ids=eos,
            raw=dict(cfg),
        )

    def to_hf(self) -> dict:
        """A Hugging Face config.json dict for this shape."""
        out = dict(self.raw)
        out.update(
            model_type=self.arch, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias, hidden_act="silu",
        )
        out.pop("rope_parameters", None)
        out["rope_scaling"] = self.rope_scaling
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return out


@dataclass(frozen=True)
class SamplingParams:
    """How the TARGET's next-token distribution is processed. temperature 0 = greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if check_number("temperature", self.temperature) < 0:
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (0.0 < check_number("top_p", self.top_p) <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}; use 1.0 to disable nucleus sampling")
        if check_int("top_k", self.top_k) < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def read_config(directory: Path) -> dict:
    """A model directory's config.json as a dict, or a ConfigError that names what is wrong."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory} has no config.json: expected a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); the download is probably corrupt") from e

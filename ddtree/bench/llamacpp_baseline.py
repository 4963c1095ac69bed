"""The `llamacpp` method: llama.cpp's plain greedy decoding of the same target, the program a CPU user would
pick instead of ours. Through llama-cpp-python, an optional extra (`pip install -e ".[llamacpp]"`; it builds
llama.cpp from source, ~10 minutes on 2 cores); without it the method is skipped with a message (peers.py).

    llamacpp       a GGUF of exactly the target's weights in the target's precision (F32 or BF16), written by
                   ddtree (gguf_export.py) once and cached under the ddtree cache: the same-model comparison
    llamacpp:gguf  the GGUF file the target was loaded from (Q4_1 for the embedded default): what a user
                   downloads and runs

Same prompts (token ids), same thread count as torch (torch.get_num_threads()), greedy (llama.cpp's own
sampler at temperature 0), stopping at the pair's stop ids or max_new_tokens; the timing includes the prompt
pass, as `ar`'s does. llama.cpp's arithmetic differs from ours, so its tokens are compared with `ar`'s and the
agreement is reported, never failed (runner.py).
"""
from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import torch

from ..api import GenerationResult
from ..base.cache import cache_root, content_key, replacing_dir
from ..base.config import ConfigError
from ..base.files import output_dir
from ..models.gguf_export import write_gguf
from ..engine.stats import GenerationStats

INSTALL = ('pip install -e ".[llamacpp]" (or pip install llama-cpp-python; it builds llama.cpp from source, '
           "~10 min on 2 cores)")
# Part of the exported GGUF's cache key: bump when gguf_export's output changes. 2: keyed by the source's bytes.
EXPORT_FORMAT = 2


def llamacpp_problem() -> str | None:
    """Why the llamacpp method cannot run here, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python is not installed ({e}); install it with {INSTALL}"
    return None


def exported_gguf(pair) -> Path:
    """The target's weights as a GGUF in its own precision, written once per (source file, dtype) and cached."""
    source = pair.source_gguf
    if source is None:
        raise ConfigError("the llamacpp method needs the target's GGUF for its tokenizer metadata: load the target "
                          "from a .gguf file (the embedded default is one); Hugging Face directories are not "
                          "supported yet")
    dtype = str(pair.target.dtype).removeprefix("torch.")
    key = hashlib.sha1(f"{EXPORT_FORMAT}:{content_key(source)}:{dtype}".encode())
    folder = cache_root() / "llamacpp" / f"{source.stem}-{dtype}-{key.hexdigest()[:12]}"
    path = folder / "model.gguf"
    if not path.is_file():
        output_dir(folder.parent, "the model cache", "set DDTREE_CACHE to a writable directory")
        print(f"ddtree: writing the target's {dtype} weights as a GGUF for llama.cpp (once; {path})",
              file=sys.stderr, flush=True)
        with replacing_dir(folder) as tmp:
            write_gguf(pair.target, tmp / "model.gguf", source)
    return path


class LlamaCppBaseline:
    """One llama.cpp model for one variant of the spec (None or 'gguf'), loaded on first use."""

    def __init__(self, pair, spec=None):
        self.pair, self.model = pair, None
        self.variant = spec.variant if spec is not None else None

    problem = staticmethod(llamacpp_problem)

    def path(self) -> Path:
        if self.variant == "gguf" or self.pair.target.quant:
            # a target running on its GGUF's blocks (quant='gguf'): that file IS its weights in its precision
            if self.pair.source_gguf is None:
                raise ConfigError("llamacpp:gguf runs the GGUF file the target was loaded from, and this target was "
                                  "not loaded from one; use llamacpp (the same weights written as a GGUF)")
            return self.pair.source_gguf
        return exported_gguf(self.pair)

    def load(self):
        problem = llamacpp_problem()
        if problem:
            raise ConfigError(problem)
        from llama_cpp import Llama

        threads = torch.get_num_threads()
        ctx = min(self.pair.target.cfg.max_position_embeddings, 8192)
        return Llama(str(self.path()), n_ctx=ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                     verbose=False)

    def generate(self, prompt, max_new_tokens: int, chat: bool = True):
        if self.model is None:
            self.model = self.load()
        ids, stop = self.pair.encode(prompt, chat), set(self.pair.stop_ids)
        llm, tokens = self.model, []
        llm.reset()  # a fresh KV cache: no prefix reuse from the previous prompt (ar gets none either)
        t0 = time.perf_counter()
        first = None
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            first = first or time.perf_counter() - t0
            tokens.append(int(tok))
            if tok in stop or len(tokens) >= max_new_tokens:
                break
        seconds = time.perf_counter() - t0
        label = "llamacpp" + (f":{self.variant}" if self.variant else "")
        stats = GenerationStats(label, None, None, len(ids), new_tokens=len(tokens), seconds=seconds,
                                time_to_first_token=first or 0.0,
                                acceptance_lengths=[1] * max(0, len(tokens) - 1),
                                stop_reason="eos" if tokens and tokens[-1] in stop else "max_new_tokens")
        return GenerationResult(tokens, self.pair.decode(tokens), stats, ids)

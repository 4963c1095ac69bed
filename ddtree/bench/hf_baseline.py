"""Hugging Face `generate()` on exactly our target's weights: the reference point for the `ar` baseline's speed
(no speedup may come from a slow baseline) and an independent check of its greedy tokens."""
from __future__ import annotations

import time

import torch

from ..api import GenerationResult
from ..runtime.cpu.quant_target import dequantized_state
from ..engine.stats import GenerationStats
from ..models.protocol import reference


def to_hf_model(target):
    """A transformers CausalLM holding a copy of the same weights, in the same dtype and on the same device
    (on the hf backend, the target's own model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if target.backend != "own":  # the generic backend holds a transformers model already
        return target.hf

    cfg = {k: v for k, v in target.cfg.to_hf().items() if k != "model_type"}
    hf_cfg = AutoConfig.for_model(target.cfg.arch, **cfg)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=target.dtype)
    if target.quant:  # a GGUF-quantized target: the same weights, dequantized (exactly)
        state = dequantized_state(target)
    else:
        state = reference(target).state_dict()
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise RuntimeError(f"HF model does not match the target: {result}")
    if target.cfg.tie_word_embeddings:
        model.tie_weights()
    return model.to(target.device).eval()


@torch.inference_mode()
def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, stop_ids=()) -> tuple[list[int], float]:
    """Greedy HF generate(); returns the new tokens and the wall time in seconds."""
    ids = torch.tensor([prompt_ids], device=model.device)
    eos = list(stop_ids) or None
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=(eos or [0])[0], temperature=None, top_p=None, top_k=None)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0


class HFBaseline:
    """The `hf` method of the benchmark: greedy HF generate() on the pair's target weights, timed like a method.
    The copy of the weights is made on first use."""

    def __init__(self, pair, spec=None):
        self.pair, self.model = pair, None

    @staticmethod
    def problem() -> str | None:
        """Why it cannot run here: never (transformers is a dependency)."""
        return None

    def generate(self, prompt, max_new_tokens: int, chat: bool = True):
        if self.model is None:
            self.model = to_hf_model(self.pair.target)
        ids = self.pair.encode(prompt, chat)
        tokens, seconds = hf_generate(self.model, ids, max_new_tokens, self.pair.stop_ids)
        stats = GenerationStats("hf", None, None, len(ids), new_tokens=len(tokens), seconds=seconds,
                                acceptance_lengths=[1] * max(0, len(tokens) - 1),
                                stop_reason="eos" if tokens and tokens[-1] in self.pair.stop_ids else "max_new_tokens")
        return GenerationResult(tokens, self.pair.decode(tokens), stats, ids)

"""Other programs' plain decoding of the pair's target, run beside ours by `compare` and the benchmark:
`hf` (Hugging Face generate(), hf_baseline.py) and `llamacpp` / `llamacpp:gguf` (llama.cpp, llamacpp_baseline.py).
Greedy only. Each is made on first use; a peer that cannot run here is dropped up front with the reason."""
from __future__ import annotations

import sys

from .method_spec import MethodSpec


def available(specs: list[MethodSpec], say=None) -> list[MethodSpec]:
    """`specs` without the peers that cannot run on this machine; `say` (default: print to stderr) gets one
    line per skipped method, naming what to install."""
    from .llamacpp_baseline import llamacpp_problem

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    problem = llamacpp_problem() if any(s.name == "llamacpp" for s in specs) else None
    if problem is None:
        return list(specs)
    for s in specs:
        if s.name == "llamacpp":
            say(f"ddtree: method {s.label} skipped: {problem}")
    return [s for s in specs if s.name != "llamacpp"]


class Peers:
    """generate(spec, prompt, max_new_tokens, chat) for every peer spec, each baseline made once."""

    def __init__(self, pair):
        self.pair, self._made = pair, {}

    def generate(self, spec: MethodSpec, prompt, max_new_tokens: int, chat: bool = True):
        if spec.label not in self._made:
            self._made[spec.label] = self._make(spec)
        return self._made[spec.label].generate(prompt, max_new_tokens, chat)

    def _make(self, spec: MethodSpec):
        if spec.name == "hf":
            from .hf_baseline import HFBaseline

            return HFBaseline(self.pair)
        if spec.name == "llamacpp":
            from .llamacpp_baseline import LlamaCppBaseline

            return LlamaCppBaseline(self.pair, spec.variant)
        raise ValueError(f"{spec.label} is not a peer method")

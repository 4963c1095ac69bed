"""Other programs' plain decoding of the pair's target, run beside ours by `compare` and the benchmark:
the registry's peer methods (method_spec.METHODS: `hf`, `llamacpp`, `llamacpp:gguf`). Greedy only. Each is
made on first use; a peer that cannot run here is dropped up front with the reason."""
from __future__ import annotations

import sys

from ..engine.method_spec import MethodSpec


def available(specs: list[MethodSpec], say=None) -> list[MethodSpec]:
    """`specs` without the peers that cannot run on this machine; `say` (default: print to stderr) gets one
    line per skipped method, naming what to install."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    kept = []
    for spec in specs:
        problem = spec.info.load().problem() if spec.peer else None
        if problem:
            say(f"ddtree: method {spec.label} skipped: {problem}")
        else:
            kept.append(spec)
    return kept


class Peers:
    """generate(spec, prompt, max_new_tokens, chat) for every peer spec, each program made once (its registry
    factory, called as factory(pair, spec))."""

    def __init__(self, pair):
        self.pair, self._made = pair, {}

    def generate(self, spec: MethodSpec, prompt, max_new_tokens: int, chat: bool = True):
        if not spec.peer:
            raise ValueError(f"{spec.label} is not a peer method")
        if spec.label not in self._made:
            self._made[spec.label] = spec.info.load()(self.pair, spec)
        return self._made[spec.label].generate(prompt, max_new_tokens, chat)

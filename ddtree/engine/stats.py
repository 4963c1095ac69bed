"""Stage timing and per-generation statistics."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

STAGES = ("prefill", "draft", "tree_build", "tree_compile", "verify", "commit")


class StageTimer:
    """Accumulates wall time per stage. On CUDA a stage's time is the host's: work it launched is counted where the
    host next waits for the GPU (a step has two such waits: the draft's tree build and the walk). sync=True
    synchronizes at every stage edge instead, so each stage carries its own GPU time, at the cost of the
    syncs (off by default: the speed figures are measured without them)."""

    def __init__(self, device: torch.device, sync: bool = False):
        self.seconds: dict[str, float] = defaultdict(float)
        self._sync = sync and torch.device(device).type == "cuda"

    @contextmanager
    def __call__(self, stage: str):
        if self._sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            self.seconds[stage] += time.perf_counter() - t0


@dataclass
class GenerationStats:
    method: str
    budget: int | str | None  # "auto" for the adaptive budget
    block_size: int | None
    prompt_tokens: int
    new_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per step, bonus included
    tree_sizes: list[int] = field(default_factory=list)  # nodes verified per step, root included
    seconds: float = 0.0  # whole generate() call: prefill + decode
    time_to_first_token: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""  # "eos", "stop_token", "stop_string", "max_new_tokens" or "context_limit"
    stop_match: str | int | None = None  # the stop string or stop token id that matched (see stops.py)
    attention_backend: str = ""
    backend: str = ""  # the target backend: "own", or "hf:<the model's attention>" (see loading.choose_backend)
    drafter: str = ""

    @property
    def steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean accepted length per target verify pass, bonus token included (1.0 for plain decoding, and for an
        answer that ended at the prefill's token: no step, so nothing drafted and nothing gained)."""
        if not self.acceptance_lengths:
            return 1.0
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    @property
    def tokens_per_second(self) -> float:
        """End to end: new tokens over the whole call, prefill included."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_seconds(self) -> float:
        """The time after the first token (the prefill's): the decoding steps alone."""
        return max(0.0, self.seconds - self.time_to_first_token)

    @property
    def decode_tokens_per_second(self) -> float:
        """Decode only, as the DDTree reference reports it (its clock starts after the prefill): the tokens after
        the first over the time after it; 0.0 where there is none or the prefill was not timed apart."""
        if self.new_tokens < 2 or self.decode_seconds <= 0 or self.time_to_first_token <= 0:
            return 0.0
        return (self.new_tokens - 1) / self.decode_seconds

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items()}
        d.update(steps=self.steps, tau=self.tau, tokens_per_second=self.tokens_per_second,
                 decode_seconds=self.decode_seconds, decode_tokens_per_second=self.decode_tokens_per_second)
        return d

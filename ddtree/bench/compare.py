"""Run several methods on the same prompts, interleaved per prompt, check them against plain decoding and
tabulate tau and speedup over `ar` (the runner and the speedup definition are the benchmark's: runner.py)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..base.config import ConfigError, check_int
from ..engine.method_spec import parse_methods
from .peers import Peers, available
from .runner import RunSettings, run_prompt, summarize_methods
from ..engine.stops import check_stop, check_stop_token_ids


@dataclass
class Comparison:
    records: list[dict] = field(default_factory=list)  # one per prompt x method
    rows: list[dict] = field(default_factory=list)  # one per method: the summary

    def table(self) -> str:
        head = "| method | tau | tokens/s | speedup vs ar | tie flips | errors |\n|---|---|---|---|---|---|\n"
        return head + "".join(
            f"| {r['method']} | {r['tau']:.2f} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | "
            f"{r['tie_flips']} | {r['errors']} |\n" for r in self.rows)

    @property
    def ok(self) -> bool:
        return all(r["errors"] == 0 for r in self.rows)

    def __str__(self) -> str:
        return self.table()


def compare(pair, prompts, methods=("ar", "dflash", "ddtree"), budget=None, max_new_tokens: int = 128,
            temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, block_size: int | None = None,
            seed: int = 0, chat: bool = True, warmup: bool = True, show: bool = True, stop=None,
            stop_token_ids=None) -> Comparison:
    """Decode every prompt with every method (ar, hf, llamacpp, dflash, ddtree, ddtree:N, ddtree:auto; a bare ddtree takes
    `budget`), methods interleaved per prompt so machine drift hits all alike. At temperature 0 each method's
    tokens are checked against `ar`'s (tie flips counted, errors reported). Speedup: see runner.py.
    stop, stop_token_ids: as pair.generate()'s, for every prompt (the peers hf and llamacpp then do not run)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise ConfigError(f"prompts must be a list of prompts, got {type(prompts).__name__}; for one prompt write "
                          "compare(pair, [prompt], ...)")  # a bare string would run one prompt per character
    if not prompts:
        raise ConfigError("prompts is empty: give at least one prompt")
    check_int("seed", seed)
    specs = available(parse_methods(methods, None if budget is None else [budget], pair.device))
    stops = dict(stop=check_stop(stop), stop_token_ids=check_stop_token_ids(stop_token_ids, pair.target.cfg.vocab_size))
    settings = RunSettings(max_new_tokens, temperature, top_p, top_k, block_size, chat, **stops)
    peers = Peers(pair)
    if warmup:  # first-call costs (allocator, kernels, the adaptive budget's cost curve) stay out of the timings
        run_prompt(pair, prompts[0], specs, replace(settings, max_new_tokens=8), seed, peers)
    result = Comparison()
    for index, prompt in enumerate(prompts):
        for rec in run_prompt(pair, prompt, specs, settings, seed + index, peers):
            result.records.append({**rec, "prompt_index": index})
    result.rows = summarize_methods(result.records, specs)
    if show:
        print(result.table())
        for r in result.records:
            if r["check"] == "error":
                print(f"LOSSLESS CHECK FAILED: prompt {r['prompt_index']} {r['method']}: {r['check_detail']}")
    return result

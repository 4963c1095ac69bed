"""Run several methods on the same prompts, interleaved per prompt, check them against plain decoding and
tabulate tau and speedup over `ar`."""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import ConfigError, check_int


def parse_method(spec: str, default_budget: int | str) -> tuple[str, int | str | None]:
    """'ar', 'dflash', 'ddtree', 'ddtree:32' or 'ddtree:auto' -> (name, budget or None)."""
    name, _, budget = spec.partition(":")
    if budget and name != "ddtree":
        raise ConfigError(f"only ddtree takes a budget, got {spec!r}")
    if name == "ddtree":
        try:
            return name, parse_budget(budget) if budget else default_budget
        except ConfigError:
            raise ConfigError(f"bad budget in {spec!r}; write e.g. ddtree:64 or ddtree:auto") from None
    return name, None


def parse_budget(text: str) -> int | str:
    """'64' -> 64; 'auto' -> 'auto' (the adaptive budget)."""
    text = str(text).strip()
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"a budget is an integer (draft nodes per step) or 'auto', got {text!r}") from None


def method_label(name: str, budget: int | None) -> str:
    return f"{name}:{budget}" if budget is not None else name


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


def compare(pair, prompts, methods=("ar", "dflash", "ddtree"), budget: int = 64, max_new_tokens: int = 128,
            temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, block_size: int | None = None,
            seed: int = 0, chat: bool = True, warmup: bool = True, show: bool = True) -> Comparison:
    """Decode every prompt with every method (methods interleaved per prompt so machine drift hits all alike).
    At temperature 0 each method's tokens are checked against `ar`'s (tie flips counted, errors reported).
    Speedup = total `ar` time / total method time over the same prompts."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise ConfigError(f"prompts must be a list of prompts, got {type(prompts).__name__}; for one prompt write "
                          "compare(pair, [prompt], ...)")  # a bare string would run one prompt per character
    if not prompts:
        raise ConfigError("prompts is empty: give at least one prompt")
    check_int("seed", seed)
    specs = [parse_method(m, budget) for m in methods]
    if ("ar", None) not in specs:
        specs.insert(0, ("ar", None))
    specs.sort(key=lambda s: s[0] != "ar")  # ar first: its tokens are the reference
    kwargs = dict(block_size=block_size, temperature=temperature, top_p=top_p, top_k=top_k,
                  max_new_tokens=max_new_tokens, chat=chat)
    if warmup:  # first-call costs (allocator, kernels) stay out of the timings
        for name, b in specs:
            pair.generate(prompts[0], method=name, budget=b or budget, seed=seed, **{**kwargs, "max_new_tokens": 8})
    result = Comparison()
    for p_index, prompt in enumerate(prompts):
        reference = None
        for name, b in specs:
            res = pair.generate(prompt, method=name, budget=b or budget, seed=seed + p_index, **kwargs)
            rec = {**res.stats.as_dict(), "prompt_index": p_index, "method": method_label(name, b),  # the label,
                   "check": "skipped (T > 0)" if temperature > 0 else "identical"}  # not the stats' bare name
            if name == "ar":
                reference = res
            elif temperature == 0:
                verdict = pair.check(res.prompt_ids, reference.token_ids, res.token_ids)
                rec["check"] = verdict.kind
                rec["check_detail"] = verdict.describe()
            result.records.append(rec)
    for name, b in specs:
        label = method_label(name, b)
        recs = [r for r in result.records if r["method"] == label]
        ar_secs = sum(r["seconds"] for r in result.records if r["method"] == "ar")
        secs = sum(r["seconds"] for r in recs)
        steps = sum(r["steps"] for r in recs)
        result.rows.append({
            "method": label, "budget": b,
            "tau": sum(sum(r["acceptance_lengths"]) for r in recs) / max(1, steps),
            "tokens_per_second": sum(r["new_tokens"] for r in recs) / secs if secs else 0.0,
            "speedup": ar_secs / secs if secs else 0.0, "seconds": secs,
            "tie_flips": sum(r["check"] == "tie_flip" for r in recs),
            "errors": sum(r["check"] == "error" for r in recs),
        })
    if show:
        print(result.table())
        for r in result.records:
            if r["check"] == "error":
                print(f"LOSSLESS CHECK FAILED: prompt {r['prompt_index']} {r['method']}: {r['check_detail']}")
    return result

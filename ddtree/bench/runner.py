"""One prompt through several methods, checked against plain decoding; and the one speedup definition.

`compare` and the benchmark both decode with `run_prompt` and tabulate with `summarize_methods`:

    speedup = method tokens/s / ar tokens/s, over the same prompts, decoded back to back (interleaved)

At T=0 both produce the same tokens, so this is ar time / method time; at T>0 samples may stop at different
lengths, which a time ratio would punish. It is given end to end (the clock runs from before the prefill) and
decode only (the tokens after the first over the time after it: the DDTree reference's definition). With
repeats, each figure is the median over repeats, with its range, and a cell the machine may have disturbed is
flagged (summarize_methods). The plots read the same rows.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..engine.method_spec import REFERENCE, MethodSpec
from ..engine.stats import STAGES


@dataclass(frozen=True)
class RunSettings:
    """What every method of one comparison decodes with (the sampling values are checked by SamplingParams)."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    block_size: int | None = None
    chat: bool = True
    trace: bool = False  # keep per-step tree traces in the records ("trace")
    stop: tuple[str, ...] = ()  # stop strings and stop token ids (stops.py); peers run without them, so skip them
    stop_token_ids: tuple[int, ...] = ()

    @property
    def peers_run(self) -> bool:
        """Whether peer methods (other programs' plain decoding) run: greedy, without stops."""
        return self.temperature == 0 and not self.stop and not self.stop_token_ids


def run_prompt(pair, prompt, specs: list[MethodSpec], settings: RunSettings, seed: int = 0, peers=None,
               tamper=None, on_record=None) -> list[dict]:
    """Decode `prompt` with every spec in order, back to back, `ar` first (its tokens are the reference), and
    return one record per method: the stats, `method` (the label, e.g. ddtree:16), `method_name`, `token_ids`
    and `check`: reference (ar) / identical / tie_flip / error (see checker.py) / skipped (T > 0).
    Peer methods (hf, llamacpp: other programs, run by `peers`, a peers.Peers) run at T=0 without stops only;
    llama.cpp's arithmetic is not ours (nor is any peer's on a target with int8 activations), so its check is
    `agreement` (the share of ar's tokens it reproduces before the first difference), never an error.
    tamper(spec, tokens, record) -> tokens may alter a method's tokens before the check (the benchmark's self-test
    of the checker); on_record(record) is called as each method finishes (progress, incremental writes)."""
    if specs[0].name != REFERENCE:
        raise ValueError("the first method must be ar: its tokens are the reference")
    records, reference = [], None
    for spec in specs:
        if spec.peer:
            if not settings.peers_run:
                continue
            res = peers.generate(spec, prompt, settings.max_new_tokens, settings.chat)
        else:
            res = pair.generate(prompt, method=spec, block_size=settings.block_size,
                                temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                                max_new_tokens=settings.max_new_tokens, seed=seed, chat=settings.chat,
                                trace=settings.trace, stop=list(settings.stop),
                                stop_token_ids=list(settings.stop_token_ids))
        tokens = list(res.token_ids)
        rec = {**res.stats.as_dict(), "method": spec.label, "method_name": spec.name}  # the label over the
        if tamper is not None:  # stats' bare name
            tokens = tamper(spec, tokens, rec)
        check = spec.info.check
        if spec.info.peer and pair.options.int8:
            check = "agreement"  # a peer runs the float model; the target's int8 activations are another function
        if check == "reference":
            reference, rec["check"] = (res.prompt_ids, tokens), "reference"
        elif settings.temperature > 0:
            rec["check"] = "skipped (T > 0)"
        elif check == "agreement":  # other arithmetic (llama.cpp): report how far it agrees, never fail
            rec["agreement"] = agreement(reference[1], tokens)
            rec["check"] = "identical" if tokens == reference[1] else "differs (other arithmetic)"
        else:
            verdict = pair.check(reference[0], reference[1], tokens)
            rec["check"], rec["check_detail"] = verdict.kind, verdict.describe()
        rec["token_ids"], rec["text"] = tokens, res.text  # the text: cut before a stop string (stops.py)
        if res.trace is not None:
            rec["trace"] = res.trace
        records.append(rec)
        if on_record is not None:
            on_record(rec)
    return records


def agreement(reference: list[int], tokens: list[int]) -> float:
    """The share of the reference's tokens that `tokens` reproduces before their first difference."""
    same = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), min(len(reference), len(tokens)))
    return same / max(1, len(reference))


# A cell (a method's row over one setting) is flagged, never hidden, when its figures may be the machine's rather
# than the method's: ar's tokens/s or the cell's speedup varied more than SPREAD_LIMIT (relative to the median)
# over the repeats, or other processes used more than LOAD_LIMIT cores on average during one of its or ar's runs.
SPREAD_LIMIT = 0.20
LOAD_LIMIT = 0.25


def timings(rec: dict) -> list[dict]:
    """A record's timed runs: its `repeats` (the benchmark times each prompt x method several times, interleaved),
    else the record itself as one run. Each has seconds, time_to_first_token and load (None where unknown)."""
    return rec.get("repeats") or [dict(seconds=rec["seconds"], time_to_first_token=rec.get("time_to_first_token", 0.0),
                                       load=rec.get("load"))]


def _rates(recs: list[dict], repeat: int) -> tuple[float, float | None]:
    """(end-to-end tokens/s, decode-only tokens/s) of `recs` in their `repeat`-th timed run. Decode only: the
    tokens after the first over the time after it (None where a run did not time its prefill apart: hf)."""
    runs = [timings(r)[repeat] for r in recs]
    secs = sum(t["seconds"] for t in runs)
    rate = sum(r["new_tokens"] for r in recs) / secs if secs else 0.0
    decode_secs = sum(t["seconds"] - t["time_to_first_token"] for t in runs)
    timed_apart = all(t["time_to_first_token"] > 0 for t in runs)
    decode = sum(max(0, r["new_tokens"] - 1) for r in recs) / decode_secs if timed_apart and decode_secs > 0 else None
    return rate, decode


def _spread(values: list[float]) -> float:
    """(max - min) / median: how far apart the repeats' figures are, relative to their median."""
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle else 0.0


def flag_reason(speedup_spread: float, ar_spread: float, load: float | None, repeats: int) -> str | None:
    """Why a cell's figures may not be the method's own (None when nothing says so)."""
    reasons = []
    if load is not None and load > LOAD_LIMIT:
        reasons.append(f"other processes used {load:.2f} cores during a run (limit {LOAD_LIMIT})")
    if ar_spread > SPREAD_LIMIT:
        reasons.append(f"ar's tokens/s varied {100 * ar_spread:.0f}% over {repeats} repeats")
    if speedup_spread > SPREAD_LIMIT:
        reasons.append(f"its speedup varied {100 * speedup_spread:.0f}% over {repeats} repeats")
    return "; ".join(reasons) or None


def summarize_methods(records: list[dict], specs: list[MethodSpec]) -> list[dict]:
    """One row per spec with records, over records of one setting (one dataset and temperature): tau, tokens/s,
    speedup over ar on the same prompts (by `prompt_index`), ms per generated token by stage, check counts.

    With repeats (timings()), repeat i of every prompt is one measurement of the cell: its tokens/s and its
    speedup over ar's repeat i (the two ran back to back); a row gives their medians and ranges, end to end and
    decode only, and `flagged` (flag_reason) when the spread or the machine's load says the figures may be noise."""
    ar = {r["prompt_index"]: r for r in records if r["method"] == REFERENCE}
    rows = []
    for spec in specs:
        recs = [r for r in records if r["method"] == spec.label]
        if not recs:
            continue
        new = sum(r["new_tokens"] for r in recs)
        steps = sum(r["steps"] for r in recs)
        ar_same = [ar[r["prompt_index"]] for r in recs if r["prompt_index"] in ar]
        repeats = min(len(timings(r)) for r in recs + ar_same)
        own = [_rates(recs, i) for i in range(repeats)]
        base = [_rates(ar_same, i) for i in range(repeats)] if ar_same else []
        speedups = [r / a if a else 0.0 for (r, _), (a, _) in zip(own, base)] or [0.0]
        decodes = [r / a for (_, r), (_, a) in zip(own, base) if r is not None and a]
        decode_speedups = decodes if len(decodes) == repeats and decodes else None
        load = max((t["load"] for r in recs + ar_same for t in timings(r) if t.get("load") is not None), default=None)
        spread, ar_spread = _spread([r for r, _ in own]), _spread([a for a, _ in base]) if base else 0.0
        stage_secs = {st: sum(r["stage_seconds"].get(st, 0.0) for r in recs) for st in STAGES}
        rows.append(dict(
            method=spec.label, budget=spec.budget, prompts=len(recs), new_tokens=new, repeats=repeats,
            seconds=sum(r["seconds"] for r in recs),
            tau=sum(sum(r["acceptance_lengths"]) for r in recs) / max(1, steps),
            mean_nodes=sum(sum(r.get("tree_sizes", [])) for r in recs) / max(1, steps),
            tokens_per_second=statistics.median([r for r, _ in own]),
            decode_tokens_per_second=(statistics.median([d for _, d in own]) if all(d is not None for _, d in own) else None),
            speedup=statistics.median(speedups), speedup_range=[min(speedups), max(speedups)],
            decode_speedup=statistics.median(decode_speedups) if decode_speedups else None,
            decode_speedup_range=[min(decode_speedups), max(decode_speedups)] if decode_speedups else None,
            spread=spread, ar_spread=ar_spread, load=load,
            flagged=flag_reason(_spread(speedups), ar_spread, load, repeats),
            stage_ms_per_token={st: 1000 * secs / max(1, new) for st, secs in stage_secs.items()},
            # a decoding step's cost (one verify pass each; the prefill is not a step): each stage, and the whole
            # step as the decode time over the steps (medians over the repeats per record)
            stage_ms_per_step={st: 1000 * secs / max(1, steps) for st, secs in stage_secs.items() if st != "prefill"},
            ms_per_step=1000 * sum(max(0.0, r["seconds"] - r.get("time_to_first_token", 0.0)) for r in recs)
            / max(1, steps),
            tie_flips=sum(r["check"] == "tie_flip" for r in recs),
            agreement=(sum(r["agreement"] for r in recs if "agreement" in r) / len(recs)
                       if any("agreement" in r for r in recs) else None),  # llamacpp: share of ar's tokens
            errors=sum(r["check"] == "error" for r in recs)))
    return rows

"""One prompt through several methods, checked against plain decoding; and the one speedup definition.

`compare` and the benchmark both decode with `run_prompt` and tabulate with `summarize_methods`:

    speedup = method tokens/s / ar tokens/s, over the same prompts, decoded back to back (interleaved)

At T=0 both produce the same tokens, so this is ar time / method time; at T>0 samples may stop at different
lengths, which a time ratio would punish. The plots read the same rows.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cpu.quant_target import int8_activations
from .method_spec import REFERENCE, MethodSpec
from .stats import STAGES


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
        if spec.info.peer and int8_activations(pair.target.quant):
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


def summarize_methods(records: list[dict], specs: list[MethodSpec]) -> list[dict]:
    """One row per spec with records, over records of one setting (one dataset and temperature): tau, tokens/s,
    speedup over ar on the same prompts (by `prompt_index`), ms per generated token by stage, check counts."""
    ar = {r["prompt_index"]: r for r in records if r["method"] == REFERENCE}
    rows = []
    for spec in specs:
        recs = [r for r in records if r["method"] == spec.label]
        if not recs:
            continue
        secs = sum(r["seconds"] for r in recs)
        new = sum(r["new_tokens"] for r in recs)
        steps = sum(r["steps"] for r in recs)
        rate = new / secs if secs else 0.0
        ar_same = [ar[r["prompt_index"]] for r in recs if r["prompt_index"] in ar]
        ar_secs = sum(a["seconds"] for a in ar_same)
        ar_rate = sum(a["new_tokens"] for a in ar_same) / ar_secs if ar_secs else 0.0
        rows.append(dict(
            method=spec.label, budget=spec.budget, prompts=len(recs), new_tokens=new, seconds=secs,
            tau=sum(sum(r["acceptance_lengths"]) for r in recs) / max(1, steps),
            mean_nodes=sum(sum(r.get("tree_sizes", [])) for r in recs) / max(1, steps),
            tokens_per_second=rate, speedup=rate / ar_rate if ar_rate else 0.0,
            stage_ms_per_token={st: 1000 * sum(r["stage_seconds"].get(st, 0.0) for r in recs) / max(1, new)
                                for st in STAGES},
            tie_flips=sum(r["check"] == "tie_flip" for r in recs),
            agreement=(sum(r["agreement"] for r in recs if "agreement" in r) / len(recs)
                       if any("agreement" in r for r in recs) else None),  # llamacpp: share of ar's tokens
            errors=sum(r["check"] == "error" for r in recs)))
    return rows

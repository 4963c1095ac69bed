"""Stop strings, stop token ids and streaming: every method ends at the token plain decoding ends at, leaves the
same text, and a stream's pieces join to generate()'s text, however a step's accepted tokens straddle a stop."""
import dataclasses
import random

import pytest
import torch

from conftest import plant_oracle
from ddtree.api import Pair
from ddtree.base.config import ConfigError
from ddtree.models.drafter import untrained_drafter
from ddtree.models.loading import load_tokenizer, resolve_target_dir
from ddtree.engine.stops import Stops
from ddtree.bench.testing import char_tokenizer, random_pair, random_target

METHODS = ["ar", "dflash", "ddtree:1", "ddtree:4", "ddtree:16", "ddtree:auto"]
TEMPERATURES = [0.0, 0.8]
MAX_NEW = 40
NEVER = "~"  # not in the character tokenizer's alphabet: no output contains it


@pytest.fixture(scope="module")
def setup():
    """A seeded random llama pair with a character tokenizer, the prompt, and the drafter's oracle reference
    (prompt + plain greedy decoding): acceptance is deep and branchy, so stops land inside multi-token steps."""
    target, drafter = random_pair("llama", seed=11, num_draft_layers=2, block_size=8, init_scale=0.25)
    tok = char_tokenizer()
    prompt = tok.encode("Some text")
    greedy = Pair(target, drafter, tok, stop_ids=(1,)).generate(prompt, method="ar", max_new_tokens=MAX_NEW)
    assert len(greedy.token_ids) == MAX_NEW
    return target, drafter, tok, prompt, prompt + greedy.token_ids + [0] * 300


def decode(setup, method, temperature, stream=False, **kw):
    """One generation on a fresh Pair with the oracle planted afresh: a run with stops then makes exactly the
    draws and drafts of the run without them, up to where it ends (the adaptive budget learns per Pair)."""
    target, drafter, tok, prompt, reference = setup
    plant_oracle(drafter, reference, seed=5, top1=0.8)
    pair = Pair(target, drafter, tok, stop_ids=(1,))
    args = dict(method=method, temperature=temperature, seed=3, max_new_tokens=MAX_NEW, chat=False, **kw)
    if not stream:
        return pair.generate(prompt, **args)
    s = pair.stream(prompt, **args)
    pieces = list(s)
    return s.result, pieces


def expected(tok, tokens, stops):
    """Plain decoding's answer, from first principles: the first k whose text contains a stop; the text cut
    where the earliest stop starts."""
    for k in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:k], skip_special_tokens=True)
        found = sorted((text.find(s), i) for i, s in enumerate(stops) if s in text)
        if found:
            return tokens[:k], text[:found[0][0]], stops[found[0][1]]
    return tokens, tok.decode(tokens, skip_special_tokens=True), None


def stop_cases(tok, tokens, steps):
    """Stop strings of two characters placed on the run's step structure: completed inside a step with more
    accepted tokens after it, spanning two steps, at the first token, never, and several at once."""
    text = tok.decode(tokens, skip_special_tokens=True)
    pos = [len(tok.decode(tokens[:k], skip_special_tokens=True)) for k in range(len(tokens) + 1)]
    ends = [1] + [1 + sum(steps[:j + 1]) for j in range(len(steps))]  # commit ends: prefill, then each step

    def two_chars(k):  # tokens k, k+1 as a stop, if each has one character and it first occurs at token k
        s = text[pos[k]:pos[k + 2]]
        ok = k + 2 <= len(tokens) and pos[k + 1] - pos[k] == 1 == pos[k + 2] - pos[k + 1] and text.find(s) == pos[k]
        return s if ok else None

    def within(margin):  # both tokens committed by one step, with `margin` accepted tokens after them
        return next((s for a, b in zip(ends, ends[1:]) for k in range(a, b - 1 - margin) if (s := two_chars(k))),
                    None)

    across = next((s for a in ends[1:-1] if (s := two_chars(a - 1))), None)
    cases = {"inside": within(0), "mid-step": within(1), "across": across,
             "first": text[:1] if pos[1] == 1 else None, "never": NEVER}
    cases["several"] = [NEVER] + [s for s in (across, cases["mid-step"] or cases["inside"]) if s]
    return {name: s for name, s in cases.items() if s}


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("method", METHODS)
def test_stop_strings_end_where_plain_decoding_would(setup, method, temperature):
    tok = setup[2]
    full = decode(setup, method, temperature)
    if temperature == 0:
        assert full.token_ids == decode(setup, "ar", 0.0).token_ids
    cases = stop_cases(tok, full.token_ids, full.stats.acceptance_lengths)
    # the oracle makes multi-token steps, so these kinds must be there (not for auto: its trees follow the cost
    # curve this machine measured, which may make every step a plain one)
    if temperature == 0 and method not in ("ar", "ddtree:auto"):
        deep = max(full.stats.acceptance_lengths) >= 3  # ddtree:1 commits at most 2 tokens a step
        assert {"inside", "across"} | ({"mid-step"} if deep else set()) <= set(cases), cases
    for name, stop in cases.items():
        stops = [stop] if isinstance(stop, str) else stop
        tokens, text, match = expected(tok, full.token_ids, stops)
        res, pieces = decode(setup, method, temperature, stream=True, stop=stop)
        assert res.token_ids == tokens and res.text == text, f"{method} T={temperature} stop {name} {stop!r}"
        assert "".join(pieces) == text
        assert (res.stats.stop_reason, res.stats.stop_match) == (
            ("stop_string", match) if match else (full.stats.stop_reason, None))
        if name == "several":  # generate() builds the text after decoding, a stream during it: the same
            assert decode(setup, method, temperature, stop=stop).text == text
    if temperature == 0:
        assert "first" in cases  # the greedy first token is one character
    if "first" in cases:
        assert len(expected(tok, full.token_ids, [cases["first"]])[0]) == 1


@pytest.mark.parametrize("method", METHODS)
def test_stop_token_ids_end_at_that_token_and_leave_it_out_of_the_text(setup, method):
    tok = setup[2]
    full = decode(setup, "ar", 0.0)
    stop_id = full.token_ids[9]
    k = full.token_ids.index(stop_id) + 1
    res = decode(setup, method, 0.0, stop_token_ids=[stop_id], stop=NEVER)
    assert res.token_ids == full.token_ids[:k]
    assert (res.stats.stop_reason, res.stats.stop_match) == ("stop_token", stop_id)
    assert res.text == tok.decode(full.token_ids[:k - 1])
    assert full.stats.stop_reason == "max_new_tokens" and full.stats.stop_match is None


def test_the_cut_does_not_depend_on_how_tokens_are_grouped_into_steps():
    tok = char_tokenizer()
    tokens = tok.encode("xyab abcab abc.")
    rng = random.Random(0)
    results = set()
    for trial in range(30):
        stops = Stops(eos=(1,), strings=("zzz", "bc", "abc"), decode=tok.decode, live=True)
        kept, shown, i = [], "", 0
        while not stops.reason and i < len(tokens):
            n = 1 if trial == 0 else rng.randint(1, 6)
            kept += tokens[i:i + n][:stops.cut(tokens[i:i + n])]
            shown += stops.ready()
            i += n
        shown += stops.rest(kept)
        results.add((tuple(kept), stops.finish(kept), shown, stops.match))
    # "bc" and "abc" both complete at the same token: the text ends where the earlier one starts
    assert results == {(tuple(tok.encode("xyab abc")), "xyab ", "xyab ", "abc")}


def test_a_stream_holds_back_what_a_stop_string_could_still_cut():
    tok = char_tokenizer()
    stops = Stops(strings=("abc",), decode=tok.decode, live=True)
    seen = []
    for ch in "xaba":
        stops.cut(tok.encode(ch))
        seen.append(stops.ready())
    assert seen == ["x", "", "", "ab"]  # "a", "ab", then "a" again could begin "abc"
    stops.cut(tok.encode("b"))
    assert stops.ready() == "" and stops.cut(tok.encode("cd")) == 1 and stops.reason == "stop_string"
    assert stops.rest(tok.encode("xababc")) == "" and stops.finish([]) == "xab"  # nothing shown was cut


def test_bad_stops_are_refused_with_the_fix(setup):
    target, drafter, tok, prompt, _ = setup
    pair = Pair(target, drafter, tok, stop_ids=(1,))
    for kwargs, message in [(dict(stop=5), "stop must be a string or a list of strings"),
                            (dict(stop=["ok", b"x"]), "stop must be a string or a list of strings"),
                            (dict(stop=["ok", ""]), "empty string"),
                            (dict(stop_token_ids="a"), "stop_token_ids must be a token id or a list"),
                            (dict(stop_token_ids=[True]), "stop_token_ids must be"),
                            (dict(stop_token_ids=[96]), r"outside the vocabulary \(0..95\)")]:
        with pytest.raises(ConfigError, match=message):
            pair.generate(prompt, method="ar", max_new_tokens=2, **kwargs)
        with pytest.raises(ConfigError, match=message):
            pair.stream(prompt, method="ar", max_new_tokens=2, **kwargs)
    ids_only = Pair(target, drafter, None)
    with pytest.raises(ConfigError, match="stop strings need a tokenizer"):
        ids_only.generate(prompt, method="ar", stop="x")
    with pytest.raises(ConfigError, match="no tokenizer"):
        ids_only.stream(prompt, method="ar")
    assert ids_only.generate(prompt, method="ar", max_new_tokens=3, stop_token_ids=[]).text == ""
    stream = pair.stream(prompt, method="ar", max_new_tokens=3)
    list(stream)
    with pytest.raises(ConfigError, match="iterated already"):
        list(stream)


# --- multi-byte characters: the embedded model's byte-level tokenizer, a target that follows a script --------
SCRIPT_TEXT = "Hi 你好，世界！😀🎉 café 🇫🇷 naïve 日本語のテキスト。👍🏽 ok 漢字"


class ScriptedTarget:
    """A random target (the real cache, taps and shapes) whose next-token choice at every position is the
    script's token: any method, at any temperature, decodes the script, in steps of any shape."""

    def __init__(self, target, prompt_len: int, script: list[int]):
        self.target, self.prompt_len, self.script = target, prompt_len, script

    def __getattr__(self, name):
        return getattr(self.target, name)

    def lazy_logits(self, rows: int) -> bool:
        return False  # all rows as one tensor, to be rewritten

    def __call__(self, ids, positions, cache, vis, taps=(), last_only=False, **kw):
        out = self.target(ids, positions, cache, vis, taps, last_only=last_only, **kw)
        rows = positions[-1:] if last_only else positions
        logits = torch.full_like(out.logits, -1e4)
        for r, p in enumerate(rows.tolist()):
            logits[r, self.script[min(p + 1 - self.prompt_len, len(self.script) - 1)]] = 0.0
        return dataclasses.replace(out, logits=logits)


@pytest.fixture(scope="module")
def byte_level():
    tok = load_tokenizer(resolve_target_dir(None))
    script = tok.encode(SCRIPT_TEXT)
    assert any(tok.decode(script[:k]).endswith("\ufffd") for k in range(len(script)))  # characters do split
    target = random_target("llama", seed=2, vocab_size=len(tok))
    return tok, target, script


@pytest.mark.real_model  # the embedded model's tokenizer
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("method", METHODS)
def test_streamed_cjk_and_emoji_equal_the_generated_text(byte_level, method, temperature):
    tok, target, script = byte_level
    prompt = tok.encode("Say hi")
    scripted = ScriptedTarget(target, len(prompt), script)
    drafter = plant_oracle(untrained_drafter(target, 1, 8, seed=1), prompt + script + [0] * 300, seed=1, top1=0.7)
    for stop in (None, "世界", "🎉", "テキ"):
        pair = Pair(scripted, drafter, tok)
        args = dict(method=method, temperature=temperature, seed=1, max_new_tokens=len(script), chat=False,
                    stop=stop)
        stream = pair.stream(prompt, **args)
        pieces = list(stream)
        res = stream.result
        want = SCRIPT_TEXT if stop is None else SCRIPT_TEXT[:SCRIPT_TEXT.index(stop)]
        assert res.text == want and "".join(pieces) == want, (method, stop, pieces)
        assert not any("\ufffd" in p for p in pieces), pieces  # never half a character
        assert res.token_ids == expected(tok, script, [stop] if stop else [])[0]
        assert Pair(scripted, drafter, tok).generate(prompt, **args).text == want
        if method not in ("ar", "ddtree:auto") and stop is None:  # auto: see the stop-string test
            assert res.stats.tau > 1.5  # multi-token steps: characters split across steps too

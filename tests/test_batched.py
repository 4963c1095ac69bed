"""The batched data generator: every row is what single-sequence `ar` decoding of the same model gives
(checked with the project's checker: rounding tie flips are allowed and counted, errors fail)."""
import random

import pytest
import torch

from ddtree.api import Pair
from ddtree.bench.testing import random_target
from ddtree.train.batched import BatchedDecoder, Job

STOPS = (1, 2, 3, 4, 5)  # several stop tokens: most rows end early, so follow-up turns happen


def _jobs(n, vocab, seed=0, follow_every=3):
    rng = random.Random(seed)
    return [Job(f"j{i}", [rng.randrange(6, vocab) for _ in range(rng.randint(1, 40))],
                follow_up=[rng.randrange(6, vocab) for _ in range(rng.randint(1, 6))] if i % follow_every == 0
                else None)
            for i in range(n)]


def _check_rows(target, answers, max_new_tokens):
    pair = Pair(target, None, None, stop_ids=STOPS)
    flips = 0
    for a in answers:
        ref = pair.generate(a.prompt_ids, method="ar", max_new_tokens=max_new_tokens).token_ids
        verdict = pair.check(a.prompt_ids, ref, a.response_ids)
        assert verdict.ok, f"{a.job.key} turn {a.turn}: {verdict.describe()}"
        flips += verdict.kind == "tie_flip"
    return flips


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen3", torch.float32),
                                        ("llama", torch.bfloat16)])
@pytest.mark.slow
def test_rows_equal_single_sequence_decoding(arch, dtype):
    target = random_target(arch, seed=3, dtype=dtype, init_scale=0.25)
    decoder = BatchedDecoder(target, slots=4, capacity=160, max_new_tokens=24, stop_ids=STOPS, group_size=2,
                             resort_every=3)  # rows reordered by length often, attention in groups of 2
    check_two_turn_answers(decoder, target, dtype)


def check_two_turn_answers(decoder, target, dtype, jobs=18, max_new_tokens=24):
    """A batched decoder's answers to _jobs(jobs): every first turn, second turns that continue them, each row what
    `ar` gives (no tie flip in float32), and rows that shared steps."""
    answers = list(decoder.run(_jobs(jobs, target.cfg.vocab_size)))
    firsts = [a for a in answers if a.turn == 1]
    seconds = [a for a in answers if a.turn == 2]
    assert len(firsts) == jobs and seconds, "some rows must stop and take their follow-up turn"
    for a in seconds:  # the second turn's prompt is the first turn's prompt + answer + follow-up
        first = next(f for f in firsts if f.job is a.job)
        assert first.response_ids[-1] in STOPS and not first.last_turn
        assert a.prompt_ids == first.prompt_ids + first.response_ids + a.job.follow_up
    flips = _check_rows(target, answers, max_new_tokens)
    if dtype == torch.float32:
        assert flips == 0
    assert decoder.decode_steps < sum(len(a.response_ids) for a in answers) / 2  # rows really shared steps


def test_jobs_that_cannot_fit_are_reported_not_decoded():
    check_unfit_jobs(BatchedDecoder)


def check_unfit_jobs(decoder_class):
    """A job whose prompt and answer cannot fit the cache is answered at once with turn 0; the others decode."""
    target = random_target("llama", seed=1)
    decoder = decoder_class(target, slots=2, capacity=40, max_new_tokens=16, stop_ids=STOPS)
    jobs = [Job("short", [7, 8, 9]), Job("long", list(range(6, 40))), Job("short2", [10, 11])]
    answers = {a.job.key: a for a in decoder.run(jobs)}
    assert answers["long"].turn == 0 and answers["long"].response_ids == []
    assert answers["short"].turn == 1 and answers["short2"].turn == 1
    _check_rows(target, [answers["short"], answers["short2"]], 16)


def test_sampled_rows_do_not_depend_on_the_batch():
    target = random_target("qwen3", seed=2, init_scale=0.3)
    jobs = [Job(f"s{i}", [6 + i, 7 + i], temperature=0.9, seed=100 + i) for i in range(6)]
    alone = [next(iter(BatchedDecoder(target, 1, 64, 12, STOPS).run([j]))).response_ids for j in jobs]
    together = {a.job.key: a.response_ids for a in BatchedDecoder(target, 4, 64, 12, STOPS).run(jobs)}
    assert [together[j.key] for j in jobs] == alone
    assert len({tuple(r) for r in alone}) > 1


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="slots"):
        BatchedDecoder(random_target("llama"), slots=0, capacity=32, max_new_tokens=8, stop_ids=[])

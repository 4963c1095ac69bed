"""The GPU-shaped data generator: greedy rows are what single-sequence `ar` decoding gives (the checker: rounding
tie flips allowed and counted, errors fail), sampled rows draw from the target's distribution and do not depend on
their batch, and its answers are BatchedDecoder's answers."""
import pytest
import torch

from ddtree.bench.testing import random_target
from ddtree.train.batched import BatchedDecoder, Job
from ddtree.train.static_batched import StaticBatchedDecoder, choose_rows, counter_uniform
from test_batched import STOPS, _jobs, check_two_turn_answers, check_unfit_jobs


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen3", torch.float32),
                                        ("llama", torch.bfloat16)])
@pytest.mark.slow
def test_rows_equal_single_sequence_decoding(arch, dtype):
    target = random_target(arch, seed=3, dtype=dtype, init_scale=0.25)
    # spans of 16 keys, refills in twos, prefill passes of at most 24 padded tokens: every path is taken
    decoder = StaticBatchedDecoder(target, slots=4, capacity=160, max_new_tokens=24, stop_ids=STOPS, span_step=16,
                                   refill_at=2, prefill_tokens=24)
    check_two_turn_answers(decoder, target, dtype)


def test_greedy_answers_equal_the_cpu_generator():
    target = random_target("qwen3", seed=5, init_scale=0.25)
    jobs = _jobs(10, target.cfg.vocab_size, seed=4)
    cpu = {(a.job.key, a.turn): a.response_ids for a in BatchedDecoder(target, 3, 160, 20, STOPS).run(jobs)}
    static = {(a.job.key, a.turn): a.response_ids
              for a in StaticBatchedDecoder(target, 5, 160, 20, STOPS, span_step=32).run(jobs)}
    assert static == cpu


def test_sampled_rows_do_not_depend_on_the_batch():
    target = random_target("qwen3", seed=2, init_scale=0.3)
    jobs = [Job(f"s{i}", [6 + i, 7 + i], temperature=0.9, seed=100 + i, follow_up=[9, 10] if i % 2 else None)
            for i in range(6)]

    def answers(slots, run_jobs):
        return {(a.job.key, a.turn): a.response_ids
                for a in StaticBatchedDecoder(target, slots, 64, 12, STOPS, span_step=8).run(run_jobs)}
    together = answers(4, jobs)
    for j in jobs:
        assert answers(1, [j]) == {k: v for k, v in together.items() if k[0] == j.key}
    assert len({tuple(v) for v in together.values()}) > 1


def test_counter_uniform_is_uniform_and_seeded():
    n = 200_000
    counter = torch.arange(n)
    u = counter_uniform(torch.full((n,), 12345), torch.full((n,), 678), counter)
    assert 0 < float(u.min()) and float(u.max()) < 1
    hist = torch.histc(u, bins=20, min=0, max=1) / n
    assert float((hist - 0.05).abs().max()) < 0.004  # ~3 standard errors of a bin's share
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01
    other = counter_uniform(torch.full((n,), 12346), torch.full((n,), 678), counter)
    assert float((u - other).abs().mean()) > 0.2  # another seed, other draws
    assert torch.equal(u, counter_uniform(torch.full((n,), 12345), torch.full((n,), 678), counter))


def test_choose_rows_samples_the_tempered_softmax():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    n, temp = 100_000, 0.8
    u = counter_uniform(torch.full((n,), 7), torch.zeros(n, dtype=torch.int64), torch.arange(n))
    tokens = choose_rows(logits.expand(n, -1), torch.full((n,), temp), u)
    freq = torch.bincount(tokens, minlength=12).double() / n
    probs = torch.softmax(logits[0].double() / temp, -1)
    assert float((freq - probs).abs().max()) < 4 * float((probs * (1 - probs) / n).sqrt().max())
    greedy = choose_rows(logits.expand(3, -1), torch.zeros(3), torch.rand(3))
    assert greedy.tolist() == [int(logits.argmax())] * 3


def test_jobs_that_cannot_fit_are_reported_not_decoded():
    check_unfit_jobs(StaticBatchedDecoder)


def test_bad_settings_are_refused():
    target = random_target("llama")
    with pytest.raises(ValueError, match="slots"):
        StaticBatchedDecoder(target, slots=0, capacity=32, max_new_tokens=8, stop_ids=[])
    with pytest.raises(ValueError, match="CUDA"):
        StaticBatchedDecoder(target, slots=2, capacity=32, max_new_tokens=8, stop_ids=[], graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphs_give_the_eager_tokens():
    target = random_target("llama", seed=3, dtype=torch.float32, device="cuda", init_scale=0.25, runtime=False)
    jobs = _jobs(12, target.cfg.vocab_size)
    runs = [{(a.job.key, a.turn): a.response_ids
             for a in StaticBatchedDecoder(target, 4, 160, 24, STOPS, span_step=16, graphs=g).run(jobs)}
            for g in (False, True)]
    assert runs[0] == runs[1]


def test_the_row_kernel_gives_the_masked_sdpa_tokens():
    """The Triton decode attention (the Triton interpreter on a CPU) reads each row's own keys: the same answers
    as SDPA over the longest row's span with a mask."""
    pytest.importorskip("triton")
    from ddtree.base.kernel_files import kernel_module
    if not torch.cuda.is_available() and not kernel_module("row_attention")._interpreting():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    target = random_target("qwen3", seed=5, init_scale=0.25)
    jobs = _jobs(8, target.cfg.vocab_size, seed=2)
    for j in jobs[::3]:
        j.temperature, j.seed = 0.8, 11
    runs = [{(a.job.key, a.turn): a.response_ids
             for a in StaticBatchedDecoder(target, 3, 160, 16, STOPS, span_step=16, row_kernel=k).run(jobs)}
            for k in (False, True)]
    assert runs[0] == runs[1]

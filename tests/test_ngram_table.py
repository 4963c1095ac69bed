"""The table of the target's own 3-gram continuations (ddtree/engine/ngram_table.py) and the lookup's fallback on it."""
import random
from collections import Counter

import numpy as np
import pytest

from conftest import run
from ddtree.base.config import ConfigError
from ddtree.base.options import LoadOptions
from ddtree.bench.testing import random_pair
from ddtree.engine.decoder import Decoder, make_method
from ddtree.engine.lookup import TABLE_LENGTH, ContextLookup
from ddtree.engine.ngram_table import FILE, NgramTable
from ddtree.models.loading import SHIPPED_DRAFTER


def brute_force_table(sequences, min_count, min_share):
    """3-gram -> its most frequent next token (the lowest id among equals), where kept."""
    seen: dict[tuple, Counter] = {}
    for s in sequences:
        for i in range(len(s) - 3):
            seen.setdefault(tuple(s[i:i + 3]), Counter())[s[i + 3]] += 1
    out = {}
    for gram, nexts in seen.items():
        total, best = sum(nexts.values()), max(nexts.values())
        if total >= min_count and best >= min_share * total:
            out[gram] = min(t for t, c in nexts.items() if c == best)
    return out


@pytest.mark.parametrize("min_count,min_share", [(1, 0.01), (2, 0.5), (3, 0.6), (4, 0.4)])
def test_the_table_keeps_each_frequent_3grams_most_frequent_next_token(min_count, min_share):
    rng = random.Random(min_count)
    sequences = [[rng.randrange(5) for _ in range(rng.randint(0, 40))] for _ in range(60)]
    table = NgramTable.from_sequences(sequences, 5, min_count, min_share)
    want = brute_force_table(sequences, min_count, min_share)
    assert len(table) == len(want) > 0
    for gram, token in want.items():
        assert table.next_token(*gram) == token
    for gram in {tuple(s[i:i + 3]) for s in sequences for i in range(len(s) - 2)} - set(want):
        assert table.next_token(*gram) is None


def test_a_chain_follows_the_table_3gram_by_3gram_and_stops_where_it_has_none():
    table = NgramTable(np.array([[1, 2, 3], [2, 3, 4], [3, 4, 9]]), np.array([4, 9, 1]), 10)
    assert table.chain([7, 1, 2, 3], 5) == [4, 9, 1]  # (4, 9, 1) has no entry
    assert table.chain([1, 2, 3], 2) == [4, 9]
    assert table.chain([2, 3], 3) == [] and table.chain([0, 0, 0], 3) == []
    assert table.next_token(1, 2, 30) is None  # past the vocabulary: no entry, no error


def test_large_token_ids_keep_their_keys_apart():
    vocab = 1 << 21
    grams = np.array([[vocab - 1, 0, 0], [0, vocab - 1, 0], [0, 0, vocab - 1], [1, 0, 0]])
    table = NgramTable(grams, np.array([1, 2, 3, 4]), vocab)
    assert [table.next_token(*g) for g in grams.tolist()] == [1, 2, 3, 4]


def test_it_saves_and_loads_and_refuses_what_it_cannot_use(tmp_path):
    table = NgramTable.from_sequences([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4]], 50, 1, 0.5)
    table.save(tmp_path / FILE)
    again = NgramTable.load(tmp_path / FILE)
    assert again.vocab_size == 50 and np.array_equal(again.keys, table.keys)
    assert np.array_equal(again.next_ids, table.next_ids)
    (tmp_path / "bad.npz").write_bytes(b"not a table")
    with pytest.raises(ConfigError, match="not an n-gram table.*ngram-table"):
        NgramTable.load(tmp_path / "bad.npz")
    with pytest.raises(ConfigError, match="below its vocabulary"):
        NgramTable(np.array([[1, 2, 3]]), np.array([60]), 50)
    with pytest.raises(ConfigError, match="twice"):
        NgramTable(np.array([[1, 2, 3], [1, 2, 3]]), np.array([4, 5]), 50)
    with pytest.raises(ConfigError, match="another tokenizer"):
        NgramTable.from_sequences([[1, 2, 3, 70]], 50)
    with pytest.raises(ConfigError, match="min_count"):
        NgramTable.from_sequences([[1, 2, 3, 4]], 50, 0)


def test_the_shipped_drafter_carries_a_table_of_its_targets_vocabulary():
    table = NgramTable.load(SHIPPED_DRAFTER / FILE)
    assert table.vocab_size == 49152 and len(table) > 100_000


def test_the_lookup_falls_back_on_the_table_where_the_context_has_no_match():
    table = NgramTable(np.array([[5, 6, 7], [6, 7, 8], [7, 8, 9], [8, 9, 10]]), np.array([8, 9, 10, 11]), 20)
    lookup = ContextLookup(table=table)
    lookup.start([1, 5, 6, 7])  # no earlier occurrence of (5, 6, 7): the table's chain, TABLE_LENGTH long
    assert lookup.chain() == [8, 9, 10][:TABLE_LENGTH] and lookup.tier == len(lookup.tiers) == lookup.kinds - 1
    lookup.extend([2, 5, 6, 7])  # now the context has one: its chain, tier 0
    assert lookup.chain() == [2, 5, 6, 7] and lookup.tier == 0
    plain = ContextLookup()
    plain.start([1, 5, 6, 7])
    assert plain.chain() == [] and plain.kinds == len(plain.tiers) + 1


def test_a_table_of_the_targets_own_answers_grafts_accepted_chains_and_stays_exact():
    """A table built from the random target's greedy answers to other prompts proposes chains where the context has
    none; they are grafted and some accepted, and every method's output is exactly plain decoding's. A table of
    random continuations changes the trees, never the output."""
    target, drafter = random_pair("llama", seed=4, block_size=8)
    rng = random.Random(0)
    others = [[rng.randrange(target.cfg.vocab_size) for _ in range(6)] for _ in range(12)]
    answers = [p + run(target, None, p, "ar", max_new_tokens=40)[0] for p in others]
    own = NgramTable.from_sequences(answers, target.cfg.vocab_size, 1, 0.5)
    noise = NgramTable.from_sequences([[rng.randrange(target.cfg.vocab_size) for _ in range(400)]],
                                      target.cfg.vocab_size, 1, 0.5)
    grafted_any = accepted_any = 0
    for prompt in others[:4]:
        reference, _ = run(target, None, prompt, "ar", max_new_tokens=40)
        for table in (own, noise):
            for method in ("ddtree:1+lookup", "ddtree:4+lookup", "ddtree:auto+lookup"):
                records = []
                tokens, _ = Decoder(target, drafter).generate(
                    prompt, make_method(method, None, None, drafter, table), max_new_tokens=40, trace=records)
                assert tokens == reference, (method, prompt)
                if table is own:
                    grafted_any += sum(rec["grafted"] for rec in records)
                    accepted_any += sum(node >= len(rec["parents"]) - rec["grafted"] for rec in records
                                        for node in rec["accepted"])
    assert grafted_any > 0 and accepted_any > 0, (grafted_any, accepted_any)


def test_the_table_is_on_by_default_and_a_knob_turns_it_off(monkeypatch):
    monkeypatch.delenv("DDTREE_NGRAM_TABLE", raising=False)
    assert LoadOptions.resolve().ngram_table is True
    assert LoadOptions.resolve(ngram_table=False).ngram_table is False
    monkeypatch.setenv("DDTREE_NGRAM_TABLE", "0")
    assert LoadOptions.resolve().ngram_table is False
    assert LoadOptions.resolve(ngram_table=True).ngram_table is True


def test_load_gives_the_drafters_table_to_the_lookup_unless_told_not_to(tmp_path):
    import ddtree
    from ddtree.bench.testing import save_target

    target, drafter = random_pair("llama", seed=1, num_draft_layers=1)
    drafter.model.save(tmp_path / "drafter")
    target_dir, draft_dir = save_target(target, tmp_path / "target"), tmp_path / "drafter"
    vocab = target.cfg.vocab_size
    assert ddtree.load(target=target_dir, draft=draft_dir, threads=1).ngram_table is None  # none there
    NgramTable.from_sequences([[1, 2, 3, 4] * 5], vocab, 1, 0.5).save(draft_dir / FILE)
    pair = ddtree.load(target=target_dir, draft=draft_dir, threads=1)
    assert pair.ngram_table is not None and pair.ngram_table.next_token(1, 2, 3) == 4
    assert pair.method("ddtree:2+lookup").lookup.table is pair.ngram_table
    assert ddtree.load(target=target_dir, draft=draft_dir, threads=1, ngram_table=False).ngram_table is None
    NgramTable.from_sequences([[1, 2, 3, 4] * 5], vocab + 1, 1, 0.5).save(draft_dir / FILE)
    with pytest.raises(ConfigError, match="vocabulary.*--no-ngram-table"):
        ddtree.load(target=target_dir, draft=draft_dir, threads=1)

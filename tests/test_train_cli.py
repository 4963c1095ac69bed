"""The training command line (ddtree/train/cli.py): generate-data, fit, resume, export, quantize."""
import json

import pytest
import torch

from ddtree.base.config import ConfigError
from ddtree.models.drafter import DFlashDrafter, untrained_drafter
from ddtree.bench.testing import random_target
from ddtree.train.cli import _check_ids, _read_prompts_file, build_parser
from ddtree.train.data import read_sequences
from ddtree.train.trainer import Trainer
from conftest import id_prompts, new_drafter, run, train_config

torch.set_num_threads(1)


@pytest.mark.slow
def test_cli_generate_fit_resume_export(tmp_path):
    from safetensors.torch import save_file

    from ddtree.train.cli import main

    target = random_target("qwen3", seed=9, init_scale=0.3)
    model_dir = tmp_path / "target"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(target.cfg.to_hf()))
    save_file({k: v.contiguous() for k, v in target.model.state_dict().items()}, str(model_dir / "model.safetensors"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"ids": p.ids}) + "\n" for p in id_prompts(16, 96, seed=2)))
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
    state = torch.load(run / "checkpoint.pt", weights_only=True)
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
        torch.testing.assert_close(copied.layers[k].mlp.down_proj.weight, target.model.model.layers[i].mlp.down_proj.weight,
                                   rtol=0, atol=1e-6)
    assert main(fresh + ["--out", str(tmp_path / "bad"), "--layers", "3", "--layers-from-target", "3,1"]) == 2


@pytest.mark.slow
def test_export_never_replaces_a_drafter_silently(tiny_data, tmp_path, monkeypatch):
    from ddtree.train import cli

    target, data = tiny_data
    run, out = tmp_path / "run", tmp_path / "drafter"
    Trainer(train_config(epochs=1, max_steps=1, val_sequences=0), target, new_drafter(target),
            read_sequences(data, "train")[:4], run).run()
    assert cli.main(["export", "--run", str(run), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"config.json", "model.safetensors", "README.md"}
    assert cli.main(["export", "--run", str(run), "--out", str(out), "--dtype", "float32"]) == 2  # needs --force
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    def broken_card(*args):  # an export that fails half-way (after the weights were written)
        raise RuntimeError("disk full")

    monkeypatch.setattr("ddtree.train.cli.model_card", broken_card)  # where the CLI looks it up
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
    from ddtree.runtime.cpu import qlinear
    from ddtree.runtime.cpu.runtime import attach
    from ddtree.train import cli
    
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
    _, rounded = attach(target, rounded)  # as a pair runs it: in the CPU runtime
    assert rounded.stack is not None and isinstance(rounded.head.compact, qlinear.QWeight)
    for prompt in ([5, 9, 2], [40, 41, 42, 43, 44, 45, 46], [3] * 12):
        reference, _ = run(target, None, prompt, "ar", max_new_tokens=20)
        for method, budget in (("dflash", None), ("ddtree", 2), ("ddtree", 16), ("ddtree", "auto")):
            assert run(target, rounded, prompt, method, budget=budget or 1, max_new_tokens=20)[0] == reference
    assert cli.main(["quantize", "--draft", str(tmp_path / "src"), "--out", str(out)]) == 2  # needs --force
    assert cli.main(["quantize", "--draft", str(tmp_path), "--out", str(tmp_path / "x")]) == 2  # no config.json


def test_prompts_file_ids_outside_the_vocabulary_and_a_bad_heldout(tmp_path):
    """Token ids the target does not have were a raw IndexError mid-run; --heldout 1.5 was accepted."""
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


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_probe_json_to_an_unwritable_path_fails_before_the_probe(tmp_path, monkeypatch, capsys, where):
    """Issue 55: `train probe --json PATH` checks PATH up front (exit 2); before, it failed after the whole probe."""
    from ddtree.train import cli

    def load(*args, **kw):
        raise AssertionError("the probe started")

    monkeypatch.setattr(cli, "load", load)
    (tmp_path / "file").write_text("")
    path = tmp_path if where == "a directory" else tmp_path / "file" / "probe.json"
    assert cli.main(["probe", "--eval-sets", "gsm", "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--json" in err and ("is a directory" if where == "a directory" else "is a file") in err


def test_fit_refuses_two_schedule_lengths_before_loading(tmp_path, capsys):
    from ddtree.train.cli import main

    assert main(["fit", "--data", "d", "--out", str(tmp_path / "o"), "--epochs", "2", "--total-steps", "50"]) == 2
    assert "--epochs 2 and --total-steps 50 both set the schedule's length: give one" in capsys.readouterr().err

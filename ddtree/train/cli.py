"""`python -m ddtree train {generate-data,export-prompts,fit,export,quantize,probe,markov-tables,markov-fit}`: the
drafter training recipe from the command line.

    python -m ddtree train generate-data --out data/smollm2-v2 --num-prompts 10000 --max-minutes 100
    python -m ddtree train fit --data data/smollm2 --out runs/l1 --layers 1 --max-minutes 110
    python -m ddtree train fit --data data/smollm2 --out runs/l1 --resume          # next 2-hour chunk
    python -m ddtree train export --run runs/l1 --out drafters/l1     # --force to replace a drafter there
    python -m ddtree train quantize --draft drafters/l1 --out drafters/l1-q8  # 8-bit blocks: faster CPU drafts
    python -m ddtree train probe --data data/smollm2-v5 --eval-sets humaneval,mt-bench,gsm  # acceptance, offline
    python -m ddtree train markov-tables --data data/smollm2-v4 --out runs/tables  # then markov-fit: a Markov head
Multi-process: torchrun --nproc_per_node N -m ddtree train fit ...
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from dataclasses import fields, replace
from pathlib import Path

import torch

from ..api import load
from ..base.cache import replacing_dir
from ..base.config import ConfigError, cli_int
from ..bench.datasets import load_prompts
from ..models.drafter import DFlashDrafter, untrained_drafter
from ..models.markov import CONFIG_KEY as MARKOV_KEY, MarkovHead
from ..base.files import output_dir, output_file, read_jsonl
from ..models.loading import (SHIPPED_DRAFTER, default_dtype, load_target, load_tokenizer, parse_dtype, resolve_device,
                       resolve_target_dir, stop_token_ids)
from ..engine.ngram_table import MIN_COUNT as NGRAM_MIN_COUNT, MIN_SHARE as NGRAM_MIN_SHARE, ORDER as NGRAM_ORDER
from ..engine.ngram_table import FILE as NGRAM_FILE, NgramTable
from ..runtime.cpu.qlinear import po2_q8
from .card import model_card
from .data import (DECODERS, GenerationSettings, encode_prompt, follow_up_ids, generate_data, read_records,
                   read_sequences)
from .grow import grow_drafter, layers_from_target
from .markov import collect_tables, depth_top1, fit_head, flat_rows, heldout_nll, read_tables
from .model import OBJECTIVES
from .probe import SIBLING_RANKS, probe, tree_tau
from .prompts import Prompt, SCALE_MIX, build_prompts, with_follow_ups
from .trainer import (CHECKPOINT, RUNTIME_FIELDS, TrainConfig, Trainer, drafter_from_checkpoint, init_distributed,
                      resume_config)
from .vocab import coverage, draft_vocabulary, pruned_draft_vocab, response_token_counts, with_draft_vocab


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """The tokenizer's own mask token if it has one; else its highest-id special token that is not
    bos/eos/pad/unk (never produced in chat, so it cannot collide with a real bonus token); else the last id.
    SmolLM2: id 16 `<empty_output>`, one of the StarCoder metadata tokens (5, 7-16) whose embedding rows are
    identical, i.e. never trained: the target never emits it, and its embedding is far from every real token."""
    if tokenizer is None:
        return vocab_size - 1
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    reserved = {getattr(tokenizer, n, None) for n in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    template = getattr(tokenizer, "chat_template", None) or ""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    candidates = [i for i, t in decoder.items() if getattr(t, "special", False) and i not in reserved
                  and i < vocab_size and t.content not in template]
    return max(candidates) if candidates else vocab_size - 1


def _target_args(p):
    p.add_argument("--target", help="HF model directory or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="target dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--threads", type=cli_int(1), default=None, help="torch CPU threads (default: torch's choice)")


def _load_target(args, dtype_default=None):
    """dtype_default(device) picks the dtype when --dtype is not given (default: fp32 on CPU, bf16 on CUDA)."""
    device = resolve_device(args.device)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dtype = parse_dtype(args.dtype) if args.dtype else dtype_default(device) if dtype_default else \
        (torch.bfloat16 if device.type == "cuda" else torch.float32)
    directory = resolve_target_dir(args.target)
    target = load_target(directory, dtype, device)
    tokenizer = load_tokenizer(directory)
    return target, tokenizer, stop_token_ids(directory, target.cfg, tokenizer), directory


def _parse_mix(text: str | None):
    if not text:
        return None
    try:
        return {k: float(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise ConfigError(f"--mix must look like codeio=0.35,math=0.2,chat=0.2,stdlib=0.25, got {text!r}") from None


def _fraction(text: str) -> float:
    """An argparse type: a fraction in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1) (the share of prompts held out), got {text}")
    return value


def _check_ids(prompts, vocab_size: int, path: str) -> None:
    """A ConfigError naming the prompt whose token ids fall outside the target's vocabulary."""
    for p in prompts:
        for ids in (p.ids, p.follow_up_ids):
            bad = [t for t in ids or () if not 0 <= t < vocab_size]
            if bad:
                raise ConfigError(f"--prompts-file {path}: prompt {p.key!r} has token ids {bad[:5]} outside the "
                                  f"target's vocabulary (0..{vocab_size - 1}): were they made with another tokenizer?")


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _read_prompts_file(path: str):
    """Prompts from JSONL: {"text"}, {"messages"} or {"ids"} per line, with optional "key", "source" and a
    second user turn ("follow_up" text with text/messages, "follow_up_ids" tokens with ids: the template's
    tokens after the first answer's stop token, as `train export-prompts` writes them)."""
    if not Path(path).is_file():
        raise ConfigError(f"--prompts-file {path} does not exist")
    out = []
    for number, r in read_jsonl(path):
        i = number - 1  # keys stay what they were when lines were counted from 0
        key, source = (r.get("key", f"file/{i}"), r.get("source", "file")) if isinstance(r, dict) else (None, None)
        follow, follow_ids = (r.get("follow_up"), r.get("follow_up_ids")) if isinstance(r, dict) else (None, None)
        ids_follow_ok = follow is None and (follow_ids is None or _is_ids(follow_ids))  # with "ids": ids only
        text_follow_ok = follow_ids is None and (follow is None or isinstance(follow, str) and follow.strip())
        if isinstance(r, dict) and _is_ids(r.get("ids")) and ids_follow_ok:
            out.append(Prompt(key, source, ids=r["ids"], follow_up_ids=follow_ids))
        elif isinstance(r, dict) and isinstance(r.get("text"), str) and r["text"].strip() and text_follow_ok:
            out.append(Prompt(key, source, [{"role": "user", "content": r["text"]}], follow_up=follow))
        elif isinstance(r, dict) and isinstance(r.get("messages"), list) and r["messages"] and \
                all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in r["messages"]) and text_follow_ok:
            out.append(Prompt(key, source, r["messages"], follow_up=follow))
        else:
            hint = " (that is the benchmark's format)" if isinstance(r, dict) and {"prompt", "turns"} & set(r) else ""
            raise ConfigError(f"{path}:{number}: expected a non-empty {{\"text\": \"...\"}}, {{\"messages\": "
                              f"[{{\"role\", \"content\"}}, ...]}} or {{\"ids\": [token ids]}} (a follow-up as "
                              f"\"follow_up\" text, or \"follow_up_ids\" with ids), got {_keys(r)}{hint}")
    if not out:
        raise ConfigError(f"--prompts-file {path} holds no prompts")
    return out


def _keys(record) -> str:
    return str(sorted(record)) if isinstance(record, dict) else type(record).__name__


def cmd_generate_data(args) -> int:
    settings = GenerationSettings(args.max_new_tokens, args.slots, args.sampled_fraction, args.t_min, args.t_max,
                                  args.follow_ups, args.seed, args.chunk_size, args.max_prompt_tokens,
                                  args.answers_per_prompt)
    output_dir(args.out, "--out")  # bad input fails here, before the target is loaded
    if args.prompts_file:  # a file's follow-up turns are its own
        prompts = _read_prompts_file(args.prompts_file)
    else:
        prompts = build_prompts(args.num_prompts, _parse_mix(args.mix) or SCALE_MIX, args.seed)
        prompts = with_follow_ups(prompts, settings.follow_up_fraction, args.seed)
    target, tokenizer, stops, directory = _load_target(args, default_dtype)  # the engine's: fp32 on CPUs
    if args.prompts_file:
        _check_ids(prompts, target.cfg.vocab_size, args.prompts_file)
    # the target as the user named it (the cache directory's name changes with the install)
    meta = {"target": args.target or "embedded:SmolLM2-135M-Instruct",
            "mix": None if args.prompts_file else args.mix or "scale", "prompts_file": args.prompts_file}
    stats = generate_data(target, tokenizer, prompts, args.out, settings, stops, args.heldout, meta,
                          progress=not args.no_progress, max_minutes=args.max_minutes, group_size=args.group_size,
                          decoder=args.decoder)
    rate = stats["tokens"] / stats["seconds"] if stats["seconds"] else 0.0
    left = f"; {stats['remaining']} chunks left: run the same command again" if stats["remaining"] else ""
    print(f"generate-data: {stats['chunks']} chunks in {args.out} ({stats['written']} written now, "
          f"{stats['skipped']} already there){left}; {stats['answers']} answers, {stats['tokens']} response tokens "
          f"at {rate:.1f} tok/s ({stats['decode_steps']} batched steps, {stats['prefill_tokens']} prefill tokens)")
    return 0


def cmd_export_prompts(args) -> int:
    """The training prompts as token ids (prompt and follow-up turn, in the target's chat template), for a
    generate-data run on a machine without the prompt packages or the tokenizer (e.g. a GPU box)."""
    out = Path(args.out)
    output_dir(out.parent, "the parent of --out")
    tokenizer = load_tokenizer(resolve_target_dir(args.target))
    if tokenizer is None:
        raise ConfigError("export-prompts needs the target's tokenizer; this target has none")
    prompts = with_follow_ups(build_prompts(args.num_prompts, _parse_mix(args.mix) or SCALE_MIX, args.seed),
                              args.follow_ups, args.seed)
    done = {r["key"] for d in args.exclude for r in read_records(d)}
    lines, skipped = [], 0
    for p in prompts:
        if p.key in done:
            skipped += 1
            continue
        ids = encode_prompt(p, tokenizer)
        rec = {"key": p.key, "source": p.source, "ids": ids}
        follow = follow_up_ids(p, tokenizer, ids)
        if follow is not None:
            rec["follow_up_ids"] = follow
        lines.append(json.dumps(rec, separators=(",", ":")) + "\n")
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, out)
    print(f"export-prompts: {len(lines)} prompts written to {out} ({skipped} already answered in "
          f"{', '.join(args.exclude) or '-'} left out)")
    return 0


def _train_config(args):
    names = {f.name for f in fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    values["progress"] = not args.no_progress
    return TrainConfig(**values)


def _warn_ignored(args, state: dict, drafter) -> None:
    """On --resume the run's own settings hold; say so for any that this command line tries to change."""
    saved = dict(state["config"], layers=drafter.cfg.model.num_layers, block_size=drafter.cfg.block_size,
                 mask_token_id=drafter.cfg.mask_token_id, taps=list(drafter.cfg.target_layer_ids))
    ignored = [k for k, v in vars(args).items() if k in saved and k not in RUNTIME_FIELDS and v is not None
               and v != saved[k]]
    if ignored:
        print(f"warning: --resume keeps the run's own {', '.join(ignored)} "
              f"({', '.join(f'{k}={saved[k]}' for k in ignored)}); start a new --out to change them", file=sys.stderr)


def _initial_drafter(args, target, tokenizer, seed: int, vocab=None):
    """A seeded random drafter, or (--init-from) an existing drafter's weights to go on from, e.g. at another
    block size: the weights do not depend on it. vocab: target ids of a reduced draft vocabulary (or None)."""

    if args.init_from is None:
        mask = args.mask_token_id if args.mask_token_id is not None else \
            default_mask_token_id(tokenizer, target.cfg.vocab_size)
        from_target = args.layers_from_target
        layers = args.layers or (len(from_target) if from_target else 1)
        drafter = untrained_drafter(target, layers, args.block_size or 16, seed=seed, mask_token_id=mask,
                                    draft_vocab=vocab)
        if args.taps:
            drafter = _with_taps(drafter, args.taps, target, seed)
        return layers_from_target(drafter, target, from_target) if from_target else drafter
    if args.layers_from_target:
        raise ConfigError("--layers-from-target starts a new drafter's layers; --init-from already gives them "
                          "(drop one)")
    drafter = DFlashDrafter.load(args.init_from, target.dtype, target.device)
    if args.mask_token_id is not None and args.mask_token_id != drafter.cfg.mask_token_id:
        raise ConfigError(f"--init-from {args.init_from} fixes mask_token_id: drop --mask-token-id")
    if args.block_size:
        drafter.cfg = replace(drafter.cfg, block_size=args.block_size)
    drafter = grow_drafter(drafter.bind(target), args.layers, args.taps, seed=seed)
    return drafter if vocab is None else with_draft_vocab(drafter, vocab, target.lm_head.weight)


def _tap_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers like 1,10,18,27, got {text!r}")


def _with_taps(drafter, taps, target, seed: int):
    """A random drafter reading `taps` instead of its default tap layers (a fresh fc of the right width)."""
    new = DFlashDrafter(replace(drafter.cfg, target_layer_ids=tuple(taps)), drafter.attention_backend)
    state = drafter.state_dict()
    gen = torch.Generator().manual_seed(seed + 1)
    state["fc.weight"] = (torch.randn(new.fc.weight.shape, generator=gen) * 0.02).to(drafter.fc.weight)
    new.load_state_dict(state)
    return new.to(drafter.fc.weight.device).bind(target)


def _check_markov_args(args) -> None:
    """--markov-weight / --markov-rank against the drafter they apply to (before the target is loaded)."""
    if args.markov_weight is not None and args.markov_weight < 0:
        raise ConfigError(f"--markov-weight must be >= 0, got {args.markov_weight}")
    if args.resume:
        if args.markov_rank:
            raise ConfigError("--markov-rank starts a head; a resumed run keeps its own drafter: drop --markov-rank")
        for name in ("draft_vocab", "init_from", "layers_from_target"):  # they shape a new drafter only
            if getattr(args, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} shapes a new run's drafter; a resumed run keeps its own drafter "
                                  f"(and vocabulary): drop {flag}, or start a new --out with it")
        return
    if args.markov_lr is not None and not args.markov_weight:
        raise ConfigError("--markov-lr is the head's learning rate with --markov-weight: add --markov-weight W, or "
                          "drop --markov-lr")
    if args.markov_rank and not args.markov_weight:
        raise ConfigError("--markov-rank gives the drafter a fresh head, which only --markov-weight trains: "
                          "add --markov-weight W (e.g. 1)")
    has_head = False
    if args.init_from is not None and (cfg := Path(args.init_from) / "config.json").is_file():
        has_head = MARKOV_KEY in json.loads(cfg.read_text()) and not args.draft_vocab  # another vocabulary drops it
    if args.markov_rank and has_head:
        raise ConfigError(f"--init-from {args.init_from} already has a Markov head: drop --markov-rank to train that "
                          "one, or make a copy without it first (train quantize --drop-markov)")
    if args.markov_weight and not (has_head or args.markov_rank):
        raise ConfigError("--markov-weight trains the drafter's Markov head, and this drafter has none: --init-from a "
                          "drafter with one (markov-fit), or add --markov-rank R (e.g. 64) for a fresh head")


def cmd_fit(args) -> int:
    out = output_dir(args.out, "--out")  # bad input fails here, before the target is loaded
    _check_markov_args(args)
    if args.epochs is not None and args.total_steps is not None:
        raise ConfigError(f"--epochs {args.epochs} and --total-steps {args.total_steps} both set the schedule's "
                          "length: give one")
    train, heldout = read_sequences(args.data, "train"), read_sequences(args.data, "heldout")
    target, tokenizer, stops, _ = _load_target(args)
    init_distributed(target.device)
    cfg = _train_config(args)
    if args.pack_tokens is None and target.device.type == "cuda":
        cfg = replace(cfg, pack_tokens=8192)
    ckpt = out / CHECKPOINT
    if args.resume:
        if not ckpt.is_file():
            raise ConfigError(f"--resume: {ckpt} does not exist (start without --resume)")
        drafter, state = drafter_from_checkpoint(ckpt, target)
        _warn_ignored(args, state, drafter)
        cfg = resume_config(state["config"], cfg, given={k for k, v in vars(args).items() if v is not None})
    else:
        if ckpt.is_file():
            raise ConfigError(f"{out} already holds a run (checkpoint.pt): pass --resume to continue it, or "
                              "choose another --out")
        vocab = None
        if args.draft_vocab:
            vocab = draft_vocabulary(response_token_counts(train, target.cfg.vocab_size), args.draft_vocab, stops)
            print(f"fit: draft vocabulary of {args.draft_vocab} tokens covers {coverage(vocab, train):.2%} of the "
                  f"training and {coverage(vocab, heldout):.2%} of the held-out response tokens", file=sys.stderr)
        drafter = _initial_drafter(args, target, tokenizer, cfg.seed, vocab)
        if args.markov_rank:
            m = drafter.cfg.model
            drafter.set_markov_head(MarkovHead(m.hidden_size, drafter.cfg.draft_vocab, drafter.cfg.block_size - 1,
                                               args.markov_rank).to(target.device))
        state = None
    drafter = drafter.float().requires_grad_(True)  # fp32 master weights (the target may be bf16)
    trainer = Trainer(cfg, target, drafter, train, out, heldout, tokenizer, stops)
    if state is not None:
        trainer.load_state(state)
    if trainer.rank == 0:
        print(f"fit: {len(train)} train / {len(heldout)} held-out sequences; {drafter.cfg.model.num_layers} draft "
              f"layers, block {drafter.cfg.block_size}, taps {list(drafter.cfg.target_layer_ids)}, mask "
              f"{drafter.cfg.mask_token_id}; step {trainer.step}/{trainer.total_steps}", file=sys.stderr)
    status = trainer.run()
    if trainer.rank == 0:
        print(f"fit: {status} at step {trainer.step}/{trainer.total_steps} ({trainer.label_tokens} label tokens); "
              f"drafter in {out / 'drafter'}" + ("" if status == "done" else "; continue with --resume"))
    return 0


def cmd_export(args) -> int:
    path = Path(args.run)
    path = path / CHECKPOINT if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {path}")
    for d in args.data or []:
        if not Path(d).is_dir():
            raise ConfigError(f"--data {d} is not a directory")
    out = _drafter_out(args.out, args.force)
    dtype = parse_dtype(args.dtype)
    drafter, state = drafter_from_checkpoint(path)
    with replacing_dir(out) as tmp:  # a failed export leaves what --out held untouched
        drafter.save(tmp, dtype)
        card = model_card(state, path.parent, args.data, args.dtype, args.name or out.name)
        (tmp / "README.md").write_text(card)
    print(f"export: step {state['step']} drafter ({drafter.cfg.model.num_layers} layers, block "
          f"{drafter.cfg.block_size}, {args.dtype}) written to {args.out}")
    return 0


def _drafter_dir(path, flag: str) -> Path:
    """The drafter directory `path` given as `flag`; a ConfigError where it holds no config.json."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{flag} {path} is not a drafter directory (no config.json)")
    return path


def _drafter_out(path: str, force: bool) -> Path:
    """--out of export / quantize: a new or empty directory (or any, with --force) under a writable parent."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory: choose a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        held = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise ConfigError(f"--out {out} is not empty ({held}): pass --force to replace it, or choose a new directory")
    output_dir(out.parent, "the parent of --out")
    return out


def cmd_quantize(args) -> int:
    """A drafter with every matrix rounded to 8-bit blocks with power-of-two scales (qlinear.round_po2_q8), saved
    in bfloat16, which holds those values exactly: a drafter in the published format like any other, whose float32
    CPU passes read 8.5 bits a weight instead of 16 (cpu_stack.compact_copy), with the same bits as its bf16 file."""
    source = _drafter_dir(args.draft, "--draft")
    out = _drafter_out(args.out, args.force)
    drafter = DFlashDrafter.load(source)
    if args.drop_markov:
        drafter.set_markov_head(None)
    if args.markov_from:
        drafter.set_markov_head(_donor_head(drafter, Path(args.markov_from)))
    rounded, kept = [], []
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            blocks = None if name.startswith("markov.") else po2_q8(p, exact=False)  # the head is not a CPU pass
            (rounded if blocks is not None else kept).append(name)
            if blocks is not None:
                p.copy_(blocks.dequantize())
    _write_drafter(drafter, out, source)
    print(f"quantize: {len(rounded)} matrices rounded to 8-bit power-of-two blocks, {len(kept)} tensors kept "
          f"(norms: {', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}); written to {out} in bfloat16 (its model "
          f"card copied unchanged: say there that it is rounded)")
    return 0


def _write_drafter(drafter, out: Path, source: Path) -> None:
    """A drafter made from the one in `source` (quantize, prune-vocab), written to `out` in bfloat16 with the source's
    model card and n-gram table (the target's, not the drafter's: ngram_table.py) copied unchanged."""
    with replacing_dir(out) as tmp:
        drafter.save(tmp, torch.bfloat16)
        for name in ("README.md", NGRAM_FILE):
            if (source / name).is_file():
                shutil.copy(source / name, tmp / name)


def cmd_prune_vocab(args) -> int:
    """A drafter over the --size most frequent tokens of its draft vocabulary in --data's training answers (the
    target's stop tokens always kept): its own head's rows, so its logits are the drafter's columns and its trees
    the drafter's wherever the kept tokens carry them, for a head a fraction of the size (vocab.pruned_draft_vocab)."""
    source = _drafter_dir(args.draft, "--draft")
    out = _drafter_out(args.out, args.force)
    drafter = DFlashDrafter.load(source)
    if not drafter.cfg.reduced_vocab:
        raise ConfigError(f"--draft {source} predicts over the target's whole vocabulary: prune-vocab keeps part of "
                          "a reduced draft vocabulary (make one with `train fit --draft-vocab N`)")
    if not args.size < drafter.cfg.draft_vocab_size:
        raise ConfigError(f"--size {args.size}: the drafter's draft vocabulary has {drafter.cfg.draft_vocab_size} "
                          "tokens; give fewer")
    target, _, stops, _ = _load_target(args)
    drafter.cfg.check_target(target.cfg)
    train = read_sequences(args.data, "train")
    if not train:
        raise ConfigError(f"--data {' '.join(args.data)}: no training answers there (generate-data writes them)")
    own = drafter.to_target_ids(torch.arange(drafter.cfg.draft_vocab_size))  # draft id -> target id
    counts = response_token_counts(train, target.cfg.vocab_size)[own]
    always = [int(i) for i in torch.nonzero(torch.isin(own, torch.tensor(sorted(stops), dtype=torch.long)))]
    keep = draft_vocabulary(counts, args.size, always)
    pruned = pruned_draft_vocab(drafter, keep)
    _write_drafter(pruned, out, source)
    print(f"prune-vocab: {args.size} of {drafter.cfg.draft_vocab_size} draft tokens kept; they cover "
          f"{coverage(own[keep], train):.2%} of the training response tokens (all {drafter.cfg.draft_vocab_size}: "
          f"{coverage(own, train):.2%}); written to {out} in bfloat16 (its model card copied unchanged: say there "
          "that it is pruned)")
    return 0


def cmd_ngram_table(args) -> int:
    """The table of the target's own 3-gram continuations (ddtree/engine/ngram_table.py) from --data's training
    answers, written to --out (ngrams.npz in a drafter's folder: load() gives it to ddtree:N+lookup)."""
    if not args.out.endswith(".npz"):
        raise ConfigError(f"--out {args.out}: the table is an .npz file; name it so (e.g. DRAFTER_DIR/ngrams.npz)")
    out = output_file(args.out, "--out")
    if out.exists() and not args.force:
        raise ConfigError(f"--out {out} exists; give --force to replace it")
    target, _, _, _ = _load_target(args)
    train = read_sequences(args.data, "train")
    if not train:
        raise ConfigError(f"--data {' '.join(args.data)}: no training answers there (generate-data writes them)")
    # each answer with the ORDER prompt tokens before it (the chat template's assistant header), so its first
    # tokens have 3-grams too
    answers = (seq.tokens[max(0, seq.prompt_len - NGRAM_ORDER):] for seq in train)
    table = NgramTable.from_sequences(answers, target.cfg.vocab_size, args.min_count, args.min_share)
    table.save(out)
    tokens = sum(len(seq.tokens) - seq.prompt_len for seq in train)
    print(f"ngram-table: {len(table):,} 3-grams (seen >= {args.min_count} times, one next token >= "
          f"{args.min_share:.0%} of them) from {len(train):,} training answers ({tokens:,} response tokens); "
          f"written to {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


def _donor_head(drafter, donor_dir: Path):
    """The Markov head of the drafter in donor_dir, for `drafter`: refused unless it indexes the same draft vocabulary
    (size and d2t) over the same block positions."""
    donor = DFlashDrafter.load(_drafter_dir(donor_dir, "--markov-from"))
    if donor.markov is None:
        raise ConfigError(f"--markov-from {donor_dir}: that drafter has no Markov head (fit one with markov-fit)")
    same = donor.cfg.draft_vocab == drafter.cfg.draft_vocab and donor.cfg.block_size == drafter.cfg.block_size and \
        (not drafter.cfg.reduced_vocab or torch.equal(donor.d2t, drafter.d2t))
    if not same:
        raise ConfigError(f"--markov-from {donor_dir}: its head is for another draft vocabulary or block size "
                          f"({donor.cfg.draft_vocab} tokens, block {donor.cfg.block_size}; this drafter: "
                          f"{drafter.cfg.draft_vocab}, block {drafter.cfg.block_size}, or another d2t)")
    return donor.markov


def _answers(pair, args, greedy_only: bool) -> list[tuple]:
    """(tokens, prompt_len, group) of --data's answers (--split, at most --max-sequences per directory, shuffled
    with seed 0) and of the target's own greedy answers to --eval-sets prompts (measured on, never trained on)."""
    seqs = []
    for d in args.data or []:
        found = [q for q in read_sequences(d, None if args.split == "all" else args.split)
                 if q.temperature == 0.0 or not greedy_only]
        random.Random(0).shuffle(found)
        seqs += [(q.tokens, q.prompt_len, q.source) for q in found[: args.max_sequences]]
    for name in (args.eval_sets.split(",") if args.eval_sets else []):
        for text in load_prompts(name, args.num_prompts):
            res = pair.generate(text, method="ar", max_new_tokens=args.max_new_tokens)
            seqs.append((res.prompt_ids + res.token_ids, len(res.prompt_ids), name))
    return seqs


def cmd_markov_tables(args) -> int:
    if not args.data and not args.eval_sets:
        raise ConfigError("nothing to tabulate: give --data DIR ... and/or --eval-sets humaneval,mt-bench,gsm")
    pair = load(args.target, args.draft, args.device, args.dtype or "float32")
    seqs = _answers(pair, args, args.greedy_only)
    if not seqs:
        raise ConfigError(f"no {args.split} answers in {', '.join(args.data or [])}")
    from tqdm import tqdm

    bar = None if args.no_progress else tqdm(total=len(seqs), desc="markov-tables", unit="answer", file=sys.stderr)
    written = collect_tables(pair.target, pair.drafter, seqs, args.out, args.candidates, args.chunk,
                             bar.update if bar else None)
    if bar:
        bar.close()
    print(f"markov-tables: {len(seqs)} answers in {args.out} ({written} chunks written now)")
    return 0


def _print_tau(title: str, result: dict, budgets) -> None:
    """A probe result (train.probe.probe / tree_tau) as a markdown table: per group positions, top-1, tau."""
    print(title)
    print("| group | positions | top-1 | " + " | ".join(f"tau @{b}" for b in budgets) + " |")
    print("|---|---:|---:|" + "---:|" * len(budgets))
    for g, r in sorted(result.items(), key=lambda kv: kv[0] == "all"):
        taus = " | ".join(f"{r['tau'][b]:.3f}" for b in budgets)
        print(f"| {g} | {r['positions']} | {r['top1']:.1%} | {taus} |")
    paths = {g: r["paths"] for g, r in result.items() if r.get("paths")}
    if paths:
        print(f"\ntop-1 / top-{SIBLING_RANKS} hit rate of the true token at each depth, after a spine (top-1) parent and "
              f"after a sibling (rank 2-{SIBLING_RANKS}) parent, over roots whose true path stayed in the top "
              f"{SIBLING_RANKS}")
        depths = [p["depth"] for p in paths["all"]]
        print("| group | parent | " + " | ".join(f"d{d}" for d in depths) + " |")
        print("|---|---|" + "---:|" * len(depths))
        for g, rows in sorted(paths.items(), key=lambda kv: kv[0] == "all"):
            for kind in ("spine", "sibling"):
                cells = [f"{p[kind]['top1']:.0%} / {p[kind]['topk']:.0%}" if p[kind]["roots"] else "-" for p in rows]
                print(f"| {g} | {kind} | " + " | ".join(cells) + " |")


def cmd_markov_fit(args) -> int:
    budgets = [int(b) for b in args.budgets.split(",")]
    out = _drafter_out(args.out, args.force)
    if args.draft is None and args.target is not None:
        raise ConfigError("--draft is needed with --target: the drafter the head is fitted to")
    tables = read_tables(args.tables)  # before the (slow) load: a wrong path is refused at once
    target = _load_target(args, lambda device: torch.float32)[0]  # only its embedding: the parents' codes
    source = Path(args.draft or SHIPPED_DRAFTER)
    drafter = DFlashDrafter.load(source, target=target)
    cfg, m = drafter.cfg, int(tables["cand_ids"].shape[-1])
    torch.manual_seed(args.seed)
    head = MarkovHead(cfg.model.hidden_size, cfg.draft_vocab, cfg.block_size - 1, args.rank, m)
    embed = target.model.embed_tokens.weight.detach().float()
    device = embed.device  # the fit runs where the target is (--device); the held-out trees are built on the host
    head, rows = head.to(device), {k: v.to(device) for k, v in flat_rows(tables).items()}
    from tqdm import tqdm

    steps = max(1, -(-int(args.epochs * rows["label_idx"].numel()) // args.batch))
    bar = None if args.no_progress else tqdm(total=steps, desc="markov-fit", unit="step", file=sys.stderr)
    log = (lambda step, loss: bar.set_postfix(loss=f"{loss:.4f}")) if bar else None
    fit_head(head, embed, rows, args.epochs, args.batch, args.lr, args.weight_decay, args.seed,
             bar.update if bar else None, log)
    if bar:
        bar.close()
    print(f"markov-fit: {rows['label_idx'].numel()} rows, {steps} steps, rank {args.rank}, {m} candidates")
    head, embed = head.to(torch.bfloat16).float().cpu(), embed.cpu()  # evaluate what the bf16 file holds
    drafter.set_markov_head(head)
    if args.heldout:
        held = read_tables(args.heldout)
        hrows = flat_rows(held)
        print(f"held-out NLL of the true token at block positions 2..{cfg.block_size - 1}: drafter "
              f"{heldout_nll(None, embed, hrows):.4f}, with the head {heldout_nll(head, embed, hrows):.4f} "
              f"({hrows['label_idx'].numel()} rows)")
        print("teacher-forced top-1 by block position (the drafter's marginal -> the head's conditional): " +
              ", ".join(f"{d}: {a:.1%} -> {b:.1%}" for d, a, b in depth_top1(head, embed, hrows)))
        _print_tau("without the head (the drafter's marginals):", tree_tau(held, budgets), budgets)
        _print_tau("with the head (each node's own conditional):",
                   tree_tau(held, budgets, head, embed, drafter.to_target_ids), budgets)
    with replacing_dir(out) as tmp:
        drafter.save(tmp, torch.bfloat16)
        if (source / "README.md").is_file():
            shutil.copy(source / "README.md", tmp / "README.md")
    print(f"markov-fit: drafter with its head written to {out}. Other engines do not use the head: vLLM refuses "
          f"a drafter with the markov.* tensors, SGLang ignores them and config.json's {MARKOV_KEY!r}; write a copy "
          "without them for those engines (docs/serving.md; `quantize --drop-markov` also rounds to 8-bit blocks)")
    return 0


def cmd_probe(args) -> int:
    budgets = [int(b) for b in args.budgets.split(",")]
    if min(budgets) < 1 or max(budgets) > args.top_k:
        raise ConfigError(f"--budgets must lie in 1..--top-k ({args.top_k}), got {args.budgets}")
    if not args.data and not args.eval_sets:
        raise ConfigError("nothing to probe: give --data DIR ... and/or --eval-sets humaneval,mt-bench,gsm")
    if args.json:
        output_file(args.json, "--json")  # an unwritable path fails here, not after the probe
    pair = load(args.target, args.draft, args.device, args.dtype or "float32",
                markov_head=args.markov_head or None)  # not given: DDTREE_MARKOV_HEAD decides (options.py)
    seqs = _answers(pair, args, greedy_only=True)  # a sampled answer is not the target's continuation at T=0
    if not seqs:
        raise ConfigError(f"no greedy {args.split} answers in {', '.join(args.data)}")
    from tqdm import tqdm

    bar = None if args.no_progress else tqdm(total=len(seqs), desc="probe", unit="answer", file=sys.stderr)
    result = probe(pair.target, pair.drafter, seqs, budgets, args.top_k, bar.update if bar else None)
    if bar:
        bar.close()
    _print_tau(f"drafter {getattr(pair.drafter, 'label', args.draft)}; {len(seqs)} answers; tau = 1 + mean accepted "
               "length over every position, for best-first trees of each budget", result, budgets)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddtree train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate-data", help="the target answers the training prompts; writes token-id chunks")
    _target_args(g)
    g.add_argument("--out", required=True, help="data directory (resumes: finished chunks are skipped)")
    g.add_argument("--num-prompts", type=cli_int(1), default=10000)
    g.add_argument("--mix", help="source weights, e.g. sharegpt=0.35,codeio=0.25,stdlib=0.15,chat=0.12,math=0.13 "
                   "(the default); sources: codeio, math, chat, stdlib, sharegpt, writing")
    g.add_argument("--prompts-file", help="JSONL prompts instead: {\"text\"}, {\"messages\"} or {\"ids\"} per line")
    g.add_argument("--max-new-tokens", type=int, default=256, help="per answer (default: %(default)s)")
    g.add_argument("--slots", type=cli_int(1), default=64, help="sequences decoded together (default: %(default)s)")
    g.add_argument("--group-size", type=cli_int(1), default=8,
                   help="rows per attention group of the rows decoder (default: %(default)s; not a data setting)")
    g.add_argument("--decoder", choices=DECODERS, default="auto",
                   help="the batched generator: rows (per-row Python, attention per group: a CPU's), static (fixed "
                   "buffers, CUDA graphs, a Triton attention: a GPU's), static-eager (static in plain torch) or "
                   "auto (static on CUDA; default; not a data setting)")
    g.add_argument("--sampled-fraction", type=float, default=0.25,
                   help="prompts answered by sampling at T in [--t-min, --t-max]; the rest greedy (default %(default)s)")
    g.add_argument("--answers-per-prompt", type=cli_int(1), default=1,
                   help="answers per prompt; the 2nd and later are always sampled (more data from a finite prompt "
                   "pool; default %(default)s)")
    g.add_argument("--t-min", type=float, default=0.7)
    g.add_argument("--t-max", type=float, default=1.0)
    g.add_argument("--follow-ups", type=float, default=0.35,
                   help="fraction of prompts that get a second user turn after the answer (default %(default)s)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chunk-size", type=cli_int(1), default=250, help="prompts per chunk file (the unit of resuming)")
    g.add_argument("--heldout", type=_fraction, default=0.02, help="held-out fraction of prompts (by key hash)")
    g.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    g.add_argument("--max-minutes", type=float, help="start no new chunk after this long (rerun resumes)")
    g.add_argument("--no-progress", action="store_true")

    f = sub.add_parser("fit", help="train a DFlash drafter on generated data")
    _target_args(f)
    f.add_argument("--data", required=True, nargs="+", metavar="DIR", help="generate-data directories (one or more)")
    f.add_argument("--out", required=True, help="run directory: checkpoint.pt, log.jsonl, drafter/")
    f.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    f.add_argument("--layers", type=int, choices=range(1, 6), metavar="{1..5}", help="draft layers (default 1)")
    f.add_argument("--block-size", type=int, help="drafter block size (default 16)")
    f.add_argument("--taps", type=_tap_list, metavar="I,J,...", help="target tap layers (default: evenly spaced "
                   "from 1 to L-3, one per draft layer)")
    f.add_argument("--init-from", help="start from this drafter's weights (published format directory) instead of "
                   "a random init; --block-size may differ from its own, and --layers / --taps may add layers and "
                   "taps: it grows without changing what it computes (ddtree/train/grow.py)")
    f.add_argument("--layers-from-target", type=_tap_list, metavar="I,J,...", help="start draft layer k as a copy "
                   "of target layer I_k (one per draft layer; default: a random init)")
    f.add_argument("--mask-token-id", type=int, help="default: the tokenizer's mask token, else an unused special "
                   "token (SmolLM2: 16 <empty_output>)")
    f.add_argument("--lr", type=float, help="peak AdamW learning rate (default 6e-4)")
    f.add_argument("--weight-decay", type=float, help="(default 0.01; not on norms)")
    f.add_argument("--warmup", type=float, help="warmup fraction of all steps (default 0.04)")
    f.add_argument("--min-lr-ratio", type=float, help="cosine decays to lr * this (default 0)")
    f.add_argument("--grad-clip", type=float, help="(default 1.0)")
    f.add_argument("--epochs", type=int, help="(default 6)")
    f.add_argument("--total-steps", type=cli_int(1), help="the schedule's length in optimizer steps, in place of "
                   "--epochs: a run sized by the compute at hand (warmup and cosine decay over these steps; a "
                   "partial epoch reads a random subset of the data)")
    f.add_argument("--seqs-per-step", type=int, help="sequences per process per optimizer step (default 4)")
    f.add_argument("--pack-tokens", type=cli_int(0), help="a step's sequences share passes of up to this many "
                   "tokens (default: 8192 on CUDA, where a pass per sequence is launch-bound; 0 on CPU: one each)")
    f.add_argument("--anchors", type=int, help="anchors per sequence, re-drawn each epoch (default 64)")
    f.add_argument("--include-prompt-anchors", action="store_true", default=None,
                   help="also anchor blocks inside the prompt (default: response only, as in decoding)")
    f.add_argument("--max-seq-len", type=int, help="sequences are cut to this many tokens (default 1024)")
    f.add_argument("--gamma", type=float, help="loss decay (default: 7 for block 16, 5 for 10, 4 for 8)")
    f.add_argument("--distill", type=float, help="weight of the target's own next-token distribution in the loss, "
                   "0..1 (default 0: hard labels only; 1: pure distillation)")
    f.add_argument("--distill-topk", type=int, help="the teacher distribution is the target's top-k (default 32)")
    f.add_argument("--objective", choices=OBJECTIVES, help="the loss: ce (cross-entropy; default), tv (total "
                   "variation to the same target mix: speculative sampling's rejection probability) or ce+tv")
    f.add_argument("--markov-weight", type=float, help="train the drafter's Markov head with it: this weight on the "
                   "head's NLL at block positions 2.. (default 0: a head stays as it is; needs a head: --init-from "
                   "a drafter with one, or --markov-rank)")
    f.add_argument("--markov-lr", type=float, help="the head's peak learning rate with --markov-weight (default: --lr)")
    f.add_argument("--markov-rank", type=cli_int(1), help="give the drafter a fresh Markov head of this rank "
                   "(the identity at first) for --markov-weight to train")
    f.add_argument("--draft-vocab", type=int, help="a reduced draft vocabulary: the N most frequent response tokens "
                   "of the training data (own head from the target's rows, d2t; default: the full vocabulary)")
    f.add_argument("--seed", type=int, help="drafter init, data order and anchors (default 0)")
    f.add_argument("--bf16", action="store_true", default=None, help="bf16 autocast (GPUs, CPUs with AMX)")
    f.add_argument("--max-minutes", type=float, help="stop cleanly (checkpoint) after this long (default 110)")
    f.add_argument("--max-steps", type=int, help="stop (checkpoint) at this global step")
    f.add_argument("--checkpoint-every", type=int, help="steps (default 100)")
    f.add_argument("--eval-every", type=int, help="steps between evaluations (default 0: at the end only)")
    f.add_argument("--eval-prompts", type=int, help="held-out prompts decoded for tau (default 4)")
    f.add_argument("--eval-max-new-tokens", type=int, help="(default 96)")
    f.add_argument("--eval-ddtree-budget", type=int, help="also measure ddtree tau at this budget (0 = off)")
    f.add_argument("--val-sequences", type=int, help="held-out sequences for the validation loss (default 16)")
    f.add_argument("--feature-cache", help="directory caching the target's tap features across epochs")
    f.add_argument("--no-progress", action="store_true")

    x = sub.add_parser("export-prompts", help="the training prompts as token ids (JSONL for --prompts-file)")
    x.add_argument("--target", help="HF model directory or .gguf whose tokenizer and chat template apply "
                   "(default: embedded SmolLM2-135M-Instruct)")
    x.add_argument("--out", required=True, help="JSONL file to write")
    x.add_argument("--num-prompts", type=cli_int(1), default=10000)
    x.add_argument("--mix", help="source weights as for generate-data (default: the scale mix)")
    x.add_argument("--follow-ups", type=float, default=0.35, help="fraction of prompts with a second user turn")
    x.add_argument("--seed", type=int, default=0)
    x.add_argument("--exclude", action="append", default=[], metavar="DATA_DIR",
                   help="leave out prompts already answered in this generate-data directory (repeatable)")

    e = sub.add_parser("export", help="write a run's drafter in the published format")
    e.add_argument("--run", required=True, help="run directory or checkpoint.pt")
    e.add_argument("--out", required=True, help="drafter directory (config.json + model.safetensors)")
    e.add_argument("--dtype", default="bfloat16", help="weights' dtype on disk (default: %(default)s, as published "
                   "drafters ship; loading casts to the engine's dtype)")
    e.add_argument("--data", nargs="+", metavar="DIR",
                   help="the run's generate-data directories: the model card (README.md) then lists them")
    e.add_argument("--name", help="title of the model card (default: the --out directory's name)")
    e.add_argument("--force", action="store_true", help="replace what --out holds (e.g. an earlier export)")
    q = sub.add_parser("quantize", help="a drafter rounded to 8-bit blocks with power-of-two scales (exact in bf16): "
                       "its CPU passes read half the bytes")
    q.add_argument("--draft", required=True, help="drafter directory (published format)")
    q.add_argument("--out", required=True, help="directory for the rounded drafter")
    q.add_argument("--force", action="store_true", help="replace what --out holds")
    head = q.add_mutually_exclusive_group()
    head.add_argument("--drop-markov", action="store_true", help="leave out the drafter's Markov head (markov-fit)")
    head.add_argument("--markov-from", metavar="DIR", help="carry this drafter's Markov head instead (the same draft "
                      "vocabulary: e.g. a head fitted on the drafter a fine-tune started from)")
    v = sub.add_parser("prune-vocab", help="a drafter over the most frequent tokens of its draft vocabulary: a "
                       "smaller head, the same drafts wherever those tokens carry them")
    _target_args(v)
    v.add_argument("--draft", required=True, help="drafter directory (published format, a reduced draft vocabulary)")
    v.add_argument("--data", required=True, nargs="+", metavar="DIR",
                   help="generate-data directories: their training answers' token counts pick the kept tokens")
    v.add_argument("--size", required=True, type=cli_int(1), help="draft tokens to keep")
    v.add_argument("--out", required=True, help="directory for the pruned drafter")
    v.add_argument("--force", action="store_true", help="replace what --out holds")
    n = sub.add_parser("ngram-table", help="the target's own 3-gram continuations from the training answers: what "
                       "ddtree:N+lookup falls back on where the context has no match")
    _target_args(n)
    n.add_argument("--data", required=True, nargs="+", metavar="DIR", help="generate-data directories (their "
                   "training answers; never the evaluation sets)")
    n.add_argument("--min-count", type=cli_int(1), default=NGRAM_MIN_COUNT,
                   help="occurrences a kept 3-gram needs (default: %(default)s)")
    n.add_argument("--min-share", type=float, default=NGRAM_MIN_SHARE,
                   help="the share of them its most frequent next token needs (default: %(default)s)")
    n.add_argument("--out", required=True, help="the table's file, e.g. a drafter's folder/ngrams.npz")
    n.add_argument("--force", action="store_true", help="replace --out")
    p = sub.add_parser("probe", help="a drafter's top-1 and tree acceptance at every position of greedy answers")
    _target_args(p)
    p.add_argument("--draft", help="drafter directory (default: the shipped one)")
    p.add_argument("--data", nargs="+", metavar="DIR", help="generate-data directories: their greedy answers")
    p.add_argument("--split", default="heldout", choices=("heldout", "train", "all"))
    p.add_argument("--max-sequences", type=cli_int(1), default=400, help="per data directory (default: %(default)s)")
    p.add_argument("--eval-sets", help="also the target's own greedy answers to these evaluation prompts "
                   "(e.g. humaneval,mt-bench,gsm): measured on, never trained on")
    p.add_argument("--num-prompts", type=cli_int(1), default=8, help="per evaluation set (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=cli_int(1), default=96, help="per evaluation answer")
    p.add_argument("--budgets", default="1,2,4,8,32", help="tree budgets (default: %(default)s)")
    p.add_argument("--top-k", type=cli_int(1), default=32, help="ranks kept per depth (>= the largest budget)")
    p.add_argument("--markov-head", action="store_true", help="with the drafter's Markov head (its conditional trees)")
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--no-progress", action="store_true")
    t = sub.add_parser("markov-tables", help="a drafter's top candidates at every root of the answers, for "
                       "markov-fit (resumable chunks)")
    _target_args(t)
    t.add_argument("--draft", help="drafter directory (default: the shipped one)")
    t.add_argument("--data", nargs="+", metavar="DIR", help="generate-data directories")
    t.add_argument("--split", default="train", choices=("heldout", "train", "all"))
    t.add_argument("--greedy-only", action="store_true", help="only the greedy answers (the probe's; for held-out)")
    t.add_argument("--max-sequences", type=cli_int(1), default=100000, help="per data directory")
    t.add_argument("--eval-sets", help="also the target's own greedy answers to these evaluation prompts "
                   "(measured on, never trained on: for held-out tables only)")
    t.add_argument("--num-prompts", type=cli_int(1), default=8, help="per evaluation set (default: %(default)s)")
    t.add_argument("--max-new-tokens", type=cli_int(1), default=96, help="per evaluation answer")
    t.add_argument("--candidates", type=cli_int(1), default=32, help="top candidates kept per block position")
    t.add_argument("--chunk", type=cli_int(1), default=100, help="answers per written chunk")
    t.add_argument("--out", required=True, help="table directory (resumes: finished chunks are skipped)")
    t.add_argument("--no-progress", action="store_true")
    f = sub.add_parser("markov-fit", help="fit a Markov head (parent-conditioned trees) on a frozen drafter")
    _target_args(f)
    f.add_argument("--draft", help="the frozen drafter (default: the shipped one)")
    f.add_argument("--tables", nargs="+", required=True, help="markov-tables directories to fit on")
    f.add_argument("--heldout", nargs="+", help="markov-tables directories to report NLL and tree tau on")
    f.add_argument("--rank", type=cli_int(1), default=64)
    f.add_argument("--epochs", type=float, default=2.0)
    f.add_argument("--batch", type=cli_int(1), default=4096)
    f.add_argument("--lr", type=float, default=3e-3)
    f.add_argument("--weight-decay", type=float, default=0.0)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--budgets", default="1,2,4,8,16,32", help="tree budgets for the held-out tau")
    f.add_argument("--out", required=True, help="directory for the drafter with its head")
    f.add_argument("--force", action="store_true", help="replace what --out holds")
    f.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    try:
        return {"generate-data": cmd_generate_data, "fit": cmd_fit, "export": cmd_export, "quantize": cmd_quantize,
                "prune-vocab": cmd_prune_vocab, "export-prompts": cmd_export_prompts, "probe": cmd_probe,
                "markov-tables": cmd_markov_tables, "markov-fit": cmd_markov_fit,
                "ngram-table": cmd_ngram_table}[args.command](args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

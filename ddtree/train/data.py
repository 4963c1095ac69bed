"""Training data: the TARGET's own answers to the training prompts, as resumable token-id shards.

Layout of a data directory:
    meta.json            what was generated (target, prompt set, decoding settings); checked on resume
    shard_00000.jsonl    one record per prompt: {"key", "source", "split", "prompt_ids", "response_ids"}
    ...
A shard is written to a temporary name and renamed when complete, so a restart skips finished shards and
redoes at most one. The response ends with the stop token when the target produced one (the drafter must
learn to predict it too).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..hf_baseline import to_hf_model
from .prompts import Prompt

SHARD_GLOB = "shard_*.jsonl"


def encode_prompt(prompt: Prompt, tokenizer) -> list[int]:
    if prompt.ids is not None:
        return list(prompt.ids)
    if tokenizer is None:
        raise ValueError(f"prompt {prompt.key} is text but the target has no tokenizer")
    ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


@dataclass
class GenerationSettings:
    max_new_tokens: int = 256
    batch_size: int = 8
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    shard_size: int = 128
    max_prompt_tokens: int = 512


class BatchedGenerator:
    """Left-padded batched `generate()` on the HF twin of the target; returns each response, cut after the
    first stop token."""

    def __init__(self, target, stop_ids, pad_id: int | None = None):
        self.model = to_hf_model(target)
        self.device = target.device
        self.stop_ids = list(stop_ids)
        self.pad_id = pad_id if pad_id is not None else (self.stop_ids[0] if self.stop_ids else 0)

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], settings: GenerationSettings) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sample = settings.temperature > 0
        kwargs = dict(do_sample=True, temperature=settings.temperature, top_p=settings.top_p) if sample else \
            dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=settings.max_new_tokens, pad_token_id=self.pad_id,
                                  eos_token_id=self.stop_ids or None, min_new_tokens=1, **kwargs)
        responses = []
        for row in out[:, width:].tolist():
            for j, tok in enumerate(row):
                if tok in self.stop_ids:
                    row = row[: j + 1]
                    break
            responses.append(row)
        return responses


def _check_meta(out_dir: Path, meta: dict) -> None:
    path = out_dir / "meta.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old != meta:
            diff = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
            raise ValueError(f"{out_dir} already holds data generated with different settings ({', '.join(diff)}); "
                             "use another --out directory or the original settings")
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, indent=2) + "\n")


def generate_data(target, tokenizer, prompts: list[Prompt], out_dir, settings: GenerationSettings, stop_ids=(),
                  heldout_fraction: float = 0.02, meta: dict | None = None, progress: bool = True,
                  max_minutes: float | None = None) -> dict:
    """Write the target's answers to `prompts` as shards in out_dir; skip shards already there; stop after
    the shard that crosses max_minutes (run again to continue). Returns counts: {"shards", "written",
    "skipped", "remaining", "tokens", "seconds"}."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    keys = [p.key for p in prompts]
    _check_meta(out_dir, {**(meta or {}), "num_prompts": len(prompts), "shard_size": settings.shard_size,
                          "max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
                          "top_p": settings.top_p, "seed": settings.seed, "heldout_fraction": heldout_fraction,
                          "max_prompt_tokens": settings.max_prompt_tokens,
                          "prompt_keys_sha1": _sha1("\n".join(keys))})
    shards = [prompts[i:i + settings.shard_size] for i in range(0, len(prompts), settings.shard_size)]
    todo = [i for i in range(len(shards)) if not (out_dir / f"shard_{i:05d}.jsonl").is_file()]
    stats = {"shards": len(shards), "written": 0, "skipped": len(shards) - len(todo), "remaining": len(todo),
             "tokens": 0, "seconds": 0.0}
    if not todo:
        return stats
    generator = BatchedGenerator(target, stop_ids)
    bar = tqdm(total=sum(len(shards[i]) for i in todo), unit="prompt", desc="generate-data", disable=not progress)
    t0 = time.perf_counter()
    for i in todo:
        if max_minutes is not None and time.perf_counter() - t0 >= 60 * max_minutes:
            break
        torch.manual_seed(settings.seed * 100003 + i)  # sampling is reproducible per shard
        items = [(p, encode_prompt(p, tokenizer)) for p in shards[i]]
        items = [(p, ids) for p, ids in items if len(ids) <= settings.max_prompt_tokens]
        bar.update(len(shards[i]) - len(items))
        items.sort(key=lambda x: len(x[1]))  # similar lengths in a batch: less padding
        records = []
        for b in range(0, len(items), settings.batch_size):
            batch = items[b:b + settings.batch_size]
            responses = generator([ids for _, ids in batch], settings)
            for (p, ids), resp in zip(batch, responses):
                records.append({"key": p.key, "source": p.source, "split": p.split(heldout_fraction),
                                "prompt_ids": ids, "response_ids": resp})
                stats["tokens"] += len(resp)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{stats['tokens'] / (time.perf_counter() - t0):.1f}")
        tmp = out_dir / f".shard_{i:05d}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, out_dir / f"shard_{i:05d}.jsonl")
        stats["written"] += 1
        stats["remaining"] -= 1
    bar.close()
    stats["seconds"] = time.perf_counter() - t0
    return stats


def _sha1(text: str) -> str:
    import hashlib

    return hashlib.sha1(text.encode()).hexdigest()


@dataclass
class Sequence:
    tokens: list[int]  # prompt + response
    prompt_len: int
    key: str
    source: str


def read_sequences(data_dir, split: str | None = "train", min_response: int = 2) -> list[Sequence]:
    """All records of a data directory (one split, or all with split=None), in shard order."""
    data_dir = Path(data_dir)
    files = sorted(data_dir.glob(SHARD_GLOB))
    if not files:
        raise FileNotFoundError(f"{data_dir} holds no {SHARD_GLOB} shards: run `python -m ddtree train generate-data`")
    out = []
    for path in files:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if (split is None or r["split"] == split) and len(r["response_ids"]) >= min_response:
                out.append(Sequence(r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"]), r["key"], r["source"]))
    return out

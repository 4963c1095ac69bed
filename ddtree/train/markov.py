"""Training a Markov head (ddtree/models/markov.py) on a FROZEN drafter, from cached draft tables.

The head only reads each block position's top-M candidates (log-probs, draft ids), the parent token and the
true token, so one drafter pass per answer (`probe.block_drafts`: one target pass + one whole-block training
forward at every root) gives all it ever needs, and fitting touches [rows, M] numbers, never the vocabulary:

    python -m ddtree train markov-tables --data data/smollm2-v4 --out runs/markov-tables   # resumable chunks
    python -m ddtree train markov-fit --tables runs/markov-tables --out runs/drafter-markov

A table row is one root a of one answer: per depth d = 1..B-1 the drafter's top-M candidates at block position
d, the true token a+d (a draft id, -1 past the end or outside the draft vocabulary), its log-prob, and its
parent token a+d-1 (a target id; the root itself for d = 1). Teacher-forced: a node is accepted only when its
parent was, so the true previous token is the only parent whose conditional matters.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from ..base.config import ConfigError
from ..models.markov import MarkovHead, conditional_logprobs, row_log_likelihood
from .probe import anchor_tables, block_drafts

TABLE_GLOB = "tables_*.npz"
TABLE_KEYS = ("cand_lp", "cand_ids", "labels", "label_lp", "parents", "group")
ROW_KEYS = ("cand_lp", "cand_ids", "label_idx", "label_lp", "parents", "depths")  # flat_rows' = row_log_likelihood's


def collect_tables(target, drafter, sequences, out_dir, m: int = 32, chunk: int = 100, progress=None) -> int:
    """sequences: (tokens, prompt_len, group) triples. Writes tables_XXXXX.npz of `chunk` answers each; a chunk
    already written is skipped (resume by running again). Returns the number of chunks written now."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"candidates": m, "chunk": chunk}  # not the answer count: a longer list of the same answers extends it
    meta_path = out / "meta.json"
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        raise ConfigError(f"{out} holds tables made with other settings ({meta_path.read_text().strip()}); "
                          "use another --out or the same settings")
    meta_path.write_text(json.dumps(meta) + "\n")
    written = 0
    for start in range(0, len(sequences), chunk):
        path = out / f"tables_{start // chunk:05d}.npz"
        if path.exists():
            if progress is not None:
                progress(min(chunk, len(sequences) - start))
            continue
        parts = []
        for tokens, prompt_len, group in sequences[start:start + chunk]:
            rows = anchor_tables(block_drafts(target, drafter, tokens, prompt_len), tokens, m)
            rows["group"] = np.array([group] * len(rows["labels"]))
            parts.append(rows)
            if progress is not None:
                progress(1)
        merged = {k: np.concatenate([p[k] for p in parts]) for k in TABLE_KEYS}
        tmp = path.with_name(f".{path.name}.part")  # outside TABLE_GLOB until complete
        with open(tmp, "wb") as f:
            np.savez(f, **merged)
        tmp.rename(path)
        written += 1
    return written


def read_tables(dirs) -> dict[str, np.ndarray]:
    """Every chunk of one or several table directories, concatenated."""
    paths = [p for d in ([dirs] if isinstance(dirs, (str, Path)) else dirs) for p in sorted(Path(d).glob(TABLE_GLOB))]
    if not paths:
        raise FileNotFoundError(f"no {TABLE_GLOB} in {dirs}: run `python -m ddtree train markov-tables` first")
    parts = []
    for p in paths:
        with np.load(p) as z:
            parts.append({k: z[k] for k in TABLE_KEYS})
    return {k: np.concatenate([p[k] for p in parts]) for k in TABLE_KEYS}


def _label_index(cand_ids: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """[..., M], [...] -> [...] the label's index among the candidates, -1 when it is not one."""
    hit = (cand_ids == labels[..., None]) & (labels[..., None] >= 0)
    return np.where(hit.any(-1), hit.argmax(-1), -1)


def flat_rows(tables: dict[str, np.ndarray], first: bool = False) -> dict[str, torch.Tensor]:
    """The (root, depth) rows with a true token in the draft vocabulary, flattened to tensors; depth 0 (block
    position 1, where the head adds nothing) only with first=True (the held-out likelihood of the whole block)."""
    a, d = tables["labels"].shape
    depths = np.broadcast_to(np.arange(d), (a, d)).reshape(-1)
    keep = (tables["labels"] >= 0).reshape(-1) & ((depths > 0) | first)
    m = tables["cand_ids"].shape[-1]
    return {"cand_lp": torch.from_numpy(tables["cand_lp"].reshape(-1, m)[keep].astype(np.float32)),
            "cand_ids": torch.from_numpy(tables["cand_ids"].reshape(-1, m)[keep].astype(np.int64)),
            "label_idx": torch.from_numpy(_label_index(tables["cand_ids"], tables["labels"]).reshape(-1)[keep]),
            "label_lp": torch.from_numpy(tables["label_lp"].reshape(-1)[keep].astype(np.float32)),
            "parents": torch.from_numpy(tables["parents"].reshape(-1)[keep].astype(np.int64)),
            "depths": torch.from_numpy(depths[keep].copy())}


def fit_head(head: MarkovHead, embed: torch.Tensor, rows: dict[str, torch.Tensor], epochs: float = 2.0,
             batch: int = 4096, lr: float = 3e-3, weight_decay: float = 0.0, seed: int = 0, progress=None,
             log=None) -> MarkovHead:
    """Adam on the mean negative log-likelihood of the true tokens under the head's conditionals (cosine decay
    to 0 over the run). embed: the target's input embedding [V, H] (frozen). log(step, loss) every 50 steps."""
    n = rows["label_idx"].numel()
    steps = max(1, math.ceil(epochs * n / batch))
    opt = torch.optim.Adam(head.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    order, pos, running = torch.randperm(n, generator=gen), 0, []
    head.train()
    for step in range(steps):
        if pos + batch > n:
            order, pos = torch.randperm(n, generator=gen), 0
        idx = order[pos:pos + batch].to(rows["label_idx"].device)
        pos += batch
        loss = -row_log_likelihood(head, embed, *(rows[k][idx] for k in ROW_KEYS)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        running.append(loss.item())
        if log is not None and (step + 1) % 50 == 0:
            log(step + 1, sum(running) / len(running))
            running = []
        if progress is not None:
            progress(1)
    return head.eval()


@torch.no_grad()
def heldout_nll(head: MarkovHead | None, embed: torch.Tensor, rows: dict[str, torch.Tensor]) -> float:
    """Mean negative log-likelihood of the true tokens (the drafter alone when head is None)."""
    if head is None:
        return float(-torch.where(rows["label_idx"] >= 0, rows["cand_lp"].gather(
            1, rows["label_idx"].clamp(min=0)[:, None])[:, 0], rows["label_lp"]).mean())
    total = 0.0
    for s in range(0, rows["label_idx"].numel(), 65536):
        part = {k: v[s:s + 65536] for k, v in rows.items()}
        total -= float(row_log_likelihood(head, embed, *(part[k] for k in ROW_KEYS)).sum())
    return total / rows["label_idx"].numel()


@torch.no_grad()
def depth_top1(head: MarkovHead, embed: torch.Tensor, rows: dict[str, torch.Tensor]) -> list[tuple[int, float, float]]:
    """Teacher-forced top-1 per block position: (position, the drafter's marginal, the head's conditional)."""
    cond, _ = conditional_logprobs(head, rows["cand_lp"], rows["cand_ids"], head.code(embed)[rows["parents"]][:, None],
                                   rows["depths"])
    best = cond[:, 0].argmax(-1)
    out = []
    for d in sorted(set(rows["depths"].tolist())):
        k = rows["depths"] == d
        out.append((d + 1, float((rows["label_idx"][k] == 0).float().mean()),
                    float((best[k] == rows["label_idx"][k]).float().mean())))
    return out

"""Issue 51, item 2, before building it: how much tree acceptance would a path-conditioned draft buy?

A DFlash block pass drafts depth d without knowing which token stood at depth d-1, so after a sibling (a parent
ranked 2nd-4th) the true token is top-1 about half as often as after the spine (the probe's path table). This study
trains a small refiner on the frozen shipped drafter's block hidden states, teacher-forced on the target's own
greedy answers, and measures tree tau with and without it on held-out answers and the evaluation sets' answers:

    refined h_d = h_d + W2 gelu(W1 [h_d ; h_(d-1) ; E(parent) ; E(grandparent)])   (W2 starts at zero)

h are the drafter's final-normed block hidden states, E the target's (frozen) embedding, the logits h @ head^T over
the draft vocabulary. Trees are built best-first; with the refiner each popped node's children come from its own
refined distribution (the refiner run once per node: the upper bound of what a batched, tree-attention refiner
could give with the same model). Without it, every node at depth d takes the marginal's top-k (the engine's tree).
The figures say whether the refiner is worth building into the engine, and at what draft cost it would pay.

    python scripts/path_refiner_study.py --train-answers 600 --epochs 3 --out runs/refiner-study
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.api import load
from ddtree.bench.datasets import load_prompts
from ddtree.models.protocol import reference
from ddtree.train.data import read_sequences
from ddtree.train.model import block_inputs, draft_head, drafter_block_hidden, target_features, target_to_draft
from ddtree.train.probe import head_accepted_lengths

DATA = [f"data/smollm2-v{i}" for i in range(2, 7)]


class Refiner(nn.Module):
    def __init__(self, hidden: int, width: int = 512):
        super().__init__()
        self.up = nn.Linear(4 * hidden, width)
        self.down = nn.Linear(width, hidden)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, h, h_prev, e_parent, e_grand):  # each [N, H] -> refined [N, H]
        return h + self.down(F.gelu(self.up(torch.cat([h, h_prev, e_parent, e_grand], -1))))


@torch.inference_mode()
def block_states(pair, tokens, prompt_len, anchors_per_answer=None, rng=None):
    """(hidden [A, B, H] fp32, labels [A, B-1] target ids (-1 past the end), roots [A]) of one answer."""
    target, drafter = pair.target, reference(pair.drafter)
    cfg = pair.drafter.cfg
    ids = torch.tensor(tokens)
    feats = target_features(target, ids, cfg.target_layer_ids).to(drafter.fc.weight.dtype)
    anchors = torch.arange(max(1, prompt_len), ids.numel() - 1)
    if anchors_per_answer is not None and anchors.numel() > anchors_per_answer:
        anchors = anchors[torch.tensor(sorted(rng.sample(range(anchors.numel()), anchors_per_answer)))]
    block, positions, labels = block_inputs(ids, anchors, cfg.block_size, cfg.mask_token_id)
    hidden = drafter_block_hidden(drafter, feats, block, positions, anchors, reference(target).model.embed_tokens)
    return hidden.float(), labels.clamp(min=-1), ids[anchors]


def examples(hidden, labels, roots, t2d):
    """Teacher-forced rows for depths 2..B-1: (h_d, h_(d-1), parent id, grandparent id, draft label)."""
    a, b, _ = hidden.shape
    rows = []
    for d in range(2, b):  # block position d (1 = the first drafted token, whose parent is the root)
        parent = labels[:, d - 2]
        grand = labels[:, d - 3] if d >= 3 else roots
        lab = labels[:, d - 1]
        ok = (parent >= 0) & (grand >= 0) & (lab >= 0)
        dl = t2d[lab.clamp(min=0)]
        ok &= dl >= 0
        rows.append((hidden[ok, d], hidden[ok, d - 1], parent[ok], grand[ok], dl[ok]))
    return [torch.cat(x) for x in zip(*rows)]


def tree_accepts(hidden, labels, root, head, embed, t2d, target_of, budgets, refiner=None, k=8):
    """Best-first tree of max(budgets) nodes for one root; returns the accepted draft tokens per budget.
    t2d: target id -> draft id (-1 outside); target_of: draft id -> target id (the drafter's to_target_ids)."""
    b = hidden.shape[0]

    def children(depth, token, parent_token):  # depth of the children (1..B-1) -> (log-probs [k], draft ids [k])
        h = hidden[depth]
        if refiner is not None and depth >= 2:
            h = refiner(h[None], hidden[depth - 1][None], embed[token][None], embed[parent_token][None])[0]
        lp = (h @ head.T).log_softmax(-1)
        top = lp.topk(k)
        return top.values.tolist(), top.indices.tolist()

    heap, order, n = [], [], 0  # entries (-path log-prob, n, depth, draft id, path of draft ids)
    vals, idx = children(1, int(root), -1)
    for v, i in zip(vals, idx):
        heapq.heappush(heap, (-v, n, 1, i, (i,)))
        n += 1
    while heap and len(order) < max(budgets):
        neg, _, depth, i, path = heapq.heappop(heap)
        order.append(path)
        if depth + 1 < b:
            tok = int(target_of[i])
            par = int(target_of[path[-2]]) if len(path) >= 2 else int(root)
            vals, idx = children(depth + 1, tok, par)
            for v, j in zip(vals, idx):
                heapq.heappush(heap, (neg - v, n, depth + 1, j, path + (j,)))
                n += 1
    true = [int(t2d[t]) if t >= 0 else -2 for t in labels.tolist()]
    index = {p: pos for pos, p in enumerate(order)}
    accepted_at = []  # pop positions of the true path's nodes
    for d in range(1, b):
        p = tuple(true[:d])
        if p not in index:
            break
        accepted_at.append(index[p])
    return [sum(pos < bud for pos in accepted_at) for bud in budgets]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-answers", type=int, default=600)
    ap.add_argument("--anchors", type=int, default=48, help="roots per training answer")
    ap.add_argument("--eval-answers", type=int, default=12, help="held-out answers per data directory")
    ap.add_argument("--eval-prompts", type=int, default=8, help="per evaluation set")
    ap.add_argument("--eval-roots", type=int, default=600, help="roots per group, at most")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--budgets", default="2,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/refiner-study")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the refiner already in --out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budgets = [int(x) for x in args.budgets.split(",")]
    pair = load(None, None, "cpu", "float32", markov_head=True)  # the head only for the comparison's trees
    head = draft_head(pair.drafter, pair.target).float()
    embed = reference(pair.target).model.embed_tokens.weight.float()
    t2d = target_to_draft(reference(pair.drafter))
    target_of = reference(pair.drafter).to_target_ids(torch.arange(head.shape[0]))  # draft id -> target id
    t0 = time.time()

    refiner = Refiner(head.shape[1], args.width)
    if args.eval_only:
        refiner.load_state_dict(torch.load(out / "refiner.pt"))
    else:
        train_refiner(refiner, training_rows(pair, t2d, args, out, rng, t0), head, embed, args.epochs, t0)
        torch.save(refiner.state_dict(), out / "refiner.pt")
    evaluate(pair, refiner, head, embed, t2d, target_of, budgets, args, out, t0)
    return 0


def training_rows(pair, t2d, args, out, rng, t0):
    """The teacher-forced rows of --train-answers greedy training answers (cached in --out)."""
    cache = out / "train.pt"
    if cache.is_file():
        return torch.load(cache)
    seqs = [q for d in DATA for q in read_sequences(d, "train") if q.temperature == 0.0]
    rng.shuffle(seqs)
    parts = []
    for i, q in enumerate(seqs[:args.train_answers]):
        parts.append(examples(*block_states(pair, q.tokens, q.prompt_len, args.anchors, rng), t2d))
        if i % 50 == 0:
            print(f"[{time.time() - t0:.0f}s] features of {i} answers", flush=True)
    train = [torch.cat(x) for x in zip(*parts)]
    train[0], train[1] = train[0].half(), train[1].half()
    torch.save(train, cache)
    return train


def train_refiner(refiner, train, head, embed, epochs, t0):
    n = train[0].shape[0]
    print(f"[{time.time() - t0:.0f}s] {n} training rows", flush=True)
    opt = torch.optim.AdamW(refiner.parameters(), lr=1e-3, weight_decay=0.01)
    steps = epochs * math.ceil(n / 512)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 1e-3, total_steps=steps, pct_start=0.05)
    step = 0
    for epoch in range(epochs):
        perm = torch.randperm(n)
        total = hits = base_hits = 0.0
        for s in range(0, n, 512):
            j = perm[s:s + 512]
            h, hp = train[0][j].float(), train[1][j].float()
            refined = refiner(h, hp, embed[train[2][j]], embed[train[3][j]])
            logits = refined @ head.T
            loss = F.cross_entropy(logits, train[4][j])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            total += loss.item() * j.numel()
            hits += (logits.argmax(-1) == train[4][j]).sum().item()
            with torch.no_grad():
                base_hits += ((h @ head.T).argmax(-1) == train[4][j]).sum().item()
        print(f"[{time.time() - t0:.0f}s] epoch {epoch + 1}: loss {total / n:.3f}, top-1 {hits / n:.1%} "
              f"(marginal {base_hits / n:.1%})", flush=True)


def evaluate(pair, refiner, head, embed, t2d, target_of, budgets, args, out, t0):
    """tau per budget on the same roots: marginal trees, the Markov head's trees (the engine's), refined trees."""
    drafter = pair.drafter
    groups: dict[str, list] = {}
    for d in DATA:
        held = [q for q in read_sequences(d, "heldout") if q.temperature == 0.0]
        random.Random(0).shuffle(held)
        for q in held[:args.eval_answers]:
            groups.setdefault("held-out", []).append((q.tokens, q.prompt_len))
    for name in ("humaneval", "mt-bench", "gsm"):
        for text in load_prompts(name, args.eval_prompts):
            res = pair.generate(text, method="ar", max_new_tokens=128)
            groups.setdefault(name, []).append((res.prompt_ids + res.token_ids, len(res.prompt_ids)))
    result = {}
    refiner.eval()
    with torch.inference_mode():
        for name, answers in groups.items():
            roots = []
            for tokens, plen in answers:
                hidden, labels, rts = block_states(pair, tokens, plen)
                roots += [(hidden[a], labels[a], rts[a]) for a in range(hidden.shape[0])]
            random.Random(1).shuffle(roots)
            roots = roots[:args.eval_roots]
            sums = {"marginal": [0] * len(budgets), "head": [0] * len(budgets), "refined": [0] * len(budgets)}
            for hidden, labels, root in roots:
                for kind, r in (("marginal", None), ("refined", refiner)):
                    acc = tree_accepts(hidden, labels, root, head, embed, t2d, target_of, budgets, r)
                    sums[kind] = [x + y for x, y in zip(sums[kind], acc)]
                logprobs = (hidden[1:] @ head.T).log_softmax(-1)  # [B-1, draft vocab]
                true = torch.where(labels >= 0, t2d[labels.clamp(min=0)], -1).numpy()
                acc = head_accepted_lengths(drafter, logprobs, int(root), true, budgets)
                sums["head"] = [x + y for x, y in zip(sums["head"], acc)]
            result[name] = {kind: {b: 1 + v / len(roots) for b, v in zip(budgets, vals)} for kind, vals in sums.items()}
            result[name]["roots"] = len(roots)
            r = result[name]
            print(f"[{time.time() - t0:.0f}s] {name} ({len(roots)} roots), marginal / head / refined: " + ", ".join(
                f"@{b} {r['marginal'][b]:.3f} / {r['head'][b]:.3f} / {r['refined'][b]:.3f}" for b in budgets),
                flush=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())

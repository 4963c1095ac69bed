"""End-to-end verify-pass timing on a GPU: a Qwen3-8B-shaped target with seeded random weights (bf16, CUDA),
`ar` vs `dflash` vs `ddtree` (budgets 16..256) under each attention backend (sdpa, triton), with the
losslessness verdict of every run against `ar`.

The drafter is a real 5-layer DFlash module (its forward runs, so the draft cost is real), but its output
logits are replaced by a confident oracle that ranks the target's own greedy continuation first with
p=0.8 (else 2nd or 3rd): random weights alone would accept nothing, and the point here is the cost of
verify passes that accept realistic paths. Speedups are therefore upper-bound-ish; per-stage ms/step are
the figures to read.

    python scripts/bench_verify.py 1024 4096          # context lengths; JSON to $OUT (default .)
    SMOKE=1 python scripts/bench_verify.py 64         # tiny CPU model, SDPA only: checks the script runs
"""
import json
import os
import sys
import time
import types

import torch

from ddtree.api import Pair
from ddtree.config import ModelConfig
from ddtree.drafter import untrained_drafter
from ddtree.target import TargetModel
from ddtree.testing import QWEN3_8B

from ddtree.testing import TINY
SMOKE = os.environ.get("SMOKE") == "1"
dev = torch.device("cpu" if SMOKE else "cuda")
cfg = ModelConfig(**({**TINY, "arch": "qwen3"} if SMOKE else QWEN3_8B), tie_word_embeddings=False)
t0 = time.time()
with torch.device(dev):
    target = TargetModel(cfg).to(torch.float32 if SMOKE else torch.bfloat16).eval()
gen = torch.Generator(device=dev).manual_seed(0)
with torch.no_grad():
    for name, p in target.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.05 if "lm_head" in name else 0.02, generator=gen)
drafter = untrained_drafter(target, num_layers=2 if SMOKE else 5, block_size=16, seed=1)
print(f"built target+drafter in {time.time() - t0:.1f}s", flush=True)
pair = Pair(target, drafter, None, ())
real_draft = drafter.draft
REF: list[int] = []
dgen = torch.Generator(device=dev).manual_seed(5)


def oracle_draft(self, cache, bonus, length=None, top1=0.8):
    """A confident drafter that is right with p=top1 (else the right token is 2nd or 3rd)."""
    logits = real_draft(cache, bonus, length)  # [L-1, V]: the real drafter's cost
    L, V = logits.shape
    pos = cache.length + torch.arange(1, L + 1, device=dev)
    ok = pos < len(REF)
    ref = torch.as_tensor(REF, device=dev)[pos.clamp(max=len(REF) - 1)]
    new = torch.randn(L, V, generator=dgen, device=dev)
    r = torch.rand(L, generator=dgen, device=dev)
    rank = torch.where(r < top1, 0, torch.where(r < (1 + top1) / 2, 1, 2))
    rows = torch.arange(L, device=dev)
    decoys = torch.randint(0, V, (L, 2), generator=dgen, device=dev)
    new[rows, decoys[:, 0]] = torch.where(rank >= 1, 14.0, 0.0)
    new[rows, decoys[:, 1]] = torch.where(rank >= 2, 13.0, 0.0)
    new[rows[ok], ref[ok]] = (14.0 - rank.float())[ok]
    return new.to(logits.dtype)


drafter.draft = types.MethodType(oracle_draft, drafter)
results = []
for ctx in (int(a) for a in sys.argv[1:] or ["1024", "4096"]):
    prompt = torch.randint(0, cfg.vocab_size, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist()
    for backend in (("sdpa",) if SMOKE else ("sdpa", "triton")):
        target.attention_backend = drafter.attention_backend = backend
        pair.generate(prompt, method="ar", max_new_tokens=8)  # warm-up
        ar = pair.generate(prompt, method="ar", max_new_tokens=96)
        REF[:] = prompt + ar.token_ids
        runs = [("ar", 0, ar)]
        for method, budget in [("dflash", 0), ("ddtree", 16), ("ddtree", 64), ("ddtree", 128), ("ddtree", 256)]:
            pair.generate(prompt, method=method, budget=budget or None, max_new_tokens=16)  # warm-up (compiles)
            runs.append((method, budget, pair.generate(prompt, method=method, budget=budget or None, max_new_tokens=96)))
        for method, budget, res in runs:
            s = res.stats
            verdict = pair.check(prompt, ar.token_ids, res.token_ids) if method != "ar" else None
            rec = dict(ctx=ctx, backend=backend, method=method, budget=budget, tau=s.tau, tok_s=s.tokens_per_second,
                       speedup=s.tokens_per_second / ar.stats.tokens_per_second, steps=s.steps,
                       ms_per_step={k: 1e3 * v / max(1, s.steps) for k, v in s.stage_seconds.items()},
                       verdict=verdict.kind if verdict else "reference")
            results.append(rec)
            stages = " ".join(f"{k}={v:.2f}" for k, v in rec["ms_per_step"].items())
            print(f"ctx={ctx} {backend:6s} {method:6s} B={budget:<3d} tau={s.tau:5.2f} {s.tokens_per_second:7.1f} tok/s "
                  f"x{rec['speedup']:.2f} [{rec['verdict']}] ms/step: {stages}", flush=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "."), "e2e_qwen3_8b_shapes.json"), "w"), indent=1)

"""The published DDTree code (liranringel/ddtree) beside this engine on one GPU (issue 53 item 5): the same seeded
Qwen3-8B-shaped target, the same drafter weights and the same oracle draws, decode-only tokens/s and tau per budget,
and the reference's tokens checked against this engine's `ar`.

    git clone https://github.com/liranringel/ddtree .ref/ddtree     # or copy a snapshot there (.ref/ is ignored)
    python scripts/gpu_reference.py --budgets 32 64 128 --prompts 2 --context 2048
    SMOKE=1 python scripts/gpu_reference.py                          # tiny shapes on the CPU: checks the script

The reference runs as published (`ddtree_generate`: a transformers Qwen3 target with a DynamicCache and SDPA over a
float tree mask, the DFlash draft model, its clock from the first draft on), with three stand-ins that change no
arithmetic of its own:
- its target is a transformers `Qwen3ForCausalLM` holding this engine's seeded target weights, and its draft model
  holds this engine's drafter weights (the published checkpoint layout is the same), in SDPA (flash-attn is not
  installed on the lent GPUs);
- its `build_ddtree_tree` is handed the oracle's logits for the draft's (scripts/gpu_e2e.py: the target's greedy
  token ranked where a preset draws it), drawn from the same table in the same order as this engine's run of the
  same budget, so both build the same trees and accept the same paths;
- `loguru` and `datasets`, which only its benchmark's logging and dataset loading use, are stubbed where missing, and
  `DynamicCache.crop(n)` keeps the first n tokens where a newer transformers takes only a negative count.
Writes gpu_reference.json to $OUT (default .).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_e2e as e2e  # noqa: E402  the seeded pair and the oracle (with SMOKE: the Triton interpreter, the CPU)

from ddtree.base.config import SamplingParams  # noqa: E402
from ddtree.bench.oracle import PRESETS  # noqa: E402
from ddtree.engine.decoder import Decoder, make_method  # noqa: E402
from ddtree.runtime.gpu import runtime as gpu  # noqa: E402

DEV, SMOKE = e2e.DEV, e2e.SMOKE


def import_reference(path: str) -> types.ModuleType:
    """The reference's ddtree.py as module `ddtree_reference` (its own name is this package's), with its dflash.py
    and model/ importable from `path`."""
    if not os.path.isfile(os.path.join(path, "ddtree.py")):
        raise SystemExit(f"no reference at {path}: git clone https://github.com/liranringel/ddtree {path} "
                         "(or set DDTREE_REFERENCE to a copy)")
    for name, attrs in (("loguru", dict(logger=types.SimpleNamespace(info=print, warning=print))),
                        ("datasets", dict(load_dataset=None, Features=None, Sequence=None, Value=None))):
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = types.SimpleNamespace(**attrs)
    sys.path.insert(0, path)
    spec = importlib.util.spec_from_file_location("ddtree_reference", os.path.join(path, "ddtree.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if DEV.type != "cuda":  # its clock synchronizes CUDA
        module.cuda_time = time.perf_counter
    _keep_positive_crop()
    return module


def _keep_positive_crop() -> None:
    """DynamicCache.crop(n >= 0) keeps the first n tokens, as the transformers the reference was written for did;
    newer ones (5.2x) take only a negative count of tokens to remove."""
    from transformers import DynamicCache

    if hasattr(DynamicCache, "_published_crop"):
        return
    DynamicCache._published_crop = DynamicCache.crop

    def crop(self, max_length: int):
        if max_length < 0:
            return self._published_crop(max_length)
        extra = self.get_seq_length() - max_length
        if extra > 0:
            self._published_crop(-extra)

    DynamicCache.crop = crop


def reference_models(ref_t, ref_d, module):
    """(transformers Qwen3ForCausalLM, the reference's DFlashDraftModel) holding the engine's target and drafter
    weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dtype = next(ref_t.parameters()).dtype
    config = Qwen3Config(**{k: v for k, v in ref_t.cfg.to_hf().items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(DEV):
            target = Qwen3ForCausalLM(config).eval()
            draft = module.DFlashDraftModel(Qwen3Config(**ref_d.cfg.to_hf())).eval()
    finally:
        torch.set_default_dtype(default)
    draft.config._attn_implementation = "sdpa"
    ref_t.fuse(False)  # the separate q/k/v and gate/up weights, as the checkpoint layout names them
    try:
        _load(target, ref_t.state_dict())
    finally:
        ref_t.fuse()
    _load(draft, {k: v for k, v in ref_d.state_dict().items() if k != "d2t"})
    return target, draft


def _load(model, state: dict) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise SystemExit(f"{type(model).__name__}: weights missing {missing[:5]}, unexpected {unexpected[:5]}")


def oracle_tree_builder(module, target, draft, perm, preset):
    """Make the reference's build_ddtree_tree build on gpu_e2e.oracle_draws' logits (the same tables, the same order
    as this engine's run from a fresh oracle): the root is the first token of the block its draft embedded last."""
    build = module.__dict__.setdefault("_published_build", module.build_ddtree_tree)
    embed = target.model.embed_tokens
    if not hasattr(embed, "_published_forward"):
        embed._published_forward, embed.last_ids = embed.forward, None

        def forward(ids):
            embed.last_ids = ids
            return embed._published_forward(ids)

        embed.forward = forward
    draw = e2e.oracle_draws(perm, preset, draft.block_size - 1)

    def build_on_oracle(draft_logits, budget):
        return build(draw(embed.last_ids[0, :1], *draft_logits.shape).to(draft_logits.dtype), budget)

    module.build_ddtree_tree = build_on_oracle


def run_reference(module, target, draft, prompts, budget, args, stop_ids=()):
    """Decode-only tok/s (the reference's own clock), tau and each prompt's tokens."""
    tokens, new, seconds, lengths = [], 0, 0.0, []
    for ids in prompts:
        out = module.ddtree_generate(draft, target, torch.tensor([ids], device=DEV), draft.mask_token_id,
                                     args.max_new_tokens, draft.block_size, list(stop_ids), 0.0, budget)
        got = out.output_ids[0, out.num_input_tokens:].tolist()
        tokens.append(got)
        new += out.num_output_tokens
        seconds += out.time_per_output_token * max(out.num_output_tokens, 1)
        lengths += out.acceptance_lengths
    return dict(decode_tok_s=new / seconds, tau=sum(lengths) / max(1, len(lengths)), tokens=tokens)


def run_engine(dec, prompts, method, budget, args):
    """This engine's decode-only tok/s (the tokens after the first over the time after the prefill), tau, tokens."""
    tokens, new, seconds, steps, accepted = [], 0, 0.0, 0, 0
    for ids in prompts:
        e2e.sync()
        got, st = dec.generate(ids, make_method(method, budget, None, dec.drafter), SamplingParams(),
                               args.max_new_tokens, ())
        tokens.append(got)
        new += st.new_tokens - 1
        seconds += st.seconds - st.time_to_first_token
        steps += st.steps
        accepted += sum(st.acceptance_lengths)
    return dict(decode_tok_s=new / seconds, tau=accepted / max(1, steps), tokens=tokens)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--oracle", choices=sorted(PRESETS), default="qwen3-8b-dflash")
    ap.add_argument("--reference", default=os.environ.get("DDTREE_REFERENCE", ".ref/ddtree"))
    args = ap.parse_args()
    if SMOKE:
        args.context, args.max_new_tokens, args.budgets = min(args.context, 96), min(args.max_new_tokens, 24), [8, 16]
    t0 = time.time()
    module = import_reference(args.reference)
    ref_t, ref_d, perm = e2e.qwen3_8b_pair()
    hf_target, hf_draft = reference_models(ref_t, ref_d, module)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, ref_t.cfg.vocab_size, (args.context,), generator=g).tolist()
               for _ in range(args.prompts)]
    t = gpu.GPUTarget(ref_t, graphs=DEV.type == "cuda")
    dec = Decoder(t, gpu.GPUDrafter(ref_d, graphs=t.graphs))
    longest = args.context + args.max_new_tokens + max(args.budgets) + 1
    dec.target.new_cache(longest)
    dec.drafter.new_cache(longest)
    report = dict(device=torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", torch=torch.__version__,
                  args=vars(args), rows=[])
    print(f"loaded in {time.time() - t0:.0f}s on {report['device']}", flush=True)
    run_engine(dec, prompts[:1], "ar", None, args)  # warm-up: the graphs captured, the prefill's kernels chosen
    ar = run_engine(dec, prompts, "ar", None, args)
    preset = PRESETS[args.oracle]
    for budget in args.budgets:
        # warm-ups (graphs captured, Triton and cuBLAS set up), then each side from a fresh oracle: the same draws
        e2e.plant_oracle(dec.drafter, perm, preset)
        run_engine(dec, prompts[:1], "ddtree", budget, args)
        oracle_tree_builder(module, hf_target, hf_draft, perm, preset)
        run_reference(module, hf_target, hf_draft, prompts[:1], budget, args)
        e2e.plant_oracle(dec.drafter, perm, preset)
        ours = run_engine(dec, prompts, "ddtree", budget, args)
        oracle_tree_builder(module, hf_target, hf_draft, perm, preset)
        theirs = run_reference(module, hf_target, hf_draft, prompts, budget, args)
        row = dict(budget=budget, ours_decode_tok_s=ours["decode_tok_s"], ref_decode_tok_s=theirs["decode_tok_s"],
                   speedup_over_ref=ours["decode_tok_s"] / theirs["decode_tok_s"], ours_tau=ours["tau"],
                   ref_tau=theirs["tau"], ours_equal_ar=ours["tokens"] == ar["tokens"],
                   ref_equal_ar=theirs["tokens"] == ar["tokens"])
        report["rows"].append(row)
        print(f"ddtree:{budget:<4} ours {row['ours_decode_tok_s']:8.1f} tok/s tau {row['ours_tau']:5.2f} | "
              f"reference {row['ref_decode_tok_s']:8.1f} tok/s tau {row['ref_tau']:5.2f} | "
              f"{row['speedup_over_ref']:.2f}x | tokens = ar: ours {row['ours_equal_ar']}, "
              f"reference {row['ref_equal_ar']}", flush=True)
    report["ar_decode_tok_s"] = ar["decode_tok_s"]
    path = os.path.join(os.environ.get("OUT", "."), "gpu_reference.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"ar {ar['decode_tok_s']:.1f} tok/s decode; wrote {path} ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()

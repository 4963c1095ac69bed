"""Where a speculative step's time goes outside the model passes (issue 35's "step overhead"), measured.

    python scripts/step_overhead.py --method ddtree:2 --quant gguf-int8 --prompts 6 --tokens 96

Decodes the first prompts of each evaluation set with `ar` and the method back to back, prompt by prompt (so the
machine's drift hits both alike), timing every model pass (the target's layers and head, the drafter's context pass,
draft layers and head) around the decoding loop, and prints per step: the whole step, the passes, and what is left
(tree build, compile, walk, commit, Python), next to the stage timers' own columns. The prefill is left out.
Greedy, every method checked against `ar` token for token.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

import ddtree
from ddtree.engine.cost_cache import machine_name
from ddtree.runtime.cpu.runtime import CPUDrafter, CPUTarget
from ddtree.bench.datasets import load_prompt_items


class PassClock:
    """Inclusive seconds per wrapped function, and per function the seconds of its outermost calls (those not
    inside another wrapped call): their sum is the time inside any pass."""

    def __init__(self):
        self.seconds, self.outer, self.depth = defaultdict(float), defaultdict(float), 0

    def wrap(self, cls, name: str, label: str):
        original = getattr(cls, name)

        def timed(*args, **kwargs):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.depth -= 1
                self.seconds[label] += dt
                if self.depth == 0:
                    self.outer[label] += dt

        setattr(cls, name, timed)

    def reset(self):
        self.seconds.clear()
        self.outer.clear()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="ddtree:2")
    p.add_argument("--quant", default=None, help="gguf or gguf-int8 (default: the float target)")
    p.add_argument("--prompts", type=int, default=4, help="per dataset")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--markov-head", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = PassClock()
    clock.wrap(CPUTarget, "__call__", "target layers")
    clock.wrap(CPUTarget, "logits", "target head")
    clock.wrap(CPUDrafter, "_context", "drafter context")
    clock.wrap(CPUDrafter, "draft", "drafter draft")
    clock.wrap(CPUDrafter, "logits", "drafter head")
    pair = ddtree.load(quant=args.quant, markov_head=args.markov_head, threads=args.threads)
    prompts = [text for name in ("humaneval", "mt-bench", "gsm") for text, _ in load_prompt_items(name, args.prompts)]
    pair.generate(prompts[0], method=args.method, max_new_tokens=8)  # warm-up
    print(f"{machine_name('cpu')}, {args.threads} thread(s), target {pair.target.quant or 'float'}, {args.method}, "
          f"{len(prompts)} prompts x {args.tokens} tokens, greedy; ms per step (prefill excluded)")
    # per prompt, ar and the method back to back (ar's run is the method's reference), so that the machine's drift
    # over the run hits both alike
    totals = {m: defaultdict(float) for m in ("ar", args.method)}
    stages = {m: defaultdict(float) for m in ("ar", args.method)}
    steps, tokens = defaultdict(int), defaultdict(int)
    for prompt in prompts:
        reference = None
        for method in dict.fromkeys(("ar", args.method)):
            clock.reset()
            res = pair.generate(prompt, method=method, max_new_tokens=args.tokens)
            if reference is None:
                reference = list(res.token_ids)
            elif list(res.token_ids) != reference:
                raise SystemExit(f"{method} differs from ar on {prompt[:40]!r}")
            st, total = res.stats, totals[method]
            prefill = st.stage_seconds.get("prefill", 0.0)
            steps[method] += len(st.acceptance_lengths)
            tokens[method] += st.new_tokens
            total["step"] += st.seconds - st.time_to_first_token
            # the prefill's target pass lies inside the prefill stage: taken off the target's passes
            total["target"] += clock.outer["target layers"] + clock.outer["target head"] - prefill
            total["drafter"] += clock.outer["drafter draft"] + clock.outer["drafter context"]
            total["drafter context"] += clock.seconds["drafter context"]
            total["drafter head"] += clock.seconds["drafter head"]
            for stage, secs in st.stage_seconds.items():
                stages[method][stage] += secs
    for method in totals:
        n = steps[method]
        ms = {k: 1000 * v / n for k, v in totals[method].items()}
        passes = ms["target"] + ms["drafter"]
        print(f"\n{method}: {n} steps, tau {tokens[method] / n:.2f}, {tokens[method] / totals[method]['step']:.1f} "
              f"tok/s decode")
        print(f"  step {ms['step']:.3f} = target passes {ms['target']:.3f} + drafter passes {ms['drafter']:.3f} "
              f"+ outside the passes {ms['step'] - passes:.3f}")
        print(f"  drafter: context {ms['drafter context']:.3f}, its head {ms['drafter head']:.3f}, layers and the "
              f"rest {ms['drafter'] - ms['drafter context'] - ms['drafter head']:.3f}")
        print("  stage timers: " + ", ".join(f"{k} {1000 * v / n:.3f}" for k, v in stages[method].items()
                                             if k != "prefill"))


if __name__ == "__main__":
    main()

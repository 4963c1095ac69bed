"""One decoding loop for every method. A method only decides what to propose each step (a lone root, a
chain, or a tree); verifying (one target pass), walking and committing are shared.

    prefill prompt -> bonus
    loop: tree = method.propose(bonus)         # root = bonus, then draft nodes
          logits = target(tree, tree mask)     # ONE pass over the N nodes
          path, bonus = walk(tree, choose(logits))
          commit path's K/V (+ drafter context from its tap features); emit path tokens + bonus
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .attention import Visibility
from .config import ConfigError, SamplingParams
from .sampling import choose
from .stats import GenerationStats, StageTimer
from .budget import CostModel, DraftGate, EdgeCalibration, calibrate, choose_budget
from .tree import DraftTree, ancestor_matrix, best_first_nodes, chain_parents, walk, walk_drawn

METHODS = ("ar", "dflash", "ddtree")
AUTO_MAX_BUDGET = 256  # budget="auto": the largest tree the adaptive rule may pick


class Method:
    name = ""
    uses_drafter = True
    budget: int | None = None
    block_size: int | None = None

    def max_nodes(self) -> int:
        """Largest tree (root included) this method verifies in one pass."""
        raise NotImplementedError

    def propose(self, drafter, dcache, bonus: torch.Tensor, room: int, timer) -> DraftTree:
        raise NotImplementedError

    def observe(self, accepted: int) -> None:
        """Feedback after each verify: `accepted` draft tokens (bonus excluded). Only adaptive methods use it."""


class AR(Method):
    """Plain autoregressive decoding: the tree is the root alone."""
    name, uses_drafter = "ar", False

    def max_nodes(self) -> int:
        return 1

    def propose(self, drafter, dcache, bonus, room, timer):
        return DraftTree(bonus, *chain_parents(1))


class DFlash(Method):
    """Linear DFlash: the drafter's argmax at each block position, verified as a chain."""
    name = "dflash"

    def __init__(self, block_size: int):
        if block_size < 2:
            raise ConfigError(f"block_size must be >= 2 for dflash/ddtree, got {block_size}")
        self.block_size = block_size

    def max_nodes(self) -> int:
        return self.block_size

    def propose(self, drafter, dcache, bonus, room, timer):
        length = min(self.block_size, room)
        if length < 2:
            return DraftTree(bonus, *chain_parents(1))
        with timer("draft"):
            logits = drafter.draft(dcache, bonus, length)  # [length - 1, draft vocab]
        with timer("tree_build"):
            tokens = torch.cat([bonus, drafter.to_target_ids(logits.argmax(dim=-1))])
            return DraftTree(tokens, *chain_parents(length))


class DDTree(Method):
    """DDTree: the best `budget` nodes of the drafter's per-position distributions, as one tree. With a cost
    model (budget="auto") each step keeps only the first b* of them, b* maximizing expected tokens/second."""
    name = "ddtree"

    def __init__(self, budget: int, block_size: int, adaptive: bool = False):
        if not isinstance(budget, int) or budget < 1:
            raise ConfigError(f"budget must be an integer >= 1 (draft nodes per step) or 'auto', got {budget!r}")
        if block_size < 2:
            raise ConfigError(f"block_size must be >= 2 for dflash/ddtree, got {block_size}")
        self.budget, self.block_size, self.adaptive = budget, block_size, adaptive
        self.cost: CostModel | None = None  # set by the Decoder when adaptive
        self.calibration: EdgeCalibration | None = None  # likewise (shared across the decoder's generations)
        self.gate: DraftGate | None = None  # likewise
        self._last = None  # (path log-probs, depths) of the nodes verified in the current step

    def max_nodes(self) -> int:
        return self.budget + 1

    def propose(self, drafter, dcache, bonus, room, timer):
        length = min(self.block_size, room)
        if length < 2 or (self.gate is not None and not self.gate.draft_now(self.cost)):
            return DraftTree(bonus, *chain_parents(1))  # a plain step: drafting does not pay (see DraftGate)
        with timer("draft"):
            logits = drafter.draft(dcache, bonus, length)
        with timer("tree_build"):
            parents, depths, tokens, scores = best_first_nodes(logits.float().log_softmax(dim=-1),
                                                               min(self.budget, room - 1))
            if self.cost is not None:  # pop order: any prefix is a tree
                scale = self.calibration.c if self.calibration is not None else 1.0
                b = choose_budget(scores, self.cost, depths[1:], scale)
                parents, depths, tokens = parents[:b + 1], depths[:b + 1], tokens[:b]
                self._last = (scores[:b], depths[1:])
            drafts = drafter.to_target_ids(torch.tensor(tokens, dtype=torch.long, device=bonus.device))
            tokens = torch.cat([bonus, drafts])
            return DraftTree(tokens, parents, depths)

    def observe(self, accepted: int) -> None:
        if self._last is None:  # a plain step, or not adaptive
            return
        logp, depths = self._last
        self.calibration.update(logp, depths, accepted)
        self.gate.update(accepted + 1, float(self.cost.step_seconds(np.array([len(logp) + 1]))[0]))
        self._last = None


def make_method(name: str, budget: int | str = 64, block_size: int | None = None, drafter=None) -> Method:
    """budget: draft nodes per step for ddtree, or "auto" (adaptive, up to AUTO_MAX_BUDGET)."""
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    if name == "ar":
        return AR()
    if drafter is None:
        raise ConfigError(f"method {name!r} needs a drafter; load one (ddtree.load(draft=...)) or use method='ar'")
    block_size = drafter.block_size if block_size is None else block_size
    if name == "dflash":
        return DFlash(block_size)
    if budget == "auto":
        return DDTree(AUTO_MAX_BUDGET, block_size, adaptive=True)
    return DDTree(budget, block_size)


class Decoder:
    """Runs one method over a target (and drafter) for one prompt at a time (batch size 1)."""

    def __init__(self, target, drafter=None):
        self.target, self.drafter = target, drafter
        self._costs: dict[tuple, CostModel] = {}
        self.calibration = EdgeCalibration()  # the adaptive budget's trust in the drafter, kept across prompts
        self.gate = DraftGate()  # and whether drafting pays at all

    def cost_model(self, block_size: int, max_nodes: int) -> CostModel:
        """The adaptive budget's cost model: measured once per (block size, size range, threads), then reused."""
        key = (block_size, max_nodes, self.target.attention_backend, torch.get_num_threads())
        if key not in self._costs:
            sizes = tuple(n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if n < max_nodes) + (max_nodes,)
            self._costs[key] = calibrate(self.target, self.drafter, sizes=sizes, block_size=block_size)
        return self._costs[key]

    def accept(self, tree: DraftTree, ancestors, logits: torch.Tensor, sampling: SamplingParams, generator):
        """The target's choices and the walk: greedy, all nodes at once (one tensor op); sampled, only at the
        nodes the walk visits (processing a 49K-token distribution costs ~1 ms per node on a CPU). Tests
        override this to plant a biased rule."""
        if sampling.greedy:
            return walk(tree, ancestors, choose(logits, sampling, generator))
        return walk_drawn(tree, lambda i: int(choose(logits[i:i + 1], sampling, generator)[0]))

    def _validate(self, prompt_ids: list[int], method: Method, max_new_tokens: int) -> None:
        cfg = self.target.cfg
        if not prompt_ids:
            raise ConfigError("the prompt is empty: give at least one token")
        if len(prompt_ids) > cfg.max_position_embeddings:
            raise ConfigError(f"the prompt has {len(prompt_ids)} tokens, more than the target's context limit of "
                              f"{cfg.max_position_embeddings}; shorten it")
        bad = [t for t in prompt_ids if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise ConfigError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{cfg.vocab_size - 1})")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if method.uses_drafter and self.drafter is None:
            raise ConfigError(f"method {method.name!r} needs a drafter")

    def generate(self, prompt_ids: list[int], method: Method, sampling: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 256, stop_ids=(), seed: int | None = None) -> tuple[list[int], GenerationStats]:
        target, drafter, cfg = self.target, self.drafter, self.target.cfg
        self._validate(prompt_ids, method, max_new_tokens)
        if getattr(method, "adaptive", False):
            if method.cost is None:
                method.cost = self.cost_model(method.block_size, method.max_nodes())
            if method.calibration is None:
                method.calibration = self.calibration
            if method.gate is None:
                method.gate = self.gate
        device, stop = target.device, set(stop_ids)
        generator = None
        if not sampling.greedy and seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
        m = len(prompt_ids)
        capacity = min(cfg.max_position_embeddings, m + max_new_tokens + method.max_nodes())
        tcache = target.new_cache(capacity)
        dcache = drafter.new_cache(capacity) if method.uses_drafter else None
        taps = tuple(drafter.cfg.target_layer_ids) if method.uses_drafter else ()
        budget = "auto" if getattr(method, "adaptive", False) else method.budget
        stats = GenerationStats(method.name, budget, method.block_size, m,
                                attention_backend=target.attention_backend,
                                drafter=getattr(drafter, "label", "") if method.uses_drafter else "")
        timer = StageTimer(device)
        t0 = time.perf_counter()

        with timer("prefill"):
            ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
            out = target(ids, torch.arange(m, device=device), tcache, Visibility.causal(0, m, device), taps,
                         last_only=True)
            tcache.commit(m)
            bonus = int(choose(out.logits, sampling, generator)[0])
            if dcache is not None:
                drafter.add_context(dcache, out.taps)
        stats.time_to_first_token = time.perf_counter() - t0
        tokens = [bonus]

        while not (stop_reason := _stop_reason(tokens, stop, max_new_tokens, tcache.room)):
            start = tcache.length
            tree = method.propose(drafter, dcache, torch.tensor([bonus], device=device), tcache.room, timer)
            with timer("tree_compile"):
                ancestors = None
                if tree.size > 1:
                    ancestors = torch.from_numpy(ancestor_matrix(tree.parents, tree.depths)).to(device)
                vis = Visibility(start, ancestors)
                positions = torch.from_numpy(tree.depths).to(device) + start
            with timer("verify"):
                out = target(tree.tokens, positions, tcache, vis, taps)
                path, choices = self.accept(tree, ancestors, out.logits, sampling, generator)
            with timer("commit"):
                n = len(path)
                rows = None if path[-1] == n - 1 else torch.tensor(path, device=device)  # a prefix needs no move
                tcache.commit(n, rows)
                if dcache is not None:
                    drafter.add_context(dcache, out.taps[:n] if rows is None else out.taps[rows])
            method.observe(n - 1)
            stats.acceptance_lengths.append(n)
            stats.tree_sizes.append(tree.size)
            # emit the accepted drafts and the bonus token, cut after a stop token or at max_new_tokens
            emitted = [choices[i] for i in path]
            cut = next((j + 1 for j, tok in enumerate(emitted) if tok in stop), len(emitted))
            tokens.extend(emitted[:cut])
            del tokens[max_new_tokens:]
            bonus = tokens[-1]

        stats.stop_reason = stop_reason
        stats.seconds = time.perf_counter() - t0
        stats.new_tokens = len(tokens)
        stats.stage_seconds = dict(timer.seconds)
        return tokens, stats


def _stop_reason(tokens: list[int], stop: set[int], max_new_tokens: int, room: int) -> str:
    if tokens[-1] in stop:
        return "eos"
    if len(tokens) >= max_new_tokens:
        return "max_new_tokens"
    return "context_limit" if room < 1 else ""

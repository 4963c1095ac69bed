"""One decoding loop for every method. A method only decides what to propose each step (a lone root, a
chain, or a tree); verifying (one target pass), walking and committing are shared. The loop knows no method
by name: it calls method.prepare() once, then propose() and observe() each step.

    prefill prompt -> bonus; method.start(prompt + bonus)
    loop: tree = method.propose(bonus)         # root = bonus, then draft nodes
          logits = target(tree, tree mask)     # ONE pass over the N nodes
          path, bonus = walk(tree, choose(logits))
          commit path's K/V (+ queue the drafter's context: its tap features); emit path tokens + bonus,
          cut after the first token that ends the generation (an EOS / stop token, a stop string: stops.py);
          method.observe(path, committed tokens)
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from ..models.attention import Visibility
from .budget import CostModel, DraftGate, EdgeCalibration, RowCostFeedback, choose_budget
from .lookup import ContextLookup
from ..base.config import ConfigError, SamplingParams, check_int
from .cost_cache import verify_costs
from .method_spec import MethodSpec, check_budget
from .sampling import choose
from .stats import GenerationStats, StageTimer
from .staged_ops import step_ops_for
from .stops import Stops
from .traces import step_record
from .tree import DraftTree, Popped, chain_added, chain_parents, graft_chain, walk_drawn

AUTO_MAX_BUDGET = 256  # budget="auto": the largest tree the adaptive rule may pick
LONE_ROOT = chain_parents(1)  # a plain step's parents and depths, built once (nothing writes into a tree's arrays)


class Method:
    """What one method decides: the tree each step verifies. A method is self-contained: whatever it learns
    across steps and prompts (the adaptive budget's cost model and trust in the drafter) is its own state; the
    loop only calls prepare() and start() once per generation, then propose() and observe() each step."""
    block_size: int | None = None

    def __init__(self, spec: MethodSpec):
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def uses_drafter(self) -> bool:
        return self.spec.info.uses_drafter  # the method registry's (method_spec.METHODS)

    def max_nodes(self) -> int:
        """Largest tree (root included) this method verifies in one pass."""
        raise NotImplementedError

    def longest_draft(self) -> int | None:
        """The most positions one draft pass covers (the stats' block_size)."""
        return self.block_size

    def prepare(self, target, drafter, sampling: SamplingParams | None = None) -> None:
        """Before each generation, outside its timing: load or measure what the method needs (once), and
        start a new prompt decoded with `sampling` (None: greedy)."""

    def start(self, context: list[int]) -> None:
        """A generation's committed tokens before its first step: the prompt and the prefill's token."""

    def propose(self, drafter, ops, dcache, bonus: torch.Tensor, room: int, timer) -> DraftTree:
        """The tree to verify, rooted at `bonus` [1], built with the step operations `ops` (protocol.StepOps). The one
        place that decides a plain step (the root alone, exactly plain decoding): when no draft of >= 1 token fits
        the `room` left, or the method declines."""
        length = min(self.block_size or 1, room)
        if length < 2 or not self.wants_draft():
            return DraftTree(bonus, *LONE_ROOT)
        return self.draft(drafter, ops, dcache, bonus, length, room, timer)

    def wants_draft(self) -> bool:
        return self.uses_drafter

    def draft(self, drafter, ops, dcache, bonus: torch.Tensor, length: int, room: int, timer) -> DraftTree:
        """A drafted tree over block positions 1..length-1 (length >= 2), at most `room` nodes."""
        raise NotImplementedError

    def observe(self, path: list[int], committed: list[int]) -> None:
        """Feedback after each verify: the accepted path's nodes (root first; len(path) - 1 draft tokens were
        accepted) and the tokens the step committed (the accepted drafts and the bonus)."""


class AR(Method):
    """Plain autoregressive decoding: the tree is the root alone."""

    @classmethod
    def make(cls, spec: MethodSpec, drafter, block_size: int | None, ngram_table=None) -> "AR":
        return cls(spec)

    def max_nodes(self) -> int:
        return 1


class DFlash(Method):
    """Linear DFlash: the drafter's argmax at each block position, verified as a chain."""

    def __init__(self, spec: MethodSpec, block_size: int):
        super().__init__(spec)
        self.block_size = block_size

    @classmethod
    def make(cls, spec: MethodSpec, drafter, block_size: int | None, ngram_table=None) -> "DFlash":
        return cls(spec, check_block_size(block_size, drafter.block_size))

    def max_nodes(self) -> int:
        return self.block_size

    def draft(self, drafter, ops, dcache, bonus, length, room, timer):
        with timer("draft"):
            logits = drafter.draft(dcache, bonus, length)  # [length - 1, draft vocab]
        with timer("tree_build"):
            ids = ops.chain_ids(drafter, logits, bonus)  # [length - 1] in the draft vocabulary
            return DraftTree(ops.tree_tokens(drafter, bonus, ids), *chain_parents(length), draft_logits=logits,
                             draft_ids=ids)


class DDTree(Method):
    """DDTree: the best `budget` nodes of the drafter's per-position distributions, as one tree.

    A tree of `budget` nodes is at most `budget` deep, so the drafter drafts min(block_size, budget + 1) positions:
    the ones past that could only shape the others through the block's non-causal attention, which moved tau by
    about a percent with the shipped drafter while a shorter draft pass costs less on a CPU (docs/cpu-speed.md).
    From budget 7 on the whole block is drafted."""

    def __init__(self, spec: MethodSpec, budget: int, block_size: int, ngram_table=None):
        super().__init__(spec)
        self.budget, self.block_size = budget, min(block_size, budget + 1)
        self.lookup = ContextLookup(table=ngram_table) if spec.lookup else None  # ddtree:N+lookup

    @classmethod
    def make(cls, spec: MethodSpec, drafter, block_size: int | None, ngram_table=None) -> "DDTree":
        """A fixed budget, or (spec.budget 'auto') the adaptive one, AdaptiveDDTree. ngram_table: the target's own
        3-gram continuations (ngram_table.py), which the lookup of ddtree:N+lookup falls back on."""
        block_size = check_block_size(block_size, drafter.block_size)
        context = drafter.target.cfg.max_position_embeddings
        if spec.adaptive:
            return AdaptiveDDTree(spec, min(AUTO_MAX_BUDGET, context - 1), block_size, ngram_table)
        if spec.budget > context - 1:
            raise ConfigError(f"budget {spec.budget} cannot help: a tree of {spec.budget} draft nodes and its root "
                              f"must fit the target's context of {context} positions; use at most {context - 1}")
        return cls(spec, spec.budget, block_size, ngram_table)

    def max_nodes(self) -> int:
        return self.budget + 1 + (self.lookup.length if self.lookup is not None else 0)

    def prepare(self, target, drafter, sampling: SamplingParams | None = None) -> None:
        """A sampled generation copies its context less faithfully than a greedy one: its lookup proposes chains of
        the first tier's length only (docs/cpu-speed.md)."""
        if self.lookup is not None:
            self.lookup.top = len(self.lookup.tiers) - 1 if sampling is None or sampling.greedy else 0

    def start(self, context: list[int]) -> None:
        if self.lookup is not None:
            self.lookup.start(context)

    def draft(self, drafter, ops, dcache, bonus, length, room, timer):
        with timer("draft"):
            logits = drafter.draft(dcache, bonus, length)
        with timer("tree_build"):
            parents, depths, ids, scores = ops.tree_nodes(drafter, logits.float().log_softmax(dim=-1), bonus,
                                                          self.heap_size(room))
            tokens = ops.tree_tokens(drafter, bonus, ids)  # [n + 1]: the root, then every popped node
            chain = self.lookup.chain()[:room - 1] if self.lookup is not None else []
            b = self.keep(scores, depths[1:], dcache.length, Popped(parents, depths, tokens, chain))
            ids = ids[:b]  # [b] in the draft vocabulary; pop order: any prefix is a tree
            tokens, parents, depths, grafted = tokens[:b + 1], parents[:b + 1], depths[:b + 1], 0
            if chain := chain[:room - 1 - b]:
                tokens, parents, depths, grafted = self._graft(tokens, parents, depths, chain)
            return DraftTree(tokens, parents, depths, draft_logits=logits, draft_ids=ids, grafted=grafted)

    def _graft(self, tokens: torch.Tensor, parents: np.ndarray, depths: np.ndarray, chain: list[int]) -> tuple:
        """The tree (tokens [N], parents [N], depths [N]) with the lookup's `chain` grafted on
        (tree.graft_chain) where graft_pays says so, and how many nodes that appended; else the same tree and 0."""
        listed = tokens.tolist(), parents.tolist(), depths.tolist()
        added = graft_chain(*listed, chain)
        if not added or not self.graft_pays(chain, added):
            return tokens, parents, depths, 0
        return (torch.tensor(listed[0], dtype=tokens.dtype, device=tokens.device),
                np.array(listed[1], dtype=np.int64), np.array(listed[2], dtype=np.int64), added)

    def graft_pays(self, chain: list[int], added: int) -> bool:
        """Whether to verify a chain that adds `added` nodes to the tree: a fixed budget always does."""
        return True

    def observe(self, path: list[int], committed: list[int]) -> None:
        if self.lookup is not None:
            self.lookup.extend(committed)

    def heap_size(self, room: int) -> int:
        """How many best-first nodes to pop this step (keep() verifies a prefix of them): the budget, in the room."""
        return min(self.budget, room - 1)

    def keep(self, path_logprobs: np.ndarray, depths: np.ndarray, context: int, popped: Popped) -> int:
        """How many of the best-first nodes (path log-probs [n], depths [n], pop order) to verify after `context`
        committed tokens, the step's whole heap and lookup chain in `popped`: all of them."""
        return len(path_logprobs)


class AdaptiveDDTree(DDTree):
    """budget="auto": each step keeps the first b* best-first nodes, b* maximizing expected tokens per second
    under a verify-cost curve measured once per machine (cached on disk, ddtree/engine/cost_cache.py). Its trust in
    the drafter (EdgeCalibration) and whether drafting pays at all (DraftGate) are learned across the steps
    and prompts this object decodes; while drafting loses, steps are plain ones (see DraftGate).

    It drafts only as deep as its trees go: each draft covers one position more than the deepest tree kept in
    the last DEPTH_MEMORY drafted steps (at most the block), so a run of shallow trees (a CPU, where b* is
    often 1-4) stops paying for the block's unused positions, and a confident run deepens it by one per step.
    Likewise it pops twice as many best-first nodes as the largest tree kept in those steps (at least HEAP_MIN),
    not its whole budget: a heap of 64 nodes for a tree of 3 costs a CPU step more host time than the tree.

    With a context lookup (ddtree:auto+lookup) it grafts a step's chain unless chains like it have stopped matching
    the text: while its tier's `graft_yield` (what a chain matched of the text beyond the drafter's share of its
    step, per node it added; an average over the steps that had a chain, grafted or not, weighted GRAFT_ALPHA per
    chain) is at least GRAFT_FLOOR. A chain is judged once the text has reached its end, a step or a few later: a
    step that did not graft it commits only the drafter's tokens and the bonus, and judging it on those alone would
    count its later tokens as misses. The yield is learned per kind of chain (ContextLookup.kinds: how far the
    chain's earlier occurrence agrees, or the n-gram table's), since a long agreement copies on far more reliably
    than a 3-token one, and the table's guesses hold on some texts and not on others. A
    floor, not a rate comparison on the cost curve: the yield lags a passage the output starts to copy by the steps
    its chains take to be judged, and a rate comparison declined exactly those first chains (docs/cpu-speed.md).
    Where a chain will be grafted, the drafter's nodes are weighed on top of the rows it adds (choose_budget's
    chain_added), not as if their tree were alone. What rows cost on this run against the curve (RowCostFeedback)
    is learned from the drafted steps' verify times, across prompts and sampling settings (a property of the machine).

    What it learns is kept per sampling setting (greedy, each temperature / top-p / top-k): acceptance at T = 1
    is well below T = 0's, so one shared trust and gate would carry a sampled prompt's pessimism into the next
    greedy one (and back) until relearned."""
    DEPTH_MEMORY = 4
    HEAP_MIN = 4
    GRAFT_PRIOR = 0.5  # tokens an added node commits in expectation, before any chain has been seen
    GRAFT_ALPHA = 0.3
    GRAFT_FLOOR = 0.1  # a tier whose chains match less than this per added node is not grafted

    def __init__(self, spec: MethodSpec, max_budget: int, block_size: int, ngram_table=None):
        super().__init__(spec, max_budget, block_size, ngram_table)
        self.max_length = self.block_size
        self.cost: CostModel | None = None  # prepare() loads or measures it, unless set beforehand
        self._last = None  # (path log-probs, depths) of the drafter's nodes verified in the current step
        self._chain: tuple[list[int], int, int] | None = None  # the step's lookup chain, its nodes to add, its tier
        # chains not judged yet: (where the chain starts in the lookup's text, chain, added, tier, drafter's tokens)
        self._unjudged: list[tuple[int, list[int], int, int, int]] = []
        self._context: int | None = None  # committed tokens at the last drafted step (the cost curve's context)
        self.row_costs = RowCostFeedback()
        self._step: tuple | None = None  # (the step's stage timer, its verify seconds before the step, its tree's rows)
        # sampling -> (calibration, gate, recent trees, draft length, graft yield)
        self._regimes: dict[SamplingParams, tuple] = {}
        self._regime = SamplingParams()  # greedy until prepare() says otherwise
        self.calibration, self.gate, self._recent, self.block_size, self.graft_yield = self._fresh()

    def _fresh(self) -> tuple:
        """A sampling setting's state before it has learned anything: trust in the drafter, the draft gate, the
        recent trees' (depth, nodes), the next draft's length and the tokens a grafted node adds, per lookup tier."""
        kinds = self.lookup.kinds if self.lookup is not None else 1
        return (EdgeCalibration(), DraftGate(), deque(maxlen=self.DEPTH_MEMORY), self.max_length,
                [self.GRAFT_PRIOR] * kinds)

    def _enter(self, sampling: SamplingParams) -> None:
        """Make `sampling`'s learned state the current one (a fresh one the first time), keeping the last one's."""
        self._regimes[self._regime] = (self.calibration, self.gate, self._recent, self.block_size, self.graft_yield)
        state = self._regimes.get(sampling) or self._fresh()
        self.calibration, self.gate, self._recent, self.block_size, self.graft_yield = state
        self._regime = sampling

    def longest_draft(self) -> int:
        return self.max_length

    def start(self, context: list[int]) -> None:
        super().start(context)
        self._unjudged = []  # a chain of the last generation is judged against its own text or not at all

    def prepare(self, target, drafter, sampling: SamplingParams | None = None) -> None:
        super().prepare(target, drafter, sampling)
        self._enter(SamplingParams() if sampling is None or sampling.greedy else sampling)
        if self.cost is None:
            self.cost = verify_costs(target, drafter, self.max_length, self.budget + 1)  # a grafted chain: extrapolated
            # a tree the calibration stopped short of costs more than a fully accepted block can repay
            self.budget = max(1, min(self.budget, self.cost.sizes[-1] - 1))
        self.gate.restart()

    def wants_draft(self) -> bool:
        return self.gate.draft_now(self.cost, self._context)

    def heap_size(self, room: int) -> int:
        largest = max((nodes for _, nodes in self._recent), default=self.budget)
        return min(self.budget, room - 1, max(self.HEAP_MIN, 2 * largest))

    def keep(self, path_logprobs, depths, context, popped):
        self._context = context  # the drafter's committed context: the target's, less a step's pending tokens
        logp, depths = path_logprobs.tolist(), depths.tolist()  # Python floats: the rules read a handful each
        added, gain = None, 0.0
        if popped.chain and (gain := self.graft_yield[self.lookup.tier]) >= self.GRAFT_FLOOR:  # it will be grafted
            added = chain_added(popped.parents.tolist(), popped.depths.tolist(), popped.tokens.tolist(), popped.chain)
        b = choose_budget(logp, self.cost, depths, self.calibration.c, self.block_size, context, added, gain,
                          self.row_costs.scale)
        self._last = (logp[:b], depths[:b])
        return b

    def propose(self, drafter, ops, dcache, bonus, room, timer):
        """As Method.propose; where the gate declines to draft, the lookup's chain alone, if it pays (no draft pass:
        the root and the chain's nodes)."""
        verified = timer.seconds["verify"]
        tree = super().propose(drafter, ops, dcache, bonus, room, timer)
        if tree.size == 1 and self.lookup is not None and (chain := self.lookup.chain()[:room - 1]):
            with timer("tree_build"):
                tokens, parents, depths, grafted = self._graft(tree.tokens, tree.parents, tree.depths, chain)
                tree = DraftTree(tokens, parents, depths, grafted=grafted)
        self._step = (timer, verified, tree.size)
        return tree

    def graft_pays(self, chain: list[int], added: int) -> bool:
        """The chain's added nodes are verified while its tier's chains still match the text (GRAFT_FLOOR)."""
        tier = self.lookup.tier  # of this chain (ContextLookup.chain)
        self._chain = (chain, added, tier)
        return self.graft_yield[tier] >= self.GRAFT_FLOOR

    def observe(self, path: list[int], committed: list[int]) -> None:
        super().observe(path, committed)
        by_drafter = 0
        if self._last is not None:  # a drafted step
            logp, depths = self._last
            b = len(logp)
            # the drafter is judged on its own nodes, as if it had been alone (the grafted ones come after its b):
            # its trust, and whether drafting pays at all
            by_drafter = sum(1 for node in path[1:] if node <= b)
            self.calibration.update(logp, depths, by_drafter)
            self.gate.update(by_drafter + 1, self.cost.tree_step_seconds(b, self.block_size, self._context)[-1])
            if self._step is not None:  # the step's verify time against the curve's price of its rows
                timer, verified, rows = self._step
                priced = self.cost.tree_step_seconds(rows - 1, self.block_size, self._context)
                self.row_costs.update(priced[-1] - priced[0], timer.seconds["verify"] - verified)
            self._recent.append((int(max(depths)), len(logp)))
            self.block_size = min(self.max_length, max(d for d, _ in self._recent) + 2)  # the next draft's positions
        if self._chain is not None:  # the step's chain starts at its first committed token
            chain, added, tier = self._chain
            self._unjudged.append((len(self.lookup.tokens) - len(committed), chain, added, tier, by_drafter))
        if self._unjudged:
            self._judge_chains()
        self._last = self._chain = self._step = None

    def _judge_chains(self) -> None:
        """The graft yield of each chain whose span the text now covers: what it matched of the text, past the
        drafter's share of its step, per node it added."""
        text, waiting = self.lookup.tokens, []
        for start, chain, added, tier, by_drafter in self._unjudged:
            if len(text) < start + len(chain):
                waiting.append((start, chain, added, tier, by_drafter))
                continue
            gain = max(0, _common_prefix(chain, text[start:start + len(chain)]) - by_drafter) / added
            self.graft_yield[tier] += self.GRAFT_ALPHA * (gain - self.graft_yield[tier])
        self._unjudged = waiting


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_method(method: str | MethodSpec = "ddtree", budget=None, block_size: int | None = None,
                drafter=None, ngram_table=None) -> Method:
    """A Method for `method` (a MethodSpec or its text: 'ar', 'dflash', 'ddtree', 'ddtree:32', 'ddtree:auto';
    a bare 'ddtree' takes `budget`), made by its strategy in the method registry (method_spec.METHODS). Budgets
    and block sizes that cannot help are refused here, once. ngram_table: an NgramTable the context lookup falls
    back on (ngram_table.py), or None."""
    spec = MethodSpec.parse(method, budget)
    info = spec.info
    if info.peer:
        raise ConfigError(f"method {spec.label!r} is {info.summary}: another program, not the decoding loop; use "
                          "ar, dflash or ddtree here")
    if info.uses_drafter and drafter is None:
        raise ConfigError(f"method {spec.name!r} needs a drafter; load one (ddtree.load(draft=...)) or use method='ar'")
    return info.load().make(spec, drafter, block_size, ngram_table)


def check_block_size(block_size, drafter_block: int) -> int:
    """None: the drafter's own block. Otherwise 2..drafter_block: the drafter was trained to fill its block,
    a longer one asks it for positions it never learned."""
    if block_size is None:
        return drafter_block
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size <= drafter_block:
        raise ConfigError(f"block_size must be >= 2 and at most the drafter's block ({drafter_block}), an integer; got "
                          f"{block_size!r}. Leave it unset to use the drafter's block")
    return block_size


class Decoder:
    """Runs one method over a target (and drafter) for one prompt at a time (batch size 1)."""

    def __init__(self, target, drafter=None, sync_stages: bool = False):
        self.target, self.drafter = target, drafter
        self.sync_stages = sync_stages  # on CUDA: synchronize at stage edges for per-stage GPU times (StageTimer)
        # the step's tree build, visibility and walk: its runtime's (a CPU runtime's C++ kernel), or the engine's own
        # (staged on the host for a target whose passes take host inputs)
        self.ops = step_ops_for(target)

    def compile(self, tree: DraftTree, start: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The verify pass's inputs beside the tokens: the visibility among the tree's nodes (bool [N, N]; None for a
        lone root) and their positions [N] after `start` cached ones."""
        return self.ops.visibility(tree.parents, tree.depths, start, self.target.device)

    def accept(self, tree: DraftTree, ancestors, logits, sampling: SamplingParams, generator):
        """The target's choices and the walk: greedy, all nodes at once (StepOps.greedy_walk); sampled, or with
        RowLogits (float32 CPU, target.RowLogits), only at the nodes the walk visits (on a CPU processing a
        whole-vocabulary distribution, and an LM-head row, cost real time per node). logits: [N, V] or RowLogits.
        Tests override this to plant a biased rule."""
        if sampling.greedy and isinstance(logits, torch.Tensor):
            return self.ops.greedy_walk(tree, ancestors, logits)
        return walk_drawn(tree, lambda i: int(choose(logits[i:i + 1], sampling, generator)[0]))

    def _validate(self, prompt_ids: list[int], method: Method, max_new_tokens: int, seed) -> None:
        cfg = self.target.cfg
        check_int("max_new_tokens", max_new_tokens, 1)
        if seed is not None:
            check_int("seed", seed)
            if not -2**63 <= seed < 2**64:
                raise ConfigError(f"seed {seed} does not fit in 64 bits: use one in 0..2**64 - 1")
        if not prompt_ids:
            raise ConfigError("the prompt is empty: give at least one token")
        if len(prompt_ids) > cfg.max_position_embeddings:
            raise ConfigError(f"the prompt has {len(prompt_ids)} tokens, more than the target's context limit of "
                              f"{cfg.max_position_embeddings}; shorten it")
        bad = [t for t in prompt_ids if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise ConfigError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{cfg.vocab_size - 1})")
        if method.uses_drafter and self.drafter is None:
            raise ConfigError(f"method {method.name!r} needs a drafter")
        check_budget(method.spec.budget, self.target.device)
        self.target.check_fresh()
        if method.uses_drafter:
            self.drafter.check_fresh()

    def generate(self, prompt_ids: list[int], method: Method, sampling: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 256, stops=(), seed: int | None = None,
                 trace: list | None = None) -> tuple[list[int], GenerationStats]:
        """Decode to the end: (tokens, stats). See steps()."""
        steps = self.steps(prompt_ids, method, sampling, max_new_tokens, stops, seed, trace)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def steps(self, prompt_ids: list[int], method: Method, sampling: SamplingParams = SamplingParams(),
              max_new_tokens: int = 256, stops=(), seed: int | None = None, trace: list | None = None):
        """A generator that yields each step's committed tokens as they are committed (the prefill's one
        first) and returns (tokens, stats). stops: a stops.Stops, or the stop token ids alone (their reason: "eos").
        trace: a list to append one record per decoding step to (the tree, the target's choices, the
        accepted path; see traces.py), or None. The time the consumer spends between yields is not counted.
        Bad input is refused here, before the first step."""
        self._validate(prompt_ids, method, max_new_tokens, seed)
        stops = stops if isinstance(stops, Stops) else Stops(eos=stops)
        return self._steps(prompt_ids, method, sampling, max_new_tokens, stops, seed, trace)

    def _steps(self, prompt_ids, method, sampling, max_new_tokens, stops, seed, trace):
        target, drafter, cfg = self.target, self.drafter, self.target.cfg
        method.prepare(target, drafter, sampling)
        device = target.device
        generator = None
        if not sampling.greedy and seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
        m = len(prompt_ids)
        capacity = min(cfg.max_position_embeddings, m + max_new_tokens + method.max_nodes())
        tcache = target.new_cache(capacity)
        dcache = drafter.new_cache(capacity) if method.uses_drafter else None
        taps = tuple(drafter.cfg.target_layer_ids) if method.uses_drafter else ()
        stats = GenerationStats(method.name, method.spec.budget, method.longest_draft(), m,
                                attention_backend=target.attention_backend,
                                backend=target.backend,
                                drafter=drafter.label if method.uses_drafter else "")
        timer = StageTimer(device, self.sync_stages)
        t0 = time.perf_counter()

        with timer("prefill"):
            ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
            out = target(ids, torch.arange(m, device=device), tcache, Visibility.causal(0, m, device), taps,
                         last_only=True)
            tcache.commit(m)
            emitted = [int(choose(out.logits, sampling, generator)[0])]
            if dcache is not None:
                drafter.add_context(dcache, out.taps)
            method.start(list(prompt_ids) + emitted)
        stats.time_to_first_token = time.perf_counter() - t0
        tokens = []

        while True:
            # commit the step's tokens (the accepted drafts and the bonus), cut after the token that ends the
            # generation (stops.cut: token by token, as plain decoding would) or at max_new_tokens
            kept = emitted[:stops.cut(emitted[:max_new_tokens - len(tokens)])]
            tokens.extend(kept)
            paused = time.perf_counter()
            yield kept
            t0 += time.perf_counter() - paused
            if stop_reason := stops.reason or _limit_reason(len(tokens), max_new_tokens, tcache.room):
                break
            start = tcache.length
            bonus = self.ops.root(tokens[-1], device)  # the root: the last committed token
            tree = method.propose(drafter, self.ops, dcache, bonus, tcache.room, timer)
            with timer("tree_compile"):
                ancestors, positions = self.compile(tree, start)
                vis = Visibility(start, ancestors)
            with timer("verify"):
                lazy = {"row_logits": True} if target.lazy_logits(tree.size) else {}
                out = target(tree.tokens, positions, tcache, vis, taps, **lazy)
                path, choices = self.accept(tree, ancestors, out.logits, sampling, generator)
            with timer("commit"):
                n = len(path)
                rows = None if path[-1] == n - 1 else self.ops.path_rows(path, device)  # a prefix needs no move
                tcache.commit(n, rows)
                if dcache is not None:
                    drafter.add_context(dcache, out.taps[:n] if rows is None else out.taps[rows])
            emitted = [choices[i] for i in path]
            method.observe(path, emitted)
            if trace is not None:
                trace.append(step_record(tree, choices, path))
            stats.acceptance_lengths.append(n)
            stats.tree_sizes.append(tree.size)

        stats.stop_reason, stats.stop_match = stop_reason, stops.match
        stats.seconds = time.perf_counter() - t0
        stats.new_tokens = len(tokens)
        stats.stage_seconds = dict(timer.seconds)
        return tokens, stats


def _limit_reason(new_tokens: int, max_new_tokens: int, room: int) -> str:
    if new_tokens >= max_new_tokens:
        return "max_new_tokens"
    return "context_limit" if room < 1 else ""

"""Shared fixtures: seeded random pairs, an oracle drafter that makes acceptance deep and branchy."""
from __future__ import annotations

import os
import random
import types
from contextlib import contextmanager

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on the CPU; it must be chosen before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ddtree.engine import cost_cache
from ddtree.runtime.cpu import qlinear
from ddtree.base.config import SamplingParams
from ddtree.models.drafter import untrained_drafter
from ddtree.models.fused import FusedLinear
from ddtree.models.protocol import reference as reference_model
from ddtree.runtime.cpu.runtime import Linear
from ddtree.engine.decoder import Decoder, make_method
from ddtree.bench.testing import random_pair, random_target
from ddtree.train.data import GenerationSettings, generate_data
from ddtree.train.prompts import Prompt
from ddtree.train.trainer import TrainConfig

torch.set_num_threads(1)  # tiny models: per-op overhead dominates, threads only contend


@pytest.fixture(autouse=True, scope="session")
def _cpu_kernel_from_the_users_cache():
    """Load the CPU kernel once, from the user's cache (built there on the first run), before any test points
    DDTREE_CACHE at a temporary folder: the first kernel use of the session would otherwise compile it there
    again, on every run."""
    qlinear.cpu_kernel_available()


@pytest.fixture(autouse=True, scope="session")
def _verify_costs_in_a_temporary_folder(tmp_path_factory):
    """The adaptive budget's cost curves of the tests' tiny models stay out of the user's cache."""
    folder = tmp_path_factory.mktemp("verify-costs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cost_cache, "costs_dir", lambda: folder)
        yield


def pytest_collection_modifyitems(items):
    """A test of the real embedded model is a slow one too: `-m "not slow"` leaves it out."""
    for item in items:
        if item.get_closest_marker("real_model") is not None:
            item.add_marker(pytest.mark.slow)


def plant_oracle(drafter, reference: list[int], seed: int = 0, top1: float = 0.6, vocab_noise: float = 1.0):
    """Make drafter.draft() predict `reference` (prompt + the target's greedy output): the right token is
    ranked first with probability top1, else second or third. A random drafter accepts almost nothing; this
    one gives long, branching accepted paths, so tree walks and non-prefix KV compaction get exercised."""
    gen = torch.Generator().manual_seed(seed)
    vocab = drafter.cfg.model.vocab_size

    def draft(self, cache, bonus, length=None):
        self.flush_context(cache)  # as the real draft(): the queued context first, so cache.length is current
        length = length or self.block_size
        logits = torch.randn(length - 1, vocab, generator=gen) * vocab_noise
        for i in range(1, length):
            pos = cache.length + i
            if pos < len(reference):
                rank = 0 if torch.rand((), generator=gen) < top1 else int(torch.randint(1, 3, (), generator=gen))
                top = logits[i - 1].topk(3).values
                logits[i - 1, reference[pos]] = top[rank] + (1e-3 if rank == 0 else 0.0)
                if rank:  # push the token that held this rank just below it
                    logits[i - 1, reference[pos]] += 1e-4
        if self.cfg.reduced_vocab:  # a reduced draft vocabulary drafts only its own tokens: keep their columns
            logits = logits[:, torch.arange(self.cfg.draft_vocab_size) + self.d2t.cpu()]
        weight = reference_model(self).fc.weight
        return logits.to(weight.device, weight.dtype)

    drafter.draft = types.MethodType(draft, drafter)
    return drafter


@pytest.fixture
def pairs():
    """Seeded random (target, drafter) pairs for Llama and Qwen3 targets."""
    return {arch: random_pair(arch, seed=11, num_draft_layers=2, block_size=8, init_scale=0.25)
            for arch in ("llama", "qwen3")}


def run(target, drafter, prompt, method, budget=16, block_size=None, max_new_tokens=24, stop_ids=(),
        sampling=SamplingParams(), seed=None):
    dec = Decoder(target, drafter)
    return dec.generate(prompt, make_method(method, budget, block_size, drafter), sampling, max_new_tokens,
                        stop_ids, seed)


def assert_same_tokens(pair_a, pair_b, what: str, seed: int, prompts: int = 4) -> None:
    """ar, dflash and ddtree (budget 16) decode the same tokens on two (target, drafter) pairs, over seeded random
    prompts: `what` names the difference between the pairs in the failure message."""
    rng = random.Random(seed)
    for _ in range(prompts):
        prompt = [rng.randrange(96) for _ in range(rng.randint(1, 30))]
        for method in ("ar", "dflash", "ddtree"):
            a, _ = run(*pair_a, prompt, method, budget=16, max_new_tokens=24)
            b, _ = run(*pair_b, prompt, method, budget=16, max_new_tokens=24)
            assert a == b, f"{method} differs between {what}"


# --- the training tests' shared data (tests/test_train_*.py, test_trainer.py) ---------------------------------
def id_prompts(n, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [Prompt(f"ids/{i}", "ids", ids=torch.randint(3, vocab, (6 + i % 5,), generator=gen).tolist())
            for i in range(n)]


def repeating_target():
    """A tiny random Llama whose layers add nothing (o_proj and down_proj zeroed): with tied embeddings its
    greedy continuation repeats the last token, which a drafter can learn in a few dozen steps."""
    target = random_target("llama", seed=7, init_scale=0.3)
    with torch.no_grad():
        for layer in target.model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return target


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    target = repeating_target()
    out = tmp_path_factory.mktemp("data")
    settings = GenerationSettings(max_new_tokens=40, slots=4, chunk_size=8, sampled_fraction=0.0)
    generate_data(target, None, id_prompts(40, target.cfg.vocab_size), out, settings, stop_ids=(),
                  heldout_fraction=0.1, progress=False)
    return target, out


def train_config(**kw):
    base = dict(lr=3e-3, epochs=4, seqs_per_step=2, anchors=16, warmup=0.1, eval_prompts=0, val_sequences=4,
                checkpoint_every=0, progress=False)
    return TrainConfig(**{**base, **kw})


def new_drafter(target, draft_vocab=None):
    return untrained_drafter(target, num_layers=1, block_size=8, seed=1, mask_token_id=0,
                             draft_vocab=draft_vocab).requires_grad_(True)


class _RuntimeLinear(nn.Module):
    """A linear layer's place taken by the runtime's Linear (reference_arithmetic), holding the same weight and bias
    (the same parameters, in the same order: the weights' guard sees the same model)."""

    def __init__(self, layer: nn.Module, kernel):
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias
        self.impl = Linear(layer.weight, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.impl(x)
        return y if self.bias is None else y + self.bias


@contextmanager
def reference_arithmetic(runtime):
    """While it lasts, a CPU runtime's (CPUTarget / CPUDrafter) passes run its reference's eager layers (no stack),
    with every linear layer on the runtime's Linear (the row kernel's sums): the arithmetic that the stack is held
    bit-equal to by the tests. The reference's modules are restored afterwards, untouched. (A test oracle: it
    lived in ddtree/runtime/cpu/runtime.py, which never used it.)"""
    linears = [(module, name, child) for module in runtime.model.modules()
               for name, child in module._modules.items()
               if isinstance(child, (nn.Linear, FusedLinear, qlinear.QLinear)) and name != "lm_head"]  # the runtime's
    saved = {name: getattr(runtime, name) for name in ("stack", "context", "one_call") if hasattr(runtime, name)}
    try:
        for module, name, child in linears:  # not setattr: no registration, so the weights' guard sees no change
            module._modules[name] = _RuntimeLinear(child, runtime.kernel)
        for name in saved:
            setattr(runtime, name, None)
        yield runtime
    finally:
        for module, name, child in linears:
            module._modules[name] = child
        for name, value in saved.items():
            setattr(runtime, name, value)

"""The method vocabulary, parsed in one place: `ar`, `hf`, `llamacpp`, `dflash`, `ddtree`, `ddtree:N`, `ddtree:auto`.

`pair.generate`, `compare`, the command line, the benchmark and the plots all turn the user's words into a
`MethodSpec` here, so a bad budget gets the same clear error everywhere (`ddtree:0`, `--budgets 0`,
`budget=False` are refused, never replaced by a default) and the default budget is defined once.

    ar           plain autoregressive decoding with a KV cache: the baseline every speedup is measured against
    hf           Hugging Face generate() on the same weights (compare and the benchmark; greedy only)
    llamacpp     llama.cpp's plain greedy decoding of the target's weights in the same precision (a GGUF
                 written by ddtree); llamacpp:gguf, of the GGUF file the target was loaded from (e.g. Q4_1).
                 Compare and the benchmark, greedy only, with llama-cpp-python installed (ddtree/llamacpp_baseline.py)
    dflash       linear DFlash: one drafted block verified as a chain
    ddtree:N     DDTree: a best-first tree of N draft nodes per step (bare `ddtree`: default_budget(device))
    ddtree:auto  DDTree with the adaptive per-step budget (ddtree/budget.py)
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from .config import ConfigError

NAMES = ("ar", "hf", "llamacpp", "dflash", "ddtree")
PEERS = ("hf", "llamacpp")  # other programs' plain decoding: compare and the benchmark only, greedy only
LLAMACPP_VARIANTS = ("gguf",)  # llamacpp:gguf, the target's own GGUF file
DEFAULT_BUDGET = 64  # draft nodes per step for a bare `ddtree` on a GPU (or where the device is not known)
AUTO = "auto"  # the adaptive budget
# The largest budget a step may verify, by device type: a step commits at most block_size (16) tokens whatever its
# budget, while a verify's cost grows with its nodes. On a CPU past the largest tree calibrate() measures (512: a
# verify then costs far more than 16 plain steps); elsewhere past 4096 nodes. Larger budgets are refused.
MAX_BUDGET = {"cpu": 512}
MAX_BUDGET_ELSEWHERE = 4096


def check_budget(budget, device) -> None:
    """A ConfigError for an integer budget a step on `device` could never repay."""
    kind = getattr(device, "type", str(device).split(":")[0])
    limit = MAX_BUDGET.get(kind, MAX_BUDGET_ELSEWHERE)
    if isinstance(budget, int) and budget > limit:
        raise ConfigError(f"budget {budget} is more than a step can repay on {kind}: a step verifies budget + 1 "
                          f"tree nodes in one pass but commits at most one block of tokens; use a budget of at "
                          f"most {limit}, or ddtree:auto (which sizes each step's tree from measured costs)")
SYNTAX = "ar, hf, llamacpp, llamacpp:gguf, dflash, ddtree, ddtree:N (N >= 1 draft nodes per step) or ddtree:auto"


def default_budget(device=None) -> int | str:
    """A bare `ddtree`'s budget: DEFAULT_BUDGET on a GPU, where a 65-node verify costs about one plain step; `auto` on
    a CPU, where a verify's cost grows with its nodes (SmolLM2 on the 2-core AVX2 EPYC, 2 prompts x 64 tokens per
    evaluation set: a 65-node step ~20x a plain one, `ddtree:64` 0.12-0.21x `ar`, `auto` 1.00-1.24x). Its cost curve is measured on first use (~2 s
    there) and cached on disk. device None (not known yet): DEFAULT_BUDGET."""
    if device is None:
        return DEFAULT_BUDGET
    return AUTO if getattr(device, "type", str(device).split(":")[0]) == "cpu" else DEFAULT_BUDGET


def parse_budget(value) -> int | str:
    """A DDTree budget: an integer >= 1 (draft nodes per step; int or its decimal string) or 'auto'."""
    if isinstance(value, str):
        text = value.strip()
        if text == AUTO:
            return AUTO
        if text.isascii() and text.isdigit() and int(text) >= 1:
            return int(text)
    elif not isinstance(value, bool):  # True is an int to Python, not a budget
        try:
            number = operator.index(value)  # int and numpy integers; never floats
        except TypeError:
            number = 0
        if number >= 1:
            return number
    raise ConfigError(f"budget must be an integer >= 1 (draft nodes per step) or 'auto', got {value!r}")


@dataclass(frozen=True)
class MethodSpec:
    """One method, validated: `name` in NAMES; `budget` set for ddtree only (an int >= 1 or 'auto'); `variant`
    for llamacpp only (None: a GGUF of the same weights and precision; 'gguf': the target's own GGUF file)."""
    name: str
    budget: int | str | None = None
    variant: str | None = None

    def __post_init__(self):
        if self.name not in NAMES:
            raise ConfigError(f"unknown method {self.name!r}; use {SYNTAX}")
        if self.name == "ddtree":
            object.__setattr__(self, "budget", parse_budget(self.budget))
        elif self.budget is not None:
            raise ConfigError(f"only ddtree takes a budget, got {self.name}:{self.budget}; use {SYNTAX}")
        if self.variant is not None and (self.name != "llamacpp" or self.variant not in LLAMACPP_VARIANTS):
            raise ConfigError(f"unknown method {self.name}:{self.variant}; use {SYNTAX}")

    @property
    def label(self) -> str:
        """The name a record, a table row and a plot use: 'ar', 'dflash', 'ddtree:16', 'ddtree:auto',
        'llamacpp:gguf'."""
        if self.name == "ddtree":
            return f"{self.name}:{self.budget}"
        return f"{self.name}:{self.variant}" if self.variant else self.name

    @property
    def peer(self) -> bool:
        """Another program's plain decoding (hf, llamacpp): not our decoding loop; greedy only."""
        return self.name in PEERS

    @property
    def adaptive(self) -> bool:
        return self.budget == AUTO

    @classmethod
    def parse(cls, method: "str | MethodSpec", budget=None, device=None) -> "MethodSpec":
        """'ddtree:32' -> ddtree at 32 nodes. A bare 'ddtree' takes `budget` (None: default_budget(device)); other
        methods ignore it, but a bad `budget` is refused whatever the method."""
        default = default_budget(device) if budget is None else parse_budget(budget)
        if isinstance(method, MethodSpec):
            return method
        if not isinstance(method, str):
            raise ConfigError(f"a method is a string ({SYNTAX}), got {method!r}")
        name, colon, explicit = method.strip().partition(":")
        if colon and name == "llamacpp":
            return cls(name, variant=explicit)
        if colon:
            if name != "ddtree":
                raise ConfigError(f"only ddtree takes a budget, got {method!r}; use {SYNTAX}")
            try:
                return cls(name, parse_budget(explicit))
            except ConfigError as e:
                raise ConfigError(f"bad budget in {method!r}: {e}; write e.g. ddtree:64 or ddtree:auto") from None
        return cls(name, default if name == "ddtree" else None)


def parse_methods(methods, budgets=None, device=None) -> list[MethodSpec]:
    """Methods as a comma-separated string or a list, `ar` first (it is the reference), duplicates dropped.
    A bare `ddtree` expands to one spec per budget in `budgets` (comma-separated or a list; None:
    default_budget(device))."""
    names = methods.split(",") if isinstance(methods, str) else list(methods)
    if isinstance(budgets, str):
        budgets = [b for b in budgets.split(",") if b.strip()]
        if not budgets:
            raise ConfigError("no budgets given: write e.g. 16,64,auto")
    budget_list = [default_budget(device)] if budgets is None else [parse_budget(b) for b in budgets]
    specs = [MethodSpec("ar")]
    for method in names:
        if isinstance(method, str) and not method.strip():
            continue
        if isinstance(method, str) and method.strip() == "ddtree":
            specs += [MethodSpec("ddtree", b) for b in budget_list]
        else:
            specs.append(MethodSpec.parse(method))
    return list(dict.fromkeys(specs))

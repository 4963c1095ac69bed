"""The method registry and vocabulary: `ar`, `hf`, `llamacpp`, `dflash`, `ddtree`, `ddtree:N`, `ddtree:auto`, and
`ddtree:N+lookup` (a context-lookup chain grafted onto each step's tree: lookup.py).

Every method is one `MethodInfo` in `METHODS`: its factory (the strategy the decoding loop runs, or the peer
program that decodes beside it) and what the engine, `compare`, the benchmark, the command line and the plots
need to know about it. Nothing else branches on a method's name. `pair.generate`, `compare`, the command line,
the benchmark and the plots all turn the user's words into a `MethodSpec` here, so a bad budget gets the same
clear error everywhere (`ddtree:0`, `--budgets 0`, `budget=False` are refused, never replaced by a default) and
the default budget is defined once.
"""
from __future__ import annotations

import importlib
import operator
from dataclasses import dataclass, field

from ..base.config import ConfigError


@dataclass(frozen=True)
class MethodInfo:
    """One method. `factory` is "module:attribute", imported on first use, so this registry sits below the
    modules that implement the methods: a decoding strategy is a class of ddtree.engine.decoder made by
    `make(spec, drafter, block_size)`; a peer is a class made by `Peer(pair, spec)` with `.generate(...)` and a
    `problem()` static method that says why it cannot run here (None when it can)."""
    name: str
    summary: str  # one line: --help, the README's table
    factory: str
    peer: bool = False  # another program's plain decoding: compare and the benchmark only, greedy only
    takes_budget: bool = False  # ddtree:N / ddtree:auto
    takes_lookup: bool = False  # ddtree:N+lookup
    variants: tuple[str, ...] = ()  # llamacpp:gguf
    uses_drafter: bool = False
    check: str = "exact"  # how its greedy tokens are checked against ar's: reference / exact / agreement
    rank: int = 9  # order in tables and plots
    display: str = ""  # the name plots give it
    color: str = "#4c72b0"  # its line in the plots
    linestyle: object = "--"  # matplotlib's, for a method drawn as one level line beside the budget curve
    variant_styles: dict = field(default_factory=dict)  # variant -> (display, color)

    def style(self, variant: str | None) -> tuple[str, str]:
        """(display name, color) of the method or of one of its variants."""
        return self.variant_styles.get(variant, (self.display, self.color))

    def load(self):
        module, _, attribute = self.factory.partition(":")
        return getattr(importlib.import_module(module), attribute)


METHODS: dict[str, MethodInfo] = {info.name: info for info in (
    MethodInfo("ar", "plain autoregressive decoding with a KV cache: the reference every speedup and check uses",
               "ddtree.engine.decoder:AR", check="reference", rank=0, display="AR", color="black"),
    MethodInfo("hf", "Hugging Face generate() on the same weights (compare and the benchmark; greedy only)",
               "ddtree.bench.hf_baseline:HFBaseline", peer=True, rank=1, display="HF generate()", color="#8c8c8c",
               linestyle=(0, (1, 1))),
    MethodInfo("llamacpp", "llama.cpp's plain decoding of the target's weights in the same precision (a GGUF written "
               "by ddtree); llamacpp:gguf, of the GGUF file the target was loaded from (compare and the benchmark, "
               "greedy only, with llama-cpp-python installed)", "ddtree.bench.llamacpp_baseline:LlamaCppBaseline",
               peer=True, variants=("gguf",), check="agreement", rank=2, display="llama.cpp, same weights",
               color="#c44e52", linestyle=(0, (5, 2)), variant_styles={"gguf": ("llama.cpp, GGUF file", "#937860")}),
    MethodInfo("dflash", "linear DFlash: one drafted block verified as a chain", "ddtree.engine.decoder:DFlash",
               uses_drafter=True, rank=3, display="DFlash", color="#4c72b0"),
    MethodInfo("ddtree", "DDTree: a best-first tree of N draft nodes per step (ddtree:N; a bare ddtree: the default "
               "budget) or the adaptive per-step budget (ddtree:auto)", "ddtree.engine.decoder:DDTree",
               takes_budget=True, takes_lookup=True, uses_drafter=True, rank=4, display="DDTree", color="#dd8452"),
)}
NAMES = tuple(METHODS)
REFERENCE = next(name for name, info in METHODS.items() if info.check == "reference")  # ar
DEFAULT_BUDGET = 64  # draft nodes per step for a bare `ddtree` on a GPU (or where the device is not known)
AUTO = "auto"  # the adaptive budget
LOOKUP = "lookup"  # ddtree:N+lookup: each step's tree also holds a chain copied from the context (lookup.py)
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
SYNTAX = ("ar, hf, llamacpp, llamacpp:gguf, dflash, ddtree, ddtree:N (N >= 1 draft nodes per step) or ddtree:auto; "
          "a ddtree with +lookup (ddtree:4+lookup) also grafts a chain copied from the context")


def default_budget(device=None) -> int | str:
    """A bare `ddtree`'s budget: DEFAULT_BUDGET on a GPU, where a 65-node verify costs about one plain step; `auto` on
    a CPU, where a verify's cost grows with its nodes, so a fixed large tree loses to plain decoding. Its cost
    curve is measured on first use (seconds) and cached on disk. device None (not known yet): DEFAULT_BUDGET."""
    if device is None:
        return DEFAULT_BUDGET
    return AUTO if getattr(device, "type", str(device).split(":")[0]) == "cpu" else DEFAULT_BUDGET


def default_lookup(device=None) -> bool:
    """Whether a bare `ddtree` given no budget also grafts the context lookup (`ddtree:auto+lookup`): on a CPU, where
    it measured at or above `ddtree:auto` on every set, in both target modes and at both temperatures
    (docs/cpu-speed.md); not on a GPU, where it has not been measured."""
    return device is not None and default_budget(device) == AUTO


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
    for llamacpp only (None: a GGUF of the same weights and precision; 'gguf': the target's own GGUF file);
    `lookup` for ddtree only (the context lookup's chain grafted onto each tree)."""
    name: str
    budget: int | str | None = None
    variant: str | None = None
    lookup: bool = False

    def __post_init__(self):
        if self.name not in METHODS:
            raise ConfigError(f"unknown method {self.name!r}; use {SYNTAX}")
        if self.info.takes_budget:
            object.__setattr__(self, "budget", parse_budget(self.budget))
        elif self.budget is not None:
            raise ConfigError(f"only ddtree takes a budget, got {self.name}:{self.budget}; use {SYNTAX}")
        if self.variant is not None and self.variant not in self.info.variants:
            raise ConfigError(f"unknown method {self.name}:{self.variant}; use {SYNTAX}")
        if self.lookup is not False and (self.lookup is not True or not self.info.takes_lookup):
            raise ConfigError(f"only ddtree takes +{LOOKUP} (and lookup is True or False), got {self.name} with "
                              f"lookup={self.lookup!r}; use {SYNTAX}")

    @property
    def info(self) -> MethodInfo:
        return METHODS[self.name]

    @property
    def label(self) -> str:
        """The name a record, a table row and a plot use: 'ar', 'dflash', 'ddtree:16', 'ddtree:auto',
        'ddtree:4+lookup', 'llamacpp:gguf'."""
        if self.info.takes_budget:
            return f"{self.name}:{self.budget}" + (f"+{LOOKUP}" if self.lookup else "")
        return f"{self.name}:{self.variant}" if self.variant else self.name

    @property
    def peer(self) -> bool:
        """Another program's plain decoding (hf, llamacpp): not our decoding loop; greedy only."""
        return self.info.peer

    @property
    def adaptive(self) -> bool:
        return self.budget == AUTO

    @classmethod
    def parse(cls, method: "str | MethodSpec", budget=None, device=None) -> "MethodSpec":
        """'ddtree:32' -> ddtree at 32 nodes; 'ddtree:32+lookup' with the context lookup. A bare 'ddtree' (or
        'ddtree+lookup') takes `budget`; given none, it is the device's default: default_budget(device), with the
        lookup where default_lookup(device). Other methods ignore `budget`, but a bad one is refused whatever the
        method."""
        default = default_budget(device) if budget is None else parse_budget(budget)
        if isinstance(method, MethodSpec):
            return method
        if not isinstance(method, str):
            raise ConfigError(f"a method is a string ({SYNTAX}), got {method!r}")
        text, plus, option = method.strip().partition("+")
        if plus:
            if option.strip() != LOOKUP:
                raise ConfigError(f"unknown option +{option} in {method!r}; the one option is +{LOOKUP}: use {SYNTAX}")
            spec = cls.parse(text, budget, device)
            if not spec.info.takes_lookup:
                raise ConfigError(f"only ddtree takes +{LOOKUP}, got {method!r}; use {SYNTAX}")
            return cls(spec.name, spec.budget, spec.variant, lookup=True)
        name, colon, explicit = text.partition(":")
        info = METHODS.get(name)
        if colon and info is not None and info.variants:
            return cls(name, variant=explicit)
        if colon:
            if info is None or not info.takes_budget:
                raise ConfigError(f"only ddtree takes a budget, got {method!r}; use {SYNTAX}")
            try:
                return cls(name, parse_budget(explicit))
            except ConfigError as e:
                raise ConfigError(f"bad budget in {method!r}: {e}; write e.g. ddtree:64 or ddtree:auto") from None
        if info is not None and info.takes_budget:
            return cls(name, default, lookup=budget is None and default_lookup(device))
        return cls(name)


def parse_methods(methods, budgets=None, device=None) -> list[MethodSpec]:
    """Methods as a comma-separated string or a list, `ar` first (it is the reference), duplicates dropped.
    A bare `ddtree` expands to one spec per budget in `budgets` (comma-separated or a list; None: the device's
    default, MethodSpec.parse)."""
    names = methods.split(",") if isinstance(methods, str) else list(methods)
    if isinstance(budgets, str):
        budgets = [b for b in budgets.split(",") if b.strip()]
        if not budgets:
            raise ConfigError("no budgets given: write e.g. 16,64,auto")
    budget_list = None if budgets is None else [parse_budget(b) for b in budgets]
    specs = [MethodSpec(REFERENCE)]
    for method in names:
        if isinstance(method, str) and not method.strip():
            continue
        info = METHODS.get(method.strip().partition("+")[0]) if isinstance(method, str) else None
        if info is not None and info.takes_budget and budget_list is None:  # a bare ddtree: the device's default
            specs.append(MethodSpec.parse(method, None, device))
        elif info is not None and info.takes_budget:  # a bare ddtree (+lookup): one spec per budget
            lookup = MethodSpec.parse(method, budget_list[0]).lookup  # refuses a bad option
            specs += [MethodSpec(info.name, b, lookup=lookup) for b in budget_list]
        else:
            specs.append(MethodSpec.parse(method))
    return list(dict.fromkeys(specs))

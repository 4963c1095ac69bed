"""load()'s settings as one object, and the command line's model flags that fill it.

One rule for every knob: an explicit argument > its DDTREE_* variable > the default, read once, when a pair is
loaded (LoadOptions.resolve); nothing below load() reads the environment. An argument left at None (for a choice,
also "auto") is not given. The variables follow ddtree/base/knobs.py's rules (booleans: 0/1/false/true/no/yes/
off/on in any case):

  knob          argument (load / CLI)                       variable                default
  cpu_kernel    cpu_kernel="off" / --cpu-kernel off         DDTREE_CPU_KERNEL=0     on (where the CPU has AVX2)
  cpu_isa       cpu_kernel="avx2"|"avx512" / --cpu-kernel   DDTREE_CPU_ISA          auto: the CPU's own
  gguf_blocks   gguf_blocks=False / --no-gguf-blocks        DDTREE_GGUF_BLOCKS      True
  markov_head   markov_head=True / --markov-head            DDTREE_MARKOV_HEAD      False
  ngram_table   ngram_table=False / --no-ngram-table        DDTREE_NGRAM_TABLE      True (where the drafter has one)
  cuda_graphs   cuda_graphs=False                           DDTREE_CUDA_GRAPHS      True
  attention     attention_backend / --attention             DDTREE_ATTENTION        auto: triton on CUDA, else sdpa
  threads       threads=N / --threads N                     DDTREE_THREADS          the cores other processes
                                                                                    leave free (measured at load)
  quant         quant="gguf"|"gguf-int8" / --quant          -                       None (the float model)
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from enum import Enum

from .config import CPU_KERNELS, ConfigError, check_int, cli_int
from .knobs import env_choice, env_flag, env_int
from .machine_load import LoadMeter, busy_cores, default_threads

ISAS = ("auto", "avx2", "avx512")
ATTENTION_BACKENDS = ("auto", "sdpa", "triton")  # models/attention.py's BACKENDS
TARGET_BACKENDS = ("auto", "own", "hf")


class Quant(str, Enum):
    """What the target's linear layers run on (CPU): its GGUF's own Q4_1 / Q8_0 blocks with float32 activations,
    or the same blocks with int8 activations (llama.cpp's arithmetic: another function than the float model)."""

    GGUF = "gguf"
    GGUF_INT8 = "gguf-int8"

    @property
    def int8(self) -> bool:
        return self is Quant.GGUF_INT8

    @classmethod
    def parse(cls, value) -> "Quant | None":
        """None, a Quant, or its name ("gguf", "gguf-int8"); anything else is a ConfigError naming the choices."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str) and value in QUANTS:
            return cls(value)
        raise ConfigError(f"unknown quant {value!r}; choose 'gguf' (the target GGUF's own blocks, float activations) "
                          "or 'gguf-int8' (the same blocks with int8 activations: llama.cpp's arithmetic)")


QUANTS = tuple(q.value for q in Quant)


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):  # "no" is truthy: a string would turn on what it names off
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


@dataclass(frozen=True)
class LoadOptions:
    """The knobs of a loaded pair, resolved (see the module docstring for the rule and the variables)."""

    cpu_kernel: bool = True  # the C++ kernels on a float32 CPU (False: torch's matmuls, the reference arithmetic)
    cpu_isa: str = "auto"  # their build: auto (the CPU's own), avx2 or avx512
    gguf_blocks: bool = True  # a float target converted from a GGUF reads its exact blocks for narrow passes
    markov_head: bool = False  # a drafter's Markov head drafts each node's children (if it has one)
    ngram_table: bool = True  # the lookup of ddtree:N+lookup falls back on the drafter's n-gram table (if it has one)
    cuda_graphs: bool = True  # the CUDA runtime (captured graphs) on a GPU with the Triton backend
    attention: str = "auto"  # auto, sdpa or triton
    quant: Quant | None = None
    threads: int | None = None  # torch's CPU threads; None: the machine's (set at load)

    def __post_init__(self):
        for name in ("cpu_kernel", "gguf_blocks", "markov_head", "ngram_table", "cuda_graphs"):
            _flag(name, getattr(self, name))
        if self.cpu_isa not in ISAS:
            raise ConfigError(f"unknown cpu_isa {self.cpu_isa!r}; choose one of {', '.join(ISAS)}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ConfigError(f"unknown attention backend {self.attention!r}; choose one of "
                              f"{', '.join(ATTENTION_BACKENDS)}")
        object.__setattr__(self, "quant", Quant.parse(self.quant))
        if self.threads is not None:
            check_int("threads", self.threads, 1)

    @property
    def kernel(self) -> str:
        """The CPU kernels' choice as qlinear takes it: "off", "auto", "avx2" or "avx512"."""
        return self.cpu_isa if self.cpu_kernel else "off"

    @property
    def int8(self) -> bool:
        """Does the target quantize its activations to int8 (quant='gguf-int8')?"""
        return self.quant is not None and self.quant.int8

    @classmethod
    def resolve(cls, cpu_kernel: str | None = None, gguf_blocks: bool | None = None,
                markov_head: bool | None = None, cuda_graphs: bool | None = None, attention: str | None = None,
                quant=None, threads: int | None = None, ngram_table: bool | None = None) -> "LoadOptions":
        """The options of one load: each knob from its argument where given, else its DDTREE_* variable, else
        the default. cpu_kernel is load()'s: "auto" (or None), "avx2", "avx512" (the build: cpu_isa) or "off"."""
        if cpu_kernel is not None and cpu_kernel not in CPU_KERNELS:
            raise ConfigError(f"unknown cpu_kernel {cpu_kernel!r}; choose one of {', '.join(CPU_KERNELS)}")
        given = None if cpu_kernel in (None, "auto") else cpu_kernel
        on = given != "off" if given else env_flag("DDTREE_CPU_KERNEL", True)
        isa = given if given in ("avx2", "avx512") else env_choice("DDTREE_CPU_ISA", ISAS, "auto")
        return cls(
            cpu_kernel=on, cpu_isa=isa if on else "auto",
            gguf_blocks=env_flag("DDTREE_GGUF_BLOCKS", True) if gguf_blocks is None else _flag("gguf_blocks",
                                                                                              gguf_blocks),
            markov_head=env_flag("DDTREE_MARKOV_HEAD", False) if markov_head is None else _flag("markov_head",
                                                                                                markov_head),
            ngram_table=env_flag("DDTREE_NGRAM_TABLE", True) if ngram_table is None else _flag("ngram_table",
                                                                                              ngram_table),
            cuda_graphs=env_flag("DDTREE_CUDA_GRAPHS", True) if cuda_graphs is None else _flag("cuda_graphs",
                                                                                              cuda_graphs),
            attention=(env_choice("DDTREE_ATTENTION", ATTENTION_BACKENDS, "auto") if attention in (None, "auto")
                       else attention),
            quant=quant,
            threads=env_int("DDTREE_THREADS", 1) if threads is None else check_int("threads", threads, 1),
        )


def machine_threads(world: int = 1, busy: float | None = None, notice: bool = True,
                    meter: LoadMeter | None = None) -> int:
    """The threads a process gets by default: the cores other processes leave free (measured over 0.5 s where
    `busy` is not given: since `meter` was made, or from now), shared by `world` processes; with a one-line notice
    on stderr when other processes keep cores busy."""
    if busy is None:
        busy = busy_cores(0.5) if meter is None else meter.lap_after(0.5)
    threads = default_threads(world, busy)
    if notice and busy is not None and round(busy) >= 1:
        print(f"ddtree: other processes keep {busy:.1f} cores busy: {threads} thread(s) (--threads, "
              "load(threads=) or DDTREE_THREADS to choose)", file=sys.stderr, flush=True)
    return threads


def load_threads(options: LoadOptions, current: int, meter: LoadMeter | None = None) -> int:
    """The torch threads a load sets: options.threads where given (argument or DDTREE_THREADS), else the cores
    other processes leave free (machine_threads; `meter`: made when the load began), never more than the process
    has now (`current`: torch's default, or what its caller set; at 1 nothing is measured)."""
    if options.threads is not None:
        return options.threads
    return current if current <= 1 else min(current, machine_threads(meter=meter))


# --- the command line's model flags (python -m ddtree generate/compare/chat/serve and the benchmark) --------------
def add_model_args(p: argparse.ArgumentParser, quant: bool = True) -> None:
    """The flags that say which pair to load and how (load()'s arguments). quant=False leaves --quant to the
    caller (the benchmark's takes several target modes)."""
    p.add_argument("--target", help="HF model directory, .gguf file or hub id org/name[@revision] (default: "
                                    "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="DFlash drafter directory or hub id (default: the shipped drafter for the "
                                   "default target)")
    p.add_argument("--markov-head", action="store_true", default=None,
                   help="use the drafter's Markov head: each tree node's children from its own conditional "
                        "(ddtree/models/markov.py; DDTREE_MARKOV_HEAD=1 where not given)")
    p.add_argument("--no-ngram-table", dest="ngram_table", action="store_false", default=None,
                   help="the context lookup (ddtree:N+lookup) does not fall back on the drafter's table of the "
                        "target's own 3-gram continuations (ddtree/engine/ngram_table.py; DDTREE_NGRAM_TABLE=0)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", help="float32 or bfloat16 (default: bfloat16 on CUDA, float32 on every CPU)")
    p.add_argument("--attention", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="attention backend (default: DDTREE_ATTENTION where set, else triton on CUDA, sdpa "
                        "elsewhere)")
    if quant:
        p.add_argument("--quant", choices=QUANTS,
                       help="gguf: run the target on its GGUF's own Q4_1 / Q8_0 blocks (CPU, float32 activations); "
                            "gguf-int8: the same blocks with int8 activations (llama.cpp's arithmetic)")
    p.add_argument("--cpu-kernel", default="auto", choices=CPU_KERNELS,
                   help="the CPU kernels' build: auto (DDTREE_CPU_KERNEL / DDTREE_CPU_ISA where set, else this "
                        "CPU's), avx2, avx512, or off (torch's matmuls only: the reference arithmetic, slower)")
    p.add_argument("--no-gguf-blocks", dest="gguf_blocks", action="store_false", default=None,
                   help="a float target converted from a GGUF reads only its float weights, not the file's exact "
                        "blocks (the same bits, more bytes; to compare with llama.cpp F32)")
    p.add_argument("--backend", default="auto", choices=list(TARGET_BACKENDS),
                   help="target backend: own-code model (llama/qwen2/qwen3/mistral) or any Hugging Face causal LM "
                        "(default: own where it covers the architecture, else hf)")
    p.add_argument("--threads", type=cli_int(1),
                   help="torch CPU threads per process (default: DDTREE_THREADS where set, else the cores other "
                        "processes leave free)")


def load_options_from(args: argparse.Namespace) -> dict:
    """load()'s keyword arguments from the flags add_model_args added (a flag not given is None or "auto": the
    environment, then the default, decide; --quant where the parser has it)."""
    return dict(target=args.target, draft=args.draft, device=args.device, dtype=args.dtype,
                attention_backend=args.attention, backend=args.backend, quant=getattr(args, "quant", None),
                cpu_kernel=args.cpu_kernel, gguf_blocks=args.gguf_blocks, markov_head=args.markov_head,
                threads=args.threads, ngram_table=args.ngram_table)

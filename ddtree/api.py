"""The Python API: `ddtree.load()` gives a target/drafter pair; `pair.generate()` decodes with one method,
`pair.stream()` the same, handing out the text as it is committed; `ddtree.compare()` runs several methods on
the same prompts and checks them against plain decoding."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from .models.attention import Visibility
from .engine.checker import Verdict, check_tokens
from .base.config import ConfigError, SamplingParams
from .base.gc_pause import gc_paused
from .base.machine_load import LoadMeter
from .runtime.cpu.qlinear import resolve_cpu_kernel
from .runtime.attach import attach
from .runtime.cpu.runtime import cpu_target
from .models.drafter import DFlashDrafter, untrained_drafter, warn_untrained
from .engine.decoder import Decoder, Method, make_method
from .base.hub import resolve as resolve_hub
from .base.options import QUANTS, LoadOptions, Quant, load_threads  # noqa: F401 - QUANTS: the CLI's choices
from .models.loading import (SHIPPED_DRAFTER, default_dtype, load_target, load_tokenizer, parse_dtype, resolve_device,
                      resolve_target_dir, source_gguf, stop_token_ids)
from .engine.method_spec import MethodSpec
from .engine.ngram_table import FILE as NGRAM_FILE, NgramTable
from .engine.stats import GenerationStats
from .engine.stops import Stops, check_stop, check_stop_token_ids


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    stats: GenerationStats
    prompt_ids: list[int] = field(default_factory=list)
    trace: list[dict] | None = None  # with trace=True: one record per decoding step (see traces.py)


class TextStream:
    """What pair.stream() returns: iterate over it for the text pieces as decoding steps commit them (held
    back: an incomplete character, and a tail that a stop string could still cut away); after the loop,
    `result` is the GenerationResult, whose text is the pieces joined. Iterable once."""

    def __init__(self, steps, stops: Stops, finish):
        self._steps, self._stops, self._finish = steps, stops, finish
        self._result: GenerationResult | None = None

    @property
    def result(self) -> GenerationResult:
        """The GenerationResult, once the loop over the stream has ended (a ConfigError before)."""
        if self._result is None:
            raise ConfigError("stream.result is ready once the stream is consumed: iterate over it to the end "
                              "first (for piece in stream: ...), or call pair.generate() for the result alone")
        return self._result

    def __iter__(self):
        if self._steps is None:
            raise ConfigError("this stream has been iterated already; call pair.stream() again")
        steps, self._steps = self._steps, None
        while True:
            try:
                next(steps)
            except StopIteration as done:
                tokens, stats = done.value
                break
            piece = self._stops.ready()
            if piece:
                yield piece
        piece = self._stops.rest(tokens)
        self._result = self._finish(tokens, stats)
        if piece:
            yield piece


class Pair:
    """A target model with its tokenizer and (optionally) a DFlash drafter bound to it."""

    def __init__(self, target, drafter, tokenizer, stop_ids=(), name: str = "", source_gguf: Path | None = None,
                 options: LoadOptions | None = None, ngram_table: NgramTable | None = None):
        # on a float32 CPU both run inside the CPU runtime (ddtree/runtime/cpu/runtime.py), built once here or at load; on
        # CUDA (Triton attention) inside the CUDA-graph runtime (ddtree/runtime/gpu/runtime.py) unless
        # options.cuda_graphs is False. A pair made by hand takes the defaults; load() resolves its options.
        self.options = LoadOptions() if options is None else options
        target, drafter = attach(target, drafter, self.options)
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.source_gguf = source_gguf  # the GGUF file the target was loaded from, if any (the llamacpp method)
        self.stop_ids = tuple(stop_ids)
        self.name = name
        self.ngram_table = ngram_table  # the target's own 3-gram continuations, for ddtree:N+lookup (or None)
        self.decoder = Decoder(target, drafter)
        self._methods: dict[tuple, Method] = {}

    def refresh(self) -> "Pair":
        """Re-make the models' copies of their weights after writes torch does not count (`w.data[...] = x`,
        `w.data.mul_()`, a numpy view's elements); generate() refuses to decode stale copies where it sees them.
        In-place torch ops, load_state_dict and assigning parameters need no call."""
        self.target.refresh()
        if self.drafter is not None:
            self.drafter.refresh()
        return self

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    def encode(self, prompt, chat: bool = True) -> list[int]:
        if not isinstance(chat, (bool, np.bool_)):  # "no" is truthy: it would apply the template asked away
            raise ConfigError(f"chat must be True or False, got {chat!r}")
        if isinstance(prompt, str):
            if not prompt:
                raise ConfigError("the prompt is empty")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate, e.g. from decoding bytes with surrogateescape
                raise ConfigError(f"the prompt is not valid Unicode ({e.reason} at character {e.start}); fix the "
                                  "text, e.g. text.encode('utf-8', 'replace').decode('utf-8')") from None
            if self.tokenizer is None:
                raise ConfigError("this target has no tokenizer: pass the prompt as a list of token ids")
            if chat and getattr(self.tokenizer, "chat_template", None):
                return self._chat_ids([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return self._chat_ids(prompt)
        # Token ids come as a list/tuple (or a 1-D tensor/array) of integers. Anything else that happens to be
        # iterable (bytes, a dict, a bool, a string's characters) is refused, not read as token ids.
        ids = prompt.tolist() if isinstance(prompt, (torch.Tensor, np.ndarray)) else prompt
        if not isinstance(ids, (list, tuple)) or not all(map(_is_token_id, ids)):
            raise ConfigError(f"the prompt must be a string or a list of integer token ids (or of chat messages), got "
                              f"{type(prompt).__name__} {_preview(prompt)}")
        if not ids:
            raise ConfigError("the prompt is empty: give a non-empty string or list of token ids")
        return [int(t) for t in ids]

    def _chat_ids(self, messages) -> list[int]:
        """A conversation [{"role": "user" | "assistant" | "system", "content": str}, ...] through the chat
        template, ending with the prompt for the assistant's next answer."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("a conversation (a list of messages) needs a tokenizer with a chat template; this "
                              "target has none: pass the prompt as a string or as token ids")
        if not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
            raise ConfigError('each message must be {"role": str, "content": str}, got '
                              f"{_preview(messages)}")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def method(self, method: str | MethodSpec = "ddtree", budget=None, block_size: int | None = None) -> Method:
        """The pair's Method for a spec (see method_spec.py), made once and reused: what the adaptive budget
        learns about this pair (its trust in the drafter, whether drafting pays) carries across prompts."""
        spec = MethodSpec.parse(method, budget, self.device)
        key = (spec, block_size)
        if key not in self._methods:
            self._methods[key] = make_method(spec, None, block_size, self.drafter, self.ngram_table)
        return self._methods[key]

    def generate(self, prompt, method: str | MethodSpec = "ddtree", budget: int | str | None = None,
                 block_size: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 max_new_tokens: int = 256, seed: int | None = None, chat: bool = True, trace: bool = False,
                 stop=None, stop_token_ids=None) -> GenerationResult:
        """method: 'ar', 'dflash', 'ddtree', 'ddtree:N' or 'ddtree:auto'; budget: a bare ddtree's budget
        (None: the device's default, `auto` with the context lookup on a CPU, 64 on a GPU; method_spec.MethodSpec.parse). trace=True keeps a per-step tree trace in the result.
        prompt: a string, a list of token ids, or a conversation [{"role": ..., "content": ...}, ...].
        stop: a string or list of strings; stop_token_ids: ids that end the generation beside the model's EOS.
        The text ends before the first stop string (the stop is not in it); token_ids end with the token that
        completed it. stats.stop_reason / stop_match say which stop ended it (see stops.py)."""
        stream = self._stream(prompt, method, budget, block_size, temperature, top_p, top_k, max_new_tokens, seed,
                              chat, trace, stop, stop_token_ids, live=False)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt, method: str | MethodSpec = "ddtree", budget: int | str | None = None,
               block_size: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               max_new_tokens: int = 256, seed: int | None = None, chat: bool = True, trace: bool = False,
               stop=None, stop_token_ids=None) -> TextStream:
        """generate(), handing out the text as it is decoded: `for piece in pair.stream(...)`; the pieces join
        to generate()'s text; afterwards the stream's `result` holds the GenerationResult (tokens, stats)."""
        if self.tokenizer is None:
            raise ConfigError("streaming hands out text, and this target has no tokenizer; use generate()")
        return self._stream(prompt, method, budget, block_size, temperature, top_p, top_k, max_new_tokens, seed,
                            chat, trace, stop, stop_token_ids, live=True)

    def _stream(self, prompt, method, budget, block_size, temperature, top_p, top_k, max_new_tokens, seed, chat,
                trace, stop, stop_token_ids, live: bool) -> TextStream:
        sampling = SamplingParams(temperature, top_p, top_k)
        if not isinstance(trace, (bool, np.bool_)):  # "no" is truthy: it would trace
            raise ConfigError(f"trace must be True or False, got {trace!r}")
        strategy = self.method(method, budget, block_size)
        stops = Stops(self.stop_ids, check_stop_token_ids(stop_token_ids, self.target.cfg.vocab_size),
                      check_stop(stop), self._decode_fn(), live)
        ids = self.encode(prompt, chat)
        steps = [] if trace else None
        run = self.decoder.steps(ids, strategy, sampling, max_new_tokens, stops, seed, steps)
        return TextStream(run, stops, lambda tokens, stats: GenerationResult(tokens, stops.finish(tokens), stats,
                                                                             ids, steps))

    def _decode_fn(self):
        return None if self.tokenizer is None else self.decode

    @torch.inference_mode()
    def logits_after(self, prompt_ids: list[int], generated: list[int], every: bool = False) -> torch.Tensor:
        """The target's next-token logits [V] after prompt + generated (one plain pass); with every=True, the
        logits [len(generated), V] that predicted each generated token instead."""
        ids = torch.tensor(prompt_ids + generated, device=self.device)
        cache = self.target.new_cache(len(ids))
        out = self.target(ids, torch.arange(len(ids), device=self.device), cache,
                          Visibility.causal(0, len(ids), self.device), last_only=not every)
        return out.logits[len(prompt_ids) - 1:len(ids) - 1] if every else out.logits[0]

    def check(self, prompt_ids: list[int], reference: list[int], tokens: list[int]) -> Verdict:
        """Greedy losslessness verdict of `tokens` against plain decoding's `reference` (see checker.py)."""
        return check_tokens(reference, tokens, lambda i: self.logits_after(prompt_ids, reference[:i]), self.dtype,
                            lambda: self.logits_after(prompt_ids, tokens, every=True))


def _is_token_id(value) -> bool:
    return hasattr(value, "__index__") and not isinstance(value, (bool, np.bool_))  # an int, numpy or torch


def _preview(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_quant(quant, target, device, dtype, kernel: str = "auto") -> Path | None:
    """The GGUF file whose blocks quant='gguf' / 'gguf-int8' runs (None without quant), or a ConfigError naming the
    fix. The arguments are checked before the target is looked for (a wrong combination is named as such, also
    where the target is missing)."""
    quant = Quant.parse(quant)
    if quant is None:
        return None
    quant = quant.value  # the name the messages give
    if kernel == "off":
        raise ConfigError(f"quant={quant!r} runs on the CPU kernels, which cpu_kernel='off' (or DDTREE_CPU_KERNEL=0) "
                          "turns off; leave cpu_kernel at 'auto'")
    if device is not None and torch.device(device).type != "cpu":
        raise ConfigError(f"quant='gguf' runs on the CPU only, not {device!r}; leave device unset")
    if dtype is not None and parse_dtype(dtype) != torch.float32:
        raise ConfigError(f"quant='gguf' takes float32 activations, not {dtype!r}; leave dtype unset")
    path = source_gguf(target)
    if path is None:
        raise ConfigError(f"quant='gguf' needs a GGUF target (the embedded default or a .gguf file), not {target!r}")
    return path


def load(target=None, draft=None, device=None, dtype=None, attention_backend: str | None = "auto",
         backend: str = "auto", quant: str | Quant | None = None, cpu_kernel: str | None = "auto",
         gguf_blocks: bool | None = None, markov_head: bool | None = None, threads: int | None = None,
         cuda_graphs: bool | None = None, ngram_table: bool | None = None) -> Pair:
    """Load a target (None = the embedded SmolLM2-135M-Instruct) and a DFlash drafter (None = the drafter
    shipped for the default target; for other targets, or before one is shipped, an UNTRAINED random drafter,
    with a warning). device: "cpu"/"cuda" (default: cuda if available). dtype: float32/bfloat16 (default: bf16 on
    CUDA, fp32 on CPUs; see loading.default_dtype). backend: "auto" (the own-code model
    where it covers the architecture, else the generic Hugging Face one), "own" or "hf"; stats.backend says
    which ran. The arithmetic of a float32 CPU target (the CPU runtime, ddtree/runtime/cpu/runtime.py):
    quant="gguf": run the target's linear layers on its GGUF file's own Q4_1 / Q8_0 blocks (float32 activations;
    the same model as the float one, weights read at 5-8.5 bits; see ddtree/runtime/cpu/quant_target.py). "gguf-int8":
    the same blocks with the activations quantized to int8 per block of 32 and integer dot products (llama.cpp's
    arithmetic: another function than the float model's, cheaper per verified row; every method is lossless
    against `ar` of the same mode).
    cpu_kernel: "auto" (the CPU's build of the C++ kernels), "avx2", "avx512", or "off" (torch's matmuls only:
    the reference arithmetic, slower).
    gguf_blocks: a float target converted from a GGUF reads that file's blocks for its narrow passes where they
    are exactly its weights (the same bits, fewer bytes; ddtree/runtime/cpu/exact_blocks.py); default True.
    markov_head: True uses a drafter's Markov head, if it has one: each tree node's children come from that node's
    own conditional (ddtree/models/markov.py; more accepted, a costlier tree build on the host). False, the
    default, drafts from the marginals alone, exactly as the published code does.
    threads: torch's CPU threads, set here once (default: the cores other processes leave free, never more than
    the process has; a notice on stderr when other processes keep cores busy).
    cuda_graphs: False runs a CUDA target eagerly, without the CUDA-graph runtime (default True).
    ngram_table: where the drafter's folder holds a table of the target's own 3-gram continuations (ngrams.npz,
    ddtree/engine/ngram_table.py), the context lookup of ddtree:N+lookup falls back on it (default True; False: the
    context alone, as before). Only the trees change: the output is the target's either way.
    Every knob: the argument where given (None, or "auto" for a choice, is not given), else its DDTREE_*
    variable (DDTREE_CPU_KERNEL, DDTREE_CPU_ISA, DDTREE_GGUF_BLOCKS, DDTREE_MARKOV_HEAD, DDTREE_THREADS,
    DDTREE_CUDA_GRAPHS, DDTREE_ATTENTION, DDTREE_NGRAM_TABLE), else the default; read once, here (ddtree/base/options.py). The pair
    keeps them as `pair.options`."""
    with gc_paused():  # the load builds many long-lived objects, which each full collection would scan again
        return _load(target, draft, device, dtype, attention_backend, backend, quant, cpu_kernel, gguf_blocks,
                     markov_head, threads, cuda_graphs, ngram_table)


def _load(target, draft, device, dtype, attention_backend, backend, quant, cpu_kernel, gguf_blocks, markov_head,
          threads, cuda_graphs, ngram_table) -> Pair:
    """load()'s body, with its arguments as given."""
    meter = LoadMeter()  # how busy other processes keep the cores, measured while the target loads (load_threads)
    options = LoadOptions.resolve(cpu_kernel, gguf_blocks, markov_head, cuda_graphs, attention_backend, quant,
                                  threads, ngram_table)  # bad values are refused here, before the slow load
    kernel = resolve_cpu_kernel(options.kernel)
    given = (target, draft)  # hub ids (ddtree/base/hub.py) become their local snapshot folders; paths stay as they are
    target, draft = resolve_hub(target, "target"), resolve_hub(draft, "draft")
    quant = options.quant
    gguf = check_quant(quant, target, device, dtype, kernel)
    device = resolve_device("cpu" if quant and device is None else device)  # before the (slow) model load
    dtype = default_dtype(device) if dtype is None and not quant else parse_dtype(dtype or "float32")
    directory = resolve_target_dir(target)
    source = source_gguf(target)
    model = load_target(directory, dtype, device, options.attention, backend)
    options = replace(options, threads=load_threads(options, torch.get_num_threads(), meter))
    torch.set_num_threads(options.threads)  # once, before the runtime picks its paths by the thread count
    tgt = cpu_target(model, options.kernel, quant_gguf=gguf, source_gguf=source, conversion=directory,
                     gguf_blocks=options.gguf_blocks, int8=options.int8)
    tokenizer = load_tokenizer(directory)
    drafter_dir = None
    if draft is not None:
        drafter = DFlashDrafter.load(draft, dtype, device, tgt.attention_backend, target=tgt)
        drafter.label = str(given[1])
        drafter_dir = Path(draft)
    elif target is None and (SHIPPED_DRAFTER / "model.safetensors").is_file():
        drafter = DFlashDrafter.load(SHIPPED_DRAFTER, dtype, device, tgt.attention_backend, target=tgt)
        drafter.label = "shipped"
        drafter_dir = SHIPPED_DRAFTER
    else:
        warn_untrained()
        drafter = untrained_drafter(tgt)
        drafter.label = "untrained"
    if drafter.markov is None and markov_head:  # asked for this drafter (DDTREE_MARKOV_HEAD=1 asks where one is)
        raise ConfigError(f"markov_head=True, and the drafter ({drafter.label}) has no Markov head: drop markov_head "
                          "(--markov-head), or give it a drafter with one (`python -m ddtree train markov-fit`)")
    if drafter.markov is not None:
        if options.markov_head:
            drafter.label += " + Markov head"
        else:
            drafter.set_markov_head(None)
    name = ("SmolLM2-135M-Instruct" if target is None else given[0] if target is not given[0]  # a hub id: itself
            else Path(directory).name)
    table = None
    if options.ngram_table and drafter_dir is not None and (drafter_dir / NGRAM_FILE).is_file():
        table = NgramTable.load(drafter_dir / NGRAM_FILE)
        if table.vocab_size != tgt.cfg.vocab_size:
            raise ConfigError(f"{drafter_dir / NGRAM_FILE} was built for a vocabulary of {table.vocab_size} tokens, "
                              f"the target has {tgt.cfg.vocab_size}: rebuild it from this target's answers (`python "
                              "-m ddtree train ngram-table`), or load with ngram_table=False (--no-ngram-table)")
    return Pair(tgt, drafter, tokenizer, stop_token_ids(directory, tgt.cfg, tokenizer), name, source, options, table)

"""The CPU runtime: a loaded target and drafter on a float32 CPU, with every fast path chosen once at load.

The model files (ddtree/models/target.py, drafter.py, layers.py) are the readable pure-torch reference. CPUTarget and
CPUDrafter wrap them and own everything CPU-specific: the C++ layer stacks (stack.py), the packed / bf16 / 8-bit
copies of the weights, the exact GGUF blocks (exact_blocks.py), the quantized target (quant_target.py), the
heads' 1-row transposes, the row and thread thresholds, and the guard that re-makes the copies when the weights
change (weights_watch.py). A pass the runtime has no fast path for (a long prefill, a windowed drafter layer)
runs the reference's own code. Each runtime implements its protocol (models/protocol.py: Target, Drafter) itself,
forwards nothing, and holds the reference as `.model`: training, saving and weight surgery go there
(`pair.drafter.model.save(...)`), and the guard sees the change.

The fast paths are held bit-equal to the reference arithmetic by tests (tests/test_cpu_stack.py and the
lossless tests): the stack sums every output in the row kernel's one order, whatever the number of rows.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from ...base.config import ConfigError
from ...models.attention import Visibility
from ...models.kv_cache import ContextCache, KVCache, add_context, flush_context
from ...models.protocol import RowLogits, TargetOutput
from ...models.target import TargetModel
from ..base import DrafterRuntime, TargetRuntime
from . import exact_blocks, int8, qlinear, stack
from .quant_target import int8_activations, quantize_target
from .step_ops import KernelStepOps
from .weights_watch import STALE, WeightsWatch

# float32, one thread: from this many verified nodes, RowLogits (only the rows a walk reads) beat all rows at once
ROW_LOGITS_MIN_ROWS = 12
# An int8-activation head (quant='gguf-int8') streams its weight once for all rows, and a row beyond the first is
# integer arithmetic on weights already in registers (cheaper with VNNI's dpbusd than with AVX2's maddubs): up to
# this many rows, all at once cost less than the ~2 one-row passes of a walk reading lazily (measured in
# docs/cpu-speed.md), keyed by the kernel's VNNI
INT8_HEAD_ALL_ROWS = {True: 16, False: 6}
# The integer mode's K/V cache dtype (llama.cpp's default): the attention widens it exactly to float32.
KV_DTYPE_INT8 = torch.float16
# The LM head's 1-row transpose costs its memory again: kept for float32 models up to this many parameters.
TRANSPOSED_MAX_PARAMS = 2_000_000_000


def applies(model) -> bool:
    """Does the CPU runtime run this model? The own-code reference target in float32 on a CPU."""
    return isinstance(model, TargetModel) and model.device.type == "cpu" and model.dtype == torch.float32


class Linear:
    """A linear layer's CPU implementation for inference, chosen at construction per pass width (1..widest_rows rows,
    then wider) at the current thread count (retune() chooses again, which a pass does when the count changed),
    from what its weight allows:

    - exact GGUF blocks (`blocks`, same bits, fewer bytes) for passes of up to `block_rows` rows;
    - a compact copy (qlinear 8-bit blocks or bf16, where the weight's values all are such: stack.compact_copy);
    - a quantized weight's own kernel (qlinear.QWeight);
    - one row on one thread: x @ a contiguous transpose [in, out], which torch's GEMV streams faster than
      F.linear's [out, in] (on more threads the row kernel splits the rows over them, and torch's GEMV does not);
    - 2..stack.MAX_ROWS rows (and 1 row where a transpose is kept): the row-invariant kernel;
    - else torch's F.linear.
    Inputs a pass never gives (not [N, in] float32, or under autograd) take torch's (or the QWeight's) general path."""

    def __init__(self, weight, kernel, blocks: qlinear.QWeight | None = None, block_rows: int = 0,
                 compact: bool = False, transposed: bool = False, int8: bool = False):
        self.weight, self.kernel, self.blocks, self.block_rows = weight, kernel, blocks, block_rows
        is_f32 = isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.device.type == "cpu"
        # int8: the compact copy is 4-bit blocks run with int8 activations (a quant='gguf-int8' target's drafter)
        self.compact = stack.compact_copy(weight, int8) if compact and kernel is not None and is_f32 else None
        self.transposed = weight.detach().t().contiguous() if transposed and is_f32 else None
        self.skinny = (kernel is not None and is_f32 and weight.dim() == 2 and weight.shape[1] % 64 == 0
                       and weight.is_contiguous())
        self.widest_rows = max(stack.MAX_ROWS, block_rows if blocks is not None else 0)
        self.general = weight.matmul if not isinstance(weight, torch.Tensor) else self._torch
        self.retune()

    def retune(self) -> None:
        """Choose each pass width's implementation for the current thread count (torch.get_num_threads())."""
        self.threads = torch.get_num_threads()
        self.by_rows = [None] + [self._choose(rows) for rows in range(1, self.widest_rows + 2)]  # [widest + 1]: wider

    def _choose(self, rows: int):
        if self.blocks is not None and rows <= self.block_rows:
            return self.blocks.matmul
        if self.compact is not None:
            return lambda x: stack.compact_linear(x, self.compact)
        if not isinstance(self.weight, torch.Tensor):
            return self.weight.matmul
        if self.transposed is not None and rows == 1 and self.threads == 1:
            return lambda x: x @ self.transposed
        if self.skinny and (rows > 1 or self.transposed is not None) and rows <= stack.MAX_ROWS:
            return lambda x: self.kernel.f32_linear(x, self.weight)
        return self._torch

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out]."""
        if (x.dim() == 2 and x.dtype == torch.float32
                and not (torch.is_grad_enabled() and (x.requires_grad or getattr(self.weight, "requires_grad", False)))):
            if self.threads != torch.get_num_threads():
                self.retune()
            return self.by_rows[min(x.shape[0], self.widest_rows + 1)](x.contiguous())
        return self.general(x)


class CPUTarget(TargetRuntime):
    """The reference TargetModel (`model`) with its CPU fast paths (protocol.Target): all layers in one C++ call
    for passes of 1..stack.MAX_ROWS rows, the LM head through Linear, the exact GGUF blocks where given, and the
    step's host operations in the kernel (step_ops)."""

    quant = None

    def __init__(self, model, cpu_kernel: str = "auto", quant: str | None = None, blocks=None):
        super().__init__(model)
        self.quant = quant  # e.g. "gguf Q4_1/Q8_0": the layers run on the GGUF's blocks (quant_target.py)
        self.int8 = int8_activations(quant)  # its products quantize their activations to int8 (quant='gguf-int8')
        self.kernel = qlinear.kernel(cpu_kernel) if qlinear.cpu_kernel_available(cpu_kernel) else None
        self.step_ops = KernelStepOps(self.kernel) if self.kernel is not None else None
        self.blocks = blocks  # exact_blocks.ExactBlocks or None
        self._build()

    @torch.inference_mode(False)  # copies made during a pass (_follow_weights) stay ordinary tensors
    def _build(self) -> None:
        """The stack, the head and the guard, from the reference's current weights."""
        ref, kernel = self.model, self.kernel
        layer_blocks = self.blocks.layers if self.blocks is not None else None
        self.stack = stack.build(ref.cfg, ref.model.layers, layer_blocks, kernel) if kernel and ref.fused else None
        if self.stack is None:
            self.blocks = None  # they serve the stack and the head's narrow passes alongside it
        else:
            stack.set_output(self.stack, ref.model.norm.weight, ref.model.norm.eps)
        head_blocks = self.blocks.head if self.blocks is not None else None
        # the separate-projection layout (fuse(False)) is the reference's: no copies of the weights for it
        small = ref.fused and sum(p.numel() for p in ref.parameters()) <= TRANSPOSED_MAX_PARAMS
        self.head = Linear(ref.lm_head.weight, kernel, head_blocks, qlinear.head_max_rows(kernel),
                           compact=self.stack is not None, transposed=head_blocks is None and small)
        # what the copies are of, and whether the model can take a fast path now (fuse() after fuse(False)); a
        # quantized target's float weights are gone: nothing of theirs is copied
        self.watch = WeightsWatch(ref.parameters) if not self.quant else None

    def __repr__(self) -> str:
        return f"CPUTarget({self.describe()}, {self.model!r})"

    # --- protocol.Target (its shape and identity: TargetRuntime) ----------------------------------------
    @property
    def kv_dtype(self) -> torch.dtype:
        """fp16 in the integer mode (quant='gguf-int8'), as llama.cpp keeps K/V: a pass reads half the bytes, rounded
        once as they are written (the stack's attention and the eager one alike); else the reference's."""
        return KV_DTYPE_INT8 if self.int8 else self.model.kv_dtype

    def new_cache(self, capacity: int) -> KVCache:
        return self.model.new_cache(capacity, self.kv_dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [N, H] -> logits [N, V]; the drafter shares this LM head."""
        return self.head(hidden)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, vis,
                 tap_layers: tuple[int, ...] = (), last_only: bool = False, row_logits: bool = False) -> TargetOutput:
        """TargetModel.forward, through the stack where it takes the pass."""
        self._follow_weights()
        ref = self.model
        if stack.usable(self.stack, tokens.shape[0], ref.attention_backend, vis):
            hidden, features = self._stack_pass(tokens, positions, cache, 0, vis.ancestors, tap_layers, last_only)
        elif vis.chain and stack.usable(self.stack, stack.MAX_ROWS, ref.attention_backend, vis):
            hidden, features = self._causal_passes(tokens, positions, cache, vis, tap_layers, last_only)
        else:
            hidden, features = ref.hidden_states(tokens, positions, cache, vis, tap_layers, last_only)
        return TargetOutput(RowLogits(self, hidden) if row_logits else self.logits(hidden), features)

    forward = __call__

    def _stack_pass(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, offset: int, ancestors,
                    tap_layers: tuple[int, ...], last_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One stack pass over rows written at cache.length + offset: the embedding, the rotary rows, all layers and
        the final norm in one C++ call (after the previous pass has streamed the weights through the caches, each
        small torch op around them would run cold). -> (normed hidden [N or 1, H], taps [N, ...] or None)."""
        ref, past = self.model, cache.length + offset
        cos, sin = ref.rotary.table(past + tokens.shape[0], torch.float32)  # positions < past + N
        hidden, features = self.stack.embed_forward(tokens if tokens.dtype == torch.long else tokens.long(),
                                                    positions, ref.embed_table(), cos, sin, cache.k, cache.v, past,
                                                    ancestors, list(tap_layers), last_only)
        return hidden, features if tap_layers else None

    def _causal_passes(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, vis,
                       tap_layers: tuple[int, ...], last_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A causal pass wider than a stack pass (a prompt's prefill) as consecutive stack passes of at most
        stack.MAX_ROWS rows, each seeing the K/V the ones before it wrote, rather than the eager layers' small torch
        ops per layer. -> (normed hidden [N or 1, H], taps [N, ...] or None)."""
        n, width = tokens.shape[0], stack.MAX_ROWS
        hidden, features = [], []
        for start in range(0, n, width):
            stop = min(n, start + width)
            part = Visibility.causal(vis.past_len + start, stop - start, tokens.device)
            h, f = self._stack_pass(tokens[start:stop], positions[start:stop], cache, start, part.ancestors,
                                    tap_layers, last_only)
            if not last_only or stop == n:
                hidden.append(h)
            features.append(f)
        return torch.cat(hidden), torch.cat(features) if tap_layers else None

    def lazy_logits(self, rows: int) -> bool:
        """Should a verify of `rows` nodes return RowLogits? A walk reads about tau rows, each a 1-row head pass
        that streams the [V, H] head, where all rows at once take the row kernel in one pass over it. On two threads
        the kernel splits the head while torch's 1-row GEMV does not, so all rows at once win; on one thread lazy
        rows win from ROW_LOGITS_MIN_ROWS nodes (docs/cpu-speed.md). A quantized head with float activations
        (compute-bound at several rows) always reads lazily; one with int8 activations above INT8_HEAD_ALL_ROWS
        rows. A head with exact blocks takes them for up to head_max_rows() rows at once, so it reads rows lazily
        only above that."""
        head = self.head
        if not self.row_logits or rows < 2:
            return False
        if head.blocks is not None:
            return rows > head.block_rows
        if isinstance(head.weight, qlinear.QWeight) and head.weight.int8:
            return rows > INT8_HEAD_ALL_ROWS[bool(self.kernel.int8_vnni)]
        return self.quant is not None or (rows >= ROW_LOGITS_MIN_ROWS and torch.get_num_threads() == 1)

    @property
    def row_logits(self) -> bool:
        """Can a pass return RowLogits worth it? Where the 1-row LM head is fast: a transposed float32 head, exact
        blocks, or a quantized head."""
        head = self.head
        return head.transposed is not None or head.blocks is not None or not isinstance(head.weight, torch.Tensor)

    def describe(self) -> dict:
        """The fast paths that set its passes' cost: the quantization it runs, the C++ layers on this kernel
        build, the exact GGUF blocks (the verify-cost curve's key; protocol.Target)."""
        out = {}
        if self.quant:
            out["quant"] = self.quant
        if self.int8:
            out["kv_cache"] = str(self.kv_dtype).removeprefix("torch.")
            out["int8_products"] = int8.products(self.kernel)
        if self.stack is not None:
            # the kernels' build (a hash of their sources): a changed kernel is a new cost curve
            out.update(cpu_layers=True, cpu_kernel=self.kernel.isa, kernel_build=self.kernel.ddtree_build)
        if self.blocks is not None:  # and the widest passes that read them
            out["exact_blocks"] = [qlinear.layer_max_rows(self.kernel), qlinear.head_max_rows(self.kernel)]
        return out

    # --- the copies of the weights ----------------------------------------------------------------------
    def _follow_weights(self) -> None:
        """The stack and the head hold copies of the weights. A weight changed in place since (a test's surgery,
        load_state_dict) would leave 1-row and many-row passes on different values, and the method's tokens no
        longer plain decoding's: re-make the copies then (WeightsWatch: one C++ loop over the parameters)."""
        if self.watch is not None and self.watch.changed():
            self.blocks = None  # they were these weights' values, not the new ones'
            self._build()

    def refresh(self) -> "CPUTarget":
        """Re-make the copies of the weights (the exact GGUF blocks are dropped) from their current values. Needed
        only after writes torch does not count: `p.data[...] = x`, `p.data.mul_()`, or a numpy view's elements.
        In-place torch ops, load_state_dict and assigning parameters are followed on every pass without it."""
        if self.watch is not None:
            self.blocks = None
            self._build()
        return self

    def check_fresh(self) -> None:
        """A ConfigError where the weights' values were written behind torch's back since their copies were made
        (WeightsWatch.stale): decoding would mix the old and the new model."""
        if self.watch is not None and not self.watch.changed() and self.watch.stale():
            raise ConfigError(STALE)


class CPUDrafter(DrafterRuntime):
    """The reference DFlashDrafter (`model`, bound to a CPUTarget) with its CPU fast paths (protocol.Drafter): the
    draft layers and the context pass as one C++ call each, and a reduced head through Linear."""

    def __init__(self, model, kernel, int8: bool = False):
        super().__init__(model)
        self.kernel = kernel  # the compiled extension, or None (torch's matmuls)
        # its 4-bit copies with int8 activations: the drafter of a quant='gguf-int8' target (the drafter's arithmetic
        # shapes only the tree, never the tokens)
        self.int8 = int8
        self._build()

    @torch.inference_mode(False)  # copies made during a draft stay ordinary tensors
    def _build(self) -> None:
        ref, kernel = self.model, self.kernel
        built = stack.build(ref.cfg.model, ref.layers, None, kernel, self.int8) if kernel is not None else None
        self.context = built is not None and stack.add_context(built, ref.fc.weight, ref.hidden_norm.weight,
                                                               ref.layers, self.int8)
        # the reduced head as 8-bit blocks or bf16 where exact (the shipped drafter's): fewer bytes, same bits
        self.head = (Linear(ref.lm_head.weight, kernel, compact=built is not None, int8=self.int8)
                     if ref.cfg.reduced_vocab else None)
        # the whole draft as one call (DecoderStack.draft) where every layer sees the whole context and block: after a
        # target pass has streamed its weights through the caches, each small torch op of a draft runs cold
        self.one_call = self.context and all(ref.cfg.layer_attention(i) == (None, False) for i in range(len(ref.layers)))
        self.head_in_stack = self.one_call and stack.set_output(built, ref.norm.weight, ref.norm.eps,
                                                                None if self.head is None else self.head.compact)
        self.stack = built
        self.watch = WeightsWatch(ref.parameters)

    def _current(self) -> None:
        """Re-make the copies where a weight changed (an optimizer step between training's evaluations, a load)."""
        if self.watch.changed():
            self._build()

    def __repr__(self) -> str:
        return f"CPUDrafter({self.model!r})"

    # --- protocol.Drafter (its identity and vocabulary: DrafterRuntime) ---------------------------------
    def new_cache(self, capacity: int) -> ContextCache:
        return self.model.new_cache(capacity)

    def describe(self) -> dict:
        """What a draft pass streams of its layers' weights: q4 / q8 / bf16 copies or float32 (stack.storage)."""
        return {"storage": stack.storage(self.model.layers[0].mlp.gate_proj.weight, self.int8)}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [N, H] -> logits over the draft vocabulary (DFlashDrafter.logits)."""
        return self.head(hidden) if self.head is not None else self.model.target.logits(hidden)

    def add_context(self, cache: KVCache, features: torch.Tensor) -> None:
        """DFlashDrafter.add_context: queued on a ContextCache, computed now on any other cache."""
        add_context(cache, features, self._checked_context)

    def flush_context(self, cache: KVCache) -> None:
        flush_context(cache, self._checked_context)

    def _checked_context(self, cache: KVCache, features: torch.Tensor) -> None:
        self._current()
        self._context(cache, features)

    def _stack_takes(self, features: torch.Tensor) -> bool:
        """Does the stack's context pass take these features [n, taps * H]? float32 rows, at most a stack pass's."""
        return (bool(self.context) and features.dim() == 2 and features.dtype == torch.float32
                and features.shape[0] <= stack.MAX_ROWS)

    @torch.inference_mode()
    def _context(self, cache: KVCache, features: torch.Tensor) -> None:
        """DFlashDrafter.context_pass, as C++ calls of at most stack.MAX_ROWS rows each instead of ~25 small torch
        ops where the stack has it: a prompt's context too. Each row's K/V depend on that row alone, so the parts
        give the bits of one pass."""
        ref = self.model
        if not self._stack_takes(features[:stack.MAX_ROWS]):
            ref.context_pass(cache, features)
            return
        for start in range(0, features.shape[0], stack.MAX_ROWS):
            part = features[start:start + stack.MAX_ROWS]
            n = part.shape[0]
            positions = torch.arange(cache.length, cache.length + n, device=features.device)
            cos, sin = ref.rotary(positions, features.dtype)
            self.stack.context(part, cos, sin, cache.k, cache.v, cache.length)
            cache.commit(n)

    @torch.inference_mode()
    def draft(self, cache: KVCache, bonus: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """DFlashDrafter.draft: logits [length - 1, draft vocab] for block positions 1..length-1."""
        self._current()  # once per draft: are its copies still the weights'?
        ref = self.model
        length = length or ref.block_size
        if self.one_call and 2 <= length <= stack.MAX_ROWS and ref.attention_backend == "sdpa":
            return self._one_call_draft(cache, int(bonus[0]), length)
        flush_context(cache, self._context)
        h, cos, sin, visibility = ref.block_inputs(cache, bonus, length)
        if len({id(v) for v in visibility}) == 1 and stack.usable(self.stack, h.shape[0], ref.attention_backend,
                                                                   visibility[0]):
            h, _ = self.stack.forward(h, cos, sin, cache.k, cache.v, cache.length, visibility[0].ancestors, [])
            hidden = self.kernel.rms_norm(h[1:], ref.norm.weight, ref.norm.eps)  # [length - 1, H]
        else:
            hidden = ref.norm(ref.block_layers(h, cos, sin, visibility, cache)[1:])
        return self.logits(hidden)

    def _one_call_draft(self, cache: KVCache, bonus: int, length: int) -> torch.Tensor:
        """draft() through DecoderStack.draft: the queued context, the block's inputs, layers, final norm and head in
        one C++ call, with the bits of the calls one by one (tests/test_cpu_stack.py)."""
        ref = self.model
        features = cache.take_pending() if isinstance(cache, ContextCache) else None
        if features is not None and not self._stack_takes(features):
            self._context(cache, features)  # a prompt's context: wider than the stack's passes
            features = None
        n = 0 if features is None else features.shape[0]
        cos, sin = ref.rotary.table(cache.length + n + length, torch.float32)
        out = self.stack.draft(features, ref.target.embed_table(), bonus, ref.cfg.mask_token_id, length, cos, sin,
                               cache.k, cache.v, cache.length)
        if n:
            cache.commit(n)
        return out if self.head_in_stack else self.logits(out)

    def refresh(self) -> "CPUDrafter":
        """Re-make the copies of the weights from their current values (see CPUTarget.refresh)."""
        self._build()
        return self

    def check_fresh(self) -> None:
        """A ConfigError where the weights were written behind torch's back since the stack copied them."""
        if not self.watch.changed() and self.watch.stale():
            raise ConfigError(STALE)


def cpu_target(model, cpu_kernel: str = "auto", quant_gguf=None, source_gguf=None, conversion=None,
               gguf_blocks: bool = True, int8: bool = False):
    """The target as it runs: the CPU runtime over `model` where it applies (applies()), else `model` itself.
    quant_gguf: run the layers on that GGUF's blocks (quant='gguf'; with int8, quant='gguf-int8': activations
    quantized to int8 per block, llama.cpp's arithmetic); source_gguf + conversion: the GGUF a float
    target was converted from, whose exact blocks serve its narrow passes unless gguf_blocks is False (load()'s
    options: the argument, else DDTREE_GGUF_BLOCKS)."""
    if not applies(model):
        return model
    quant = quantize_target(model, quant_gguf, int8) if quant_gguf is not None else None
    blocks = None
    if (quant_gguf is None and source_gguf is not None and gguf_blocks and model.fused
            and qlinear.cpu_kernel_available(cpu_kernel)):
        blocks = exact_blocks.find(model, source_gguf, conversion)
    return CPUTarget(model, cpu_kernel, quant, blocks)


def attach(target, drafter):
    """(target, drafter) as a pair runs them: a reference target on a float32 CPU gets the runtime (default
    choices), and the drafter of a CPUTarget is bound to it and gets its own runtime with the target's kernel."""
    if not isinstance(target, CPUTarget) and applies(target):
        target = CPUTarget(target)
    if isinstance(target, CPUTarget) and drafter is not None and not isinstance(drafter, CPUDrafter):
        drafter = CPUDrafter(drafter.bind(target), target.kernel, int8=target.int8)
    return target, drafter

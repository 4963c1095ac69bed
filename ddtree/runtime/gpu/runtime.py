"""The CUDA runtime: the reference models' passes replayed as captured CUDA graphs.

A speculative step on a GPU is a few passes of dozens of small kernels each; launched one by one from Python, the
launches, not the GPU, set the step's time (batch size 1). Here each pass shape is captured once and replayed:

  verify    the target over N tree nodes, N padded up to a bucket (1, 2, 3, 4, 5, 8, 9, ... 512, 513: the powers of
            two and the sizes of ddtree:B's B + 1 rows): one graph per bucket
  context   the drafter's K/V of the newly committed tokens, padded up to a bucket: one graph per bucket
  block     the drafter's block pass over `length` positions: one graph per length

A pass kind's graphs are all captured at its first use (every bucket, every block length), so that no capture
falls inside a later step. A graph bakes in addresses and shapes, not values: every per-step value lives in a static input buffer that is
written before the replay (the tokens, positions, the packed tree mask, the past length as an int32 on the
device, which the Triton tree-attention kernel reads when it runs). The graphs run the reference code itself
(TargetModel.hidden_states, DFlashDrafter.block_layers), only with a cache writer that puts the new K/V at rows
named by a device tensor. Padding rows see only themselves and are never seen by a real row; their K/V land
after the real rows, where the next pass or commit overwrites them.

The runtime owns its caches (one per model, grown when a longer one is asked for and kept across generations),
since a graph is bound to the cache it was captured on. Passes it has no graph for (the prompt's prefill, trees
larger than the last bucket, a drafter with sliding-window or causal layers, the SDPA backend) run the reference
eagerly on the same cache. Each runtime implements its protocol (models/protocol.py) itself and holds the reference as
`.model`. `graphs=False` runs the same bucketed passes without capturing them (what the tests
do on a CPU, with Triton's interpreter): the arithmetic is the replay's.
"""
from __future__ import annotations

import numpy as np
import torch

from ...models.attention import Visibility
from ...models.kv_cache import ContextCache, KVCache, add_context, flush_context
from ...models.protocol import TargetOutput
from ...models.target import TargetModel
from ..base import DrafterRuntime, TargetRuntime

# Padded pass sizes; larger passes run eagerly. A ddtree:B verify is B + 1 rows (the root and B nodes), so each power
# of two has its + 1 beside it: ddtree:128's 129 rows run the 129-row pass, not the 256-row one.
BUCKETS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513)


def applies(model) -> bool:
    """The runtime runs the own-code target on a CUDA device with the Triton attention backend (the kernel that
    reads the past length on the device). A pair loaded with cuda_graphs=False (or DDTREE_CUDA_GRAPHS=0) does not
    attach it (api.Pair, from load()'s options)."""
    return isinstance(model, TargetModel) and model.device.type == "cuda" and model.attention_backend == "triton"


def bucket(n: int) -> int | None:
    """The padded size of a pass over n rows, or None past the last bucket."""
    return next((b for b in BUCKETS if b >= n), None)


class DeviceVisibility(Visibility):
    """Visibility for a captured pass: the past length is an int32 [1] on the device and the tree mask is a static
    packed-bits buffer [B, ceil(B / 32)] (kernels/tree_attention.py's layout). Only the Triton backend reads it."""

    def __init__(self, past_len: torch.Tensor, bits: torch.Tensor, lower_triangular: bool):
        super().__init__(past_len, None)
        self._bits, self._lower = bits, lower_triangular

    @property
    def lower_triangular(self) -> bool:
        return self._lower

    def bits(self, n: int, device) -> torch.Tensor:
        return self._bits

    def dense(self, group: int):
        raise RuntimeError("a captured pass's visibility is for the Triton kernel only (attention_backend='triton')")


class RowWriter:
    """The cache as a captured pass writes it: the pass's new K/V go to rows `rows` (a device LongTensor [B]), and
    attention reads the whole cache (the kernel stops at the device past length + B)."""

    def __init__(self, cache: KVCache, rows: torch.Tensor):
        self.cache, self.rows = cache, rows

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.cache.k[layer].index_copy_(1, self.rows, k)  # k, v [Hkv, B, D]
        self.cache.v[layer].index_copy_(1, self.rows, v)
        return self.cache.k[layer], self.cache.v[layer]


class Pass:
    """One pass shape over one cache: static inputs, the function that reads them, its graph once captured."""

    def __init__(self, fn, capture: bool):
        self.fn, self.capture, self.graph, self.out = fn, capture, None, None

    def prepare(self) -> "Pass":
        """Capture the graph (a no-op uncaptured or once captured). The warm-up before the capture runs the pass,
        writing its K/V rows after the cache's past: the static past length must be current."""
        if self.capture and self.graph is None:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up off the capture: Triton compiles, cuBLAS picks its kernels
                self.fn()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.fn()
        return self

    def run(self):
        """Run with the inputs as they are now; the outputs stay valid until this pass runs again."""
        if not self.capture:
            self.out = self.fn()
        else:
            self.prepare().graph.replay()
        return self.out


class _Captured:
    """What the target's and the drafter's runtimes share: a pool of one cache per kind, the passes captured on it
    (the reference they run is `model`, from TargetRuntime / DrafterRuntime)."""

    def __init__(self, model, graphs: bool):
        super().__init__(model)
        self.graphs = graphs
        self._cache = None
        self._passes = {}
        self._weights = None
        self._static = _Static(next(model.parameters()).device, BUCKETS[-1])

    def _pooled(self, capacity: int, make) -> KVCache:
        """The runtime's cache, reset, reporting `capacity` while its tensors keep BUCKETS[-1] rows more (a
        padded pass writes past the real rows). Grown (and the graphs on the old one dropped) when too short."""
        rows = capacity + BUCKETS[-1]
        if self._cache is None or self._cache.k.shape[2] < rows:
            self._passes.clear()
            self._cache = None
            with torch.inference_mode(False):  # normal tensors: the loop commits outside inference mode
                self._cache = make(-(-rows // 1024) * 1024)
        cache = self._cache
        cache.reset()
        cache.capacity = capacity
        return cache

    def _owns(self, cache) -> bool:
        return cache is self._cache

    def check_fresh(self) -> None:
        """Before each generation (protocol.Target): graphs read the weights' storage, so where a parameter was
        replaced (not written in place) since they were captured, they are captured again."""
        key = tuple(p.data_ptr() for p in self.model.parameters())
        if key != self._weights:
            self._passes.clear()
            self._weights = key
        self.model.check_fresh()

    def refresh(self):
        self._passes.clear()
        self._weights = None
        self.model.refresh()
        return self


class _Static:
    """Static input buffers shared by all of a runtime's passes (slices of them per bucket; a verify pass's tokens,
    positions and mask: PassInputs)."""

    def __init__(self, device, rows: int):
        self.past = torch.zeros(1, dtype=torch.int32, device=device)
        self.steps = torch.arange(rows, device=device)  # row offsets 0..rows-1 from the past
        self.bonus = torch.zeros(1, dtype=torch.long, device=device)  # a draft's first token


class GPUTarget(_Captured, TargetRuntime):
    """The target on CUDA with its verify passes captured per tree-size bucket. A step's inputs come from the host
    (the engine's staged step operations keep its bookkeeping there) and go up in one copy per pass."""
    host_inputs = True

    def __repr__(self) -> str:
        return f"GPUTarget(graphs={self.graphs}, {self.model!r})"

    # --- protocol.Target (its passes here; its shape and identity: TargetRuntime) ----------------------
    def describe(self) -> dict:
        return {**self.model.describe(), "runtime": "cuda-graphs" if self.graphs else "bucketed"}

    def new_cache(self, capacity: int) -> KVCache:
        c = self.cfg
        return self._pooled(capacity, lambda rows: KVCache(c.num_layers, c.num_kv_heads, c.head_dim, rows,
                                                           self.kv_dtype, self.device))

    @torch.inference_mode()  # its buffers are inference tensors: written in inference mode only
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, vis: Visibility,
                 tap_layers: tuple[int, ...] = (), last_only: bool = False, row_logits: bool = False) -> TargetOutput:
        """A pass over tokens [N] at positions [N]. From host tensors (a step's tree: engine/staged_ops.py), the
        tokens, positions and mask bits go up in one copy from pinned memory, without a wait; device tensors (a
        prefill, the cost calibration) are copied on the device."""
        n = tokens.shape[0]
        size = bucket(n)
        host = tokens.device.type == "cpu"
        if (size is None or last_only or vis.past is not None or not self._owns(cache)
                or cache.length + size > cache.k.shape[2]):
            if host:  # the reference pass, on device copies
                ancestors = None if vis.ancestors is None else vis.ancestors.to(self.device)
                tokens, positions = tokens.to(self.device), positions.to(self.device)
                vis = Visibility(vis.past_len, ancestors, vis.past, vis.chain)
            return self.model(tokens, positions, cache, vis, tap_layers, last_only, row_logits)
        taps = tuple(tap_layers)
        self._static.past.fill_(cache.length)
        if (size, taps) not in self._passes:  # every bucket at once: no capture inside a later, timed step
            for b in BUCKETS if self.graphs else (size,):
                self._passes[(b, taps)] = self._make_pass(cache, b, taps).prepare()
        p = self._passes[(size, taps)]
        inputs = p.inputs
        if host:
            inputs.buffer.copy_(inputs.stage(tokens, positions, vis.ancestors), non_blocking=inputs.pinned)
        else:
            inputs.tokens[:n].copy_(tokens)
            inputs.positions[:n].copy_(positions)
            inputs.bits.copy_(inputs.identity)  # padding rows see themselves only
            if vis.ancestors is not None:
                packed = vis.bits(n, self.device)  # [n, ceil(n / 32)]
                inputs.bits[:n, :packed.shape[1]] = packed
        logits, features = p.run()
        return TargetOutput(logits[:n], None if features is None else features[:n].clone())

    def _make_pass(self, cache: KVCache, size: int, taps: tuple[int, ...]) -> Pass:
        s, ref = self._static, self.model
        inputs = PassInputs(size, self.device)
        vis = DeviceVisibility(s.past, inputs.bits, lower_triangular=True)

        @torch.inference_mode()
        def fn():
            writer = RowWriter(cache, s.past + s.steps[:size])
            hidden, features = ref.hidden_states(inputs.tokens, inputs.positions, writer, vis, taps)
            return ref.logits(hidden), features

        p = Pass(fn, self.graphs)
        p.inputs = inputs
        return p


class PassInputs:
    """A verify pass's inputs as one device buffer, int64 [2 * size + ceil(size * W / 2)] (W = ceil(size / 32)): the
    tokens [size], the positions [size] and the packed mask bits, int32 [size, W] (kernels/tree_attention.py's layout),
    so that a step's inputs staged on the host go up in one copy. Padding rows (past the tree's n) see only
    themselves, carry token 0 and the last real position."""

    def __init__(self, size: int, device: torch.device):
        self.size, self.words = size, -(-size // 32)
        self.length = 2 * size + -(-size * self.words // 2)
        self.buffer = torch.zeros(self.length, dtype=torch.long, device=device)
        self.tokens, self.positions, self.bits = self._views(self.buffer)
        # each row sees itself: the padding rows' mask, int32 [size, W], on the host and the device
        self._identity_host = _pack_rows(np.eye(size, dtype=bool), self.words)
        self.identity = torch.from_numpy(self._identity_host).to(device)
        self.bits.copy_(self.identity)
        self.pinned = torch.device(device).type == "cuda"

    def _views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size = self.size
        bits = buffer[2 * size:].view(torch.int32)[:size * self.words].view(size, self.words)
        return buffer[:size], buffer[size:2 * size], bits

    def stage(self, tokens: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor | None) -> torch.Tensor:
        """The inputs for host tokens [n], positions [n] and ancestors (bool [n, n] or None: a lone root) in a fresh
        host buffer of the device buffer's layout (page-locked for a CUDA device; the caching host allocator keeps
        it until the copy has run)."""
        n = tokens.shape[0]
        host = torch.empty(self.length, dtype=torch.long, pin_memory=self.pinned)
        t, pos, bits = (x.numpy() for x in self._views(host))
        t[:n], t[n:] = tokens.numpy(), 0
        pos[:n], pos[n:] = positions.numpy(), int(positions[-1])
        bits[:] = self._identity_host
        if ancestors is not None:
            bits[:n] = _pack_rows(ancestors.numpy(), self.words)
        return host


def _pack_rows(visible: np.ndarray, words: int) -> np.ndarray:
    """bool [n, m] -> int32 [n, words]: bit j % 32 of word j // 32 in row i is visible[i, j] (m <= 32 * words): the
    layout of kernels/tree_attention.py's pack_ancestor_bits, in numpy for a step's host work (a few vector ops where
    the torch packer builds an int64 [n, 32 * words] product; tests/test_gpu_runtime.py holds them equal)."""
    n, m = visible.shape
    padded = np.zeros((n, 4 * words), dtype=np.uint8)
    padded[:, :-(-m // 8)] = np.packbits(visible, axis=1, bitorder="little")
    return padded.view("<i4")
class GPUDrafter(_Captured, DrafterRuntime):
    """The drafter on CUDA with its context and block passes captured (for drafters whose layers all see the whole
    context and block, the published DFlash design; others run the reference eagerly)."""

    def __repr__(self) -> str:
        return f"GPUDrafter(graphs={self.graphs}, {self.model!r})"

    # --- protocol.Drafter (its passes here; its identity and vocabulary: DrafterRuntime) ----------------
    @property
    def capturable(self) -> bool:
        return all(self.cfg.layer_attention(i) == (None, False) for i in range(len(self.model.layers)))

    def new_cache(self, capacity: int) -> ContextCache:
        m, w = self.cfg.model, self.model.fc.weight
        return self._pooled(capacity, lambda rows: ContextCache(m.num_layers, m.num_kv_heads, m.head_dim, rows,
                                                                w.dtype, w.device))

    def add_context(self, cache: KVCache, features: torch.Tensor) -> None:
        add_context(cache, features, self.context_pass)

    def flush_context(self, cache: KVCache) -> None:
        flush_context(cache, self.context_pass)

    @torch.inference_mode()  # its buffers are inference tensors: written in inference mode only
    def context_pass(self, cache: KVCache, features: torch.Tensor) -> None:
        n = features.shape[0]
        size = bucket(n)
        if size is None or not self._owns(cache) or not self.capturable or cache.length + size > cache.k.shape[2]:
            return self.model.context_pass(cache, features)
        self._static.past.fill_(cache.length)
        if ("context", size) not in self._passes:  # every bucket at once (the warm-ups write rows the pass rewrites)
            for b in BUCKETS if self.graphs else (size,):
                self._passes[("context", b)] = self._context_pass(cache, b, features.shape[1]).prepare()
        p = self._passes[("context", size)]
        p.features[:n].copy_(features)
        p.run()
        cache.commit(n)

    def _context_pass(self, cache: KVCache, size: int, width: int) -> Pass:
        s, ref = self._static, self.model
        features = torch.zeros(size, width, dtype=ref.fc.weight.dtype, device=ref.fc.weight.device)

        @torch.inference_mode()
        def fn():
            positions = s.past + s.steps[:size]
            writer = RowWriter(cache, positions)
            cos, sin = ref.rotary(positions, features.dtype)
            ctx = ref.hidden_norm(ref.fc(features))  # [size, H]
            for i, layer in enumerate(ref.layers):
                writer.write(i, *layer.self_attn.key_value(ctx, cos, sin))

        p = Pass(fn, self.graphs)
        p.features = features
        return p

    @torch.inference_mode()  # its buffers are inference tensors: written in inference mode only
    def draft(self, cache: KVCache, bonus: torch.Tensor, length: int | None = None) -> torch.Tensor:
        length = length or self.block_size
        self.flush_context(cache)
        if not self._owns(cache) or not self.capturable or cache.length + length > cache.k.shape[2]:
            return self.model.draft(cache, bonus.to(self._static.bonus.device), length)
        self._static.past.fill_(cache.length)
        if ("block", length) not in self._passes:  # every length at once (budget="auto" drafts 2..block)
            for b in sorted({*range(2, self.block_size + 1), length}) if self.graphs else (length,):
                self._passes[("block", b)] = self._block_pass(cache, b).prepare()
        if bonus.device.type == "cpu":  # a host root (engine/staged_ops.py): a fill, no upload to wait for
            self._static.bonus.fill_(int(bonus))
        else:
            self._static.bonus.copy_(bonus)
        return self._passes[("block", length)].run()

    def _block_pass(self, cache: KVCache, length: int) -> Pass:
        s, ref = self._static, self.model
        mask = torch.full((length - 1,), self.cfg.mask_token_id, dtype=torch.long, device=s.bonus.device)
        bits = torch.full((length, -(-length // 32)), -1, dtype=torch.int32, device=s.bonus.device)  # all visible
        vis = [DeviceVisibility(s.past, bits, lower_triangular=False)] * len(ref.layers)

        @torch.inference_mode()
        def fn():
            positions = s.past + s.steps[:length]
            h = ref.target.embed(torch.cat([s.bonus, mask]))  # [length, H]
            cos, sin = ref.rotary(positions, h.dtype)
            h = ref.block_layers(h, cos, sin, vis, RowWriter(cache, positions))
            return ref.logits(ref.norm(h[1:]))  # [length - 1, draft vocab]

        return Pass(fn, self.graphs)


def attach(target, drafter, graphs: bool = True):
    """(target, drafter) as a pair runs them: a reference target on CUDA with the Triton backend gets this runtime
    (graphs=False: the same padded passes, uncaptured), and its drafter too, bound to it."""
    if not isinstance(target, GPUTarget) and (applies(target) or (isinstance(target, TargetModel) and not graphs)):
        target = GPUTarget(target, graphs)
    if isinstance(target, GPUTarget) and drafter is not None and not isinstance(drafter, GPUDrafter):
        drafter = GPUDrafter(drafter.bind(target), target.graphs)
    return target, drafter

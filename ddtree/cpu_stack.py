"""The target's decoder layers as one C++ call per pass on float32 CPUs (kernels/decoder.cpp).

Why: on a CPU a small model's plain step spends a sizeable share of its time in the ~20 small torch ops per layer
(norms, RoPE, cache writes, SDPA setup, SiLU, residuals), each costing more in dispatch than in arithmetic. The
stack does the same computation per layer in C++ and calls the same matmuls: torch's GEMV for one row, the
row-invariant kernel (kernels/qlinear.cpp) for 2-64 rows, the GGUF kernels for a quantized target. The
eager layers (ddtree.layers) stay the reference: DDTREE_CPU_KERNEL=0 runs them, and wider passes (a prompt's
prefill) and anything the stack does not cover use them too.
"""
from __future__ import annotations

import operator

import torch

from . import qlinear
from .layers import SKINNY_MAX_ROWS
from .qlinear import layer_max_rows

F32, Q4_1, Q8_0, BF16, F32P = 1, 2, 3, 4, 5  # decoder.cpp's Linear kinds
# float32 layer weights up to this size get a packed copy too (qlinear.pack_rows: one sequential stream per tile,
# faster for narrow passes); above it the memory is not worth it
PACK_MAX_BYTES = 1 << 30
QUANT_KINDS = {"Q4_1": Q4_1, "Q8_0": Q8_0}
MAX_ROWS = SKINNY_MAX_ROWS  # above this (a prefill) torch's cache-blocked GEMM beats the skinny kernel


def build(cfg, layers, blocks=None) -> object | None:
    """A DecoderStack over `layers` (ddtree.layers.DecoderLayer, shapes from the ModelConfig `cfg`), or None when
    it cannot take them: not float32 on a CPU, a shape the C++ does not cover, or no kernel. Fused layers (a
    target after fuse() or quantize_target()) lend it their weights; separate q/k/v and gate/up projections (the
    drafter) are concatenated into copies. Weights whose values are all bfloat16 values, or 8-bit blocks with
    power-of-two scales, are copied in that form (compact_copy), other float32 weights get packed copies
    (qlinear.pack_rows, up to PACK_MAX_BYTES). A stack holding copies must be rebuilt when the weights change: the
    drafter and the target check their parameters' version counters on every pass and rebuild it. blocks: per layer, its (qkv, o, gate_up, down) as
    ddtree.qlinear.QWeights that dequantize EXACTLY to the float weights (None where there is none), from
    ddtree.exact_blocks; passes of up to exact_blocks.layer_max_rows() rows read those instead (same bits)."""
    params = [p for layer in layers for p in layer.parameters()]
    if not layers or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return None
    if cfg.hidden_size % 8 or cfg.head_dim % 8 or cfg.head_dim > 512 or not qlinear.cpu_kernel_available():
        return None
    specs = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_weight is not None:
            qkv, qkv_t, qkv_bias = attn.qkv_weight, attn.qkv_t, attn.qkv_bias
        else:
            qkv, qkv_t = _cat(attn.q_proj, attn.k_proj, attn.v_proj), None
            qkv_bias = None if attn.q_proj.bias is None else _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj)
        if mlp.gate_up_weight is not None:
            gate_up, gate_up_t = mlp.gate_up_weight, mlp.gate_up_t
        else:
            gate_up, gate_up_t = _cat(mlp.gate_proj, mlp.up_proj), None
        # float32 weights that are all bfloat16 values (a checkpoint published in bf16, run in fp32) stream as bf16
        # copies, widened exactly in registers, or as 8-bit blocks where they are power-of-two-scaled 8-bit values
        # (compact_copy): a half or a quarter of the bytes, and every row count takes the row kernel
        weights = tuple(compact_if_exact(w) if isinstance(w, torch.Tensor) else w
                        for w in (qkv, attn.o_proj.weight, gate_up, mlp.down_proj.weight))
        if not all(_coverable(w) for w in weights):
            return None
        specs.append((layer, weights, qkv_t, qkv_bias, gate_up_t))
    stack = qlinear.kernel().DecoderStack(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                          cfg.intermediate_size, cfg.rms_norm_eps)
    pack = packs(layers)
    for i, (layer, (qkv, o, gate_up, down), qkv_t, qkv_bias, gate_up_t) in enumerate(specs):
        attn, mlp = layer.self_attn, layer.mlp
        biases = (qkv_bias, attn.o_proj.bias, None, mlp.down_proj.bias)
        ids = [_add(stack, qkv, qkv_t, biases[0], pack), _add(stack, o, None, biases[1], pack),
               _add(stack, gate_up, gate_up_t, None, pack), _add(stack, down, None, biases[3], pack)]
        for j, exact in enumerate(blocks[i] if blocks is not None else ()):
            if exact is not None:
                stack.add_blocks(ids[j], _add(stack, exact, None, biases[j], pack), layer_max_rows())
        norms = (attn.q_norm.weight.detach(), attn.k_norm.weight.detach()) if attn.q_norm is not None else (None, None)
        stack.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(), *norms,
                        *ids)
    return stack


def add_context(stack, fc: torch.Tensor, norm: torch.Tensor, layers) -> bool:
    """Give a drafter's stack its context pass (DecoderStack.context, DFlash's KV injection): the fc weight
    [H, taps * H], hidden_norm's weight [H], and per layer its k_proj and v_proj concatenated (compact copies where
    exact, like build()'s). False, and no context pass, where a weight is not one the stack covers."""
    kv = []
    for layer in layers:
        attn = layer.self_attn
        weight = compact_if_exact(_cat(attn.k_proj, attn.v_proj))
        bias = None if attn.k_proj.bias is None else _cat_bias(attn.k_proj, attn.v_proj)
        kv.append((weight, bias))
    fc = compact_if_exact(fc)
    if not all(_coverable(w) for w, _ in kv) or not _coverable(fc):
        return False
    ids = [_add(stack, weight, None, bias, False) for weight, bias in kv]
    stack.add_context(_add(stack, fc, None, None, False), norm.detach().float().contiguous(), ids)
    return True


def packs(layers) -> bool:
    """Does build() give these layers' float32 weights packed copies (up to PACK_MAX_BYTES in all)? Then the stack
    runs their 1-row passes too, and the layers' transposed 1-row copies (ddtree.fused) are not needed."""
    f32_bytes = sum(p.numel() * 4 for layer in layers for p in layer.parameters() if p.dtype == torch.float32)
    return f32_bytes <= PACK_MAX_BYTES


_version = operator.attrgetter("_version")
_registrations = [0, False]  # parameters and submodules registered (or replaced) since the hooks; hooks installed


def _count_registration(*_):
    _registrations[0] += 1


def registrations() -> int:
    """Changes whenever any module gains or replaces a parameter or submodule (attribute assignment included): a
    parameter list cached under this number is still the module's while the number is the same. The global
    registration hooks that count them are installed on the first call (when the first WeightsWatch is made,
    at load), not on import: importing ddtree changes nothing in torch."""
    if not _registrations[1]:
        torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        torch.nn.modules.module.register_module_module_registration_hook(_count_registration)
        _registrations[1] = True
    return _registrations[0]


class WeightsWatch:
    """Has any weight of a module changed since mark()? Written in place (an optimizer step, load_state_dict, a test's
    surgery: version counters), re-pointed (`p.data = x`: data pointers) or replaced (attribute assignment, a new
    submodule: the registration hooks above, then the parameters' identities). Whoever holds copies of the weights
    (the stacks, bf16 and packed copies, transposes) asks on every pass and re-makes them when it is true.
    `params_of()` lists the current weights. The check runs in C++ where the kernel is built (one loop, every
    pass), else in Python (weights_key)."""

    def __init__(self, params_of):
        self.params_of = params_of
        self.mark()

    def mark(self) -> None:
        """The current weights are the reference from now on."""
        self.registrations = registrations()
        self.params = list(self.params_of())
        self.sample = values_sample(self.params)
        native = all(p.device.type == "cpu" and not p.is_inference() for p in self.params) and qlinear.cpu_kernel_available()
        self.snapshot = qlinear.kernel().WeightsSnapshot(self.params) if native else None
        self.key = None if native else weights_key(self.params)

    def changed(self) -> bool:
        if self.registrations != registrations():  # something was registered somewhere: is it one of ours?
            if list(map(id, self.params_of())) != list(map(id, self.params)):
                return True
            self.registrations = registrations()
        return self.snapshot.changed() if self.snapshot is not None else weights_key(self.params) != self.key

    def stale(self) -> bool:
        """Were values written where torch does not count writes (`p.data[...] = x`, `p.data.mul_()`, a numpy
        view's elements) since mark()? Seen where they reach SAMPLE_POINTS evenly spaced elements of a weight
        (any write to a whole weight or to a block of rows); a single element elsewhere is not. One gather per
        weight: asked once per generation, not per pass."""
        return not torch.equal(values_sample(self.params), self.sample)


SAMPLE_POINTS = 64  # per weight: WeightsWatch.stale()
STALE = ("the model's weights were written where torch does not count writes (through .data or a numpy view) "
         "after its fast copies of them were made, so decoding would mix the old and the new weights: call "
         "pair.refresh() (or model.refresh()) after such edits. In-place torch ops (with torch.no_grad(): "
         "w.mul_(2)), load_state_dict and assigning parameters are followed without it")


def values_sample(params) -> torch.Tensor:
    """About SAMPLE_POINTS evenly spaced elements of every weight, concatenated [sum of the samples] as float64
    bit patterns (int64: a NaN then equals itself)."""
    parts = [p.detach().reshape(-1)[::max(1, p.numel() // SAMPLE_POINTS)] for p in params if p.numel()]
    return torch.cat(parts).double().view(torch.int64) if parts else torch.zeros(0, dtype=torch.int64)


def weights_key(params) -> tuple:
    """What changes when a parameter is written in place or re-pointed (an optimizer step, load_state_dict, a
    test's surgery): identity, storage and version counter. WeightsWatch's check where the C++ snapshot is not
    available; built by map() (C loops), not a generator: it runs every pass."""
    params = list(params)
    return tuple(map(id, params)), tuple(map(torch.Tensor.data_ptr, params)), tuple(map(_version, params))


def usable(stack, n: int, backend: str, vis) -> bool:
    """Does this pass (n new rows) take the stack? Not for a prefill, another attention backend, or a
    windowed past (only drafters have one)."""
    return stack is not None and 1 <= n <= MAX_ROWS and backend == "sdpa" and vis.past is None


def _cat(*linears) -> torch.Tensor:
    return torch.cat([lin.weight.detach() for lin in linears])


def _cat_bias(*linears) -> torch.Tensor:
    return torch.cat([lin.bias.detach() for lin in linears])


def bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 copy of a float32 weight [N, K] (K % 64 == 0) whose values are all bfloat16 (a model published
    in bf16 and loaded as float32): the kernel widens it back exactly, so the products keep their bits. None for
    any other weight; the first row decides most of those without converting the rest."""
    w = weight.detach()
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % 64 or w.shape[0] == 0:
        return None
    if not torch.equal(w[:1].to(torch.bfloat16).float(), w[:1]):
        return None
    half = w.to(torch.bfloat16)
    return half if torch.equal(half.float(), w) else None


def compact_copy(weight: torch.Tensor) -> qlinear.QWeight | torch.Tensor | None:
    """The copy of a float32 weight [N, K] that the kernel reads with the fewest bytes and the weight's own bits:
    8-bit blocks with power-of-two scales (qlinear.po2_q8; 8.5 bits a weight) where its values are exactly such
    blocks (a drafter rounded by `train quantize`), else bfloat16 (16 bits) where they are all bf16 values (bf16_copy),
    else None. A drafter's pass reads its weights from memory after every target pass has evicted them, so bytes are
    its time."""
    if weight.dtype != torch.float32:
        return None
    return qlinear.po2_q8(weight) or bf16_copy(weight)


def compact_if_exact(weight: torch.Tensor) -> qlinear.QWeight | torch.Tensor:
    """compact_copy(weight) where there is one, else the weight."""
    copy = compact_copy(weight)
    return weight.detach() if copy is None else copy


def storage(weight: torch.Tensor) -> str:
    """What a CPU pass streams of `weight`: 'q8' or 'bf16' where compact_copy() makes such a copy, else its dtype.
    A drafter's pass costs more in bf16 than in 8-bit blocks, so the adaptive budget's cost curve is kept per storage
    (cost_cache.cost_key)."""
    copy = compact_copy(weight)
    if copy is None:
        return str(weight.dtype).removeprefix("torch.")
    return "q8" if isinstance(copy, qlinear.QWeight) else "bf16"


def compact_linear(x: torch.Tensor, copy: qlinear.QWeight | torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ the weight that compact_copy() made `copy` of, transposed: its bits, through the kernel."""
    if isinstance(copy, qlinear.QWeight):
        return copy.matmul(x)
    return qlinear.kernel().bf16_linear(x.contiguous(), copy)


def _coverable(weight) -> bool:
    if isinstance(weight, qlinear.QWeight):
        return weight.kind in QUANT_KINDS
    return (isinstance(weight, torch.Tensor) and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] % 64 == 0)


def _add(stack, weight, weight_t, bias, pack: bool) -> int:
    bias = None if bias is None else bias.detach().contiguous()
    if isinstance(weight, qlinear.QWeight):
        return stack.add_linear(QUANT_KINDS[weight.kind], weight.qs, weight.d, bias)
    if weight.dtype == torch.bfloat16:
        return stack.add_linear(BF16, weight, None, bias)
    if pack and weight.shape[0] % 4 == 0:  # the kernel at every width, one row on one thread included
        return stack.add_linear(F32P, qlinear.pack_rows(weight), None, bias)
    return stack.add_linear(F32, weight.detach(), weight_t, bias)

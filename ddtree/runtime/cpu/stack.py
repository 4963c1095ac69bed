"""Decoder layers as one C++ call per pass on float32 CPUs (kernels/decoder.cpp): the CPU runtime's layer pass.

Why: on a CPU a small model's plain step spends a sizeable share of its time in the ~20 small torch ops per layer
(norms, RoPE, cache writes, SDPA setup, SiLU, residuals), each costing more in dispatch than in arithmetic. The
stack does the same computation per layer in C++ over the row-invariant matmuls of kernels/qlinear.cpp (float32,
packed, bf16 or GGUF blocks), and torch's GEMV for one row of an unpacked float32 weight. A causal pass wider than
MAX_ROWS (a prompt's prefill) runs as consecutive stack passes (CPUTarget). The eager layers (ddtree.models.layers)
stay the reference: anything the stack does not cover runs them.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from . import qlinear

F32, Q4_1, Q8_0, BF16, F32P = 1, 2, 3, 4, 5  # decoder.cpp's Linear kinds
# float32 layer weights up to this size get a packed copy too (qlinear.pack_rows: one sequential stream per tile,
# faster for narrow passes); above it the memory is not worth it
PACK_MAX_BYTES = 1 << 30
# unpacked float32 layers up to this many parameters keep transposes of qkv and gate/up for 1-row passes (their
# memory again: worth it while plain decoding is bound by how fast these weights stream)
TRANSPOSED_MAX_PARAMS = 2_000_000_000
QUANT_KINDS = {"Q4_1": Q4_1, "Q8_0": Q8_0}
INT8_KINDS = {"Q4_1": 6, "Q8_0": 7}  # the same blocks with int8 activations (decoder.cpp's Q4_1_I8, Q8_0_I8)
MAX_ROWS = 64  # passes of 1..MAX_ROWS rows; a wider causal one (a prefill) runs as several, other wide ones eager


def build(cfg, layers, blocks=None, kernel=None, int8: bool = False) -> object | None:
    """A DecoderStack over `layers` (ddtree.models.layers.DecoderLayer, shapes from the ModelConfig `cfg`) built by
    `kernel` (the compiled extension; None: qlinear.kernel()), or None when it cannot take them: not float32 on a
    CPU, a shape the C++ does not cover, or no kernel. Fused layers (ddtree.models.fused, or quant_target's QLinears)
    lend it their weights; separate q/k/v and gate/up projections (the drafter) are concatenated into copies.
    Weights whose values are all bfloat16 values, or 8-bit blocks with power-of-two scales, are copied in that form
    (compact_copy); other float32 weights get packed copies (qlinear.pack_rows) up to PACK_MAX_BYTES in all, and
    beyond that contiguous transposes of qkv and gate/up for torch's 1-row GEMV. The runtime rebuilds a stack
    whenever the weights change (ddtree/runtime/cpu/weights_watch.py). blocks: per layer, its (qkv, o, gate_up, down) as
    QWeights that dequantize EXACTLY to the float weights (None where there is none; ddtree/runtime/cpu/exact_blocks.py);
    passes of up to layer_max_rows() rows read those instead (same bits). int8: the compact copies are 4-bit blocks
    run with int8 activations (compact_copy; QWeight.int8: the drafter of a quant='gguf-int8' target)."""
    params = [p for layer in layers for p in layer.parameters()]
    if not layers or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return None
    if kernel is None:
        if not qlinear.cpu_kernel_available():
            return None
        kernel = qlinear.kernel()
    if cfg.hidden_size % 8 or cfg.head_dim % 8 or cfg.head_dim > 512:
        return None
    pack = packs(layers)
    transpose = not pack and sum(p.numel() for p in params) <= TRANSPOSED_MAX_PARAMS
    specs = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is not None:
            qkv, qkv_bias = attn.qkv_proj.weight, attn.qkv_proj.bias
        else:
            qkv = _cat(attn.q_proj, attn.k_proj, attn.v_proj)
            qkv_bias = None if attn.q_proj.bias is None else _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj)
        gate_up = mlp.gate_up_proj.weight if mlp.gate_up_proj is not None else _cat(mlp.gate_proj, mlp.up_proj)
        # float32 weights that are all bfloat16 values (a checkpoint published in bf16, run in fp32) stream as bf16
        # copies, widened exactly in registers, or as 8-bit blocks where they are power-of-two-scaled 8-bit values
        # (compact_copy): a half or a quarter of the bytes, and every row count takes the row kernel
        weights = tuple(compact_or_same(w, int8) if isinstance(w, torch.Tensor) else w
                        for w in (qkv, attn.o_proj.weight, gate_up, mlp.down_proj.weight))
        if not all(_coverable(w) for w in weights):
            return None
        # unpacked float32 qkv and gate/up (more outputs than inputs): their 1-row pass is torch's GEMV over a
        # contiguous transpose [in, out], which streams the weight faster than one over [out, in]
        qkv_t, gate_up_t = (_transposed(weights[0], pack) if transpose else None,
                            _transposed(weights[2], pack) if transpose else None)
        specs.append((layer, weights, qkv_t, qkv_bias, gate_up_t))
    stack = kernel.DecoderStack(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                cfg.intermediate_size, cfg.rms_norm_eps)
    for i, (layer, (qkv, o, gate_up, down), qkv_t, qkv_bias, gate_up_t) in enumerate(specs):
        attn, mlp = layer.self_attn, layer.mlp
        biases = (qkv_bias, attn.o_proj.bias, None, mlp.down_proj.bias)
        ids = [_add(stack, qkv, qkv_t, biases[0], pack), _add(stack, o, None, biases[1], pack),
               _add(stack, gate_up, gate_up_t, None, pack), _add(stack, down, None, biases[3], pack)]
        for j, exact in enumerate(blocks[i] if blocks is not None else ()):
            if exact is not None:
                stack.add_blocks(ids[j], _add(stack, exact, None, biases[j], pack),
                                 qlinear.layer_max_rows(kernel))
        norms = (attn.q_norm.weight.detach(), attn.k_norm.weight.detach()) if attn.q_norm is not None else (None, None)
        stack.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(), *norms,
                        *ids)
    return stack


def _transposed(weight, pack: bool) -> torch.Tensor | None:
    """A float32 weight's contiguous transpose where _add() will not pack it (else None)."""
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or (pack and weight.shape[0] % 4 == 0):
        return None
    return weight.detach().t().contiguous()


def add_context(stack, fc: torch.Tensor, norm: torch.Tensor, layers, int8: bool = False) -> bool:
    """Give a drafter's stack its context pass (DecoderStack.context, DFlash's KV injection): the fc weight
    [H, taps * H], hidden_norm's weight [H], and per layer its k_proj and v_proj concatenated (compact copies where
    exact, like build()'s). False, and no context pass, where a weight is not one the stack covers."""
    kv = []
    for layer in layers:
        attn = layer.self_attn
        weight = compact_or_same(_cat(attn.k_proj, attn.v_proj), int8)
        bias = None if attn.k_proj.bias is None else _cat_bias(attn.k_proj, attn.v_proj)
        kv.append((weight, bias))
    fc = compact_or_same(fc, int8)
    if not all(_coverable(w) for w, _ in kv) or not _coverable(fc):
        return False
    ids = [_add(stack, weight, None, bias, False) for weight, bias in kv]
    stack.add_context(_add(stack, fc, None, None, False), norm.detach().float().contiguous(), ids)
    return True


def set_output(stack, norm: torch.Tensor, eps: float, head=None) -> bool:
    """Give a stack the final norm of its one-call passes (DecoderStack.embed_forward, .draft) and a drafter's
    reduced head: `head` a compact copy (compact_copy) or None (a draft then returns the normed hidden states). True
    where the head is the stack's."""
    fused = head is not None and _coverable(head)
    stack.set_output(_add(stack, head, None, None, False) if fused else -1, norm.detach().float().contiguous(), eps)
    return fused


def packs(layers) -> bool:
    """Does build() give these layers' float32 weights packed copies (up to PACK_MAX_BYTES in all)? Then the row
    kernel runs their 1-row passes too, and no transposes are made for torch's GEMV."""
    f32_bytes = sum(p.numel() * 4 for layer in layers for p in layer.parameters() if p.dtype == torch.float32)
    return f32_bytes <= PACK_MAX_BYTES


def usable(stack, n: int, backend: str, vis) -> bool:
    """Does this pass (n new rows) take the stack in one call? Not wider than MAX_ROWS (CPUTarget splits a causal
    one), not for another attention backend or a windowed past (only drafters have one)."""
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


def compact_copy(weight: torch.Tensor, int8: bool = False) -> qlinear.QWeight | torch.Tensor | None:
    """The copy of a float32 weight [N, K] that the kernel reads with the fewest bytes. A drafter's pass reads its
    weights from memory after every target pass has evicted them, so bytes are its time.
    - Float activations (the weight's own bits): 8-bit blocks with power-of-two scales (qlinear.po2_q8; 8.5 bits a
      weight) where its values are exactly such blocks (a drafter rounded by `train quantize`), else bfloat16 (16
      bits) where they are all bf16 values (bf16_copy), else None.
    - int8 (the drafter of a gguf-int8 target, whose products already quantize their activations, so its arithmetic
      is not the float model's anyway): 4-bit blocks (Q4_1 rounded to nearest, as llama.cpp writes them; 5 bits a
      weight) with int8 activations, where K % 64 == 0. The drafter shapes only the tree, never the tokens."""
    if weight.dtype != torch.float32:
        return None
    if int8 and _int8_blocks_fit(weight):
        return replace(qlinear.QWeight.quantize(weight, "Q4_1"), int8=True)
    blocks = qlinear.po2_q8(weight)
    if blocks is not None:
        return blocks
    return bf16_copy(weight)


def _int8_blocks_fit(weight: torch.Tensor) -> bool:
    """Can the int8 kernel take `weight` as blocks? [N, K] with K % 64 == 0."""
    return weight.dim() == 2 and weight.shape[1] % 64 == 0


def compact_or_same(weight: torch.Tensor, int8: bool = False) -> qlinear.QWeight | torch.Tensor:
    """compact_copy(weight, int8) where there is one, else the weight."""
    copy = compact_copy(weight, int8)
    return weight.detach() if copy is None else copy


def storage(weight: torch.Tensor, int8: bool = False) -> str:
    """What a CPU pass streams of `weight`: 'q4', 'q8' or 'bf16' where compact_copy(weight, int8) makes such a copy,
    else its dtype. A drafter's pass costs more in bf16 than in 8-bit blocks, and more in those than in 4-bit ones,
    so the adaptive budget's cost curve is kept per storage (cost_cache.cost_key)."""
    if int8 and weight.dtype == torch.float32 and _int8_blocks_fit(weight):  # compact_copy's 4-bit case
        return "q4"
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
        if weight.int8:
            return stack.add_linear(INT8_KINDS[weight.kind], weight.int8_records(), None, bias, weight.shape[0],
                                    weight.stream)
        return stack.add_linear(QUANT_KINDS[weight.kind], weight.qs, weight.d, bias, 0)
    if weight.dtype == torch.bfloat16:
        return stack.add_linear(BF16, weight, None, bias, 0)
    if pack and weight.shape[0] % 4 == 0:  # the kernel at every width, one row on one thread included
        return stack.add_linear(F32P, qlinear.pack_rows(weight), None, bias, 0)
    return stack.add_linear(F32, weight.detach(), weight_t, bias, 0)

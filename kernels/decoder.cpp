// A stack of Llama/Qwen3 decoder layers run in one C++ call per forward pass, for float32 activations on x86 CPUs
// with AVX2 + FMA. It is ddtree.models.layers.DecoderLayer.forward (the eager reference) with the attention of
// ddtree.models.attention.attend over a KVCache, minus the ~20 small torch ops per layer that each cost more in dispatch than
// in arithmetic at 1-64 rows (a sizeable share of a small model's step: docs/cpu-speed.md).
//
// Per layer, for N new rows h [N, H] at cache rows [past, past + N):
//   x = rmsnorm(h) ; qkv = x W_qkv (+ b) ; per-head q/k rmsnorm (Qwen3) ; RoPE on q and k ; k, v -> cache
//   (a float32 cache, or an fp16 one that rounds them as torch's .half() and is read widened: the integer mode's)
//   attn = softmax(q k^T / sqrt(D), visible keys) v   keys: the whole past, and new row j where ancestors[i, j]
//   h += attn W_o (+ b) ; x = rmsnorm(h) ; g, u = x W_gate_up ; h += (silu(g) * u) W_down
// Every elementwise step rounds as the eager ops do (built with -ffp-contract=off: no fused multiply-adds where
// torch has none); the sums (norms, attention) and exp() differ from torch's in the last bits only. Each row is
// computed alone, so its result does not depend on N: with a row-invariant matmul a verify row equals a 1-row
// step.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

namespace ddtree {
namespace {

// exp(x) for x in [-87, 88] (Cephes' single-precision polynomial, ~1 ulp); below -87 it returns exp(-87) ~ 1.6e-38.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float exp1(float x) {  // one lane of exp8, for tails
  alignas(32) float v[8];
  _mm256_store_ps(v, exp8(_mm256_set1_ps(x)));
  return v[0];
}

// out[j] = w[j] * (x[j] * r), r = 1 / sqrt(mean(x^2) + eps): the eager RMSNorm's order of roundings. n % 8 == 0.
inline void rmsnorm(const float* x, const float* w, float eps, int64_t n, float* out) {
  __m256 s = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    s = _mm256_fmadd_ps(v, v, s);
  }
  const float r = 1.f / std::sqrt(hsum(s) / float(n) + eps);
  for (int64_t j = 0; j < n; ++j) out[j] = w[j] * (x[j] * r);
}

// RoPE, rotate-half layout, in place on one head x [D]: x * cos + rotate_half(x) * sin (two products, one sum).
inline void rope(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  alignas(32) float t[512];
  for (int64_t j = 0; j < half; ++j) t[j] = x[j] * cos[j] + (-x[j + half]) * sin[j];
  for (int64_t j = half; j < d; ++j) t[j] = x[j] * cos[j] + x[j - half] * sin[j];
  for (int64_t j = 0; j < d; ++j) x[j] = t[j];
}

// Eight K/V cache values as float32 lanes: the cache holds float32, or fp16 (the integer mode's, as llama.cpp's:
// half the bytes to read each pass), which widens exactly, so the attention's arithmetic is the same on either.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// The float vector of a build's two-query value sums (Stack::weigh_columns2): W lanes, and what it needs of them.
struct Ymm {
  using Vec = __m256;
  static constexpr int64_t W = 8;
  static Vec zero() { return _mm256_setzero_ps(); }
  template <class T>
  static Vec load(const T* p) { return load8(p); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
};
#ifdef __AVX512F__
struct Zmm {
  using Vec = __m512;
  static constexpr int64_t W = 16;
  static Vec zero() { return _mm512_setzero_ps(); }
  template <class T>
  static Vec load(const T* p) { return load16(p); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
};
using PairLanes = Zmm;
#else
using PairLanes = Ymm;
#endif

// One row of d values (d % 8 == 0) into the cache: copied, or rounded to the nearest fp16 (ties to even; torch's
// .half()).
inline void put_row(const float* x, float* out, int64_t d) { std::copy(x, x + d, out); }
inline void put_row(const float* x, c10::Half* out, int64_t d) {
  for (int64_t j = 0; j < d; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <class T>
inline float dot(const float* a, const T* b, int64_t d) {
  __m256 s = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), load8(b + j), s);
  return hsum(s);
}

// The eight sums hsum(a[t]), t = 0..7, as one vector: the same pairings as hsum() (lanes (0+4), (2+6), (1+5),
// (3+7), then ((0+4) + (2+6)) + ((1+5) + (3+7))), so each lane equals hsum(a[t]) bit for bit, in ~15 instructions
// instead of ~50.
inline __m256 hsum8(const __m256* a) {
  auto halves = [](__m256 x, __m256 y) {  // [x.lo + x.hi | y.lo + y.hi]
    return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  };
  const __m256 w04 = halves(a[0], a[4]), w15 = halves(a[1], a[5]), w26 = halves(a[2], a[6]), w37 = halves(a[3], a[7]);
  // [e0, o0, e1, o1 | e4, o4, e5, o5] with e = (0+4) + (2+6), o = (1+5) + (3+7) of each a[t]
  const __m256 x0145 = _mm256_add_ps(_mm256_shuffle_ps(w04, w15, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(w04, w15, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 x2367 = _mm256_add_ps(_mm256_shuffle_ps(w26, w37, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(w26, w37, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(x0145, x2367, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(x0145, x2367, _MM_SHUFFLE(3, 1, 3, 1)));
}

struct Linear {
  // Q4_1_I8, Q8_0_I8: the same blocks with the activations quantized to int8 per block (int8_linear.cpp)
  enum Kind { F32 = 1, Q4_1 = 2, Q8_0 = 3, BF16 = 4, F32P = 5, Q4_1_I8 = 6, Q8_0_I8 = 7 };
  int kind = 0;
  torch::Tensor a, b;  // F32: weight [N, K], its transpose [K, N] or undefined; Q4_1: spans; Q8_0: qs, d;
                       // BF16: weight [N, K] in bfloat16; F32P: packed weight (qlinear.pack_rows);
                       // Q4_1_I8, Q8_0_I8: the records of int8_linear.cpp's pack_q4_1 / pack_q8_0, for n outputs
  int64_t n = 0;
  bool stream = false;  // Q4_1_I8, Q8_0_I8: prefetched non-temporally (int8_linear.cpp's Prefetch::stream)
  torch::Tensor bias;
  // The same weight in GGUF blocks that dequantize to it exactly (ddtree/runtime/cpu/stack.py: a float target loaded
  // from a GGUF), taken for passes of up to `blocks_rows` rows: every kind sums an output in the same order, so the
  // result has the same bits at a sixth (Q4_1) of the bytes; wider passes are compute-bound and stay float.
  std::shared_ptr<const Linear> blocks;
  int64_t blocks_rows = 0;
  ddtree_int8::PackedWeight packed;  // Q4_1_I8, Q8_0_I8: `a`'s records, checked once (add_linear)

  // The product into `out`, which keeps its storage from call to call where it is already [M, n] (the stack's
  // buffers, reused by every layer): the int8 kinds write it in place, without an allocation or the entry point's
  // checks (x is the stack's own contiguous float32 buffer); the other kinds assign their result.
  void into(const torch::Tensor& x, torch::Tensor& out) const {
    const int64_t M = x.size(0);
    if (blocks && M <= blocks_rows) return blocks->into(x, out);
    if (packed.records == nullptr || bias.defined()) {
      out = (*this)(x);
      return;
    }
    TORCH_CHECK(x.size(1) == packed.k, "a product's input has ", x.size(1), " columns; its weight has ", packed.k);
    if (!out.defined() || out.size(0) != M || out.size(1) != n) out = torch::empty({M, n}, x.options());
    ddtree_int8::linear_into(packed, x.data_ptr<float>(), M, out.data_ptr<float>(), stream);
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (blocks && x.size(0) <= blocks_rows) return (*blocks)(x);
    torch::Tensor y;
    const bool gemv = kind == F32 && x.size(0) == 1 && at::get_num_threads() == 1;
    if (kind == Q4_1) {
      y = q4_1_linear(x, a);
    } else if (kind == Q8_0) {
      y = q8_0_linear(x, a, b);
    } else if (kind == Q4_1_I8) {
      y = ddtree_int8::q4_1_linear(x, a, n, stream);
    } else if (kind == Q8_0_I8) {
      y = ddtree_int8::q8_0_linear(x, a, n, stream);
    } else if (kind == BF16) {
      y = bf16_linear(x, a);
    } else if (gemv) {
      // One row-major row on one thread: torch's GEMV over the transposed copy streams the weight faster than
      // the kernel. Packed weights go to the kernel at every width, where it is the faster of the two (and on
      // two threads it splits the weight's rows, which torch's GEMV does not).
      y = b.defined() ? at::mm(x, b) : at::mm(x, a.t());
    } else {
      y = kind == F32P ? f32p_linear(x, a) : f32_linear(x, a);  // fixed order per output: row-invariant
    }
    if (bias.defined()) y = y + bias;
    return y;
  }
};

struct Layer {
  torch::Tensor in_norm, post_norm, q_norm, k_norm;  // q_norm / k_norm undefined without qk-norm
  Linear qkv, o, gate_up, down;
};

class Stack {
 public:
  Stack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps)
      : H(hidden), HQ(heads), HKV(kv_heads), D(head_dim), I(intermediate), eps(float(eps)) {
    TORCH_CHECK(H % 8 == 0 && D % 8 == 0 && D <= 512 && HQ % HKV == 0, "unsupported layer shape");
  }

  int64_t add_linear(int64_t kind, torch::Tensor a, c10::optional<torch::Tensor> b,
                     c10::optional<torch::Tensor> bias, int64_t n, bool stream) {
    TORCH_CHECK(kind >= Linear::F32 && kind <= Linear::Q8_0_I8, "unknown linear kind ", kind);
    Linear l;
    l.kind = int(kind);
    l.a = a;
    l.n = n;
    l.stream = stream;
    if (b) l.b = *b;
    if (bias) l.bias = *bias;
    if (l.kind == Linear::Q4_1_I8 || l.kind == Linear::Q8_0_I8)
      l.packed = ddtree_int8::packed_weight(l.a, n, l.kind == Linear::Q4_1_I8);
    linears.push_back(l);
    return int64_t(linears.size()) - 1;
  }

  // Linear `exact` (Q4_1 / Q8_0, equal to `of` once dequantized) serves `of`'s passes of up to max_rows rows.
  void add_blocks(int64_t of, int64_t exact, int64_t max_rows) {
    const Linear& e = linears.at(exact);
    TORCH_CHECK(e.kind == Linear::Q4_1 || e.kind == Linear::Q8_0, "exact blocks must be Q4_1 or Q8_0");
    linears.at(of).blocks = std::make_shared<const Linear>(e);
    linears.at(of).blocks_rows = max_rows;
  }

  void add_layer(torch::Tensor in_norm, torch::Tensor post_norm, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, int64_t qkv, int64_t o, int64_t gate_up, int64_t down) {
    Layer l;
    l.in_norm = in_norm;
    l.post_norm = post_norm;
    if (q_norm) l.q_norm = *q_norm;
    if (k_norm) l.k_norm = *k_norm;
    l.qkv = linears.at(qkv);
    l.o = linears.at(o);
    l.gate_up = linears.at(gate_up);
    l.down = linears.at(down);
    layers.push_back(l);
  }

  // h [N, H]; cos, sin [N, D]; k_cache, v_cache [layers, HKV, capacity, D]; ancestors bool [N, N] or None (all
  // new rows visible to each other). Returns the last hidden state [N, H] and the hidden states after the layers
  // in `taps`, concatenated in that order [N, len(taps) * H] (empty without taps).
  std::vector<torch::Tensor> forward(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                     torch::Tensor v_cache, int64_t past, c10::optional<torch::Tensor> ancestors,
                                     std::vector<int64_t> taps) {
    const int64_t N = h.size(0);
    const int64_t L = int64_t(layers.size());
    TORCH_CHECK(h.dim() == 2 && h.size(1) == H && h.scalar_type() == torch::kFloat32 && h.device().is_cpu(),
                "h must be float32 CPU [N, hidden]");
    check_rope(cos, sin, N);
    check_cache(k_cache, v_cache, past, N, /*half_ok=*/true);
    const bool half = k_cache.scalar_type() == torch::kHalf;
    const int64_t layer_stride = k_cache.stride(0), head_stride = k_cache.stride(1);
    const bool* anc = nullptr;
    torch::Tensor anc_t;
    if (ancestors) {
      anc_t = ancestors->contiguous();
      TORCH_CHECK(anc_t.scalar_type() == torch::kBool && anc_t.sizes() == torch::IntArrayRef({N, N}),
                  "ancestors must be bool [N, N]");
      anc = anc_t.data_ptr<bool>();
    }
    std::vector<int64_t> tap_slot(L, -1);
    for (size_t t = 0; t < taps.size(); ++t) {
      TORCH_CHECK(taps[t] >= 0 && taps[t] < L, "tap layer ", taps[t], " outside 0..", L - 1);
      tap_slot[taps[t]] = int64_t(t);
    }
    torch::Tensor tap_out = torch::empty({N, int64_t(taps.size()) * H}, h.options());

    h = h.contiguous().clone();  // updated in place below; the caller's tensor is left alone
    cos = cos.contiguous();
    sin = sin.contiguous();
    torch::Tensor x = torch::empty({N, H}, h.options());
    torch::Tensor attn = torch::empty({N, HQ * D}, h.options());
    torch::Tensor act = torch::empty({N, I}, h.options());
    torch::Tensor qkv, o, gu, down;  // the products' outputs, written by every layer in turn (Linear::into)
    float* hp = h.data_ptr<float>();
    float* xp = x.data_ptr<float>();
    const int64_t QKV = (HQ + 2 * HKV) * D;
    // The rows' elementwise work (norms, RoPE, the cache writes, residual adds, SwiGLU) runs on every thread
    // between the products (each_row); each row's arithmetic is the same wherever it runs.
    each_row(N, [&](int64_t i) { rmsnorm(hp + i * H, layers[0].in_norm.data_ptr<float>(), eps, H, xp + i * H); });
    for (int64_t l = 0; l < L; ++l) {
      const Layer& ly = layers[l];
      ly.qkv.into(x, qkv);
      TORCH_CHECK(qkv.size(1) == QKV && qkv.is_contiguous(), "qkv projection has the wrong width");
      float* q = qkv.data_ptr<float>();
      if (half)
        attention(ly, q, QKV, N, cos, sin, k_cache.data_ptr<c10::Half>() + l * layer_stride,
                  v_cache.data_ptr<c10::Half>() + l * layer_stride, head_stride, past, anc, attn.data_ptr<float>());
      else
        attention(ly, q, QKV, N, cos, sin, k_cache.data_ptr<float>() + l * layer_stride,
                  v_cache.data_ptr<float>() + l * layer_stride, head_stride, past, anc, attn.data_ptr<float>());
      ly.o.into(attn, o);
      each_row(N, [&](int64_t i) {
        add_(hp + i * H, o.data_ptr<float>() + i * H, H);
        rmsnorm(hp + i * H, ly.post_norm.data_ptr<float>(), eps, H, xp + i * H);
      });
      ly.gate_up.into(x, gu);
      each_row(N, [&](int64_t i) { swiglu(gu.data_ptr<float>() + i * 2 * I, act.data_ptr<float>() + i * I); });
      ly.down.into(act, down);
      float* dst = tap_out.data_ptr<float>();
      const Layer* next = l + 1 < L ? &layers[l + 1] : nullptr;
      each_row(N, [&](int64_t i) {
        add_(hp + i * H, down.data_ptr<float>() + i * H, H);
        if (tap_slot[l] >= 0) std::copy(hp + i * H, hp + (i + 1) * H, dst + (i * taps.size() + tap_slot[l]) * H);
        if (next) rmsnorm(hp + i * H, next->in_norm.data_ptr<float>(), eps, H, xp + i * H);
      });
    }
    return {h, tap_out};
  }

  // The drafter's context (DFlash KV injection), given by add_context(): the n committed tokens' tap features
  // [n, F] -> ctx = rmsnorm(features W_fc) [n, H]; per layer, k = RoPE(k_norm(ctx W_k)) and v = ctx W_v are written
  // at cache rows [past, past + n) (the eager DFlashDrafter._compute_context). cos, sin [n, D] at those positions.
  void add_context(int64_t fc, torch::Tensor norm, std::vector<int64_t> kv) {
    TORCH_CHECK(kv.size() == layers.size(), "add_context: one k;v linear per layer, after add_layer");
    TORCH_CHECK(norm.numel() == H && norm.scalar_type() == torch::kFloat32, "add_context: norm must be float32 [hidden]");
    ctx_fc = linears.at(fc);
    ctx_norm = norm.contiguous();
    ctx_kv.clear();
    for (int64_t id : kv) ctx_kv.push_back(linears.at(id));
  }

  void context(torch::Tensor features, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
               torch::Tensor v_cache, int64_t past) {
    TORCH_CHECK(!ctx_kv.empty(), "this stack has no drafter context (add_context)");
    const int64_t N = features.size(0);
    TORCH_CHECK(features.dim() == 2 && features.scalar_type() == torch::kFloat32 && features.device().is_cpu(),
                "features must be float32 CPU [n, taps * hidden]");
    check_rope(cos, sin, N);
    check_cache(k_cache, v_cache, past, N);
    cos = cos.contiguous();
    sin = sin.contiguous();
    torch::Tensor fused, kv;  // kv: [n, 2 * HKV * D], written by every layer in turn
    ctx_fc.into(features.contiguous(), fused);
    TORCH_CHECK(fused.size(1) == H, "the context projection has the wrong width");
    torch::Tensor ctx = torch::empty({N, H}, fused.options());
    for (int64_t i = 0; i < N; ++i)
      rmsnorm(fused.data_ptr<float>() + i * H, ctx_norm.data_ptr<float>(), eps, H, ctx.data_ptr<float>() + i * H);
    for (size_t l = 0; l < layers.size(); ++l) {
      ctx_kv[l].into(ctx, kv);
      TORCH_CHECK(kv.size(1) == 2 * HKV * D && kv.is_contiguous(), "the context's k;v projection has the wrong width");
      float* kc = k_cache.data_ptr<float>() + l * k_cache.stride(0);
      float* vc = v_cache.data_ptr<float>() + l * v_cache.stride(0);
      for (int64_t i = 0; i < N; ++i)
        key_value(layers[l], kv.data_ptr<float>() + i * 2 * HKV * D, cos.data_ptr<float>() + i * D,
                  sin.data_ptr<float>() + i * D, kc, vc, k_cache.stride(1), past + i);
    }
  }

  // The final norm of a pass, and a drafter's reduced head (a linear of this stack; -1: none, and draft()
  // returns the normed hidden states, to which the caller applies the target's head).
  void set_output(int64_t head_id, torch::Tensor norm, double norm_eps) {
    TORCH_CHECK(norm.numel() == H && norm.scalar_type() == torch::kFloat32, "set_output: norm must be float32 [hidden]");
    has_head = head_id >= 0;
    if (has_head) head = linears.at(head_id);
    final_norm = norm.contiguous();
    final_eps = float(norm_eps);
  }

  // A target's pass from its token ids as one call (CPUTarget.__call__): the rows of `embed` [V, H] at `tokens`
  // [N], the rows of the rotary tables cos_table / sin_table [P, D] at `positions` [N], the layers (forward()), then
  // the final norm (set_output) of every row, or of the last one only (last_only) -> {normed hidden [N or 1, H],
  // taps}. The functions of the calls one by one in their order: the same bits.
  std::vector<torch::Tensor> embed_forward(torch::Tensor tokens, torch::Tensor positions, torch::Tensor embed,
                                           torch::Tensor cos_table, torch::Tensor sin_table, torch::Tensor k_cache,
                                           torch::Tensor v_cache, int64_t past, c10::optional<torch::Tensor> ancestors,
                                           std::vector<int64_t> taps, bool last_only) {
    TORCH_CHECK(final_norm.defined(), "embed_forward: this stack has no final norm (set_output)");
    const int64_t N = tokens.numel();
    TORCH_CHECK(tokens.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong &&
                    positions.numel() == N && tokens.dim() == 1 && positions.dim() == 1,
                "embed_forward: tokens and positions must be int64 [N] alike");
    const torch::Tensor ids = tokens.contiguous(), pos = positions.contiguous();
    const int64_t* p = pos.data_ptr<int64_t>();
    torch::Tensor h = gather(embed, ids.data_ptr<int64_t>(), N, H, "tokens");
    torch::Tensor cos = gather(cos_table, p, N, D, "positions"), sin = gather(sin_table, p, N, D, "positions");
    std::vector<torch::Tensor> out = forward(h, cos, sin, k_cache, v_cache, past, ancestors, taps);
    out[0] = normed(out[0], last_only ? N - 1 : 0);
    return out;
  }

  // A DFlash draft as one call (DFlashDrafter.draft with every layer seeing the whole context and block): the
  // queued context features [n, F] (or none) -> K/V at cache rows [past, past + n) (context()); the block
  // [bonus, mask x (length - 1)], gathered from `embed` [V, H], at positions past + n + [0, length) (cos_table,
  // sin_table [>= past + n + length, D]: the rotary tables), through the layers (its K/V pending rows after the
  // context); the final norm of rows 1..length-1; the head -> logits [length - 1, draft vocab] (set_output; else the
  // normed hidden [length - 1, H]). The functions of the calls one by one in their order: the same bits.
  torch::Tensor draft(c10::optional<torch::Tensor> features, torch::Tensor embed, int64_t bonus, int64_t mask,
                      int64_t length, torch::Tensor cos_table, torch::Tensor sin_table, torch::Tensor k_cache,
                      torch::Tensor v_cache, int64_t past) {
    TORCH_CHECK(final_norm.defined(), "draft: this stack has no final norm (set_output)");
    TORCH_CHECK(length >= 2, "draft: a block of at least 2 positions");
    const int64_t n = features ? features->size(0) : 0;
    std::vector<int64_t> rows(std::max(n, length));
    if (n > 0) {
      std::iota(rows.begin(), rows.begin() + n, past);
      context(*features, gather(cos_table, rows.data(), n, D, "positions"),
              gather(sin_table, rows.data(), n, D, "positions"), k_cache, v_cache, past);
    }
    std::iota(rows.begin(), rows.begin() + length, past + n);
    std::vector<int64_t> block(length, mask);
    block[0] = bonus;
    torch::Tensor cos = gather(cos_table, rows.data(), length, D, "positions");
    torch::Tensor sin = gather(sin_table, rows.data(), length, D, "positions");
    const torch::Tensor out = forward(gather(embed, block.data(), length, H, "tokens"), cos, sin, k_cache, v_cache,
                                      past + n, c10::nullopt, {})[0];
    const torch::Tensor hidden = normed(out, 1);
    return has_head ? head(hidden) : hidden;
  }

 private:
  // Rows id[0..M) of a contiguous float32 table [R, width] -> [M, width]; an id outside 0..R-1 is an error.
  static torch::Tensor gather(const torch::Tensor& table, const int64_t* id, int64_t M, int64_t width,
                              const char* what) {
    TORCH_CHECK(table.dim() == 2 && table.size(1) == width && table.scalar_type() == torch::kFloat32 &&
                    table.is_contiguous() && table.device().is_cpu(),
                "a contiguous float32 CPU table [rows, ", width, "] for the ", what);
    const int64_t R = table.size(0);
    torch::Tensor out = torch::empty({M, width}, table.options());
    const float* src = table.data_ptr<float>();
    for (int64_t i = 0; i < M; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < R, what, " ", id[i], " outside the table's 0..", R - 1);
      std::copy(src + id[i] * width, src + (id[i] + 1) * width, out.data_ptr<float>() + i * width);
    }
    return out;
  }

  // The final norm (set_output) of rows first.. of x [N, H] -> [N - first, H].
  torch::Tensor normed(const torch::Tensor& x, int64_t first) const {
    torch::Tensor out = torch::empty({x.size(0) - first, H}, x.options());
    for (int64_t i = first; i < x.size(0); ++i)
      rmsnorm(x.data_ptr<float>() + i * H, final_norm.data_ptr<float>(), final_eps, H,
              out.data_ptr<float>() + (i - first) * H);
    return out;
  }

  void check_rope(const torch::Tensor& cos, const torch::Tensor& sin, int64_t n) const {
    TORCH_CHECK(cos.sizes() == torch::IntArrayRef({n, D}) && sin.sizes() == cos.sizes() &&
                    cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
                "cos and sin must be float32 [rows, head_dim]");
  }

  // Any layer and head strides (the batched generator passes one row of its cache as a view); each head's rows
  // must be contiguous [capacity, head_dim], and K and V laid out alike.
  // A target's passes take a float32 or an fp16 cache (half_ok), a drafter's context a float32 one.
  void check_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t past, int64_t n,
                   bool half_ok = false) const {
    const bool dtype_ok = k_cache.scalar_type() == torch::kFloat32 || (half_ok && k_cache.scalar_type() == torch::kHalf);
    for (const auto* c : {&k_cache, &v_cache})
      TORCH_CHECK(c->dim() == 4 && c->size(0) == int64_t(layers.size()) && c->size(1) == HKV && c->size(3) == D &&
                      c->stride(3) == 1 && c->stride(2) == D && c->strides() == k_cache.strides() &&
                      c->sizes() == k_cache.sizes() && dtype_ok && c->scalar_type() == k_cache.scalar_type() &&
                      c->device().is_cpu(),
                  "the KV cache must be ", half_ok ? "float32 or float16" : "float32",
                  " CPU [layers, kv_heads, capacity, head_dim], K and V alike, rows contiguous");
    TORCH_CHECK(past >= 0 && past + n <= k_cache.size(2), "KV cache overflow: ", past + n, " rows > capacity ",
                k_cache.size(2));
  }

  // One row's keys and values kv = [k heads | v heads] (HKV * D each): k_norm (Qwen3) and RoPE on the keys, in
  // place, then both written at cache row `pos` of every KV head.
  template <class T>
  void key_value(const Layer& ly, float* kv, const float* cos, const float* sin, T* kc, T* vc,
                 int64_t head_stride, int64_t pos) const {
    for (int64_t a = 0; a < HKV; ++a) {
      float* k = kv + a * D;
      if (ly.k_norm.defined()) rmsnorm(k, ly.k_norm.data_ptr<float>(), eps, D, k);
      rope(k, cos, sin, D);
      put_row(k, kc + a * head_stride + pos * D, D);
      put_row(kv + (HKV + a) * D, vc + a * head_stride + pos * D, D);
    }
  }

  // A layer's attention over its cache (T: float or c10::Half): per row, q_norm (Qwen3) and RoPE on the query
  // heads of q [N, QKV] in place and its keys and values into the cache at row past + i; then attend().
  template <class T>
  void attention(const Layer& ly, float* q, int64_t QKV, int64_t N, const torch::Tensor& cos,
                 const torch::Tensor& sin, T* kc, T* vc, int64_t head_stride, int64_t past, const bool* anc,
                 float* out) const {
    each_row(N, [&](int64_t i) {
      float* row = q + i * QKV;
      if (ly.q_norm.defined())
        for (int64_t a = 0; a < HQ; ++a) rmsnorm(row + a * D, ly.q_norm.data_ptr<float>(), eps, D, row + a * D);
      for (int64_t a = 0; a < HQ; ++a) rope(row + a * D, cos.data_ptr<float>() + i * D, sin.data_ptr<float>() + i * D, D);
      key_value(ly, row + HQ * D, cos.data_ptr<float>() + i * D, sin.data_ptr<float>() + i * D, kc, vc, head_stride,
                past + i);
    });
    attend(q, QKV, kc, vc, head_stride, past, N, anc, out);
  }

  // Rows from this many up share their elementwise work between the threads; fewer run on the calling thread,
  // where waking the others would cost more than the work.
  static constexpr int64_t PARALLEL_ROWS = 4;

  template <class F>
  static void each_row(int64_t n, const F& fn) {
    if (n < PARALLEL_ROWS || at::get_num_threads() < 2) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    at::parallel_for(0, n, 1, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) fn(i);
    });
  }

  // y += z, elementwise (the eager residual `h + z`).
  static void add_(float* y, const float* z, int64_t n) {
    for (int64_t j = 0; j < n; ++j) y[j] = y[j] + z[j];
  }

  // One row: gu [2I] = [gate | up] -> act [I] = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
  void swiglu(const float* g, float* a) const {
    const float* u = g + I;
    int64_t j = 0;
    for (; j + 8 <= I; j += 8) {
      const __m256 gv = _mm256_loadu_ps(g + j);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e));
      _mm256_storeu_ps(a + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
    }
    for (; j < I; ++j) a[j] = g[j] / (1.f + exp1(-g[j])) * u[j];
  }

  // Attention of the N new rows, per KV head: its queries are (query head of its group, row) pairs, all reading
  // the same K and V. They walk the keys in blocks of KEY_BLOCK, so a block is read from L2/L3 once and serves
  // every query of the task from L1, instead of once per query; within a block the queries go two at a time
  // (score_block2, weigh_values2: each key and value chunk loaded and widened once for both).
  // Each (query, key) score and each output column keep their order of sums (a score: dot()'s over D, then
  // hsum(); a column: the keys in order, the running sum parked in `out` between blocks, which rounds nothing),
  // so a row's result does not depend on N or on which queries share its task.
  static constexpr int64_t KEY_BLOCK = 32;
  // K and V rows are requested this many key blocks ahead of their use by tasks of up to PREFETCH_QUERIES
  // queries (passes of up to 5 rows for SmolLM2's 3 query heads a KV head): a long context's cache comes from
  // memory, and a few queries' arithmetic cannot hide it; a wider task's can, and there the prefetches only stall.
  static constexpr int64_t PREFETCH_BLOCKS = 2, PREFETCH_QUERIES = 8;

  // Prefetch rows [b, b + KEY_BLOCK) of one head's K or V (capped at `keys`), a cache line at a time.
  template <class T>
  void prefetch_rows(const T* X, int64_t b, int64_t keys) const {
    const int64_t e = std::min(keys, b + KEY_BLOCK);
    if (b >= e) return;
    const char* p = reinterpret_cast<const char*>(X + b * D);
    const char* end = reinterpret_cast<const char*>(X + e * D);
    for (; p < end; p += 64) _mm_prefetch(p, _MM_HINT_T0);
  }

  template <class T>
  void attend(const float* qkv, int64_t QKV, const T* kc, const T* vc, int64_t head_stride, int64_t past,
              int64_t N, const bool* anc, float* out) const {
    const int64_t group = HQ / HKV, keys = past + N, per_kv = group * N;
    // Split each KV head's queries so that every thread gets work (one row: 9 heads over 2 threads as 5 + 4).
    const int64_t splits = std::min(per_kv, (2 * int64_t(at::get_num_threads()) + HKV - 1) / HKV);
    const int64_t chunk = (per_kv + splits - 1) / splits;
    const int64_t tasks = HKV * ((per_kv + chunk - 1) / chunk);
    // taken as the threads go (parallel_chunks): a task's bits do not depend on the thread that runs it
    parallel_chunks(tasks, 1, [&](int64_t p0, int64_t p1) {
      const int64_t padded = (keys + 7) & ~int64_t(7);
      // each thread's scores, kept from layer to layer (every entry a task reads is written first: score_block*,
      // then softmax_numerators' padding)
      thread_local std::vector<float> scores, sums;
      if (scores.size() < size_t(chunk * padded)) scores.resize(chunk * padded);
      if (sums.size() < size_t(chunk)) sums.resize(chunk);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t g = p / (tasks / HKV), t0 = (p % (tasks / HKV)) * chunk;
        const int64_t count = std::min(chunk, per_kv - t0);  // queries t0 .. t0 + count of this KV head
        const T* K = kc + g * head_stride;
        const T* V = vc + g * head_stride;
        auto query = [&](int64_t t) {  // t = row * group + head in group
          return qkv + (t0 + t) / group * QKV + (g * group + (t0 + t) % group) * D;
        };
        auto output = [&](int64_t t) { return out + (t0 + t) / group * HQ * D + (g * group + (t0 + t) % group) * D; };
        for (int64_t b = 0; b < keys; b += KEY_BLOCK) {
          const int64_t e = std::min(keys, b + KEY_BLOCK);
          if (count <= PREFETCH_QUERIES) prefetch_rows(K, b + PREFETCH_BLOCKS * KEY_BLOCK, keys);
          int64_t t = 0;
          for (; t + 2 <= count; t += 2)
            score_block2(query(t), query(t + 1), K, b, e, scores.data() + t * padded, scores.data() + (t + 1) * padded);
          for (; t < count; ++t) score_block(query(t), K, b, e, scores.data() + t * padded);
        }
        for (int64_t t = 0; t < count; ++t) {
          const int64_t i = (t0 + t) / group;
          sums[t] = softmax_numerators(scores.data() + t * padded, keys, past, anc ? anc + i * N : nullptr);
        }
        for (int64_t b = 0; b < keys; b += KEY_BLOCK) {
          const int64_t e = std::min(keys, b + KEY_BLOCK);
          if (count <= PREFETCH_QUERIES) prefetch_rows(V, b + PREFETCH_BLOCKS * KEY_BLOCK, keys);
          int64_t t = 0;
          for (; t + 2 <= count; t += 2)
            weigh_values2(scores.data() + t * padded, scores.data() + (t + 1) * padded, V, b, e, past, output(t),
                          output(t + 1));
          for (; t < count; ++t) weigh_values(scores.data() + t * padded, V, b, e, past, output(t));
        }
        for (int64_t t = 0; t < count; ++t) {
          float* o = output(t);
          for (int64_t c = 0; c < D; c += 8)
            _mm256_storeu_ps(o + c, _mm256_div_ps(_mm256_loadu_ps(o + c), _mm256_set1_ps(sums[t])));
        }
      }
    });
  }

  // s[j] = q . K[j] / sqrt(D) for keys j in [b, e): eight keys at a time (eight independent FMA chains), each
  // summed by hsum8 in hsum()'s order, so the values are dot()'s bit for bit.
  template <class T>
  void score_block(const float* q, const T* K, int64_t b, int64_t e, float* s) const {
    const float scale = 1.f / std::sqrt(float(D));
    int64_t j = b;
    for (; j + 8 <= e; j += 8) {
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
      const T* k0 = K + j * D;
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, load8(k0 + t * D + c), acc[t]);
      }
      _mm256_storeu_ps(s + j, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
    }
    for (; j < e; ++j) s[j] = dot(q, K + j * D, D) * scale;
  }

#ifdef __AVX512F__
  // score_block for two queries at once (the AVX-512 build): a 16-lane vector holds both queries' 8 lanes, so
  // each key chunk is loaded once for both. Every lane runs the same chain of FMAs as score_block's and each half
  // is summed by hsum8: the scores equal score_block's bit for bit.
  template <class T>
  void score_block2(const float* qa, const float* qb, const T* K, int64_t b, int64_t e, float* sa,
                    float* sb) const {
    const float scale = 1.f / std::sqrt(float(D));
    alignas(64) float pair[2 * 512];  // [qa[c:c+8] | qb[c:c+8]] per chunk c (D <= 512, checked at construction)
    for (int64_t c = 0; c < D; c += 8) {
      std::copy(qa + c, qa + c + 8, pair + 2 * c);
      std::copy(qb + c, qb + c + 8, pair + 2 * c + 8);
    }
    int64_t j = b;
    for (; j + 8 <= e; j += 8) {
      __m512 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm512_setzero_ps();
      const T* k0 = K + j * D;
      for (int64_t c = 0; c < D; c += 8) {
        const __m512 qv = _mm512_load_ps(pair + 2 * c);
        for (int t = 0; t < 8; ++t)
          acc[t] = _mm512_fmadd_ps(qv, _mm512_broadcast_f32x8(load8(k0 + t * D + c)), acc[t]);
      }
      __m256 lo[8], hi[8];
      for (int t = 0; t < 8; ++t) {
        lo[t] = _mm512_castps512_ps256(acc[t]);
        hi[t] = _mm512_extractf32x8_ps(acc[t], 1);
      }
      _mm256_storeu_ps(sa + j, _mm256_mul_ps(hsum8(lo), _mm256_set1_ps(scale)));
      _mm256_storeu_ps(sb + j, _mm256_mul_ps(hsum8(hi), _mm256_set1_ps(scale)));
    }
    for (; j < e; ++j) {
      sa[j] = dot(qa, K + j * D, D) * scale;
      sb[j] = dot(qb, K + j * D, D) * scale;
    }
  }
#else
  // score_block for two queries at once (the AVX2 build): four keys a tile, each key chunk loaded (and widened
  // from fp16) once for both queries, 8 accumulators in 16 ymm registers. Every (query, key) runs score_block's
  // chain of FMAs over D and hsum8 sums each accumulator as hsum() does: the scores equal score_block's bit for bit.
  template <class T>
  void score_block2(const float* qa, const float* qb, const T* K, int64_t b, int64_t e, float* sa,
                    float* sb) const {
    const float scale = 1.f / std::sqrt(float(D));
    int64_t j = b;
    for (; j + 4 <= e; j += 4) {
      __m256 acc[8];  // [query a's keys j .. j + 3 | query b's]
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
      const T* k0 = K + j * D;
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 qav = _mm256_loadu_ps(qa + c), qbv = _mm256_loadu_ps(qb + c);
        for (int t = 0; t < 4; ++t) {
          const __m256 kv = load8(k0 + t * D + c);
          acc[t] = _mm256_fmadd_ps(qav, kv, acc[t]);
          acc[4 + t] = _mm256_fmadd_ps(qbv, kv, acc[4 + t]);
        }
      }
      const __m256 sums = _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale));
      _mm_storeu_ps(sa + j, _mm256_castps256_ps128(sums));
      _mm_storeu_ps(sb + j, _mm256_extractf128_ps(sums, 1));
    }
    for (; j < e; ++j) {
      sa[j] = dot(qa, K + j * D, D) * scale;
      sb[j] = dot(qb, K + j * D, D) * scale;
    }
  }
#endif

  // weigh_values for two queries at once: PairLanes::W columns a vector (PairLanes: 16 in the AVX-512 build, 8 in the
  // AVX2 one), each value row chunk loaded once for both. Each column still sums its keys in order and skips a
  // query's keys of weight 0: the same bits.
  template <class T>
  void weigh_values2(const float* wa, const float* wb, const T* V, int64_t b, int64_t e, int64_t past,
                     float* oa, float* ob) const {
    using L = PairLanes;
    int64_t c0 = 0;
    for (; c0 + 4 * L::W <= D; c0 += 4 * L::W)
      weigh_columns2<L, 4>(wa, wb, V + c0, D, b, e, past, oa + c0, ob + c0);
    switch ((D - c0) / L::W) {
      case 1: weigh_columns2<L, 1>(wa, wb, V + c0, D, b, e, past, oa + c0, ob + c0); break;
      case 2: weigh_columns2<L, 2>(wa, wb, V + c0, D, b, e, past, oa + c0, ob + c0); break;
      case 3: weigh_columns2<L, 3>(wa, wb, V + c0, D, b, e, past, oa + c0, ob + c0); break;
      default: break;
    }
    c0 += (D - c0) / L::W * L::W;
    if (c0 < D) {  // D % 16 == 8 in the AVX-512 build: the last 8 columns, one query at a time
      weigh_columns<1>(wa, V + c0, D, b, e, past, oa + c0);
      weigh_columns<1>(wb, V + c0, D, b, e, past, ob + c0);
    }
  }

  template <class L, int C, class T>
  static void weigh_columns2(const float* wa, const float* wb, const T* V, int64_t D, int64_t b, int64_t e,
                             int64_t past, float* oa, float* ob) {
    using Vec = typename L::Vec;
    Vec A[C], B[C];
    for (int c = 0; c < C; ++c) {
      A[c] = b == 0 ? L::zero() : L::load(oa + L::W * c);
      B[c] = b == 0 ? L::zero() : L::load(ob + L::W * c);
    }
    auto add = [&](Vec (&acc)[C], float w, const T* v) {  // acc += w v, W columns a vector
      const Vec wv = L::set1(w);
      for (int c = 0; c < C; ++c) acc[c] = L::fma(wv, L::load(v + L::W * c), acc[c]);
    };
    auto add_both = [&](float x, float y, const T* v) {  // each value vector loaded once for both queries
      const Vec xv = L::set1(x), yv = L::set1(y);
      for (int c = 0; c < C; ++c) {
        const Vec vv = L::load(v + L::W * c);
        A[c] = L::fma(xv, vv, A[c]);
        B[c] = L::fma(yv, vv, B[c]);
      }
    };
    int64_t j = b;
    for (const int64_t end = std::min(e, past); j < end; ++j)  // past keys: never masked, no weight is 0
      add_both(wa[j], wb[j], V + j * D);
    for (; j < e; ++j) {
      const float x = wa[j], y = wb[j];
      if (x != 0.f && y != 0.f) {
        add_both(x, y, V + j * D);
      } else if (x != 0.f) {
        add(A, x, V + j * D);
      } else if (y != 0.f) {
        add(B, y, V + j * D);
      }
    }
    for (int c = 0; c < C; ++c) {
      L::store(oa + L::W * c, A[c]);
      L::store(ob + L::W * c, B[c]);
    }
  }

  // Scores -> exp(s - max) in place over the visible keys (0 elsewhere); returns their sum. vis: the row's
  // ancestors among the new rows, or null (all visible). The sum takes the visible keys in order, the k-th one in
  // lane k % 8 (then hsum), wherever masked keys sit: a tree node's sum is that of the same path run as 1-row
  // steps (its siblings' slots skipped, not added as zeros that would shift its own key to another lane), and a
  // row's sum has one order whatever the pass's width.
  static float softmax_numerators(float* s, int64_t keys, int64_t past, const bool* vis) {
    // The maximum (exact in any order): the past eight lanes at a time, then the new rows with their mask.
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= past; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m8);
    float m = -INFINITY;
    for (float x : lanes) m = std::max(m, x);
    for (; j < keys; ++j) {
      if (j >= past && vis && !vis[j - past]) s[j] = -INFINITY;  // a new row that is not an ancestor
      m = std::max(m, s[j]);
    }
    const int64_t padded = (keys + 7) & ~int64_t(7);
    for (j = keys; j < padded; ++j) s[j] = -INFINITY;
    const __m256 mv = _mm256_set1_ps(m);
    const int64_t whole = past & ~int64_t(7);  // the past's full blocks: every key visible, key j is the j-th
    __m256 sum8 = _mm256_setzero_ps();
    for (j = 0; j < padded; j += 8) {
      const __m256 sv = _mm256_loadu_ps(s + j);
      const __m256 live = _mm256_cmp_ps(sv, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      const __m256 ev = _mm256_and_ps(exp8(_mm256_sub_ps(sv, mv)), live);
      _mm256_storeu_ps(s + j, ev);
      if (j < whole) sum8 = _mm256_add_ps(sum8, ev);
    }
    // the rest of the past, then the visible new rows, packed eight to a block in order (zeros after the last)
    alignas(32) float rest[8];
    int fill = 0;
    for (j = whole; j < keys; ++j) {
      if (j >= past && vis && !vis[j - past]) continue;  // not an ancestor: no slot
      rest[fill++] = s[j];
      if (fill == 8) {
        sum8 = _mm256_add_ps(sum8, _mm256_load_ps(rest));
        fill = 0;
      }
    }
    if (fill) {
      for (int k = fill; k < 8; ++k) rest[k] = 0.f;
      sum8 = _mm256_add_ps(sum8, _mm256_load_ps(rest));
    }
    return hsum(sum8);
  }

  // o[:D] += sum over keys j in [b, e) of w[j] V[j] (o zeroed at b == 0), 64 columns at a time: each column
  // sums its keys in order; masked keys (w == 0: only new rows, as a past key weighs at least exp(-87)) are skipped.
  template <class T>
  void weigh_values(const float* w, const T* V, int64_t b, int64_t e, int64_t past, float* o) const {
    int64_t c0 = 0;
    for (; c0 + 64 <= D; c0 += 64) weigh_columns<8>(w, V + c0, D, b, e, past, o + c0);
    switch ((D - c0) / 8) {  // D % 8 == 0
      case 1: weigh_columns<1>(w, V + c0, D, b, e, past, o + c0); break;
      case 2: weigh_columns<2>(w, V + c0, D, b, e, past, o + c0); break;
      case 3: weigh_columns<3>(w, V + c0, D, b, e, past, o + c0); break;
      case 4: weigh_columns<4>(w, V + c0, D, b, e, past, o + c0); break;
      case 5: weigh_columns<5>(w, V + c0, D, b, e, past, o + c0); break;
      case 6: weigh_columns<6>(w, V + c0, D, b, e, past, o + c0); break;
      case 7: weigh_columns<7>(w, V + c0, D, b, e, past, o + c0); break;
      default: break;
    }
  }

  // C accumulators of 8 columns fed key by key. C is a compile-time constant so that they stay in registers:
  // with a run-time count the compiler kept them on the stack, and every FMA waited on a store and a reload
  // (~10 ns per head, row and key for SmolLM2).
  template <int C, class T>
  static void weigh_columns(const float* w, const T* V, int64_t D, int64_t b, int64_t e, int64_t past,
                            float* o) {
    __m256 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = b == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o + 8 * c);
    auto add = [&](int64_t j) {  // acc += w[j] V[j]
      const __m256 wv = _mm256_set1_ps(w[j]);
      const T* v = V + j * D;
      for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(wv, load8(v + 8 * c), acc[c]);
    };
    int64_t j = b;
    for (const int64_t end = std::min(e, past); j < end; ++j) add(j);  // past keys: never masked, no weight is 0
    for (; j < e; ++j)
      if (w[j] != 0.f) add(j);
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
  }

  int64_t H, HQ, HKV, D, I;
  float eps;
  std::vector<Linear> linears;
  std::vector<Layer> layers;
  Linear ctx_fc;  // the drafter's context (add_context): fc, hidden_norm's weight, per layer its k;v projection
  torch::Tensor ctx_norm;
  std::vector<Linear> ctx_kv;
  Linear head;  // a pass's final norm and a drafter's reduced head (set_output)
  bool has_head = false;
  torch::Tensor final_norm;
  float final_eps = 0.f;
};

// The final norm of a pass, rows [N, H] -> [N, H]: the stack's rmsnorm as one call, where torch's RMSNorm takes
// ~6 dispatched ops.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.size(1) % 8 == 0,
              "rms_norm: x must be float32 CPU [N, hidden] with hidden % 8 == 0");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.numel() == x.size(1), "rms_norm: w must be float32 [hidden]");
  x = x.contiguous();
  w = w.contiguous();
  torch::Tensor out = torch::empty_like(x);
  const int64_t n = x.size(0), h = x.size(1);
  for (int64_t i = 0; i < n; ++i)
    rmsnorm(x.data_ptr<float>() + i * h, w.data_ptr<float>(), float(eps), h, out.data_ptr<float>() + i * h);
  return out;
}

}  // namespace

// argmax of one row p [v] (v > 0): torch.argmax's answer (the first maximum; a NaN counts as the maximum, the first
// one), in a vectorized pass for the maximum and one for its first index. torch's reduction is several times slower
// over a large vocabulary, and it runs every step of every method.
int64_t argmax_row(const float* p, int64_t v) {
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= v; j += 8) {
    const __m256 a = _mm256_loadu_ps(p + j);
    top = _mm256_max_ps(top, a);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float best = lanes[0];
  for (int l = 1; l < 8; ++l) best = std::max(best, lanes[l]);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t t = j; t < v; ++t) {
    if (std::isnan(p[t])) has_nan = true;
    else best = std::max(best, p[t]);
  }
  if (has_nan) {
    int64_t found = 0;
    while (!std::isnan(p[found])) ++found;
    return found;
  }
  const __m256 b = _mm256_set1_ps(best);
  int64_t k = 0;
  for (; k + 8 <= v; k += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + k), b, _CMP_EQ_OQ));
    if (mask) break;
  }
  while (p[k] != best) ++k;  // the first lane of the block that matched, or the tail
  return k;
}

namespace {

// argmax_row of each row of x [N, V] -> long [N].
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.size(1) > 0,
              "argmax_rows: x must be float32 CPU [N, V] with V > 0");
  x = x.contiguous();
  const int64_t n = x.size(0), v = x.size(1);
  torch::Tensor out = torch::empty({n}, x.options().dtype(torch::kLong));
  for (int64_t i = 0; i < n; ++i) out.data_ptr<int64_t>()[i] = argmax_row(x.data_ptr<float>() + i * v, v);
  return out;
}

// The sum in double of the entries p > 0 of p[0..n) (NaN and non-positive ones count 0), in one fixed order: eight
// lanes (two vectors of four doubles) over the groups of 8, the lanes in order, then the tail.
double positive_sum(const float* p, int64_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  const __m256 zero = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 x = _mm256_loadu_ps(p + j);
    x = _mm256_and_ps(x, _mm256_cmp_ps(x, zero, _CMP_GT_OQ));
    a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
  }
  alignas(32) double lanes[8];
  _mm256_store_pd(lanes, a0);
  _mm256_store_pd(lanes + 4, a1);
  double sum = 0.0;
  for (const double lane : lanes) sum += lane;
  for (; j < n; ++j)
    if (p[j] > 0.0f) sum += double(p[j]);
  return sum;
}

constexpr int64_t SAMPLE_BLOCK = 256;  // sample_rows' blocks of entries

// One draw per row of probs [N, V] (non-negative, any scale) by the inverse CDF: u [N] uniform in [0, 1), target =
// u * total; the first index whose running sum exceeds the target. The sums are in double, by blocks of SAMPLE_BLOCK
// entries: the block sums (positive_sum), the total their running sum, and the scan skips whole blocks on that
// running sum, then walks the block that crosses the target entry by entry from it (where rounding leaves that
// block's walk short of the target, on to the next). That is the categorical distribution p / total up to the
// rounding of double sums; a zero p is never drawn (a target that rounding puts past every running sum takes the
// last index with p > 0). torch.multinomial draws an exponential per entry over a whole vocabulary per row; this is
// one uniform, one vectorized pass and one block's walk.
torch::Tensor sample_rows(torch::Tensor probs, torch::Tensor u) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat32 && probs.device().is_cpu() &&
                  probs.size(1) > 0, "sample_rows: probs must be float32 CPU [N, V] with V > 0");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == torch::kFloat64 && u.size(0) == probs.size(0),
              "sample_rows: u must be float64 [N]");
  probs = probs.contiguous();
  u = u.contiguous();
  const int64_t n = probs.size(0), v = probs.size(1), blocks = (v + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
  torch::Tensor out = torch::empty({n}, probs.options().dtype(torch::kLong));
  std::vector<double> sums(blocks);
  for (int64_t i = 0; i < n; ++i) {
    const float* p = probs.data_ptr<float>() + i * v;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
      sums[b] = positive_sum(p + b * SAMPLE_BLOCK, std::min(SAMPLE_BLOCK, v - b * SAMPLE_BLOCK));
      total += sums[b];
    }
    TORCH_CHECK(total > 0.0 && std::isfinite(total), "sample_rows: row ", i, " has no probability mass (sum ", total, ")");
    const double target = u.data_ptr<double>()[i] * total;
    double cum = 0.0;
    int64_t pick = -1;
    for (int64_t b = 0; b < blocks && pick < 0; ++b) {
      if (cum + sums[b] <= target) {  // the draw lies past this block
        cum += sums[b];
        continue;
      }
      for (int64_t j = b * SAMPLE_BLOCK, end = std::min(v, j + SAMPLE_BLOCK); j < end; ++j) {
        if (p[j] > 0.0f) {
          cum += double(p[j]);
          if (cum > target) {
            pick = j;
            break;
          }
        }
      }
    }
    if (pick < 0)
      for (int64_t j = v - 1; j >= 0 && pick < 0; --j)
        if (p[j] > 0.0f) pick = j;
    out.data_ptr<int64_t>()[i] = pick;
  }
  return out;
}

// A snapshot of tensors' data pointers and version counters (ddtree/runtime/cpu/weights_watch.py): changed() is one C++
// loop, where the same check in Python costs three map() calls over every parameter, every pass.
struct WeightsSnapshot {
  std::vector<torch::Tensor> tensors;  // the same TensorImpls as the Python parameters: `p.data = x` is seen too
  std::vector<const void*> pointers;
  std::vector<int64_t> versions;

  explicit WeightsSnapshot(std::vector<torch::Tensor> ts) : tensors(std::move(ts)) {
    for (const auto& t : tensors) {
      pointers.push_back(t.data_ptr());
      versions.push_back(int64_t(t._version()));
    }
  }
  bool changed() const {
    for (size_t i = 0; i < tensors.size(); ++i)
      if (tensors[i].data_ptr() != pointers[i] || int64_t(tensors[i]._version()) != versions[i]) return true;
    return false;
  }
};

}  // namespace

void bind_decoder(pybind11::module& mod) {
  pybind11::class_<WeightsSnapshot>(mod, "WeightsSnapshot")
      .def(pybind11::init<std::vector<torch::Tensor>>(), "tensors: their data pointers and versions now")
      .def("changed", &WeightsSnapshot::changed, "has any tensor's data pointer or version counter changed?");
  mod.def("sample_rows", &sample_rows, "probs [N, V] float32, u [N] float64 in [0, 1) -> one draw per row (long [N])");
  mod.def("argmax_rows", &argmax_rows, "x [N, V] float32 -> torch.argmax(x, -1) (first maximum; NaN first)");
  mod.def("rms_norm", &rms_norm, "x [N, H], w [H], eps -> rmsnorm of each row (the stack's)");
  pybind11::class_<Stack>(mod, "DecoderStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double>(), "hidden, heads, kv_heads, head_dim, "
           "intermediate, rms_norm_eps")
      .def("add_linear", &Stack::add_linear, "kind (1 f32, 2 Q4_1, 3 Q8_0, 4 bf16, 5 packed f32, 6 Q4_1 int8 "
           "activations, 7 Q8_0 int8 activations), tensors, bias, outputs (the int8 kinds' packed records), stream "
           "(the int8 kinds: prefetch non-temporally) -> its index",
           pybind11::arg("kind"), pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("bias"), pybind11::arg("n"),
           pybind11::arg("stream") = false)
      .def("add_blocks", &Stack::add_blocks, "of, exact, max_rows: linear `exact` (GGUF blocks equal to linear `of`) "
           "runs `of`'s passes of up to max_rows rows")
      .def("add_layer", &Stack::add_layer, "norms and the indices of qkv, o, gate_up, down")
      .def("forward", &Stack::forward, "h, cos, sin, k_cache, v_cache, past, ancestors, taps -> [h, taps]")
      .def("add_context", &Stack::add_context, "fc, hidden_norm weight, per layer its k;v linear: the drafter's context")
      .def("set_output", &Stack::set_output, "head (a linear's index, or -1), final norm weight, eps: for "
           "embed_forward() and draft()")
      .def("embed_forward", &Stack::embed_forward, "tokens, positions, embed, cos_table, sin_table, k_cache, v_cache, "
           "past, ancestors, taps, last_only -> [normed hidden, taps]: a target's pass from its token ids")
      .def("draft", &Stack::draft, "features or None, embed, bonus, mask, length, cos_table, sin_table, k_cache, "
           "v_cache, past -> a drafter's block logits (or normed hidden) [length - 1, V]")
      .def("context", &Stack::context, "features, cos, sin, k_cache, v_cache, past: the drafter's context K/V");
}

}  // namespace ddtree

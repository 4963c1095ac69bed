// Weight-only quantized linear layers for x86 CPUs with AVX2 + FMA (and a build with AVX-512VL's registers): y [M, N] = x [M, K] @ W^T, x and y float32,
// W [N, K] quantized in GGUF's blocks of 32 weights along K and dequantized in registers (see ddtree/runtime/cpu/qlinear.py).
//
//   Q4_1: w = d * q + m, q in 0..15, repacked at load so that no shuffles are needed: per 64 weights a 40-byte
//         span of 8 uint32 lanes, nibble g (bits 4g..4g+3) of lane l holding weight 8g + l (so (lanes >> 4g) & 15
//         is weights 8g..8g+7 in order), then the two blocks' fp16 scales d0, m0, d1, m1. One stream per row:
//         d and m in arrays of their own would make three streams per row (and 24 bytes a block, not 20), which
//         the prefetchers serve more slowly (measured in docs/cpu-speed.md).
//   Q8_0: w = d * q, q int8, GGUF's order; d float32 [N, K / 32].
// The fp16 scales widen to fp32 exactly, and d * q is exact in fp32 (11 x 8 mantissa bits), so every weight
// equals gguf-py's dequantized value bit for bit: the model is exactly the GGUF's.
//
// The order of the sums is fixed per output: y[r, n] accumulates x[r, 8g:8g+8] * w[n, 8g:8g+8] in ONE 8-lane
// chain over g = 0, 1, ..., then hsum(). It does not depend on M, on the tile a row falls in, or on the thread
// split, so a 1-token decoding step and a 16-node verify project the same row bit-identically. FMA latency is
// hidden by running 4 outputs (and for M > 1, 3 x rows) side by side instead of splitting a sum.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <type_traits>
#include <utility>
#include <vector>

namespace ddtree {
namespace {

constexpr int64_t QK = 32;  // weights per block
constexpr int NT = 4;       // output rows per tile
// Rows that one dequantizing pass takes (more are swept over a stored tile): 12 with AVX-512VL, else 5 (see tile())
#if defined(__AVX512VL__)
constexpr int WIDE_PASS_ROWS = 12;
#else
constexpr int WIDE_PASS_ROWS = 5;
#endif
// Prefetch distance in rows. Without it a quantized weight streams at a fraction of the bandwidth that float32
// weights read in order reach; prefetching (never faults, so past the last row is harmless) fixes that.
constexpr int64_t PREFETCH_ROWS = 16;

// Each kind reads a row's weights 64 at a time (a "span": two blocks); w8<G>() gives weights 8G..8G+7 of it.
struct Q4_1 {
  const char* spans;  // [N, K / 64] spans of 40 bytes (see the top)
  int64_t k;
  static constexpr int64_t SPAN_BYTES = 40, SPAN_WORDS = SPAN_BYTES / 4;  // qlinear.SPAN_WORDS int32 words

  struct Span {
    __m256i v;
    __m256 sc;  // d0 m0 d1 m1 in its low lanes
  };
  inline const char* at(int64_t n, int64_t s) const { return spans + (n * (k / 64) + s) * SPAN_BYTES; }
  inline void prefetch(int64_t n, int64_t s) const {  // a span may straddle two cache lines
    _mm_prefetch(at(n, s), _MM_HINT_T0);
    _mm_prefetch(at(n, s) + SPAN_BYTES - 1, _MM_HINT_T0);
  }
  inline Span span(int64_t n, int64_t s) const {
    const char* p = at(n, s);
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 32))))};
  }
  // (d * q) + m in one FMA: d * q is exact in fp32 (see the top), so the fused rounding is gguf-py's two-step one
  template <int G>
  static inline __m256 w8(const Span& sp) {
    const __m256i q = _mm256_and_si256(_mm256_srli_epi32(sp.v, 4 * G), _mm256_set1_epi32(0x0F));
    const __m256 d = _mm256_permutevar8x32_ps(sp.sc, _mm256_set1_epi32(2 * (G / 4)));
    const __m256 m = _mm256_permutevar8x32_ps(sp.sc, _mm256_set1_epi32(2 * (G / 4) + 1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
  }
};

struct Q8_0 {
  const int8_t* qs;  // [N, K]
  const float* d;    // [N, K / 32]
  int64_t k;

  struct Span {
    const int8_t* q;
    const float* d;
  };
  inline void prefetch(int64_t n, int64_t s) const {
    _mm_prefetch(reinterpret_cast<const char*>(qs + n * k + 64 * s), _MM_HINT_T0);
    if (s % 8 == 0) _mm_prefetch(reinterpret_cast<const char*>(d + n * (k / QK) + 2 * s), _MM_HINT_T0);
  }
  inline Span span(int64_t n, int64_t s) const { return {qs + n * k + 64 * s, d + n * (k / QK) + 2 * s}; }
  template <int G>
  static inline __m256 w8(const Span& sp) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp.q + 8 * G));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_broadcast_ss(sp.d + G / 4));
  }
};

// Unquantized weights [N, K] through the same loops, as float32 or as bfloat16 widened in registers (exact: a bf16
// is the top half of an fp32, so a bf16 product equals the float32 one on the widened weights bit for bit, at half
// the bytes; for models published in bf16). For skinny products (2-64 rows) this beats torch's GEMM, which is tuned
// for larger shapes, and it gives float models the same row-order invariance.
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <class E>
struct Dense {
  const E* w;  // [N, K]
  int64_t k;

  struct Span {
    const E* p;
  };
  inline void prefetch(int64_t n, int64_t s) const {  // the span's 64 weights, one cache line at a time
    const char* p = reinterpret_cast<const char*>(w + n * k + 64 * s);
    for (size_t b = 0; b < 64 * sizeof(E); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  }
  inline Span span(int64_t n, int64_t s) const { return {w + n * k + 64 * s}; }
  template <int G>
  static inline __m256 w8(const Span& sp) { return widen8(sp.p + 8 * G); }
};
using F32 = Dense<float>;
using BF16 = Dense<uint16_t>;

// float32 weights packed per tile, [N / NT, K / 64, NT, 64] (qlinear.pack_rows): a tile's NT rows lie span by span
// in ONE run of memory. Row-major [N, K] is read as NT streams at stride K, which hardware prefetchers serve
// more slowly than one sequential stream. Same sums as F32, bit for bit.
struct Packed {
  const float* w;
  int64_t k;

  struct Span {
    const float* p;
  };
  inline const float* at(int64_t n, int64_t s) const { return w + ((n / NT) * (k / 64) + s) * (NT * 64) + (n % NT) * 64; }
  inline void prefetch(int64_t, int64_t) const {}  // one sequential stream: the hardware prefetcher keeps up alone
  inline Span span(int64_t n, int64_t s) const { return {at(n, s)}; }
  template <int G>
  static inline __m256 w8(const Span& sp) { return _mm256_loadu_ps(sp.p + 8 * G); }
};

// Where weight (t, 8g..8g+7) of a tile lies: row-major [T, K] (a dequantized buf, float32 rows in place) or packed.
struct RowMajor {
  int64_t k;
  inline int64_t operator()(int t, int64_t g) const { return t * k + 8 * g; }
};
struct Panel {
  inline int64_t operator()(int t, int64_t g) const { return (g >> 3) * (NT * 64) + t * 64 + (g & 7) * 8; }
};

// float32 rows need no dequantized copy: the several-row loops read them in place
template <class Q>
inline const float* float_rows(const Q&, int64_t) { return nullptr; }
inline const float* float_rows(const F32& q, int64_t n0) { return q.w + n0 * q.k; }
inline const float* float_rows(const Packed& q, int64_t n0) { return q.w + n0 * q.k; }  // the tile, n0 % NT == 0
// ... and how the several-row loops index them (a dequantized buf is row-major too)
template <class Q>
inline RowMajor layout(const Q&, int64_t k) { return {k}; }
inline Panel layout(const Packed&, int64_t) { return {}; }

// One span s of T output rows: the weights dequantized in registers are multiplied into acc[R][T] for x rows
// [0, R), or (R == 0) written to buf [T, K] for the sweeps.
template <int R>
constexpr int slots = R > 0 ? R : 1;
template <class Q, int T, int R, int G>
inline void step(const typename Q::Span (&sp)[T], const float* x, __m256 (&acc)[slots<R>][T], float* buf, int64_t K,
                 int64_t s) {
  __m256 xg[R];
  for (int r = 0; r < R; ++r) xg[r] = _mm256_loadu_ps(x + r * K + 64 * s + 8 * G);
  for (int t = 0; t < T; ++t) {
    const __m256 w = Q::template w8<G>(sp[t]);
    for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(xg[r], w, acc[r][t]);
    if (R == 0) _mm256_storeu_ps(buf + t * K + 64 * s + 8 * G, w);
  }
}

template <class Q, int T, int R, size_t... G>
inline void span_steps(const Q& q, int64_t n0, int64_t s, const float* x, __m256 (&acc)[slots<R>][T], float* buf,
                       int64_t K, std::index_sequence<G...>) {
  typename Q::Span sp[T];
  for (int t = 0; t < T; ++t) {
    q.prefetch(n0 + t + PREFETCH_ROWS, s);  // rows further on: DRAM streams of 4 rows at once starve otherwise
    sp[t] = q.span(n0 + t, s);
  }
  (step<Q, T, R, int(G)>(sp, x, acc, buf, K, s), ...);
}

// The pass that reads the weights, dequantizing them in registers: y[r, n0 + t] for x rows [0, R), or (R == 0) the
// tile dequantized into buf. Up to five rows take this one pass, not a pass that stores plus a sweep (see tile()).
// More rows are swept over buf: multiplying two of them in the storing pass as well gained little at 5 rows and
// lost at 9 (its 1-row tail sweep).
template <class Q, int T, int R>
inline void dequant_pass(const Q& q, int64_t n0, const float* x, int64_t K, int64_t N, float* y, float* buf) {
  __m256 acc[slots<R>][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < K / 64; ++s)
    span_steps<Q, T, R>(q, n0, s, x, acc, buf, K, std::make_index_sequence<8>{});
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) y[r * N + n0 + t] = hsum(acc[r][t]);
}

// R x rows against T dequantized weight rows buf [T, K]: T * R accumulators (12 of the 16 ymm registers at 4 x 3).
// pf: the cache lines [pf, pf + 64 * lines) to prefetch meanwhile, spread evenly over the sweep (or nullptr).
template <int T, int R, class L>
inline void rows(const float* buf, L off, const float* x, int64_t K, float* y, int64_t N, const char* pf,
                 int64_t lines) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  const int64_t steps = K / 8;
  int64_t issued = 0;
  for (int64_t g = 0; g < steps; ++g) {
    if (pf != nullptr)
      for (const int64_t due = (g + 1) * lines / steps; issued < due; ++issued) _mm_prefetch(pf + 64 * issued, _MM_HINT_T0);
    __m256 u[R];
    for (int r = 0; r < R; ++r) u[r] = _mm256_loadu_ps(x + r * K + 8 * g);
    for (int t = 0; t < T; ++t) {
      const __m256 w = _mm256_loadu_ps(buf + off(t, g));
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(u[r], w, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) y[r * N + t] = hsum(acc[r][t]);
}

#if defined(__AVX512VL__)
// R x rows on the tile two weight rows at a time, for R = 2..12 (R known at compile time). With AVX-512VL the
// compiler has 32 vector registers (EVEX encodes ymm16-31), enough for 2 x R accumulators, the x vectors and
// the dequantized weights without spilling up to ~12 rows. Same chains per output, so the same bits as the
// AVX2 build's loops.
template <class Q, int T, int R = 2>
inline bool half_tiles(const Q& q, int64_t n0, const float* x, int64_t M, int64_t K, int64_t N, float* y,
                       float* buf) {
  if (M == R) {
    for (int h = 0; h < T; h += 2) dequant_pass<Q, 2, R>(q, n0 + h, x, K, N, y, buf);
    return true;
  }
  if constexpr (R < WIDE_PASS_ROWS) return half_tiles<Q, T, R + 1>(q, n0, x, M, K, N, y, buf);
  return false;
}
#endif

// Outputs [n0, n0 + T) for every x row. float32 rows: sweeps of up to three x rows over the rows in place, one row
// included (the span-by-span pass was slower for packed 1-row products). Other weights
// (quantized, bf16): up to WIDE_PASS_ROWS rows in the pass that dequantizes them in registers; more in sweeps of
// three over the tile that the pass writes to buf [T, K].
template <class Q, int T>
void tile(const Q& q, int64_t n0, const float* x, int64_t M, int64_t K, int64_t N, float* y, float* buf) {
  const float* w = float_rows(q, n0);
  if (M == 1 && w == nullptr) return dequant_pass<Q, T, 1>(q, n0, x, K, N, y, buf);
  // float32 rows are read in place. Meanwhile the tile PREFETCH_ROWS on is prefetched (in DRAM order row-major rows
  // are four short streams, which the hardware prefetchers alone served at ~half the bandwidth), its lines spread
  // over ALL the sweeps: issued in the first sweep alone, DRAM idled while the later ones ran from L1 (5 rows cost
  // 1.21x one row; spread, 1.0x). A packed tile is one stream, which the hardware prefetches alone while a single
  // sweep (1-3 rows) reads it. (Other weights: the dequantizing pass prefetches.)
  const bool prefetch_here = w != nullptr && !(std::is_same_v<Q, Packed> && M <= 3);
  const char* pf = prefetch_here ? reinterpret_cast<const char*>(w + PREFETCH_ROWS * K) : nullptr;
  if (w == nullptr) {
    // Up to five rows in the dequantizing pass, on as many weight rows at a time as keep its accumulators, x vectors
    // and weights in the 16 registers (more would spill): 2-3 x rows on half a tile, 4-5 rows one weight row at a
    // time (which dequantizes nothing twice, where a store-and-sweep pass would). Every output keeps its one chain
    // over K, so the bits do not change.
#if defined(__AVX512VL__)
    // With 32 vector registers half tiles keep up to 12 rows' accumulators in one dequantizing pass, where the
    // loops below store and sweep from 6 rows on
    if constexpr (T % 2 == 0) {
      if (half_tiles<Q, T>(q, n0, x, M, K, N, y, buf)) return;
    }
#endif
    if constexpr (T % 2 == 0) {
      if (M == 2 || M == 3) {
        for (int h = 0; h < T; h += T / 2) {
          if (M == 2) dequant_pass<Q, T / 2, 2>(q, n0 + h, x, K, N, y, buf);
          if (M == 3) dequant_pass<Q, T / 2, 3>(q, n0 + h, x, K, N, y, buf);
        }
        return;
      }
    }
    if (M == 2) return dequant_pass<Q, T, 2>(q, n0, x, K, N, y, buf);
    if (M == 3) return dequant_pass<Q, T, 3>(q, n0, x, K, N, y, buf);
    if (M == 4 || M == 5) {
      for (int t = 0; t < T; ++t) {
        if (M == 4) dequant_pass<Q, 1, 4>(q, n0 + t, x, K, N, y, buf);
        if (M == 5) dequant_pass<Q, 1, 5>(q, n0 + t, x, K, N, y, buf);
      }
      return;
    }
    dequant_pass<Q, T, 0>(q, n0, x, K, N, y, buf);
    w = buf;
  }
  const auto off = layout(q, K);
  int64_t r = 0, j = 0;
  const int64_t sweeps = (M + 2) / 3, lines = T * K * int64_t(sizeof(float)) / 64;
  auto part = [&](int64_t j) { return pf == nullptr ? nullptr : pf + 64 * (j * lines / sweeps); };
  auto count = [&](int64_t j) { return (j + 1) * lines / sweeps - j * lines / sweeps; };
  for (; r + 3 <= M; r += 3, ++j) rows<T, 3>(w, off, x + r * K, K, y + r * N + n0, N, part(j), count(j));
  if (M - r == 2) {  // one sweep for the last two rows, not two: 5 rows (a `ddtree:4` verify) cost less than 6 again
    rows<T, 2>(w, off, x + r * K, K, y + r * N + n0, N, part(j), count(j));
    return;
  }
  if (r < M) rows<T, 1>(w, off, x + r * K, K, y + r * N + n0, N, part(j), count(j));
}

template <class Q>
torch::Tensor run(const Q& q, const torch::Tensor& x, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Tiles of NT output rows taken by torch's intra-op threads as they go (parallel_chunks, at least 4 tiles and a 32nd
  // of a thread's share at a time); a tail of N % NT rows goes one at a time.
  const int64_t tiles = (N + NT - 1) / NT;
  const int64_t chunk = std::max<int64_t>(4, tiles / (32 * std::max(1, at::get_num_threads())));
  parallel_chunks(tiles, chunk, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> buf;  // each thread's own, kept between calls (every entry written before read)
    if (M > 1 && buf.size() < size_t(NT * K)) buf.resize(NT * K);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n0 = i * NT;
      if (n0 + NT <= N) {
        tile<Q, NT>(q, n0, xp, M, K, N, yp, buf.data());
      } else {
        for (int64_t n = n0; n < N; ++n) tile<Q, 1>(q, n, xp, M, K, N, yp, buf.data());
      }
    }
  });
  return y;
}

void check_x(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor [M, K]");
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns; the weight has ", k);
}

void check(const torch::Tensor& x, const torch::Tensor& d, int64_t k) {
  check_x(x, k);
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.size(1) * QK == k,
              "scales must be contiguous float32 [N, K / 32]");
}

}  // namespace

torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor spans) {
  TORCH_CHECK(spans.dim() == 2 && spans.scalar_type() == torch::kInt32 && spans.is_contiguous() &&
                  spans.size(1) % Q4_1::SPAN_WORDS == 0, "bad Q4_1 spans: expected contiguous int32 [N, K / 64 * 10]");
  const int64_t k = spans.size(1) / Q4_1::SPAN_WORDS * 64;
  check_x(x, k);
  return run(Q4_1{reinterpret_cast<const char*>(spans.data_ptr<int32_t>()), k}, x, spans.size(0));
}

torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  const int64_t k = qs.size(1);
  TORCH_CHECK(qs.scalar_type() == torch::kInt8 && qs.is_contiguous() && k % 64 == 0, "bad Q8_0 qs");
  check(x, d, k);
  return run(Q8_0{qs.data_ptr<int8_t>(), d.data_ptr<float>(), k}, x, qs.size(0));
}

torch::Tensor f32_linear(torch::Tensor x, torch::Tensor w) {
  const int64_t k = w.size(1);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && k % 64 == 0, "bad weight");
  check_x(x, k);
  return run(F32{w.data_ptr<float>(), k}, x, w.size(0));
}

torch::Tensor f32p_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.size(2) == NT &&
                  w.size(3) == 64, "bad packed weight: expected float32 [N / 4, K / 64, 4, 64] (qlinear.pack_rows)");
  const int64_t k = w.size(1) * 64;
  check_x(x, k);
  return run(Packed{w.data_ptr<float>(), k}, x, w.size(0) * NT);
}

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w) {
  const int64_t k = w.size(1);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && k % 64 == 0,
              "bad bf16 weight");
  check_x(x, k);
  return run(BF16{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), k}, x, w.size(0));
}

}  // namespace ddtree

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  using namespace ddtree;
  mod.def("f32_linear", &f32_linear, "x [M, K] @ W^T, W float32 [N, K] (K % 64 == 0)");
  mod.def("f32p_linear", &f32p_linear, "x [M, K] @ W^T, W float32 packed [N / 4, K / 64, 4, 64]");
  mod.def("bf16_linear", &bf16_linear, "x [M, K] @ W^T, W bfloat16 [N, K] widened in registers (K % 64 == 0)");
  mod.def("q4_1_linear", &q4_1_linear, "x [M, K] @ W^T, W in Q4_1 blocks (40-byte spans: lanes, fp16 scales)");
  mod.def("q8_0_linear", &q8_0_linear, "x [M, K] @ W^T, W in GGUF Q8_0 blocks");
  bind_decoder(mod);
  bind_tree(mod);
  ddtree_int8::bind(mod, "int8_");
  mod.attr("wide_pass_rows") = WIDE_PASS_ROWS;  // exact_blocks reads the blocks up to this many rows
#if defined(__AVX512VL__)
  mod.attr("isa") = "avx512";
#else
  mod.attr("isa") = "avx2";
#endif
}

// Linear layers with INTEGER activations, the arithmetic of llama.cpp's CPU matmuls: y [M, N] float32 = x [M, K]
// float32 @ W^T, W [N, K] a QWeight (ddtree/qlinear.py) in Q4_1 spans or Q8_0 blocks, K % 64 == 0.
//
// 1. Each x row is quantized per block of 32 (llama.cpp's Q8_0 / Q8_1 activations, its AVX2 rounding):
//      amax = max |x|, id = amax != 0 ? 127 / amax : 0, qx = round_half_even(x * id) (int8),
//      dx = amax / 127, sx = dx * float(sum qx)                         (float32, each one rounding)
//    dx and sx stay float32 (llama.cpp stores them as fp16). x must be finite.
// 2. Per (row, output, block) the integer dot isum = sum qw * qx, exact in int32 (|isum| <= 32 * 128 * 127 < 2^24,
//    so float(isum) is exact too), then in float32, one rounding per operation (no FMA):
//      Q8_0: term = (dw * dx) * isum
//      Q4_1: term = (dw * dx) * isum + mw * sx          (w = dw * q + mw, q in 0..15)
//    and y[r, n] = ((0 + term_0) + term_1) + ... over the blocks in order: ONE chain per output, whatever M, the
//    rows sharing a pass or the thread split, so a row's result never depends on the other rows
//    (ddtree/cpu/int8.py's int8_linear_reference is this arithmetic in plain torch).
//
// The weights are read once per pass for all M rows: a tile of NT = 4 outputs is prepared span by span (64
// weights: two blocks) into a small stack buffer (Tile), then every x row is multiplied against it, by one of two
// loops that run the same float operations per output:
//   - rows one at a time: lanes = 4 outputs x 2 blocks; each (output, block) product vector is summed across
//     lanes by unpacks and adds;
//   - groups of 8 rows: lanes = rows; each weight dword (4 weights) is broadcast against the 8 rows' matching
//     dwords (the x rows transposed, XGroup), so the sums need no horizontal step.
// Integer products: AVX2 maddubs (u8 x s8 -> pairs summed in int16) + madd (-> int32), or with AVX-512 VNNI /
// AVX-VNNI one dpbusd (u8 x s8, 4 products summed into int32). Q4_1 nibbles are unsigned; Q8_0 weights are signed,
// so their absolute value meets qx carrying the weight's sign (|w| <= 128, |qx| <= 127: the int16 pairs of maddubs
// cannot saturate).
//
// Q4_1 span (40 bytes): 8 uint32 lanes, nibble g of lane l = weight 8g + l, then fp16 d0 m0 d1 m1. In lane l,
// byte b holds nibbles 2b (low) and 2b + 1 (high). Blending low and high nibbles at 16-bit granularity gives
//   B0 = [lo.b0, lo.b1, hi.b0, hi.b1] per lane = weights 8 * {0, 2, 1, 3} + l   (block 0)
//   B1 = [lo.b2, lo.b3, hi.b2, hi.b3] per lane = weights 8 * {4, 6, 5, 7} + l   (block 1)
// so the quantized x rows are stored for the Q4_1 passes in that order (pack_q4_1_order); the exposed
// quantize_rows returns the natural order.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace ddtree_int8 {
namespace {

constexpr int64_t QK = 32;             // values per block
constexpr int NT = 4;                  // outputs per tile: lanes [t0b0 t1b0 t2b0 t3b0 | t0b1 t1b1 t2b1 t3b1]
constexpr int64_t PREFETCH_ROWS = 16;  // prefetch distance in weight rows (as kernels/qlinear.cpp)

// dpbusd: acc + the sums of 4 products u8 x s8 per int32 lane. DDTREE_EMULATE_VNNI (tests only) runs the VNNI
// code paths on AVX2 with maddubs + madd in its place, equal for this kernel's operands (nothing saturates, below).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DDTREE_VNNI 1
#define DDTREE_ISA "avx512vnni"
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define DDTREE_VNNI 1
#define DDTREE_ISA "avxvnni"
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#elif defined(DDTREE_EMULATE_VNNI)
#define DDTREE_VNNI 1
#define DDTREE_ISA "vnni-emulated"
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#else
#define DDTREE_VNNI 0
#define DDTREE_ISA "avx2"
#endif

// 8 int32 partial sums of 32 products u8 x s8 (4 per lane). Without VNNI: maddubs, whose int16 pairs stay below
// 2^15 for both kinds (15 * 127 * 2 and 128 * 127 * 2), so nothing saturates; then madd widens them.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if DDTREE_VNNI
  return dpbusd(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// acc + dot_u8s8(u, s)
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
#if DDTREE_VNNI
  return dpbusd(acc, u, s);
#else
  return _mm256_add_epi32(acc, dot_u8s8(u, s));
#endif
}

// One quantized x row's span of 64 values, as the passes read it: the int8 values (natural order for Q8_0, the
// Q4_1 order described at the top for Q4_1), then dx and sx of its two blocks, each repeated over 4 lanes to
// match the tile's lanes.
struct alignas(64) XSpan {
  int8_t q[64];
  float dx[8];  // dx0 x4, dx1 x4
  float sx[8];  // sx0 x4, sx1 x4
};

// Quantize one block of 32 floats: the 32 int8 values as int32 lanes v[0..3] (values 8i..8i+7), dx and sx.
inline void quantize_block(const float* x, __m256i (&v)[4], float& dx, float& sx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 f[4];
  for (int i = 0; i < 4; ++i) f[i] = _mm256_loadu_ps(x + 8 * i);
  __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, f[0]), _mm256_andnot_ps(sign, f[1])),
                           _mm256_max_ps(_mm256_andnot_ps(sign, f[2]), _mm256_andnot_ps(sign, f[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);  // a max: exact, whatever the order
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  const __m256 mul = _mm256_set1_ps(id);
  __m256i s = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(f[i], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v[i] = _mm256_cvtps_epi32(r);  // integral already: exact
    s = _mm256_add_epi32(s, v[i]);
  }
  __m128i hs = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  hs = _mm_add_epi32(hs, _mm_shuffle_epi32(hs, 0x4E));
  hs = _mm_add_epi32(hs, _mm_shuffle_epi32(hs, 0xB1));
  dx = amax / 127.0f;
  sx = dx * static_cast<float>(_mm_cvtsi128_si32(hs));
}

// The 32 values in natural order as int8.
inline __m256i pack_natural(const __m256i (&v)[4]) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The 32 values in the Q4_1 pass's order: byte 4l + k = value 8 * {0, 2, 1, 3}[k] + l (lane-wise, no crossing).
inline __m256i pack_q4_1_order(const __m256i (&v)[4]) {
  const __m256i ff = _mm256_set1_epi32(0xFF);
  return _mm256_or_si256(
      _mm256_or_si256(_mm256_and_si256(v[0], ff), _mm256_slli_epi32(_mm256_and_si256(v[2], ff), 8)),
      _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(v[1], ff), 16), _mm256_slli_epi32(v[3], 24)));
}

// The rows of x [M, K] quantized into spans [M, K / 64] for a pass over kind `q4_1` or Q8_0.
void quantize_spans(const float* x, int64_t M, int64_t K, bool q4_1, XSpan* out) {
  const int64_t S = K / 64;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t s = 0; s < S; ++s) {
      XSpan& o = out[r * S + s];
      for (int b = 0; b < 2; ++b) {
        __m256i v[4];
        float dx, sx;
        quantize_block(x + r * K + 64 * s + QK * b, v, dx, sx);
        const __m256i q = q4_1 ? pack_q4_1_order(v) : pack_natural(v);
        _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + QK * b), q);
        for (int i = 0; i < 4; ++i) {
          o.dx[4 * b + i] = dx;
          o.sx[4 * b + i] = sx;
        }
      }
    }
  }
}

// Horizontal sums by unpacks and adds (hadd is a slower instruction on Zen 3); integer sums are exact in any order.
// 32-bit units of p0..p3 -> [p0 p1 p2 p3 | p0 p1 p2 p3], each the sum of its vector's 4 units of that
// 128-bit half (the add is per 16 bits for int16 pairs, per 32 for int32: ADD).
template <__m256i (*ADD)(__m256i, __m256i)>
inline __m256i sum4(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  const __m256i a = ADD(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));  // p0 p1 p0 p1
  const __m256i b = ADD(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));  // p2 p3 p2 p3
  return ADD(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}
inline __m256i add16(__m256i a, __m256i b) { return _mm256_add_epi16(a, b); }
inline __m256i add32(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }

// Blocks 0 and 1 as [t0..t3 low halves | t0..t3 high halves] each -> [t0b0 .. t3b0 | t0b1 .. t3b1]
inline __m256i merge_halves(__m256i u, __m256i v) {
  return _mm256_add_epi32(_mm256_permute2x128_si256(u, v, 0x20), _mm256_permute2x128_si256(u, v, 0x31));
}

// int32 partial sums p[t][b] (output t, block b) -> [t0b0 .. t3b0 | t0b1 .. t3b1]
inline __m256i reduce_tile(const __m256i (&p)[NT][2]) {
  return merge_halves(sum4<add32>(p[0][0], p[1][0], p[2][0], p[3][0]), sum4<add32>(p[0][1], p[1][1], p[2][1], p[3][1]));
}

// Eight x rows of one span, transposed for the row-group pass: lane i of q[b][j] is dword j (4 values) of block b
// of row i, so one weight dword broadcast over the lanes meets the 8 rows' matching values. Rows past M are zero.
struct alignas(64) XGroup {
  int32_t q[2][8][8];  // [block][dword][row]
  float dx[2][8];      // [block][row]
  float sx[2][8];
};

// Transpose 8 x 8 int32: rows r[i] -> columns in r[j]
inline void transpose8(__m256i (&r)[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);      // column 0 (low) and 4 (high) of rows i..i+3
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);  // columns 1, 5
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);  // columns 2, 6
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);  // columns 3, 7
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x20);
    r[c + 4] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x31);
  }
}

// Rows [8g, 8g + 8) of the quantized spans xs [M, S] as groups xg [G, S]
void group_rows(const XSpan* xs, int64_t M, int64_t S, int64_t G, XGroup* xg) {
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t s = 0; s < S; ++s) {
      XGroup& o = xg[g * S + s];
      for (int b = 0; b < 2; ++b) {
        __m256i r[8];
        for (int i = 0; i < 8; ++i) {
          const int64_t row = 8 * g + i;
          r[i] = row < M ? _mm256_load_si256(reinterpret_cast<const __m256i*>(xs[row * S + s].q + QK * b))
                         : _mm256_setzero_si256();
          o.dx[b][i] = row < M ? xs[row * S + s].dx[4 * b] : 0.0f;
          o.sx[b][i] = row < M ? xs[row * S + s].sx[4 * b] : 0.0f;
        }
        transpose8(r);
        for (int j = 0; j < 8; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(o.q[b][j]), r[j]);
      }
    }
  }
}

// One span of NT weight rows, ready for every x row: the u8 operands, (Q8_0) the signs, and the scales in the
// tile's lanes.
struct alignas(32) Tile {
  int32_t u[NT][2][8];  // Q4_1: blocks 0 and 1 as B0, B1 (see the top); Q8_0: |q|
  int32_t s[NT][2][8];  // Q8_0: q (its sign goes onto qx); unused for Q4_1
  float d[8], m[8];     // [t0b0 .. t3b0 | t0b1 .. t3b1]; m only for Q4_1
  inline __m256i U(int t, int b) const { return _mm256_load_si256(reinterpret_cast<const __m256i*>(u[t][b])); }
  inline __m256i S(int t, int b) const { return _mm256_load_si256(reinterpret_cast<const __m256i*>(s[t][b])); }
};

inline void store(int32_t* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }
inline __m256i load(const int32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }

struct Q4_1 {
  const char* spans;  // [N, K / 64] spans of 40 bytes
  int64_t k, n;
  static constexpr bool HAS_M = true;
  static constexpr int64_t SPAN_BYTES = 40;
  inline const char* at(int64_t row, int64_t s) const { return spans + (row * (k / 64) + s) * SPAN_BYTES; }
  // A span may straddle two cache lines; a row's spans are contiguous, so its last byte's line (and at s == 0
  // the first's) covers them all.
  inline void prefetch(int64_t row, int64_t s) const {
    if (s == 0) _mm_prefetch(at(row, s), _MM_HINT_T0);
    _mm_prefetch(at(row, s) + SPAN_BYTES - 1, _MM_HINT_T0);
  }
  inline void load_tile(const int64_t (&rows)[NT], int64_t s, Tile& w) const {
    const __m256i lowmask = _mm256_set1_epi8(0x0F);
    __m128i sc[NT];
    for (int t = 0; t < NT; ++t) {
      const char* p = at(rows[t], s);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i lo = _mm256_and_si256(v, lowmask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lowmask);
      store(w.u[t][0], _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xAA));
      store(w.u[t][1], _mm256_blend_epi16(_mm256_srli_epi32(lo, 16), hi, 0xAA));
      sc[t] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 32));  // fp16 d0 m0 d1 m1
    }
    // fp16 words [d0 m0 d1 m1] per output -> d = [d0 of t0..t3, d1 of t0..t3], m likewise
    const __m128i a = _mm_unpacklo_epi32(sc[0], sc[1]);  // d0m0 t0, d0m0 t1, d1m1 t0, d1m1 t1
    const __m128i b = _mm_unpacklo_epi32(sc[2], sc[3]);
    const __m128i split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m128i b0 = _mm_shuffle_epi8(_mm_unpacklo_epi64(a, b), split);  // d0 t0..t3, m0 t0..t3
    const __m128i b1 = _mm_shuffle_epi8(_mm_unpackhi_epi64(a, b), split);  // d1 t0..t3, m1 t0..t3
    _mm256_store_ps(w.d, _mm256_cvtph_ps(_mm_unpacklo_epi64(b0, b1)));
    _mm256_store_ps(w.m, _mm256_cvtph_ps(_mm_unpackhi_epi64(b0, b1)));
  }
  // One x row against the tile: isum lanes [t0b0 .. t3b0 | t0b1 .. t3b1]
  static inline __m256i row_isums(const Tile& w, const XSpan& x) {
    const __m256i x0 = load(reinterpret_cast<const int32_t*>(x.q));
    const __m256i x1 = load(reinterpret_cast<const int32_t*>(x.q + QK));
#if DDTREE_VNNI
    __m256i p[NT][2];
    for (int t = 0; t < NT; ++t) {
      p[t][0] = dot_u8s8(w.U(t, 0), x0);
      p[t][1] = dot_u8s8(w.U(t, 1), x1);
    }
    return reduce_tile(p);
#else
    // maddubs pairs (<= 2 * 15 * 127) summed 4 at a time in int16 (<= 15240), widened once per block
    __m256i q[NT][2];
    for (int t = 0; t < NT; ++t) {
      q[t][0] = _mm256_maddubs_epi16(w.U(t, 0), x0);
      q[t][1] = _mm256_maddubs_epi16(w.U(t, 1), x1);
    }
    const __m256i one = _mm256_set1_epi16(1);
    return merge_halves(_mm256_madd_epi16(sum4<add16>(q[0][0], q[1][0], q[2][0], q[3][0]), one),
                        _mm256_madd_epi16(sum4<add16>(q[0][1], q[1][1], q[2][1], q[3][1]), one));
#endif
  }
  // Eight x rows against output t, block b: isum per row (lane). Without VNNI the maddubs pairs (<= 2 * 15 * 127)
  // are summed 8 at a time in int16 (<= 30480 < 2^15), then widened once.
  static inline __m256i group_isums(const Tile& w, int t, int b, const __m256i (&xq)[8]) {
#if DDTREE_VNNI
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) acc = dot_acc(acc, _mm256_set1_epi32(w.u[t][b][j]), xq[j]);
    return acc;
#else
    __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi32(w.u[t][b][0]), xq[0]);
    for (int j = 1; j < 8; ++j)
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_set1_epi32(w.u[t][b][j]), xq[j]));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
  }
};

struct Q8_0 {
  const int8_t* qs;  // [N, K]
  const float* dq;   // [N, K / 32]
  int64_t k, n;
  static constexpr bool HAS_M = false;
  inline void prefetch(int64_t row, int64_t s) const {
    _mm_prefetch(reinterpret_cast<const char*>(qs + row * k + 64 * s), _MM_HINT_T0);
    if (s % 8 == 0) _mm_prefetch(reinterpret_cast<const char*>(dq + row * (k / QK) + 2 * s), _MM_HINT_T0);
  }
  inline void load_tile(const int64_t (&rows)[NT], int64_t s, Tile& w) const {
    __m128 sc[NT];
    for (int t = 0; t < NT; ++t) {
      const int8_t* p = qs + rows[t] * k + 64 * s;
      for (int b = 0; b < 2; ++b) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + QK * b));
        store(w.s[t][b], q);
        store(w.u[t][b], _mm256_abs_epi8(q));  // -128 -> 0x80, read as unsigned 128
      }
      sc[t] = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dq + rows[t] * (k / QK) + 2 * s)));
    }
    const __m128 a = _mm_unpacklo_ps(sc[0], sc[1]);  // d0 t0, d0 t1, d1 t0, d1 t1
    const __m128 b = _mm_unpacklo_ps(sc[2], sc[3]);
    _mm256_store_ps(w.d, _mm256_set_m128(_mm_movehl_ps(b, a), _mm_movelh_ps(a, b)));
    _mm256_store_ps(w.m, _mm256_setzero_ps());
  }
  static inline __m256i row_isums(const Tile& w, const XSpan& x) {
    const __m256i x0 = load(reinterpret_cast<const int32_t*>(x.q));
    const __m256i x1 = load(reinterpret_cast<const int32_t*>(x.q + QK));
    __m256i p[NT][2];
    for (int t = 0; t < NT; ++t) {
      p[t][0] = dot_u8s8(w.U(t, 0), _mm256_sign_epi8(x0, w.S(t, 0)));
      p[t][1] = dot_u8s8(w.U(t, 1), _mm256_sign_epi8(x1, w.S(t, 1)));
    }
    return reduce_tile(p);
  }
  // Eight x rows against output t, block b (maddubs pairs reach 2 * 128 * 127: widened per product pair)
  static inline __m256i group_isums(const Tile& w, int t, int b, const __m256i (&xq)[8]) {
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j)
      acc = dot_acc(acc, _mm256_set1_epi32(w.u[t][b][j]),
                    _mm256_sign_epi8(xq[j], _mm256_set1_epi32(w.s[t][b][j])));
    return acc;
  }
};

// The float step shared by both loops (same operations, so the same bits): term = (dw * dx) * isum [+ mw * sx]
template <bool HAS_M>
inline __m256 term(__m256 dw, __m256 dx, __m256 isum, __m256 mw, __m256 sx) {
  const __m256 t = _mm256_mul_ps(_mm256_mul_ps(dw, dx), isum);
  return HAS_M ? _mm256_add_ps(t, _mm256_mul_ps(mw, sx)) : t;
}

// Block b of eight x rows (one group) against the tile's NT outputs: acc[t] (lanes = rows) += term. The group's
// x vectors stay in registers across the outputs; each weight dword is broadcast from the tile.
template <class Q>
inline void group_block(const Tile& w, int b, const XGroup& x, __m256* acc) {
  __m256i xq[8];
  for (int j = 0; j < 8; ++j) xq[j] = load(x.q[b][j]);
  const __m256 dx = _mm256_load_ps(x.dx[b]), sx = _mm256_load_ps(x.sx[b]);
  for (int t = 0; t < NT; ++t) {
    const __m256 isum = _mm256_cvtepi32_ps(Q::group_isums(w, t, b, xq));  // exact: |isum| < 2^24
    acc[t] = _mm256_add_ps(acc[t], term<Q::HAS_M>(_mm256_set1_ps(w.d[4 * b + t]), dx, isum,
                                                  _mm256_set1_ps(w.m[4 * b + t]), sx));
  }
}

// Outputs [n0, n0 + NT) for all M rows: rows [0, 8G) in G row groups (lanes = rows, accumulators gacc [G, NT]),
// rows [8G, M) one at a time (lanes = outputs x blocks, accumulators acc [M, NT]). Both loops run the same float
// operations per output in the same order, so a row's bits do not depend on the loop that computed it. Outputs
// past N (the last tile) repeat row N - 1 and are not stored; every lane's arithmetic is its own.
template <class Q>
void tile(const Q& q, int64_t n0, const XSpan* xs, const XGroup* xg, int64_t M, int64_t G, float* y, float* acc,
          __m256* gacc) {
  const int64_t S = q.k / 64, N = q.n;
  int64_t rows[NT];
  for (int t = 0; t < NT; ++t) rows[t] = n0 + t < N ? n0 + t : N - 1;
  std::memset(acc, 0, sizeof(float) * M * NT);
  for (int64_t i = 0; i < G * NT; ++i) gacc[i] = _mm256_setzero_ps();
  // The tile of span s + 1 is prepared before span s is multiplied: its scales and dwords are read back as
  // scalars and broadcasts, which a load can take from a store only once the store has left the core's buffers.
  Tile tiles[2];
  q.load_tile(rows, 0, tiles[0]);
  for (int64_t s = 0; s < S; ++s) {
    for (int t = 0; t < NT; ++t) q.prefetch(rows[t] + PREFETCH_ROWS, s);  // never faults: past the end is harmless
    if (s + 1 < S) q.load_tile(rows, s + 1, tiles[(s + 1) & 1]);
    const Tile& w = tiles[s & 1];
    for (int64_t g = 0; g < G; ++g)
      for (int b = 0; b < 2; ++b) group_block<Q>(w, b, xg[g * S + s], gacc + g * NT);  // block 0, then block 1
    for (int64_t r = 8 * G; r < M; ++r) {
      const XSpan& x = xs[r * S + s];
      const __m256 isum = _mm256_cvtepi32_ps(Q::row_isums(w, x));  // exact: |isum| < 2^24
      const __m256 tm = term<Q::HAS_M>(_mm256_load_ps(w.d), _mm256_load_ps(x.dx), isum, _mm256_load_ps(w.m),
                                       _mm256_load_ps(x.sx));
      __m128 a = _mm_loadu_ps(acc + NT * r);
      a = _mm_add_ps(a, _mm256_castps256_ps128(tm));    // block 0
      a = _mm_add_ps(a, _mm256_extractf128_ps(tm, 1));  // then block 1
      _mm_storeu_ps(acc + NT * r, a);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int t = 0; t < NT && n0 + t < N; ++t) {
      alignas(32) float lane[8];
      _mm256_store_ps(lane, gacc[g * NT + t]);
      for (int i = 0; i < 8 && 8 * g + i < M; ++i) y[(8 * g + i) * N + n0 + t] = lane[i];
    }
  }
  for (int64_t r = 8 * G; r < M; ++r)
    for (int t = 0; t < NT && n0 + t < N; ++t) y[r * N + n0 + t] = acc[NT * r + t];
}

// Row groups of 8 for M rows: a remainder of GROUP_MIN_REMAINDER rows or more gets a padded group, fewer go one at
// a time (a row-group pass costs about as much whatever the number of its rows).
constexpr int64_t GROUP_MIN_REMAINDER = 5;

struct alignas(32) Lanes {
  float v[8];
};

template <class Q>
torch::Tensor run(const Q& q, const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), N = q.n, S = K / 64;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<XSpan> xs(M * S);  // XSpan is 64-byte aligned: std::vector honours it (C++17 aligned new)
  quantize_spans(x.data_ptr<float>(), M, K, Q::HAS_M, xs.data());
  const int64_t G = M / 8 + (M % 8 >= GROUP_MIN_REMAINDER ? 1 : 0);
  std::vector<XGroup> xg(G * S);
  group_rows(xs.data(), M, S, G, xg.data());
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + NT - 1) / NT;
  at::parallel_for(0, tiles, 4, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(M * NT);
    std::vector<Lanes> gacc(G * NT);  // __m256 is may_alias: read and written as such
    for (int64_t i = i0; i < i1; ++i)
      tile(q, i * NT, xs.data(), xg.data(), M, G, yp, acc.data(), reinterpret_cast<__m256*>(gacc.data()));
  });
  return y;
}

void check_x(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns; the weight has K = ", k);
  TORCH_CHECK(k % 64 == 0, "K must be a multiple of 64, got ", k);
}

}  // namespace

torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor spans) {
  TORCH_CHECK(spans.dim() == 2 && spans.scalar_type() == torch::kInt32 && spans.is_contiguous() &&
                  spans.device().is_cpu() && spans.size(1) % 10 == 0 && spans.size(1) > 0,
              "bad Q4_1 spans: expected contiguous int32 CPU [N, K / 64 * 10], got ", spans.scalar_type(), " ",
              spans.sizes());
  const int64_t k = spans.size(1) / 10 * 64;
  check_x(x, k);
  return run(Q4_1{reinterpret_cast<const char*>(spans.data_ptr<int32_t>()), k, spans.size(0)}, x);
}

torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == torch::kInt8 && qs.is_contiguous() && qs.device().is_cpu() &&
                  qs.size(1) % 64 == 0 && qs.size(1) > 0,
              "bad Q8_0 qs: expected contiguous int8 CPU [N, K], K % 64 == 0, got ", qs.scalar_type(), " ",
              qs.sizes());
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.device().is_cpu() &&
                  d.size(0) == qs.size(0) && d.size(1) * QK == qs.size(1),
              "bad Q8_0 scales: expected contiguous float32 CPU [N, K / 32], got ", d.scalar_type(), " ", d.sizes());
  check_x(x, qs.size(1));
  return run(Q8_0{qs.data_ptr<int8_t>(), d.data_ptr<float>(), qs.size(1), qs.size(0)}, x);
}

// x [M, K] -> qx int8 [M, K] (natural order), dx and sx float32 [M, K / 32]: the quantization the passes use.
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) % QK == 0, "K must be a multiple of 32, got ", x.size(1));
  const int64_t M = x.size(0), K = x.size(1);
  auto qx = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto dx = torch::empty({M, K / QK}, x.options());
  auto sx = torch::empty({M, K / QK}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = qx.data_ptr<int8_t>();
  float *dp = dx.data_ptr<float>(), *sp = sx.data_ptr<float>();
  for (int64_t i = 0; i < M * K / QK; ++i) {
    __m256i v[4];
    quantize_block(xp + QK * i, v, dp[i], sp[i]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + QK * i), pack_natural(v));
  }
  return {qx, dx, sx};
}

// The entry points as Python functions named `prefix` + name: in the CPU extension (kernels/qlinear.cpp, prefix
// "int8_"), where the decoder stack also calls them (kernels/decoder.cpp); or in a module of this file alone
// (DDTREE_INT8_MODULE: ddtree/cpu/int8.py's builds for other instruction sets, prefix "").
void bind(pybind11::module& mod, const std::string& prefix) {
  mod.def((prefix + "q4_1_linear").c_str(), &q4_1_linear,
          "x [M, K] @ W^T with int8 activations, W in Q4_1 spans [N, K / 64 * 10]");
  mod.def((prefix + "q8_0_linear").c_str(), &q8_0_linear,
          "x [M, K] @ W^T with int8 activations, W in Q8_0 blocks (qs [N, K], d)");
  mod.def((prefix + "quantize_rows").c_str(), &quantize_rows,
          "x [M, K] -> (qx int8 [M, K], dx [M, K / 32], sx [M, K / 32])");
  mod.attr((prefix + "vnni").c_str()) = bool(DDTREE_VNNI);
  mod.attr((prefix + "isa").c_str()) = DDTREE_ISA;
}

}  // namespace ddtree_int8

#ifdef DDTREE_INT8_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) { ddtree_int8::bind(mod, ""); }
#endif

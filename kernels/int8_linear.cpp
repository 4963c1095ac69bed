// Linear layers with INTEGER activations, the arithmetic of llama.cpp's CPU matmuls: y [M, N] float32 = x [M, K]
// float32 @ W^T, W [N, K] in Q4_1 or Q8_0 blocks (a QWeight, ddtree/runtime/cpu/qlinear.py) repacked once by pack_q4_1 /
// pack_q8_0 into this kernel's layout (below), K % 32 == 0 (Q4_1: K % 64 == 0, from its spans).
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
//    (ddtree/runtime/cpu/int8.py's int8_linear_reference is this arithmetic in plain torch).
//
// The layout: outputs in groups of G = 16, and per (group, block of 32) one record, groups and blocks in order
// ([N / 16, K / 32, record bytes]; outputs past N are zero weights, computed and never stored):
//   Q4_1 (320 bytes): nibbles [chunk c = 0..3][output o = 0..15][byte k = 0..3], the low nibble of byte k being
//                     weight 4c + k and the high one weight 16 + 4c + k; then d fp16 [16], m fp16 [16].
//   Q8_0 (544 bytes): q int8 [chunk j = 0..7][output o][byte k] = weight 4j + k; then d fp16 [16] (a GGUF's own
//                     scales: pack_q8_0 takes only fp16 values, which float32 holds exactly). The bytes of the file's
//                     blocks and nothing more: a head streams them every pass.
// So one vector load of a chunk holds dword j of a block for 16 (or 8) outputs side by side: the lanes are OUTPUTS,
// and an x row meets them as a broadcast of its dword j. A block's integer dot for L outputs is then 8 dot-product
// instructions and no horizontal sum, for every row; the weights are unpacked once per block for up to ROWS rows
// whose accumulators stay in registers (more rows go in chunks of ROWS, each reading the group's weights again, from
// the L1 cache).
// Integer products: AVX-512 VNNI / AVX-VNNI dpbusd (u8 x s8, 4 products summed into int32), or AVX2 / AVX-512BW
// maddubs (u8 x s8 -> int16 pairs) + madd (-> int32). Q4_1 nibbles are the unsigned operand. Q8_0 weights are
// signed: with VNNI, qx + 128 (u8) meets q and 128 * sum q is taken off (exact integers; sum q by dpbusd of ones
// and q where the record is unpacked, once for up to ROWS rows); with maddubs (whose int16 pairs would saturate at
// 255 * 128 * 2), |q| meets qx carrying q's sign (|q| <= 128, |qx| <= 127: below 2^15).
// Vectors: 16 lanes (zmm) in builds with AVX-512F/BW, else 8 (ymm; a group is two halves).
// AMX-INT8 (builds with -mamx-tile -mamx-int8 on top of AVX-512 VNNI; used where Linux grants the tile state and a
// pass has at least amx_rows() rows): a record's weight chunks are already a tile product's B operand ([K / 4 = 8
// rows][16 outputs x 4 bytes]; Q4_1 nibbles are split into 8 such rows first), the A operand is 16 x rows x 32 qx,
// and one tile product per block gives the same exact int32 dots for 16 rows x 16 outputs (signed qx with the signed
// Q8_0 q, or the unsigned Q4_1 nibbles: no offset). The float part per row is the VNNI path's, operation for
// operation, so both give the same bits.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <sys/syscall.h>
#include <unistd.h>
#define DDTREE_AMX 1
#else
#define DDTREE_AMX 0
#endif

namespace ddtree_int8 {
namespace {

constexpr int64_t QK = 32;                       // values per block
constexpr int64_t GROUP = 16;                    // outputs per record
constexpr int64_t Q4_1_RECORD = 4 * 64 + 2 * 32;  // nibbles, d, m
constexpr int64_t Q8_0_RECORD = 8 * 64 + 2 * 16;  // q, d (fp16)
constexpr int64_t PREFETCH_BYTES = 2048;  // how far ahead in the weight stream a block is prefetched
// How a pass prefetches its weights: not at all (rows after the first of a record), into the caches (`keep`), or
// non-temporally (`stream`: a weight that cannot stay cached between passes, e.g. a target many times the last-level
// cache, so that its stream does not evict what can, e.g. a drafter's weights read right after it)
enum class Prefetch { none, keep, stream };

// dpbusd: acc + the sums of 4 products u8 x s8 per int32 lane. DDTREE_EMULATE_VNNI (tests only) runs the VNNI code
// paths on AVX2 with an exact emulation in its place (even and odd bytes widened to int16, then madd).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DDTREE_VNNI 1
#if DDTREE_AMX
#define DDTREE_ISA "amx"
#else
#define DDTREE_ISA "avx512vnni"
#endif
#elif defined(__AVXVNNI__)
#define DDTREE_VNNI 1
#define DDTREE_ISA "avxvnni"
#elif defined(DDTREE_EMULATE_VNNI)
#define DDTREE_VNNI 1
#define DDTREE_ISA "vnni-emulated"
#elif defined(__AVX512F__) && defined(__AVX512BW__)
#define DDTREE_VNNI 0
#define DDTREE_ISA "avx512"
#else
#define DDTREE_VNNI 0
#define DDTREE_ISA "avx2"
#endif

// ---- the vector type: L int32 / float32 lanes ----------------------------------------------------------------
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int L = 16;
using VI = __m512i;
using VF = __m512;
inline VI loadi(const void* p) { return _mm512_loadu_si512(p); }
inline VI bcast(const int32_t* p) { return _mm512_set1_epi32(*p); }
inline VI zeroi() { return _mm512_setzero_si512(); }
inline VI set8(char c) { return _mm512_set1_epi8(c); }
inline VI set16(short c) { return _mm512_set1_epi16(c); }
inline VI and_(VI a, VI b) { return _mm512_and_si512(a, b); }
inline VI srl16(VI a, int n) { return _mm512_srli_epi16(a, n); }
inline VI sll16(VI a, int n) { return _mm512_slli_epi16(a, n); }
inline VI sra16(VI a, int n) { return _mm512_srai_epi16(a, n); }
inline VI sll32(VI a, int n) { return _mm512_slli_epi32(a, n); }
inline VI sra32(VI a, int n) { return _mm512_srai_epi32(a, n); }
inline VI add16(VI a, VI b) { return _mm512_add_epi16(a, b); }
inline VI add32(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI sub32(VI a, VI b) { return _mm512_sub_epi32(a, b); }
inline VI maddubs(VI u, VI s) { return _mm512_maddubs_epi16(u, s); }
inline VI madd(VI a, VI b) { return _mm512_madd_epi16(a, b); }
inline VI abs8(VI a) { return _mm512_abs_epi8(a); }
// s with the sign of w (0 where w is 0: AVX-512 has no sign_epi8, and there |w| = 0 zeroes the product anyway)
inline VI sign8(VI s, VI w) { return _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(w), _mm512_setzero_si512(), s); }
inline VF tofloat(VI a) { return _mm512_cvtepi32_ps(a); }
inline VF half(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
inline VF loadf(const void* p) { return _mm512_loadu_ps(p); }
inline VF bcastf(float v) { return _mm512_set1_ps(v); }
inline VF mulf(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF addf(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF zerof() { return _mm512_setzero_ps(); }
inline void storef(float* p, VF v) { _mm512_storeu_ps(p, v); }
#if DDTREE_VNNI
inline VI dpbusd(VI acc, VI u, VI s) { return _mm512_dpbusd_epi32(acc, u, s); }
#endif
#else
constexpr int L = 8;
using VI = __m256i;
using VF = __m256;
inline VI loadi(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline VI bcast(const int32_t* p) { return _mm256_set1_epi32(*p); }
inline VI zeroi() { return _mm256_setzero_si256(); }
inline VI set8(char c) { return _mm256_set1_epi8(c); }
inline VI set16(short c) { return _mm256_set1_epi16(c); }
inline VI and_(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI srl16(VI a, int n) { return _mm256_srli_epi16(a, n); }
inline VI sll16(VI a, int n) { return _mm256_slli_epi16(a, n); }
inline VI sra16(VI a, int n) { return _mm256_srai_epi16(a, n); }
inline VI sll32(VI a, int n) { return _mm256_slli_epi32(a, n); }
inline VI sra32(VI a, int n) { return _mm256_srai_epi32(a, n); }
inline VI add16(VI a, VI b) { return _mm256_add_epi16(a, b); }
inline VI add32(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI sub32(VI a, VI b) { return _mm256_sub_epi32(a, b); }
inline VI maddubs(VI u, VI s) { return _mm256_maddubs_epi16(u, s); }
inline VI madd(VI a, VI b) { return _mm256_madd_epi16(a, b); }
inline VI abs8(VI a) { return _mm256_abs_epi8(a); }
inline VI sign8(VI s, VI w) { return _mm256_sign_epi8(s, w); }
inline VF tofloat(VI a) { return _mm256_cvtepi32_ps(a); }
inline VF half(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
inline VF loadf(const void* p) { return _mm256_loadu_ps(static_cast<const float*>(p)); }
inline VF bcastf(float v) { return _mm256_set1_ps(v); }
inline VF mulf(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF addf(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF zerof() { return _mm256_setzero_ps(); }
inline void storef(float* p, VF v) { _mm256_storeu_ps(p, v); }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline VI dpbusd(VI acc, VI u, VI s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
inline VI dpbusd(VI acc, VI u, VI s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif
#endif

// Rows whose accumulators stay in registers over a pass: 16 with 32 zmm registers (a tree of up to 16 nodes unpacks
// each block once), 8 with 16 ymm ones (some weight vectors spill: reloading them costs less than unpacking the
// weights again for a second chunk of rows).
constexpr int ROWS = L == 16 ? 16 : 8;
// Q4_1 with dpbusd: passes of up to this many rows keep the high nibbles in place (Q4_1::split): 4 shifts fewer a
// record against one more a row and record, which pays for narrow passes only (docs/cpu-speed.md)
constexpr int HIGH16_ROWS = 4;

#if DDTREE_VNNI && !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
inline VI dpbusd(VI acc, VI u, VI s) {  // exact for every operand: u8 and s8 widened to int16, pairs by madd
  const VI ff = set16(0x00FF);
  return add32(acc, add32(madd(and_(u, ff), sra16(sll16(s, 8), 8)), madd(srl16(u, 8), sra16(s, 8))));
}
#endif

// ---- the activations ---------------------------------------------------------------------------------------------
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

// The quantized rows of a pass: qx [M, K] int8 (natural order; `offset` adds 128: the u8 operand of the Q8_0
// VNNI path), dx and sx [M, K / 32].
struct XRows {
  int64_t kb = 0;  // blocks per row
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
  inline const int32_t* dwords(int64_t r, int64_t b) const {
    return reinterpret_cast<const int32_t*>(q.data() + (r * kb + b) * QK);
  }
};

// pad_rows: qx holds that many rows (>= M), those past M zero (an AMX tile reads 16 rows at a time). Into `xr`,
// whose buffers keep their capacity from call to call (run() quantizes into one per thread: no allocation a pass).
void quantize_into(XRows& xr, const float* x, int64_t M, int64_t K, bool offset, int64_t pad_rows = 0) {
  xr.kb = K / QK;
  const int64_t rows = std::max(M, pad_rows);
  xr.q.resize(rows * K);
  std::fill(xr.q.begin() + M * K, xr.q.end(), int8_t(0));
  xr.dx.resize(M * xr.kb);
  xr.sx.resize(M * xr.kb);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));  // q + 128 as u8: the sign bit flipped
  for (int64_t i = 0; i < M * xr.kb; ++i) {
    __m256i v[4];
    quantize_block(x + QK * i, v, xr.dx[i], xr.sx[i]);
    __m256i q = pack_natural(v);
    if (offset) q = _mm256_xor_si256(q, flip);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xr.q.data() + QK * i), q);
  }
}

XRows quantize(const float* x, int64_t M, int64_t K, bool offset) {
  XRows xr;
  quantize_into(xr, x, M, K, offset);
  return xr;
}

// ---- the weights: one record's L outputs (half h of the group when L = 8), ready for the rows ------------------
struct Q4_1 {
  static constexpr int64_t RECORD = Q4_1_RECORD;
  static inline int64_t amx_rows = 12;  // the fewest rows a pass takes the tile products for (builds with AMX)
  static constexpr bool HAS_M = true;
  static constexpr bool OFFSET = false;
  struct W {
    VI u[8];  // dword j of the block for L outputs, u8 nibbles (HIGH16: j >= 4 as 16 x the nibble, see split)
    VF d, m;
  };
  // dword j of the block for L outputs (half h of the group), u8 nibbles. HIGH16 (dpbusd builds; rows_pass sets it
  // for passes of up to HIGH16_ROWS rows): dwords 4..7 keep the high nibbles in place, as 16 x the nibble (v & 0xF0,
  // no shift per record), and isum shifts 16 x their dot back once per row instead. dpbusd sums u8 x s8 into int32
  // without saturating, so that dot is exact; the same integers either way.
  template <bool HIGH16 = false>
  static inline void split(const uint8_t* rec, int h, VI (&u)[8]) {
    const VI low = set8(0x0F), high = set8(static_cast<char>(0xF0));
    for (int c = 0; c < 4; ++c) {
      const VI v = loadi(rec + 64 * c + 4 * L * h);
      u[c] = and_(v, low);                                        // weights 4c .. 4c + 3: dword c
      u[c + 4] = HIGH16 ? and_(v, high) : and_(srl16(v, 4), low);  // weights 16 + 4c ..: dword c + 4
    }
  }
  static inline void scales(const uint8_t* rec, int h, VF& d, VF& m) {
    d = half(rec + 256 + 2 * L * h);
    m = half(rec + 288 + 2 * L * h);
  }
  template <bool HIGH16>
  static inline void prepare(const uint8_t* rec, int h, W& w) {
    split<HIGH16>(rec, h, w.u);
    scales(rec, h, w.d, w.m);
  }
#if DDTREE_AMX
  // The tile product's B operand, [8 rows: dword j][16 outputs][4 bytes]: the split nibbles stored
  static constexpr bool UNPACK = true;
  static inline void tile_b(const uint8_t* rec, uint8_t* out) {
    VI u[8];
    split(rec, 0, u);
    for (int j = 0; j < 8; ++j) _mm512_store_si512(out + 64 * j, u[j]);
  }
#endif
  template <bool HIGH16>
  static inline VI isum(const W& w, const int32_t* x) {
#if DDTREE_VNNI
    // two chains: the low nibbles' dot and the high ones' (with HIGH16, 16 x that dot: |it| <= 16 * 16 * 15 * 128
    // < 2^31 and a multiple of 16, so the arithmetic shift gives the dot exactly)
    VI a = dpbusd(zeroi(), w.u[0], bcast(x));
    VI b = dpbusd(zeroi(), w.u[4], bcast(x + 4));
    for (int j = 1; j < 4; ++j) {
      a = dpbusd(a, w.u[j], bcast(x + j));
      b = dpbusd(b, w.u[j + 4], bcast(x + j + 4));
    }
    return add32(a, HIGH16 ? sra32(b, 4) : b);
#else
    // maddubs pairs <= 2 * 15 * 127, summed 8 at a time in int16 (<= 30480 < 2^15), widened once
    VI s = maddubs(w.u[0], bcast(x));
    for (int j = 1; j < 8; ++j) s = add16(s, maddubs(w.u[j], bcast(x + j)));
    return madd(s, set16(1));
#endif
  }
};

struct Q8_0 {
  static constexpr int64_t RECORD = Q8_0_RECORD;
  static inline int64_t amx_rows = 5;  // as Q4_1's
  static constexpr bool HAS_M = false;
  static constexpr bool OFFSET = DDTREE_VNNI;  // x is read as qx + 128
  struct W {
    VI q[8];  // VNNI: q (s8); else |q| (u8)
#if DDTREE_VNNI
    VI offset;  // 128 * sum q
#else
    VI s[8];  // q, whose sign goes onto qx
#endif
    VF d;
  };
  template <bool>  // Q4_1's HIGH16: nothing to keep in place here
  static inline void prepare(const uint8_t* rec, int h, W& w) {
#if DDTREE_VNNI
    VI sum = zeroi();
#endif
    for (int j = 0; j < 8; ++j) {
      const VI v = loadi(rec + 64 * j + 4 * L * h);
#if DDTREE_VNNI
      w.q[j] = v;
      sum = dpbusd(sum, set8(1), v);  // sum q per output (|sum| <= 32 * 128)
#else
      w.s[j] = v;
      w.q[j] = abs8(v);  // -128 -> 0x80, read as unsigned 128
#endif
    }
    VF no_m;
    scales(rec, h, w.d, no_m);
#if DDTREE_VNNI
    w.offset = sll32(sum, 7);
#endif
  }
  static inline void scales(const uint8_t* rec, int h, VF& d, VF&) { d = half(rec + 512 + 2 * L * h); }  // no m
#if DDTREE_AMX
  static constexpr bool UNPACK = false;  // a record's chunks are the B operand as they are
#endif
  template <bool>
  static inline VI isum(const W& w, const int32_t* x) {
#if DDTREE_VNNI
    VI a = dpbusd(zeroi(), bcast(x), w.q[0]);  // (qx + 128) . q, two chains
    VI b = dpbusd(zeroi(), bcast(x + 1), w.q[1]);
    for (int j = 2; j < 8; j += 2) {
      a = dpbusd(a, bcast(x + j), w.q[j]);
      b = dpbusd(b, bcast(x + j + 1), w.q[j + 1]);
    }
    return sub32(add32(a, b), w.offset);
#else
    // maddubs pairs reach 2 * 128 * 127: widened per instruction
    VI acc = madd(maddubs(w.q[0], sign8(bcast(x), w.s[0])), set16(1));
    for (int j = 1; j < 8; ++j) acc = add32(acc, madd(maddubs(w.q[j], sign8(bcast(x + j), w.s[j])), set16(1)));
    return acc;
#endif
  }
};

// The record PREFETCH_BYTES ahead of rec, as `prefetch` says (never faults: past the end is harmless). The
// instructions are asm statements: GCC 12 merges two _mm_prefetch calls of different hints into one whose hint is
// no longer a constant, and then emits no prefetch at all.
template <class Q>
inline void prefetch_record(const uint8_t* rec, Prefetch prefetch) {
  if (prefetch == Prefetch::none) return;
  for (int64_t line = 0; line < Q::RECORD; line += 64) {
    const char* ahead = reinterpret_cast<const char*>(rec) + PREFETCH_BYTES + line;
    if (prefetch == Prefetch::stream)
      __asm__ volatile("prefetchnta %0" : : "m"(*ahead));
    else
      __asm__ volatile("prefetcht0 %0" : : "m"(*ahead));
  }
}

// y[r0 + i, n0 .. n0 + L) = acc[i] for the R rows, the lanes past N dropped
template <int R>
inline void store_rows(const VF (&acc)[R], float* y, int64_t r0, int64_t N, int64_t n0) {
  const int64_t valid = std::min<int64_t>(L, N - n0);
  for (int i = 0; i < R; ++i) {
    float* out = y + (r0 + i) * N + n0;
    if (valid == L) {
      storef(out, acc[i]);
    } else {
      alignas(64) float lane[L];
      storef(lane, acc[i]);
      std::memcpy(out, lane, sizeof(float) * valid);
    }
  }
}

// R rows [r0, r0 + R) against outputs [n0, n0 + L) (half h of group g): the accumulators stay in registers over
// the blocks; per block term = (dw * dx) * isum [+ mw * sx], then acc = acc + term.
template <class Q, int R>
void rows_pass(const uint8_t* group, int64_t KB, int h, const XRows& x, int64_t r0, float* y, int64_t N,
               int64_t n0, Prefetch prefetch) {
  constexpr bool HIGH16 = DDTREE_VNNI && R <= HIGH16_ROWS;
  VF acc[R];
  for (int i = 0; i < R; ++i) acc[i] = zerof();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* rec = group + b * Q::RECORD;
    prefetch_record<Q>(rec, prefetch);
    typename Q::W w;
    Q::template prepare<HIGH16>(rec, h, w);
    // unrolled whatever R: left rolled (GCC does so from 9 rows), the rows' accumulators live in memory and two
    // blocks' weights are interleaved, more than the registers hold
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const int64_t r = r0 + i;
      const VF isum = tofloat(Q::template isum<HIGH16>(w, x.dwords(r, b)));  // exact: |isum| < 2^24
      VF term = mulf(mulf(w.d, bcastf(x.dx[r * KB + b])), isum);
      if constexpr (Q::HAS_M) term = addf(term, mulf(w.m, bcastf(x.sx[r * KB + b])));
      acc[i] = addf(acc[i], term);
    }
  }
  store_rows<R>(acc, y, r0, N, n0);
}

// rows_pass<Q, R> for R = 1 .. ROWS
template <class Q, int... R>
constexpr auto rows_passes(std::integer_sequence<int, R...>) {
  using Pass = void (*)(const uint8_t*, int64_t, int, const XRows&, int64_t, float*, int64_t, int64_t, Prefetch);
  return std::array<Pass, sizeof...(R)>{&rows_pass<Q, R + 1>...};
}

// Group g (16 outputs; two halves of L = 8) for all M rows, ROWS at a time.
template <class Q>
void group_pass(const uint8_t* group, int64_t KB, int64_t g, const XRows& x, int64_t M, float* y, int64_t N,
                Prefetch prefetch) {
  static constexpr auto passes = rows_passes<Q>(std::make_integer_sequence<int, ROWS>{});
  for (int h = 0; h < GROUP / L; ++h) {
    const int64_t n0 = GROUP * g + L * h;
    if (n0 >= N) break;
    for (int64_t r0 = 0; r0 < M; r0 += ROWS)  // the weights are prefetched once, by the first rows
      passes[std::min<int64_t>(ROWS, M - r0) - 1](group, KB, h, x, r0, y, N, n0,
                                                    r0 == 0 && h == 0 ? prefetch : Prefetch::none);
  }
}

#if DDTREE_AMX
// ---- AMX-INT8: one tile product per block for up to 16 rows x 16 outputs -----------------------------------
constexpr int64_t TILE_ROWS = 16;
constexpr int64_t TILE_B = QK / 4 * 64;  // bytes of a B operand: 8 rows of 16 outputs x 4 bytes

// Tiles C (r rows x 16 int32), A (r x rows x 32 qx) and B (8 x 64 bytes), twice: while one block's product runs,
// the float work of the block before it reads the other C. r: the rows of a pass's chunk (<= 16; fewer rows load,
// multiply and store less).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int64_t r) {
    for (int t : {0, 3}) rows[t] = uint8_t(r), colsb[t] = 64;      // C
    for (int t : {1, 4}) rows[t] = uint8_t(r), colsb[t] = QK;      // A
    for (int t : {2, 5}) rows[t] = QK / 4, colsb[t] = 64;          // B
  }
};

// Linux keeps the tile state off until a process asks for it (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA;
// kernel 5.16+); a tile instruction before that faults. Asked once, on the first pass that would use tiles.
bool tiles_granted() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

// A block's product on tiles C, A, B (the intrinsics take tile numbers as literals: one function per tile set),
// and the store of C into c [rows][16 outputs] int32: apart, so that the float work of the block before it can be
// placed between them (its loads of the other c then come before this tile store, which they would wait for)
#define DDTREE_TILE_BLOCK(PRODUCT, STORE, C, A, B)                                                  \
  template <bool SIGNED_B>                                                                         \
  inline void PRODUCT(const int8_t* a, int64_t stride, const uint8_t* b) {                        \
    _tile_loadd(A, a, stride);                                                                     \
    _tile_loadd(B, b, 64);                                                                         \
    _tile_zero(C);                                                                                 \
    if constexpr (SIGNED_B)                                                                        \
      _tile_dpbssd(C, A, B); /* signed qx x signed Q8_0 q */                                       \
    else                                                                                           \
      _tile_dpbsud(C, A, B); /* signed qx x unsigned Q4_1 nibbles */                               \
  }                                                                                                \
  inline void STORE(int32_t* c) {                                                                  \
    _tile_stored(C, c, 64);                                                                        \
  }
DDTREE_TILE_BLOCK(tile_product0, tile_store0, 0, 1, 2)
DDTREE_TILE_BLOCK(tile_product1, tile_store1, 3, 4, 5)
#undef DDTREE_TILE_BLOCK

// acc[i] + block b's term for row r0 + i, the operations of rows_pass
template <class Q, int R>
inline void tile_terms(const uint8_t* rec, const int32_t* c, const XRows& x, int64_t r0, int64_t b, VF (&acc)[R]) {
  VF d, m;
  Q::scales(rec, 0, d, m);
  for (int i = 0; i < R; ++i) {
    const int64_t r = r0 + i;
    const VF isum = tofloat(loadi(c + 16 * i));
    VF term = mulf(mulf(d, bcastf(x.dx[r * x.kb + b])), isum);
    if constexpr (Q::HAS_M) term = addf(term, mulf(m, bcastf(x.sx[r * x.kb + b])));
    acc[i] = addf(acc[i], term);
  }
}

// R rows [r0, r0 + R) against a group's 16 outputs; B operand of block b at bs + b * b_step. Pipelined: block b + 1's
// product is issued before block b's float work.
template <class Q, int R>
void tile_rows_pass(const uint8_t* group, int64_t KB, const uint8_t* bs, int64_t b_step, const XRows& x, int64_t r0,
                    float* y, int64_t N, int64_t n0, Prefetch prefetch) {
  constexpr bool SIGNED_B = !Q::HAS_M;
  alignas(64) int32_t c[2][TILE_ROWS * 16];
  const int64_t stride = KB * QK;  // bytes from one qx row to the next
  const int8_t* a = x.q.data() + r0 * stride;
  VF acc[R];
  for (int i = 0; i < R; ++i) acc[i] = zerof();
  auto fetch = [&](int64_t b) { prefetch_record<Q>(group + b * Q::RECORD, prefetch); };
  // block b's product is in c[b % 2] when its float work starts; block b + 1's runs meanwhile on the other tiles
  fetch(0);
  tile_product0<SIGNED_B>(a, stride, bs);
  tile_store0(c[0]);
  for (int64_t b = 0; b < KB; ++b) {
    const bool next = b + 1 < KB, odd = b & 1;
    if (next) {
      fetch(b + 1);
      if (odd)
        tile_product0<SIGNED_B>(a + (b + 1) * QK, stride, bs + (b + 1) * b_step);
      else
        tile_product1<SIGNED_B>(a + (b + 1) * QK, stride, bs + (b + 1) * b_step);
    }
    tile_terms<Q, R>(group + b * Q::RECORD, c[odd], x, r0, b, acc);
    if (next) {
      if (odd)
        tile_store0(c[0]);
      else
        tile_store1(c[1]);
    }
  }
  store_rows<R>(acc, y, r0, N, n0);
}

template <class Q, int... R>
constexpr auto tile_rows_passes(std::integer_sequence<int, R...>) {
  using Pass = void (*)(const uint8_t*, int64_t, const uint8_t*, int64_t, const XRows&, int64_t, float*, int64_t,
                        int64_t, Prefetch);
  return std::array<Pass, sizeof...(R)>{&tile_rows_pass<Q, R + 1>...};
}

// Group g for all M rows, `chunk` (<= 16, the tiles' rows) at a time (x.q padded to whole chunks). Q4_1's B operands are unpacked for the whole
// group first, into `unpacked` (KB x 512 bytes): unpacked right before its tile load, a B operand would wait for
// its stores to reach the cache.
template <class Q>
void tile_group_pass(const uint8_t* group, int64_t KB, int64_t g, const XRows& x, int64_t M, int64_t chunk,
                     float* y, int64_t N, Prefetch prefetch, uint8_t* unpacked) {
  static constexpr auto passes = tile_rows_passes<Q>(std::make_integer_sequence<int, TILE_ROWS>{});
  const uint8_t* bs = group;
  int64_t b_step = Q::RECORD;
  if constexpr (Q::UNPACK) {
    for (int64_t b = 0; b < KB; ++b) {
      prefetch_record<Q>(group + b * Q::RECORD, prefetch);
      Q::tile_b(group + b * Q::RECORD, unpacked + b * TILE_B);
    }
    bs = unpacked, b_step = TILE_B;
  }
  for (int64_t r0 = 0; r0 < M; r0 += chunk)
    passes[std::min<int64_t>(chunk, M - r0) - 1](group, KB, bs, b_step, x, r0, y, N, GROUP * g,
                                                   r0 == 0 && !Q::UNPACK ? prefetch : Prefetch::none);
}
#endif

// Groups a thread takes at a time (ddtree::parallel_chunks) out of G of `bytes` each: at least 16 KB of weights (a
// take is one compare-and-swap), and at least a 32nd of a thread's share (a head's 3,072 groups in 64 takes)
inline int64_t group_chunk(int64_t G, int64_t bytes) {
  return std::max<int64_t>((16384 + bytes - 1) / bytes, G / (32 * std::max(1, at::get_num_threads())));
}

// Passes of at least Q::amx_rows rows take the tile products where the build has them and Linux grants the tiles.
// Below, the dpbusd passes are as fast or faster: a tile product costs about as much for 1 row as for 16 (its
// loads, the store of C, and float work that does not overlap it), and Q4_1 adds splitting its nibbles
// (docs/cpu-speed.md has the crossover measured).

// y [M, N] = x [M, K] @ W^T for the packed weight w of G groups (the entry points' checks done by the caller).
template <class Q>
void run_into(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t G, int64_t N, bool stream, float* yp) {
  if (M == 0 || N == 0) return;
  const int64_t KB = K / QK;
  const Prefetch prefetch = stream ? Prefetch::stream : Prefetch::keep;
  // the calling thread's quantized rows, reused (a pass makes ~120 products); named through a reference, which
  // the workers' lambdas capture: `xr` itself would name each worker's own instance there
  thread_local XRows rows;
  XRows& xr = rows;
#if DDTREE_AMX
  if (M >= Q::amx_rows && tiles_granted()) {
    // the rows in equal chunks of at most 16 (17 rows: 9 + 8, not 16 + 1: a tile pass costs about the same
    // whatever its rows, and the last chunk reads rows past M, zeros)
    const int64_t chunks = (M + TILE_ROWS - 1) / TILE_ROWS, chunk = (M + chunks - 1) / chunks;
    quantize_into(xr, x, M, K, false, chunks * chunk);
    at::parallel_for(0, G, 2, [&](int64_t g0, int64_t g1) {
      const TileConfig config(chunk);
      _tile_loadconfig(&config);  // per thread: the tile configuration is a thread's state
      std::vector<uint8_t> unpacked(Q::UNPACK ? KB * TILE_B + 64 : 0);
      uint8_t* buffer = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(unpacked.data()) + 63) & ~uintptr_t(63));
      for (int64_t g = g0; g < g1; ++g)
        tile_group_pass<Q>(w + g * KB * Q::RECORD, KB, g, xr, M, chunk, yp, N, prefetch, buffer);
      _tile_release();
    });
    return;
  }
#endif
  quantize_into(xr, x, M, K, Q::OFFSET);
  ddtree::parallel_chunks(G, group_chunk(G, KB * Q::RECORD), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) group_pass<Q>(w + g * KB * Q::RECORD, KB, g, xr, M, yp, N, prefetch);
  });
}

template <class Q>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, bool stream) {
  const int64_t M = x.size(0), K = x.size(1), G = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  run_into<Q>(x.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), G, N, stream, y.data_ptr<float>());
  return y;
}

void check_weight(const torch::Tensor& packed, int64_t n, int64_t record, const char* kind) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.device().is_cpu() && packed.size(2) == record,
              "bad packed ", kind, " weight: expected contiguous uint8 CPU [N / 16, K / 32, ", record, "] from pack_",
              kind == std::string("Q4_1") ? "q4_1" : "q8_0", ", got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(n >= 0 && (n + GROUP - 1) / GROUP == packed.size(0), "n = ", n, " does not fit a packed weight of ",
              packed.size(0), " groups of 16 outputs");
}

void check_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t record, const char* kind) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor [M, K], got ", x.scalar_type(), " ", x.sizes());
  check_weight(packed, n, record, kind);
  TORCH_CHECK(x.size(1) == packed.size(1) * QK, "x has ", x.size(1), " columns; the weight has K = ",
              packed.size(1) * QK);
}

}  // namespace

torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor packed, int64_t n, bool stream) {
  check_packed(x, packed, n, Q4_1_RECORD, "Q4_1");
  return run<Q4_1>(x, packed, n, stream);
}

torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor packed, int64_t n, bool stream) {
  check_packed(x, packed, n, Q8_0_RECORD, "Q8_0");
  return run<Q8_0>(x, packed, n, stream);
}

PackedWeight packed_weight(const torch::Tensor& packed, int64_t n, bool q4_1) {
  check_weight(packed, n, q4_1 ? Q4_1_RECORD : Q8_0_RECORD, q4_1 ? "Q4_1" : "Q8_0");
  return {packed.data_ptr<uint8_t>(), packed.size(0), packed.size(1) * QK, n, q4_1};
}

void linear_into(const PackedWeight& w, const float* x, int64_t M, float* y, bool stream) {
  (w.q4_1 ? run_into<Q4_1> : run_into<Q8_0>)(x, M, w.k, w.records, w.groups, w.n, stream, y);
}

// Q4_1 spans [N, K / 64 * 10] (ddtree/runtime/cpu/qlinear.py: per 64 weights 8 uint32 lanes, nibble g of lane l = weight
// 8g + l, then fp16 d0 m0 d1 m1) -> records [N / 16, K / 32, 320]
torch::Tensor pack_q4_1(torch::Tensor spans) {
  TORCH_CHECK(spans.dim() == 2 && spans.scalar_type() == torch::kInt32 && spans.is_contiguous() &&
                  spans.device().is_cpu() && spans.size(1) % 10 == 0 && spans.size(1) > 0,
              "bad Q4_1 spans: expected contiguous int32 CPU [N, K / 64 * 10], got ", spans.scalar_type(), " ",
              spans.sizes());
  const int64_t N = spans.size(0), S = spans.size(1) / 10, KB = 2 * S, G = (N + GROUP - 1) / GROUP;
  auto out = torch::zeros({G, KB, Q4_1_RECORD}, spans.options().dtype(torch::kUInt8));
  const uint32_t* sp = reinterpret_cast<const uint32_t*>(spans.data_ptr<int32_t>());
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t o = n % GROUP;
    for (int64_t b = 0; b < KB; ++b) {
      const uint32_t* span = sp + (n * S + b / 2) * 10;
      auto nibble = [&](int64_t i) {  // weight i of block b
        const int64_t w = QK * (b % 2) + i;
        return (span[w % 8] >> (4 * (w / 8))) & 0x0F;
      };
      uint8_t* rec = op + ((n / GROUP) * KB + b) * Q4_1_RECORD;
      for (int c = 0; c < 4; ++c)
        for (int k = 0; k < 4; ++k)
          rec[64 * c + 4 * o + k] = uint8_t(nibble(4 * c + k) | (nibble(16 + 4 * c + k) << 4));
      uint16_t dm[4];  // fp16 d0 m0 d1 m1
      std::memcpy(dm, span + 8, sizeof(dm));
      std::memcpy(rec + 256 + 2 * o, &dm[2 * (b % 2)], 2);
      std::memcpy(rec + 288 + 2 * o, &dm[2 * (b % 2) + 1], 2);
    }
  }
  return out;
}

// Q8_0 qs int8 [N, K] and d float32 [N, K / 32], fp16 values -> records [N / 16, K / 32, 544]
torch::Tensor pack_q8_0(torch::Tensor qs, torch::Tensor d) {
  TORCH_CHECK(qs.dim() == 2 && qs.scalar_type() == torch::kInt8 && qs.is_contiguous() && qs.device().is_cpu() &&
                  qs.size(1) % QK == 0 && qs.size(1) > 0,
              "bad Q8_0 qs: expected contiguous int8 CPU [N, K], K % 32 == 0, got ", qs.scalar_type(), " ",
              qs.sizes());
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.device().is_cpu() &&
                  d.size(0) == qs.size(0) && d.size(1) * QK == qs.size(1),
              "bad Q8_0 scales: expected contiguous float32 CPU [N, K / 32], got ", d.scalar_type(), " ", d.sizes());
  const int64_t N = qs.size(0), K = qs.size(1), KB = K / QK, G = (N + GROUP - 1) / GROUP;
  auto out = torch::zeros({G, KB, Q8_0_RECORD}, qs.options().dtype(torch::kUInt8));
  const int8_t* q = qs.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t o = n % GROUP;
    for (int64_t b = 0; b < KB; ++b) {
      const int8_t* src = q + n * K + QK * b;
      uint8_t* rec = op + ((n / GROUP) * KB + b) * Q8_0_RECORD;
      for (int j = 0; j < 8; ++j)
        for (int k = 0; k < 4; ++k) rec[64 * j + 4 * o + k] = static_cast<uint8_t>(src[4 * j + k]);
      const float scale = dp[n * KB + b];
      const c10::Half d16(scale);
      TORCH_CHECK(static_cast<float>(d16) == scale, "Q8_0 scales must be fp16 values (a GGUF's blocks store them so), "
                  "got d = ", scale, " for output ", n, ", block ", b);
      std::memcpy(rec + 512 + 2 * o, &d16.x, 2);
    }
  }
  return out;
}

// x [M, K] -> qx int8 [M, K] (natural order), dx and sx float32 [M, K / 32]: the quantization the passes use.
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) % QK == 0, "K must be a multiple of 32, got ", x.size(1));
  const int64_t M = x.size(0), K = x.size(1);
  const XRows xr = quantize(x.data_ptr<float>(), M, K, false);
  auto qx = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto dx = torch::empty({M, K / QK}, x.options());
  auto sx = torch::empty({M, K / QK}, x.options());
  std::memcpy(qx.data_ptr<int8_t>(), xr.q.data(), M * K);
  std::memcpy(dx.data_ptr<float>(), xr.dx.data(), sizeof(float) * M * xr.kb);
  std::memcpy(sx.data_ptr<float>(), xr.sx.data(), sizeof(float) * M * xr.kb);
  return {qx, dx, sx};
}

// The entry points as Python functions named `prefix` + name: in the CPU extension (kernels/qlinear.cpp, prefix
// "int8_"), where the decoder stack also calls them (kernels/decoder.cpp); or in a module of this file alone
// (DDTREE_INT8_MODULE: ddtree/runtime/cpu/int8.py's builds for other instruction sets, prefix "").
void bind(pybind11::module& mod, const std::string& prefix) {
  mod.def((prefix + "q4_1_linear").c_str(), &q4_1_linear,
          "x [M, K] @ W^T with int8 activations, W a packed Q4_1 weight (pack_q4_1) of n outputs; stream: prefetch "
          "W non-temporally (a weight that cannot stay cached)",
          pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("stream") = false);
  mod.def((prefix + "q8_0_linear").c_str(), &q8_0_linear,
          "x [M, K] @ W^T with int8 activations, W a packed Q8_0 weight (pack_q8_0) of n outputs; stream: as "
          "q4_1_linear's",
          pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("stream") = false);
  mod.def((prefix + "pack_q4_1").c_str(), &pack_q4_1, "Q4_1 spans [N, K / 64 * 10] -> records [N / 16, K / 32, 320]");
  mod.def((prefix + "pack_q8_0").c_str(), &pack_q8_0,
          "Q8_0 qs [N, K], d [N, K / 32] (fp16 values) -> records [N / 16, K / 32, 544]");
  mod.def((prefix + "quantize_rows").c_str(), &quantize_rows,
          "x [M, K] -> (qx int8 [M, K], dx [M, K / 32], sx [M, K / 32])");
  mod.def((prefix + "amx_rows").c_str(), [](const std::string& kind, int64_t rows) {
            TORCH_CHECK(kind == "Q4_1" || kind == "Q8_0", "kind must be 'Q4_1' or 'Q8_0', got '", kind, "'");
            int64_t& threshold = kind == "Q4_1" ? Q4_1::amx_rows : Q8_0::amx_rows;
            const int64_t before = threshold;
            if (rows >= 0) threshold = std::max<int64_t>(rows, 1);
            return before;
          }, "the fewest rows a pass of `kind` ('Q4_1' or 'Q8_0') takes the AMX tile products for (builds with AMX; "
          "the same bits either way); rows >= 1 sets it, -1 only reads it; -> the value before",
          pybind11::arg("kind"), pybind11::arg("rows") = -1);
  mod.def((prefix + "amx_active").c_str(), [] {
#if DDTREE_AMX
            return tiles_granted();
#else
            return false;
#endif
          }, "whether passes can take the tile products: the build has AMX and Linux granted the tile state");
  mod.attr((prefix + "amx").c_str()) = bool(DDTREE_AMX);
  mod.attr((prefix + "vnni").c_str()) = bool(DDTREE_VNNI);
  mod.attr((prefix + "isa").c_str()) = DDTREE_ISA;
  mod.attr((prefix + "lanes").c_str()) = L;
}

}  // namespace ddtree_int8

#ifdef DDTREE_INT8_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) { ddtree_int8::bind(mod, ""); }
#endif

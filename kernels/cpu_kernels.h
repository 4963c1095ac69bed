// The CPU extension's entry points shared between its sources (qlinear.cpp: the matmuls; decoder.cpp: whole
// decoder layers; int8_linear.cpp: the matmuls with integer activations; tree.cpp: a DDTree step's host work). The
// products take and return contiguous float32 CPU tensors; see each source for layouts and the order of the sums.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

namespace ddtree {

// The sum of 8 float lanes, always in this order: ((0+4) + (2+6)) + ((1+5) + (3+7)).
inline float hsum(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// fn(a, b) over [0, n) on the threads, as at::parallel_for(0, n, grain, fn) splits it, but in chunks of `chunk` items
// taken as the threads go: each thread takes its own share's chunks from the front, then the chunks left at the back
// of the others' shares. A thread that starts late (woken from its wait) or runs slower than the others (a busy host
// core) leaves its last chunks to them instead of holding them at the closing barrier, and each thread still reads
// its share in order (the weight streams' prefetches run ahead of it). fn must give the same result for an item
// whichever thread runs it and with whatever items beside it in a call.
template <class F>
void parallel_chunks(int64_t n, int64_t chunk, const F& fn) {
  constexpr int64_t MAX_THREADS = 64;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t threads = std::min<int64_t>({int64_t(at::get_num_threads()), (n + chunk - 1) / chunk, MAX_THREADS});
  if (threads <= 1 || at::in_parallel_region() || n >= (int64_t(1) << 31)) {
    if (n > 0) fn(int64_t(0), n);
    return;
  }
  // share t: [front, end) packed as front << 32 | end, both ends moved by compare-and-swap; a cache line each
  struct alignas(64) Share {
    std::atomic<uint64_t> span;
  };
  Share shares[MAX_THREADS];
  for (int64_t t = 0; t < threads; ++t)
    shares[t].span.store(uint64_t(n * t / threads) << 32 | uint64_t(n * (t + 1) / threads), std::memory_order_relaxed);
  // the next chunk of share s, from its front (its own thread) or its back (another one); false once it is empty
  auto take = [&](Share& s, bool front, int64_t& a, int64_t& b) {
    uint64_t span = s.span.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = int64_t(span >> 32), hi = int64_t(span & 0xFFFFFFFFu);
      if (lo >= hi) return false;
      a = front ? lo : std::max(lo, hi - chunk);
      b = front ? std::min(hi, lo + chunk) : hi;
      const uint64_t next = front ? uint64_t(b) << 32 | uint64_t(hi) : uint64_t(lo) << 32 | uint64_t(a);
      if (s.span.compare_exchange_weak(span, next, std::memory_order_acq_rel, std::memory_order_relaxed)) return true;
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t a, b;
      while (take(shares[t], true, a, b)) fn(a, b);
      for (int64_t o = 1; o < threads; ++o)
        while (take(shares[(t + o) % threads], false, a, b)) fn(a, b);
    }
  });
}

torch::Tensor f32_linear(torch::Tensor x, torch::Tensor w);     // x [M, K] @ w [N, K]^T
torch::Tensor f32p_linear(torch::Tensor x, torch::Tensor w);    // the same, w packed [N/4, K/64, 4, 64]
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w);    // the same with w bfloat16
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor spans);  // Q4_1 spans [N, K / 64 * 10]
torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d);

void bind_decoder(pybind11::module& mod);  // decoder.cpp
int64_t argmax_row(const float* p, int64_t v);  // decoder.cpp: torch.argmax of one row (first maximum, NaN first)
void bind_tree(pybind11::module& mod);  // tree.cpp: a DDTree step's host work

}  // namespace ddtree

// int8_linear.cpp: the same products with the activations quantized to int8 per block of 32 (llama.cpp's arithmetic)
namespace ddtree_int8 {
// stream: the weight is prefetched non-temporally (one that cannot stay cached between passes)
torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor packed, int64_t n, bool stream);  // packed by pack_q4_1
torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor packed, int64_t n, bool stream);  // packed by pack_q8_0
// A packed weight's records and shape, checked once (packed_weight), for products into a caller's buffers without
// the entry points' per-call checks and allocations (the decoder stack's ~120 products a pass). The tensor must
// outlive it.
struct PackedWeight {
  const uint8_t* records = nullptr;
  int64_t groups = 0, k = 0, n = 0;  // groups of 16 outputs, inputs, outputs
  bool q4_1 = true;                  // else Q8_0
};
PackedWeight packed_weight(const torch::Tensor& packed, int64_t n, bool q4_1);
// y [M, n] = x [M, k] @ W^T, x and y contiguous float32 (the same bits as q4_1_linear / q8_0_linear)
void linear_into(const PackedWeight& w, const float* x, int64_t M, float* y, bool stream);
void bind(pybind11::module& mod, const std::string& prefix);
}  // namespace ddtree_int8

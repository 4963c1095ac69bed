// The CPU extension's entry points shared between its sources (qlinear.cpp: the matmuls; decoder.cpp: whole
// decoder layers; int8_linear.cpp: the matmuls with integer activations; tree.cpp: a DDTree step's host work). The
// products take and return contiguous float32 CPU tensors; see each source for layouts and the order of the sums.
#pragma once
#include <immintrin.h>
#include <torch/extension.h>

#include <string>

namespace ddtree {

// The sum of 8 float lanes, always in this order: ((0+4) + (2+6)) + ((1+5) + (3+7)).
inline float hsum(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
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

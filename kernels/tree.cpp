// A DDTree step's host work in C++: the best-first tree over a draft's log-probs, its tokens in the target's
// vocabulary, the verify pass's visibility and positions, and the greedy walk. Each is ddtree/tree.py's Python function of the same
// name, with the same results (tests/test_tree.py holds them equal); here they are a call each instead of dozens of
// Python and torch calls, which cost most after a model pass has pushed the interpreter out of the caches.
//
// The heap orders nodes exactly as Python's heapq orders tree.best_first_nodes' tuples (-score, parent, depth
// index, rank), with the scores summed in double in the same order, so the pop order is the same. Each depth's ranks
// are its log-probs in descending order, ties broken by the lower token id.
#include "cpu_kernels.h"

#include <pybind11/numpy.h>

#include <algorithm>
#include <queue>
#include <tuple>
#include <vector>

namespace ddtree {
namespace {

// The first `k` ranks of one row x [V]: (value, id) by value descending, then id ascending. A scan keeps the best
// k seen so far; eight values at a time are skipped while none beats the k-th.
void top_ranks(const float* x, int64_t V, int64_t k, std::vector<float>& vals, std::vector<int64_t>& ids) {
  vals.clear();
  ids.clear();
  if (k <= 0) return;
  auto insert = [&](float v, int64_t id) {  // v beats the current k-th (or fewer than k are kept)
    int64_t at = static_cast<int64_t>(vals.size());
    while (at > 0 && vals[at - 1] < v) --at;  // equal values keep the lower id first (scanned in id order)
    vals.insert(vals.begin() + at, v);
    ids.insert(ids.begin() + at, id);
    if (static_cast<int64_t>(vals.size()) > k) {
      vals.pop_back();
      ids.pop_back();
    }
  };
  int64_t j = 0;
  for (; j < V && static_cast<int64_t>(vals.size()) < k; ++j) insert(x[j], j);
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    if (!_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(vals.back()), _CMP_GT_OQ))) continue;
    for (int64_t t = j; t < j + 8; ++t)
      if (x[t] > vals.back()) insert(x[t], t);
  }
  for (; j < V; ++j)
    if (x[j] > vals.back()) insert(x[j], j);
}

// One row's ranks, fetched lazily as tree.py's _Ranks does: the first FIRST_RANKS, then (once) up to k.
struct Ranks {
  static constexpr int64_t FIRST_RANKS = 32;
  const float* row;
  int64_t V, k;
  bool complete;
  std::vector<float> lp;
  std::vector<int64_t> ids;

  Ranks(const float* row_, int64_t V_, int64_t k_) : row(row_), V(V_), k(k_), complete(k_ <= FIRST_RANKS) {
    top_ranks(row, V, std::min(k, FIRST_RANKS), lp, ids);
  }
  bool has(int64_t r) {
    if (r < static_cast<int64_t>(lp.size())) return true;
    if (complete || r >= k) return false;
    top_ranks(row, V, k, lp, ids);
    complete = true;
    return r < static_cast<int64_t>(lp.size());
  }
};

using Entry = std::tuple<double, int64_t, int64_t, int64_t>;  // (-score, parent node, depth index, rank)

}  // namespace

// logprobs float32 [L, V] (block positions 1..L), budget >= 1 -> parents int64 [n + 1], depths int64 [n + 1]
// (root first), draft ids int64 [n], path log-probs float64 [n] in pop order; n = min(budget, nodes there are).
std::vector<torch::Tensor> best_first_tree(torch::Tensor logprobs, int64_t budget) {
  TORCH_CHECK(logprobs.dim() == 2 && logprobs.scalar_type() == torch::kFloat32 && logprobs.is_contiguous() &&
                  logprobs.device().is_cpu(),
              "best_first_tree: logprobs must be a contiguous float32 CPU tensor [depth, V]");
  TORCH_CHECK(budget >= 1, "best_first_tree: budget must be >= 1, got ", budget);
  const int64_t L = logprobs.size(0), V = logprobs.size(1), k = std::min(budget, V);
  const float* x = logprobs.data_ptr<float>();
  std::vector<Ranks> ranks;
  ranks.reserve(L);
  for (int64_t d = 0; d < L; ++d) ranks.emplace_back(x + d * V, V, k);
  std::vector<int64_t> parents{-1}, depths{0}, tokens;
  std::vector<double> scores;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;  // a min-heap, as heapq
  if (L > 0 && V > 0) heap.emplace(-static_cast<double>(ranks[0].lp[0]), 0, 0, 0);
  while (!heap.empty() && static_cast<int64_t>(tokens.size()) < budget) {
    const auto [neg, parent, d, r] = heap.top();
    heap.pop();
    const int64_t node = static_cast<int64_t>(parents.size());
    parents.push_back(parent);
    depths.push_back(d + 1);
    tokens.push_back(ranks[d].ids[r]);
    scores.push_back(-neg);
    if (ranks[d].has(r + 1))  // next sibling: same parent, next rank at this depth
      heap.emplace(neg + static_cast<double>(ranks[d].lp[r]) - static_cast<double>(ranks[d].lp[r + 1]), parent, d,
                   r + 1);
    if (d + 1 < L)  // first child: the best rank one level deeper
      heap.emplace(neg - static_cast<double>(ranks[d + 1].lp[0]), node, d + 1, 0);
  }
  auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  const int64_t n = static_cast<int64_t>(tokens.size());
  torch::Tensor p = torch::empty({n + 1}, i64), dep = torch::empty({n + 1}, i64), ids = torch::empty({n}, i64),
                s = torch::empty({n}, torch::TensorOptions().dtype(torch::kFloat64));
  std::copy(parents.begin(), parents.end(), p.data_ptr<int64_t>());
  std::copy(depths.begin(), depths.end(), dep.data_ptr<int64_t>());
  std::copy(tokens.begin(), tokens.end(), ids.data_ptr<int64_t>());
  std::copy(scores.begin(), scores.end(), s.data_ptr<double>());
  return {p, dep, ids, s};
}

// root token, draft ids int64 [n], d2t (the drafter's draft -> target offsets, int64 [draft vocab]) or None ->
// the tree's tokens int64 [n + 1] in the target's vocabulary: root, then id + d2t[id] (or id).
torch::Tensor tree_tokens(int64_t root, torch::Tensor ids, c10::optional<torch::Tensor> d2t) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64 && ids.is_contiguous(),
              "tree_tokens: ids must be a contiguous int64 tensor [n]");
  const int64_t n = ids.size(0);
  torch::Tensor out = torch::empty({n + 1}, torch::TensorOptions().dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t* in = ids.data_ptr<int64_t>();
  o[0] = root;
  if (d2t.has_value()) {
    TORCH_CHECK(d2t->dim() == 1 && d2t->scalar_type() == torch::kInt64 && d2t->is_contiguous(),
                "tree_tokens: d2t must be a contiguous int64 tensor [draft vocab]");
    const int64_t* map = d2t->data_ptr<int64_t>();
    const int64_t size = d2t->size(0);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(in[i] >= 0 && in[i] < size, "tree_tokens: draft id ", in[i], " is outside the draft vocabulary");
      o[i + 1] = in[i] + map[in[i]];
    }
  } else {
    std::copy(in, in + n, o + 1);
  }
  return out;
}

using Index = pybind11::array_t<int64_t, pybind11::array::c_style | pybind11::array::forcecast>;  // numpy int64 [N]

// Parents int64 [N] in tree order: parents[0] = -1, every other parent before its child.
void check_parents(const int64_t* par, int64_t N, const char* who) {
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(i == 0 ? par[i] == -1 : (par[i] >= 0 && par[i] < i), who, ": node ", i, " has parent ", par[i],
                "; parents must precede their children and only node 0 is the root");
}

// parents [N] (numpy int64, tree order), depths [N], past length -> ancestors bool [N, N] ([i, j]: node j is an
// ancestor-or-self of node i; tree.ancestor_matrix) and positions int64 [N] = past + depth.
std::vector<torch::Tensor> tree_visibility(Index parents, Index depths, int64_t past) {
  TORCH_CHECK(parents.ndim() == 1 && depths.ndim() == 1 && parents.shape(0) == depths.shape(0),
              "tree_visibility: parents and depths must be int64 arrays [N] of one length");
  const int64_t N = parents.shape(0);
  const int64_t* par = parents.data();
  const int64_t* dep = depths.data();
  check_parents(par, N, "tree_visibility");
  torch::Tensor anc = torch::zeros({N, N}, torch::TensorOptions().dtype(torch::kBool));
  torch::Tensor pos = torch::empty({N}, torch::TensorOptions().dtype(torch::kInt64));
  bool* a = anc.data_ptr<bool>();
  int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t up = par[i];
    if (up >= 0) std::copy(a + up * N, a + up * N + up + 1, a + i * N);  // the parent's ancestors (all < parent + 1)
    a[i * N + i] = true;
    p[i] = past + dep[i];
  }
  return {anc, pos};
}

// tree.walk with the target's greedy choices: logits float32 [N, V] (the verify pass's), parents [N] (numpy int64,
// tree order), tokens int64 [N] -> (path, choices) as lists: each node's argmax (torch.argmax's: the first maximum),
// and the longest root path on which every node's token is its parent's choice (the first deepest).
pybind11::tuple greedy_walk(torch::Tensor logits, Index parents, torch::Tensor tokens) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.device().is_cpu() && logits.size(1) > 0,
              "greedy_walk: logits must be a contiguous float32 CPU tensor [N, V]");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(parents.ndim() == 1 && parents.shape(0) == N && tokens.dim() == 1 && tokens.size(0) == N &&
                  tokens.scalar_type() == torch::kInt64 && tokens.is_contiguous(),
              "greedy_walk: parents and tokens must be int64 [N], one per row of logits");
  const int64_t* par = parents.data();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  check_parents(par, N, "greedy_walk");
  std::vector<int64_t> choice(N), depth(N, 0);
  std::vector<char> ok(N, 0);
  for (int64_t i = 0; i < N; ++i) choice[i] = argmax_row(logits.data_ptr<float>() + i * V, V);
  ok[0] = 1;
  int64_t end = 0;
  for (int64_t i = 1; i < N; ++i) {
    const int64_t up = par[i];
    if (ok[up] && tok[i] == choice[up]) {
      ok[i] = 1;
      depth[i] = depth[up] + 1;
      if (depth[i] > depth[end]) end = i;
    }
  }
  std::vector<int64_t> path;
  for (int64_t node = end; node != 0; node = par[node]) path.push_back(node);
  path.push_back(0);
  std::reverse(path.begin(), path.end());
  return pybind11::make_tuple(pybind11::cast(path), pybind11::cast(choice));
}

void bind_tree(pybind11::module& mod) {
  mod.def("best_first_tree", &best_first_tree,
          "logprobs [L, V] float32, budget -> parents, depths, draft ids, path log-probs (tree.best_first_nodes)");
  mod.def("tree_tokens", &tree_tokens, "root, draft ids [n], d2t [draft vocab] or None -> tokens [n + 1]");
  mod.def("tree_visibility", &tree_visibility,
          "parents [N], depths [N] (numpy int64), past -> ancestors bool [N, N], positions [N] (tree.ancestor_matrix)");
  mod.def("greedy_walk", &greedy_walk,
          "logits [N, V] float32, parents [N] (numpy int64), tokens [N] -> (path, choices) lists (tree.walk, argmax)");
}

}  // namespace ddtree

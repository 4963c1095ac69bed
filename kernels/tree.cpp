// A DDTree step's host work in C++: the best-first tree over a draft's log-probs, its tokens in the target's
// vocabulary, the verify pass's visibility and positions, and the greedy walk. Each is ddtree/engine/tree.py's Python function of the same
// name, with the same results (tests/test_tree.py holds them equal); here they are a call each instead of dozens of
// Python and torch calls, which cost most after a model pass has pushed the interpreter out of the caches. With a
// Markov head, the tree and the chain from each node's own conditional (markov_tree, markov_chain: ddtree/models/markov.py's
// conditional_table + conditional_best_first / conditional_chain; tests/test_markov.py holds them equal).
//
// The heap orders nodes exactly as Python's heapq orders tree.best_first_nodes' tuples (-score, parent, depth
// index, rank), with the scores summed in double in the same order, so the pop order is the same. Each depth's ranks
// are its log-probs in descending order, ties broken by the lower token id.
#include "cpu_kernels.h"

#include <pybind11/numpy.h>

#include <algorithm>
#include <cmath>
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

// A tree in pop order as tensors: parents int64 [n + 1], depths int64 [n + 1], draft ids int64 [n], scores float64 [n].
std::vector<torch::Tensor> tree_tensors(const std::vector<int64_t>& parents, const std::vector<int64_t>& depths,
                                        const std::vector<int64_t>& tokens, const std::vector<double>& scores) {
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
  return tree_tensors(parents, depths, tokens, scores);
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

// --- Trees from a Markov head's conditionals (ddtree/models/markov.py: conditional_table, conditional_best_first,
// conditional_chain; the same arithmetic, in double, with the same pop order) ------------------------------------

namespace {

double logsumexp(const double* x, int64_t n) {
  double top = x[0];
  for (int64_t i = 1; i < n; ++i) top = std::max(top, x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(x[i] - top);
  return top + std::log(sum);
}

// The conditionals of one block: per depth d the top-M draft ids and cond[d][p][c] = log cond(candidate c of depth
// d | parent p), the parent being candidate p of depth d - 1 (the root at depth 0, the same for every row). A row is
// computed on first use: a tree of n nodes reads at most n + 1 of the D x M rows.
class CondTable {
 public:
  int64_t D, M;
  std::vector<int64_t> ids;  // [D, M] draft ids

  CondTable(const torch::Tensor& logprobs, int64_t root, int64_t m, const torch::Tensor& codes,
            const torch::Tensor& out_t, const torch::Tensor& scale, const c10::optional<torch::Tensor>& d2t);

  const double* row(int64_t d, int64_t p) {  // cond[d][p][:]
    const int64_t at = d * M + p;
    if (!done_[at]) fill(d, p);
    return cond_.data() + at * M;
  }
  const std::vector<int64_t>& ranked(int64_t d, int64_t p) {  // argsort(-row, stable): ties keep the lower index
    const int64_t at = d * M + p;
    if (order_[at].empty()) {
      const double* r = row(d, p);
      auto& o = order_[at];
      o.resize(M);
      for (int64_t c = 0; c < M; ++c) o[c] = c;
      std::stable_sort(o.begin(), o.end(), [r](int64_t a, int64_t b) { return r[a] > r[b]; });
    }
    return order_[at];
  }

 private:
  int64_t root_, R_, vocab_;
  const float *codes_, *out_t_, *scale_;
  const int64_t* map_ = nullptr;
  std::vector<double> lp_, rest_, cond_;  // [D, M] candidates' log-probs, [D] the mass outside them, [D, M, M]
  std::vector<char> done_;
  std::vector<std::vector<int64_t>> order_;

  void fill(int64_t d, int64_t p) {
    int64_t parent = root_;  // depth d's parents: depth d - 1's candidates, as target ids
    if (d > 0) {
      const int64_t id = ids[(d - 1) * M + p];
      parent = map_ ? id + map_[id] : id;
    }
    TORCH_CHECK(parent >= 0 && parent < vocab_, "markov tree: parent token ", parent, " is outside the vocabulary");
    const float* z = codes_ + parent * R_;
    const double* cl = lp_.data() + d * M;
    const double s = static_cast<double>(scale_[d]);
    double* out = cond_.data() + (d * M + p) * M;
    for (int64_t c = 0; c < M; ++c) {  // lp + scale * (z . w): the bias of the head, among the candidates
      const float* w = out_t_ + ids[d * M + c] * R_;
      double dot = 0.0;
      for (int64_t k = 0; k < R_; ++k) dot += static_cast<double>(z[k]) * static_cast<double>(w[k]);
      out[c] = cl[c] + s * dot;
    }
    const double norm = std::log(rest_[d] + std::exp(logsumexp(out, M)));
    for (int64_t c = 0; c < M; ++c) out[c] -= norm;
    done_[d * M + p] = 1;
  }
};

CondTable::CondTable(const torch::Tensor& logprobs, int64_t root, int64_t m, const torch::Tensor& codes,
                     const torch::Tensor& out_t, const torch::Tensor& scale, const c10::optional<torch::Tensor>& d2t) {
  TORCH_CHECK(logprobs.dim() == 2 && logprobs.scalar_type() == torch::kFloat32 && logprobs.is_contiguous() &&
                  logprobs.device().is_cpu() && logprobs.size(0) >= 1,
              "markov tree: logprobs must be a contiguous float32 CPU tensor [depth, draft vocab]");
  D = logprobs.size(0);
  const int64_t V = logprobs.size(1);
  for (const torch::Tensor* t : {&codes, &out_t, &scale})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->device().is_cpu(),
                "markov tree: the head's tables must be contiguous float32 CPU tensors");
  TORCH_CHECK(codes.dim() == 2 && out_t.dim() == 2 && codes.size(1) == out_t.size(1) && out_t.size(0) == V &&
                  scale.dim() == 1 && scale.size(0) >= D,
              "markov tree: codes [vocab, r], out_t [draft vocab, r] and scale [>= depth] do not fit logprobs [",
              D, ", ", V, "]");
  TORCH_CHECK(m >= 1 && m <= V, "markov tree: candidates must lie in 1..", V, ", got ", m);
  M = m;
  root_ = root;
  R_ = codes.size(1);
  vocab_ = codes.size(0);
  TORCH_CHECK(root >= 0 && root < vocab_, "markov tree: root token ", root, " is outside the vocabulary");
  if (d2t.has_value()) {
    TORCH_CHECK(d2t->dim() == 1 && d2t->scalar_type() == torch::kInt64 && d2t->is_contiguous() && d2t->size(0) == V,
                "markov tree: d2t must be a contiguous int64 tensor [draft vocab]");
    map_ = d2t->data_ptr<int64_t>();
  }
  codes_ = codes.data_ptr<float>();
  out_t_ = out_t.data_ptr<float>();
  scale_ = scale.data_ptr<float>();
  ids.resize(D * M);
  lp_.resize(D * M);
  rest_.resize(D);
  cond_.resize(D * M * M);
  done_.assign(D * M, 0);
  order_.resize(D * M);
  const float* x = logprobs.data_ptr<float>();
  std::vector<float> vals;
  std::vector<int64_t> top;
  for (int64_t d = 0; d < D; ++d) {  // candidates: each depth's top-M (ties: the lower id first)
    top_ranks(x + d * V, V, M, vals, top);
    for (int64_t c = 0; c < M; ++c) {
      ids[d * M + c] = top[c];
      lp_[d * M + c] = static_cast<double>(vals[c]);
    }
    rest_[d] = std::max(-std::expm1(logsumexp(lp_.data() + d * M, M)), 1e-12);
  }
}

using CondEntry = std::tuple<double, int64_t, int64_t, int64_t, int64_t>;  // (-score, parent node, d, row p, rank)

}  // namespace

// markov.head_tree_nodes' tree in one call: logprobs float32 [D, draft vocab] (block positions 1..D), the root's
// target id, budget, M candidates per depth, the head's host tables (codes [vocab, r], out_t [draft vocab, r],
// scale [>= D]) and d2t or None -> parents [n + 1], depths [n + 1], draft ids [n], path log-probs [n] (float64),
// in pop order: each node's children from its own conditional (markov.conditional_best_first).
std::vector<torch::Tensor> markov_tree(torch::Tensor logprobs, int64_t root, int64_t budget, int64_t m,
                                       torch::Tensor codes, torch::Tensor out_t, torch::Tensor scale,
                                       c10::optional<torch::Tensor> d2t) {
  TORCH_CHECK(budget >= 1, "markov_tree: budget must be >= 1, got ", budget);
  CondTable t(logprobs, root, m, codes, out_t, scale, d2t);
  std::vector<int64_t> parents{-1}, depths{0}, tokens;
  std::vector<double> scores;
  std::priority_queue<CondEntry, std::vector<CondEntry>, std::greater<CondEntry>> heap;  // a min-heap, as heapq
  heap.emplace(-t.row(0, 0)[t.ranked(0, 0)[0]], 0, 0, 0, 0);
  while (!heap.empty() && static_cast<int64_t>(tokens.size()) < budget) {
    const auto [neg, parent, d, p, r] = heap.top();
    heap.pop();
    const std::vector<int64_t>& idx = t.ranked(d, p);
    const double* lp = t.row(d, p);
    const int64_t node = static_cast<int64_t>(parents.size()), c = idx[r];
    parents.push_back(parent);
    depths.push_back(d + 1);
    tokens.push_back(t.ids[d * t.M + c]);
    scores.push_back(-neg);
    if (r + 1 < t.M)  // next sibling: same parent, next rank of its conditional
      heap.emplace(neg + lp[idx[r]] - lp[idx[r + 1]], parent, d, p, r + 1);
    if (d + 1 < t.D)  // first child: the best of this node's own conditional
      heap.emplace(neg - t.row(d + 1, c)[t.ranked(d + 1, c)[0]], node, d + 1, c, 0);
  }
  return tree_tensors(parents, depths, tokens, scores);
}

// markov.conditional_chain over the same table: the spine's draft ids int64 [D], each the best candidate (the
// first maximum) given the one drafted before it.
torch::Tensor markov_chain(torch::Tensor logprobs, int64_t root, int64_t m, torch::Tensor codes, torch::Tensor out_t,
                           torch::Tensor scale, c10::optional<torch::Tensor> d2t) {
  CondTable t(logprobs, root, m, codes, out_t, scale, d2t);
  torch::Tensor out = torch::empty({t.D}, torch::TensorOptions().dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t d = 0, p = 0; d < t.D; ++d) {
    const double* r = t.row(d, p);
    p = std::max_element(r, r + t.M) - r;
    o[d] = t.ids[d * t.M + p];
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
  mod.def("markov_tree", &markov_tree,
          "logprobs [D, V] float32, root, budget, M, codes [vocab, r], out_t [V, r], scale [D'] (float32), d2t or None "
          "-> parents, depths, draft ids, path log-probs (markov.head_tree_nodes)");
  mod.def("markov_chain", &markov_chain,
          "logprobs [D, V] float32, root, M, codes, out_t, scale, d2t or None -> draft ids [D] (markov.conditional_chain)");
  mod.def("tree_tokens", &tree_tokens, "root, draft ids [n], d2t [draft vocab] or None -> tokens [n + 1]");
  mod.def("tree_visibility", &tree_visibility,
          "parents [N], depths [N] (numpy int64), past -> ancestors bool [N, N], positions [N] (tree.ancestor_matrix)");
  mod.def("greedy_walk", &greedy_walk,
          "logits [N, V] float32, parents [N] (numpy int64), tokens [N] -> (path, choices) lists (tree.walk, argmax)");
}

}  // namespace ddtree

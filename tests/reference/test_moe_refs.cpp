// Host checks of the MoE CPU references: each backward against central finite differences of its
// forward (evaluated in double from fp32 inputs), the aux loss against a literal transcription of
// transformers' load_balancing_loss_func, and the routing/permutation order rules.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <vector>

#include "oom/reference/lm_head_loss.hpp"
#include "oom/reference/moe.hpp"
#include "oom/reference/permute.hpp"
#include "oom/reference/router.hpp"
#include "support/compare.hpp"
#include "support/finite_differences.hpp"

namespace ref = oom::reference;
using oom::test::check_fd;
using oom::test::dot;
using oom::test::random_normal;

namespace {

/// Smallest gap, over tokens, between the k-th and (k+1)-th largest logit: the routing is
/// constant within a perturbation smaller than this, so finite differences see no discrete jump.
double topk_margin(const ref::RouterShape& s, std::span<const float> logits) {
  if (s.top_k == s.experts) return INFINITY;
  double margin = INFINITY;
  std::vector<float> row(static_cast<std::size_t>(s.experts));
  for (std::int64_t t = 0; t < s.tokens; ++t) {
    std::copy_n(&logits[t * s.experts], s.experts, row.begin());
    std::sort(row.begin(), row.end(), std::greater<>());
    margin = std::min(margin, static_cast<double>(row[s.top_k - 1] - row[s.top_k]));
  }
  return margin;
}

}  // namespace

TEST_CASE("router: top-k order is decreasing probability, the lower expert index first among ties") {
  const ref::RouterShape s{.tokens = 2, .hidden = 1, .experts = 6, .top_k = 3, .norm_topk_prob = true};
  const std::vector<float> logits = {0.f, 1.f, 1.f, 0.5f, 1.f, 0.f,   // three-way tie at the top
                                     2.f, 0.f, 0.f, 0.f, 0.f, 3.f};
  const auto f = ref::router_select(s, logits);
  CHECK(f.expert_ids == std::vector<std::int32_t>{1, 2, 4, 5, 0, 1});
  for (std::int64_t t = 0; t < 2; ++t) {
    const double sum = f.weights[t * 3] + f.weights[t * 3 + 1] + f.weights[t * 3 + 2];
    CHECK(sum == doctest::Approx(1.0).epsilon(1e-6));
  }
  CHECK(f.weights[0] == doctest::Approx(1.0 / 3).epsilon(1e-6));
}

TEST_CASE("router: aux loss equals transformers' load_balancing_loss_func, and k for uniform probabilities") {
  const ref::RouterShape s{.tokens = 9, .hidden = 4, .experts = 7, .top_k = 2, .norm_topk_prob = false};
  const auto x = random_normal(static_cast<std::size_t>(s.tokens * s.hidden), 11);
  const auto w = random_normal(static_cast<std::size_t>(s.experts * s.hidden), 12);
  const auto f = ref::router_forward(s, x, w);
  const auto counts = ref::expert_counts(s.experts, f.expert_ids);
  // Literal transcription: expert_mask = one_hot(selected, E) (T, k, E); tokens_per_expert =
  // mean over T (k, E); router_prob_per_expert = mean over T (E); E * sum(tpe * rppe[None]).
  double hf = 0;
  for (std::int64_t j = 0; j < s.top_k; ++j)
    for (std::int64_t e = 0; e < s.experts; ++e) {
      double tpe = 0, rppe = 0;
      for (std::int64_t t = 0; t < s.tokens; ++t) {
        tpe += f.expert_ids[t * s.top_k + j] == e ? 1.0 : 0.0;
        rppe += f.probs[t * s.experts + e];
      }
      hf += (tpe / s.tokens) * (rppe / s.tokens);
    }
  hf *= s.experts;
  CHECK(ref::router_aux_loss(s, f.probs, counts) == doctest::Approx(hf).epsilon(1e-12));

  const std::vector<float> uniform(static_cast<std::size_t>(s.tokens * s.experts), 1.0f / s.experts);
  const auto fu = ref::router_select(s, std::vector<float>(uniform.size(), 0.0f));
  CHECK(ref::router_aux_loss(s, fu.probs, ref::expert_counts(s.experts, fu.expert_ids)) ==
        doctest::Approx(static_cast<double>(s.top_k)).epsilon(1e-6));
}

TEST_CASE("router: backward matches finite differences (weights through renorm + softmax, aux loss)") {
  for (const bool norm : {true, false}) {
    CAPTURE(norm);
    const ref::RouterShape s{.tokens = 6, .hidden = 5, .experts = 8, .top_k = 3, .norm_topk_prob = norm};
    // Draw inputs until every token's k-th and (k+1)-th logits are well apart (no discrete jump
    // within the finite-difference step).
    std::vector<float> x, w;
    for (std::uint64_t seed = 100;; seed += 2) {
      x = random_normal(static_cast<std::size_t>(s.tokens * s.hidden), seed);
      w = random_normal(static_cast<std::size_t>(s.experts * s.hidden), seed + 1, 0.7f);
      if (topk_margin(s, ref::router_forward(s, x, w).logits) > 0.05) break;
    }
    const auto d_weights = random_normal(static_cast<std::size_t>(s.tokens * s.top_k), 7);
    const float aux_grad = 0.37f;
    const auto fwd = ref::router_forward(s, x, w);
    const auto g = ref::router_backward(s, x, w, fwd, d_weights, aux_grad);
    const auto loss = [&] {
      const auto f = ref::router_forward(s, x, w);
      return dot(d_weights, f.weights) + aux_grad * ref::router_aux_loss(s, f.probs, ref::expert_counts(s.experts, f.expert_ids));
    };
    check_fd(x, g.dx, loss, "router dx");
    check_fd(w, g.dw_router, loss, "router dw");
  }
}

TEST_CASE("permute: stable order by (expert, slot), zero-token experts, offsets, inverse map") {
  // T = 4, k = 2, E = 5; expert 0 and 3 receive nothing.
  const std::vector<std::int32_t> ids = {2, 1, 4, 2, 1, 2, 4, 1};
  const auto p = ref::permute_plan(ids, 4, 2, 5);
  CHECK(p.expert_counts == std::vector<std::int32_t>{0, 3, 3, 0, 2});
  CHECK(p.expert_offsets == std::vector<std::int32_t>{0, 0, 3, 6, 6, 8});
  CHECK(p.row_to_slot == std::vector<std::int32_t>{1, 4, 7, 0, 3, 5, 2, 6});
  for (std::size_t r = 0; r < p.row_to_slot.size(); ++r) CHECK(p.slot_to_row[p.row_to_slot[r]] == static_cast<std::int32_t>(r));
}

TEST_CASE("permute: gather backward is its adjoint; combine backward matches finite differences") {
  const std::int64_t T = 5, k = 3, E = 6, H = 4;
  std::vector<std::int32_t> ids;
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j) ids.push_back(static_cast<std::int32_t>((t * 7 + j * 2) % (E - 1)));  // expert 5 empty
  const auto p = ref::permute_plan(ids, T, k, E);
  CHECK(p.expert_counts[5] == 0);
  const auto x = random_normal(static_cast<std::size_t>(T * H), 1);
  const auto g = random_normal(static_cast<std::size_t>(T * k * H), 2);
  // <P x, g> == <x, P^T g>
  CHECK(dot(ref::permute_rows(p, x, k, H), g) == doctest::Approx(dot(x, ref::permute_rows_backward(p, g, k, H))).epsilon(1e-6));

  auto y = random_normal(static_cast<std::size_t>(T * k * H), 3);
  auto wts = random_normal(static_cast<std::size_t>(T * k), 4);
  const auto d_out = random_normal(static_cast<std::size_t>(T * H), 5);
  const auto cg = ref::unpermute_combine_backward(p, d_out, y, wts, k, H);
  const auto loss = [&] { return dot(d_out, ref::unpermute_combine(p, y, wts, k, H)); };
  check_fd(y, cg.dy_perm, loss, "combine dy_perm");
  check_fd(wts, cg.d_weights, loss, "combine d_weights");
}

TEST_CASE("experts: SwiGLU expert MLP backward matches finite differences, empty experts get zero weight grads") {
  const ref::ExpertShape s{.hidden = 6, .intermediate = 5, .experts = 4};
  const std::vector<std::int32_t> counts = {3, 0, 1, 4};
  const std::int64_t n = 8;
  auto x = random_normal(static_cast<std::size_t>(n * s.hidden), 21);
  auto wgu = random_normal(static_cast<std::size_t>(s.experts * 2 * s.intermediate * s.hidden), 22, 0.5f);
  auto wd = random_normal(static_cast<std::size_t>(s.experts * s.hidden * s.intermediate), 23, 0.5f);
  const auto dy = random_normal(static_cast<std::size_t>(n * s.hidden), 24);
  const auto fwd = ref::expert_mlp_forward(s, counts, x, wgu, wd);
  const auto g = ref::expert_mlp_backward(s, counts, x, wgu, wd, fwd, dy);
  const auto loss = [&] { return dot(dy, ref::expert_mlp_forward(s, counts, x, wgu, wd).y); };
  check_fd(x, g.dx, loss, "expert dx");
  check_fd(wgu, g.dw_gate_up, loss, "expert dw_gate_up");
  check_fd(wd, g.dw_down, loss, "expert dw_down");
  const auto I2H = 2 * s.intermediate * s.hidden;
  CHECK(std::all_of(g.dw_gate_up.begin() + I2H, g.dw_gate_up.begin() + 2 * I2H, [](float v) { return v == 0.0f; }));
}

TEST_CASE("shared expert: sigmoid gate backward matches finite differences") {
  const std::int64_t T = 4, H = 7;
  auto x = random_normal(static_cast<std::size_t>(T * H), 31);
  auto wg = random_normal(static_cast<std::size_t>(H), 32, 0.5f);
  auto y = random_normal(static_cast<std::size_t>(T * H), 33);
  const auto routed = random_normal(static_cast<std::size_t>(T * H), 34);
  const auto d_out = random_normal(static_cast<std::size_t>(T * H), 35);
  const auto f = ref::shared_expert_gate_forward(T, H, x, wg, y, routed);
  const auto g = ref::shared_expert_gate_backward(T, H, x, wg, y, f.gate_logit, d_out);
  const auto loss = [&] { return dot(d_out, ref::shared_expert_gate_forward(T, H, x, wg, y, routed).out); };
  check_fd(x, g.dx, loss, "shared gate dx");
  check_fd(wg, g.dw_gate, loss, "shared gate dw_gate");
  check_fd(y, g.dy, loss, "shared gate dy");
}

TEST_CASE("MoE layer: router + permute + experts + combine + aux loss compose to the right dx") {
  // The trainer's chain: dx = router dx + permute^T(expert dx), with d_weights from the combine.
  const ref::RouterShape rs{.tokens = 5, .hidden = 6, .experts = 4, .top_k = 2, .norm_topk_prob = true};
  const ref::ExpertShape es{.hidden = 6, .intermediate = 3, .experts = 4};
  std::vector<float> x, wr;
  for (std::uint64_t seed = 200;; seed += 2) {
    x = random_normal(static_cast<std::size_t>(rs.tokens * rs.hidden), seed);
    wr = random_normal(static_cast<std::size_t>(rs.experts * rs.hidden), seed + 1, 0.7f);
    if (topk_margin(rs, ref::router_forward(rs, x, wr).logits) > 0.05) break;
  }
  const auto wgu = random_normal(static_cast<std::size_t>(es.experts * 2 * es.intermediate * es.hidden), 41, 0.5f);
  const auto wd = random_normal(static_cast<std::size_t>(es.experts * es.hidden * es.intermediate), 42, 0.5f);
  const auto d_out = random_normal(static_cast<std::size_t>(rs.tokens * rs.hidden), 43);
  const float aux_grad = 0.01f;
  const auto k = rs.top_k, H = rs.hidden;
  const auto loss = [&] {
    const auto r = ref::router_forward(rs, x, wr);
    const auto p = ref::permute_plan(r.expert_ids, rs.tokens, k, rs.experts);
    const auto y = ref::expert_mlp_forward(es, p.expert_counts, ref::permute_rows(p, x, k, H), wgu, wd).y;
    return dot(d_out, ref::unpermute_combine(p, y, r.weights, k, H)) +
           aux_grad * ref::router_aux_loss(rs, r.probs, p.expert_counts);
  };
  const auto r = ref::router_forward(rs, x, wr);
  const auto p = ref::permute_plan(r.expert_ids, rs.tokens, k, rs.experts);
  const auto xp = ref::permute_rows(p, x, k, H);
  const auto ef = ref::expert_mlp_forward(es, p.expert_counts, xp, wgu, wd);
  const auto cg = ref::unpermute_combine_backward(p, d_out, ef.y, r.weights, k, H);
  const auto eg = ref::expert_mlp_backward(es, p.expert_counts, xp, wgu, wd, ef, cg.dy_perm);
  const auto rg = ref::router_backward(rs, x, wr, r, cg.d_weights, aux_grad);
  auto dx = ref::permute_rows_backward(p, eg.dx, k, H);
  for (std::size_t i = 0; i < dx.size(); ++i) dx[i] += rg.dx[i];
  check_fd(x, dx, loss, "moe layer dx");
  check_fd(wr, rg.dw_router, loss, "moe layer dw_router");
}

TEST_CASE("lm head loss: ignored targets, loss sum and count, backward matches finite differences") {
  const std::int64_t T = 5, H = 4, V = 11;
  auto x = random_normal(static_cast<std::size_t>(T * H), 51);
  auto w = random_normal(static_cast<std::size_t>(V * H), 52);
  const std::vector<std::int32_t> targets = {3, ref::ignore_index, 0, 10, ref::ignore_index};
  const double scale = 1.0 / 3.0;
  const auto r = ref::lm_head_loss(T, H, V, x, w, targets, true, scale);
  CHECK(r.valid_count == 3);
  CHECK(r.row_loss[1] == 0.0f);
  CHECK(r.loss_sum > 0);
  for (std::int64_t h = 0; h < H; ++h) CHECK(r.dx[1 * H + h] == 0.0f);
  const auto loss = [&] { return scale * ref::lm_head_loss(T, H, V, x, w, targets, false, 0).loss_sum; };
  check_fd(x, r.dx, loss, "lm head dx");
  check_fd(w, r.dw, loss, "lm head dw");
}

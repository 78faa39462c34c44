// CudaCausalLm::footprint: the executor's exact memory by claimant, computed without a GPU (so it
// runs in CI). Checks the arithmetic on a small model and, on the 5.13B benchmark model, the case
// found on the H200: at 128K the planner's own plan needs more GPU memory with the CUDA executor
// than the H200 has, while the same plan with checkpoint retention fits.
#include <doctest/doctest.h>

#include <filesystem>

#include "oom/model/model_spec.hpp"
#include "oom/plan/planner.hpp"
#include "oom/runtime/cuda_causal_lm.hpp"

using namespace oom;
using namespace oom::literals;

namespace {

ModelSpec config(const char* name) {
  return ModelSpec::from_file(std::filesystem::path(OOM_SOURCE_DIR) / "examples/configs" / name);
}

Bytes gpu_bytes(const std::array<Bytes, claimant_count>& fp) {
  Bytes b;
  for (int c = 0; c < claimant_count; ++c)
    if (on_gpu(static_cast<Claimant>(c))) b = b + fp[static_cast<std::size_t>(c)];
  return b;
}

Plan plan_for(const ModelSpec& spec, std::uint64_t seq) {
  const auto profile = MachineProfile::builtin("h200", 1);
  const Planner planner(spec, profile);
  PlanRequest req;
  req.gpus = 1;
  req.gpu_budget = profile.gpu_memory;
  req.host_budget = profile.host_memory;
  req.workload = {1, seq};
  return planner.plan(req).plans.front();
}

void checkpoint(Plan& p) {
  for (std::size_t l = 0; l < p.retention.size(); ++l)
    for (int c = 0; c < activation_class_count; ++c)
      p.retention[l][static_cast<std::size_t>(c)] =
          c == 0 ? RetentionDecision::keep() : RetentionDecision::recompute(static_cast<int>(l));
}

}  // namespace

TEST_CASE("resident state is 18 bytes a parameter; streaming moves it to pinned host memory") {
  const auto spec = config("tiny-moe-d128.json");
  Plan p = plan_for(spec, 256);
  p.resident_segments.clear();
  for (const auto& s : spec.segments()) p.resident_segments.push_back(s.name);
  const auto all = CudaCausalLm::footprint(spec, p);
  // bf16 weights + fp32 master, m, v, gradient, each buffer rounded up to 256 bytes.
  std::uint64_t want = 0;
  for (const auto& s : spec.segments()) want += (s.parameters() * 2 + 255) / 256 * 256 + 4 * ((s.parameters() * 4 + 255) / 256 * 256);
  CHECK(all[static_cast<std::size_t>(Claimant::resident_state)] == Bytes{want});
  CHECK(all[static_cast<std::size_t>(Claimant::host_state)] == 0_B);

  p.resident_segments.clear();  // only the ends stay on the GPU
  const auto streamed = CudaCausalLm::footprint(spec, p);
  CHECK(streamed[static_cast<std::size_t>(Claimant::resident_state)] < all[static_cast<std::size_t>(Claimant::resident_state)]);
  CHECK(streamed[static_cast<std::size_t>(Claimant::host_state)] > 0_B);
  CHECK(streamed[static_cast<std::size_t>(Claimant::host_staging)] > 0_B);
  CHECK(streamed[static_cast<std::size_t>(Claimant::worksets)] > all[static_cast<std::size_t>(Claimant::worksets)]);  // slots
  CHECK(gpu_bytes(streamed) < gpu_bytes(all));
}

TEST_CASE("5.13B at 128K: the planner's plan does not fit the CUDA executor on an H200, its checkpoint variant does") {
  const auto spec = config("moe-5b.json");
  const auto h200 = MachineProfile::builtin("h200", 1).gpu_memory;
  Plan p = plan_for(spec, 131072);
  const auto as_planned = CudaCausalLm::footprint(spec, p);
  MESSAGE("as planned: " << gpu_bytes(as_planned).count() << " B on the GPU; H200 " << h200.count());
  CHECK(gpu_bytes(as_planned) > h200);
  checkpoint(p);
  const auto ckpt = CudaCausalLm::footprint(spec, p);
  MESSAGE("checkpoint: " << gpu_bytes(ckpt).count() << " B");
  CHECK(gpu_bytes(ckpt) < h200 - 1_GiB);
  // What the H200 run measured for this plan (2026-11-30): arena peak 70,733.9 MiB.
  CHECK(gpu_bytes(ckpt) > 60_GiB);
  CHECK(gpu_bytes(ckpt) < 75_GiB);
}

TEST_CASE("the layer's workspace grows with the sequence: 512K does not fit one H200 without token chunks") {
  const auto spec = config("moe-5b.json");
  Plan p = plan_for(spec, 524288);
  checkpoint(p);
  const auto fp = CudaCausalLm::footprint(spec, p);
  // 242 GiB (2026-11-30): the layer's workspace alone is 75 GiB and each rotating saved buffer 4x
  // the 128K one; token chunks in the CUDA layer are what 512K needs.
  CHECK(gpu_bytes(fp) > MachineProfile::builtin("h200", 1).gpu_memory);
  CHECK(fp[static_cast<std::size_t>(Claimant::worksets)] > 64_GiB);
  CHECK(fp[static_cast<std::size_t>(Claimant::retained_activations)] > 100_GiB);
}

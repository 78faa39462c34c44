// A tiny program that uses OOM the way an embedding trainer would: the vocabulary, an error, a
// plan for a layer of its own (LayerStackPlanner, in oom::host), and (when the package was built
// with CUDA) a symbol from oom::cuda.
#include <cstdio>
#include <string>
#include <vector>

#include <oom/oom.hpp>  // alone: the planners and the host executor come with it
#if OOM_CONSUMER_CUDA
#include <oom/cuda/device.hpp>
int consumer_kernel_launches();  // consumer_kernel.cu
#endif

// The trainer's own layer, as the planner sees it: one segment, a cost per workload.
struct ConsumerLayer {
  std::vector<oom::StateSegment> segs{{"block", oom::SegmentRole::dense_mlp, 0, -1, {{"block.w", {1024, 1024}}}}};
  const std::vector<oom::StateSegment>& segments() const { return segs; }
  oom::LayerCost cost(const oom::Workload& w) const {
    oom::LayerCost c;
    c.forward_flops = 2.0 * 1024 * 1024 * static_cast<double>(w.tokens());
    c.backward_flops = 2 * c.forward_flops;
    c.output = oom::Bytes{w.tokens() * 1024 * 4};
    return c;
  }
};

int main() {
  using namespace oom::literals;
  const oom::Bytes budget = oom::parse_bytes("80GiB");
  if (budget != 80_GiB) return 1;
  try {
    OOM_THROW(oom::Errc::out_of_budget, "consumer check");
  } catch (const oom::Error& e) {
    if (e.code() != oom::Errc::out_of_budget) return 2;
  }
#if OOM_CONSUMER_CUDA
  std::printf("GPUs visible: %d\n", oom::cuda::device_count());
  if (consumer_kernel_launches() != 1) return 3;
#endif
  {
    const std::vector<ConsumerLayer> layers(4);
    const oom::MachineProfile profile = oom::MachineProfile::h200(1);
    std::vector<oom::LayerDescription> described = oom::describe_layers(layers);
    for (std::size_t l = 0; l < described.size(); ++l) described[l].segments[0].name += std::to_string(l);
    const oom::LayerStackPlanner planner(std::move(described), profile);
    oom::PlanRequest req;
    req.gpu_budget = 64_MiB;
    req.host_budget = 1_GiB;
    req.workload = {1, 1024};
    if (planner.plan(req).plans.empty()) return 4;
    oom::HostBackend backend({64_MiB, 64_MiB});
    if (backend.device_arena().budget() != 64_MiB) return 5;
  }
  oom::log_info("budget {}", budget);
  std::printf("oom consumer ok\n");
  return 0;
}

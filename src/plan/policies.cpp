// ResidencySet and RetentionTable (see oom/plan/policies.hpp).
#include "oom/plan/policies.hpp"

#include <algorithm>

#include "oom/core/error.hpp"

namespace oom {

ResidencySet::ResidencySet(const ModelSpec& spec, std::vector<bool> resident, int gpus, bool expert_parallel)
    : resident_(std::move(resident)), gpus_(gpus), expert_parallel_(expert_parallel) {
  if (resident_.size() != spec.segments().size())
    OOM_THROW(Errc::invalid_argument, "residency mask has " + std::to_string(resident_.size()) + " entries for " +
                                          std::to_string(spec.segments().size()) + " segments");
  for (std::size_t i = 0; i < spec.segments().size(); ++i) index_.emplace(spec.segments()[i].name, i);
}

Placement ResidencySet::place(const StateSegment& s) const {
  const auto it = index_.find(s.name);
  if (it == index_.end() || !resident_[it->second]) return Placement::host();
  if (expert_parallel_ && s.expert >= 0) return Placement::on_device(s.expert % gpus_);
  return Placement::on_device(0);  // and every other GPU: each holds its replica
}

std::size_t ResidencySet::resident_count() const {
  return static_cast<std::size_t>(std::count(resident_.begin(), resident_.end(), true));
}

const char* to_string(RetentionTemplate t) noexcept {
  switch (t) {
    case RetentionTemplate::keep_all: return "keep-all";
    case RetentionTemplate::checkpoint: return "checkpoint";
    case RetentionTemplate::offload_checkpoint: return "offload-checkpoint";
    case RetentionTemplate::keep_attention: return "keep-attention";
    case RetentionTemplate::offload_attention: return "offload-attention";
    case RetentionTemplate::hybrid_regenerate: return "hybrid-regenerate";
  }
  return "?";
}

namespace {

std::array<RetentionDecision, activation_class_count> decide(const ModelSpec& spec, RetentionTemplate t, int layer) {
  std::array<RetentionDecision, activation_class_count> row{};
  for (int ci = 0; ci < activation_class_count; ++ci) {
    const auto c = static_cast<ActivationClass>(ci);
    const bool boundary = c == ActivationClass::layer_boundary;
    RetentionDecision d = RetentionDecision::keep();
    switch (t) {
      case RetentionTemplate::keep_all: break;
      case RetentionTemplate::checkpoint: d = boundary ? RetentionDecision::keep() : RetentionDecision::recompute(layer); break;
      case RetentionTemplate::offload_checkpoint:
        d = boundary ? RetentionDecision::offload() : RetentionDecision::recompute(layer);
        break;
      case RetentionTemplate::keep_attention:
        d = boundary || is_attention_result(c) ? RetentionDecision::keep() : RetentionDecision::recompute(layer);
        break;
      case RetentionTemplate::offload_attention:
        d = boundary || is_attention_result(c) ? RetentionDecision::offload() : RetentionDecision::recompute(layer);
        break;
      case RetentionTemplate::hybrid_regenerate: {
        // Groups end at a full-attention layer; a group's first layer keeps its boundary on the
        // host, the others regenerate theirs through the (cheap) layers before them.
        int start = layer;
        while (start > 0 && spec.layer(start - 1).attention != AttentionKind::full) --start;
        const bool full = spec.layer(layer).attention == AttentionKind::full;
        if (boundary)
          d = start == layer ? RetentionDecision::offload() : RetentionDecision::recompute(start);
        else if (full && is_attention_result(c))
          d = RetentionDecision::offload();  // quadratic: never recomputed
        else
          d = RetentionDecision::recompute(layer);
        break;
      }
    }
    row[static_cast<std::size_t>(ci)] = d;
  }
  return row;
}

}  // namespace

RetentionTable::RetentionTable(const ModelSpec& spec, RetentionTemplate far, RetentionTemplate near, int layers_near_loss) {
  const int n = spec.num_layers();
  layers_near_loss = std::clamp(layers_near_loss, 0, n);
  table_.reserve(static_cast<std::size_t>(n));
  for (int l = 0; l < n; ++l) table_.push_back(decide(spec, l >= n - layers_near_loss ? near : far, l));
  name_ = layers_near_loss == 0 ? to_string(far)
          : layers_near_loss == n
              ? to_string(near)
              : std::string(to_string(far)) + " + last " + std::to_string(layers_near_loss) + " layers " + to_string(near);
}

}  // namespace oom

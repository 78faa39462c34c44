// Names of the vocabulary enums (segment roles, activation classes, resources), for plans and logs.
#include "oom/model/segment.hpp"

namespace oom {

const char* to_string(SegmentRole r) noexcept {
  switch (r) {
    case SegmentRole::embedding: return "embedding";
    case SegmentRole::attention: return "attention";
    case SegmentRole::linear_attention: return "linear_attention";
    case SegmentRole::norm: return "norm";
    case SegmentRole::router: return "router";
    case SegmentRole::expert: return "expert";
    case SegmentRole::shared_expert: return "shared_expert";
    case SegmentRole::dense_mlp: return "dense_mlp";
    case SegmentRole::final_norm: return "final_norm";
    case SegmentRole::lm_head: return "lm_head";
  }
  return "?";
}

}  // namespace oom

#include "oom/model/workload.hpp"

namespace oom {

const char* to_string(ActivationClass c) noexcept {
  switch (c) {
    case ActivationClass::layer_boundary: return "layer_boundary";
    case ActivationClass::norm_output: return "norm_output";
    case ActivationClass::attention_output: return "attention_output";
    case ActivationClass::softmax_stats: return "softmax_stats";
    case ActivationClass::linear_attention_state: return "linear_attention_state";
    case ActivationClass::router_output: return "router_output";
    case ActivationClass::permuted_tokens: return "permuted_tokens";
    case ActivationClass::expert_intermediate: return "expert_intermediate";
    case ActivationClass::other: return "other";
  }
  return "?";
}

}  // namespace oom

#include "oom/concepts/cost_model.hpp"

namespace oom {

const char* to_string(Resource r) noexcept {
  switch (r) {
    case Resource::gpu_compute: return "gpu_compute";
    case Resource::h2d: return "h2d";
    case Resource::d2h: return "d2h";
    case Resource::cpu: return "cpu";
    case Resource::network: return "network";
  }
  return "?";
}

}  // namespace oom

// Names of segment roles.
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

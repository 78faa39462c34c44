// Test support: a small Qwen3-MoE whose layers OOM's CUDA kernels take (head_dim 128): hidden 256,
// 4 query / 2 key-value heads, 8 experts top-2 of intermediate 128, vocab 300; with
// router_aux_loss_coef > 0, transformers' load-balancing loss in the training loss
// (output_router_logits) at that coefficient.
#pragma once

#include <string>

#include "oom/io/json.hpp"
#include "oom/model/model_spec.hpp"

namespace oom::test {

inline ModelSpec small_qwen3_moe(int layers, double router_aux_loss_coef = 0) {
  const std::string balance = router_aux_loss_coef > 0 ? R"(, "output_router_logits": true, "router_aux_loss_coef": )" +
                                                             std::to_string(router_aux_loss_coef)
                                                       : std::string();
  return ModelSpec::from_json(Json::parse(R"({
    "model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_hidden_layers": )" + std::to_string(layers) + R"(, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 128, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": false)" + balance + "}"));
}

}  // namespace oom::test

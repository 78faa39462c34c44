// A config.json at another depth (oom-plan --most-layers, oom-train --layers): the same widths, more
// or fewer layers.
#pragma once

#include <cstdint>
#include <utility>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"

namespace oom::examples {

/// config.json's max_position_embeddings (under text_config where the model wraps one, as Qwen3.5's
/// does, like ModelSpec reads it): the positions the model was trained for; 0 where it does not say.
inline std::uint64_t max_position_embeddings(const Json& config) {
  const Json* text = config.find("text_config");
  const Json& fields = text != nullptr && text->is_object() ? *text : config;
  const Json* v = fields.find("max_position_embeddings");
  return v != nullptr && v->is_integer() && v->as_int64() > 0 ? static_cast<std::uint64_t>(v->as_int64()) : 0;
}

/// `config` (a Hugging Face config.json) with `layers` decoder layers of its widths. Layer i takes
/// layer (i mod N)'s kinds, N the config's count: its layer_types entry and whether it is in
/// mlp_only_layers (decoder_sparse_step and full_attention_interval already repeat). The fields
/// sit under text_config where the model wraps one (Qwen3.5), as ModelSpec reads them. Errors
/// (invalid_argument): a depth past max_config_layers, no positive num_hidden_layers, a
/// layer_types of another length.
/// The most layers with_layers makes (a model of more is not one a node trains; a typo of many more
/// had built it in memory before any error).
inline constexpr int max_config_layers = 4096;

inline Json with_layers(const Json& config, int layers) {
  if (layers < 1 || layers > max_config_layers)
    OOM_THROW(Errc::invalid_argument, fmt::format("{} layers: a depth from 1 to {}", layers, max_config_layers));
  Json out = config;
  const bool wrapped = config.find("text_config") != nullptr && config.find("text_config")->is_object();
  Json fields = wrapped ? *config.find("text_config") : config;
  const Json* n_field = fields.find("num_hidden_layers");
  if (n_field == nullptr || !n_field->is_integer() || n_field->as_int64() < 1)
    OOM_THROW(Errc::invalid_argument, "the config has no positive num_hidden_layers to take another depth from");
  const auto n = n_field->as_int64();
  if (const Json* types = fields.find("layer_types"); types != nullptr && types->is_array()) {
    if (static_cast<std::int64_t>(types->size()) != n)
      OOM_THROW(Errc::invalid_argument, fmt::format("the config's layer_types has {} entries for {} layers", types->size(), n));
    Json repeated = Json::array();
    for (int i = 0; i < layers; ++i) repeated.push_back(types->as_array()[static_cast<std::size_t>(i % n)]);
    fields.set("layer_types", std::move(repeated));
  }
  if (const Json* mlp_only = fields.find("mlp_only_layers"); mlp_only != nullptr && mlp_only->is_array()) {
    Json repeated = Json::array();
    for (int i = 0; i < layers; ++i)
      for (const Json& l : mlp_only->as_array())
        if (l.is_integer() && l.as_int64() == i % n) repeated.push_back(i);
    fields.set("mlp_only_layers", std::move(repeated));
  }
  fields.set("num_hidden_layers", layers);
  if (wrapped) out.set("text_config", std::move(fields));
  else out = std::move(fields);
  return out;
}

}  // namespace oom::examples

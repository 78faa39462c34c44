// Plan <-> JSON. The JSON is what `oom-plan --json` writes and the trainer's `--plan` reads.
#include <algorithm>
#include <charconv>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"
#include "oom/plan/plan.hpp"

namespace oom {

namespace {

const char* action_name(Retention r) {
  switch (r) {
    case Retention::keep: return "keep";
    case Retention::offload: return "offload";
    case Retention::recompute: return "recompute";
  }
  return "?";
}

Retention parse_retention(const JsonCursor& c) {
  const auto& s = c.as_string();
  for (auto r : {Retention::keep, Retention::offload, Retention::recompute})
    if (s == action_name(r)) return r;
  OOM_THROW(Errc::parse, fmt::format("{}: '{}' is not keep, offload or recompute", c.path(), s));
}

/// The value of `values` whose to_string() is the string at `c`; else an error naming the field
/// and what it may be (`expected`).
template <class E>
E parse_named(const JsonCursor& c, std::initializer_list<E> values, std::string_view expected) {
  const auto& s = c.as_string();
  for (const E v : values)
    if (s == to_string(v)) return v;
  OOM_THROW(Errc::parse, fmt::format("{}: '{}' is not {}", c.path(), s, expected));
}

ExecutionPath parse_path(const JsonCursor& c) {
  return parse_named(c, {ExecutionPath::local, ExecutionPath::expert_parallel}, "local or expert-parallel");
}

GradAccumulation parse_accumulation(const JsonCursor& c) {
  return parse_named(c, {GradAccumulation::host, GradAccumulation::device}, "host or device");
}

/// Refuses a key of the object at `c` that is not one of `known`: a misspelt field
/// ("grad_acumulation") had been ignored and its default run instead. `where` says whose keys
/// they are in the message ("a plan", "layer 3's retention").
void refuse_unknown_keys(const JsonCursor& c, const std::vector<std::string>& known, std::string_view where) {
  for (const auto& [key, v] : c.as_object())
    if (std::find(known.begin(), known.end(), key) == known.end())
      OOM_THROW(Errc::parse, fmt::format("{}: unknown key '{}' in {} (known: {})", c[key].path(), key, where, fmt::join(known, ", ")));
}

template <class E>
std::vector<std::string> names_of(int count) {
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) out.emplace_back(to_string(static_cast<E>(i)));
  return out;
}

/// A precision of model state: a floating-point type. An "int32" had been priced at its 4 bytes
/// and the plan then refused as another model's (its resident state differed from the model's).
DType parse_state_dtype(const JsonCursor& c) {
  const std::string& text = c.as_string();
  DType d{};
  try {
    d = parse_dtype(text);
  } catch (const Error& e) {
    OOM_THROW(Errc::parse, fmt::format("{}: {}", c.path(), e.message()));
  }
  switch (d) {
    case DType::bf16:
    case DType::fp16:
    case DType::fp32:
    case DType::fp64:
    case DType::fp8_e4m3:
    case DType::fp8_e5m2: return d;
    default: break;
  }
  OOM_THROW(Errc::parse, fmt::format("{}: '{}' is not a floating-point type (model state is bf16, fp16, fp32, fp64, fp8_e4m3 or fp8_e5m2)",
                                     c.path(), text));
}

Json bytes_by_claimant(const std::array<Bytes, claimant_count>& a) {
  Json o = Json::object();
  for (int c = 0; c < claimant_count; ++c) o.set(to_string(static_cast<Claimant>(c)), a[static_cast<std::size_t>(c)].count());
  return o;
}

}  // namespace

Json Plan::to_json() const {
  Json j = Json::object();
  j.set("format", "oom-plan/1");
  j.set("model", model);
  if (!model_fingerprint.empty()) j.set("model_fingerprint", model_fingerprint);  // none for a LayerStackPlanner's layers
  if (!layers_fingerprint.empty()) j.set("layers_fingerprint", layers_fingerprint);  // a LayerStackPlanner's only
  j.set("path", to_string(path));
  j.set("gpus", gpus);
  j.set("prefetch_depth", prefetch_depth);
  j.set("sequences", workload.sequences);
  j.set("seq_len", workload.seq_len);
  j.set("micro_batches", micro_batches);
  j.set("grad_accumulation", to_string(grad_accumulation));
  j.set("clip_grad_norm", clip_grad_norm);
  Json prec = Json::object();
  prec.set("weights", std::string(name(precision.weights)));
  prec.set("master", std::string(name(precision.master)));
  prec.set("moments", std::string(name(precision.moments)));
  prec.set("grads", std::string(name(precision.grads)));
  j.set("precision", std::move(prec));
  j.set("gpu_budget_bytes", gpu_budget.count());
  j.set("host_budget_bytes", host_budget.count());
  j.set("resident_level_bytes", resident_level.count());
  Json res = Json::array();
  for (const auto& s : resident_segments) res.push_back(s);
  j.set("resident_segments", std::move(res));
  j.set("retention_name", retention_name);
  Json layers = Json::array();
  for (std::size_t l = 0; l < retention.size(); ++l) {
    Json layer = Json::object();
    Json ret = Json::object();
    for (int c = 0; c < activation_class_count; ++c) {
      const auto d = retention[l][static_cast<std::size_t>(c)];
      std::string v = action_name(d.action);
      if (d.action == Retention::recompute) v += fmt::format(" from {}", d.recompute_from);
      ret.set(to_string(static_cast<ActivationClass>(c)), v);
    }
    layer.set("retention", std::move(ret));
    Json ends = Json::array();
    if (l < chunks.size())
      for (auto e : chunks[l].attention) ends.push_back(e);
    layer.set("attention_chunk_ends", std::move(ends));
    layer.set("moe_chunk_tokens", l < chunks.size() ? chunks[l].moe_tokens : 0);
    layers.push_back(std::move(layer));
  }
  j.set("layers", std::move(layers));
  j.set("loss_chunk_rows", loss_rows);
  Json pred = Json::object();
  pred.set("step_s", predicted.step_s);
  Json busy = Json::object();
  for (int r = 0; r < resource_count; ++r) busy.set(to_string(static_cast<Resource>(r)), predicted.busy.seconds[static_cast<std::size_t>(r)]);
  pred.set("busy_s", std::move(busy));
  pred.set("gpu_peak_bytes", predicted.gpu_peak.count());
  pred.set("host_peak_bytes", predicted.host_peak.count());
  pred.set("gpu_at_peak_bytes", bytes_by_claimant(predicted.gpu_at_peak));
  pred.set("peak_bytes", bytes_by_claimant(predicted.peak));
  j.set("predicted", std::move(pred));
  return j;
}

// The names plans are written with (and logs and traces print), beside the reader that parses them
// (declared with their enums in plan.hpp and simulator.hpp).
const char* to_string(ExecutionPath p) noexcept {
  switch (p) {
    case ExecutionPath::local: return "local";
    case ExecutionPath::expert_parallel: return "expert-parallel";
  }
  return "?";
}

const char* to_string(Claimant c) noexcept {
  switch (c) {
    case Claimant::resident_state: return "resident_state";
    case Claimant::retained_activations: return "retained_activations";
    case Claimant::worksets: return "worksets";
    case Claimant::host_state: return "host_state";
    case Claimant::host_staging: return "host_staging";
    case Claimant::host_offload: return "host_offload";
  }
  return "?";
}

const char* to_string(GradAccumulation a) noexcept {
  switch (a) {
    case GradAccumulation::host: return "host";
    case GradAccumulation::device: return "device";
  }
  return "?";
}

namespace {

/// A whole number field within [lo, hi], named when it is not: a count past int's range would
/// otherwise wrap in the cast (prefetch_depth 4294967297 read as 1), and a huge one ask an
/// executor for that many weight slots or micro-batches.
int bounded(const JsonCursor& j, std::int64_t lo, std::int64_t hi, std::string_view what) {
  const std::int64_t v = j.as_int64();
  if (v < lo || v > hi) OOM_THROW(Errc::parse, fmt::format("{}: {} is out of range ({} to {}: {})", j.path(), v, lo, hi, what));
  return static_cast<int>(v);
}

}  // namespace

Plan Plan::from_json(const Json& json, std::string_view source) {
  try {
    const JsonCursor j(json);
    if (j["format"].as_string() != "oom-plan/1")
      OOM_THROW(Errc::parse, fmt::format("format: '{}' is not oom-plan/1", j["format"].as_string()));
    // Every level's keys are known: a misspelt optional field had run with its default.
    refuse_unknown_keys(j,
                        {"format", "model", "model_fingerprint", "layers_fingerprint", "path", "gpus", "prefetch_depth", "sequences", "seq_len", "micro_batches",
                         "grad_accumulation", "clip_grad_norm", "precision", "gpu_budget_bytes", "host_budget_bytes",
                         "resident_level_bytes", "resident_segments", "retention_name", "layers", "loss_chunk_rows", "predicted"},
                        "a plan");
    refuse_unknown_keys(j["precision"], {"weights", "master", "moments", "grads"}, "the plan's precision");
    Plan p;
    p.model = j["model"].as_string();
    // Each absent in older plans; model_fingerprint in a LayerStackPlanner's, layers_fingerprint in a Planner's.
    for (const auto& [key, field] : {std::pair{"model_fingerprint", &p.model_fingerprint}, std::pair{"layers_fingerprint", &p.layers_fingerprint}}) {
      const auto fp = j[key];
      if (!fp.present()) continue;
      *field = fp.as_string();
      if (field->size() != 16 ||
          !std::all_of(field->begin(), field->end(), [](char ch) { return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f'); }))
        OOM_THROW(Errc::parse, fmt::format("{}: '{}' is not 16 lowercase hex digits", fp.path(), *field));
    }
    p.path = parse_path(j["path"]);
    p.gpus = bounded(j["gpus"], 1, max_plan_gpus, "GPUs of one node");
    p.prefetch_depth = bounded(j["prefetch_depth"], 1, max_prefetch_depth, "weight slots, layers in flight");
    p.workload = {j["sequences"].as_uint64(), j["seq_len"].as_uint64()};
    p.micro_batches = bounded(j["micro_batches"], 1, max_micro_batches, "micro-batches a step");
    if (j["grad_accumulation"].present()) p.grad_accumulation = parse_accumulation(j["grad_accumulation"]);  // absent in older plans: host
    if (j["clip_grad_norm"].present()) p.clip_grad_norm = j["clip_grad_norm"].as_bool();  // absent in older plans: off
    p.precision.weights = parse_state_dtype(j["precision"]["weights"]);
    p.precision.master = parse_state_dtype(j["precision"]["master"]);
    p.precision.moments = parse_state_dtype(j["precision"]["moments"]);
    p.precision.grads = parse_state_dtype(j["precision"]["grads"]);
    p.gpu_budget = Bytes{j["gpu_budget_bytes"].as_uint64()};
    p.host_budget = Bytes{j["host_budget_bytes"].as_uint64()};
    p.resident_level = Bytes{j["resident_level_bytes"].as_uint64()};
    for (std::size_t i = 0; i < j["resident_segments"].size(); ++i) p.resident_segments.push_back(j["resident_segments"][i].as_string());
    p.retention_name = j["retention_name"].as_string();
    if (p.workload.sequences == 0 || p.workload.seq_len == 0) OOM_THROW(Errc::parse, "sequences and seq_len must be positive");
    if (!p.workload.within_limit())
      OOM_THROW(Errc::parse, fmt::format("sequences {} x seq_len {} is more than the {} tokens a micro-batch may hold", p.workload.sequences,
                                         p.workload.seq_len, max_workload_tokens));
    const auto layers = j["layers"];
    (void)layers.as_array();  // an object would otherwise pass as a list of its members
    const auto classes = names_of<ActivationClass>(activation_class_count);
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const auto layer = layers[l];
      refuse_unknown_keys(layer, {"retention", "attention_chunk_ends", "moe_chunk_tokens"}, fmt::format("layer {}", l));
      refuse_unknown_keys(layer["retention"], classes, fmt::format("layer {}'s retention", l));
      std::array<RetentionDecision, activation_class_count> row{};
      for (int c = 0; c < activation_class_count; ++c) {
        const auto field = layer["retention"][to_string(static_cast<ActivationClass>(c))];
        std::string text = field.as_string();
        RetentionDecision d;
        if (const auto at = text.find(" from "); at != std::string::npos) {
          const std::string_view num = std::string_view(text).substr(at + 6);
          int from = -1;
          const auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), from);
          if (ec != std::errc{} || end != num.data() + num.size() || from < 0)
            OOM_THROW(Errc::parse, fmt::format("{}: '{}' is not 'recompute from <layer>' with a layer number", field.path(), text));
          d.recompute_from = from;
          text = text.substr(0, at);
          if (text != "recompute") OOM_THROW(Errc::parse, fmt::format("{}: only recompute takes 'from <layer>'", field.path()));
        }
        d.action = parse_retention(JsonCursor(Json(text), field.path()));
        if (d.action == Retention::recompute && d.recompute_from < 0)
          OOM_THROW(Errc::parse, fmt::format("{}: recompute needs 'from <layer>'", field.path()));
        row[static_cast<std::size_t>(c)] = d;
      }
      p.retention.push_back(row);
      LayerChunks lc;
      std::uint64_t prev = 0;
      for (std::size_t i = 0; i < layer["attention_chunk_ends"].size(); ++i) {
        const auto e = layer["attention_chunk_ends"][i].as_uint64();
        if (e <= prev) OOM_THROW(Errc::parse, fmt::format("{}: chunk ends must increase", layer["attention_chunk_ends"].path()));
        lc.attention.push_back(prev = e);
      }
      // Empty: the layer has no attention chunks (a LayerStackPlanner's plans write none); the
      // Planner's step graph refuses that for a model's layers (check_plan).
      if (!lc.attention.empty() && lc.attention.back() != p.workload.seq_len)
        OOM_THROW(Errc::parse, fmt::format("{}: the last chunk must end at seq_len {}", layer["attention_chunk_ends"].path(), p.workload.seq_len));
      lc.moe_tokens = layer["moe_chunk_tokens"].as_uint64();
      if (lc.moe_tokens == 0) OOM_THROW(Errc::parse, fmt::format("{}: must be > 0", layer["moe_chunk_tokens"].path()));
      p.chunks.push_back(std::move(lc));
    }
    p.loss_rows = j["loss_chunk_rows"].as_uint64();
    if (p.loss_rows == 0) OOM_THROW(Errc::parse, "loss_chunk_rows must be > 0");
    p.predicted.step_s = j["predicted"]["step_s"].as_double();
    p.predicted.gpu_peak = Bytes{j["predicted"]["gpu_peak_bytes"].as_uint64()};
    p.predicted.host_peak = Bytes{j["predicted"]["host_peak_bytes"].as_uint64()};
    // Optional (a hand-written plan may leave them out): busy seconds by resource, bytes by claimant.
    const auto pred = j["predicted"];
    refuse_unknown_keys(pred, {"step_s", "busy_s", "gpu_peak_bytes", "host_peak_bytes", "gpu_at_peak_bytes", "peak_bytes"},
                        "the plan's prediction");
    if (pred["busy_s"].present()) refuse_unknown_keys(pred["busy_s"], names_of<Resource>(resource_count), "the prediction's busy_s");
    for (const char* key : {"gpu_at_peak_bytes", "peak_bytes"})
      if (pred[key].present()) refuse_unknown_keys(pred[key], names_of<Claimant>(claimant_count), fmt::format("the prediction's {}", key));
    if (pred["busy_s"].present())
      for (int r = 0; r < resource_count; ++r)
        if (const auto v = pred["busy_s"][to_string(static_cast<Resource>(r))]; v.present())
          p.predicted.busy.seconds[static_cast<std::size_t>(r)] = v.as_double();
    for (const auto& [key, into] : {std::pair{"gpu_at_peak_bytes", &p.predicted.gpu_at_peak}, std::pair{"peak_bytes", &p.predicted.peak}})
      if (pred[key].present())
        for (int c = 0; c < claimant_count; ++c)
          if (const auto v = pred[key][to_string(static_cast<Claimant>(c))]; v.present())
            (*into)[static_cast<std::size_t>(c)] = Bytes{v.as_uint64()};
    return p;
  } catch (const Error& e) {  // one line, the file first, as the profile reader's
    throw Error(e.code(), fmt::format("plan {}: {}", source, e.message()));
  } catch (const std::exception& e) {
    throw Error(Errc::parse, fmt::format("plan {}: {}", source, e.what()));
  }
}

}  // namespace oom

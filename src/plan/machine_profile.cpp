// MachineProfile: SizeCurve interpolation, strict JSON reading and writing, validation, and the
// built-in profiles (H200, H100 80GB SXM, RTX 4090 24GB) with the provenance of every constant.
#include "oom/plan/machine_profile.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"

namespace oom {

// ---------------------------------------------------------------------------------------------
// SizeCurve

SizeCurve::SizeCurve(std::vector<std::pair<double, double>> samples) : samples_(std::move(samples)) {
  if (samples_.empty()) OOM_THROW(Errc::invalid_argument, "a size curve needs at least one (size, rate) sample");
  for (std::size_t i = 0; i < samples_.size(); ++i) {
    const auto [size, rate] = samples_[i];
    if (!(std::isfinite(size) && size > 0))
      OOM_THROW(Errc::invalid_argument, fmt::format("sample {}: size must be > 0 and finite, got {}", i, size));
    if (!(std::isfinite(rate) && rate > 0))
      OOM_THROW(Errc::invalid_argument, fmt::format("sample {}: rate must be > 0 and finite, got {}", i, rate));
    if (i > 0 && !(size > samples_[i - 1].first))
      OOM_THROW(Errc::invalid_argument,
                fmt::format("sample {}: size {} is not above the previous size {} (samples must be sorted by "
                            "size, without duplicates)",
                            i, size, samples_[i - 1].first));
  }
  // The envelope: a larger problem can run as several smaller ones, so its rate is at least theirs.
  // Measured dips (a cuBLAS heuristic picking a poor kernel at one size) must not make the planner
  // prefer splitting work for no physical reason.
  for (std::size_t i = 1; i < samples_.size(); ++i)
    samples_[i].second = std::max(samples_[i].second, samples_[i - 1].second);
}

double SizeCurve::at(double size) const {
  if (samples_.empty()) OOM_THROW(Errc::invalid_argument, "SizeCurve::at on an empty curve");
  if (!(std::isfinite(size) && size > 0))
    OOM_THROW(Errc::invalid_argument, fmt::format("SizeCurve::at: size must be > 0 and finite, got {}", size));
  const auto& [x0, r0] = samples_.front();
  // Below the measured range the work is latency-bound: a fixed time per call, so the rate falls
  // in proportion to the size (never extrapolate a log-log slope that was fitted elsewhere).
  if (size <= x0) return r0 * (size / x0);
  if (size >= samples_.back().first) return samples_.back().second;  // saturated: no growth beyond data
  const auto hi = std::upper_bound(samples_.begin(), samples_.end(), size,
                                   [](double s, const std::pair<double, double>& p) { return s < p.first; });
  const auto lo = hi - 1;
  const double t = (std::log(size) - std::log(lo->first)) / (std::log(hi->first) - std::log(lo->first));
  const double r = std::exp(std::log(lo->second) + t * (std::log(hi->second) - std::log(lo->second)));
  // exp(log(.)) can land an ulp outside its endpoints; clamping keeps at() exactly monotone.
  return std::clamp(r, lo->second, hi->second);
}

// ---------------------------------------------------------------------------------------------
// The fields, in JSON order. One table drives writing, reading, validation and the provenance check,
// so a field cannot be added to one and forgotten in another.

namespace {

enum class Rule : unsigned char {
  positive,    ///< > 0
  collective,  ///< > 0 with several GPUs; >= 0 with one (there is no collective to measure)
  optional,    ///< >= 0, 0 (or absent from the file) meaning not measured; provenance only when > 0
};

struct RateField {
  const char* name;
  double MachineProfile::*member;
  Rule rule;
};

constexpr RateField kRates[] = {
    {"h2d_bytes_per_s", &MachineProfile::h2d_bytes_per_s, Rule::positive},
    {"d2h_bytes_per_s", &MachineProfile::d2h_bytes_per_s, Rule::positive},
    {"bidir_bytes_per_s", &MachineProfile::bidir_bytes_per_s, Rule::positive},
    {"pageable_h2d_bytes_per_s", &MachineProfile::pageable_h2d_bytes_per_s, Rule::positive},
    {"host_link_total_bytes_per_s", &MachineProfile::host_link_total_bytes_per_s, Rule::positive},
    {"hbm_bytes_per_s", &MachineProfile::hbm_bytes_per_s, Rule::positive},
    {"launch_overhead_s", &MachineProfile::launch_overhead_s, Rule::positive},
    {"cpu_adamw_params_per_s", &MachineProfile::cpu_adamw_params_per_s, Rule::positive},
    {"cpu_adamw_bf16_moments_params_per_s", &MachineProfile::cpu_adamw_bf16_moments_params_per_s, Rule::optional},
    {"host_copy_bytes_per_s", &MachineProfile::host_copy_bytes_per_s, Rule::positive},
    {"all_to_all_bytes_per_s", &MachineProfile::all_to_all_bytes_per_s, Rule::collective},
    {"all_reduce_bytes_per_s", &MachineProfile::all_reduce_bytes_per_s, Rule::collective},
    {"gated_delta_forward_updates_per_s", &MachineProfile::gated_delta_forward_updates_per_s, Rule::optional},
    {"gated_delta_backward_updates_per_s", &MachineProfile::gated_delta_backward_updates_per_s, Rule::optional},
};

struct BytesField {
  const char* name;
  Bytes MachineProfile::*member;
};
constexpr BytesField kSizes[] = {
    {"gpu_memory", &MachineProfile::gpu_memory},
    {"host_memory", &MachineProfile::host_memory},
};

struct CurveField {
  const char* name;
  SizeCurve MachineProfile::*member;
  bool optional = false;  ///< may be empty (absent from the file): not measured; provenance only when set
};
constexpr CurveField kCurves[] = {
    {"gemm_flops", &MachineProfile::gemm_flops},
    {"attention_forward_flops", &MachineProfile::attention_forward_flops},
    {"attention_backward_flops", &MachineProfile::attention_backward_flops},
    {"attention_forward_flops_d256", &MachineProfile::attention_forward_flops_d256, true},
    {"attention_backward_flops_d256", &MachineProfile::attention_backward_flops_d256, true},
    {"gated_delta_forward_parallel", &MachineProfile::gated_delta_forward_parallel, true},
    {"gated_delta_backward_parallel", &MachineProfile::gated_delta_backward_parallel, true},
};
/// The single forward + backward attention curve of profiles written before the two were split
/// (read as both; see MachineProfile::attention_forward_flops).
constexpr const char* kLegacyAttention = "attention_flops";

/// Every field that must carry provenance: all measured or assumed constants (name and gpus are
/// what the profile describes, not constants about it).
std::vector<std::string> constant_fields() {
  std::vector<std::string> names;
  for (const auto& f : kSizes) names.emplace_back(f.name);
  for (const auto& f : kRates) names.emplace_back(f.name);
  for (const auto& f : kCurves) names.emplace_back(f.name);
  return names;
}

[[noreturn]] void bad(std::string_view source, std::string_view field, const std::string& what) {
  OOM_THROW(Errc::invalid_argument, fmt::format("profile {}: field {} {}", source, field, what));
}

/// ISO 8601 calendar date, full or reduced precision: YYYY, YYYY-MM or YYYY-MM-DD (a datasheet is
/// often dated only by its year).
bool is_iso_date(std::string_view d) {
  auto digits = [&](std::size_t from, std::size_t n) {
    for (std::size_t i = from; i < from + n; ++i)
      if (!std::isdigit(static_cast<unsigned char>(d[i]))) return false;
    return true;
  };
  if (d.size() != 4 && d.size() != 7 && d.size() != 10) return false;
  if (!digits(0, 4)) return false;
  if (d.size() >= 7) {
    if (d[4] != '-' || !digits(5, 2)) return false;
    const int month = (d[5] - '0') * 10 + (d[6] - '0');
    if (month < 1 || month > 12) return false;
  }
  if (d.size() == 10) {
    if (d[7] != '-' || !digits(8, 2)) return false;
    const int day = (d[8] - '0') * 10 + (d[9] - '0');
    if (day < 1 || day > 31) return false;
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Validation

void MachineProfile::validate(std::string_view source) const {
  if (name.empty()) bad(source, "name", "must not be empty");
  if (gpus < 1) bad(source, "gpus", fmt::format("must be >= 1, got {}", gpus));
  for (const auto& f : kSizes)
    if ((this->*f.member).count() == 0) bad(source, f.name, "must be > 0, got 0");
  for (const auto& f : kRates) {
    const double v = this->*f.member;
    if (!std::isfinite(v)) bad(source, f.name, fmt::format("must be finite, got {}", v));
    if (f.rule == Rule::optional) {
      if (v < 0) bad(source, f.name, fmt::format("must be >= 0 (0: not measured), got {}", v));
    } else if (f.rule == Rule::positive || gpus > 1) {
      if (!(v > 0))
        bad(source, f.name,
            f.rule == Rule::positive ? fmt::format("must be > 0, got {}", v)
                                     : fmt::format("must be > 0 with {} GPUs, got {}", gpus, v));
    } else if (v < 0) {
      bad(source, f.name, fmt::format("must be >= 0, got {}", v));
    }
  }
  for (const auto& f : kCurves) {
    const SizeCurve& c = this->*f.member;
    if (c.empty() && f.optional) continue;  // not measured
    if (c.empty()) bad(source, f.name, "must have at least one [size, rate] sample");
    // A curve built by SizeCurve's constructor is already valid; this guards one assembled by hand
    // from a default-constructed profile and then compared or written.
    try {
      (void)SizeCurve(c.samples());
    } catch (const Error& e) {
      bad(source, f.name, e.message());
    }
  }
  // Head dim 256's two curves go together: with one, the cost model would price that head dim's
  // forward and backward from different kernels' measurements.
  if (attention_forward_flops_d256.empty() != attention_backward_flops_d256.empty())
    bad(source, attention_forward_flops_d256.empty() ? "attention_forward_flops_d256" : "attention_backward_flops_d256",
        "is missing while attention_" + std::string(attention_forward_flops_d256.empty() ? "backward" : "forward") +
            "_flops_d256 is given (give both head-dim-256 curves or neither)");
  for (const std::string& field : constant_fields()) {
    const auto optional = std::find_if(std::begin(kRates), std::end(kRates), [&](const RateField& f) {
      return f.name == field && f.rule == Rule::optional;
    });
    if (optional != std::end(kRates) && this->*optional->member == 0) continue;  // not measured: nothing to explain
    const auto curve = std::find_if(std::begin(kCurves), std::end(kCurves),
                                    [&](const CurveField& f) { return f.name == field && f.optional; });
    if (curve != std::end(kCurves) && (this->*curve->member).empty()) continue;
    const auto it = provenance.find(field);
    if (it == provenance.end()) bad(source, field, "has no provenance entry (where did the value come from?)");
    const Provenance& p = it->second;
    if (p.source.empty()) bad(source, field, "has a provenance entry with an empty source");
    if (p.machine.empty()) bad(source, field, "has a provenance entry with an empty machine");
    if (!is_iso_date(p.date))
      bad(source, field,
          fmt::format("has a provenance date \"{}\" that is not an ISO date (YYYY-MM-DD, YYYY-MM or YYYY)", p.date));
  }
  // Provenance for a field that does not exist is a typo that would leave the real field unexplained.
  const auto known = constant_fields();
  for (const auto& [field, p] : provenance)
    if (std::find(known.begin(), known.end(), field) == known.end())
      bad(source, fmt::format("provenance.{}", field), "names no field of a machine profile");
}

// ---------------------------------------------------------------------------------------------
// JSON

Json MachineProfile::to_json() const {
  Json j = Json::object();
  j.set("name", name);
  j.set("gpus", gpus);
  for (const auto& f : kSizes) j.set(f.name, static_cast<unsigned long long>((this->*f.member).count()));
  for (const auto& f : kRates) j.set(f.name, this->*f.member);
  for (const auto& f : kCurves) {
    if (f.optional && (this->*f.member).empty()) continue;  // not measured: absent, as in files from before the field
    Json arr = Json::array();
    for (const auto& [size, rate] : (this->*f.member).samples()) arr.push_back(Json(Json::Array{Json(size), Json(rate)}));
    j.set(f.name, std::move(arr));
  }
  Json prov = Json::object();
  for (const auto& [field, p] : provenance) {
    Json entry = Json::object();
    entry.set("source", p.source);
    entry.set("machine", p.machine);
    entry.set("date", p.date);
    prov.set(field, std::move(entry));
  }
  j.set("provenance", std::move(prov));
  return j;
}

MachineProfile MachineProfile::from_json(const Json& j, std::string_view source) {
  if (!j.is_object())
    OOM_THROW(Errc::parse, fmt::format("profile {}: expected a JSON object, got {}", source, to_string(j.type())));
  const JsonCursor root(j);
  MachineProfile p;
  // Reads `field` with the cursor's typed accessor; its "missing required field" / "expected number"
  // messages get the profile and field named the same way validate() names them.
  auto read = [&](std::string_view field, auto&& get) {
    const JsonCursor c = root[field];
    if (!c.present()) OOM_THROW(Errc::parse, fmt::format("profile {}: field {} is missing", source, field));
    try {
      return get(c);
    } catch (const Error& e) {
      OOM_THROW(Errc::parse, fmt::format("profile {}: field {}", source, e.message()));
    }
  };

  p.name = read("name", [](const JsonCursor& c) { return c.as_string(); });
  const std::int64_t gpus = read("gpus", [](const JsonCursor& c) { return c.as_int64(); });
  if (gpus < 1 || gpus > 1024) bad(source, "gpus", fmt::format("must be in [1, 1024], got {}", gpus));
  p.gpus = static_cast<int>(gpus);
  for (const auto& f : kSizes) {
    // Byte counts are integers in the file: "139 GiB" as a double would not round-trip exactly.
    const JsonCursor c = root[f.name];
    if (c.present() && c.value().is_number() && !c.value().is_integer())
      bad(source, f.name, fmt::format("must be an integer byte count, got {}", c.value().dump()));
    if (c.present() && c.value().is_integer() && c.value().as_double() < 0)
      bad(source, f.name, fmt::format("must be > 0, got {}", c.value().dump()));
    p.*f.member = Bytes{read(f.name, [](const JsonCursor& c) { return c.as_uint64(); })};
  }
  for (const auto& f : kRates) {
    if (f.rule == Rule::optional && !root[f.name].present()) continue;  // a profile from before the field: 0
    p.*f.member = read(f.name, [](const JsonCursor& c) { return c.as_double(); });
  }
  // A profile from before the attention curve was split: its one curve serves both passes.
  const bool legacy_attention = root[kLegacyAttention].present() && !root["attention_forward_flops"].present() &&
                                !root["attention_backward_flops"].present();
  for (const auto& f : kCurves) {
    if (f.optional && !root[f.name].present()) continue;  // a profile from before the field: not measured
    const bool split_pair = std::string_view(f.name) == "attention_forward_flops" || std::string_view(f.name) == "attention_backward_flops";
    const std::string_view name = legacy_attention && split_pair ? kLegacyAttention : f.name;
    const auto samples = read(name, [](const JsonCursor& c) {
      (void)c.as_array();  // an object would otherwise pass as a list of members
      std::vector<std::pair<double, double>> s;
      for (std::size_t i = 0; i < c.size(); ++i) {
        const JsonCursor pair = c[i];
        if (pair.size() != 2 || !pair.value().is_array())
          OOM_THROW(Errc::parse, fmt::format("{}: expected a [size, rate] pair", pair.path()));
        s.emplace_back(pair[std::size_t{0}].as_double(), pair[std::size_t{1}].as_double());
      }
      return s;
    });
    try {
      p.*f.member = SizeCurve(samples);
    } catch (const Error& e) {
      bad(source, name, e.message());
    }
  }
  const JsonCursor prov = root["provenance"];
  if (!prov.present()) OOM_THROW(Errc::parse, fmt::format("profile {}: field provenance is missing", source));
  try {
    for (const auto& [field, entry] : prov.as_object()) {
      const JsonCursor e = prov[field];
      (void)e.as_object();
      for (const auto& [key, v] : entry.as_object())
        if (key != "source" && key != "machine" && key != "date")
          OOM_THROW(Errc::parse, fmt::format("{}.{}: unknown key (expected source, machine, date)", e.path(), key));
      const Provenance pv{e["source"].as_string(), e["machine"].as_string(), e["date"].as_string()};
      if (legacy_attention && field == kLegacyAttention) {
        Provenance both = pv;
        both.source += " (one forward + backward curve, read as the rate of each pass)";
        p.provenance["attention_forward_flops"] = both;
        p.provenance["attention_backward_flops"] = both;
      } else {
        p.provenance[field] = pv;
      }
    }
  } catch (const Error& e) {
    OOM_THROW(Errc::parse, fmt::format("profile {}: field {}", source, e.message()));
  }

  // A misspelt field ("h2d_bytes_per_sec") would otherwise be ignored while the real one is missing;
  // reject unknown names so the message points at the typo.
  for (const auto& [key, v] : j.as_object()) {
    const auto known = constant_fields();
    if (key != "name" && key != "gpus" && key != "provenance" && !(legacy_attention && key == kLegacyAttention) &&
        std::find(known.begin(), known.end(), key) == known.end())
      OOM_THROW(Errc::parse, fmt::format("profile {}: field {} is not a machine profile field", source, key));
  }
  p.validate(source);
  return p;
}

MachineProfile MachineProfile::from_file(const std::filesystem::path& path) {
  return from_json(read_json_file(path), path.string());
}

// ---------------------------------------------------------------------------------------------
// Built-in profiles

namespace {

constexpr double kGB = 1e9;
constexpr double kTFLOP = 1e12;

// --- Measured on our H200 machine, 2026-11-30 (docs/MISSION.md, "The machines we measure on"). ---
constexpr const char* kH200Machine = "1x NVIDIA H200 (132 SMs), 16-core Xeon (Sapphire Rapids)";
constexpr const char* kH200Date = "2026-11-30";
constexpr const char* kH200AttentionDate = "2026-12-03";  // the attention curves (h200_attention)
constexpr const char* kH200AttentionD256Date = "2026-12-04";  // their head-dim-256 pair
constexpr double kH200H2d = 55.3 * kGB, kH200D2h = 55.3 * kGB, kH200Bidir = 101.3 * kGB, kH200Pageable = 6.9 * kGB;
constexpr double kH200GemmPeakMeasured = 799 * kTFLOP;   // cuBLAS bf16 GEMM 8192^3
constexpr double kH200HostCopy = 87 * kGB;               // memcpy, read + write counted
constexpr double kH200HostTriad = 126 * kGB;             // a + b -> b, 16 threads
constexpr double kH200Hbm = 4.3e12;                      // KINDS.md device-to-device copy, read + write
constexpr double kH200HbmDatasheet = 4.8e12;             // NVIDIA H200 datasheet
// cudaMemGetInfo total on the H200 reads 143771 MiB (KINDS.md, nvidia-smi); ~139 GiB is usable after
// the context and library workspaces, so ~1.4 GiB goes to them. The same allowance is taken off the
// other GPUs' capacity (it is mostly the CUDA context and cuBLAS/NCCL workspaces, not per-chip).
constexpr std::uint64_t kContextOverheadMiB = 143771 - 139 * 1024;

// Dense bf16 tensor throughput with fp32 accumulate, from the vendors' documents. The H100 SXM and
// H200 datasheets list 1,979 TFLOP/s "with sparsity"; dense is half.
constexpr double kH200Bf16Peak = 989.4 * kTFLOP;
constexpr double kH100Bf16Peak = 989.4 * kTFLOP;
constexpr double kAda4090Bf16Fp32AccPeak = 165.2 * kTFLOP;

// NCCL over NVLink 4 without NVLink SHARP (we never enable NVLS): 450 GB/s line rate per direction,
// ~370 GB/s effective after protocol overhead, seen as busBw of ring all-reduce and of other
// collectives (NCCL maintainer, NVIDIA/nccl-tests issue 212, 2024-05-06).
constexpr double kNvlink4NcclBusBw = 370 * kGB;

// CPU AdamW bytes per parameter: fp32 master, m and v read and written (24), the gradient read and
// the bf16 weight written (~6): ~30 bytes (MISSION.md's floor uses the same figure).
constexpr double kAdamwBytesPerParam = 30;
// Assumed fraction of a bandwidth bound a well-vectorised streaming loop reaches, until measured.
constexpr double kAssumedStreamEfficiency = 0.7;

Provenance prov(std::string source, std::string machine, std::string date) {
  return Provenance{std::move(source), std::move(machine), std::move(date)};
}

/// bf16 GEMM FLOP/s by m at n = k = 2048: min(compute cap, arithmetic intensity x memory bandwidth).
/// A roofline is an upper bound; it stands in until oom-calibrate measures the real curve.
SizeCurve gemm_roofline(double cap_flops, double mem_bytes_per_s) {
  constexpr double n = 2048, k = 2048;
  std::vector<std::pair<double, double>> s;
  for (double m : {16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0}) {
    const double flops = 2 * m * n * k;
    const double bytes = 2 * (m * k + k * n + m * n);  // bf16 A, B read and C written once
    s.emplace_back(m, std::min(cap_flops, flops / (bytes / mem_bytes_per_s)));
  }
  return SizeCurve(std::move(s));
}

/// OOM's own flash attention (mma.sync, deterministic backward) on our H200, causal GQA 16q/4kv
/// heads, head dim 128, batch 1, each pass timed alone (oom-calibrate's measure_flash_attention),
/// scaled by `scale`: what the planner must predict OOM's steps with.
struct AttentionCurves {
  SizeCurve forward, backward;  ///< head dim 128
  SizeCurve forward_d256, backward_d256;
};
AttentionCurves h200_attention(double scale) {
  // oom-calibrate on our 1x H200, 2026-12-03, twenty-ninth session (examples/profiles/h200-2026-12-03.json):
  // the wgmma kernels as they are since the twenty-second session (the forward with 128-byte
  // swizzled tiles, 1.5-1.64x the seventh session's curve; the backward without recomputed
  // products, 1.0-1.1x). The seventh session's curves (examples/profiles/h200-2026-11-30e.json)
  // predicted the 5.13B model's 128K step 1.15x and its 256K step 1.20x too long. The curve is
  // non-decreasing by construction (oom-calibrate), so 32K-128K read the 16K forward (568-564
  // measured there). PyTorch SDPA forward + backward on the same shapes, 2026-11-30: 263 (4K),
  // 576 (16K), 564 (32K), 549 (128K) TFLOP/s.
  return {SizeCurve({{4096, 387.6 * kTFLOP * scale},
                     {8192, 461.8 * kTFLOP * scale},
                     {16384, 572.0 * kTFLOP * scale},
                     {32768, 572.0 * kTFLOP * scale},
                     {65536, 572.0 * kTFLOP * scale},
                     {131072, 572.0 * kTFLOP * scale}}),
          SizeCurve({{4096, 300.5 * kTFLOP * scale},
                     {8192, 373.9 * kTFLOP * scale},
                     {16384, 423.4 * kTFLOP * scale},
                     {32768, 423.4 * kTFLOP * scale},
                     {65536, 424.0 * kTFLOP * scale},
                     {131072, 428.9 * kTFLOP * scale}}),
          // Head dim 256, causal GQA 16q/2kv (Qwen3-Next's full attention), oom-calibrate on our 1x H200,
          // 2026-12-04, thirty-ninth session (examples/profiles/h200-2026-12-04.json; non-decreasing,
          // so the forward from 32K reads 16K's 610.2 (573-584 measured there) and the backward from
          // 16K reads 8K's 367.5 (345-359 measured there)). With them the 2-layer Qwen3-Next
          // slice's attention backward at 256K came out 1.03x its prediction, against 1.21x with the
          // head-dim-128 curves.
          SizeCurve({{4096, 401.9 * kTFLOP * scale},
                     {8192, 526.4 * kTFLOP * scale},
                     {16384, 610.2 * kTFLOP * scale},
                     {32768, 610.2 * kTFLOP * scale},
                     {65536, 610.2 * kTFLOP * scale},
                     {131072, 610.2 * kTFLOP * scale}}),
          SizeCurve({{4096, 290.2 * kTFLOP * scale},
                     {8192, 367.5 * kTFLOP * scale},
                     {16384, 367.5 * kTFLOP * scale},
                     {32768, 367.5 * kTFLOP * scale},
                     {65536, 367.5 * kTFLOP * scale},
                     {131072, 367.5 * kTFLOP * scale}})};
}

/// An estimate's provenance for the head-dim-256 curves: the same scaling of the H200's.
Provenance est_d256(Provenance p) {
  p.source += "; these: the H200's head-dim-256 curves (16q/2kv heads, " + std::string(kH200AttentionD256Date) + "), scaled the same";
  return p;
}

/// The four curves with their provenance: forward then backward, head dim 128 then 256.
void set_attention(MachineProfile& p, const AttentionCurves& c, const std::array<Provenance, 4>& how) {
  p.attention_forward_flops = c.forward;
  p.attention_backward_flops = c.backward;
  p.attention_forward_flops_d256 = c.forward_d256;
  p.attention_backward_flops_d256 = c.backward_d256;
  p.provenance["attention_forward_flops"] = how[0];
  p.provenance["attention_backward_flops"] = how[1];
  p.provenance["attention_forward_flops_d256"] = how[2];
  p.provenance["attention_backward_flops_d256"] = how[3];
}

void check_gpus(std::string_view profile, int gpus) {
  // One node: the built-ins describe boards of at most 8 GPUs (HGX/DGX, or a 4-8 slot workstation).
  if (gpus < 1 || gpus > 8)
    OOM_THROW(Errc::invalid_argument,
              fmt::format("built-in profile {}: gpus must be in [1, 8] (one node), got {}", profile, gpus));
}

std::string node(int gpus, std::string_view what) { return fmt::format("{}x {}", gpus, what); }

}  // namespace

/// OOM's gated delta rule measured on our H200 at the Qwen3-Next-80B linear layer's shape (1 x 4096
/// tokens, 16 key / 32 value heads of 128, states every 64 tokens) as `automatic` takes it: on a
/// GPU with clusters (`clusters`: Hopper, whose shared memory the chunked kernels need) the chunked
/// form, forward 1.95 ms, backward 5.93 ms (forty-first session); else the recurrent one, 3.69 ms,
/// and 22.7 ms one block per head; times `scale` for another GPU, `estimate` saying why (empty: ours).
/// By sequences side by side, with clusters, the forward is the chunked form's up to two sequences
/// and the recurrent one's from four, the backward the chunked form's throughout.
void set_gated_delta(MachineProfile& p, double scale, bool clusters, const std::string& estimate, const std::string& machine) {
  constexpr double updates = 4096.0 * 32 * 128 * 128;
  const double forward_ms = clusters ? 1.95 : 3.69, backward_ms = clusters ? 5.93 : 22.7;
  const std::string what =
      "OOM's gated delta rule (kernels/gated_delta.hpp), the {} timed alone at 1 x 4096 tokens, 16/32 heads of 128, chunk 64: "
      "{} ms for 4096 x 32 x 128 x 128 state updates (bench_gated_delta and test_gated_delta_kernels' timing case, "
      "docs/performance.md: the recurrent forward 3.69 ms and one-block backward 22.7 ms in the thirty-seventh session, the "
      "chunked forward 1.95 ms and backward 5.93 ms in the forty-first, 2026-12-04)";
  p.gated_delta_forward_updates_per_s = scale * updates / (forward_ms * 1e-3);
  p.gated_delta_backward_updates_per_s = scale * updates / (backward_ms * 1e-3);
  const std::string prefix = estimate.empty() ? "" : "ESTIMATE: " + estimate + ", from ";
  p.provenance["gated_delta_forward_updates_per_s"] =
      prov(prefix + fmt::format(fmt::runtime(what), clusters ? "chunked forward" : "recurrent forward", forward_ms), machine, estimate.empty() ? "2026-12-04" : "2023");
  p.provenance["gated_delta_backward_updates_per_s"] = prov(
      prefix + fmt::format(fmt::runtime(what), clusters ? "chunked backward" : "recurrent backward (one block a head, no clusters)",
                           backward_ms),
      machine, estimate.empty() ? "2026-12-04" : "2023");
  // By recurrences side by side: 1, 2, 4 and 8 sequences of the same 32 heads (bench_gated_delta),
  // the first point the scalars above, the rest the form `automatic` takes (forty-first session):
  // with clusters the forward's chunked form at 2 sequences (two waves of its blocks) and its
  // recurrent one from 4, the backward's chunked form throughout; without, the recurrent form
  // throughout (thirty-seventh session), its backward one block a head.
  const double chunked_forward_at[] = {forward_ms, 3.888, 4.943, 9.858}, chunked_backward_at[] = {backward_ms, 11.868, 23.617, 46.975};
  const double recurrent_forward_at[] = {forward_ms, 3.989, 4.929, 9.802}, recurrent_backward_at[] = {backward_ms, 23.952, 27.580, 55.369};
  const double* forward_at = clusters ? chunked_forward_at : recurrent_forward_at;
  const double* backward_at = clusters ? chunked_backward_at : recurrent_backward_at;
  std::vector<std::pair<double, double>> forward, backward;
  for (int i = 0; i < 4; ++i) {
    const double sequences = static_cast<double>(1 << i);
    forward.emplace_back(32 * sequences, scale * sequences * updates / (forward_at[i] * 1e-3));
    backward.emplace_back(32 * sequences, scale * sequences * updates / (backward_at[i] * 1e-3));
  }
  p.gated_delta_forward_parallel = SizeCurve(forward);
  p.gated_delta_backward_parallel = SizeCurve(backward);
  const std::string curve =
      "OOM's gated delta rule's {} by recurrences side by side (sequences x value heads): 1, 2, 4, 8 sequences of "
      "4096 tokens, 16/32 heads of 128 (bench_gated_delta, docs/performance.md, thirty-seventh and forty-first sessions: {} ms, "
      "2026-12-04)";
  p.provenance["gated_delta_forward_parallel"] =
      prov(prefix + fmt::format(fmt::runtime(curve), "forward",
                                fmt::format("{}, {}, {}, {}", forward_at[0], forward_at[1], forward_at[2], forward_at[3])),
           machine, estimate.empty() ? "2026-12-04" : "2023");
  p.provenance["gated_delta_backward_parallel"] = prov(
      prefix + fmt::format(fmt::runtime(curve), "backward",
                           fmt::format("{}, {}, {}, {}", backward_at[0], backward_at[1], backward_at[2], backward_at[3])),
      machine,
      estimate.empty() ? "2026-12-04" : "2023");
}

MachineProfile MachineProfile::h200(int gpus) {
  check_gpus("h200", gpus);
  MachineProfile p;
  p.name = "h200";
  p.gpus = gpus;
  const std::string machine = gpus == 1 ? std::string(kH200Machine) : node(gpus, "NVIDIA H200 (NVLink 4)");
  const std::string mission = "docs/MISSION.md, 'The machines we measure on'";
  const std::string kCalibrated = "oom-calibrate 2026-11-30, examples/profiles/h200-2026-11-30.json";

  p.gpu_memory = Bytes{139ull << 30};
  p.provenance["gpu_memory"] =
      prov("~139 GiB usable per GPU after the CUDA context (" + mission + "); 143771 MiB total", kH200Machine, kH200Date);

  // Host RAM usable to a process on our lent machines: 125 GiB (1 GPU) and 251 GiB (2 GPUs) measured;
  // the 4- and 8-GPU kinds have 512 and 560 GiB limits (KINDS.md), taken at the same 251/256 share.
  std::uint64_t host_gib = 0;
  std::string host_src;
  if (gpus == 1) {
    host_gib = 125;
    host_src = "125 GiB usable host RAM on the 1-GPU machine (" + mission + ")";
  } else if (gpus == 2) {
    host_gib = 251;
    host_src = "251 GiB host RAM on the 2-GPU machine (" + mission + ", 2xH200 runs)";
  } else {
    const std::uint64_t limit = gpus <= 4 ? 512 : 560;
    host_gib = limit * 251 / 256;
    host_src = fmt::format("estimate: the {}-GPU kind's {} GiB memory limit (device KINDS.md, 2026-10-29) x 251/256, "
                           "the usable share measured on the 2-GPU machine",
                           gpus <= 4 ? 4 : 8, limit);
  }
  p.host_memory = Bytes{host_gib << 30};
  p.provenance["host_memory"] = prov(host_src, machine, kH200Date);

  const std::string gpu_check = "oom gpu-check: measure_copy_bandwidth pinned 256 MiB x 8 (" + mission + ")";
  p.h2d_bytes_per_s = kH200H2d;
  p.d2h_bytes_per_s = kH200D2h;
  p.bidir_bytes_per_s = kH200Bidir;
  p.pageable_h2d_bytes_per_s = kH200Pageable;
  p.provenance["h2d_bytes_per_s"] = prov(gpu_check, kH200Machine, kH200Date);
  p.provenance["d2h_bytes_per_s"] = prov(gpu_check, kH200Machine, kH200Date);
  p.provenance["bidir_bytes_per_s"] = prov(gpu_check + ", both directions at once", kH200Machine, kH200Date);
  p.provenance["pageable_h2d_bytes_per_s"] = prov(gpu_check + ", pageable source", kH200Machine, kH200Date);
  if (gpus == 1) {
    p.host_link_total_bytes_per_s = kH200Bidir;
    p.provenance["host_link_total_bytes_per_s"] =
        prov("one GPU: its measured bidirectional pinned rate (" + gpu_check + ")", kH200Machine, kH200Date);
  } else {
    p.host_link_total_bytes_per_s = std::min(gpus * kH200Bidir, kH200HostTriad);
    p.provenance["host_link_total_bytes_per_s"] = prov(
        fmt::format("estimate: min({} GPUs x 101.3 GB/s bidirectional, 126 GB/s host a+b->b measured with 16 threads on "
                    "the 1-GPU machine); the multi-GPU host's memory system is not measured yet",
                    gpus),
        machine, kH200Date);
  }

  p.hbm_bytes_per_s = kH200Hbm;
  p.provenance["hbm_bytes_per_s"] =
      prov("device-to-device copy through PyTorch, 8.6 GB in 2.0 ms, bytes read + written (device KINDS.md)",
           "1x NVIDIA H200 (lent nvidia-h200 kind)", "2026-11-04");

  // Measured by m at n = k = 2048 (the 65536 point, 713.7, sits under the envelope's 775.0).
  p.gemm_flops = SizeCurve({{16, 17.57e12}, {64, 71.36e12}, {256, 270.2e12}, {1024, 609.2e12}, {4096, 733.4e12},
                            {16384, 775.0e12}, {65536, 713.7e12}});
  p.provenance["gemm_flops"] = prov(kCalibrated + ": cuBLAS bf16 GEMM (fp32 accumulate) by m at n = k = 2048", kH200Machine,
                                    kH200Date);

  {
    const std::string what =
        "OOM's flash attention, causal GQA 16q/4kv heads, head dim 128, batch 1, the {} timed alone ({}x the causal "
        "forward FLOPs; oom-calibrate measure_flash_attention; the Hopper wgmma kernels, forward + backward "
        "0.88-1.55x PyTorch SDPA, docs/hopper.md; examples/profiles/h200-2026-12-03.json)";
    const std::string what_d256 =
        "OOM's flash attention, causal GQA 16q/2kv heads, head dim 256, batch 1, the {} timed alone ({}x the causal "
        "forward FLOPs; oom-calibrate measure_flash_attention; examples/profiles/h200-2026-12-04.json)";
    set_attention(p, h200_attention(1.0),
                  {prov(fmt::format(fmt::runtime(what), "forward", 1), kH200Machine, kH200AttentionDate),
                   prov(fmt::format(fmt::runtime(what), "backward", 2.5), kH200Machine, kH200AttentionDate),
                   prov(fmt::format(fmt::runtime(what_d256), "forward", 1), kH200Machine, kH200AttentionD256Date),
                   prov(fmt::format(fmt::runtime(what_d256), "backward", 2.5), kH200Machine, kH200AttentionD256Date)});
  }

  p.launch_overhead_s = 3.44e-6;
  p.provenance["launch_overhead_s"] = prov(kCalibrated + ": empty kernel launch, median", kH200Machine, kH200Date);

  set_gated_delta(p, 1.0, true, "", kH200Machine);

  p.cpu_adamw_params_per_s = 4.82e9;
  p.provenance["cpu_adamw_params_per_s"] = prov(
      kCalibrated + ": OOM's CPU AdamW, 64M parameters, fp32 master and moments, bf16 weights out, 16 threads "
                    "(PyTorch's foreach AdamW: 0.82e9, " + mission + ")",
      kH200Machine, kH200Date);

  // Not calibrated there: the fp32 rate x the ratio bench_adamw measured between the two on that
  // machine's CPU (6.35 / 4.92 G params/s at 16 threads, 2026-11-30; 30 / 22 of the bytes would
  // be 1.36x). oom-calibrate measures it.
  p.cpu_adamw_bf16_moments_params_per_s = 4.82e9 * (6.35 / 4.92);
  p.provenance["cpu_adamw_bf16_moments_params_per_s"] =
      prov("ESTIMATE: the calibrated fp32-moment rate (4.82e9) x 1.29, bench_adamw's bf16-moment rate over its fp32-moment "
           "rate on the same CPU (6.35e9 / 4.92e9, 16 threads)",
           kH200Machine, kH200Date);

  p.host_copy_bytes_per_s = kH200HostCopy;
  p.provenance["host_copy_bytes_per_s"] =
      prov("host memcpy, all cores, bytes read + written (" + mission + ")", kH200Machine, kH200Date);

  if (gpus == 1) {
    p.all_to_all_bytes_per_s = 0;
    p.all_reduce_bytes_per_s = 0;
    p.provenance["all_to_all_bytes_per_s"] = prov("one GPU: no collective", kH200Machine, kH200Date);
    p.provenance["all_reduce_bytes_per_s"] = prov("one GPU: no collective", kH200Machine, kH200Date);
  } else {
    p.all_to_all_bytes_per_s = kNvlink4NcclBusBw;
    p.all_reduce_bytes_per_s = kNvlink4NcclBusBw;
    const std::string src =
        "NVLink 4, 450 GB/s per direction line rate; NCCL without NVLS reaches ~370 GB/s bus bandwidth after protocol "
        "overhead (NCCL maintainer, github.com/NVIDIA/nccl-tests/issues/212); not measured on our machine";
    p.provenance["all_to_all_bytes_per_s"] = prov(src, machine, "2024-05-06");
    p.provenance["all_reduce_bytes_per_s"] = prov(src, machine, "2024-05-06");
  }
  return p;
}

MachineProfile MachineProfile::h100_80gb(int gpus) {
  check_gpus("h100-80gb", gpus);
  MachineProfile p;
  p.name = "h100-80gb";
  p.gpus = gpus;
  const std::string machine = node(gpus, "NVIDIA H100 80GB SXM5 (HGX/DGX board), 2-socket Xeon (assumed)");
  const std::string datasheet = "NVIDIA H100 Tensor Core GPU datasheet (SXM5)";
  // The host is assumed to be the DGX H100's: 2x Xeon Platinum 8480C, 8 channels of DDR5-4800 each
  // (2 x 8 x 38.4 = 614.4 GB/s theoretical), 2 TB for 8 GPUs, i.e. 256 GiB per GPU.
  constexpr double host_bw = 614.4 * kGB;
  const std::string host = "assumed host: DGX H100 (NVIDIA DGX H100 datasheet: 2x Xeon Platinum 8480C, 2 TB DDR5-4800)";

  p.gpu_memory = Bytes{(80ull << 30) - (kContextOverheadMiB << 20)};
  p.provenance["gpu_memory"] =
      prov(datasheet + ": 80 GB HBM3, less the ~1.4 GiB the CUDA context and libraries took on our H200 (143771 MiB "
                       "total, ~139 GiB usable)",
           machine, "2023");
  p.host_memory = Bytes{static_cast<std::uint64_t>(gpus) * (250ull << 30)};
  p.provenance["host_memory"] =
      prov(host + ": 256 GiB per GPU, less the 2.3% the OS kept on our 1-GPU H200 machine (125 of 128 GiB) -> 250 GiB "
                  "per GPU",
           machine, "2023");

  // Same PCIe Gen5 x16 host interface as our H200 (datasheet: "PCIe Gen5: 128 GB/s"), so the same
  // achieved pinned rates; pageable copies are bound by the host, so also only a guess from ours.
  const std::string pcie =
      "PCIe Gen5 x16 as on our H200 (" + datasheet + "): our H200's measured pinned rate, oom gpu-check " + kH200Date;
  p.h2d_bytes_per_s = kH200H2d;
  p.d2h_bytes_per_s = kH200D2h;
  p.bidir_bytes_per_s = kH200Bidir;
  p.pageable_h2d_bytes_per_s = kH200Pageable;
  p.provenance["h2d_bytes_per_s"] = prov(pcie, kH200Machine, kH200Date);
  p.provenance["d2h_bytes_per_s"] = prov(pcie, kH200Machine, kH200Date);
  p.provenance["bidir_bytes_per_s"] = prov(pcie + ", both directions at once", kH200Machine, kH200Date);
  p.provenance["pageable_h2d_bytes_per_s"] =
      prov("our H200 machine's pageable H2D (host-bound staging copy; depends on the host), oom gpu-check", kH200Machine,
           kH200Date);
  p.host_link_total_bytes_per_s = std::min(gpus * kH200Bidir, host_bw * kAssumedStreamEfficiency);
  p.provenance["host_link_total_bytes_per_s"] =
      prov(fmt::format("estimate: min({} x 101.3 GB/s bidirectional per GPU, 0.7 x 614.4 GB/s host DDR5 theoretical); ",
                       gpus) +
               host,
           machine, "2023");

  p.hbm_bytes_per_s = 3.35e12 * (kH200Hbm / kH200HbmDatasheet);
  p.provenance["hbm_bytes_per_s"] =
      prov(datasheet + ": 3.35 TB/s, x 0.896 = the ratio of our H200's measured copy rate (4.3 TB/s) to its datasheet "
                       "4.8 TB/s",
           machine, "2023");

  // Same GH100 compute as the H200 (both datasheets: 989 TFLOP/s dense bf16), so the H200's measured
  // cap scaled by the peak ratio (1.0); the roofline uses the H100's own memory bandwidth.
  const double scale = kH100Bf16Peak / kH200Bf16Peak;
  p.gemm_flops = gemm_roofline(kH200GemmPeakMeasured * scale, p.hbm_bytes_per_s);
  p.provenance["gemm_flops"] =
      prov("ESTIMATE: our H200's measured cuBLAS bf16 8192^3 799 TFLOP/s x (989.4 / 989.4, H100 SXM / H200 dense bf16 "
           "datasheet peaks) as cap; by m, roofline with 3.0 TB/s (see hbm_bytes_per_s)",
           machine, "2023");
  {
    const Provenance est = prov("ESTIMATE: OOM's flash attention curves measured on our H200 (" + std::string(kH200AttentionDate) +
                                    ") x 1.0, the ratio of the H100 SXM and H200 dense bf16 datasheet peaks (989.4 TFLOP/s each)",
                                machine, "2023");
    set_attention(p, h200_attention(scale), {est, est, est_d256(est), est_d256(est)});
  }
  set_gated_delta(p, 1.0, true,
                  "the H200's rates x 1.0: the rule's chunked kernels are bound by each SM's latency, shared memory and "
                  "tf32 tensor cores (little HBM traffic), and the H100 SXM has the same 132 SMs, 227 KiB a block and "
                  "tf32 peak",
                  machine);

  p.launch_overhead_s = 5e-6;
  p.provenance["launch_overhead_s"] =
      prov("estimate: a few microseconds per kernel launch or small async copy; not measured", machine, kH200Date);

  p.cpu_adamw_params_per_s = host_bw * kAssumedStreamEfficiency / kAdamwBytesPerParam;
  p.provenance["cpu_adamw_params_per_s"] =
      prov("ESTIMATE: 614.4 GB/s host DDR5 theoretical x 0.7 assumed efficiency / 30 bytes per parameter; " + host,
           machine, "2023");
  p.host_copy_bytes_per_s = host_bw * kAssumedStreamEfficiency;
  p.provenance["host_copy_bytes_per_s"] =
      prov("ESTIMATE: 614.4 GB/s host DDR5 theoretical x 0.7 assumed efficiency; " + host, machine, "2023");

  if (gpus == 1) {
    p.provenance["all_to_all_bytes_per_s"] = prov("one GPU: no collective", machine, "2023");
    p.provenance["all_reduce_bytes_per_s"] = prov("one GPU: no collective", machine, "2023");
  } else {
    p.all_to_all_bytes_per_s = kNvlink4NcclBusBw;
    p.all_reduce_bytes_per_s = kNvlink4NcclBusBw;
    const std::string src =
        "NVLink 4 (" + datasheet + ": 900 GB/s bidirectional); NCCL without NVLS ~370 GB/s bus bandwidth "
        "(NCCL maintainer, github.com/NVIDIA/nccl-tests/issues/212)";
    p.provenance["all_to_all_bytes_per_s"] = prov(src, machine, "2024-05-06");
    p.provenance["all_reduce_bytes_per_s"] = prov(src, machine, "2024-05-06");
  }
  return p;
}

MachineProfile MachineProfile::rtx4090(int gpus) {
  check_gpus("rtx4090", gpus);
  MachineProfile p;
  p.name = "rtx4090";
  p.gpus = gpus;
  const std::string machine = node(gpus, "NVIDIA GeForce RTX 4090 24GB (PCIe Gen4 x16), workstation host (assumed)");
  const std::string whitepaper = "NVIDIA Ada GPU Architecture whitepaper (GeForce RTX 4090)";
  // Assumed host: a single-socket workstation with 8 channels of DDR5-4800 (307.2 GB/s theoretical)
  // and enough PCIe lanes for x16 per GPU (Threadripper PRO / Xeon W class), 64 GiB RAM per GPU.
  constexpr double host_bw = 307.2 * kGB;
  const std::string host = "assumed host: 1-socket workstation, 8-channel DDR5-4800 (307.2 GB/s theoretical), x16 per GPU";

  p.gpu_memory = Bytes{(24ull << 30) - (kContextOverheadMiB << 20)};
  p.provenance["gpu_memory"] = prov(
      whitepaper + ": 24 GB GDDR6X, less the ~1.4 GiB the CUDA context and libraries took on our H200", machine, "2022");
  p.host_memory = Bytes{static_cast<std::uint64_t>(gpus) * (64ull << 30)};
  p.provenance["host_memory"] =
      prov("assumed: 64 GiB per GPU (a 4x4090 box with 256 GiB, a common workstation configuration)", machine, "2022");

  // PCIe Gen4 x16 carries half of Gen5 x16 per direction (16 vs 32 GT/s, same encoding), so our H200's
  // measured Gen5 rates halved.
  const std::string pcie = "ESTIMATE: PCIe Gen4 x16 = half of Gen5 x16; our H200's measured pinned rate (oom gpu-check " +
                           std::string(kH200Date) + ") x 0.5";
  p.h2d_bytes_per_s = kH200H2d * 0.5;
  p.d2h_bytes_per_s = kH200D2h * 0.5;
  p.bidir_bytes_per_s = kH200Bidir * 0.5;
  p.pageable_h2d_bytes_per_s = kH200Pageable;
  p.provenance["h2d_bytes_per_s"] = prov(pcie, machine, kH200Date);
  p.provenance["d2h_bytes_per_s"] = prov(pcie, machine, kH200Date);
  p.provenance["bidir_bytes_per_s"] = prov(pcie + ", both directions at once", machine, kH200Date);
  p.provenance["pageable_h2d_bytes_per_s"] =
      prov("ESTIMATE: our H200 machine's pageable H2D 6.9 GB/s (bound by the host's staging copy, below Gen4's pinned "
           "rate too)",
           machine, kH200Date);
  p.host_link_total_bytes_per_s = std::min(gpus * p.bidir_bytes_per_s, host_bw * kAssumedStreamEfficiency);
  p.provenance["host_link_total_bytes_per_s"] = prov(
      fmt::format("estimate: min({} x 50.65 GB/s bidirectional per GPU, 0.7 x 307.2 GB/s); ", gpus) + host, machine,
      "2022");

  p.hbm_bytes_per_s = 1008e9 * (kH200Hbm / kH200HbmDatasheet);
  p.provenance["hbm_bytes_per_s"] = prov(
      whitepaper + ": 1008 GB/s GDDR6X, x 0.896 = our H200's measured/datasheet copy ratio (4.3 / 4.8 TB/s)", machine,
      "2022");

  const double scale = kAda4090Bf16Fp32AccPeak / kH200Bf16Peak;
  p.gemm_flops = gemm_roofline(kH200GemmPeakMeasured * scale, p.hbm_bytes_per_s);
  p.provenance["gemm_flops"] =
      prov("ESTIMATE: our H200's measured cuBLAS bf16 8192^3 799 TFLOP/s x (165.2 / 989.4, RTX 4090 bf16 with fp32 "
           "accumulate per the Ada whitepaper / H200 dense bf16 datasheet) as cap; by m, roofline with 903 GB/s",
           machine, "2022");
  {
    const Provenance est = prov("ESTIMATE: OOM's flash attention curves measured on our H200 (" + std::string(kH200AttentionDate) +
                                    ") x 165.2 / 989.4 (dense bf16 fp32-accumulate peaks: Ada whitepaper, H200 datasheet)",
                                machine, "2022");
    set_attention(p, h200_attention(scale), {est, est, est_d256(est), est_d256(est)});
  }
  set_gated_delta(p, 128.0 / 132.0, false,
                  "the H200's rates x 128 / 132 SMs, its backward as one block a head (compute capability 8.9 has no "
                  "thread-block clusters): the recurrent kernels are bound by each SM's latency (no tensor cores, little "
                  "memory traffic); the 4090's higher clocks are not counted",
                  machine);

  p.launch_overhead_s = 5e-6;
  p.provenance["launch_overhead_s"] =
      prov("estimate: a few microseconds per kernel launch or small async copy; not measured", machine, kH200Date);

  p.cpu_adamw_params_per_s = host_bw * kAssumedStreamEfficiency / kAdamwBytesPerParam;
  p.provenance["cpu_adamw_params_per_s"] =
      prov("ESTIMATE: 307.2 GB/s x 0.7 assumed efficiency / 30 bytes per parameter; " + host, machine, "2022");
  p.host_copy_bytes_per_s = host_bw * kAssumedStreamEfficiency;
  p.provenance["host_copy_bytes_per_s"] = prov("ESTIMATE: 307.2 GB/s x 0.7 assumed efficiency; " + host, machine, "2022");

  if (gpus == 1) {
    p.provenance["all_to_all_bytes_per_s"] = prov("one GPU: no collective", machine, "2022");
    p.provenance["all_reduce_bytes_per_s"] = prov("one GPU: no collective", machine, "2022");
  } else {
    // GeForce 40-series has no NVLink and no peer-to-peer: NCCL stages through host shared memory,
    // so each byte crosses PCIe twice (down to the host buffer, up to the peer).
    p.all_to_all_bytes_per_s = p.h2d_bytes_per_s * 0.5;
    p.all_reduce_bytes_per_s = p.h2d_bytes_per_s * 0.5;
    const std::string src =
        "ESTIMATE: no NVLink and no P2P on RTX 4090; NCCL's SHM transport crosses PCIe twice per byte -> half the "
        "Gen4 pinned rate (27.65 GB/s x 0.5)";
    p.provenance["all_to_all_bytes_per_s"] = prov(src, machine, kH200Date);
    p.provenance["all_reduce_bytes_per_s"] = prov(src, machine, kH200Date);
  }
  return p;
}

MachineProfile MachineProfile::builtin(std::string_view name, int gpus) {
  if (name == "h200") return h200(gpus);
  if (name == "h100-80gb" || name == "h100") return h100_80gb(gpus);
  if (name == "rtx4090" || name == "4090") return rtx4090(gpus);
  OOM_THROW(Errc::invalid_argument,
            fmt::format("no built-in machine profile \"{}\" (known: h200, h100-80gb or h100, rtx4090 or 4090)", name));
}

}  // namespace oom

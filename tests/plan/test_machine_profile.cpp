// MachineProfile and SizeCurve: interpolation and its envelope, strict JSON reading with errors
// that name the field, exact round-trips of every built-in profile, and provenance everywhere.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"
#include "oom/plan/cost_model.hpp"
#include "oom/plan/machine_profile.hpp"

using namespace oom;
using namespace oom::literals;

namespace {

/// The message of the error `f` raises; fails the test when it raises none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  FAIL("no error raised");
  return {};
}

/// The error from_json raises for `j` (named "t.json"); fails the test when it parses.
std::string profile_error(const Json& j) {
  return error_of([&] { (void)MachineProfile::from_json(j, "t.json"); });
}

Json h200_json() { return MachineProfile::h200(2).to_json(); }

}  // namespace

TEST_CASE("SizeCurve: exact at samples, log-log between them") {
  const SizeCurve c({{1000, 1e9}, {4000, 4e9}, {16000, 8e9}});
  CHECK(c.at(1000) == doctest::Approx(1e9));
  CHECK(c.at(4000) == doctest::Approx(4e9));
  CHECK(c.at(16000) == doctest::Approx(8e9));
  // Log-log: halfway in log(size) between 1000 and 4000 is 2000, and the rate is the geometric mean.
  CHECK(c.at(2000) == doctest::Approx(2e9));
  CHECK(c.at(8000) == doctest::Approx(std::sqrt(4e9 * 8e9)));
  // Linear interpolation would give 5.33e9 at 8000; log-log must not.
  CHECK(c.at(8000) != doctest::Approx(4e9 + (8e9 - 4e9) * (8000 - 4000) / 12000.0));
}

TEST_CASE("SizeCurve: below the range the rate falls with the size, above it stays at the last rate") {
  const SizeCurve c({{100, 5e9}, {1000, 2e10}});
  CHECK(c.at(50) == doctest::Approx(2.5e9));   // latency-bound: fixed time per call
  CHECK(c.at(1) == doctest::Approx(5e7));
  CHECK(c.at(1e6) == doctest::Approx(2e10));  // saturated
  CHECK(c.at(1e12) == doctest::Approx(2e10));
  CHECK_THROWS_AS((void)c.at(0), Error);
  CHECK_THROWS_AS((void)c.at(-3), Error);
  CHECK_THROWS_AS((void)c.at(std::nan("")), Error);
  CHECK_THROWS_AS((void)SizeCurve().at(10), Error);
}

TEST_CASE("SizeCurve: the envelope makes the curve non-decreasing and at() monotone") {
  // A measured dip at 256 (a poor kernel choice) is lifted to the rate of the smaller problem.
  const SizeCurve c({{16, 1e12}, {64, 5e12}, {256, 3e12}, {1024, 9e12}, {4096, 8e12}});
  const auto& s = c.samples();
  REQUIRE(s.size() == 5);
  CHECK(s[2].second == 5e12);
  CHECK(s[4].second == 9e12);
  for (std::size_t i = 1; i < s.size(); ++i) CHECK(s[i].second >= s[i - 1].second);
  double prev = 0;
  for (double x = 1; x < 1e5; x *= 1.07) {
    const double r = c.at(x);
    CHECK(r >= prev);
    prev = r;
  }
}

TEST_CASE("SizeCurve: malformed sample lists are rejected with the reason") {
  CHECK(error_of([] { SizeCurve(std::vector<std::pair<double, double>>{}); }).find("at least one") != std::string::npos);
  CHECK(error_of([] { SizeCurve({{10, 1}, {5, 2}}); }).find("sorted") != std::string::npos);
  CHECK(error_of([] { SizeCurve({{10, 1}, {10, 2}}); }).find("sorted") != std::string::npos);
  CHECK(error_of([] { SizeCurve({{0, 1}}); }).find("size must be > 0") != std::string::npos);
  CHECK(error_of([] { SizeCurve({{1, -1}}); }).find("rate must be > 0") != std::string::npos);
  CHECK(error_of([] { SizeCurve({{1, INFINITY}}); }).find("rate must be > 0") != std::string::npos);
}

TEST_CASE("built-in profiles validate, for every GPU count of a node") {
  for (const char* name : {"h200", "h100-80gb", "rtx4090"}) {
    for (int gpus = 1; gpus <= 8; ++gpus) {
      CAPTURE(name);
      CAPTURE(gpus);
      const MachineProfile p = MachineProfile::builtin(name, gpus);
      CHECK(p.gpus == gpus);
      CHECK_NOTHROW(p.validate(name));
      CHECK((gpus == 1) == (p.all_reduce_bytes_per_s == 0));
      CHECK((gpus == 1) == (p.all_to_all_bytes_per_s == 0));
      // A multi-GPU node's links together are never slower than one GPU's.
      CHECK(p.host_link_total_bytes_per_s >= p.bidir_bytes_per_s);
      CHECK(p.pageable_h2d_bytes_per_s <= p.h2d_bytes_per_s);
    }
  }
}

TEST_CASE("built-in names, aliases and errors") {
  CHECK(MachineProfile::builtin("h200").name == "h200");
  CHECK(MachineProfile::builtin("h100-80gb").name == "h100-80gb");
  CHECK(MachineProfile::builtin("h100").name == "h100-80gb");
  CHECK(MachineProfile::builtin("rtx4090").name == "rtx4090");
  CHECK(MachineProfile::builtin("4090", 4).name == "rtx4090");
  CHECK(MachineProfile::builtin("h100", 4) == MachineProfile::h100_80gb(4));
  const std::string e = error_of([] { (void)MachineProfile::builtin("a100"); });
  CHECK(e.find("a100") != std::string::npos);
  CHECK(e.find("h200") != std::string::npos);
  CHECK(e.find("rtx4090") != std::string::npos);
  CHECK_THROWS_AS((void)MachineProfile::h200(0), Error);
  CHECK_THROWS_AS((void)MachineProfile::h200(9), Error);
}

TEST_CASE("built-in H200 carries the figures measured on our machine") {
  const MachineProfile p = MachineProfile::h200(1);
  CHECK(p.h2d_bytes_per_s == 55.3e9);
  CHECK(p.d2h_bytes_per_s == 55.3e9);
  CHECK(p.bidir_bytes_per_s == 101.3e9);
  CHECK(p.pageable_h2d_bytes_per_s == 6.9e9);
  CHECK(p.host_copy_bytes_per_s == 87e9);
  CHECK(p.hbm_bytes_per_s == 4.3e12);
  CHECK(p.gpu_memory == 139_GiB);
  CHECK(p.host_memory == 125_GiB);
  CHECK(MachineProfile::h200(2).host_memory == 251_GiB);
  CHECK(p.gemm_flops.at(16) < 100e12);  // a 16-row GEMM is memory-bound, far below the cap
  // OOM's own attention kernel as measured (not the peer's): the planner predicts OOM's steps.
  // Each pass at its own rate, both rising with the sequence (the causal tail and the fixed costs
  // weigh less), and not the same curve.
  CHECK(p.attention_forward_flops.at(4096) < p.attention_forward_flops.at(131072));
  CHECK(p.attention_backward_flops.at(4096) < p.attention_backward_flops.at(131072));
  CHECK(p.attention_forward_flops.at(131072) != p.attention_backward_flops.at(131072));
  CHECK(p.provenance.at("attention_forward_flops").source.find("OOM's flash attention") != std::string::npos);
  CHECK(p.provenance.at("attention_backward_flops").source.find("backward timed alone") != std::string::npos);
  CHECK(p.provenance.at("h2d_bytes_per_s").date == "2026-11-30");
}

TEST_CASE("built-in H200 agrees with the profile oom-calibrate measured there") {
  const MachineProfile builtin = MachineProfile::h200(1);
  const MachineProfile measured = MachineProfile::from_file(OOM_SOURCE_DIR "/examples/profiles/h200-2026-11-30.json");
  for (double m : {16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0}) {
    CAPTURE(m);
    CHECK(builtin.gemm_flops.at(m) == doctest::Approx(measured.gemm_flops.at(m)).epsilon(0.01));
  }
  CHECK(builtin.cpu_adamw_params_per_s == doctest::Approx(measured.cpu_adamw_params_per_s).epsilon(0.01));
  CHECK(builtin.launch_overhead_s == doctest::Approx(measured.launch_overhead_s).epsilon(0.01));
  CHECK(builtin.h2d_bytes_per_s == doctest::Approx(measured.h2d_bytes_per_s).epsilon(0.01));
  CHECK(builtin.d2h_bytes_per_s == doctest::Approx(measured.d2h_bytes_per_s).epsilon(0.01));
  CHECK(measured.provenance.at("cpu_adamw_params_per_s").source.find("oom-calibrate") != std::string::npos);
  // That file predates the split attention curves (it is read through the legacy path) and the
  // wgmma attention kernels; the attention curves come from the calibration of today's kernels.
  const MachineProfile split = MachineProfile::from_file(OOM_SOURCE_DIR "/examples/profiles/h200-2026-12-03.json");
  for (double s : {4096.0, 8192.0, 16384.0, 32768.0, 65536.0, 131072.0}) {
    CAPTURE(s);
    CHECK(builtin.attention_forward_flops.at(s) == doctest::Approx(split.attention_forward_flops.at(s)).epsilon(0.01));
    CHECK(builtin.attention_backward_flops.at(s) == doctest::Approx(split.attention_backward_flops.at(s)).epsilon(0.01));
  }
  CHECK(split.provenance.at("attention_backward_flops").source.find("backward timed alone") != std::string::npos);
}

TEST_CASE("the other built-ins keep the hardware's ordering") {
  const auto h200 = MachineProfile::h200(4), h100 = MachineProfile::h100_80gb(4), g4090 = MachineProfile::rtx4090(4);
  CHECK(h100.hbm_bytes_per_s < h200.hbm_bytes_per_s);
  CHECK(g4090.hbm_bytes_per_s < h100.hbm_bytes_per_s);
  CHECK(h100.gpu_memory < h200.gpu_memory);
  CHECK(g4090.gpu_memory < h100.gpu_memory);
  CHECK(g4090.gpu_memory > 20_GiB);
  CHECK(g4090.h2d_bytes_per_s < h100.h2d_bytes_per_s);  // Gen4 against Gen5
  CHECK(g4090.gemm_flops.at(65536) < h100.gemm_flops.at(65536));
  CHECK(g4090.all_reduce_bytes_per_s < 0.1 * h100.all_reduce_bytes_per_s);  // PCIe through the host vs NVLink
  CHECK(h100.host_memory == 1000_GiB);
  CHECK(g4090.host_memory == 256_GiB);
}

TEST_CASE("JSON round-trip of every built-in profile is exact") {
  for (const char* name : {"h200", "h100-80gb", "rtx4090"}) {
    for (int gpus : {1, 2, 4, 8}) {
      CAPTURE(name);
      CAPTURE(gpus);
      const MachineProfile p = MachineProfile::builtin(name, gpus);
      const Json j = p.to_json();
      CHECK(MachineProfile::from_json(j, "mem") == p);
      // Through text too: the writer's shortest round-trip doubles must parse back bit-exact.
      CHECK(MachineProfile::from_json(Json::parse(j.dump(2)), "text") == p);
    }
  }
}

TEST_CASE("JSON layout: byte counts are integers, curves are [size, rate] arrays") {
  const Json j = MachineProfile::h200(1).to_json();
  REQUIRE(j.find("gpu_memory") != nullptr);
  CHECK(j.find("gpu_memory")->is_integer());
  CHECK(j.find("gpu_memory")->as_uint64() == 139ull << 30);
  CHECK(j.find("host_memory")->is_integer());
  const Json& gemm = *j.find("gemm_flops");
  REQUIRE(gemm.is_array());
  CHECK(gemm.as_array()[0].as_array().size() == 2);
  CHECK(gemm.as_array()[0].as_array()[0].as_double() == 16);
  CHECK(j.find("provenance")->find("hbm_bytes_per_s")->find("source") != nullptr);
}

TEST_CASE("malformed profiles: each error names the file and the field") {
  SUBCASE("missing field") {
    Json j = h200_json();
    Json::Object o;
    for (auto& [k, v] : j.as_object())
      if (k != "h2d_bytes_per_s") o.emplace_back(k, v);
    const std::string e = profile_error(Json(o));
    CHECK(e.find("t.json") != std::string::npos);
    CHECK(e.find("h2d_bytes_per_s") != std::string::npos);
    CHECK(e.find("missing") != std::string::npos);
  }
  SUBCASE("negative rate") {
    Json j = h200_json();
    j.set("h2d_bytes_per_s", -1);
    CHECK(profile_error(j) == "profile t.json: field h2d_bytes_per_s must be > 0, got -1");
  }
  SUBCASE("zero collective bandwidth with two GPUs") {
    Json j = h200_json();
    j.set("all_reduce_bytes_per_s", 0);
    const std::string e = profile_error(j);
    CHECK(e.find("all_reduce_bytes_per_s") != std::string::npos);
    CHECK(e.find("2 GPUs") != std::string::npos);
  }
  SUBCASE("wrong type") {
    Json j = h200_json();
    j.set("hbm_bytes_per_s", "fast");
    const std::string e = profile_error(j);
    CHECK(e.find("hbm_bytes_per_s") != std::string::npos);
    CHECK(e.find("expected number") != std::string::npos);
  }
  SUBCASE("byte count given as a double") {
    Json j = h200_json();
    j.set("gpu_memory", 139.5e9);
    const std::string e = profile_error(j);
    CHECK(e.find("gpu_memory") != std::string::npos);
    CHECK(e.find("integer") != std::string::npos);
  }
  SUBCASE("negative byte count") {
    Json j = h200_json();
    j.set("host_memory", -5);
    CHECK(profile_error(j) == "profile t.json: field host_memory must be > 0, got -5");
  }
  SUBCASE("missing provenance entry") {
    Json j = h200_json();
    Json prov = Json::object();
    for (auto& [k, v] : j.find("provenance")->as_object())
      if (k != "attention_backward_flops") prov.set(k, v);
    j.set("provenance", prov);
    const std::string e = profile_error(j);
    CHECK(e.find("attention_backward_flops") != std::string::npos);
    CHECK(e.find("provenance") != std::string::npos);
  }
  SUBCASE("provenance with a bad date") {
    Json j = h200_json();
    Json prov = *j.find("provenance");
    prov.set("hbm_bytes_per_s", Json(Json::Object{{"source", "x"}, {"machine", "y"}, {"date", "30/11/2026"}}));
    j.set("provenance", prov);
    const std::string e = profile_error(j);
    CHECK(e.find("hbm_bytes_per_s") != std::string::npos);
    CHECK(e.find("ISO date") != std::string::npos);
  }
  SUBCASE("provenance for a field that does not exist") {
    Json j = h200_json();
    Json prov = *j.find("provenance");
    prov.set("h2d_gbps", Json(Json::Object{{"source", "x"}, {"machine", "y"}, {"date", "2026"}}));
    j.set("provenance", prov);
    CHECK(profile_error(j).find("provenance.h2d_gbps") != std::string::npos);
  }
  SUBCASE("unsorted curve") {
    Json j = h200_json();
    j.set("gemm_flops", Json::parse("[[64, 1e12], [16, 2e12]]"));
    const std::string e = profile_error(j);
    CHECK(e.find("field gemm_flops") != std::string::npos);
    CHECK(e.find("sorted") != std::string::npos);
  }
  SUBCASE("curve element that is not a pair") {
    Json j = h200_json();
    j.set("attention_forward_flops", Json::parse("[[4096, 1e12, 3]]"));
    const std::string e = profile_error(j);
    CHECK(e.find("attention_forward_flops[0]") != std::string::npos);
    CHECK(e.find("[size, rate]") != std::string::npos);
  }
  SUBCASE("empty curve") {
    Json j = h200_json();
    j.set("attention_forward_flops", Json::array());
    CHECK(profile_error(j).find("attention_forward_flops") != std::string::npos);
  }
  SUBCASE("misspelt field") {
    Json j = h200_json();
    j.set("h2d_bytes_per_sec", 5e10);
    CHECK(profile_error(j).find("h2d_bytes_per_sec") != std::string::npos);
  }
  SUBCASE("gpus out of range") {
    Json j = h200_json();
    j.set("gpus", 0);
    CHECK(profile_error(j).find("field gpus") != std::string::npos);
  }
  SUBCASE("not an object") { CHECK(profile_error(Json::parse("[1]")).find("expected a JSON object") != std::string::npos); }
}

TEST_CASE("validate() names the field of a profile built in code") {
  MachineProfile p = MachineProfile::rtx4090(1);
  p.hbm_bytes_per_s = std::nan("");
  CHECK(error_of([&] { p.validate("mine"); }).find("profile mine: field hbm_bytes_per_s") != std::string::npos);
  p = MachineProfile::rtx4090(1);
  p.provenance.erase("launch_overhead_s");
  CHECK(error_of([&] { p.validate("mine"); }) ==
        "profile mine: field launch_overhead_s has no provenance entry (where did the value come from?)");
  p = MachineProfile::rtx4090(1);
  p.gemm_flops = SizeCurve();
  CHECK(error_of([&] { p.validate("mine"); }).find("field gemm_flops") != std::string::npos);
  p = MachineProfile::rtx4090(1);
  p.gpu_memory = Bytes{0};
  CHECK(error_of([&] { p.validate("mine"); }) == "profile mine: field gpu_memory must be > 0, got 0");
}

TEST_CASE("from_file reads what to_json wrote and names the path in errors") {
  const auto dir = std::filesystem::temp_directory_path();
  const auto good = dir / "oom_test_profile_good.json";
  const auto bad = dir / "oom_test_profile_bad.json";
  {
    std::ofstream(good) << MachineProfile::h100_80gb(4).to_json().dump(2);
    Json j = MachineProfile::h100_80gb(4).to_json();
    j.set("d2h_bytes_per_s", -1);
    std::ofstream(bad) << j.dump(2);
  }
  CHECK(MachineProfile::from_file(good) == MachineProfile::h100_80gb(4));
  const std::string e = error_of([&] { (void)MachineProfile::from_file(bad); });
  CHECK(e.find(bad.string()) != std::string::npos);
  CHECK(e.find("d2h_bytes_per_s must be > 0, got -1") != std::string::npos);
  CHECK_THROWS_AS((void)MachineProfile::from_file(dir / "oom_no_such_profile.json"), Error);
  std::filesystem::remove(good);
  std::filesystem::remove(bad);
}

TEST_CASE("a profile with the older single attention curve reads it as the rate of each pass") {
  // Profiles written before the forward and backward curves were split carry `attention_flops`
  // (forward + backward at 3.5x the causal forward FLOPs): the same time for the pair either way.
  const Json current = MachineProfile::h200(1).to_json();
  const Json legacy = Json::parse("[[4096, 1.0e14], [131072, 2.0e14]]");
  Json j = Json::object();
  for (const auto& [k, v] : current.as_object())
    if (!k.starts_with("attention_")) j.set(k, v);
  j.set("attention_flops", legacy);
  Json prov = Json::object();
  for (const auto& [k, v] : current.find("provenance")->as_object())
    if (!k.starts_with("attention_")) prov.set(k, v);
  prov.set("attention_flops", Json(Json::Object{{"source", "old calibration"}, {"machine", "m"}, {"date", "2026-11-30"}}));
  j.set("provenance", prov);
  const MachineProfile p = MachineProfile::from_json(j, "old.json");
  CHECK(p.attention_forward_flops.at(4096) == doctest::Approx(1.0e14));
  CHECK(p.attention_backward_flops.at(131072) == doctest::Approx(2.0e14));
  CHECK(p.provenance.at("attention_backward_flops").source.find("old calibration") != std::string::npos);
  CHECK(p.attention_forward_flops_d256.empty());  // not measured, not read from the single curve
  // The head-dim-256 curves beside the single one are read from their own fields.
  Json with_d256 = j;
  Json prov_d256 = prov;
  for (const char* f : {"attention_forward_flops_d256", "attention_backward_flops_d256"}) {
    with_d256.set(f, *current.find(f));
    prov_d256.set(f, *current.find("provenance")->find(f));
  }
  with_d256.set("provenance", prov_d256);
  const MachineProfile q = MachineProfile::from_json(with_d256, "old-and-d256.json");
  CHECK(q.attention_forward_flops.at(4096) == doctest::Approx(1.0e14));
  CHECK(q.attention_backward_flops_d256 == MachineProfile::h200(1).attention_backward_flops_d256);
  // Written back, it is in the new form and reads back equal.
  CHECK(MachineProfile::from_json(p.to_json(), "new.json") == p);
  // A file with both forms is a mistake, named.
  Json both = MachineProfile::h200(1).to_json();
  both.set("attention_flops", legacy);
  CHECK(error_of([&] { (void)MachineProfile::from_json(both, "both.json"); }).find("attention_flops") != std::string::npos);
}

TEST_CASE("cost model: each attention pass at its own rate; the CPU AdamW shares host memory with the copies") {
  const MachineProfile p = MachineProfile::h200(1);
  const ProfileCostModel cost(p);
  // 32K tokens, 16 heads of 128: the forward at its curve, the backward (2.5x the FLOPs) at its.
  const auto fwd = Operation::attention(false, 32768, 32768, 128, 16);
  const auto bwd = Operation::attention(true, 32768, 32768, 128, 16);
  CHECK(cost.predict(fwd)[Resource::gpu_compute] ==
        doctest::Approx(p.launch_overhead_s + fwd.flops() / p.attention_forward_flops.at(32768)));
  CHECK(cost.predict(bwd)[Resource::gpu_compute] ==
        doctest::Approx(p.launch_overhead_s + bwd.flops() / p.attention_backward_flops.at(32768)));
  // Idle host memory: the calibrated rate. With a layer's gradients (4 B) down and weights (2 B)
  // up meanwhile: (30 + 6) / 30 of that time, and more copies never make it faster.
  const std::uint64_t n = 300'000'000;
  const double idle = cost.predict(Operation::over(OpKind::cpu_optimizer, n))[Resource::cpu];
  CHECK(idle == doctest::Approx(static_cast<double>(n) / p.cpu_adamw_params_per_s));
  const double streaming = cost.predict(Operation::over(OpKind::cpu_optimizer, n, Bytes{n * 6}))[Resource::cpu];
  CHECK(streaming == doctest::Approx(idle * 36.0 / 30.0));
  CHECK(cost.predict(Operation::over(OpKind::cpu_optimizer, n, Bytes{n * 12}))[Resource::cpu] > streaming);
  CHECK(cost.predict(Operation::over(OpKind::cpu_optimizer, n, Bytes{n * 6}))[Resource::h2d] == 0.0);
  // bf16 moments: at their own rate where the profile has one (the built-in H200's), the
  // streaming copies' share as with fp32 moments.
  const double idle16 = static_cast<double>(n) / p.cpu_adamw_bf16_moments_params_per_s;
  CHECK(cost.predict(Operation::over(OpKind::cpu_optimizer, n, Bytes{}, DType::bf16))[Resource::cpu] == doctest::Approx(idle16));
  CHECK(cost.predict(Operation::over(OpKind::cpu_optimizer, n, Bytes{n * 6}, DType::bf16))[Resource::cpu] ==
        doctest::Approx(idle16 + idle * 6.0 / 30.0));
  // Without one (0: not measured), the fp32 rate scaled by the bytes: 22 a parameter against the
  // 30 it was measured at.
  MachineProfile unmeasured = p;
  unmeasured.cpu_adamw_bf16_moments_params_per_s = 0;
  const ProfileCostModel by_bytes(unmeasured);
  CHECK(by_bytes.predict(Operation::over(OpKind::cpu_optimizer, n, Bytes{}, DType::bf16))[Resource::cpu] ==
        doctest::Approx(idle * 22.0 / 30.0));
  CHECK(by_bytes.predict(Operation::over(OpKind::cpu_optimizer, n, Bytes{n * 6}, DType::bf16))[Resource::cpu] ==
        doctest::Approx(idle * 28.0 / 30.0));
  // fp32 moments never read the bf16 rate.
  CHECK(by_bytes.predict(Operation::over(OpKind::cpu_optimizer, n))[Resource::cpu] == doctest::Approx(idle));
  const double gpu32 = cost.predict(Operation::over(OpKind::gpu_optimizer, n))[Resource::gpu_compute] - p.launch_overhead_s;
  const double gpu16 = cost.predict(Operation::over(OpKind::gpu_optimizer, n, Bytes{}, DType::bf16))[Resource::gpu_compute] -
                       p.launch_overhead_s;
  CHECK(gpu32 == doctest::Approx(static_cast<double>(n) * 30.0 / p.hbm_bytes_per_s));
  CHECK(gpu16 == doctest::Approx(gpu32 * 22.0 / 30.0));
}

TEST_CASE("cost model: a grouped GEMM at the rate of the launch's rows, never faster than reading its groups' weights") {
  const MachineProfile p = MachineProfile::h200(1);
  const ProfileCostModel cost(p);
  const auto gpu = [&](const Operation& op) { return cost.predict(op)[Resource::gpu_compute]; };
  // 64 experts' gate/up (2304 x 2048 each) over 32 rows an expert (256 tokens, top-8): the launch
  // spreads 2048 rows over the GPU, and must read 64 x 2304 x 2048 bf16 weights (604 MB).
  const auto small = Operation::gemm(32, 2304, 2048, 64);
  const double weights_s = 2.0 * 2304 * 2048 * 64 / p.hbm_bytes_per_s;
  CHECK(gpu(small) == doctest::Approx(p.launch_overhead_s + std::max(small.flops() / p.gemm_flops.at(32.0 * 64), weights_s)));
  CHECK(gpu(small) == doctest::Approx(p.launch_overhead_s + weights_s));  // here the weight read bounds it
  CHECK(gpu(small) >= weights_s);
  // Priced by rows per expert it would be about 4x slower than the weight read (the 44-layer
  // run's over-prediction, docs/performance.md thirty-third session).
  CHECK(small.flops() / p.gemm_flops.at(32) > 3.5 * weights_s);
  // Many rows an expert: compute-bound at the rate of all the launch's rows.
  const auto large = Operation::gemm(4096, 2304, 2048, 64);
  CHECK(gpu(large) == doctest::Approx(p.launch_overhead_s + large.flops() / p.gemm_flops.at(4096.0 * 64)));
  // One group: the dense GEMM as before.
  const auto dense = Operation::gemm(4096, 2048, 2048);
  CHECK(gpu(dense) == doctest::Approx(p.launch_overhead_s + dense.flops() / p.gemm_flops.at(4096)));
  // No groups: no work, the launch alone (the curve is never asked for 0 rows).
  CHECK(gpu(Operation::gemm(32, 2304, 2048, 0)) == doctest::Approx(p.launch_overhead_s));
  // More work never predicts less time: rows, groups, width.
  for (std::uint64_t groups : {1u, 8u, 64u, 128u})
    for (std::uint64_t m = 1; m <= 65536; m *= 2) {
      CAPTURE(groups);
      CAPTURE(m);
      CHECK(gpu(Operation::gemm(2 * m, 2304, 2048, groups)) >= gpu(Operation::gemm(m, 2304, 2048, groups)));
      CHECK(gpu(Operation::gemm(m, 2304, 2048, 2 * groups)) >= gpu(Operation::gemm(m, 2304, 2048, groups)));
      CHECK(gpu(Operation::gemm(m, 4608, 2048, groups)) >= gpu(Operation::gemm(m, 2304, 2048, groups)));
    }
}

TEST_CASE("the gated delta rule's rates by recurrences side by side: more sequences fill more of the GPU") {
  const MachineProfile h200 = MachineProfile::h200(1);
  REQUIRE_FALSE(h200.gated_delta_forward_parallel.empty());
  // The curve's first point is the scalar (32 heads of one sequence).
  CHECK(h200.gated_delta_forward_parallel.at(32) == doctest::Approx(h200.gated_delta_forward_updates_per_s));
  CHECK(h200.gated_delta_backward_parallel.at(32) == doctest::Approx(h200.gated_delta_backward_updates_per_s));
  const ProfileCostModel model(h200);
  const auto gpu = [&](const Operation& op) { return model.predict(op)[Resource::gpu_compute] - h200.launch_overhead_s; };
  for (const bool backward : {false, true}) {
    CAPTURE(backward);
    const Operation one = Operation::delta_rule(backward, 4096, 128, 128, 32);
    const Operation four = Operation::delta_rule(backward, 4 * 4096, 128, 128, 32, 4);
    CHECK(four.recurrences() == 128);
    CHECK(four.state_updates() == 4 * one.state_updates());
    // Four sequences side by side (as bench_gated_delta measured the forms `automatic` takes: the
    // forward chunked at one sequence and recurrent at four, the backward chunked at both): the
    // forward 4x the work in 4.943 / 1.95 the time, the backward in 23.617 / 5.93. The same tokens
    // as one sequence run 4x the time.
    CHECK(gpu(four) / gpu(one) == doctest::Approx(backward ? 23.617 / 5.93 : 4.943 / 1.95).epsilon(1e-3));
    CHECK(gpu(Operation::delta_rule(backward, 4 * 4096, 128, 128, 32)) == doctest::Approx(4 * gpu(one)));
  }
  // The RTX 4090 has no clusters: its backward curve starts at the one-block path.
  const MachineProfile ada = MachineProfile::rtx4090(1);
  CHECK(ada.gated_delta_backward_parallel.at(32) == doctest::Approx(ada.gated_delta_backward_updates_per_s));
  CHECK(ada.gated_delta_backward_parallel.at(32) < ada.gated_delta_backward_parallel.at(64));
  // Optional in a file: absent reads as not measured (the scalars price the rule), written back
  // only when set, and a set curve needs its provenance.
  const MachineProfile old = MachineProfile::from_file(OOM_SOURCE_DIR "/examples/profiles/h200-2026-12-03.json");
  CHECK(old.gated_delta_forward_parallel.empty());
  CHECK(old.to_json().dump().find("gated_delta_forward_parallel") == std::string::npos);
  CHECK(MachineProfile::from_json(h200.to_json(), "t.json").gated_delta_backward_parallel == h200.gated_delta_backward_parallel);
  MachineProfile unexplained = h200;
  unexplained.provenance.erase("gated_delta_forward_parallel");
  CHECK_THROWS_WITH_AS(unexplained.validate("x"), doctest::Contains("gated_delta_forward_parallel has no provenance entry"), Error);
}

TEST_CASE("the gated delta rule's rates: measured on the built-in H200, optional in a file, priced by the cost model") {
  const MachineProfile h200 = MachineProfile::h200(1);
  CHECK(h200.gated_delta_forward_updates_per_s > h200.gated_delta_backward_updates_per_s);  // the backward reruns each chunk
  CHECK(h200.provenance.at("gated_delta_backward_updates_per_s").source.find("chunked backward") != std::string::npos);
  // The other built-ins estimate them from the H200's, and say so.
  CHECK(MachineProfile::h100_80gb(1).gated_delta_forward_updates_per_s == h200.gated_delta_forward_updates_per_s);
  CHECK(MachineProfile::rtx4090(1).gated_delta_backward_updates_per_s < h200.gated_delta_backward_updates_per_s);
  // ... the 4090's backward from the H200's one-block path (no clusters before compute capability 9.0).
  CHECK(MachineProfile::rtx4090(1).gated_delta_backward_updates_per_s ==
        doctest::Approx(h200.gated_delta_backward_updates_per_s * 128.0 / 132.0 * 5.93 / 22.7));
  CHECK(MachineProfile::rtx4090(1).provenance.at("gated_delta_backward_updates_per_s").source.find("no clusters") != std::string::npos);
  CHECK(MachineProfile::rtx4090(1).provenance.at("gated_delta_backward_updates_per_s").source.starts_with("ESTIMATE"));
  // A file from before the fields (the examples/profiles files before 2026-12-04) reads them as 0, not measured.
  const MachineProfile old = MachineProfile::from_file(OOM_SOURCE_DIR "/examples/profiles/h200-2026-12-03.json");
  CHECK(old.gated_delta_forward_updates_per_s == 0);
  CHECK(old.gated_delta_backward_updates_per_s == 0);
  SUBCASE("negative") {
    Json j = h200_json();
    j.set("gated_delta_forward_updates_per_s", -1);
    CHECK(profile_error(j) == "profile t.json: field gated_delta_forward_updates_per_s must be >= 0 (0: not measured), got -1");
  }
  SUBCASE("measured without provenance") {
    MachineProfile p = MachineProfile::h100_80gb(1);
    p.provenance.erase("gated_delta_backward_updates_per_s");
    CHECK_THROWS_WITH_AS(p.validate("x"), doctest::Contains("gated_delta_backward_updates_per_s has no provenance entry"), Error);
  }
  SUBCASE("priced: the measured rate, or a tensor-core scan where not measured, more tokens never less time") {
    const ProfileCostModel measured(h200);
    const auto fwd = Operation::delta_rule(false, 4096, 128, 128, 32), bwd = Operation::delta_rule(true, 4096, 128, 128, 32);
    CHECK(fwd.state_updates() == 4096.0 * 128 * 128 * 32);
    // The kernels' measured seconds at that shape come back (the launch aside).
    CHECK(measured.predict(fwd)[Resource::gpu_compute] == doctest::Approx(h200.launch_overhead_s + 1.95e-3));
    CHECK(measured.predict(bwd)[Resource::gpu_compute] == doctest::Approx(h200.launch_overhead_s + 5.93e-3));
    MachineProfile unmeasured = h200;
    unmeasured.gated_delta_forward_updates_per_s = unmeasured.gated_delta_backward_updates_per_s = 0;
    unmeasured.gated_delta_forward_parallel = unmeasured.gated_delta_backward_parallel = SizeCurve{};
    const ProfileCostModel scan(unmeasured);
    CHECK(scan.predict(bwd)[Resource::gpu_compute] > scan.predict(fwd)[Resource::gpu_compute]);
    CHECK(scan.predict(bwd)[Resource::gpu_compute] < measured.predict(bwd)[Resource::gpu_compute]);
    for (const ProfileCostModel* m : {&measured, &scan})
      CHECK(m->predict(Operation::delta_rule(true, 8192, 128, 128, 32))[Resource::gpu_compute] >=
            m->predict(bwd)[Resource::gpu_compute]);
  }
}

TEST_CASE("the CPU AdamW's bf16-moment rate: an estimate on the built-in H200, optional in a file, measured by oom-calibrate") {
  const MachineProfile h200 = MachineProfile::h200(1);
  // The H200 machine's CPU ran bf16 moments 1.29x as fast as fp32 ones (bench_adamw), short of the
  // 30 / 22 = 1.36x their bytes would give: the estimate says so.
  CHECK(h200.cpu_adamw_bf16_moments_params_per_s == doctest::Approx(h200.cpu_adamw_params_per_s * 6.35 / 4.92));
  CHECK(h200.cpu_adamw_bf16_moments_params_per_s < h200.cpu_adamw_params_per_s * 30.0 / 22.0);
  CHECK(h200.provenance.at("cpu_adamw_bf16_moments_params_per_s").source.starts_with("ESTIMATE"));
  // The estimated built-ins leave it unmeasured (the cost model scales their fp32 rate by bytes).
  CHECK(MachineProfile::h100_80gb(1).cpu_adamw_bf16_moments_params_per_s == 0);
  CHECK(MachineProfile::h100_80gb(1).provenance.count("cpu_adamw_bf16_moments_params_per_s") == 0);
  // Written and read back (0 too); a file from before the field (every examples/profiles file but
  // the H100's) reads 0.
  CHECK(MachineProfile::from_json(h200.to_json(), "t.json") == h200);
  CHECK(MachineProfile::from_json(MachineProfile::h100_80gb(1).to_json(), "t.json") == MachineProfile::h100_80gb(1));
  CHECK(MachineProfile::from_file(OOM_SOURCE_DIR "/examples/profiles/h200-2026-12-04.json").cpu_adamw_bf16_moments_params_per_s == 0);
  // Measured by oom-calibrate on an H100 machine: 1.25x its fp32-moment rate, short of the bytes' 1.36x.
  const MachineProfile h100 = MachineProfile::from_file(OOM_SOURCE_DIR "/examples/profiles/h100-2026-12-06.json");
  CHECK(h100.cpu_adamw_bf16_moments_params_per_s > h100.cpu_adamw_params_per_s);
  CHECK(h100.cpu_adamw_bf16_moments_params_per_s < h100.cpu_adamw_params_per_s * 30.0 / 22.0);
  CHECK(h100.provenance.at("cpu_adamw_bf16_moments_params_per_s").source.find("bf16 m/v") != std::string::npos);
  SUBCASE("negative") {
    Json j = h200_json();
    j.set("cpu_adamw_bf16_moments_params_per_s", -1);
    CHECK(profile_error(j) == "profile t.json: field cpu_adamw_bf16_moments_params_per_s must be >= 0 (0: not measured), got -1");
  }
  SUBCASE("measured without provenance") {
    MachineProfile p = h200;
    p.provenance.erase("cpu_adamw_bf16_moments_params_per_s");
    CHECK_THROWS_WITH_AS(p.validate("x"), doctest::Contains("cpu_adamw_bf16_moments_params_per_s has no provenance entry"), Error);
  }
}

TEST_CASE("attention at head dim 256: its own curves, measured on the built-in H200, optional in a file, priced by head dim") {
  const MachineProfile h200 = MachineProfile::h200(1);
  // The built-in's are the 2026-12-04 oom-calibrate run's (examples/profiles/h200-2026-12-04.json).
  const MachineProfile measured = MachineProfile::from_file(OOM_SOURCE_DIR "/examples/profiles/h200-2026-12-04.json");
  for (double s : {4096.0, 8192.0, 16384.0, 32768.0, 65536.0, 131072.0}) {
    CAPTURE(s);
    CHECK(h200.attention_forward_flops_d256.at(s) == doctest::Approx(measured.attention_forward_flops_d256.at(s)).epsilon(0.01));
    CHECK(h200.attention_backward_flops_d256.at(s) == doctest::Approx(measured.attention_backward_flops_d256.at(s)).epsilon(0.01));
  }
  CHECK(measured.provenance.at("attention_backward_flops_d256").source.find("head dim 256") != std::string::npos);
  CHECK(h200.provenance.at("attention_backward_flops_d256").source.find("head dim 256") != std::string::npos);
  CHECK(MachineProfile::rtx4090(1).provenance.at("attention_forward_flops_d256").source.starts_with("ESTIMATE"));
  // Priced by the op's head dim: 256 at its own (slower backward) rate, 128 at the usual one, and
  // without the curves (a file from before them) 256 at the head-dim-128 rate.
  const ProfileCostModel model(h200);
  const auto bwd = [](std::uint64_t head_dim) { return Operation::attention(true, 65536, 65536, head_dim, 16); };
  const double t128 = model.predict(bwd(128))[Resource::gpu_compute], t256 = model.predict(bwd(256))[Resource::gpu_compute];
  CHECK(t256 / 2 > t128);  // twice the FLOPs at a lower rate
  CHECK(t256 == doctest::Approx(h200.launch_overhead_s + bwd(256).flops() / h200.attention_backward_flops_d256.at(65536)));
  const MachineProfile old = MachineProfile::from_file(OOM_SOURCE_DIR "/examples/profiles/h200-2026-12-03.json");
  CHECK(old.attention_backward_flops_d256.empty());
  CHECK(old.to_json().dump().find("attention_backward_flops_d256") == std::string::npos);
  const ProfileCostModel without(old);
  CHECK(without.predict(bwd(256))[Resource::gpu_compute] ==
        doctest::Approx(old.launch_overhead_s + bwd(256).flops() / old.attention_backward_flops.at(65536)));
  // Written back and read again with the rest.
  CHECK(MachineProfile::from_json(h200.to_json(), "t.json").attention_forward_flops_d256 == h200.attention_forward_flops_d256);
  // The pair goes together: one without the other is refused, naming the missing one.
  MachineProfile half = h200;
  half.attention_backward_flops_d256 = SizeCurve{};
  CHECK_THROWS_WITH_AS(half.validate("x"), doctest::Contains("attention_backward_flops_d256 is missing"), Error);
  // The built-in's head-dim-256 provenance says what was measured, and when.
  CHECK(h200.provenance.at("attention_forward_flops_d256").source.find("head dim 256") != std::string::npos);
  CHECK(h200.provenance.at("attention_forward_flops_d256").date == "2026-12-04");
}

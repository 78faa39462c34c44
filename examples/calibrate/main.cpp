// oom-calibrate: measures the machine it runs on (PCIe links, device memory, cuBLAS GEMM by size, a
// OOM's flash attention, launch overhead, OOM's CPU AdamW, host memory copy, NCCL collectives) and writes a
// MachineProfile JSON with the provenance of every constant. Every measurement is printed as it
// finishes, with its ratio to the built-in h200 profile, and checked where it can be; a failed
// check writes no profile.
//
//   oom-calibrate [--out profile.json] [--name NAME] [--quick] [--gpus N] [--host-memory SIZE]
//
// Exit status: 0 written, 1 a measurement or check failed, 2 no GPU or bad arguments.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "common/cli_numbers.hpp"
#include "common/output_path.hpp"
#include "oom/core/bytes.hpp"
#include "oom/core/error.hpp"
#include "oom/cuda/calibrate.hpp"
#include "oom/cuda/device.hpp"
#include "oom/io/atomic_file.hpp"
#include "oom/io/json.hpp"
#include "oom/optim/cpu_adamw.hpp"
#include "oom/plan/machine_profile.hpp"

namespace {

using namespace oom;
using namespace oom::literals;

constexpr const char* kUsage =
    "usage: oom-calibrate [--out profile.json] [--name NAME] [--quick] [--gpus N] [--host-memory SIZE]\n"
    "  --out PATH          where to write the profile (default: profile.json)\n"
    "  --name NAME         the profile's name (default: from the GPU name, e.g. nvidia-h200)\n"
    "  --quick             fewer repetitions and sizes (~1 minute); for a smoke test, not a profile to plan with\n"
    "  --gpus N            use GPUs 0..N-1 (default: all visible)\n"
    "  --host-memory SIZE  usable host RAM, e.g. 251GiB (default: physical pages from sysconf; on VMs whose\n"
    "                      memory grows as it is used, MemTotal starts low: pass the real limit; bytes, or a\n"
    "                      number with a unit, KiB to PiB or KB to PB, e.g. 3.5TiB; a fraction of a byte is rounded down)\n";

struct Options {
  std::string out = "profile.json";
  std::string name;
  bool quick = false;
  int gpus = 0;  // 0: all visible
  std::optional<Bytes> host_memory;
  std::string command;
};

struct UsageError {
  std::string what;
};

Options parse_args(int argc, char** argv) {
  Options o;
  o.command = "oom-calibrate";
  for (int i = 1; i < argc; ++i) o.command += std::string(" ") + argv[i];
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError{a + " needs a value"};
      return argv[++i];
    };
    if (a == "--out") o.out = value();
    else if (a == "--name") {
      if ((o.name = value()).empty()) throw UsageError{"--name must not be empty"};
    }
    else if (a == "--quick") o.quick = true;
    else if (a == "--gpus") {
      const std::string v = value();
      try {
        o.gpus = oom::examples::parse_int_count(a, v);  // digits alone: stoi took " 2" and "+2"
      } catch (const Error& e) {
        throw UsageError{e.message()};
      }
    } else if (a == "--host-memory") {
      const std::string v = value();
      try {
        o.host_memory = parse_bytes(v);
      } catch (const Error& e) {
        throw UsageError{"--host-memory: " + e.message()};
      }
    } else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else {
      throw UsageError{"unknown argument \"" + a + "\""};
    }
  }
  // Refused now, not after minutes of measurement.
  if (o.host_memory && o.host_memory->count() == 0) throw UsageError{"--host-memory must be more than 0"};
  try {
    oom::examples::require_output_file("--out", o.out);
  } catch (const Error& e) {
    throw UsageError{e.message()};
  }
  return o;
}

std::string today_iso() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", &tm);
  return buf;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown CPU";
}

std::string slug(std::string s) {
  std::string out;
  for (char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (std::isalnum(u)) out += static_cast<char>(std::tolower(u));
    else if (!out.empty() && out.back() != '-') out += '-';
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out.empty() ? "calibrated" : out;
}

/// Progress lines: "[3/12] HBM copy 2 GiB ... 4.31 TB/s (1.00x h200 default)".
class Progress {
 public:
  explicit Progress(int total) : total_(total) {}
  void begin(const std::string& what) {
    fmt::print("[{:>2}/{}] {} ... ", ++step_, total_, what);
    std::fflush(stdout);
    t0_ = std::chrono::steady_clock::now();
  }
  void end(const std::string& result, double measured = 0, double reference = 0) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    std::string ratio;
    if (reference > 0 && measured > 0) ratio = fmt::format(" ({:.2f}x h200 default)", measured / reference);
    fmt::print("{}{} [{:.1f} s]\n", result, ratio, s);
    std::fflush(stdout);
  }
  void note(const std::string& line) {
    fmt::print("        {}\n", line);
    std::fflush(stdout);
  }

 private:
  int total_;
  int step_ = 0;
  std::chrono::steady_clock::time_point t0_;
};

std::string gbps(double b) { return fmt::format("{:.1f} GB/s", b / 1e9); }
std::string tflops(double f) { return fmt::format("{:.1f} TFLOP/s", f / 1e12); }

struct HostCopy {
  double bytes_per_s = 0;
  bool verified = false;
  int threads = 0;
};

/// memcpy of `size` bytes split over all cores, each thread copying the slice it first touched (so
/// pages sit on its NUMA node); bytes read + written counted, median of `repeats`.
HostCopy measure_host_copy(Bytes size, int repeats) {
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const std::size_t n = size.count();
  std::unique_ptr<unsigned char[]> src(new unsigned char[n]), dst(new unsigned char[n]);
  auto parallel = [&](auto&& body) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        const std::size_t lo = n * t / threads, hi = n * (t + 1) / threads;
        body(lo, hi);
      });
    for (auto& th : pool) th.join();
  };
  parallel([&](std::size_t lo, std::size_t hi) {
    for (std::size_t i = lo; i < hi; ++i) src[i] = static_cast<unsigned char>(i * 131 >> 3);
    std::memset(dst.get() + lo, 0, hi - lo);
  });
  std::vector<double> t;
  for (int r = -1; r < repeats; ++r) {  // r = -1: warm-up
    const auto t0 = std::chrono::steady_clock::now();
    parallel([&](std::size_t lo, std::size_t hi) { std::memcpy(dst.get() + lo, src.get() + lo, hi - lo); });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r >= 0) t.push_back(s);
  }
  std::sort(t.begin(), t.end());
  HostCopy out;
  out.threads = threads;
  out.bytes_per_s = 2.0 * static_cast<double>(n) / t[t.size() / 2];
  out.verified = std::memcmp(src.get(), dst.get(), n) == 0;
  return out;
}

struct CpuAdamw {
  double params_per_s = 0;
  bool verified = false;
  int threads = 0;
  std::string isa;
};

/// OOM's CPU AdamW (fp32 master, moments of type M: fp32, or bf16 as with --moments bf16; bf16
/// weights written out, as the trainer runs it) over `params` parameters on all cores, median of
/// `repeats` steps after one warm-up step. The warm-up step is checked against adamw_element, the
/// per-element definition, at a few indices.
template <class M>
CpuAdamw measure_cpu_adamw(std::size_t params, int repeats) {
  using namespace oom::optim;
  std::vector<float> master(params), g(params);
  std::vector<M> m(params), v(params);
  const auto moment = [](float x) {
    if constexpr (std::is_same_v<M, float>) return x;
    else return to_bf16(x);
  };
  const auto widen = [](M x) {
    if constexpr (std::is_same_v<M, float>) return x;
    else return to_float(x);
  };
  for (std::size_t i = 0; i < params; ++i) {
    master[i] = static_cast<float>((i * 2654435761u) % 2001) * 1e-3f - 1.0f;
    m[i] = moment(1e-3f * static_cast<float>(i % 7));
    v[i] = moment(1e-6f * static_cast<float>(i % 5));
    g[i] = static_cast<float>((i * 40503u) % 1001) * 1e-5f - 5e-3f;
  }
  std::vector<bf16> out(params);
  // The threads the CUDA executor gives it: all but one (CudaCausalLmOptions::cpu_threads).
  ThreadPool pool(optimizer_threads());
  const AdamWSpan<M> span{master, m, v, g, out};
  const std::size_t probes[] = {0, params / 3, params - 1};
  struct Saved { float p, m, v, g; };
  std::vector<Saved> saved;
  for (std::size_t i : probes) saved.push_back({master[i], widen(m[i]), widen(v[i]), g[i]});
  const AdamWConfig config;
  adamw_update(span, adamw_step_scalars(config, 1), pool);
  bool ok = true;
  const AdamWStepScalars s1 = adamw_step_scalars(config, 1);
  for (std::size_t k = 0; k < saved.size(); ++k) {
    float p = saved[k].p, mm = saved[k].m, vv = saved[k].v;
    adamw_element(s1, p, mm, vv, saved[k].g);
    const std::size_t i = probes[k];
    // The kernels promise the element's exact bits (bf16 moments stored rounded to nearest even);
    // allow a few fp32 ulps, and one ulp of what is stored in bf16 (an fp32 ulp before rounding
    // can move it a whole bf16 ulp), so a benign difference in a future ISA does not void a whole
    // calibration, while a wrong kernel is still caught.
    auto near = [](float a, float b, float rel) { return std::fabs(a - b) <= rel * std::max(1e-30f, std::fabs(b)); };
    const float fp32_rel = 1e-6f, bf16_rel = 1.0f / 128;
    const float moment_rel = std::is_same_v<M, float> ? fp32_rel : bf16_rel;
    ok = ok && near(master[i], p, fp32_rel) && near(widen(m[i]), widen(moment(mm)), moment_rel) &&
         near(widen(v[i]), widen(moment(vv)), moment_rel) && near(to_float(out[i]), to_float(to_bf16(p)), bf16_rel);
  }
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    adamw_update(span, adamw_step_scalars(config, 2 + r), pool);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  CpuAdamw r;
  r.params_per_s = static_cast<double>(params) / t[t.size() / 2];
  r.verified = ok;
  r.threads = static_cast<int>(pool.size());
  r.isa = to_string(active_cpu_isa());
  return r;
}

int run(const Options& opt) {
  const int visible = cuda::device_count();
  if (visible == 0) {
    const cuda::NoDevice why = cuda::why_no_device();
    const std::string_view remedy = cuda::no_device_remedy(why.kind);
    fmt::print(stderr, "oom-calibrate: no usable NVIDIA GPU: {}.\n{}\n", why.reason,
               !remedy.empty() ? fmt::format("To measure this machine's GPUs, {}.", remedy)
               : why.kind == cuda::NoDevice::Kind::other
                   ? std::string("oom-calibrate measures the GPUs this process can use; the CUDA error says why it has none.")
                   : std::string("oom-calibrate measures the GPUs of the machine it runs on; run it on the GPU machine."));
    return 2;
  }
  const int gpus = opt.gpus ? opt.gpus : visible;
  if (gpus > visible) {
    fmt::print(stderr, "oom-calibrate: --gpus {} but only {} GPU(s) are visible\n", gpus, visible);
    return 2;
  }

  const auto dev0 = cuda::device_info(0);
  const std::string today = today_iso();
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const std::string machine = fmt::format("{}x {}, {}, {} cores", gpus, dev0.name, cpu_model(), cores);
  const MachineProfile ref = MachineProfile::h200(std::min(gpus, 8));

  const bool q = opt.quick;
  const int reps = q ? 3 : 10;
  const Bytes copy_size = q ? 64_MiB : 256_MiB;
  const Bytes hbm_size = q ? 512_MiB : 2_GiB;
  const std::vector<std::int64_t> gemm_m = {16, 64, 256, 1024, 4096, 16384, 65536};
  const std::vector<std::int64_t> attn_seq = q ? std::vector<std::int64_t>{4096, 16384}
                                               : std::vector<std::int64_t>{4096, 8192, 16384, 32768, 65536, 131072};
  constexpr int kQHeads = 16, kKvHeads = 4, kHeadDim = 128;

  fmt::print("oom-calibrate{}: {} on {}\n", q ? " (quick: not for planning)" : "", machine, today);
  fmt::print("ratios are to the built-in h200 profile (measured 2026-11-30 on our 1x H200 machine)\n\n");
  std::fflush(stdout);

  MachineProfile p;
  p.name = opt.name.empty() ? (gpus > 1 ? fmt::format("{}-x{}", slug(dev0.name), gpus) : slug(dev0.name)) : opt.name;
  p.gpus = gpus;
  auto measured = [&](const std::string& field, const std::string& how) {
    p.provenance[field] = Provenance{opt.command + ": " + how, machine, today};
  };
  std::vector<std::string> failures;
  auto check = [&](bool ok, const std::string& what) {
    if (!ok) failures.push_back(what);
    return ok ? "" : "  CHECK FAILED";
  };

  const int steps = 14 + (gpus > 1 ? 1 : 0);  // the progress.begin() calls below
  Progress progress(steps);

  // GPU memory: free after the context exists, the smallest over the GPUs used.
  progress.begin("GPU memory (cudaMemGetInfo free after context creation)");
  Bytes gpu_free = dev0.free_memory;
  for (int d = 1; d < gpus; ++d) gpu_free = min(gpu_free, cuda::device_info(d).free_memory);
  p.gpu_memory = gpu_free;
  measured("gpu_memory", fmt::format("cudaMemGetInfo free after context creation, min over {} GPU(s), total {}",
                                     gpus, to_string(dev0.total_memory)));
  progress.end(to_string(gpu_free), static_cast<double>(gpu_free.count()), static_cast<double>(ref.gpu_memory.count()));

  progress.begin("host memory");
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  const Bytes phys{static_cast<std::uint64_t>(std::max(0L, pages)) * static_cast<std::uint64_t>(std::max(0L, page))};
  p.host_memory = opt.host_memory.value_or(phys);
  measured("host_memory", opt.host_memory ? "--host-memory as given (sysconf physical pages read " + to_string(phys) + ")"
                                          : "sysconf(_SC_PHYS_PAGES) x page size");
  progress.end(to_string(p.host_memory), static_cast<double>(p.host_memory.count()),
               static_cast<double>(ref.host_memory.count()));
  if (!opt.host_memory && p.host_memory < ref.host_memory / 2)
    progress.note(fmt::format("note: reads less than half the h200 default ({}); on a VM whose memory grows as it is "
                              "used this is too low: pass --host-memory",
                              to_string(ref.host_memory)));

  // PCIe: every GPU's own link; the profile keeps the slowest (one GPU in a slower slot bounds the step).
  progress.begin(fmt::format("pinned/pageable copies, {} x {} per direction, {} GPU(s)", to_string(copy_size), reps,
                             q ? 1 : gpus));
  cuda::CopyBandwidth pcie = cuda::measure_copy_bandwidth(0, copy_size, reps);
  bool pcie_ok = pcie.verified;
  for (int d = 1; d < (q ? 1 : gpus); ++d) {
    const auto o = cuda::measure_copy_bandwidth(d, copy_size, reps);
    pcie_ok = pcie_ok && o.verified;
    pcie.h2d_bytes_per_s = std::min(pcie.h2d_bytes_per_s, o.h2d_bytes_per_s);
    pcie.d2h_bytes_per_s = std::min(pcie.d2h_bytes_per_s, o.d2h_bytes_per_s);
    pcie.bidir_bytes_per_s = std::min(pcie.bidir_bytes_per_s, o.bidir_bytes_per_s);
    pcie.pageable_h2d_bytes_per_s = std::min(pcie.pageable_h2d_bytes_per_s, o.pageable_h2d_bytes_per_s);
  }
  p.h2d_bytes_per_s = pcie.h2d_bytes_per_s;
  p.d2h_bytes_per_s = pcie.d2h_bytes_per_s;
  p.bidir_bytes_per_s = pcie.bidir_bytes_per_s;
  p.pageable_h2d_bytes_per_s = pcie.pageable_h2d_bytes_per_s;
  const std::string copy_how = fmt::format("measure_copy_bandwidth {} x {}, min over GPUs", to_string(copy_size), reps);
  measured("h2d_bytes_per_s", copy_how + ", pinned host to device");
  measured("d2h_bytes_per_s", copy_how + ", device to pinned host");
  measured("bidir_bytes_per_s", copy_how + ", both directions at once, both counted");
  measured("pageable_h2d_bytes_per_s", copy_how + ", pageable host to device");
  progress.end(fmt::format("H2D {}, D2H {}, both {}, pageable {}{}", gbps(pcie.h2d_bytes_per_s), gbps(pcie.d2h_bytes_per_s),
                           gbps(pcie.bidir_bytes_per_s), gbps(pcie.pageable_h2d_bytes_per_s),
                           check(pcie_ok, "pinned copy round trip")),
               pcie.h2d_bytes_per_s, ref.h2d_bytes_per_s);

  progress.begin(gpus > 1 ? fmt::format("all {} GPUs' host links at once", gpus) : "host link total (one GPU: its bidirectional rate)");
  if (gpus > 1) {
    const auto link = cuda::measure_host_link_total(gpus, copy_size, reps);
    p.host_link_total_bytes_per_s = link.bytes_per_s;
    measured("host_link_total_bytes_per_s",
             fmt::format("measure_host_link_total: {} GPUs, pinned {} both directions at once, x 4 per round, median of {}",
                         gpus, to_string(copy_size), reps));
  } else {
    p.host_link_total_bytes_per_s = p.bidir_bytes_per_s;
    measured("host_link_total_bytes_per_s", copy_how + ", both directions at once (one GPU)");
  }
  progress.end(gbps(p.host_link_total_bytes_per_s), p.host_link_total_bytes_per_s, ref.host_link_total_bytes_per_s);

  progress.begin(fmt::format("HBM device-to-device copy {}", to_string(hbm_size)));
  const auto hbm = cuda::measure_hbm_bandwidth(0, hbm_size, reps);
  p.hbm_bytes_per_s = hbm.bytes_per_s;
  measured("hbm_bytes_per_s", fmt::format("measure_hbm_bandwidth cudaMemcpyAsync device to device {}, bytes read + "
                                          "written, median of {}", to_string(hbm_size), reps));
  progress.end(fmt::format("{:.2f} TB/s{}", hbm.bytes_per_s / 1e12, check(hbm.verified, "HBM copy content")),
               hbm.bytes_per_s, ref.hbm_bytes_per_s);

  progress.begin("launch overhead (empty kernel, 4 KiB pinned copy)");
  const auto launch = cuda::measure_launch_overhead(0, 1000, reps);
  p.launch_overhead_s = std::max(launch.kernel_s, launch.small_copy_s);
  measured("launch_overhead_s", fmt::format("measure_launch_overhead: max(empty kernel {:.2f} us, 4 KiB H2D copy {:.2f} "
                                            "us), 1000 issued back to back, median of {}",
                                            launch.kernel_s * 1e6, launch.small_copy_s * 1e6, reps));
  progress.end(fmt::format("kernel {:.2f} us, small copy {:.2f} us", launch.kernel_s * 1e6, launch.small_copy_s * 1e6),
               p.launch_overhead_s, ref.launch_overhead_s);

  progress.begin("cuBLAS bf16 GEMM (fp32 accumulate) by m at n = k = 2048, and 8192^3");
  fmt::print("\n");
  std::vector<std::pair<double, double>> gemm_samples;
  bool gemm_ok = true;
  for (std::int64_t m : gemm_m) {
    const auto g = cuda::measure_gemm_bf16(0, m, 2048, 2048, reps);
    gemm_ok = gemm_ok && g.verified;
    gemm_samples.emplace_back(static_cast<double>(m), g.flops_per_s);
    progress.note(fmt::format("m = {:>6}: {:>8} ({:.2f}x h200 default){}", m, tflops(g.flops_per_s),
                              g.flops_per_s / ref.gemm_flops.at(static_cast<double>(m)),
                              check(g.verified, fmt::format("GEMM m={} result", m))));
  }
  const auto square = cuda::measure_gemm_bf16(0, 8192, 8192, 8192, reps);
  gemm_ok = gemm_ok && square.verified;
  progress.note(fmt::format("8192^3   : {:>8} ({:.2f}x the 799 TFLOP/s measured 2026-11-30){}", tflops(square.flops_per_s),
                            square.flops_per_s / 799e12, check(square.verified, "GEMM 8192^3 result")));
  p.gemm_flops = SizeCurve(gemm_samples);
  measured("gemm_flops", fmt::format("measure_gemm_bf16 cublasGemmEx bf16 in/out, CUBLAS_COMPUTE_32F, C = A W^T, "
                                     "n = k = 2048, m = 16..65536, median of {}; 8192^3 ran at {:.1f} TFLOP/s",
                                     reps, square.flops_per_s / 1e12));
  progress.end(gemm_ok ? "done, results checked" : "done  CHECK FAILED");

  // OOM's flash attention at each length, forward and backward timed alone: the head-dim-128
  // curves every model uses, then head dim 256's (Qwen3-Next's and Qwen3.5's full attention).
  const auto attention_curves = [&](int q_heads, int kv_heads, int head_dim, const SizeCurve& ref_forward,
                                    const SizeCurve& ref_backward) {
    progress.begin(fmt::format("OOM flash attention forward + backward, causal GQA {}/{} heads, hd {}", q_heads, kv_heads, head_dim));
    fmt::print("\n");
    std::vector<std::pair<double, double>> forward, backward;
    for (std::int64_t s : attn_seq) {
      // Q, O, dO, dQ and K, V, dK, dV in bf16, plus the LSE and the backward's workspace.
      const double need = 2.0 * 4 * static_cast<double>(s) * (q_heads + kv_heads) * head_dim + 12.0 * q_heads * static_cast<double>(s);
      if (need > 0.8 * static_cast<double>(p.gpu_memory.count())) {
        progress.note(fmt::format("seq {:>6}: skipped, needs {} of {}", s, to_string(Bytes{static_cast<std::uint64_t>(need)}),
                                  to_string(p.gpu_memory)));
        continue;
      }
      const auto a = cuda::measure_flash_attention(0, s, q_heads, kv_heads, head_dim, q ? 2 : 3);
      forward.emplace_back(static_cast<double>(s), a.forward_flops_per_s);
      backward.emplace_back(static_cast<double>(s), a.backward_flops_per_s);
      const double key = static_cast<double>(s);
      const auto against = [&](double rate, const SizeCurve& ref) {
        return ref.empty() ? std::string() : fmt::format(" ({:.2f}x h200 default)", rate / ref.at(key));
      };
      progress.note(fmt::format("seq {:>6}: forward {:>8}{}, backward {:>8}{}, together {} in {:.1f} ms", s,
                                tflops(a.forward_flops_per_s), against(a.forward_flops_per_s, ref_forward),
                                tflops(a.backward_flops_per_s), against(a.backward_flops_per_s, ref_backward), tflops(a.flops_per_s),
                                a.seconds * 1e3));
    }
    if (forward.empty()) OOM_THROW(Errc::out_of_budget, "no attention size fits this GPU's memory");
    progress.end("done");
    const std::string how = fmt::format(
        "measure_flash_attention: OOM's flash attention kernel, the {{}} timed alone, causal GQA {}/{} heads, head dim {}, "
        "batch 1; FLOPs = {{}} x causal forward (2 S^2 heads head_dim)",
        q_heads, kv_heads, head_dim);
    return std::tuple{SizeCurve(forward), SizeCurve(backward), how};
  };
  {
    auto [forward, backward, how] = attention_curves(kQHeads, kKvHeads, kHeadDim, ref.attention_forward_flops, ref.attention_backward_flops);
    p.attention_forward_flops = std::move(forward);
    p.attention_backward_flops = std::move(backward);
    measured("attention_forward_flops", fmt::format(fmt::runtime(how), "forward", 1));
    measured("attention_backward_flops", fmt::format(fmt::runtime(how), "backward", 2.5));
  }
  // Optional in a profile: a GPU whose kernels do not take head dim 256 leaves them out (the cost
  // model then prices that head dim at the curves above).
  try {
    auto [forward, backward, how] =
        attention_curves(16, 2, 256, ref.attention_forward_flops_d256, ref.attention_backward_flops_d256);
    p.attention_forward_flops_d256 = std::move(forward);
    p.attention_backward_flops_d256 = std::move(backward);
    measured("attention_forward_flops_d256", fmt::format(fmt::runtime(how), "forward", 1));
    measured("attention_backward_flops_d256", fmt::format(fmt::runtime(how), "backward", 2.5));
  } catch (const Error& e) {
    if (e.code() != Errc::unsupported) throw;
    progress.end(fmt::format("not measured: {} (head dim 256 priced at head dim 128's curves)", e.message()));
  }

  // The hybrid models' linear attention: the Qwen3-Next-80B linear layer's shape.
  constexpr std::int64_t kDeltaTokens = 4096;
  constexpr int kDeltaKHeads = 16, kDeltaVHeads = 32, kDeltaDim = 128;
  progress.begin(fmt::format("gated delta rule, {} tokens, {}/{} heads of {}", kDeltaTokens, kDeltaKHeads, kDeltaVHeads, kDeltaDim));
  const auto gd = cuda::measure_gated_delta(0, kDeltaTokens, kDeltaKHeads, kDeltaVHeads, kDeltaDim, q ? 3 : 7);
  p.gated_delta_forward_updates_per_s = gd.forward_updates_per_s;
  p.gated_delta_backward_updates_per_s = gd.backward_updates_per_s;
  const std::string delta_how = fmt::format(
      "measure_gated_delta: OOM's recurrent gated delta rule, the {{}} timed alone ({{:.2f}} ms, median of {}), 1 x {} tokens, "
      "{}/{} heads of {}, chunk 64; updates = tokens x v_heads x head_dim^2",
      gd.repeats, kDeltaTokens, kDeltaKHeads, kDeltaVHeads, kDeltaDim);
  measured("gated_delta_forward_updates_per_s", fmt::format(fmt::runtime(delta_how), "forward", gd.forward_seconds * 1e3));
  measured("gated_delta_backward_updates_per_s", fmt::format(fmt::runtime(delta_how), "backward", gd.backward_seconds * 1e3));
  progress.end(fmt::format("forward {:.2f} ms ({:.2f}x h200 default), backward {:.2f} ms ({:.2f}x){}", gd.forward_seconds * 1e3,
                           gd.forward_updates_per_s / ref.gated_delta_forward_updates_per_s, gd.backward_seconds * 1e3,
                           gd.backward_updates_per_s / ref.gated_delta_backward_updates_per_s,
                           check(gd.verified, "gated delta rule outputs finite")));
  // By recurrences side by side (sequences x value heads): the same layer at 2, 4 and 8 sequences
  // (2 and 4 with --quick), the first point the one sequence above.
  {
    const int most = q ? 4 : 8;
    progress.begin(fmt::format("gated delta rule side by side, 2..{} sequences of {} tokens", most, kDeltaTokens));
    std::vector<std::pair<double, double>> forward{{kDeltaVHeads, gd.forward_updates_per_s}}, backward{{kDeltaVHeads, gd.backward_updates_per_s}};
    std::string times = fmt::format("1: {:.2f} / {:.2f}", gd.forward_seconds * 1e3, gd.backward_seconds * 1e3);
    bool finite = gd.verified;
    for (int b = 2; b <= most; b *= 2) {
      const auto r = cuda::measure_gated_delta(0, kDeltaTokens, kDeltaKHeads, kDeltaVHeads, kDeltaDim, q ? 3 : 7, b);
      forward.emplace_back(static_cast<double>(b) * kDeltaVHeads, r.forward_updates_per_s);
      backward.emplace_back(static_cast<double>(b) * kDeltaVHeads, r.backward_updates_per_s);
      times += fmt::format(", {}: {:.2f} / {:.2f}", b, r.forward_seconds * 1e3, r.backward_seconds * 1e3);
      finite = finite && r.verified;
    }
    p.gated_delta_forward_parallel = SizeCurve(forward);
    p.gated_delta_backward_parallel = SizeCurve(backward);
    const std::string how = fmt::format(
        "measure_gated_delta at 1..{} sequences of {} tokens, {}/{} heads of {}, the {{}} timed alone (median of {}), keyed by "
        "sequences x v_heads; sequences: forward / backward ms {}",
        most, kDeltaTokens, kDeltaKHeads, kDeltaVHeads, kDeltaDim, q ? 3 : 7, times);
    measured("gated_delta_forward_parallel", fmt::format(fmt::runtime(how), "forward"));
    measured("gated_delta_backward_parallel", fmt::format(fmt::runtime(how), "backward"));
    progress.end(fmt::format("ms forward / backward by sequences: {}{}", times, check(finite, "gated delta rule outputs finite")));
  }

  const Bytes host_copy_size = q ? 512_MiB : 2_GiB;
  progress.begin(fmt::format("host memcpy {}, all cores", to_string(host_copy_size)));
  const auto hc = measure_host_copy(host_copy_size, q ? 3 : 7);
  p.host_copy_bytes_per_s = hc.bytes_per_s;
  measured("host_copy_bytes_per_s", fmt::format("memcpy of {} split over {} threads, bytes read + written, median of {}",
                                                to_string(host_copy_size), hc.threads, q ? 3 : 7));
  progress.end(gbps(hc.bytes_per_s) + check(hc.verified, "host memcpy content"), hc.bytes_per_s, ref.host_copy_bytes_per_s);

  const std::size_t adamw_params = q ? (std::size_t{1} << 23) : (std::size_t{1} << 26);
  // OOM's CPU AdamW with moments of type M: measured, recorded as `field` with its provenance,
  // printed with its rate in bytes moved (`bytes` a parameter) and `extra`.
  const auto cpu_adamw = [&]<class M>(const char* field, const char* moments, const char* layout, double bytes, double MachineProfile::*member,
                                      const std::function<std::string(double)>& extra) {
    progress.begin(fmt::format("CPU AdamW, {}M parameters, {}, bf16 weights out", adamw_params >> 20, moments));
    const auto aw = measure_cpu_adamw<M>(adamw_params, q ? 3 : 7);
    p.*member = aw.params_per_s;
    measured(field, fmt::format("oom::optim::adamw_update {} on {} threads, {} parameters ({}, fp32 grads, bf16 weights out: ~{:.0f} "
                                "bytes per parameter), median of {} steps",
                                aw.isa, aw.threads, adamw_params, layout, bytes, q ? 3 : 7));
    progress.end(fmt::format("{:.2f} G params/s ({} moved at {:.0f} B/param; {}){}", aw.params_per_s / 1e9,
                             gbps(aw.params_per_s * bytes), bytes, extra(aw.params_per_s),
                             check(aw.verified, fmt::format("CPU AdamW result, {}", moments))),
                 aw.params_per_s, ref.*member);
    return aw.params_per_s;
  };
  const double fp32_rate = cpu_adamw.operator()<float>(
      "cpu_adamw_params_per_s", "fp32 master and moments", "fp32 master/m/v", 30, &MachineProfile::cpu_adamw_params_per_s,
      [](double) { return std::string("PyTorch's foreach AdamW: 0.82 G"); });
  (void)cpu_adamw.operator()<bf16>("cpu_adamw_bf16_moments_params_per_s", "fp32 master, bf16 moments (--moments bf16)",
                                   "fp32 master, bf16 m/v", 22, &MachineProfile::cpu_adamw_bf16_moments_params_per_s,
                                   [&](double rate) {
                                     return fmt::format("{:.2f}x the fp32 moments' rate, {:.2f}x by the bytes", rate / fp32_rate,
                                                        30.0 / 22.0);
                                   });

  if (gpus > 1) {
    const Bytes coll = q ? 64_MiB : 512_MiB;
    progress.begin(fmt::format("NCCL all-reduce and all-to-all, {} per GPU, {} GPUs (NVLS off)", to_string(coll), gpus));
    const auto c = cuda::measure_collectives(gpus, coll, reps);
    p.all_reduce_bytes_per_s = c.all_reduce_bus_bytes_per_s;
    p.all_to_all_bytes_per_s = c.all_to_all_bytes_per_s;
    measured("all_reduce_bytes_per_s",
             fmt::format("measure_collectives ncclAllReduce float sum {} per GPU, {} GPUs, bus bandwidth = algbw x "
                         "2(n-1)/n, NCCL_NVLS_ENABLE=0, median of {}", to_string(c.size), gpus, reps));
    measured("all_to_all_bytes_per_s",
             fmt::format("measure_collectives grouped ncclSend/ncclRecv {} per GPU, {} GPUs, bytes each GPU sends to "
                         "others per second, median of {}", to_string(c.size), gpus, reps));
    progress.end(fmt::format("all-reduce bus {}, all-to-all {}{}", gbps(c.all_reduce_bus_bytes_per_s),
                             gbps(c.all_to_all_bytes_per_s), check(c.verified, "NCCL results")),
                 c.all_reduce_bus_bytes_per_s, ref.all_reduce_bytes_per_s);
  } else {
    p.provenance["all_to_all_bytes_per_s"] = Provenance{"one GPU: no collective", machine, today};
    p.provenance["all_reduce_bytes_per_s"] = Provenance{"one GPU: no collective", machine, today};
  }

  fmt::print("\n");
  if (!failures.empty()) {
    fmt::print(stderr, "oom-calibrate: {} check(s) failed, no profile written:\n", failures.size());
    for (const auto& f : failures) fmt::print(stderr, "  - {}\n", f);
    return 1;
  }
  p.validate(opt.out);
  write_file_atomically(opt.out, p.to_json().dump(2) + "\n");  // an existing profile stays whole if the write fails
  // Read it back: what the planner will load must be what was measured.
  if (!(MachineProfile::from_file(opt.out) == p))
    OOM_THROW(Errc::internal, opt.out + " does not read back equal to the measured profile");
  fmt::print("wrote {} (profile \"{}\", {} GPU(s)){}\n", opt.out, p.name, gpus,
             q ? "; --quick: fewer repetitions, use a full run for planning" : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  oom::examples::fail_oversized_writes_with_errors();
  Options opt;
  try {
    opt = parse_args(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "oom-calibrate: %s\n%s", e.what.c_str(), kUsage);
    return 2;
  }
  try {
    return run(opt);
  } catch (const oom::Error& e) {
    std::fprintf(stderr, "\noom-calibrate: %s\n", oom::user_message(e).c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\noom-calibrate: %s\n", e.what());
    return 1;
  }
}

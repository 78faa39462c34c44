// A checkpoint's save rate (save_checkpoint: the weights and two moments in fp32, with checksums)
// against the disk's own rate in the same run: the same bytes written by plain write() calls of
// 8 MiB and one fsync, into the same directory. `ratio` is save over disk, so the figure transfers
// between machines as a fraction of what their disk takes.
// Usage: bench_checkpoint [--layers=N] [--dir=PATH] [google benchmark flags]
//   --layers  decoder layers of the 5.13B configuration's widths (default 1: 5.32 GB of state;
//             the state is held in host memory, so keep it below a third of it)
//   --dir     where to write (default: the system's temp directory); removed afterwards
#include <benchmark/benchmark.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "oom/io/checkpoint.hpp"
#include "oom/io/json.hpp"
#include "oom/model/model_spec.hpp"

using namespace oom;
namespace fs = std::filesystem;

namespace {

int g_layers = 1;
fs::path g_dir;

struct State {
  ModelSpec spec;
  std::string config;
  std::vector<SegmentOptimizerState> segments;
  std::uint64_t bytes = 0;  // of the three fp32 arrays
};

const State& state() {
  static const State s = [] {
    Json cfg = read_json_file(fs::path(OOM_SOURCE_DIR) / "examples/configs/moe-5b.json");
    cfg.set("num_hidden_layers", g_layers);
    State out{ModelSpec::from_json(cfg, "moe-5b.json"), cfg.dump(), {}, 0};
    for (const auto& seg : out.spec.segments()) {
      const auto n = seg.parameters();
      SegmentOptimizerState st;
      st.master.assign(n, 0.02f);
      st.exp_avg.assign(n, -1e-3f);
      st.exp_avg_sq.assign(n, 1e-6f);
      out.bytes += 3 * n * sizeof(float);
      out.segments.push_back(std::move(st));
    }
    return out;
  }();
  return s;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The disk alone: `bytes` by 8 MiB write() calls, then fsync, as a save writes its files.
double disk_seconds(const fs::path& file, std::uint64_t bytes) {
  std::vector<char> buf(std::size_t{8} << 20, 1);
  const auto t0 = std::chrono::steady_clock::now();
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + file.string());
  for (std::uint64_t done = 0; done < bytes;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), bytes - done));
    const ssize_t w = ::write(fd, buf.data(), n);
    if (w <= 0) throw std::runtime_error("cannot write " + file.string());
    done += static_cast<std::uint64_t>(w);
  }
  if (::fsync(fd) != 0) throw std::runtime_error("cannot fsync " + file.string());
  ::close(fd);
  const double s = seconds_since(t0);
  fs::remove(file);
  return s;
}

void BM_checkpoint_save(benchmark::State& st) {
  const State& s = state();
  const fs::path run = g_dir / fmt::format("oom-bench-checkpoint-{}", ::getpid());
  fs::remove_all(run);
  double save = 0, disk = 0;
  std::uint64_t step = 0;
  for (auto _ : st) {
    const auto t0 = std::chrono::steady_clock::now();
    (void)save_checkpoint(run, s.spec, s.segments, {++step, s.config, Json::object(), 1});
    const double t = seconds_since(t0);
    st.SetIterationTime(t);
    save += t;
    disk += disk_seconds(run / "disk.bin", s.bytes);  // beside the kept checkpoint: the same room
  }
  fs::remove_all(run);
  const double n = static_cast<double>(st.iterations());
  st.counters["state_GB"] = static_cast<double>(s.bytes) / 1e9;
  st.counters["save_GBps"] = static_cast<double>(s.bytes) * n / save / 1e9;
  st.counters["disk_GBps"] = static_cast<double>(s.bytes) * n / disk / 1e9;
  st.counters["ratio"] = disk / save;
}

}  // namespace

int main(int argc, char** argv) {
  g_dir = fs::temp_directory_path();
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--layers=", 0) == 0) g_layers = std::atoi(a.c_str() + 9);
    else if (a.rfind("--dir=", 0) == 0) g_dir = a.substr(6);
    else rest.push_back(argv[i]);
  }
  if (g_layers < 1) {
    std::fprintf(stderr, "bench_checkpoint: --layers must be at least 1\n");
    return 2;
  }
  benchmark::RegisterBenchmark("checkpoint_save", BM_checkpoint_save)->UseManualTime()->Iterations(3)->Unit(benchmark::kSecond);
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}

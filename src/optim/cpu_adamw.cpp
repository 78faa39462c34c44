// CPU AdamW dispatch: validates the spans, picks the ISA at run time (CPUID through
// __builtin_cpu_supports, never the build host's flags), splits the span into fixed tiles and runs
// them on the pool. Tiles are independent elementwise work, so neither the tiling nor the thread
// that runs a tile can change a result.
#include "oom/optim/cpu_adamw.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kernels.hpp"
#include "oom/core/error.hpp"

#if OOM_OPTIM_X86_KERNELS
#include <xmmintrin.h>
#endif

namespace oom::optim {

const char* to_string(CpuIsa isa) noexcept {
  switch (isa) {
    case CpuIsa::scalar: return "scalar";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::avx512: return "avx512";
  }
  return "unknown";
}

CpuIsa parse_cpu_isa(std::string_view text) {
  for (CpuIsa isa : {CpuIsa::scalar, CpuIsa::avx2, CpuIsa::avx512}) {
    if (text == to_string(isa)) return isa;
  }
  OOM_THROW(Errc::invalid_argument, fmt::format("unknown CPU ISA '{}' (expected scalar, avx2 or avx512)", text));
}

bool cpu_supports(CpuIsa isa) noexcept {
#if OOM_OPTIM_X86_KERNELS
  switch (isa) {
    case CpuIsa::scalar: return true;
    // libgcc's checks include the OS having enabled the YMM/ZMM state (XGETBV).
    case CpuIsa::avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuIsa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  return false;
#else
  return isa == CpuIsa::scalar;
#endif
}

std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::scalar, CpuIsa::avx2, CpuIsa::avx512}) {
    if (cpu_supports(isa)) out.push_back(isa);
  }
  return out;
}

CpuIsa best_cpu_isa() noexcept {
  if (cpu_supports(CpuIsa::avx512)) return CpuIsa::avx512;
  if (cpu_supports(CpuIsa::avx2)) return CpuIsa::avx2;
  return CpuIsa::scalar;
}

namespace {

// -1: nothing forced; otherwise the CpuIsa value. Atomic so a test thread may force while pool
// threads are idle without a data race.
std::atomic<int> forced_isa{-1};

void require_supported(CpuIsa isa, const char* why) {
  if (!cpu_supports(isa)) {
    OOM_THROW(Errc::unsupported, fmt::format("{} asks for CPU ISA {}, which this CPU does not run (best: {})",
                                             why, to_string(isa), to_string(best_cpu_isa())));
  }
}

}  // namespace

CpuIsa active_cpu_isa() {
  if (const int f = forced_isa.load(std::memory_order_relaxed); f >= 0) return static_cast<CpuIsa>(f);
  if (const char* env = std::getenv("OOM_CPU_ISA"); env != nullptr && *env != '\0') {
    CpuIsa isa{};
    try {
      isa = parse_cpu_isa(env);
    } catch (Error& e) {
      throw e.add_context("reading the environment variable OOM_CPU_ISA");
    }
    require_supported(isa, "OOM_CPU_ISA");
    return isa;
  }
  return best_cpu_isa();
}

void force_cpu_isa(std::optional<CpuIsa> isa) {
  if (isa) require_supported(*isa, "force_cpu_isa");
  forced_isa.store(isa ? static_cast<int>(*isa) : -1, std::memory_order_relaxed);
}

namespace {

/// For the duration of one tile: IEEE defaults in MXCSR (round to nearest even, no flush-to-zero,
/// no denormals-are-zero, exceptions masked). The caller's thread runs tiles too, and a framework
/// that set FTZ/DAZ on it would otherwise make the result depend on which thread ran which tile.
class IeeeFloatEnvironment {
 public:
#if OOM_OPTIM_X86_KERNELS
  IeeeFloatEnvironment() : saved_(_mm_getcsr()) { _mm_setcsr(0x1f80u); }
  ~IeeeFloatEnvironment() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

/// fn(tile, begin, count) for each tile of `tile` elements of [0, n), spread over `pool`, each
/// under IeeeFloatEnvironment: what every loop here splits, so no result depends on the threads.
template <class Fn>
void for_each_tile(ThreadPool& pool, std::size_t n, std::size_t tile, Fn&& fn) {
  pool.run((n + tile - 1) / tile, [&](std::size_t t) {
    const IeeeFloatEnvironment ieee;
    const std::size_t begin = t * tile;
    fn(t, begin, std::min(tile, n - begin));
  });
}

struct Region {
  const char* name;
  std::uintptr_t begin;
  std::uintptr_t end;
};

template <class Moment>
void validate(const AdamWSpan<Moment>& s) {
  const std::size_t n = s.master.size();
  auto check_size = [&](const char* name, std::size_t size) {
    if (size != n) {
      OOM_THROW(Errc::invalid_argument,
                fmt::format("AdamW span sizes differ: master has {} elements, {} has {}", n, name, size));
    }
  };
  check_size("exp_avg", s.exp_avg.size());
  check_size("exp_avg_sq", s.exp_avg_sq.size());
  check_size("grads", s.grads.size());
  if (!s.weights_out.empty()) check_size("weights_out", s.weights_out.size());

  auto check_align = [](const char* name, const void* p, std::size_t align) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    if (address % align != 0) {
      OOM_THROW(Errc::invalid_argument, fmt::format("AdamW {} at address {:#x} is not aligned to its {}-byte elements",
                                                    name, address, align));
    }
  };
  check_align("master", s.master.data(), alignof(float));
  check_align("exp_avg", s.exp_avg.data(), alignof(Moment));
  check_align("exp_avg_sq", s.exp_avg_sq.data(), alignof(Moment));
  check_align("grads", s.grads.data(), alignof(float));
  check_align("weights_out", s.weights_out.data(), alignof(bf16));

  // Overlap would make the result depend on the tiling and the thread schedule.
  auto region = [](const char* name, auto span) {
    const auto b = reinterpret_cast<std::uintptr_t>(span.data());
    return Region{name, b, b + span.size_bytes()};
  };
  const Region regions[] = {region("master", s.master), region("exp_avg", s.exp_avg),
                            region("exp_avg_sq", s.exp_avg_sq), region("grads", s.grads),
                            region("weights_out", s.weights_out)};
  for (std::size_t a = 0; a < std::size(regions); ++a) {
    for (std::size_t b = a + 1; b < std::size(regions); ++b) {
      const Region& x = regions[a];
      const Region& y = regions[b];
      if (x.begin < x.end && y.begin < y.end && x.begin < y.end && y.begin < x.end) {
        OOM_THROW(Errc::invalid_argument,
                  fmt::format("AdamW {} [{:#x}, {:#x}) overlaps {} [{:#x}, {:#x})", x.name, x.begin, x.end,
                              y.name, y.begin, y.end));
      }
    }
  }
}

kernels::Scalars to_kernel(const AdamWStepScalars& s) {
  return {s.grad_scale, s.decay, s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2,
          s.bias_correction2_sqrt, s.eps, s.neg_step_size};
}

std::uint16_t* raw(std::span<bf16> s) { return s.empty() ? nullptr : reinterpret_cast<std::uint16_t*>(s.data()); }

kernels::Fp32Moments range_of(const AdamWSpan<float>& s) {
  return {s.master.data(), s.exp_avg.data(), s.exp_avg_sq.data(), s.grads.data(), raw(s.weights_out), s.master.size()};
}
kernels::Bf16Moments range_of(const AdamWSpan<bf16>& s) {
  return {s.master.data(), raw(s.exp_avg), raw(s.exp_avg_sq), s.grads.data(), raw(s.weights_out), s.master.size()};
}

template <class Range>
Range sub_range(const Range& r, std::size_t begin, std::size_t count) {
  Range t = r;
  t.p += begin;
  t.m += begin;
  t.v += begin;
  t.g += begin;
  if (t.out != nullptr) t.out += begin;
  t.n = count;
  return t;
}

template <class Moment>
void update(const AdamWSpan<Moment>& span, const AdamWStepScalars& step, ThreadPool& pool,
            std::optional<CpuIsa> isa_opt) {
  validate(span);
  const CpuIsa isa = isa_opt ? *isa_opt : active_cpu_isa();
  require_supported(isa, "adamw_update");
  const auto range = range_of(span);
  using Range = decltype(range);
  void (*kernel)(const kernels::Scalars&, const Range&) = nullptr;
  switch (isa) {
    case CpuIsa::scalar: kernel = kernels::adamw_scalar; break;
#if OOM_OPTIM_X86_KERNELS
    case CpuIsa::avx2: kernel = kernels::adamw_avx2; break;
    case CpuIsa::avx512: kernel = kernels::adamw_avx512; break;
#else
    default: OOM_ASSERT(!"vector kernels are not built for this architecture");
#endif
  }
  const kernels::Scalars k = to_kernel(step);
  for_each_tile(pool, range.n, adamw_tile_elements,
                [&](std::size_t, std::size_t begin, std::size_t count) { kernel(k, sub_range(range, begin, count)); });
}

}  // namespace

void adamw_update(const AdamWSpan<float>& span, const AdamWStepScalars& step, ThreadPool& pool,
                  std::optional<CpuIsa> isa) {
  update(span, step, pool, isa);
}
void adamw_update(const AdamWSpan<bf16>& span, const AdamWStepScalars& step, ThreadPool& pool,
                  std::optional<CpuIsa> isa) {
  update(span, step, pool, isa);
}

double grad_sum_of_squares(std::span<const float> grads, ThreadPool& pool, std::optional<CpuIsa> isa_opt) {
  if (reinterpret_cast<std::uintptr_t>(grads.data()) % alignof(float) != 0) {
    OOM_THROW(Errc::invalid_argument, fmt::format("gradients at address {:#x} are not aligned to 4-byte floats",
                                                  reinterpret_cast<std::uintptr_t>(grads.data())));
  }
  const CpuIsa isa = isa_opt ? *isa_opt : active_cpu_isa();
  require_supported(isa, "grad_sum_of_squares");
  double (*kernel)(const float*, std::size_t) = nullptr;
  switch (isa) {
    case CpuIsa::scalar: kernel = kernels::sum_of_squares_scalar; break;
#if OOM_OPTIM_X86_KERNELS
    case CpuIsa::avx2: kernel = kernels::sum_of_squares_avx2; break;
    case CpuIsa::avx512: kernel = kernels::sum_of_squares_avx512; break;
#else
    default: OOM_ASSERT(!"vector kernels are not built for this architecture");
#endif
  }
  std::vector<double> partial((grads.size() + sum_of_squares_tile_elements - 1) / sum_of_squares_tile_elements);
  for_each_tile(pool, grads.size(), sum_of_squares_tile_elements,
                [&](std::size_t t, std::size_t begin, std::size_t count) { partial[t] = kernel(grads.data() + begin, count); });
  double total = 0.0;
  for (double p : partial) total += p;  // in tile order, whatever thread produced each
  return total;
}

void require_finite_gradients(std::span<const float> grads, std::string_view what, ThreadPool& pool) {
  std::atomic<bool> bad{false};
  for_each_tile(pool, grads.size(), sum_of_squares_tile_elements, [&](std::size_t, std::size_t begin, std::size_t count) {
    if (!all_finite(grads.subspan(begin, count))) bad.store(true, std::memory_order_relaxed);
  });
  if (bad.load()) require_finite_gradients(grads, what);  // throws, naming the first
}

void add_gradients(std::span<float> dst, std::span<const float> src, ThreadPool& pool) {
  if (dst.size() != src.size())
    OOM_THROW(Errc::invalid_argument, fmt::format("add_gradients: {} elements into {}", src.size(), dst.size()));
  // Under IEEE defaults, as every tile here: a caller's flush-to-zero would change the sums' bits.
  for_each_tile(pool, dst.size(), sum_of_squares_tile_elements, [&](std::size_t, std::size_t begin, std::size_t count) {
    for (std::size_t i = begin; i < begin + count; ++i) dst[i] += src[i];
  });
}

}  // namespace oom::optim

// ProfileCostModel: OOM's cost_model. Seconds on each resource for an Operation, from a calibrated
// MachineProfile. Every rate it uses is non-decreasing in problem size, so more work never
// predicts less time (cost_model requirement 2) and larger chunks never predict more.
#pragma once

#include <algorithm>

#include "oom/concepts/cost_model.hpp"
#include "oom/plan/machine_profile.hpp"

namespace oom {

/// Bytes an AdamW update moves per parameter, on the GPU or the CPU alike: reads the fp32 master
/// and gradient and the moments m, v; writes master, m, v and the bf16 working copy. 30 with fp32
/// moments, 22 with bf16 ones.
constexpr double adamw_bytes_per_param(DType moments) { return 4.0 + 4.0 + 4.0 + 2.0 + 4.0 * static_cast<double>(size_of(moments)); }
static_assert(adamw_bytes_per_param(DType::fp32) == 16.0 + 12.0 + 2.0);

class ProfileCostModel {
 public:
  /// `active_gpus` GPUs move data at once: each gets min(its link, the host's total / active_gpus).
  explicit ProfileCostModel(const MachineProfile& profile, int active_gpus = 1)
      : profile_(&profile), gpus_(std::max(active_gpus, 1)) {}

  [[nodiscard]] const MachineProfile& profile() const { return *profile_; }
  [[nodiscard]] double h2d_rate() const { return link_share(profile_->h2d_bytes_per_s); }
  [[nodiscard]] double d2h_rate() const { return link_share(profile_->d2h_bytes_per_s); }

  /// adamw_bytes_per_param with fp32 moments, on the GPU and for the CPU AdamW in host memory
  /// (what MachineProfile::cpu_adamw_params_per_s is measured at).
  static constexpr double gpu_adamw_bytes_per_param = adamw_bytes_per_param(DType::fp32);
  static constexpr double cpu_adamw_bytes_per_param = adamw_bytes_per_param(DType::fp32);

  /// Seconds of `rows` rows of `flops_per_row` each at `rate`'s FLOP/s for that many rows, and never
  /// less than fewer rows take: between some samples the measured rate grows faster than the rows
  /// (a launch of a few rows is latency-bound), which would make more work predict less time.
  [[nodiscard]] static double compute_seconds(const SizeCurve& rate, double rows, double flops_per_row) {
    double s = flops_per_row * rows / rate.at(rows);
    for (const auto& [x, r] : rate.samples())
      if (x < rows) s = std::max(s, flops_per_row * x / r);
    return s;
  }

  [[nodiscard]] ResourceTimes predict(const Operation& op) const {
    ResourceTimes t;
    const double launch = profile_->launch_overhead_s;
    const auto bytes = static_cast<double>(op.bytes.count());
    switch (op.kind) {
      case OpKind::gemm: {
        // A grouped launch (batch > 1: one GEMM per expert) spreads all its groups' rows over the
        // GPU, so it runs at the rate of its total rows, not of one group's; and it cannot beat
        // reading every group's n x k bf16 weights from HBM. Priced by rows per group instead, 64
        // experts' gate/up at 32 rows each came out 4x slower than that weight read, and than
        // the H200 measured (docs/performance.md, thirty-third session).
        // (A batch of 0 is no work: the launch overhead, as before grouped launches were priced.)
        const double rows = static_cast<double>(std::max<std::uint64_t>(op.m, 1)) * static_cast<double>(std::max<std::uint64_t>(op.batch, 1));
        double c = compute_seconds(profile_->gemm_flops, rows, op.flops() / rows);
        if (op.batch > 1) c = std::max(c, 2.0 * static_cast<double>(op.n) * op.k * op.batch / profile_->hbm_bytes_per_s);
        t[Resource::gpu_compute] = launch + c;
        break;
      }
      case OpKind::attention_forward:
      case OpKind::attention_backward: {
        // Keyed by the queries in the launch: the parallel work a flash kernel spreads over the GPU.
        // op.k is the head dim, taken as a class: 256 and up at the head-dim-256 curves where the
        // profile has them, anything below at the head-dim-128 ones (so a head dim between the two,
        // which no model here has, may be priced above 256's; more FLOPs at one head dim never less).
        const bool fwd = op.kind == OpKind::attention_forward;
        const SizeCurve& d256 = fwd ? profile_->attention_forward_flops_d256 : profile_->attention_backward_flops_d256;
        const SizeCurve& rate = op.k >= 256 && !d256.empty() ? d256
                                : fwd                        ? profile_->attention_forward_flops
                                                             : profile_->attention_backward_flops;
        t[Resource::gpu_compute] = launch + op.flops() / rate.at(static_cast<double>(std::max<std::uint64_t>(op.m, 1)));
        break;
      }
      case OpKind::delta_rule_forward:
      case OpKind::delta_rule_backward: {
        const bool backward = op.kind == OpKind::delta_rule_backward;
        // Keyed by the recurrences side by side where measured so (more fill more of the GPU).
        const SizeCurve& by_count = backward ? profile_->gated_delta_backward_parallel : profile_->gated_delta_forward_parallel;
        const double rate = !by_count.empty() ? by_count.at(static_cast<double>(std::max<std::uint64_t>(op.recurrences(), 1)))
                            : backward      ? profile_->gated_delta_backward_updates_per_s
                                            : profile_->gated_delta_forward_updates_per_s;
        if (rate > 0) {  // OOM's recurrent kernels, as measured
          t[Resource::gpu_compute] = launch + op.state_updates() / rate;
        } else {
          // Not measured (a profile from before the field): a chunked tensor-core scan in chunks
          // of 64 as GEMMs, each token's row of all heads' [k | v] against 64 + 2k columns; the
          // backward 2.5x. The recurrent kernels OOM runs are slower than this (the 4K Qwen3-Next
          // layer's 0.023 s backward on an H200 against 0.002 s so priced).
          const double rows = static_cast<double>(std::max<std::uint64_t>(op.m, 1));
          const double flops_per_row = 2.0 * static_cast<double>(op.batch) * static_cast<double>(op.k + op.n) *
                                       static_cast<double>(64 + 2 * op.k);
          t[Resource::gpu_compute] = (backward ? 2.5 : 1.0) * (launch + compute_seconds(profile_->gemm_flops, rows, flops_per_row));
        }
        break;
      }
      case OpKind::memory_bound: t[Resource::gpu_compute] = launch + bytes / profile_->hbm_bytes_per_s; break;
      case OpKind::copy_h2d: t[Resource::h2d] = launch + bytes / h2d_rate(); break;
      case OpKind::copy_d2h: t[Resource::d2h] = launch + bytes / d2h_rate(); break;
      case OpKind::cpu_optimizer: {
        // Memory-bound (OOM's CPU AdamW runs at ~1.0x the host's copy bandwidth): other DRAM
        // traffic meanwhile (`concurrent`: the copies streaming, and for LayerStackPlanner the
        // executor's gradient check) takes its share of the same bandwidth. On the H200 machine at
        // 32K the in-step rate was 0.85x the idle calibration, as (30 + 6) / 30 predicts for a
        // layer's fp32 gradients down and bf16 weights up during its update.
        // bf16 moments (op.dtype) at their own calibrated rate where the profile has one, else at
        // the fp32 rate scaled by the bytes moved (22 a parameter where it was measured at 30).
        const double elements = static_cast<double>(op.elements);
        const double update = op.dtype == DType::bf16 && profile_->cpu_adamw_bf16_moments_params_per_s > 0
                                  ? elements / profile_->cpu_adamw_bf16_moments_params_per_s
                                  : elements * adamw_bytes_per_param(op.dtype) / cpu_adamw_bytes_per_param / profile_->cpu_adamw_params_per_s;
        t[Resource::cpu] = update + bytes / cpu_adamw_bytes_per_param / profile_->cpu_adamw_params_per_s;
        break;
      }
      case OpKind::gpu_optimizer:
        t[Resource::gpu_compute] =
            launch + static_cast<double>(op.elements) * adamw_bytes_per_param(op.dtype) / profile_->hbm_bytes_per_s;
        break;
      case OpKind::all_to_all:
        if (gpus_ > 1) t[Resource::network] = launch + bytes / profile_->all_to_all_bytes_per_s;
        break;
      case OpKind::all_reduce:
        if (gpus_ > 1) t[Resource::network] = launch + bytes / profile_->all_reduce_bytes_per_s;
        break;
    }
    return t;
  }

 private:
  [[nodiscard]] double link_share(double per_link) const {
    const double total = profile_->host_link_total_bytes_per_s;
    return total > 0 ? std::min(per_link, total / gpus_) : per_link;
  }

  const MachineProfile* profile_;
  int gpus_;
};

static_assert(cost_model<ProfileCostModel>);

}  // namespace oom

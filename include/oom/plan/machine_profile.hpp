// MachineProfile: what the cost model knows about a machine, every constant with its provenance
// (which measurement or datasheet, which machine, when). Calibrated profiles come from
// oom-calibrate; built-in defaults exist for H100 80GB, H200 and RTX 4090 24GB.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "oom/core/bytes.hpp"

namespace oom {

class Json;

/// Where a constant came from.
struct Provenance {
  std::string source;   ///< "oom-calibrate pinned copy 256 MiB x 8", "NVIDIA H100 datasheet", ...
  std::string machine;  ///< "1x NVIDIA H200, 16-core Xeon (Sapphire Rapids)"
  std::string date;     ///< ISO date of the measurement or the document
  friend bool operator==(const Provenance&, const Provenance&) = default;
};

/// A rate that depends on problem size, from (size, rate) samples sorted by size.
/// at(x): log-log interpolation between samples; below the first sample, the first rate scaled by
/// x / first size (small problems are latency-bound); above the last, the last rate. The curve is
/// made non-decreasing when built (a larger problem can always run as several smaller ones, so
/// its achievable rate is at least theirs), which keeps the planner's predictions monotone.
class SizeCurve {
 public:
  SizeCurve() = default;
  /// Throws Errc::invalid_argument on an empty list, non-positive values or unsorted/duplicate sizes.
  explicit SizeCurve(std::vector<std::pair<double, double>> samples);

  [[nodiscard]] double at(double size) const;
  [[nodiscard]] const std::vector<std::pair<double, double>>& samples() const { return samples_; }
  [[nodiscard]] bool empty() const { return samples_.empty(); }
  friend bool operator==(const SizeCurve&, const SizeCurve&) = default;

 private:
  std::vector<std::pair<double, double>> samples_;
};

struct MachineProfile {
  std::string name;            ///< "h200", "h100-80gb", "rtx4090", or a calibrated machine's name
  int gpus = 1;
  Bytes gpu_memory;            ///< usable per GPU (after the CUDA context and library workspaces)
  Bytes host_memory;           ///< usable host RAM of the node

  // Per GPU, pinned host memory, large transfers.
  double h2d_bytes_per_s = 0;
  double d2h_bytes_per_s = 0;
  double bidir_bytes_per_s = 0;   ///< both directions at once, the two counted together
  double pageable_h2d_bytes_per_s = 0;
  /// All GPUs' host links together are also bounded by the host's memory system.
  double host_link_total_bytes_per_s = 0;

  double hbm_bytes_per_s = 0;     ///< device memory, bytes read + written per second
  SizeCurve gemm_flops;           ///< bf16 GEMM FLOP/s (fp32 accumulate) by m, at n = k = 2048
  /// Causal attention by sequence length: the forward's FLOP/s (counted as the causal forward's
  /// 2·S²·heads·head_dim) and the backward's (2.5x those FLOPs). Two curves, not one for the pair:
  /// a flash backward runs at a lower rate than its forward (OOM's: 0.75x at 128K), and a plan
  /// that recomputes the forward pays the forward's rate. A profile file with the older single
  /// `attention_flops` (forward + backward at 3.5x) is read as that rate for both, which gives
  /// the same forward + backward time.
  SizeCurve attention_forward_flops;
  SizeCurve attention_backward_flops;
  /// The same two curves at head dim 256 (Qwen3-Next's and Qwen3.5's full attention), whose kernels
  /// run at other rates (OOM's D = 256 backward ~0.8x its D = 128 one). Optional: empty (a profile
  /// without them), the head-dim-128 curves stand in for every head dim.
  SizeCurve attention_forward_flops_d256;
  SizeCurve attention_backward_flops_d256;
  double launch_overhead_s = 0;   ///< fixed cost per kernel or copy
  /// OOM's gated delta rule (the hybrid models' linear attention) in the form its `automatic`
  /// takes: state elements updated per second (tokens x value heads x key dim x value dim over the
  /// kernel's seconds), forward and backward (which reruns each chunk's forward). 0: not measured
  /// (a profile from before these fields), and the cost model prices the rule as a tensor-core
  /// chunked scan. One rate per pass, measured at 32 value heads of one sequence (on Hopper the
  /// chunked form).
  double gated_delta_forward_updates_per_s = 0;
  double gated_delta_backward_updates_per_s = 0;
  /// The same rates by the recurrences run side by side (sequences x value heads): more of them
  /// fill more of the GPU (on the H200 the forward runs 1.6x the updates a second at 128 as at 32,
  /// the recurrent form's at 128 against the chunked one's at 32 and 64). Optional:
  /// empty (absent from the file) and the cost model takes the scalar rates above whatever the
  /// count. (A curve is made non-decreasing: a count measured slower than a smaller one's rate is
  /// priced at that rate.)
  SizeCurve gated_delta_forward_parallel;
  SizeCurve gated_delta_backward_parallel;

  double cpu_adamw_params_per_s = 0;  ///< OOM's CPU AdamW, fp32 master and moments, all cores
  /// The same with bf16 moments (fp32 master, `--moments bf16`). Optional: 0 (absent from the
  /// file) and the cost model scales the fp32 rate by the bytes moved, 30 / 22, which the H200
  /// machine's CPU did not reach (1.29x measured against 1.36x).
  double cpu_adamw_bf16_moments_params_per_s = 0;
  double host_copy_bytes_per_s = 0;   ///< host memory, bytes read + written per second, all cores

  double all_to_all_bytes_per_s = 0;  ///< NCCL all-to-all, bytes each GPU sends per second (0: one GPU)
  double all_reduce_bytes_per_s = 0;  ///< NCCL all-reduce bus bandwidth per GPU (0: one GPU)

  /// Field name (as in the JSON) -> where its value came from. Every field above has one, but an
  /// optional one left at 0 (not measured).
  std::map<std::string, Provenance> provenance;

  /// Built-in profiles, `gpus` of them in one node.
  [[nodiscard]] static MachineProfile h200(int gpus = 1);
  [[nodiscard]] static MachineProfile h100_80gb(int gpus = 1);
  [[nodiscard]] static MachineProfile rtx4090(int gpus = 1);
  /// "h200", "h100-80gb" / "h100", "rtx4090" / "4090"; throws naming the known names otherwise.
  [[nodiscard]] static MachineProfile builtin(std::string_view name, int gpus = 1);

  [[nodiscard]] Json to_json() const;
  /// Errors name the source and the field (missing, wrong type, non-positive, no provenance).
  [[nodiscard]] static MachineProfile from_json(const Json& j, std::string_view source = "<profile>");
  [[nodiscard]] static MachineProfile from_file(const std::filesystem::path& path);
  /// Checks every constant is positive where it must be and has provenance; throws naming the field.
  void validate(std::string_view source = "<profile>") const;

  /// Every field, provenance included: a profile read back from its JSON equals the original.
  friend bool operator==(const MachineProfile&, const MachineProfile&) = default;
};

}  // namespace oom

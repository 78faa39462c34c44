// Training checkpoints: a directory a run can be resumed from and that transformers can load.
//
//   <run>/checkpoint-000120/
//       model.safetensors      fp32 master weights under their Hugging Face names (a packed
//                              expert tensor is written whole, gathered from its segments)
//       optimizer.safetensors  AdamW moments: "exp_avg.<name>" and "exp_avg_sq.<name>", fp32
//       trainer_state.json     whatever the trainer needs to continue (step, data position, ...)
//       config.json            the model's config.json, verbatim
//       checksums.json         the CRC-32C of each tensor's bytes (each expert slice of a packed
//                              tensor's), of trainer_state.json and config.json; the step and the
//                              save id the safetensors files' metadata carry ("step", "save")
//   <run>/latest               "checkpoint-000120\n"
//
// Nothing half-written is ever visible: the files go into "checkpoint-000120.partial/", each
// written atomically; the directory is renamed into place, the rename fsync'ed, and only then is
// `latest` replaced (atomically). A crash at any point leaves `latest` naming a complete checkpoint (or none); a
// failed save removes its .partial directory. An earlier checkpoint of the same step is moved to
// "checkpoint-000120.old/" while the new one is renamed in; latest_checkpoint() moves it back if
// a crash came between the two renames.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "oom/core/bytes.hpp"
#include "oom/io/json.hpp"
#include "oom/optim/segment_state.hpp"

namespace oom {

class ModelSpec;

struct CheckpointWrite {
  std::uint64_t step = 0;        ///< names the directory
  std::string config_json;       ///< written verbatim as config.json
  Json trainer_state;            ///< written as trainer_state.json
  int keep = 2;                  ///< complete checkpoints kept in the run directory (older ones removed)
  /// Told what the save could not do that does not fail it, with the system's reason: an older
  /// checkpoint pruning could not remove (it stays, or stays in part as "<name>.partial"), or what
  /// a killed save left that could not be removed. Unset: not told.
  std::function<void(const std::string&)> on_warning = {};  // (= {}: no -Wmissing-field-initializers where it is left out)
};

/// Writes a checkpoint of `state` (one entry per segment of `spec`, in spec.segments() order) into
/// `run_dir` (created if missing) and points `latest` at it; returns the checkpoint's directory.
/// Errc::invalid_argument, before anything is written, when `state` does not match the spec's
/// segments, `what.trainer_state` would not read back as JSON (a string that is not UTF-8),
/// `what.config_json` is not a JSON object, or `what.keep` is below 1; Errc::io on write errors
/// (nothing under the checkpoint's final name then), and before anything is written when the file
/// system has less room than the weights and moments take (naming both). Of the checkpoints in
/// `run_dir` up to this step, the `keep` with the highest steps are kept, pruned once the new one is
/// complete; those of higher steps (a continuation left by resuming from an earlier checkpoint)
/// are left alone and not counted.
std::filesystem::path save_checkpoint(const std::filesystem::path& run_dir, const ModelSpec& spec,
                                      std::span<const SegmentOptimizerState> state, const CheckpointWrite& what);
/// The same from views of the state where it lives (an executor's StateSnapshot): the values are
/// read straight into the files, so a checkpoint takes no second copy of the model's state in
/// host memory.
std::filesystem::path save_checkpoint(const std::filesystem::path& run_dir, const ModelSpec& spec,
                                      std::span<const SegmentStateView> state, const CheckpointWrite& what);

/// A checkpoint's weights and two moments in fp32, the bulk of its bytes (its small files aside):
/// the room save_checkpoint asks the file system for before it writes.
[[nodiscard]] Bytes checkpoint_state_bytes(const ModelSpec& spec);

/// The directory name of step `step`'s checkpoint: "checkpoint-" and the step, at least 6 digits.
[[nodiscard]] std::string checkpoint_name(std::uint64_t step);
/// The step a checkpoint directory's name ("checkpoint-<digits>") holds; nullopt for any other
/// name (a ".partial" or ".old" one too). Pruning orders by it, not by name: past step 999999 the
/// names grow a digit and "checkpoint-1000000" sorts before "checkpoint-999999".
[[nodiscard]] std::optional<std::uint64_t> checkpoint_step(std::string_view name);
/// The checkpoint directories in `run_dir` ("checkpoint-<step>"; a ".partial" or ".old" is none),
/// by step, lowest first; none where `run_dir` cannot be read. Their files are not checked.
[[nodiscard]] std::vector<std::pair<std::uint64_t, std::filesystem::path>> complete_checkpoints(const std::filesystem::path& run_dir);

/// The checkpoint `latest` names in `run_dir`, or nullopt when there is none yet (neither `latest`
/// nor a checkpoint directory). Errc::parse when `latest` exists but names no checkpoint directory
/// (one a crashed save set aside as "<name>.old" is first moved back), and when it is missing beside
/// checkpoint directories (naming the newest).
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& run_dir);

/// `dir`/`name` (a checkpoint's trainer_state.json or config.json) as its save wrote it: Errc::parse
/// when the file's CRC-32C is not the one checksums.json lists, checksums.json lists none, or the
/// file cannot be read. Nothing to check (no error) for a checkpoint saved before checksums. CheckpointReader checks both files so; a caller that reads config.json first (to
/// build the model it opens the checkpoint with) checks it with this.
void check_saved_file(const std::filesystem::path& dir, std::string_view name);

/// A checkpoint directory opened for reading segment by segment: the files are mapped, every
/// tensor of `spec` is checked (present, F32 or BF16, the right shape) when it opens, a tensor the
/// spec does not have is an error (a checkpoint of another model), and values are converted only
/// when read. On opening, the two safetensors files must be of one save (their metadata's step and
/// save id, as checksums.json says) and trainer_state.json and config.json (where present) must
/// have the checksums it lists; each tensor's bytes are checked against theirs as they are read.
/// A checkpoint saved before checksums (no save id, no checksums.json) is read unchecked. Errors
/// name the file and the tensor (Errc::parse) or the file (Errc::io).
class CheckpointReader {
 public:
  CheckpointReader(const std::filesystem::path& dir, const ModelSpec& spec);
  ~CheckpointReader();
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;

  [[nodiscard]] const Json& trainer_state() const;
  /// Segment `segment`'s master weights and moments into the spans (each its parameters() long).
  void read(std::size_t segment, std::span<float> master, std::span<float> exp_avg, std::span<float> exp_avg_sq) const;
  /// read() as a SegmentStateSource (valid while this reader lives).
  [[nodiscard]] SegmentStateSource source() const;
  /// Every segment's state, read into owned vectors (small models; load_checkpoint).
  [[nodiscard]] std::vector<SegmentOptimizerState> read_all() const;

 private:
  struct Files;
  std::unique_ptr<Files> files_;
};

struct CheckpointRead {
  std::vector<SegmentOptimizerState> state;  ///< per segment of the spec, in order
  Json trainer_state;
};

/// Reads a checkpoint directory against `spec`: every segment's tensors by name and shape, fp32 or
/// bf16, and no others. `with_optimizer` false reads weights only (moments left empty), e.g. to
/// start a run from someone's weights; that read, as load_weights' and weight_source's of our own
/// checkpoint's model.safetensors, checks each tensor against the checksums.json beside it (none
/// when the file names no save or none is beside it: weights from elsewhere, or a copy alone). Errors name the file and the tensor (Errc::parse) or the
/// file (Errc::io).
CheckpointRead load_checkpoint(const std::filesystem::path& dir, const ModelSpec& spec, bool with_optimizer = true);

/// Reads weights only (transformers' checkpoints, or ours): per segment of `spec`, the fp32 values
/// of its tensors back to back. `path` is one safetensors file, a Hugging Face sharded
/// checkpoint's model.safetensors.index.json (its weight_map names each tensor's shard, a file
/// beside it), or a directory holding model.safetensors or that index.
std::vector<std::vector<float>> load_weights(const std::filesystem::path& path, const ModelSpec& spec);
/// The same weights as a source, read segment by segment (the files stay mapped while the source
/// lives; `spec` must outlive it). Every tensor's name, shape and type is checked here, before any
/// is read, in whichever shard holds it; errors name the file and the tensor (a tensor the index
/// does not list: the index).
SegmentWeightSource weight_source(const std::filesystem::path& path, const ModelSpec& spec);

}  // namespace oom

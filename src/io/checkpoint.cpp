// Checkpoints: segments' fp32 state to safetensors under Hugging Face names, and back.
#include "oom/io/checkpoint.hpp"

#include <sys/statvfs.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <charconv>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <map>
#include <random>
#include <system_error>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "oom/core/bytes.hpp"
#include "oom/core/error.hpp"
#include "oom/core/log.hpp"
#include "oom/core/numeric.hpp"
#include "oom/io/atomic_file.hpp"
#include "oom/io/crc32c.hpp"
#include "oom/io/json.hpp"
#include "oom/io/safetensors.hpp"
#include "oom/model/model_spec.hpp"

namespace oom {
namespace {

namespace fs = std::filesystem;

// Where one checkpoint tensor's values come from: slices of segments' vectors, in tensor order
// (one slice for a plain tensor, stacked_count for a packed expert tensor).
struct Source {
  std::string name;
  std::vector<std::uint64_t> shape;  // the checkpoint tensor's
  std::vector<std::pair<std::size_t, std::uint64_t>> slices;  // (segment, offset within it)
  std::uint64_t slice_elements = 0;
};

std::vector<Source> sources(const ModelSpec& spec) {
  std::vector<Source> out;
  std::map<std::string, std::size_t> packed;  // name -> index in out
  const auto& segs = spec.segments();
  for (std::size_t s = 0; s < segs.size(); ++s) {
    std::uint64_t offset = 0;
    for (const auto& t : segs[s].tensors) {
      if (t.stacked_index < 0) {
        out.push_back({t.name, t.shape, {{s, offset}}, t.elements()});
      } else {
        auto [it, fresh] = packed.try_emplace(t.name, out.size());
        if (fresh) {
          Source src{t.name, t.shape, {}, t.elements()};
          src.shape.insert(src.shape.begin(), t.stacked_count);
          src.slices.resize(t.stacked_count, {segs.size(), 0});
          out.push_back(std::move(src));
        }
        out[it->second].slices.at(static_cast<std::size_t>(t.stacked_index)) = {s, offset};
      }
      offset += t.elements();
    }
  }
  for (const auto& src : out)
    for (const auto& [seg, off] : src.slices)
      if (seg >= segs.size())
        OOM_THROW(Errc::internal, fmt::format("packed tensor '{}' has a slice no segment provides", src.name));
  return out;
}

// The index of the first value a reader would refuse (not finite; for a second moment, also below
// zero; -0 is not), or v.size(). Blocks of plain bit tests the compiler vectorises (16-20 GB/s on the
// workstation at -O3), then the exact element in the block that has one: a std::find_if with
// std::isfinite, a value at a time (~4 GB/s), had been the slowest part of a checkpoint's gather.
template <bool SecondMoment>
std::size_t first_refused(std::span<const float> v) {
  constexpr std::size_t block = 1024;
  // 0 or 1, no branch (a short-circuit || kept GCC from vectorising the block's loop).
  const auto refused = [](std::uint32_t bits) -> std::uint32_t {
    const std::uint32_t not_finite = (bits & 0x7f800000u) == 0x7f800000u;  // an all-ones exponent: inf or NaN
    if constexpr (SecondMoment) return not_finite | static_cast<std::uint32_t>(bits > 0x80000000u);  // the sign on a magnitude above 0
    return not_finite;
  };
  for (std::size_t b = 0; b < v.size(); b += block) {
    const std::size_t end = std::min(v.size(), b + block);
    std::uint32_t any = 0;
    for (std::size_t i = b; i < end; ++i) any |= refused(std::bit_cast<std::uint32_t>(v[i]));
    if (!any) continue;
    for (std::size_t i = b; i < end; ++i)
      if (refused(std::bit_cast<std::uint32_t>(v[i]))) return i;
  }
  return v.size();
}

// A safetensors entry whose bytes are gathered from the segments' `array`, wherever it lives (a
// GPU-resident segment's is read a piece at a time: no copy of it is held).
// `crcs` (one a slice: an expert's of a packed tensor) gets the CRC-32C of each slice's bytes as
// they are written, for checksums.json.
SafetensorsEntry entry(std::string name, const Source& src, std::span<const SegmentStateView> state, StateArray array,
                       std::vector<std::uint32_t>& crcs) {
  SafetensorsEntry e;
  e.name = std::move(name);
  e.dtype = DType::fp32;
  e.shape = src.shape;
  const Source* s = &src;
  crcs.assign(src.slices.size(), 0);
  auto next = std::make_shared<std::uint64_t>(0);  // the checksums run over the bytes in order
  e.fill = [s, state, array, crcs = &crcs, next](std::uint64_t offset, std::span<std::byte> out) {
    // An fp32 tensor's pieces start and end on whole floats.
    OOM_ASSERT(offset % sizeof(float) == 0 && out.size() % sizeof(float) == 0);
    if (offset != *next)
      OOM_THROW(Errc::internal, fmt::format("checkpoint: tensor '{}' filled at byte {} after {}; its checksum needs its bytes in order",
                                            s->name, offset, *next));
    *next = offset + out.size();
    const std::span<float> floats(reinterpret_cast<float*>(out.data()), out.size() / sizeof(float));
    std::uint64_t done = 0;
    while (done < floats.size()) {
      const std::uint64_t at = offset / sizeof(float) + done;
      const std::uint64_t slice = at / s->slice_elements, within = at % s->slice_elements;
      const auto [seg, seg_off] = s->slices[slice];
      const std::uint64_t n = std::min<std::uint64_t>(s->slice_elements - within, floats.size() - done);
      state[seg].copy(array, seg_off + within, floats.subspan(done, n));
      (*crcs)[slice] = crc32c(std::as_bytes(floats.subspan(done, n)), (*crcs)[slice]);
      done += n;
    }
    // What the reader would refuse is not written: a save throws instead, so the checkpoint
    // `latest` names, and the ones rotation keeps, stay those of a state that can resume.
    const auto bad = floats.begin() + static_cast<std::ptrdiff_t>(array == StateArray::exp_avg_sq ? first_refused<true>(floats)
                                                                                                     : first_refused<false>(floats));
    if (bad != floats.end())
      OOM_THROW(Errc::invalid_argument,
                fmt::format("checkpoint: tensor '{}'{} holds {} at element {}: the training state is no longer {}; not saved",
                            s->name, array == StateArray::master ? "" : array == StateArray::exp_avg ? " (exp_avg)" : " (exp_avg_sq)",
                            *bad, offset / sizeof(float) + static_cast<std::uint64_t>(bad - floats.begin()),
                            std::isfinite(*bad) ? "valid (a negative second moment)" : "finite"));
  };
  return e;
}

constexpr const char* checksums_file = "checksums.json";

// Names one save: its two safetensors files carry it, and checksums.json, so files of two saves (of
// two steps, or two runs of one model at one step) are not taken for one checkpoint.
std::string save_id() {
  std::random_device device;
  const std::uint64_t v = (static_cast<std::uint64_t>(device()) << 32 | device()) ^
                          static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  return fmt::format("{:016x}", v);
}

// Where save_checkpoint moves an earlier checkpoint of the same step while it renames the new one in.
fs::path set_aside(const fs::path& dir) {
  fs::path p = dir;
  p += ".old";
  return p;
}

/// `latest`'s text without the blanks around the name (a newline, an editor's spaces).
std::string without_blanks(std::string text) {
  const auto blank = [](char c) { return c == '\n' || c == '\r' || c == ' ' || c == '\t'; };
  while (!text.empty() && blank(text.back())) text.pop_back();
  text.erase(0, static_cast<std::size_t>(std::find_if_not(text.begin(), text.end(), blank) - text.begin()));
  return text;
}

/// Whether the file `latest` names `name` (blanks around it aside); false where it cannot be read.
bool latest_names(const fs::path& latest, const std::string& name) {
  std::error_code ec;
  if (!fs::is_regular_file(latest, ec)) return false;
  std::string text;
  try {
    std::ifstream in(latest, std::ios::binary);
    if (!in.is_open()) return false;
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::exception&) {  // (libstdc++'s filebuf throws on a read error)
    return false;
  }
  return without_blanks(std::move(text)) == name;
}

// A crash between moving `dir` aside and renaming the new one in leaves `latest` naming `dir`
// with its data at set_aside(dir): this moves it back. Nothing to do otherwise.
std::error_code restore_set_aside(const fs::path& dir) {
  std::error_code ec, absent;  // (is_directory reports a missing path in its error code)
  if (!fs::exists(dir, absent) && fs::is_directory(set_aside(dir), absent)) fs::rename(set_aside(dir), dir, ec);
  return ec;
}

// `out` from the tensor `t` of `file`, converted to fp32; then the tensor's pages leave the resident
// set (a checkpoint or weights file is read once: without it, a 5.13B model's resume would hold
// its 61 GB of checkpoint pages in RSS beside the pinned state it reads into).
// `crcs`, when given, are the tensor's slices' CRC-32C from checksums.json: the bytes read must have
// the one of t's slice.
void read_values(const SafetensorsFile& file, const TensorSpec& t, std::span<float> out, bool second_moment = false,
                 const std::vector<std::uint32_t>* crcs = nullptr) {
  DType dt{};
  const auto bytes = file.tensor_bytes(t, &dt);
  if (crcs != nullptr) {
    const std::size_t slice = t.stacked_index < 0 ? 0 : static_cast<std::size_t>(t.stacked_index);
    const std::string which = t.stacked_index < 0 ? std::string() : fmt::format(" (expert {})", t.stacked_index);
    if (slice >= crcs->size())
      OOM_THROW(Errc::parse, fmt::format("{}: tensor '{}'{} has no checksum in {} ({} listed)", file.source(), t.name, which,
                                         checksums_file, crcs->size()));
    if (const std::uint32_t got = crc32c(bytes); got != (*crcs)[slice])
      OOM_THROW(Errc::parse, fmt::format("{}: tensor '{}'{} changed after its save: its bytes' CRC-32C is {:08x}, {} has {:08x} (a "
                                         "damaged file, or one copied in from elsewhere)", file.source(), t.name, which, got,
                                         checksums_file, (*crcs)[slice]));
  }
  if (dt == DType::fp32) {
    std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  } else if (dt == DType::bf16) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      bf16 h;
      std::memcpy(&h.bits, bytes.data() + 2 * i, 2);
      out[i] = to_float(h);
    }
  } else {
    OOM_THROW(Errc::parse, fmt::format("{}: tensor '{}' is {}; weights must be F32 or BF16", file.source(), t.name,
                                       safetensors_dtype_name(dt)));
  }
  file.drop_pages(bytes);
  // A NaN or an infinity would train on silently (every loss then non-finite, every step skipped):
  // refused here, naming the tensor and the element.
  const auto bad = std::find_if(out.begin(), out.end(), [](float v) { return !std::isfinite(v); });
  if (bad != out.end())
    OOM_THROW(Errc::parse, fmt::format("{}: tensor '{}' holds {} at element {}; weights and moments must be finite", file.source(),
                                       t.name, *bad, bad - out.begin()));
  // A second moment is a mean of squares: a negative one (a flipped sign bit) makes the update's
  // square root NaN, and every later step skipped.
  if (second_moment) {
    const auto neg = std::find_if(out.begin(), out.end(), [](float v) { return v < 0.0f; });
    if (neg != out.end())
      OOM_THROW(Errc::parse, fmt::format("{}: tensor '{}' holds {} at element {}; a second moment (exp_avg_sq) is never negative",
                                         file.source(), t.name, *neg, neg - out.begin()));
  }
}

// Tensor `t` present in `file`, of the right shape and of a type read_values converts (F32, BF16);
// `rule` ends the type error.
void check_tensor(const SafetensorsFile& file, const TensorSpec& t, std::string_view rule) {
  DType dt{};
  (void)file.tensor_bytes(t, &dt);
  if (dt != DType::fp32 && dt != DType::bf16)
    OOM_THROW(Errc::parse, fmt::format("{}: tensor '{}' is {}; {} F32 or BF16", file.source(), t.name, safetensors_dtype_name(dt), rule));
}

// Every tensor of `spec` present in `file` as `prefix` + its name, checked before anyone reads one.
void check_tensors(const SafetensorsFile& file, const ModelSpec& spec, std::string_view prefix, std::string_view rule) {
  for (const auto& seg : spec.segments())
    for (const auto& t : seg.tensors) {
      TensorSpec named = t;
      named.name = std::string(prefix) + t.name;
      check_tensor(file, named, rule);
    }
}

// No tensor in our own checkpoint `file` beyond `spec`'s (each under one of `prefixes`): a
// checkpoint of a deeper or wider model must not load into this one with its extra layers
// silently dropped. (Weights from elsewhere may carry more, e.g. multi-token-prediction heads.)
void check_no_other_tensors(const SafetensorsFile& file, const ModelSpec& spec,
                            std::initializer_list<std::string_view> prefixes) {
  std::unordered_set<std::string> names;
  for (const auto& seg : spec.segments())
    for (const auto& t : seg.tensors)
      for (const auto prefix : prefixes) names.insert(std::string(prefix) + t.name);
  const SafetensorsTensor* first = nullptr;
  std::size_t others = 0;
  for (const auto& t : file.tensors())
    if (!names.contains(t.name)) {
      if (first == nullptr) first = &t;
      ++others;
    }
  if (first != nullptr)
    OOM_THROW(Errc::parse, fmt::format("{}: tensor '{}' is not in the model ({} of the file's {} tensors are not; a checkpoint "
                                       "of another model?)", file.source(), first->name, others, file.tensors().size()));
}

// Each tensor's slices' CRC-32C, by the tensor's name in its file.
using Checksums = std::unordered_map<std::string, std::vector<std::uint32_t>>;

std::string metadata_value(const SafetensorsFile& file, std::string_view key) {
  for (const auto& [k, v] : file.metadata())
    if (k == key) return v;
  return {};
}

// f(), its errors those of a damaged checkpoint (Errc::parse): a field of checksums.json missing or of
// another type (JsonCursor's Errc::invalid_argument) is damage, not a bad argument, and callers
// give the older-checkpoint advice for parse errors only.
template <class F>
auto as_damage(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    if (e.code() == Errc::parse) throw;
    throw Error(Errc::parse, e.message(), e.file(), e.line());
  }
}

// Tensor `name`'s slices' checksums in `table` (of the file `source`), or nullptr where the
// checkpoint has none at all (saved before them).
const std::vector<std::uint32_t>* listed_checksums(const Checksums& table, const std::string& name, const std::string& source) {
  if (table.empty()) return nullptr;
  const auto it = table.find(name);
  if (it == table.end()) OOM_THROW(Errc::parse, fmt::format("{}: tensor '{}' has no checksum in {}", source, name, checksums_file));
  return &it->second;
}

// `dir`/`name` (trainer_state.json or config.json) against its checksum in checksums.json, `c`.
void check_saved_file(const fs::path& dir, std::string_view name, const JsonCursor& c) {
  const fs::path path = dir / name;
  const std::uint64_t want = c["files"][name].as_uint64();
  if (const std::uint32_t got = crc32c(MappedFile(path).bytes()); got != want)
    OOM_THROW(Errc::parse, fmt::format("{}: changed after its save: its CRC-32C is {:08x}, {} has {:08x}", path.string(), got,
                                       checksums_file, want));
}

// checksums.json's table for one of the safetensors files, `c` the file's root.
Checksums tensor_checksums(const JsonCursor& c, const char* file) {
  Checksums out;
  const JsonCursor list = c["tensors"][file];
  for (const auto& [name, v] : list.as_object()) {
    auto& crcs = out[name];
    const JsonCursor entries(v, list.path() + "." + name);  // (list[name] searches the members: 150k of them)
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const std::uint64_t crc = entries[i].as_uint64();
      if (crc > 0xffffffffu) OOM_THROW(Errc::parse, fmt::format("{}[{}]: {} is not a CRC-32C", entries.path(), i, crc));
      crcs.push_back(static_cast<std::uint32_t>(crc));
    }
  }
  return out;
}

// The checksums of our own checkpoint's model.safetensors when read for its weights alone
// (--init-from a checkpoint directory, load_checkpoint without the optimizer): those of the
// checksums.json beside it when the file names a save; none for any other weights. A checksums.json
// of another save is refused, as CheckpointReader refuses it.
Checksums weight_checksums(const SafetensorsFile& file) {
  const std::string save = metadata_value(file, "save");
  const fs::path path = fs::path(file.source());
  const fs::path sums = path.parent_path() / checksums_file;
  std::error_code ec;
  if (save.empty() || !fs::exists(sums, ec)) return {};  // weights from elsewhere, or the file copied out alone
  const Json j = read_json_file(sums);
  const JsonCursor c(j, sums.string());
  return as_damage([&] {
    if (c["save"].as_string() != save)
      OOM_THROW(Errc::parse, fmt::format("{}: of save {}, while {} is of save {}: files of two saves", sums.string(),
                                         c["save"].as_string(), path.string(), save));
    return tensor_checksums(c, path.filename().string().c_str());
  });
}

/// Weights in one safetensors file or in a Hugging Face sharded checkpoint: the shards named by a
/// model.safetensors.index.json's weight_map (tensor name -> shard file, beside the index). Opened
/// from the file, the index, or a directory holding model.safetensors or the index.
class WeightFiles {
 public:
  static WeightFiles open(const fs::path& path) {
    std::error_code ec;
    if (fs::is_directory(path, ec)) {
      if (fs::exists(path / "model.safetensors.index.json", ec)) return open(path / "model.safetensors.index.json");
      if (fs::exists(path / "model.safetensors", ec)) return open(path / "model.safetensors");
      OOM_THROW(Errc::io, fmt::format("{}: a directory without model.safetensors or model.safetensors.index.json (a Hugging Face "
                                      "checkpoint has one of them)", path.string()));
    }
    if (path.extension() != ".json") return of(std::make_shared<const SafetensorsFile>(SafetensorsFile::open(path)));
    WeightFiles w;
    w.source_ = path.string();
    const Json index = read_json_file(path);
    const JsonCursor map = JsonCursor(index, path.string())["weight_map"];
    std::unordered_map<std::string, std::size_t> shard_of;  // shard file name -> files_ index
    for (const auto& member : map.as_object()) {  // (not map[name]: a scan of the map per key)
      const std::string& name = member.first;
      const std::string& file = JsonCursor(member.second, map.path() + "." + name).as_string();
      if (file.empty() || fs::path(file).filename() != fs::path(file))
        OOM_THROW(Errc::parse, fmt::format("{}: weight_map.{}: '{}' is not a file name beside the index", path.string(), name, file));
      auto [it, added] = shard_of.try_emplace(file, w.files_.size());
      if (added) {
        try {
          w.files_.push_back(std::make_shared<const SafetensorsFile>(SafetensorsFile::open(path.parent_path() / file)));
        } catch (const Error& e) {
          throw Error(e.code(), fmt::format("{}: weight_map.{}: shard '{}': {}", path.string(), name, file, e.message()), e.file(),
                      e.line());
        }
      }
      w.index_.emplace(name, it->second);
    }
    if (w.files_.empty()) OOM_THROW(Errc::parse, fmt::format("{}: weight_map names no tensor", path.string()));
    return w;
  }

  /// One file already open (our checkpoint's model.safetensors: its checksums are checked as read).
  static WeightFiles of(std::shared_ptr<const SafetensorsFile> file) {
    WeightFiles w;
    w.source_ = file->source();
    w.checksums_ = weight_checksums(*file);
    w.files_.push_back(std::move(file));
    return w;
  }
  /// Tensor `name`'s slices' checksums, or nullptr when the weights have none.
  [[nodiscard]] const std::vector<std::uint32_t>* checksums_of(const std::string& name) const {
    return listed_checksums(checksums_, name, source_);
  }

  /// The file holding tensor `name` (a packed expert's: the stacked tensor's name).
  [[nodiscard]] const SafetensorsFile& file_of(const std::string& name) const {
    if (index_.empty()) return *files_.front();
    const auto it = index_.find(name);
    if (it == index_.end()) OOM_THROW(Errc::parse, fmt::format("{}: weight_map has no tensor '{}'", source_, name));
    return *files_[it->second];
  }
  [[nodiscard]] const std::string& source() const { return source_; }
  [[nodiscard]] const std::vector<std::shared_ptr<const SafetensorsFile>>& files() const { return files_; }

 private:
  std::string source_;
  std::vector<std::shared_ptr<const SafetensorsFile>> files_;
  std::unordered_map<std::string, std::size_t> index_;  ///< empty: one file holds every tensor
  Checksums checksums_;  ///< our own checkpoint's, else empty
};

// Every tensor of `spec` in the file that holds it, checked before anyone reads one; and what the
// model leaves unread. Whole decoder layers past its last (a deeper model's: the first N layers of
// a checkpoint are a way to train a slice of it) are left, said once as a warning; a tensor the
// model lacks inside one of its own layers is refused (another architecture's weights), and so is
// any other extra tensor in our own checkpoints (producer "oom": a tied model given its untied
// head). Other extras of weights from elsewhere, such as a Qwen3-Next checkpoint's
// multi-token-prediction head ("mtp."), are left unread.
void check_tensors(const WeightFiles& files, const ModelSpec& spec) {
  for (const auto& seg : spec.segments())
    for (const auto& t : seg.tensors) check_tensor(files.file_of(t.name), t, "weights must be");
  std::unordered_set<std::string> names;
  std::string layers;  // the decoder layers' prefix, as the model names them: "model.layers.", "model.language_model.layers."
  for (const auto& seg : spec.segments())
    for (const auto& t : seg.tensors) {
      names.insert(t.name);
      if (const auto at = t.name.find("layers.0."); layers.empty() && at != std::string::npos) layers = t.name.substr(0, at + 7);
    }
  std::uint64_t first_dropped = ~std::uint64_t{0}, last_dropped = 0, dropped = 0;
  for (const auto& file : files.files()) {
    const auto& meta = file->metadata();
    const bool ours = std::find(meta.begin(), meta.end(), std::pair<std::string, std::string>{"producer", "oom"}) != meta.end();
    for (const auto& t : file->tensors()) {
      if (names.contains(t.name) || t.name.ends_with(".rotary_emb.inv_freq")) continue;
      std::uint64_t layer = 0;
      const bool in_layer = !layers.empty() && t.name.starts_with(layers) &&
                            std::from_chars(t.name.data() + layers.size(), t.name.data() + t.name.size(), layer).ec == std::errc();
      if (in_layer && layer >= static_cast<std::uint64_t>(spec.num_layers())) {
        first_dropped = std::min(first_dropped, layer);
        last_dropped = std::max(last_dropped, layer);
        ++dropped;
        continue;
      }
      if (ours || in_layer)
        OOM_THROW(Errc::parse, fmt::format("{}: tensor '{}' is not in the model, a model of {} decoder layers: weights of "
                                           "another model?", file->source(), t.name, spec.num_layers()));
    }
  }
  if (dropped > 0)
    log_warn("{}: layers {} to {} ({} tensors) are past the model's {} decoder layers and are not read: its first {} layers are",
             files.source(), first_dropped, last_dropped, dropped, spec.num_layers(), spec.num_layers());
}

void read_segment(const WeightFiles& files, const StateSegment& seg, std::span<float> out);

// Every segment of `spec`, checked first.
std::vector<std::vector<float>> read_all_segments(const WeightFiles& files, const ModelSpec& spec) {
  check_tensors(files, spec);
  std::vector<std::vector<float>> out;
  for (const auto& seg : spec.segments()) {
    out.emplace_back(seg.parameters());
    read_segment(files, seg, out.back());
  }
  return out;
}

void read_segment(const WeightFiles& files, const StateSegment& seg, std::span<float> out) {
  if (out.size() != seg.parameters())
    OOM_THROW(Errc::invalid_argument, fmt::format("{}: segment '{}' has {} parameters; a span of {}", files.source(), seg.name,
                                                  seg.parameters(), out.size()));
  std::uint64_t offset = 0;
  for (const auto& t : seg.tensors) {
    read_values(files.file_of(t.name), t, out.subspan(offset, t.elements()), false, files.checksums_of(t.name));
    offset += t.elements();
  }
}

}  // namespace

std::optional<std::uint64_t> checkpoint_step(std::string_view name) {
  constexpr std::string_view prefix = "checkpoint-";
  if (!name.starts_with(prefix) || name.size() == prefix.size()) return std::nullopt;
  const char* first = name.data() + prefix.size();
  const char* last = name.data() + name.size();
  std::uint64_t step = 0;
  const auto r = std::from_chars(first, last, step);
  if (r.ec != std::errc() || r.ptr != last) return std::nullopt;
  return step;
}

std::vector<std::pair<std::uint64_t, fs::path>> complete_checkpoints(const fs::path& run_dir) {
  std::vector<std::pair<std::uint64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir, ec))
    if (const auto step = checkpoint_step(e.path().filename().string()); step && e.is_directory(ec)) out.emplace_back(*step, e.path());
  std::sort(out.begin(), out.end());
  return out;
}

Bytes checkpoint_state_bytes(const ModelSpec& spec) { return Bytes{spec.total_parameters() * 3 * sizeof(float)}; }

std::string checkpoint_name(std::uint64_t step) { return fmt::format("checkpoint-{:06}", step); }

fs::path save_checkpoint(const fs::path& run_dir, const ModelSpec& spec, std::span<const SegmentOptimizerState> state,
                         const CheckpointWrite& what) {
  const std::vector<SegmentStateView> views(state.begin(), state.end());
  return save_checkpoint(run_dir, spec, std::span<const SegmentStateView>(views), what);
}

fs::path save_checkpoint(const fs::path& run_dir, const ModelSpec& spec, std::span<const SegmentStateView> state,
                         const CheckpointWrite& what) {
  const auto& segs = spec.segments();
  if (state.size() != segs.size())
    OOM_THROW(Errc::invalid_argument, fmt::format("checkpoint: {} segment states for a model of {} segments", state.size(), segs.size()));
  for (std::size_t s = 0; s < segs.size(); ++s) {
    const auto n = segs[s].parameters();
    const auto& v = state[s];
    if (v.size(StateArray::master) != n || v.size(StateArray::exp_avg) != n || v.size(StateArray::exp_avg_sq) != n)
      OOM_THROW(Errc::invalid_argument, fmt::format("checkpoint: segment '{}' holds {}/{}/{} values (master/m/v) for {} parameters",
                                                    segs[s].name, v.size(StateArray::master), v.size(StateArray::exp_avg),
                                                    v.size(StateArray::exp_avg_sq), n));
  }
  if (what.keep < 1)
    OOM_THROW(Errc::invalid_argument, fmt::format("checkpoint: keep is {}; at least 1 (the new checkpoint) is kept", what.keep));
  // What is saved must read back, or `latest` would name a checkpoint no run can resume from:
  // trainer_state.json as JSON (a string of bytes that are not UTF-8 is written as it is, and had
  // been refused only by the resume), config.json as a JSON object.
  std::string trainer_state_text;
  try {
    trainer_state_text = what.trainer_state.dump(2) + "\n";
    (void)Json::parse(trainer_state_text, "trainer_state");
  } catch (const Error& e) {
    OOM_THROW(Errc::invalid_argument,
              fmt::format("checkpoint: the trainer state would not read back ({}); nothing was written", e.message()));
  }
  try {
    if (!Json::parse(what.config_json, "config").is_object()) OOM_THROW(Errc::parse, "not a JSON object");
  } catch (const Error& e) {
    OOM_THROW(Errc::invalid_argument,
              fmt::format("checkpoint: the config is not a model's config.json ({}); nothing was written", e.message()));
  }
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) OOM_THROW(Errc::io, fmt::format("{}: cannot create the run directory: {}", run_dir.string(), ec.message()));
  const std::string name = checkpoint_name(what.step);
  const fs::path final_dir = run_dir / name;
  const fs::path partial = run_dir / (name + ".partial");
  const fs::path aside = set_aside(final_dir);
  // What killed saves left, removed before this one is written (it takes room a full disk may need).
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    const auto fn = e.path().filename().string();
    if (!e.is_directory(ec)) continue;
    if (fn.ends_with(".partial") && checkpoint_step(fn.substr(0, fn.size() - 8))) {
      // Left by a save that was killed (a second signal, SIGKILL, a crash): never complete, never
      // named by `latest`, and as large as the model's state. (One writer per run directory:
      // oom-train holds its lock.)
      fs::remove_all(e.path(), ec);
      if (ec && what.on_warning)
        what.on_warning(fmt::format("cannot remove {}, left by an earlier save ({}): remove it by hand", e.path().string(), ec.message()));
    } else if (fn.ends_with(".old")) {
      // Set aside by a save that crashed after renaming its checkpoint in: a stale copy. Alone (the
      // crash came between the two renames), it is the complete checkpoint of its step: put back.
      const fs::path in_place = run_dir / fn.substr(0, fn.size() - 4);
      if (checkpoint_step(in_place.filename().string())) {
        if (fs::is_directory(in_place, ec)) fs::remove_all(e.path(), ec);
        else (void)restore_set_aside(in_place);
      }
    }
  }
  (void)remove_stale_temporaries(run_dir / "latest");  // a kill between writing `latest` and renaming it
  fs::remove_all(partial, ec);
  if (ec)
    OOM_THROW(Errc::io, fmt::format("{}: cannot remove this step's earlier partial checkpoint: {}", partial.string(), ec.message()));
  ec = restore_set_aside(final_dir);
  if (ec)
    OOM_THROW(Errc::io, fmt::format("cannot rename {} back to {}: {}", aside.string(), final_dir.string(), ec.message()));
  // Something else under the checkpoint's name (a file, say) had been moved aside and deleted.
  if (const auto st = fs::symlink_status(final_dir, ec); !ec && fs::exists(st) && !fs::is_directory(st))
    OOM_THROW(Errc::io, fmt::format("{}: exists and is not a checkpoint directory, and {} would replace it: move it away; nothing "
                                    "was written", final_dir.string(), name));
  // Room for the whole checkpoint before a byte of it is written: a full disk had been found only
  // once as much as fit was written (tens of GB for a large model), in an error naming no sizes.
  // The kept checkpoints are removed only once the new one is complete, so they hold their room.
  const std::uint64_t parameters = spec.total_parameters();
  const Bytes needed = checkpoint_state_bytes(spec);
  // (A file system that reports no blocks, as some FUSE and network ones do, says nothing of its room.)
  if (struct statvfs fs_stat {}; ::statvfs(run_dir.c_str(), &fs_stat) == 0 && fs_stat.f_blocks > 0) {
    const Bytes available{static_cast<std::uint64_t>(fs_stat.f_bavail) * fs_stat.f_frsize};
    if (available < needed)
      OOM_THROW(Errc::io, fmt::format("{}: {} needs at least {} (the fp32 weights and two moments of {} parameters), its file "
                                      "system has {} free (older checkpoints are removed only once a new one is complete); nothing was "
                                      "written", run_dir.string(), name, needed, parameters,
                                      available));
  }
  fs::create_directory(partial, ec);
  if (ec) OOM_THROW(Errc::io, fmt::format("{}: cannot create: {}", partial.string(), ec.message()));

  try {
    const auto srcs = sources(spec);
    // Each tensor slice's CRC-32C, taken as it is written: [source][master, exp_avg, exp_avg_sq].
    std::vector<std::array<std::vector<std::uint32_t>, 3>> crcs(srcs.size());
    std::vector<SafetensorsEntry> model, optimizer;
    for (std::size_t i = 0; i < srcs.size(); ++i) {
      const auto& src = srcs[i];
      model.push_back(entry(src.name, src, state, StateArray::master, crcs[i][0]));
      optimizer.push_back(entry("exp_avg." + src.name, src, state, StateArray::exp_avg, crcs[i][1]));
      optimizer.push_back(entry("exp_avg_sq." + src.name, src, state, StateArray::exp_avg_sq, crcs[i][2]));
    }
    const std::string save = save_id();
    const SafetensorsFile::Metadata meta{
        {"format", "pt"}, {"producer", "oom"}, {"step", std::to_string(what.step)}, {"save", save}};
    write_safetensors(partial / "model.safetensors", std::move(model), meta);
    write_safetensors(partial / "optimizer.safetensors", std::move(optimizer), meta);
    write_file_atomically(partial / "trainer_state.json", trainer_state_text);
    write_file_atomically(partial / "config.json", what.config_json);
    Json::Object model_crcs, optimizer_crcs;
    const auto list = [](const std::vector<std::uint32_t>& v) {
      Json::Array a;
      for (const auto c : v) a.emplace_back(static_cast<unsigned long long>(c));
      return Json(std::move(a));
    };
    for (std::size_t i = 0; i < srcs.size(); ++i) {
      model_crcs.emplace_back(srcs[i].name, list(crcs[i][0]));
      optimizer_crcs.emplace_back("exp_avg." + srcs[i].name, list(crcs[i][1]));
      optimizer_crcs.emplace_back("exp_avg_sq." + srcs[i].name, list(crcs[i][2]));
    }
    const auto crc_of = [](std::string_view text) {
      return static_cast<unsigned long long>(crc32c(std::as_bytes(std::span(text.data(), text.size()))));
    };
    const Json checksums(Json::Object{
        {"format", "oom checkpoint checksums"},
        {"version", 1},
        {"algorithm", "CRC-32C"},
        {"step", static_cast<unsigned long long>(what.step)},
        {"save", save},
        {"files", Json(Json::Object{{"trainer_state.json", crc_of(trainer_state_text)}, {"config.json", crc_of(what.config_json)}})},
        {"tensors", Json(Json::Object{{"model.safetensors", Json(std::move(model_crcs))},
                                      {"optimizer.safetensors", Json(std::move(optimizer_crcs))}})}});
    // Written last: a checkpoint whose files name a save has its checksums.
    write_file_atomically(partial / checksums_file, checksums.dump() + "\n");

    // A checkpoint of the same step from an earlier, abandoned attempt, which `latest` may name:
    // moved aside rather than deleted, so that at every instant `latest` finds it either in place
    // or at `aside`, from where latest_checkpoint (or the next save) puts it back.
    if (fs::exists(final_dir, ec)) {
      fs::remove_all(aside, ec);
      if (!ec) fs::rename(final_dir, aside, ec);
      if (ec) OOM_THROW(Errc::io, fmt::format("cannot rename {} to {}: {}", final_dir.string(), aside.string(), ec.message()));
    }
    fs::rename(partial, final_dir, ec);
    if (ec) OOM_THROW(Errc::io, fmt::format("cannot rename {} to {}: {}", partial.string(), final_dir.string(), ec.message()));
  } catch (...) {
    // Best effort: a failed save leaves no partial copy of the model's state behind.
    std::error_code ignored;
    fs::remove_all(partial, ignored);
    (void)restore_set_aside(final_dir);
    throw;
  }
  // Made durable before `latest` names it: otherwise both renames waited for `latest`'s fsync of
  // the directory, and a power loss before it could keep the new `latest` without the directory it
  // names (ext4 and XFS journal the two in order; POSIX promises no order).
  // A failure here had left the checkpoint complete under its final name with `latest` not naming
  // it (a full disk at `latest`'s write: the run said it had nothing to resume from, and --resume
  // and a new run were both refused until `latest` was written by hand). Undone unless `latest`
  // came to name it (only the directory's fsync after `latest`'s rename failed): then it is the
  // run's checkpoint, and the failure a warning.
  try {
    sync_parent_directory(final_dir);
    write_file_atomically(run_dir / "latest", name + "\n");
  } catch (const std::exception& e) {
    if (latest_names(run_dir / "latest", name)) {
      if (what.on_warning)
        what.on_warning(fmt::format("{} is complete and {} names it, but {}: it may not survive a power loss", final_dir.string(),
                                    (run_dir / "latest").string(), e.what()));
    } else {
      std::error_code renamed, ignored;
      fs::rename(final_dir, partial, renamed);  // out of the complete names first, as pruning does
      fs::remove_all(renamed ? final_dir : partial, ignored);
      (void)restore_set_aside(final_dir);
      throw;
    }
  }
  fs::remove_all(aside, ec);

  // Keep the newest `keep` complete checkpoints by step up to this one; `latest` is always among
  // them. Those of higher steps are a continuation the run left (it resumed from an earlier one):
  // neither counted nor removed, so they no longer push this run's own fallbacks out (with two of
  // them and keep 2 only `latest` had stayed of this run); each is replaced when the run saves
  // its step.
  auto complete = complete_checkpoints(run_dir);
  std::erase_if(complete, [&](const auto& c) { return c.first > what.step; });
  const std::size_t keep = static_cast<std::size_t>(what.keep);
  for (std::size_t i = 0; i + keep < complete.size(); ++i) {
    const fs::path& old = complete[i].second;
    if (old == final_dir) continue;
    // Out of the complete checkpoints' names first: a kill while its files went (seconds for a large
    // one) had left a directory named as complete with some of them missing. A .partial is never
    // complete, and the next save removes what is left of it.
    fs::path doomed = old;
    doomed += ".partial";
    fs::rename(old, doomed, ec);
    const fs::path& gone = ec ? old : doomed;
    fs::remove_all(gone, ec);
    if (ec && what.on_warning)
      what.on_warning(fmt::format("cannot remove the older checkpoint {} ({}); it stays at {}: remove it by hand", old.string(), ec.message(), gone.string()));
  }
  return final_dir;
}

namespace {

/// "<run_dir> holds <the checkpoints>: to resume the run, write into it the name of the checkpoint
/// to continue from (echo <newest> > <latest>)", for a `latest` that names none of them; "" where
/// the run directory holds no complete checkpoint.
std::string what_run_dir_holds(const fs::path& run_dir, const fs::path& latest) {
  const auto complete = complete_checkpoints(run_dir);
  if (complete.empty()) return "";
  const std::string newest = complete.back().second.filename().string();
  return fmt::format("{} holds {}: to resume the run, write into it the name of the checkpoint to continue from (echo {} > {})",
                     run_dir.string(),
                     complete.size() == 1 ? newest
                                          : fmt::format("{} checkpoints, {} to {}", complete.size(),
                                                        complete.front().second.filename().string(), newest),
                     newest, latest.string());
}

}  // namespace

std::optional<fs::path> latest_checkpoint(const fs::path& run_dir) {
  const fs::path latest = run_dir / "latest";
  std::error_code ec;
  if (!fs::exists(latest, ec)) {
    // Checkpoints without `latest` (it was removed, or a save was killed between renaming the run's
    // first checkpoint in and writing `latest`) are a run all the same: taken for none, a new run
    // there had replaced them step by step and emptied metrics.jsonl, and --resume said "no checkpoint".
    const std::string holds = what_run_dir_holds(run_dir, latest);
    if (holds.empty()) return std::nullopt;
    OOM_THROW(Errc::parse, fmt::format("{}: missing, while {}", latest.string(), holds));
  }
  MappedFile f(latest);
  const std::string name = without_blanks(std::string(reinterpret_cast<const char*>(f.bytes().data()), f.bytes().size()));
  // A control byte (a NUL cut the path short, to the run directory itself, and the message with it)
  // is in no checkpoint's name: refused, the name shown with such bytes escaped.
  if (std::any_of(name.begin(), name.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; })) {
    std::string shown;
    for (const char c : name)
      shown += static_cast<unsigned char>(c) < 0x20 || c == 0x7f ? fmt::format("\\x{:02x}", static_cast<unsigned char>(c)) : std::string(1, c);
    OOM_THROW(Errc::parse, fmt::format("{}: names '{}', which is not a checkpoint directory (a name holds no control bytes)",
                                       latest.string(), shown));
  }
  if (!name.empty() && name.find('/') == std::string::npos && checkpoint_step(name)) {
    ec = restore_set_aside(run_dir / name);
    if (ec)
      OOM_THROW(Errc::io, fmt::format("{}: names '{}', whose files are at {} and cannot be moved back: {}", latest.string(), name,
                                      set_aside(run_dir / name).string(), ec.message()));
  }
  if (name.empty() || name.find('/') != std::string::npos || !checkpoint_step(name) || !fs::is_directory(run_dir / name, ec)) {
    const std::string holds = what_run_dir_holds(run_dir, latest);
    OOM_THROW(Errc::parse, fmt::format("{}: names '{}', which is not a checkpoint directory{}", latest.string(), name,
                                       holds.empty() ? std::string() : "; " + holds));
  }
  return run_dir / name;
}

struct CheckpointReader::Files {
  const ModelSpec* spec;
  SafetensorsFile model, optimizer;
  Json trainer_state;
  // Each tensor's slices' CRC-32C from checksums.json, by its name in its file; empty for a
  // checkpoint saved before checksums were.
  Checksums model_crcs, optimizer_crcs;
};

namespace {

// The two safetensors files are of one save (the same step and save id in their metadata), as
// checksums.json says; trainer_state.json and config.json (where present) have the checksums it
// lists. Returns its tensor checksums, none for a checkpoint saved before them.
std::pair<Checksums, Checksums> check_one_save(const fs::path& dir, const SafetensorsFile& model, const SafetensorsFile& optimizer) {
  const auto save_of = [](const SafetensorsFile& f) {
    const std::string step = metadata_value(f, "step"), save = metadata_value(f, "save");
    return fmt::format("step {}{}", step.empty() ? "?" : step, save.empty() ? std::string() : ", save " + save);
  };
  if (metadata_value(model, "step") != metadata_value(optimizer, "step") ||
      metadata_value(model, "save") != metadata_value(optimizer, "save"))
    OOM_THROW(Errc::parse, fmt::format("{}: model.safetensors is of {}, optimizer.safetensors of {}: files of two saves (one copied in "
                                       "from another checkpoint?)", dir.string(), save_of(model), save_of(optimizer)));
  const std::string save = metadata_value(model, "save");
  const fs::path path = dir / checksums_file;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    if (!save.empty())
      OOM_THROW(Errc::parse, fmt::format("{}: missing, while the checkpoint's files are of save {}", path.string(), save));
    return {};  // saved before checksums were
  }
  const Json j = read_json_file(path);
  const JsonCursor c(j, path.string());
  return as_damage([&]() -> std::pair<Checksums, Checksums> {
    if (c["save"].as_string() != save || std::to_string(c["step"].as_uint64()) != metadata_value(model, "step"))
      OOM_THROW(Errc::parse, fmt::format("{}: of step {}, save {}, while the safetensors files are of {}", path.string(),
                                         c["step"].as_uint64(), c["save"].as_string(), save_of(model)));
    for (const char* name : {"trainer_state.json", "config.json"})
      if (fs::exists(dir / name, ec)) check_saved_file(dir, name, c);  // (a missing config.json is its reader's to name)
    return {tensor_checksums(c, "model.safetensors"), tensor_checksums(c, "optimizer.safetensors")};
  });
}

}  // namespace

void check_saved_file(const fs::path& dir, std::string_view name) {
  const fs::path path = dir / checksums_file;
  std::error_code ec;
  if (!fs::exists(path, ec)) return;  // a checkpoint saved before checksums
  const Json j = read_json_file(path);
  as_damage([&] { check_saved_file(dir, name, JsonCursor(j, path.string())); });
}

namespace {

}  // namespace

CheckpointReader::CheckpointReader(const fs::path& dir, const ModelSpec& spec)
    : files_(std::make_unique<Files>(Files{&spec, SafetensorsFile::open(dir / "model.safetensors"),
                                           SafetensorsFile::open(dir / "optimizer.safetensors"),
                                           read_json_file(dir / "trainer_state.json"), {}, {}})) {
  check_tensors(files_->model, spec, "", "checkpoints hold");
  check_tensors(files_->optimizer, spec, "exp_avg.", "checkpoints hold");
  check_tensors(files_->optimizer, spec, "exp_avg_sq.", "checkpoints hold");
  check_no_other_tensors(files_->model, spec, {""});
  check_no_other_tensors(files_->optimizer, spec, {"exp_avg.", "exp_avg_sq."});
  std::tie(files_->model_crcs, files_->optimizer_crcs) = check_one_save(dir, files_->model, files_->optimizer);
}

CheckpointReader::~CheckpointReader() = default;
CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;

const Json& CheckpointReader::trainer_state() const { return files_->trainer_state; }

void CheckpointReader::read(std::size_t segment, std::span<float> master, std::span<float> exp_avg,
                            std::span<float> exp_avg_sq) const {
  const auto& segs = files_->spec->segments();
  if (segment >= segs.size())
    OOM_THROW(Errc::invalid_argument, fmt::format("checkpoint read: segment {} of a model of {}", segment, segs.size()));
  const auto& seg = segs[segment];
  const std::uint64_t n = seg.parameters();
  if (master.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n)
    OOM_THROW(Errc::invalid_argument, fmt::format("checkpoint read: segment '{}' has {} parameters; spans of {}/{}/{}", seg.name, n,
                                                  master.size(), exp_avg.size(), exp_avg_sq.size()));
  std::uint64_t offset = 0;
  for (const auto& t : seg.tensors) {
    for (const auto& [file, crcs, prefix, out] :
         {std::tuple{&files_->model, &files_->model_crcs, "", master}, {&files_->optimizer, &files_->optimizer_crcs, "exp_avg.", exp_avg},
          {&files_->optimizer, &files_->optimizer_crcs, "exp_avg_sq.", exp_avg_sq}}) {
      TensorSpec named = t;
      named.name = std::string(prefix) + t.name;
      read_values(*file, named, out.subspan(offset, t.elements()), std::string_view(prefix) == "exp_avg_sq.",
                  listed_checksums(*crcs, named.name, file->source()));
    }
    offset += t.elements();
  }
}

std::vector<SegmentOptimizerState> CheckpointReader::read_all() const {
  std::vector<SegmentOptimizerState> out;
  for (std::size_t s = 0; s < files_->spec->segments().size(); ++s) {
    const auto n = files_->spec->segments()[s].parameters();
    SegmentOptimizerState st{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
    read(s, st.master, st.exp_avg, st.exp_avg_sq);
    out.push_back(std::move(st));
  }
  return out;
}

SegmentStateSource CheckpointReader::source() const {
  return [this](std::size_t s, std::span<float> w, std::span<float> m, std::span<float> v) { read(s, w, m, v); };
}

CheckpointRead load_checkpoint(const fs::path& dir, const ModelSpec& spec, bool with_optimizer) {
  CheckpointRead r;
  if (!with_optimizer) {
    // The trainer state first (the small file), then model.safetensors opened once: checked for
    // tensors the model lacks, then read.
    r.trainer_state = read_json_file(dir / "trainer_state.json");
    auto file = std::make_shared<const SafetensorsFile>(SafetensorsFile::open(dir / "model.safetensors"));
    check_no_other_tensors(*file, spec, {""});
    for (auto& w : read_all_segments(WeightFiles::of(std::move(file)), spec)) r.state.push_back({std::move(w), {}, {}});
    return r;
  }
  const CheckpointReader reader(dir, spec);
  r.state = reader.read_all();
  r.trainer_state = reader.trainer_state();
  return r;
}

std::vector<std::vector<float>> load_weights(const fs::path& safetensors, const ModelSpec& spec) {
  return read_all_segments(WeightFiles::open(safetensors), spec);
}

SegmentWeightSource weight_source(const fs::path& path, const ModelSpec& spec) {
  auto files = std::make_shared<const WeightFiles>(WeightFiles::open(path));
  check_tensors(*files, spec);
  return [files, &spec](std::size_t s, std::span<float> out) {
    if (s >= spec.segments().size())
      OOM_THROW(Errc::invalid_argument, fmt::format("{}: segment {} of a model of {}", files->source(), s, spec.segments().size()));
    read_segment(*files, spec.segments()[s], out);
  };
}

}  // namespace oom

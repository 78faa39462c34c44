// Checkpoints: the state comes back bit for bit, packed expert tensors are written whole, nothing
// partial is ever named by `latest`, old checkpoints are pruned, and bad files are named.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <set>

#include <fmt/format.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "oom/core/error.hpp"
#include "oom/core/log.hpp"
#include "oom/io/checkpoint.hpp"
#include "oom/io/crc32c.hpp"
#include "oom/io/safetensors.hpp"
#include "oom/model/model_spec.hpp"
#include "resident.hpp"
#include "temp_dir.hpp"

using namespace oom;
using oom::test::resident_kib;
namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const char* name) {
  const fs::path p = fs::temp_directory_path() / fmt::format("oom-ckpt-{}-{}", name, ::getpid());
  fs::remove_all(p);
  return p;
}

std::vector<SegmentOptimizerState> random_state(const ModelSpec& spec, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  std::vector<SegmentOptimizerState> out;
  for (const auto& s : spec.segments()) {
    SegmentOptimizerState st;
    for (auto* v : {&st.master, &st.exp_avg, &st.exp_avg_sq}) {
      v->resize(s.parameters());
      for (auto& x : *v) x = d(rng);
    }
    for (auto& x : st.exp_avg_sq) x = std::abs(x);  // a mean of squares
    out.push_back(std::move(st));
  }
  return out;
}

// Writes `value` over element `at` of fp32 tensor `name` (a plain one) in the safetensors file `path`.
// With `rechecksum`, the checksums.json beside it is made to match, as if the checkpoint had been
// saved so (by a writer without the save's own checks): the reader's value checks are what is
// tested. Without it, as a flipped bit or a bad disk would: the checksum no longer matches.
void poke(const fs::path& path, const std::string& name, std::uint64_t at, float value, bool rechecksum = true) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f);
  std::uint64_t header = 0;
  f.read(reinterpret_cast<char*>(&header), 8);
  std::string text(header, '\0');
  f.read(text.data(), static_cast<std::streamsize>(header));
  const Json meta = Json::parse(text);
  const std::uint64_t begin = static_cast<std::uint64_t>(meta.find(name)->find("data_offsets")->as_array().at(0).as_int64());
  f.seekp(static_cast<std::streamoff>(8 + header + begin + at * sizeof(float)));
  f.write(reinterpret_cast<const char*>(&value), sizeof value);
  REQUIRE(f);
  f.close();
  const fs::path sums = path.parent_path() / "checksums.json";
  if (!rechecksum || !fs::exists(sums)) return;
  const auto& offsets = meta.find(name)->find("data_offsets")->as_array();
  const auto end = static_cast<std::uint64_t>(offsets.at(1).as_int64());
  std::ifstream in(path, std::ios::binary);
  std::string bytes(end - begin, '\0');
  in.seekg(static_cast<std::streamoff>(8 + header + begin));
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(in);
  Json j = read_json_file(sums);
  Json tensors = *j.find("tensors");
  Json file = *tensors.find(path.filename().string());
  file.set(name, Json(Json::Array{Json(static_cast<unsigned long long>(crc32c(std::as_bytes(std::span(bytes.data(), bytes.size())))))}));
  tensors.set(path.filename().string(), std::move(file));
  j.set("tensors", std::move(tensors));
  write_file_atomically(sums, j.dump());
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

ModelSpec tiny() { return ModelSpec::from_file(fs::path(OOM_SOURCE_DIR) / "examples/configs/tiny-moe.json"); }

}  // namespace

TEST_CASE("a checkpoint round-trips the optimizer state bit for bit; latest names the newest, older ones are pruned") {
  const auto spec = tiny();
  const auto dir = fresh_dir("roundtrip");
  CHECK_FALSE(latest_checkpoint(dir).has_value());
  const auto a = random_state(spec, 1), b = random_state(spec, 2);
  Json ts = Json::object();
  ts.set("step", 5);
  (void)save_checkpoint(dir, spec, a, {5, "{}", ts, 1});
  ts.set("step", 7);
  const auto where = save_checkpoint(dir, spec, b, {7, "{\"model_type\": \"qwen3_moe\"}", ts, 1});
  CHECK(where == dir / "checkpoint-000007");
  CHECK_FALSE(fs::exists(dir / "checkpoint-000005"));  // keep = 1
  // A crash mid-write leaves a .partial directory, which nothing reads.
  fs::create_directories(dir / "checkpoint-000009.partial");
  REQUIRE(latest_checkpoint(dir).has_value());
  CHECK(*latest_checkpoint(dir) == where);
  const auto r = load_checkpoint(where, spec);
  REQUIRE(r.state.size() == b.size());
  for (std::size_t s = 0; s < b.size(); ++s) {
    CAPTURE(spec.segments()[s].name);
    CHECK(same_bits(r.state[s].master, b[s].master));
    CHECK(same_bits(r.state[s].exp_avg, b[s].exp_avg));
    CHECK(same_bits(r.state[s].exp_avg_sq, b[s].exp_avg_sq));
  }
  CHECK(r.trainer_state.find("step")->as_int64() == 7);
  // Weights are under their Hugging Face names, as transformers expects.
  const auto model = SafetensorsFile::open(where / "model.safetensors");
  CHECK(model.find("model.layers.3.mlp.experts.7.down_proj.weight") != nullptr);
  CHECK(model.find("lm_head.weight") != nullptr);
  CHECK(load_weights(where / "model.safetensors", spec)[1] == b[1].master);
  fs::remove_all(dir);
}

TEST_CASE("pruning keeps this run's newest checkpoints; those of higher steps (a continuation left behind) are neither counted nor removed") {
  const auto spec = tiny();
  const auto dir = fresh_dir("abandoned");
  const auto st = random_state(spec, 4);
  for (std::uint64_t step : {4, 8, 12, 16}) (void)save_checkpoint(dir, spec, st, {step, "{}", Json::object(), 4});
  // Resumed from checkpoint 4 (`latest` edited back): the run saves 6 and 7 with keep 2.
  (void)save_checkpoint(dir, spec, st, {6, "{}", Json::object(), 2});
  (void)save_checkpoint(dir, spec, st, {7, "{}", Json::object(), 2});
  CHECK(*latest_checkpoint(dir) == dir / "checkpoint-000007");
  // The run's own two newest stay (keep 2 had left only 7 beside the higher ones); 8-16 untouched.
  std::vector<std::uint64_t> steps;
  for (const auto& [step, path] : complete_checkpoints(dir)) steps.push_back(step);
  CHECK(steps == std::vector<std::uint64_t>{6, 7, 8, 12, 16});
  // Saving over a higher step replaces it, and the ones below it count again.
  (void)save_checkpoint(dir, spec, st, {8, "{}", Json::object(), 2});
  steps.clear();
  for (const auto& [step, path] : complete_checkpoints(dir)) steps.push_back(step);
  CHECK(steps == std::vector<std::uint64_t>{7, 8, 12, 16});
  fs::remove_all(dir);
}

namespace {
// Makes `file` impossible to remove, also for root: the immutable attribute where the file system
// takes it (ext4, XFS, tmpfs since Linux 6.0), else, for a user other than root, its directory
// read-only. False where neither holds; undo() puts it back.
struct Unremovable {
  fs::path file;
  bool attribute = false, held = false;
  explicit Unremovable(fs::path f) : file(std::move(f)) {
    if (set_immutable(true)) {
      attribute = held = true;
    } else if (geteuid() != 0) {
      fs::permissions(file.parent_path(), fs::perms::owner_read | fs::perms::owner_exec);
      held = true;
    }
  }
  bool set_immutable(bool on) const {
    const int fd = ::open(file.c_str(), O_RDONLY);
    if (fd < 0) return false;
    int flags = 0;
    bool ok = ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
    flags = on ? (flags | FS_IMMUTABLE_FL) : (flags & ~FS_IMMUTABLE_FL);
    ok = ok && ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
    ::close(fd);
    return ok;
  }
  void undo() noexcept {
    if (!held) return;
    std::error_code ec;  // called from the destructor too: a failure leaves the test directory behind
    if (attribute) (void)set_immutable(false);
    else fs::permissions(file.parent_path(), fs::perms::owner_all, ec);
    held = false;
  }
  ~Unremovable() { undo(); }
};
}  // namespace

TEST_CASE("an older checkpoint pruning cannot remove is named in a warning; the save stands") {
  const auto spec = tiny();
  const auto dir = fresh_dir("unremovable");
  const auto st = random_state(spec, 6);
  std::vector<std::string> warnings;
  const auto warn = [&](const std::string& m) { warnings.push_back(m); };
  (void)save_checkpoint(dir, spec, st, {1, "{}", Json::object(), 1, warn});
  Unremovable stuck(dir / "checkpoint-000001" / "config.json");
  if (!stuck.held) {
    MESSAGE("skipped: this file system takes no immutable attribute and we are root, so nothing here cannot be removed");
    fs::remove_all(dir);
    return;
  }
  const auto where = save_checkpoint(dir, spec, st, {2, "{}", Json::object(), 1, warn});
  CHECK(*latest_checkpoint(dir) == where);
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].find("cannot remove the older checkpoint " + (dir / "checkpoint-000001").string()) != std::string::npos);
  // What stays is out of the complete checkpoints' names (renamed .partial first, when the
  // directory could be renamed), and the next save says so again rather than failing.
  std::vector<std::uint64_t> steps;
  for (const auto& [step, path] : complete_checkpoints(dir)) steps.push_back(step);
  CHECK(steps == std::vector<std::uint64_t>{2});
  CHECK(warnings[0].find("it stays at " + (dir / "checkpoint-000001.partial").string()) != std::string::npos);
  (void)save_checkpoint(dir, spec, st, {3, "{}", Json::object(), 1, warn});
  REQUIRE(warnings.size() >= 2);
  CHECK(warnings[1].find("left by an earlier save") != std::string::npos);
  // Without a listener the save is as quiet as before, and once it can, it removes the rest.
  stuck.file = dir / "checkpoint-000001.partial" / "config.json";  // where the rename took it
  stuck.undo();
  (void)save_checkpoint(dir, spec, st, {4, "{}", Json::object(), 1});
  CHECK_FALSE(fs::exists(dir / "checkpoint-000001.partial"));
  fs::remove_all(dir);
}

TEST_CASE("packed expert tensors are gathered from their segments and split again") {
  // A small Qwen3.5-MoE: experts packed per layer as gate_up_proj [E, 2I, H] and down_proj [E, H, I].
  Json j = read_json_file(fs::path(OOM_SOURCE_DIR) / "examples/configs/qwen3.5-35b-a3b.json");
  Json text = *j.find("text_config");
  for (auto [k, v] : {std::pair{"hidden_size", 32}, {"num_hidden_layers", 4}, {"num_experts", 4}, {"moe_intermediate_size", 8},
                      {"shared_expert_intermediate_size", 8}, {"vocab_size", 64}, {"num_attention_heads", 2},
                      {"num_key_value_heads", 1}, {"head_dim", 16}, {"linear_num_key_heads", 2}, {"linear_num_value_heads", 2},
                      {"linear_key_head_dim", 8}, {"linear_value_head_dim", 8}, {"num_experts_per_tok", 2}})
    text.set(k, v);
  if (text.find("layer_types") != nullptr)
    text.set("layer_types", Json::parse(R"(["linear_attention","linear_attention","linear_attention","full_attention"])"));
  j.set("text_config", text);
  const auto spec = ModelSpec::from_json(j, "small-qwen3.5");
  bool any_packed = false;
  for (const auto& s : spec.segments())
    for (const auto& t : s.tensors) any_packed |= t.stacked_index >= 0;
  REQUIRE(any_packed);
  const auto dir = fresh_dir("packed");
  const auto st = random_state(spec, 3);
  const auto where = save_checkpoint(dir, spec, st, {1, "{}", Json::object(), 2});
  const auto r = load_checkpoint(where, spec);
  for (std::size_t s = 0; s < st.size(); ++s) CHECK(same_bits(r.state[s].master, st[s].master));
  fs::remove_all(dir);
}

TEST_CASE("bad state and bad files are refused with their names, leaving nothing behind") {
  const auto spec = tiny();
  const auto dir = fresh_dir("bad");
  auto st = random_state(spec, 4);
  st[3].exp_avg.pop_back();
  CHECK_THROWS_WITH_AS((void)save_checkpoint(dir, spec, st, {1, "{}", Json::object(), 2}),
                       doctest::Contains(spec.segments()[3].name.c_str()), Error);
  CHECK_FALSE(latest_checkpoint(dir).has_value());
  st = random_state(spec, 4);
  const auto where = save_checkpoint(dir, spec, st, {2, "{}", Json::object(), 2});
  // Truncate model.safetensors: the reader names the file.
  const auto model = where / "model.safetensors";
  fs::resize_file(model, fs::file_size(model) - 100);
  CHECK_THROWS_WITH_AS((void)load_checkpoint(where, spec), doctest::Contains("model.safetensors"), Error);
  // A checkpoint of another model: the missing tensor is named.
  Json other = read_json_file(fs::path(OOM_SOURCE_DIR) / "examples/configs/tiny-moe.json");
  other.set("num_hidden_layers", 5);
  const auto bigger = ModelSpec::from_json(other);
  const auto where2 = save_checkpoint(dir, spec, st, {3, "{}", Json::object(), 2});
  CHECK_THROWS_WITH_AS((void)load_checkpoint(where2, bigger), doctest::Contains("model.layers.4"), Error);
  // `latest` naming something that is not there.
  write_file_atomically(dir / "latest", "checkpoint-999999\n");
  CHECK_THROWS_WITH_AS((void)latest_checkpoint(dir), doctest::Contains("checkpoint-999999"), Error);
  fs::remove_all(dir);
}

TEST_CASE("pruning keeps the newest checkpoints by step, also past step 999999 where the names grow a digit") {
  const auto spec = tiny();
  const test::TempDir dir("ckpt-prune");
  const auto st = random_state(spec, 12);
  fs::create_directories(dir / "checkpoint-000001.partial");  // never a complete checkpoint
  fs::create_directories(dir / "checkpoint-notes");           // not ours: left alone
  for (const std::uint64_t step : {999'998u, 999'999u, 1'000'000u, 1'000'001u})
    (void)save_checkpoint(dir.path(), spec, st, {step, "{}", Json::object(), 2});
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  // A .partial is a save that was killed: never complete, as large as the state, so removed.
  CHECK(names == std::vector<std::string>{"checkpoint-1000000", "checkpoint-1000001", "checkpoint-notes", "latest"});
  CHECK(latest_checkpoint(dir.path()) == dir / "checkpoint-1000001");
}

TEST_CASE("checkpoints without `latest` are a run, not none: refused naming the newest") {
  const auto spec = tiny();
  const test::TempDir dir("ckpt-no-latest");
  // Neither `latest` nor a complete checkpoint: no run yet.
  fs::create_directories(dir / "checkpoint-000001.partial");
  fs::create_directories(dir / "checkpoint-notes");
  CHECK_FALSE(latest_checkpoint(dir.path()).has_value());
  const auto st = random_state(spec, 15);
  for (const std::uint64_t step : {2u, 4u}) (void)save_checkpoint(dir.path(), spec, st, {step, "{}", Json::object(), 2});
  // `latest` removed (or never written: a save killed between renaming its checkpoint in and
  // writing it). Taken for "no run yet", a new run had replaced these step by step.
  fs::remove(dir / "latest");
  const std::string both = fmt::format("latest: missing, while {} holds 2 checkpoints, checkpoint-000002 to checkpoint-000004",
                                       dir.path().string());
  CHECK_THROWS_WITH_AS((void)latest_checkpoint(dir.path()), doctest::Contains(both.c_str()), Error);
  CHECK_THROWS_WITH_AS((void)latest_checkpoint(dir.path()), doctest::Contains("echo checkpoint-000004 > "), Error);
  fs::remove_all(dir / "checkpoint-000002");
  CHECK_THROWS_WITH_AS((void)latest_checkpoint(dir.path()), doctest::Contains("holds checkpoint-000004: to resume"), Error);
  write_file_atomically(dir / "latest", "checkpoint-000004\n");
  CHECK(latest_checkpoint(dir.path()) == dir / "checkpoint-000004");
}

TEST_CASE("`latest` with blanks around the name reads; one with control bytes is refused, the bytes shown escaped") {
  const auto spec = tiny();
  const test::TempDir dir("ckpt-latest-bytes");
  (void)save_checkpoint(dir.path(), spec, random_state(spec, 17), {2, "{}", Json::object(), 2});
  write_file_atomically(dir / "latest", " \tcheckpoint-000002\t\r\n");
  CHECK(latest_checkpoint(dir.path()) == dir / "checkpoint-000002");
  // A NUL had cut the path short to the run directory itself, and the error message with it.
  write_file_atomically(dir / "latest", std::string("\0\xff\xfegarbage", 10));
  CHECK_THROWS_WITH_AS((void)latest_checkpoint(dir.path()), doctest::Contains("names '\\x00\xff\xfegarbage', which is not a checkpoint"),
                       Error);
  write_file_atomically(dir / "latest", std::string("checkpoint-000002\0", 18));
  CHECK_THROWS_WITH_AS((void)latest_checkpoint(dir.path()), doctest::Contains("names 'checkpoint-000002\\x00'"), Error);
}

TEST_CASE("a checkpoint the file system has no room for is refused before a byte is written, naming both sizes") {
  // A vocabulary of 2^30 over 256 wide: an embedding and a head of 2^38 parameters each, 6 TiB of
  // weights and moments, read through views that are never asked (it had been written until the
  // disk was full, in an error naming no sizes).
  Json cfg = read_json_file(fs::path(OOM_SOURCE_DIR) / "examples/configs/tiny-moe.json");
  cfg.set("vocab_size", std::int64_t{1} << 30);
  const auto spec = ModelSpec::from_json(cfg);
  const test::TempDir dir("ckpt-room");
  std::uint64_t parameters = 0;
  std::vector<SegmentStateView> views;
  for (const auto& seg : spec.segments()) {
    parameters += seg.parameters();
    views.emplace_back(seg.parameters(), [](StateArray, std::size_t, std::span<float>) { FAIL("a value was read"); });
  }
  const std::uint64_t needed = parameters * 12;
  if (struct statvfs st {}; ::statvfs(dir.path().c_str(), &st) != 0 || st.f_bavail * st.f_frsize >= needed) {
    MESSAGE("skipped: the temporary directory's file system has room for ", needed, " bytes");
    return;
  }
  // An earlier checkpoint and what a killed save left, which takes room: removed first.
  const auto small = tiny();
  (void)save_checkpoint(dir.path(), small, random_state(small, 16), {2, "{}", Json::object(), 2});
  fs::create_directories(dir / "checkpoint-000003.partial");
  const std::string sizes = fmt::format("checkpoint-000004 needs at least {} (the fp32 weights and two moments of {} parameters), "
                                        "its file system has ", Bytes{needed}, parameters);
  CHECK_THROWS_WITH_AS((void)save_checkpoint(dir.path(), spec, std::span<const SegmentStateView>(views), {4, "{}", Json::object(), 2}),
                       doctest::Contains(sizes.c_str()), Error);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"checkpoint-000002", "latest"});
  CHECK(latest_checkpoint(dir.path()) == dir / "checkpoint-000002");
}

TEST_CASE("a step saved again replaces its checkpoint; one set aside by a crash is put back") {
  const auto spec = tiny();
  const test::TempDir dir("ckpt-again");
  const auto a = random_state(spec, 13), b = random_state(spec, 14);
  const auto where = save_checkpoint(dir.path(), spec, a, {3, "{}", Json::object(), 2});
  CHECK(save_checkpoint(dir.path(), spec, b, {3, "{}", Json::object(), 2}) == where);
  const auto names = [&] {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir.path())) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  };
  CHECK(names() == std::vector<std::string>{"checkpoint-000003", "latest"});
  CHECK(same_bits(load_checkpoint(where, spec).state[2].exp_avg, b[2].exp_avg));
  // A crash between moving the old checkpoint aside and renaming the new one in: `latest` names a
  // directory that is not there, its files are at .old. Reading puts them back.
  fs::rename(where, dir / "checkpoint-000003.old");
  fs::create_directories(dir / "checkpoint-000003.partial");
  REQUIRE(latest_checkpoint(dir.path()) == where);
  CHECK(same_bits(load_checkpoint(where, spec).state[2].exp_avg, b[2].exp_avg));
  // Saved again over the restored one (and this step's stale .partial).
  (void)save_checkpoint(dir.path(), spec, a, {3, "{}", Json::object(), 2});
  CHECK(names() == std::vector<std::string>{"checkpoint-000003", "latest"});
  CHECK(same_bits(load_checkpoint(where, spec).state[2].exp_avg, a[2].exp_avg));
  // A crash after the new one was renamed in leaves a stale .old beside it: the next save removes it.
  fs::create_directories(dir / "checkpoint-000003.old");
  (void)save_checkpoint(dir.path(), spec, b, {4, "{}", Json::object(), 2});
  CHECK(names() == std::vector<std::string>{"checkpoint-000003", "checkpoint-000004", "latest"});
}

TEST_CASE("a save that cannot name its checkpoint in `latest` leaves nothing under the checkpoint's name") {
  // `latest` could not be replaced (a full disk at its write, say; here a directory in its place):
  // the new checkpoint had stayed complete under its name with `latest` naming the older one, and
  // oom-train said there was nothing to resume from while --resume and a new run were refused.
  const auto spec = tiny();
  const test::TempDir dir("ckpt-latest-fails");
  const auto st = random_state(spec, 19);
  (void)save_checkpoint(dir.path(), spec, st, {2, "{}", Json::object(), 2});
  fs::remove(dir / "latest");
  fs::create_directories(dir / "latest" / "held");
  Errc code{};
  try {
    (void)save_checkpoint(dir.path(), spec, st, {4, "{}", Json::object(), 2});
  } catch (const Error& e) {
    code = e.code();
  }
  CHECK(code == Errc::io);
  CHECK_FALSE(fs::exists(dir / "checkpoint-000004"));
  CHECK_FALSE(fs::exists(dir / "checkpoint-000004.partial"));
  CHECK(fs::exists(dir / "checkpoint-000002" / "model.safetensors"));
  fs::remove_all(dir / "latest");
  write_file_atomically(dir / "latest", "checkpoint-000002\n");
  CHECK(save_checkpoint(dir.path(), spec, st, {4, "{}", Json::object(), 2}) == dir / "checkpoint-000004");
  CHECK(latest_checkpoint(dir.path()) == dir / "checkpoint-000004");
  // A file under a checkpoint's name is refused, not moved aside and deleted.
  write_file_atomically(dir / "checkpoint-000006", "my notes\n");
  CHECK_THROWS_WITH_AS((void)save_checkpoint(dir.path(), spec, st, {6, "{}", Json::object(), 2}),
                       doctest::Contains("checkpoint-000006: exists and is not a checkpoint directory"), Error);
  CHECK(fs::is_regular_file(dir / "checkpoint-000006"));
  CHECK(latest_checkpoint(dir.path()) == dir / "checkpoint-000004");
  // `latest` naming a directory that is no checkpoint's name ('..', a .partial) is refused.
  fs::create_directories(dir / "checkpoint-000008.partial");
  for (const char* name : {"..", ".", "checkpoint-000008.partial"}) {
    write_file_atomically(dir / "latest", std::string(name) + "\n");
    CHECK_THROWS_WITH_AS((void)latest_checkpoint(dir.path()), doctest::Contains("which is not a checkpoint directory"), Error);
  }
  // Naming a checkpoint that is not there: the ones that are, and how to name one.
  write_file_atomically(dir / "latest", "checkpoint-000099\n");
  const std::string want = "names 'checkpoint-000099', which is not a checkpoint directory; " + dir.path().string() +
                           " holds 2 checkpoints, checkpoint-000002 to checkpoint-000004: to resume the run, write into it the name of "
                           "the checkpoint to continue from (echo checkpoint-000004 > " + (dir / "latest").string() + ")";
  CHECK_THROWS_WITH_AS((void)latest_checkpoint(dir.path()), doctest::Contains(want.c_str()), Error);
}

TEST_CASE("a save removes what killed saves left: other processes' temporaries of `latest`, and puts a lone .old back") {
  const auto spec = tiny();
  const test::TempDir dir("ckpt-leftovers");
  const auto a = random_state(spec, 18);
  (void)save_checkpoint(dir.path(), spec, a, {2, "{}", Json::object(), 3});
  // A kill between writing `latest`'s temporary and renaming it (pid 1 is never this test); names
  // that are not such a temporary stay.
  for (const char* name : {"latest.tmp-1", "latest.tmp-12x", "notes.tmp-1"}) write_file_atomically(dir / name, "x");
  // A crash between moving checkpoint 4 aside and renaming its replacement in, `latest` already past it.
  (void)save_checkpoint(dir.path(), spec, a, {4, "{}", Json::object(), 3});
  fs::rename(dir / "checkpoint-000004", dir / "checkpoint-000004.old");
  (void)save_checkpoint(dir.path(), spec, a, {6, "{}", Json::object(), 3});
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"checkpoint-000002", "checkpoint-000004", "checkpoint-000006", "latest",
                                          "latest.tmp-12x", "notes.tmp-1"});
  CHECK(same_bits(load_checkpoint(dir / "checkpoint-000004", spec).state[1].master, a[1].master));
}

TEST_CASE("a checkpoint of a deeper model is refused by a shallower one, naming a tensor it does not have") {
  const auto spec = tiny();
  Json cfg = read_json_file(fs::path(OOM_SOURCE_DIR) / "examples/configs/tiny-moe.json");
  cfg.set("num_hidden_layers", cfg.find("num_hidden_layers")->as_int64() + 1);
  const auto deeper = ModelSpec::from_json(cfg);
  const test::TempDir dir("ckpt-deeper");
  const auto where = save_checkpoint(dir.path(), deeper, random_state(deeper, 15), {1, "{}", Json::object(), 2});
  // The last layer's tensors, counted as the checkpoint names them (a packed expert tensor once).
  std::set<std::string> extra;
  for (const auto& seg : deeper.segments())
    for (const auto& t : seg.tensors) extra.insert(t.name);
  for (const auto& seg : spec.segments())
    for (const auto& t : seg.tensors) extra.erase(t.name);
  REQUIRE(!extra.empty());
  const std::string layer = fmt::format("'model.layers.{}.", cfg.find("num_hidden_layers")->as_int64() - 1);
  const std::string model_count = fmt::format("({} of the file's", extra.size());
  const std::string optimizer_count = fmt::format("({} of the file's", 2 * extra.size());
  for (const bool with_optimizer : {true, false}) {
    CAPTURE(with_optimizer);
    try {
      (void)load_checkpoint(where, spec, with_optimizer);
      FAIL("a checkpoint of a deeper model loaded");
    } catch (const Error& e) {
      CHECK(e.code() == Errc::parse);
      CHECK(e.message().find("model.safetensors: tensor " + layer) != std::string::npos);
      CHECK(e.message().find(model_count) != std::string::npos);
    }
  }
  // As weights (oom-train --init-from): the first layers of a deeper model are a slice of it, and
  // load, the layers left unread said in a warning (they had been dropped without a word).
  {
    std::vector<std::string> warned;
    const LogSink before = set_log_sink([&](LogLevel, std::string_view m) { warned.emplace_back(m); });
    CHECK(load_weights(where / "model.safetensors", spec).size() == spec.segments().size());
    (void)set_log_sink(before);
    REQUIRE(warned.size() == 1);
    const std::string want = fmt::format("layers {0} to {0} ({1} tensors) are past the model's {0} decoder layers", spec.num_layers(),
                                         extra.size());
    CHECK(warned.front().find(want) != std::string::npos);
  }
  {
    // Weights from elsewhere (no producer "oom"): a head the model does not have is left unread,
    // a tensor the model lacks inside one of its own layers is refused; in our own checkpoints any
    // extra tensor outside the layers is refused too.
    const auto file = SafetensorsFile::open(save_checkpoint(dir / "foreign", spec, random_state(spec, 17), {1, "{}", Json::object(), 2}) /
                                            "model.safetensors");
    const std::vector<float> extra_values(4, 1.0f);
    const auto extra_bytes = std::as_bytes(std::span(extra_values));
    for (const bool layer : {false, true}) {
      CAPTURE(layer);
      std::vector<SafetensorsEntry> entries;
      for (const auto& t : file.tensors()) entries.push_back(SafetensorsEntry::view(t.name, t.dtype, t.shape, t.data));
      const std::string extra_name = layer ? "model.layers.0.mlp.extra_gate.weight" : "mtp.fc.weight";
      entries.push_back(SafetensorsEntry::view(extra_name, DType::fp32, {4}, extra_bytes));
      const auto path = dir / "foreign" / fmt::format("hf-{}.safetensors", layer);
      write_safetensors(path, std::move(entries), {{"format", "pt"}});
      if (layer)
        CHECK_THROWS_WITH_AS((void)load_weights(path, spec), doctest::Contains(("'" + extra_name + "' is not in the model").c_str()),
                             Error);
      else
        CHECK(load_weights(path, spec).size() == spec.segments().size());
      write_safetensors(path, [&] {
        std::vector<SafetensorsEntry> ours;
        for (const auto& t : file.tensors()) ours.push_back(SafetensorsEntry::view(t.name, t.dtype, t.shape, t.data));
        ours.push_back(SafetensorsEntry::view(extra_name, DType::fp32, {4}, extra_bytes));
        return ours;
      }(), {{"format", "pt"}, {"producer", "oom"}});
      CHECK_THROWS_WITH_AS((void)load_weights(path, spec), doctest::Contains(("'" + extra_name + "' is not in the model").c_str()),
                           Error);
    }
  }
  // The optimizer file alone: a checkpoint whose model file matches, its moments another model's.
  fs::copy_file(save_checkpoint(dir / "shallow", spec, random_state(spec, 16), {1, "{}", Json::object(), 2}) / "model.safetensors",
                where / "model.safetensors", fs::copy_options::overwrite_existing);
  try {
    const CheckpointReader reader(where, spec);
    FAIL("a checkpoint with another model's moments opened");
  } catch (const Error& e) {
    CHECK(e.message().find("optimizer.safetensors: tensor 'exp_avg") != std::string::npos);
    CHECK(e.message().find(optimizer_count) != std::string::npos);
  }
}

TEST_CASE("a checkpoint read segment by segment: the same bits, from views written without a copy") {
  const auto spec = tiny();
  const auto dir = fresh_dir("reader");
  const auto st = random_state(spec, 5);
  // Written from views (as the CUDA executor's pinned state is), read back piece by piece.
  const std::vector<SegmentStateView> views(st.begin(), st.end());
  const auto where = save_checkpoint(dir, spec, std::span<const SegmentStateView>(views), {4, "{}", Json::object(), 2});
  const CheckpointReader reader(where, spec);
  const auto source = reader.source();
  for (std::size_t s = 0; s < st.size(); ++s) {
    CAPTURE(spec.segments()[s].name);
    const auto n = spec.segments()[s].parameters();
    std::vector<float> w(n, -1.0f), m(n, -1.0f), v(n, -1.0f);
    source(s, w, m, v);
    CHECK(same_bits(w, st[s].master));
    CHECK(same_bits(m, st[s].exp_avg));
    CHECK(same_bits(v, st[s].exp_avg_sq));
  }
  // Spans of the wrong size, or a segment the model does not have: refused, named.
  std::vector<float> small(3);
  CHECK_THROWS_WITH_AS(reader.read(0, small, small, small), doctest::Contains(spec.segments()[0].name.c_str()), Error);
  CHECK_THROWS_WITH_AS(reader.read(spec.segments().size(), small, small, small), doctest::Contains("segment"), Error);
  // A checkpoint of another model, or one missing its optimizer file: refused when it opens,
  // before anything is read.
  Json other = read_json_file(fs::path(OOM_SOURCE_DIR) / "examples/configs/tiny-moe.json");
  other.set("num_hidden_layers", 5);
  CHECK_THROWS_WITH_AS(CheckpointReader(where, ModelSpec::from_json(other)), doctest::Contains("model.layers.4"), Error);
  fs::remove(where / "optimizer.safetensors");
  CHECK_THROWS_WITH_AS(CheckpointReader(where, spec), doctest::Contains("optimizer.safetensors"), Error);
  fs::remove_all(dir);
}

TEST_CASE("a checkpoint of state read a range at a time (a GPU's): the same files, never a whole array at once") {
  // A vocabulary of 16384 makes the embedding 4 Mi floats: more than one 8 MiB piece of the writer.
  Json cfg = read_json_file(fs::path(OOM_SOURCE_DIR) / "examples/configs/tiny-moe.json");
  cfg.set("vocab_size", 16384);
  const auto spec = ModelSpec::from_json(cfg);
  const test::TempDir dir("ckpt-ranges");
  const auto st = random_state(spec, 11);
  const auto spans = save_checkpoint(dir.path() / "spans", spec, st, {1, "{}", Json::object(), 2});

  // Every other segment, and the embedding (segment 0), only through a reader, as the CUDA
  // executor's resident segments are.
  std::size_t largest = 0, read_floats = 0, calls = 0, fail_at = 0;
  std::uint64_t behind_readers = 0;
  std::vector<SegmentStateView> views;
  for (std::size_t s = 0; s < st.size(); ++s) {
    if (s % 2 == 1) {
      views.emplace_back(st[s]);
      continue;
    }
    behind_readers += st[s].master.size();
    views.emplace_back(st[s].master.size(), [&, s](StateArray a, std::size_t offset, std::span<float> out) {
      if (fail_at != 0 && ++calls == fail_at) throw Error(Errc::io, "the reader failed");
      largest = std::max(largest, out.size());
      read_floats += out.size();
      const auto& from = a == StateArray::master ? st[s].master : a == StateArray::exp_avg ? st[s].exp_avg : st[s].exp_avg_sq;
      std::copy_n(from.begin() + static_cast<std::ptrdiff_t>(offset), out.size(), out.begin());
    });
  }
  REQUIRE(st[0].master.size() == 16384u * 256u);  // hidden_size 256
  const auto ranged = save_checkpoint(dir.path() / "ranged", spec, std::span<const SegmentStateView>(views), {1, "{}", Json::object(), 2});
  // The same bytes but for the save's id, which names each save.
  const auto without_save = [](const fs::path& dir, const char* file) {
    std::ifstream in(dir / file, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    const std::string save = read_json_file(dir / "checksums.json").find("save")->as_string();
    for (std::size_t at = text.find(save); at != std::string::npos; at = text.find(save, at)) text.replace(at, save.size(), "<save>");
    return text;
  };
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "checksums.json"}) {
    CAPTURE(file);
    CHECK(without_save(spans, file) == without_save(ranged, file));
  }
  CHECK(read_floats == 3 * behind_readers);  // each value read once
  // A range past the end is refused by name, for a view of host memory and before a reader is asked.
  const std::size_t read_before = read_floats;
  std::vector<float> two(2);
  CHECK_THROWS_WITH_AS(views[0].copy(StateArray::master, st[0].master.size() - 1, two), doctest::Contains("state read: values"), Error);
  CHECK_THROWS_WITH_AS(views[1].copy(StateArray::exp_avg, st[1].master.size() - 1, two), doctest::Contains("of a segment of"), Error);
  CHECK(read_floats == read_before);
  CHECK(largest <= (std::size_t{8} << 20) / sizeof(float));
  CHECK(largest < st[0].master.size());

  // A reader that fails midway: the error comes out, and `latest` still names the last complete
  // checkpoint, with nothing under the failed one's name.
  fail_at = 5;
  CHECK_THROWS_WITH_AS(save_checkpoint(dir.path() / "ranged", spec, std::span<const SegmentStateView>(views), {2, "{}", Json::object(), 2}),
                       doctest::Contains("the reader failed"), Error);
  CHECK(latest_checkpoint(dir.path() / "ranged") == ranged);
  CHECK_FALSE(fs::exists(dir.path() / "ranged" / "checkpoint-000002"));
  CHECK_FALSE(fs::exists(dir.path() / "ranged" / "checkpoint-000002.partial"));  // the failed save's files removed
}

TEST_CASE("weights read as a source: load_weights' bits, segment by segment in any order; every tensor checked when it opens") {
  const auto spec = tiny();
  const auto dir = fresh_dir("weight-source");
  const auto st = random_state(spec, 6);
  const auto where = save_checkpoint(dir, spec, st, {1, "{}", Json::object(), 2});
  const auto model = where / "model.safetensors";
  const auto whole = load_weights(model, spec);
  const auto source = weight_source(model, spec);
  for (std::size_t k = 0; k < st.size(); ++k) {
    const std::size_t s = st.size() - 1 - k;  // the last first: nothing depends on the order
    CAPTURE(spec.segments()[s].name);
    std::vector<float> w(spec.segments()[s].parameters(), -1.0f);
    source(s, w);
    CHECK(same_bits(w, st[s].master));
    CHECK(same_bits(w, whole[s]));
  }
  // A span of the wrong size, a segment the model does not have: named.
  std::vector<float> small(3);
  CHECK_THROWS_WITH_AS(source(0, small), doctest::Contains(spec.segments()[0].name.c_str()), Error);
  const auto past = fmt::format("segment {} of a model of {}", spec.segments().size(), spec.segments().size());
  CHECK_THROWS_WITH_AS(source(spec.segments().size(), small), doctest::Contains(past.c_str()), Error);
  // A tensor of a type the reader does not take (F16): named when the source is made.
  const auto src = SafetensorsFile::open(model);
  std::vector<SafetensorsEntry> entries;
  for (const auto& t : src.tensors()) {
    SafetensorsEntry e;
    e.name = t.name;
    e.shape = t.shape;
    e.dtype = t.name == "model.norm.weight" ? DType::fp16 : t.dtype;
    const std::uint64_t bytes = t.elements() * (e.dtype == DType::fp16 ? 2 : t.data.size() / t.elements());
    const auto data = t.data;
    e.fill = [data, bytes](std::uint64_t offset, std::span<std::byte> out) {
      REQUIRE(offset + out.size() <= bytes);
      std::memcpy(out.data(), data.data() + offset, out.size());
    };
    entries.push_back(std::move(e));
  }
  const auto f16 = dir / "f16.safetensors";
  write_safetensors(f16, std::move(entries));
  CHECK_THROWS_WITH_AS((void)weight_source(f16, spec), doctest::Contains("'model.norm.weight' is F16"), Error);
  // Another model's weights: the missing tensor named when the source is made, before any read.
  Json other = read_json_file(fs::path(OOM_SOURCE_DIR) / "examples/configs/tiny-moe.json");
  other.set("num_hidden_layers", 5);
  const auto bigger = ModelSpec::from_json(other);
  CHECK_THROWS_WITH_AS((void)weight_source(model, bigger), doctest::Contains("model.layers.4"), Error);
  CHECK_THROWS_WITH_AS((void)weight_source(dir / "absent.safetensors", spec), doctest::Contains("absent.safetensors"), Error);
  fs::remove_all(dir);
}

TEST_CASE("a NaN or an infinity in the weights or the moments is refused when read, naming the tensor and the element") {
  // It had loaded (oom-train --init-from, --resume), and every step's loss was then non-finite.
  const auto spec = tiny();
  const auto dir = fresh_dir("nonfinite");
  const std::size_t s = 3, at = 5;
  const std::string name = spec.segments()[s].tensors.front().name;
  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    const auto st = random_state(spec, 7);
    const auto moments = save_checkpoint(dir, spec, st, {1, "{}", Json::object(), 3});
    poke(moments / "optimizer.safetensors", "exp_avg_sq." + name, at, bad);
    CHECK_THROWS_WITH_AS((void)load_checkpoint(moments, spec, true), doctest::Contains(fmt::format("at element {}", at).c_str()), Error);
    CHECK_NOTHROW((void)load_checkpoint(moments, spec, false));  // the weights alone are finite
    const auto weights = save_checkpoint(dir, spec, st, {2, "{}", Json::object(), 3});
    poke(weights / "model.safetensors", name, at, bad);
    CHECK_THROWS_WITH_AS((void)load_weights(weights / "model.safetensors", spec), doctest::Contains(fmt::format("'{}' holds", name).c_str()), Error);
    CHECK_THROWS_WITH_AS((void)load_checkpoint(weights, spec, false), doctest::Contains("must be finite"), Error);
    fs::remove_all(dir);
  }
}

TEST_CASE("crc32c: the Castagnoli check value, continued runs, and every length and alignment alike") {
  const std::string check = "123456789";
  CHECK(crc32c(std::as_bytes(std::span(check.data(), check.size()))) == 0xE3069283u);
  CHECK(crc32c({}) == 0u);
  // Byte by byte against a bitwise reference, over lengths and offsets that exercise both the
  // 8-byte steps and the tail.
  std::vector<std::byte> data(301);
  std::mt19937 rng(21);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  const auto bitwise = [](std::span<const std::byte> bytes) {
    std::uint32_t c = ~0u;
    for (const std::byte b : bytes) {
      c ^= static_cast<std::uint8_t>(b);
      for (int k = 0; k < 8; ++k) c = (c & 1u) != 0 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    }
    return ~c;
  };
  for (std::size_t offset : {0u, 1u, 3u, 7u})
    for (std::size_t n : {0u, 1u, 7u, 8u, 9u, 64u, 293u}) {
      CAPTURE(offset);
      CAPTURE(n);
      const auto piece = std::span<const std::byte>(data).subspan(offset, n);
      CHECK(crc32c(piece) == bitwise(piece));
      CHECK(detail::crc32c_by_table(piece) == bitwise(piece));  // the path of CPUs without SSE4.2
      CHECK(crc32c(piece.subspan(n / 3), crc32c(piece.first(n / 3))) == bitwise(piece));
    }
}

TEST_CASE("checksums: a changed byte (read with the moments or alone), a file of another save, an edited trainer state or a lost checksums.json is refused by name") {
  const auto spec = tiny();
  const test::TempDir dir("ckpt-checksums");
  const auto st = random_state(spec, 19);
  const auto first = save_checkpoint(dir.path(), spec, st, {1, "{}", Json::object(), 5});
  const auto copy = [&](const char* name) {
    const fs::path to = dir / name;
    fs::copy(first, to, fs::copy_options::recursive);
    return to;
  };
  // A value that is still finite (a flipped low mantissa bit) had loaded without a word.
  const std::string plain = spec.segments()[2].tensors.back().name;
  const auto flipped = copy("flipped");
  poke(flipped / "model.safetensors", plain, 3, std::nextafter(st[2].master.back(), 1.0f) + 0.25f, /*rechecksum=*/false);
  CHECK_THROWS_WITH_AS((void)load_checkpoint(flipped, spec),
                       doctest::Contains(fmt::format("model.safetensors: tensor '{}' changed after its save: its bytes' CRC-32C is", plain).c_str()),
                       Error);
  // ... also when only its weights are read (--init-from a checkpoint directory), whichever way.
  const std::string changed = fmt::format("tensor '{}' changed after its save", plain);
  CHECK_THROWS_WITH_AS((void)load_checkpoint(flipped, spec, /*with_optimizer=*/false), doctest::Contains(changed.c_str()), Error);
  CHECK_THROWS_WITH_AS((void)load_weights(flipped / "model.safetensors", spec), doctest::Contains(changed.c_str()), Error);
  CHECK_THROWS_WITH_AS((void)load_weights(flipped, spec), doctest::Contains(changed.c_str()), Error);
  // A model.safetensors copied out alone has no checksums beside it: read unchecked.
  fs::create_directories(dir / "alone");
  fs::copy_file(flipped / "model.safetensors", dir / "alone" / "model.safetensors");
  CHECK_NOTHROW((void)load_weights(dir / "alone", spec));
  // An expert's slice of a packed tensor (Qwen3.5's experts.gate_up_proj) is named with its expert.
  {
    const auto qwen35 = ModelSpec::from_file(fs::path(OOM_SOURCE_DIR) / "examples/configs/tiny-qwen3.5-moe-d128.json");
    std::string packed;
    std::uint64_t experts = 0;
    const std::int64_t expert = 1;
    for (const auto& seg : qwen35.segments())
      for (const auto& t : seg.tensors)
        if (t.stacked_index == expert && packed.empty()) packed = t.name, experts = static_cast<std::uint64_t>(t.stacked_count);
    REQUIRE(!packed.empty());
    const auto where = save_checkpoint(dir / "qwen35", qwen35, random_state(qwen35, 22), {1, "{}", Json::object(), 2});
    std::fstream f(where / "optimizer.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    std::uint64_t header = 0;
    f.read(reinterpret_cast<char*>(&header), 8);
    std::string text(header, '\0');
    f.read(text.data(), static_cast<std::streamsize>(header));
    const Json layout = Json::parse(text);
    const auto& off = layout.find("exp_avg." + packed)->find("data_offsets")->as_array();
    const auto bytes = static_cast<std::uint64_t>(off.at(1).as_int64() - off.at(0).as_int64());
    f.seekp(static_cast<std::streamoff>(8 + header + static_cast<std::uint64_t>(off.at(0).as_int64()) + bytes / experts + 1));
    f.put('\x5a');  // a byte of expert 1's first value
    f.close();
    CHECK_THROWS_WITH_AS((void)load_checkpoint(where, qwen35),
                         doctest::Contains(fmt::format("tensor 'exp_avg.{}' (expert {}) changed after its save", packed, expert).c_str()),
                         Error);
  }
  // The optimizer file of another save of the same model and step (a run's, or this one's again).
  const auto again = save_checkpoint(dir / "other-run", spec, st, {1, "{}", Json::object(), 5});
  const auto mixed = copy("mixed");
  fs::copy_file(again / "optimizer.safetensors", mixed / "optimizer.safetensors", fs::copy_options::overwrite_existing);
  CHECK_THROWS_WITH_AS((void)load_checkpoint(mixed, spec), doctest::Contains("files of two saves"), Error);
  // ... and of another step: said by their steps.
  const auto later = save_checkpoint(dir / "other-run", spec, st, {3, "{}", Json::object(), 5});
  fs::copy_file(later / "model.safetensors", mixed / "model.safetensors", fs::copy_options::overwrite_existing);
  fs::copy_file(later / "optimizer.safetensors", mixed / "optimizer.safetensors", fs::copy_options::overwrite_existing);
  CHECK_THROWS_WITH_AS((void)load_checkpoint(mixed, spec), doctest::Contains("checksums.json: of step 1, save"), Error);
  // An edited trainer_state.json (the same JSON otherwise) and a lost checksums.json.
  const auto edited = copy("edited");
  write_file_atomically(edited / "trainer_state.json", "{\"step\": 1}\n");
  CHECK_THROWS_WITH_AS((void)load_checkpoint(edited, spec), doctest::Contains("trainer_state.json: changed after its save"), Error);
  const auto lost = copy("lost");
  fs::remove(lost / "checksums.json");
  CHECK_THROWS_WITH_AS((void)load_checkpoint(lost, spec), doctest::Contains("checksums.json: missing, while the checkpoint's files are of save"),
                       Error);
  // The untouched one reads, bit for bit.
  CHECK(same_bits(load_checkpoint(first, spec).state[2].exp_avg_sq, st[2].exp_avg_sq));
}

TEST_CASE("a checkpoint saved before checksums (no save id, no checksums.json) reads as before, unchecked") {
  const auto spec = tiny();
  const test::TempDir dir("ckpt-before-checksums");
  const auto st = random_state(spec, 23);
  const auto where = save_checkpoint(dir.path(), spec, st, {1, "{}", Json::object(), 2});
  // Each safetensors file written again with the metadata saves had before (no "save").
  for (const char* name : {"model.safetensors", "optimizer.safetensors"}) {
    const auto file = SafetensorsFile::open(where / name);
    std::vector<SafetensorsEntry> entries;
    for (const auto& t : file.tensors()) entries.push_back(SafetensorsEntry::view(t.name, t.dtype, t.shape, t.data));
    write_safetensors(where / (std::string(name) + ".old-style"), std::move(entries), {{"format", "pt"}, {"producer", "oom"}, {"step", "1"}});
  }
  for (const char* name : {"model.safetensors", "optimizer.safetensors"})
    fs::rename(where / (std::string(name) + ".old-style"), where / name);
  fs::remove(where / "checksums.json");
  const auto back = load_checkpoint(where, spec);
  for (std::size_t s = 0; s < st.size(); ++s) {
    CAPTURE(s);
    CHECK(same_bits(back.state[s].master, st[s].master));
    CHECK(same_bits(back.state[s].exp_avg_sq, st[s].exp_avg_sq));
  }
}

TEST_CASE("a save whose trainer state or config would not read back, or that keeps no checkpoint, writes nothing") {
  const auto spec = tiny();
  const test::TempDir dir("ckpt-unreadable");
  const auto st = random_state(spec, 20);
  Json latin1 = Json::object();
  latin1.set("data", std::string("caf\xe9.txt"));  // Latin-1: not UTF-8
  CHECK_THROWS_WITH_AS((void)save_checkpoint(dir.path(), spec, st, {1, "{}", latin1, 2}),
                       doctest::Contains("the trainer state would not read back"), Error);
  CHECK_THROWS_WITH_AS((void)save_checkpoint(dir.path(), spec, st, {1, "vocab_size: 3", Json::object(), 2}),
                       doctest::Contains("the config is not a model's config.json"), Error);
  CHECK_THROWS_WITH_AS((void)save_checkpoint(dir.path(), spec, st, {1, "[1]", Json::object(), 2}), doctest::Contains("not a JSON object"),
                       Error);
  CHECK_THROWS_WITH_AS((void)save_checkpoint(dir.path(), spec, st, {1, "{}", Json::object(), 0}), doctest::Contains("keep is 0"), Error);
  CHECK(fs::is_empty(dir.path()));
}

TEST_CASE("a negative second moment is refused when read, naming the tensor and the element") {
  // A flipped sign bit had loaded: the update's square root made the weights NaN at the next step,
  // every later step was skipped, and their checkpoints rotated the good ones out.
  const auto spec = tiny();
  const test::TempDir dir("ckpt-negative");
  const std::size_t s = 2, at = 7;
  const std::string name = spec.segments()[s].tensors.back().name;
  const auto where = save_checkpoint(dir.path(), spec, random_state(spec, 8), {1, "{}", Json::object(), 3});
  poke(where / "optimizer.safetensors", "exp_avg_sq." + name, at, -3.4e-10f);
  CHECK_THROWS_WITH_AS((void)load_checkpoint(where, spec, true),
                       doctest::Contains(fmt::format("'exp_avg_sq.{}' holds -3.4e-10 at element {}; a second moment", name, at).c_str()),
                       Error);
  // A negative first moment or weight is ordinary.
  poke(where / "optimizer.safetensors", "exp_avg_sq." + name, at, 0.0f);
  poke(where / "optimizer.safetensors", "exp_avg." + name, at, -1.0f);
  CHECK_NOTHROW((void)load_checkpoint(where, spec, true));
}

TEST_CASE("a state that is not finite, or a negative second moment, is not saved: latest and the kept checkpoints stay") {
  // Such a checkpoint could never resume, and its saving rotated the good ones out (--keep).
  const auto spec = tiny();
  const test::TempDir dir("ckpt-unsaveable");
  const auto good = random_state(spec, 9);
  for (const std::uint64_t step : {1u, 2u}) (void)save_checkpoint(dir.path(), spec, good, {step, "{}", Json::object(), 2});
  const std::size_t s = 4, at = 3;
  const auto names = [&] {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir.path())) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  };
  for (const int which : {0, 1, 2, 3, 4, 5}) {
    CAPTURE(which);
    auto st = good;
    if (which == 0) st[s].master[at] = std::numeric_limits<float>::quiet_NaN();
    if (which == 1) st[s].exp_avg[at] = std::numeric_limits<float>::infinity();
    if (which == 2) st[s].exp_avg_sq[at] = -std::numeric_limits<float>::infinity();
    if (which == 3) st[s].exp_avg_sq[at] = -1e-12f;
    if (which == 4) st[s].exp_avg_sq[at] = -std::numeric_limits<float>::denorm_min();
    // The segment's last element (blocks past the first: the check runs in blocks of 1024), named
    // as its last tensor's.
    const std::uint64_t last_tensor = spec.segments()[s].tensors.back().elements();
    REQUIRE(last_tensor > 2048);
    const std::size_t where = which == 5 ? last_tensor - 1 : at;
    if (which == 5) st[s].master.back() = -std::numeric_limits<float>::quiet_NaN();
    try {
      (void)save_checkpoint(dir.path(), spec, st, {3, "{}", Json::object(), 2});
      FAIL("a state that cannot resume was saved");
    } catch (const Error& e) {
      CHECK(e.message().find("not saved") != std::string::npos);
      CHECK(e.message().find(fmt::format("at element {}", where)) != std::string::npos);
    }
    CHECK(names() == std::vector<std::string>{"checkpoint-000001", "checkpoint-000002", "latest"});
    CHECK(latest_checkpoint(dir.path()) == dir / "checkpoint-000002");
  }
  // Negative zero is a second moment like zero; negative values elsewhere are values.
  auto st = good;
  st[s].exp_avg_sq[at] = -0.0f;
  st[s].exp_avg[at] = -std::numeric_limits<float>::max();
  st[s].master[at] = -std::numeric_limits<float>::denorm_min();
  CHECK_NOTHROW((void)save_checkpoint(dir.path(), spec, st, {3, "{}", Json::object(), 2}));
}

TEST_CASE("weights in a Hugging Face sharded checkpoint: read through its index, the single file's bits; bad indexes named") {
  const auto dir = fresh_dir("sharded");
  auto write_index = [&](const fs::path& at, Json::Object weight_map) {
    Json index = Json::object();
    index.set("metadata", Json::object());
    index.set("weight_map", Json(std::move(weight_map)));
    std::ofstream(at) << index.dump();
  };
  // The tensors dealt over three shards, the index naming each one's, as transformers writes them:
  // the tiny Qwen3-MoE, and a Qwen3.5-MoE whose experts are slices of packed tensors (gate_up_proj
  // and down_proj in different shards).
  Json::Object map;
  fs::path hf;
  ModelSpec spec = tiny();
  std::vector<std::vector<float>> whole;
  for (const fs::path& config : {fs::path(OOM_SOURCE_DIR) / "tests/data/tiny-qwen3.5-moe.json", fs::path(OOM_SOURCE_DIR) / "examples/configs/tiny-moe.json"}) {
    CAPTURE(config.string());
    spec = ModelSpec::from_file(config);
    const auto model = save_checkpoint(dir / config.stem(), spec, random_state(spec, 7), {1, "{}", Json::object(), 2}) / "model.safetensors";
    whole = load_weights(model, spec);
    const auto src = SafetensorsFile::open(model);
    hf = dir / config.stem() / "hf";
    fs::create_directories(hf);
    std::vector<std::vector<SafetensorsEntry>> shards(3);
    map.clear();
    for (std::size_t i = 0; i < src.tensors().size(); ++i) {
      const auto& t = src.tensors()[i];
      shards[i % 3].push_back(SafetensorsEntry::view(t.name, t.dtype, t.shape, t.data));
      map.emplace_back(t.name, Json(fmt::format("model-{:05}-of-00003.safetensors", i % 3 + 1)));
    }
    for (std::size_t k = 0; k < shards.size(); ++k) write_safetensors(hf / fmt::format("model-{:05}-of-00003.safetensors", k + 1), shards[k]);
    write_index(hf / "model.safetensors.index.json", map);
    // The index, the directory holding it, and a directory holding model.safetensors (a checkpoint
    // of ours): every segment as the single file gives it.
    for (const fs::path& path : {hf / "model.safetensors.index.json", hf, model.parent_path()}) {
      CAPTURE(path.string());
      const auto got = load_weights(path, spec);
      REQUIRE(got.size() == whole.size());
      for (std::size_t s = 0; s < got.size(); ++s) CHECK(same_bits(got[s], whole[s]));
    }
  }
  // An index that leaves a tensor out: the index and the tensor named, when the source is made.
  Json::Object partial(map.begin(), map.end());
  const std::string dropped = partial.back().first;
  partial.pop_back();
  write_index(hf / "partial.json", partial);
  CHECK_THROWS_WITH_AS((void)weight_source(hf / "partial.json", spec),
                       doctest::Contains(fmt::format("partial.json: weight_map has no tensor '{}'", dropped).c_str()), Error);
  // A shard that is not there, a shard named by a path, an index with no tensors, a directory
  // with neither file: each named.
  Json::Object missing = map;
  missing.front().second = Json("model-00009-of-00009.safetensors");
  write_index(hf / "missing.json", missing);
  CHECK_THROWS_WITH_AS((void)weight_source(hf / "missing.json", spec),
                       doctest::Contains(("missing.json: weight_map." + missing.front().first + ": shard 'model-00009-of-00009.safetensors'").c_str()),
                       Error);
  Json::Object pathy = map;
  pathy.front().second = Json("../model.safetensors");
  write_index(hf / "pathy.json", pathy);
  CHECK_THROWS_WITH_AS((void)weight_source(hf / "pathy.json", spec),
                       doctest::Contains("'../model.safetensors' is not a file name beside the index"), Error);
  write_index(hf / "empty.json", {});
  CHECK_THROWS_WITH_AS((void)weight_source(hf / "empty.json", spec), doctest::Contains("weight_map names no tensor"), Error);
  fs::create_directories(dir / "nothing");
  CHECK_THROWS_WITH_AS((void)weight_source(dir / "nothing", spec),
                       doctest::Contains("a directory without model.safetensors or model.safetensors.index.json"), Error);
  fs::remove_all(dir);
}

TEST_CASE("reading a checkpoint or weights file leaves its pages out of the resident set") {
  // A vocabulary of 16384 makes the embedding and the LM head 16 MiB each: the checkpoint's files
  // hold 140 MiB. Read segment by segment into buffers already resident, they would add that much
  // to the RSS if their pages stayed mapped in.
  Json cfg = read_json_file(fs::path(OOM_SOURCE_DIR) / "examples/configs/tiny-moe.json");
  cfg.set("vocab_size", 16384);
  const auto spec = ModelSpec::from_json(cfg);
  const test::TempDir dir("ckpt-resident");  // removed however the test ends
  const auto st = random_state(spec, 9);
  const auto where = save_checkpoint(dir.path(), spec, st, {1, "{}", Json::object(), 2});
  const auto file_kib = static_cast<long>((fs::file_size(where / "model.safetensors") + fs::file_size(where / "optimizer.safetensors")) >> 10);
  REQUIRE(file_kib > 90 * 1024);
  std::vector<SegmentOptimizerState> out(st.size());
  for (std::size_t s = 0; s < st.size(); ++s)
    for (auto* v : {&out[s].master, &out[s].exp_avg, &out[s].exp_avg_sq}) v->assign(st[s].master.size(), -1.0f);
  const long before = resident_kib();
  if (before < 0) {
    MESSAGE("no /proc/self/smaps_rollup here: the resident set is not checked");
    return;
  }
  {
    const CheckpointReader reader(where, spec);
    for (std::size_t s = 0; s < st.size(); ++s) reader.read(s, out[s].master, out[s].exp_avg, out[s].exp_avg_sq);
    const long grew = resident_kib() - before;
    MESSAGE("checkpoint of " << file_kib << " KiB read: the RSS grew " << grew << " KiB");
    CHECK(grew < file_kib / 8);
  }
  for (std::size_t s = 0; s < st.size(); ++s) {
    CHECK(same_bits(out[s].master, st[s].master));
    CHECK(same_bits(out[s].exp_avg_sq, st[s].exp_avg_sq));
  }
  const long again = resident_kib();
  const auto source = weight_source(where / "model.safetensors", spec);
  for (std::size_t s = 0; s < st.size(); ++s) source(s, out[s].master);
  CHECK(resident_kib() - again < file_kib / 8);
  for (std::size_t s = 0; s < st.size(); ++s) CHECK(same_bits(out[s].master, st[s].master));
}

// The example programs' path arguments (examples/common/output_path.hpp): an empty path is refused
// by its flag, and no output may be the file of an input or of another output, however spelled.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/output_path.hpp"
#include "oom/core/error.hpp"

namespace fs = std::filesystem;
using oom::examples::path_argument;
using oom::examples::refuse_overlapping_paths;
using oom::examples::same_file;

namespace {
// A fresh directory under the temporary one, removed with its files at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "oom-output-path-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = fs::canonical(pattern);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

void touch(const fs::path& p) { std::ofstream(p) << "{}\n"; }

template <class F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const oom::Error& e) {
    CHECK(e.code() == oom::Errc::invalid_argument);
    return e.message();
  }
  return "";
}
}  // namespace

TEST_CASE("path_argument refuses an empty path by its flag (it had silently meant the default)") {
  CHECK(path_argument("--profile", "p.json") == "p.json");
  CHECK(refusal([] { (void)path_argument("--profile", ""); }) == "--profile needs a path, got ''");
}

TEST_CASE("same_file: one file however it is named, existing or not") {
  TempDir t;
  const fs::path cfg = t.path / "cfg.json";
  touch(cfg);
  fs::create_directory(t.path / "sub");
  fs::create_symlink(cfg, t.path / "link.json");
  fs::create_hard_link(cfg, t.path / "hard.json");
  fs::create_directory_symlink(t.path / "sub", t.path / "sublink");
  touch(t.path / "other.json");

  CHECK(same_file(cfg, cfg));
  CHECK(same_file(cfg, t.path / "sub" / ".." / "." / "cfg.json"));
  CHECK(same_file(cfg, t.path / "link.json"));  // a symlink to it
  CHECK(same_file(t.path / "hard.json", cfg));  // a hard link: another name, the same inode
  CHECK_FALSE(same_file(cfg, t.path / "other.json"));
  CHECK_FALSE(same_file(cfg, t.path / "new.json"));
  // Neither exists yet: the same path once resolved, through a directory link too.
  CHECK(same_file(t.path / "sub" / "new.json", t.path / "sublink" / "new.json"));
  CHECK(same_file(t.path / "new.json", t.path / "sub" / ".." / "new.json"));
  CHECK_FALSE(same_file(t.path / "new.json", t.path / "sub" / "new.json"));
  // A relative spelling of an absolute path.
  const fs::path cwd = fs::current_path();
  fs::current_path(t.path);
  CHECK(same_file("cfg.json", cfg));
  CHECK(same_file("./fresh.json", t.path / "fresh.json"));
  CHECK(same_file("fresh.json", "./fresh.json"));
  CHECK(same_file("fresh.json", t.path / "fresh.json"));
  // '..' after a link is the parent of where it points, as the file system reads it.
  fs::create_directories(t.path / "a" / "b");
  fs::create_directory_symlink(t.path / "a" / "b", t.path / "blink");
  CHECK(same_file("blink/../fresh.json", t.path / "a" / "fresh.json"));
  CHECK_FALSE(same_file("blink/../fresh.json", t.path / "fresh.json"));
  CHECK_FALSE(same_file("fresh.json", "sub/fresh.json"));
  fs::current_path(cwd);
}

TEST_CASE("refuse_overlapping_paths: an output onto an input, or onto another output, names both flags") {
  TempDir t;
  const fs::path cfg = t.path / "cfg.json", prof = t.path / "prof.json";
  touch(cfg);
  touch(prof);
  fs::create_symlink(prof, t.path / "prof-link.json");
  const auto check = [&](const std::vector<oom::examples::PathArgument>& outputs) {
    return refusal([&] { refuse_overlapping_paths(outputs, {{"--model", cfg}, {"--profile", prof}, {"--plan", ""}}); });
  };
  CHECK(check({{"--json", t.path / "plan.json"}, {"--trace", t.path / "trace.json"}}).empty());
  CHECK(check({{"--json", ""}, {"--trace", ""}}).empty());  // flags not given
  CHECK(check({{"--json", cfg}}) ==
        fmt::format("--json {} is the same file as --model {}: writing it would destroy that input", cfg.string(), cfg.string()));
  CHECK(check({{"--json", t.path / "plan.json"}, {"--trace", t.path / "prof-link.json"}}) ==
        fmt::format("--trace {}/prof-link.json is the same file as --profile {}: writing it would destroy that input", t.path.string(),
                    prof.string()));
  CHECK(check({{"--json", t.path / "p.json"}, {"--trace", t.path / "sub" / ".." / "p.json"}}) ==
        fmt::format("--trace {0}/sub/../p.json is the same file as --json {0}/p.json: one would be written over the other",
                    t.path.string()));
}

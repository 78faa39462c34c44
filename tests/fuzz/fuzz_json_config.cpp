// libFuzzer target: arbitrary bytes -> Json::parse -> ModelSpec::from_json. Any exception other
// than oom::Error, any sanitizer report, or a parsed value that does not survive dump() and
// parse() again is a bug.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"
#include "oom/model/model_spec.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  oom::Json j;
  try {
    j = oom::Json::parse(text, "fuzz.json");
  } catch (const oom::Error&) {
    return 0;
  }
  // The writer must produce text the parser reads back as the same value.
  const oom::Json again = oom::Json::parse(j.dump(), "fuzz.json (dumped)");
  if (!(again == j)) __builtin_trap();
  if (!(oom::Json::parse(j.dump(2), "fuzz.json (indented)") == j)) __builtin_trap();
  try {
    const oom::ModelSpec spec = oom::ModelSpec::from_json(j, "fuzz.json");
    (void)spec.total_parameters();
    (void)spec.active_parameters();
    (void)spec.state_bytes();
  } catch (const oom::Error&) {
  }
  return 0;
}

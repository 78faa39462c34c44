// libFuzzer target: arbitrary bytes -> Json::parse -> ModelSpec::from_json, Plan::from_json and
// MachineProfile::from_json (the three JSON inputs oom-train and oom-plan read). Any exception
// other than oom::Error, any sanitizer report, a parsed value that does not survive dump() and
// parse() again, or a profile or plan that does not survive its own to_json() is a bug.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"
#include "oom/model/model_spec.hpp"
#include "oom/plan/machine_profile.hpp"
#include "oom/plan/plan.hpp"

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
  // What was read must read back from its own to_json(): an error there is a bug too.
  oom::MachineProfile profile;
  bool have_profile = true;
  try {
    profile = oom::MachineProfile::from_json(j, "fuzz.json");
  } catch (const oom::Error&) {
    have_profile = false;
  }
  if (have_profile) {
    try {
      if (!(oom::MachineProfile::from_json(profile.to_json(), "fuzz.json (written)") == profile)) __builtin_trap();
    } catch (...) {
      __builtin_trap();
    }
  }
  oom::Plan plan;
  bool have_plan = true;
  try {
    plan = oom::Plan::from_json(j, "fuzz.json");
  } catch (const oom::Error&) {
    have_plan = false;
  }
  if (have_plan) {
    try {
      const oom::Json written = plan.to_json();
      if (!(oom::Plan::from_json(written, "fuzz.json (written)").to_json() == written)) __builtin_trap();
    } catch (...) {
      __builtin_trap();
    }
  }
  return 0;
}

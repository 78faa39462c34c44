// oom-plan --most-layers' configs (examples/common/config_layers.hpp): the same widths at another
// depth, each layer i of the kinds of the config's layer (i mod N).
#include <doctest/doctest.h>

#include <string>

#include "common/config_layers.hpp"
#include "oom/core/error.hpp"
#include "oom/io/json.hpp"
#include "oom/model/model_spec.hpp"

using namespace oom;
using oom::examples::with_layers;

namespace {
std::string dumped(const Json* j) { return j == nullptr ? "absent" : j->dump(); }
}  // namespace

TEST_CASE("with_layers: the depth changes, nothing else of a uniform config") {
  const Json c = read_json_file(OOM_SOURCE_DIR "/examples/configs/moe-5b.json");
  const Json deep = with_layers(c, 40);
  CHECK(deep.find("num_hidden_layers")->as_int64() == 40);
  Json back = deep;
  back.set("num_hidden_layers", 16);
  CHECK(back == c);  // every other field as it was, in its place
  const ModelSpec spec = ModelSpec::from_json(deep, "deep");
  CHECK(spec.num_layers() == 40);
  CHECK(spec.hidden_size() == ModelSpec::from_json(c, "c").hidden_size());
}

TEST_CASE("with_layers: layer_types and mlp_only_layers repeat with the config's period") {
  Json c = Json::parse(R"({"num_hidden_layers": 4, "layer_types": ["a", "a", "a", "f"], "mlp_only_layers": [1]})");
  const Json six = with_layers(c, 6);
  CHECK(dumped(six.find("layer_types")) == R"(["a","a","a","f","a","a"])");
  CHECK(dumped(six.find("mlp_only_layers")) == "[1,5]");
  const Json ten = with_layers(c, 10);
  CHECK(dumped(ten.find("mlp_only_layers")) == "[1,5,9]");
  const Json two = with_layers(c, 2);
  CHECK(dumped(two.find("layer_types")) == R"(["a","a"])");
  CHECK(dumped(two.find("mlp_only_layers")) == "[1]");
  // Under text_config where the model wraps one (Qwen3.5): changed there, the wrapper kept.
  const Json wrapped = read_json_file(OOM_SOURCE_DIR "/examples/configs/qwen3.5-122b-a10b.json");
  const Json w = with_layers(wrapped, 50);
  const Json& text = *w.find("text_config");
  CHECK(text.find("num_hidden_layers")->as_int64() == 50);
  REQUIRE(text.find("layer_types")->size() == 50);
  for (std::size_t i = 0; i < 50; ++i)
    CHECK(text.find("layer_types")->as_array()[i] == wrapped.find("text_config")->find("layer_types")->as_array()[i % 48]);
  CHECK(ModelSpec::from_json(w, "w").num_layers() == 50);
}

TEST_CASE("with_layers: a config it cannot repeat is refused by name") {
  const Json c = Json::parse(R"({"num_hidden_layers": 4})");
  CHECK(with_layers(c, oom::examples::max_config_layers).find("num_hidden_layers")->as_int64() == 4096);
  CHECK_THROWS_WITH_AS(with_layers(c, 4097), doctest::Contains("4097 layers: a depth from 1 to 4096"), Error);
  CHECK_THROWS_WITH_AS(with_layers(c, 0), doctest::Contains("0 layers: a depth from 1 to 4096"), Error);
  CHECK_THROWS_WITH_AS(with_layers(Json::parse(R"({"hidden_size": 8})"), 3), doctest::Contains("no positive num_hidden_layers"), Error);
  CHECK_THROWS_WITH_AS(with_layers(Json::parse(R"({"num_hidden_layers": 3, "layer_types": ["a", "f"]})"), 4),
                       doctest::Contains("layer_types has 2 entries for 3 layers"), Error);
}

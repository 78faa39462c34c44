// oom::Json: strict parsing (with errors that say where and what), exact integers, round-trips.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>

#include <fmt/format.h>
#include <unistd.h>

#include "oom/core/error.hpp"
#include "oom/io/json.hpp"

using namespace oom;

namespace {
/// The message of the parse error `text` raises (fails the test when it parses).
std::string parse_error(std::string_view text) {
  try {
    (void)Json::parse(text, "t.json");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::parse);
    return e.message();
  }
  FAIL("parsed without error: " << text);
  return {};
}
}  // namespace

TEST_CASE("scalars, arrays and objects parse with their types") {
  const Json j = Json::parse(R"( {"a": null, "b": true, "c": false, "d": -12, "e": 2.5e3, "f": "x",
                                   "g": [1, [2], {}], "h": {"k": []}} )");
  REQUIRE(j.is_object());
  CHECK(j.size() == 8);
  CHECK(j.find("a")->is_null());
  CHECK(j.find("b")->as_bool() == true);
  CHECK(j.find("c")->as_bool() == false);
  CHECK(j.find("d")->as_int64() == -12);
  CHECK(j.find("e")->as_double() == 2500.0);
  CHECK_FALSE(j.find("e")->is_integer());
  CHECK(j.find("f")->as_string() == "x");
  CHECK(j.find("g")->as_array().size() == 3);
  CHECK(j.find("h")->find("k")->is_array());
  CHECK(j.find("zz") == nullptr);
}

TEST_CASE("objects keep insertion order and set() replaces in place") {
  Json j = Json::parse(R"({"z": 1, "a": 2, "m": 3})");
  const auto& o = j.as_object();
  CHECK(o[0].first == "z");
  CHECK(o[1].first == "a");
  CHECK(o[2].first == "m");
  j.set("a", "two");
  j.set("b", 4);
  CHECK(j.dump() == R"({"z":1,"a":"two","m":3,"b":4})");
}

TEST_CASE("an object of 200k keys parses and is written in linear time; a duplicate among them is still named") {
  // Safetensors headers (up to 100 MB) and our optimizer files (~147k tensors for Qwen3-Next-80B)
  // are such objects. A scan per key took 30 s for 80k keys; linear work took 0.25 s (Release, 2 cores).
  constexpr int keys = 200'000;
  std::string text = "{";
  for (int i = 0; i < keys; ++i) text += fmt::format("{}\"model.layers.{}.weight\":{}", i ? "," : "", i, i);
  text += "}";
  const auto start = std::chrono::steady_clock::now();
  const Json j = Json::parse(text);
  const std::string again = j.dump();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(j.size() == keys);
  CHECK(j.as_object()[keys - 1].first == fmt::format("model.layers.{}.weight", keys - 1));
  const bool same = again == text;  // (not compared in CHECK: it would print 6 MB on a failure)
  CHECK(same);
  MESSAGE(keys << " keys parsed and written in " << seconds << " s");
  CHECK(seconds < 20.0);  // 80x margin for a loaded or Debug build; the old scan took minutes (not done in 287 s)
  // A duplicate of the first key as the last: named, at the last key's position.
  text.back() = ',';
  const std::size_t column = text.size() + 1;
  text += "\"model.layers.0.weight\": 0}";
  CHECK(parse_error(text) == fmt::format("t.json:1:{}: expected a key not already in this object (duplicate "
                                         "\"model.layers.0.weight\"), found '\"'", column));
}

TEST_CASE("an object built from members refuses a duplicate key, as documented") {
  const Json ok(Json::Object{{"a", 1}, {"b", 2}});
  CHECK(ok.dump() == R"({"a":1,"b":2})");
  try {
    const Json bad(Json::Object{{"a", 1}, {"b", 2}, {"a", 3}});
    FAIL("a duplicate key was accepted: " << bad.dump());
  } catch (const Error& e) {
    CHECK(e.code() == Errc::invalid_argument);
    CHECK(e.message().find("duplicate key \"a\"") != std::string::npos);
  }
}

TEST_CASE("integers are exact to 64 bits; doubles keep their kind") {
  CHECK(Json::parse("9223372036854775807").as_int64() == std::numeric_limits<std::int64_t>::max());
  CHECK(Json::parse("-9223372036854775808").as_int64() == std::numeric_limits<std::int64_t>::min());
  CHECK(Json::parse("18446744073709551615").as_uint64() == std::numeric_limits<std::uint64_t>::max());
  // 2^53 + 1 is not representable as a double: it must survive exactly.
  CHECK(Json::parse("9007199254740993").as_int64() == 9007199254740993LL);
  CHECK(Json::parse("1.0") != Json::parse("1"));
  CHECK_THROWS_AS((void)Json::parse("1.5").as_int64(), Error);
  CHECK_THROWS_AS((void)Json::parse("-1").as_uint64(), Error);
  CHECK(Json::parse("1").as_double() == 1.0);
  // Beyond 64 bits an integer literal becomes a double, like other readers.
  CHECK(Json::parse("36893488147419103232").as_double() == std::ldexp(1.0, 65));
}

TEST_CASE("strings: escapes, \\u and surrogate pairs decode to UTF-8") {
  CHECK(Json::parse(R"("a\"b\\c\/d\b\f\n\r\t")").as_string() == "a\"b\\c/d\b\f\n\r\t");
  CHECK(Json::parse(R"("\u00e9\u20AC")").as_string() == "\xC3\xA9\xE2\x82\xAC");
  CHECK(Json::parse(R"("\ud83d\ude00")").as_string() == "\xF0\x9F\x98\x80");  // U+1F600
  CHECK(Json::parse("\"\xF0\x9F\x98\x80 raw\"").as_string() == "\xF0\x9F\x98\x80 raw");
}

TEST_CASE("malformed input is rejected with line:column and what was expected") {
  CHECK(parse_error("{\"a\": 1,\n  \"b\" 2}") == "t.json:2:7: expected ':' after the key, found '2'");
  CHECK(parse_error("[1, 2") == "t.json:1:6: expected ',' or ']' in an array, found end of input");
  CHECK(parse_error("{} x").find("t.json:1:4: expected end of input after the value") == 0);
  CHECK(parse_error("01").find("leading zeros") != std::string::npos);
  CHECK(parse_error("-01").find("leading zeros") != std::string::npos);
  CHECK(parse_error("NaN").find("expected a value") != std::string::npos);
  CHECK(parse_error("[Infinity]").find("expected a value") != std::string::npos);
  CHECK(parse_error("1.").find("digit after the decimal point") != std::string::npos);
  CHECK(parse_error("1e").find("digit in the exponent") != std::string::npos);
  CHECK(parse_error("+1").find("expected a value") != std::string::npos);
  CHECK(parse_error("1e999").find("within double range") != std::string::npos);
  CHECK(parse_error(R"({"a": 1, "a": 2})").find("duplicate \"a\"") != std::string::npos);
  CHECK(parse_error("[1,]").find("expected a value") != std::string::npos);
  CHECK(parse_error("{\"a\":1,}").find("string key") != std::string::npos);
  CHECK(parse_error("'a'").find("expected a value") != std::string::npos);
  CHECK(parse_error("tru").find("expected a value") != std::string::npos);
  CHECK(parse_error("").find("end of input") != std::string::npos);
  CHECK(parse_error("\"a\nb\"").find("control character") != std::string::npos);
  CHECK(parse_error(R"("\x")").find("one of") != std::string::npos);
  CHECK(parse_error(R"("\u12G4")").find("4 hex digits") != std::string::npos);
  CHECK(parse_error(R"("\ud83d")").find("low surrogate") != std::string::npos);
  CHECK(parse_error(R"("\ud83d\u0041")").find("low surrogate") != std::string::npos);
  CHECK(parse_error(R"("\ude00")").find("high surrogate") != std::string::npos);
  CHECK(parse_error("\"\xC0\xAF\"").find("UTF-8") != std::string::npos);      // overlong '/'
  CHECK(parse_error("\"\xED\xA0\x80\"").find("UTF-8") != std::string::npos);  // encoded surrogate
  CHECK(parse_error("\"\xE2\x82\"").find("UTF-8") != std::string::npos);     // truncated
  CHECK(parse_error("\"\xFF\"").find("UTF-8") != std::string::npos);
}

TEST_CASE("nesting deeper than the limit is an error, not a stack overflow") {
  const std::string ok = std::string(500, '[') + std::string(500, ']');
  CHECK(Json::parse(ok).is_array());
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  CHECK(parse_error(deep).find("nesting no deeper than") != std::string::npos);
}

TEST_CASE("doubles round-trip exactly in shortest form") {
  for (double d : {0.1, 1.0 / 3.0, 1e-300, 6.02214076e23, -0.0, 5e-324, 1.7976931348623157e308, 1e6, 123456.789}) {
    const std::string text = Json(d).dump();
    const Json back = Json::parse(text);
    CHECK_FALSE(back.is_integer());
    CHECK(back.as_double() == d);
    CHECK(std::signbit(back.as_double()) == std::signbit(d));
  }
  CHECK(Json(0.1).dump() == "0.1");
  CHECK(Json(1.0).dump() == "1.0");
  CHECK(Json(1e6).dump() == "1e+06");  // shortest form; still reads back as a double
  CHECK_THROWS_AS((void)Json(std::nan("")).dump(), Error);
  CHECK_THROWS_AS((void)Json(HUGE_VAL).dump(), Error);
  // The message names where the value is, so a caller's state file that will not write says which
  // field: a key path as JsonCursor spells it.
  const auto dump_error = [](const Json& j) {
    try {
      (void)j.dump(2);
    } catch (const Error& e) {
      CHECK(e.code() == Errc::invalid_argument);
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  CHECK(dump_error(Json(std::nan(""))).find("NaN or infinity [") != std::string::npos);  // no path at the top
  Json inner = Json::object();
  inner.set("ok", 1.5);
  Json losses = Json::array();
  losses.push_back(2.0);
  losses.push_back(-HUGE_VAL);
  inner.set("losses", losses);
  Json state = Json::object();
  state.set("step", 3);
  state.set("run", inner);
  CHECK(dump_error(state).find("NaN or infinity (at run.losses[1])") != std::string::npos);
  Json rows = Json::array();
  rows.push_back(Json::array());
  Json row = Json::array();
  row.push_back(std::nan(""));
  rows.push_back(row);
  CHECK(dump_error(rows).find("(at [1][0])") != std::string::npos);
  // A key under an array, and a key that begins with '[': JsonCursor's spelling, a '.' before
  // every key but the first.
  Json item = Json::object();
  item.set("loss", std::nan(""));
  Json items = Json::array();
  items.push_back(Json::object());
  items.push_back(item);
  CHECK(dump_error(items).find("(at [1].loss)") != std::string::npos);
  Json outer = Json::object();
  outer.set("runs", items);
  CHECK(dump_error(outer).find("(at runs[1].loss)") != std::string::npos);
  Json odd = Json::object();
  odd.set("[x]", std::nan(""));
  Json holder = Json::object();
  holder.set("a", odd);
  CHECK(dump_error(holder).find("(at a.[x])") != std::string::npos);
  const Json cursor_of = holder;
  CHECK(JsonCursor(cursor_of)["a"]["[x]"].path() == "a.[x]");
}

TEST_CASE("compact and pretty output parse back to the same value") {
  const std::string text =
      R"({"name":"t\u00e9st \"q\"\n","n":[1,-2,18446744073709551615,2.5,{"x":null,"y":[]}],"e":{},"t":true})";
  const Json j = Json::parse(text);
  CHECK(Json::parse(j.dump()) == j);
  CHECK(Json::parse(j.dump(2)) == j);
  CHECK(j.dump() == "{\"name\":\"t\xC3\xA9st \\\"q\\\"\\n\",\"n\":[1,-2,18446744073709551615,2.5,"
                    "{\"x\":null,\"y\":[]}],\"e\":{},\"t\":true}");
  CHECK(Json::parse(R"({"a":[1,{"b":2}],"c":{}})").dump(2) ==
        "{\n  \"a\": [\n    1,\n    {\n      \"b\": 2\n    }\n  ],\n  \"c\": {}\n}");
  CHECK(Json(std::string("\x01")).dump() == "\"\\u0001\"");
}

TEST_CASE("JsonCursor names the key path on a type mismatch or a missing field") {
  const Json j = Json::parse(R"({"rope_scaling": {"factor": "4"}, "layers": [1, "x"], "n": 3})");
  const JsonCursor c(j);
  CHECK(c["n"].as_int64() == 3);
  CHECK(c["layers"][0].as_int64() == 1);
  CHECK_FALSE(c["missing"].present());
  CHECK_FALSE(c["missing"]["deeper"].present());
  const auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.message();
    }
    return std::string("no error");
  };
  CHECK(message([&] { (void)c["rope_scaling"]["factor"].as_double(); }) ==
        "rope_scaling.factor: expected number, got string");
  CHECK(message([&] { (void)c["layers"][1].as_int64(); }) == "layers[1]: expected integer, got string");
  CHECK(message([&] { (void)c["layers"][5]; }) == "layers[5]: index out of range (array has 2)");
  CHECK(message([&] { (void)c["vocab_size"].as_int64(); }) == "vocab_size: missing required field");
  CHECK(message([&] { (void)c["n"]["x"]; }) == "n: expected object, got number 3");
}

TEST_CASE("read_json_file reports a missing file as an I/O error naming it") {
  try {
    (void)read_json_file("/nonexistent/oom/config.json");
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::io);
    CHECK(e.message().find("/nonexistent/oom/config.json") != std::string::npos);
  }
}

TEST_CASE("read_json_file reports a directory as an I/O error naming it and why, not as a parse error") {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("oom-json-dir-{}", ::getpid());
  std::filesystem::create_directories(dir);
  try {
    (void)read_json_file(dir);
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.code() == Errc::io);
    CHECK(e.message().find(dir.string()) != std::string::npos);
    CHECK(e.message().find("Is a directory") != std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("same_value: members in any order and numbers by value, unlike operator==") {
  const Json a = Json::parse(R"({"hidden_size": 64, "rope_theta": 1000000, "layers": [1, 2.5], "tied": false, "act": "silu"})");
  const Json reordered = Json::parse(R"({"act": "silu", "tied": false, "layers": [1.0, 2.5], "rope_theta": 1000000.0, "hidden_size": 64})");
  CHECK(same_value(a, reordered));
  CHECK(same_value(reordered, a));
  CHECK_FALSE(a == reordered);
  // Another value, a member more or less, another order of an array's elements, another type.
  CHECK_FALSE(same_value(a, Json::parse(R"({"hidden_size": 65, "rope_theta": 1000000, "layers": [1, 2.5], "tied": false, "act": "silu"})")));
  CHECK_FALSE(same_value(a, Json::parse(R"({"hidden_size": 64, "rope_theta": 1000000, "layers": [1, 2.5], "tied": false})")));
  CHECK_FALSE(same_value(a, Json::parse(R"({"hidden_size": 64, "rope_theta": 1000000, "layers": [1, 2.5], "tied": false, "act": "silu", "x": null})")));
  CHECK_FALSE(same_value(a, Json::parse(R"({"hidden_size": 64, "rope_theta": 1000000, "layers": [2.5, 1], "tied": false, "act": "silu"})")));
  CHECK_FALSE(same_value(a, Json::parse(R"({"hidden_size": "64", "rope_theta": 1000000, "layers": [1, 2.5], "tied": false, "act": "silu"})")));
  // Integers past a double's 53 bits stay exact.
  CHECK_FALSE(same_value(Json::parse("9007199254740993"), Json::parse("9007199254740992")));
  CHECK(same_value(Json::parse("18446744073709551615"), Json::parse("18446744073709551615")));
}

TEST_CASE("first_difference names the first member that differs and both values") {
  const Json a = Json::parse(R"({"hidden_size": 64, "rope": {"theta": 1e6, "scaling": null}, "layers": [1, 2.5], "act": "silu"})");
  CHECK(first_difference(a, Json::parse(R"({"act": "silu", "layers": [1.0, 2.5], "rope": {"scaling": null, "theta": 1000000}, "hidden_size": 64})")) ==
        "");
  CHECK(first_difference(a, Json::parse(R"({"hidden_size": 64, "rope": {"theta": 1e6, "scaling": null}, "layers": [1, 2.5], "act": "gelu"})")) ==
        R"(act: "silu" against "gelu")");
  CHECK(first_difference(a, Json::parse(R"({"hidden_size": 64, "rope": {"theta": 1e4, "scaling": null}, "layers": [1, 2.5], "act": "silu"})")) ==
        "rope.theta: 1e+06 against 10000.0");
  CHECK(first_difference(a, Json::parse(R"({"hidden_size": 64, "rope": {"theta": 1e6, "scaling": null}, "layers": [1, 3], "act": "silu"})")) ==
        "layers[1]: 2.5 against 3");
  CHECK(first_difference(a, Json::parse(R"({"hidden_size": 64, "rope": {"theta": 1e6, "scaling": null}, "layers": [1, 2.5]})")) ==
        "act: only in the first");
  CHECK(first_difference(a, Json::parse(R"({"hidden_size": 64, "rope": {"theta": 1e6, "scaling": null}, "layers": [1, 2.5], "act": "silu", "x": 0})")) ==
        "x: only in the second");
  CHECK(first_difference(a, Json::parse(R"({"hidden_size": "64", "rope": {"theta": 1e6, "scaling": null}, "layers": [1, 2.5], "act": "silu"})")) ==
        R"(hidden_size: 64 against "64")");
  CHECK(first_difference(Json::parse("[1, 2]"), Json::parse("[1, 2, 3]")) == "[1,2] against [1,2,3]");
  const std::string long_a = "\"" + std::string(100, 'a') + "\"";
  const std::string d = first_difference(Json::parse(long_a), Json::parse("1"));
  CHECK(d.find("...") != std::string::npos);
  CHECK(d.size() < 80);
}

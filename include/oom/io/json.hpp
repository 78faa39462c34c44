// A small JSON library of our own: a value type, a strict RFC 8259 parser and a writer. OOM reads
// Hugging Face config.json and safetensors headers and writes plans, traces and metrics with it;
// we keep it in-tree because the GPU machine has no third-party JSON package.
//
// - Integers stay exact: an integral literal is kept as int64 (or uint64 above INT64_MAX); only
//   literals with a fraction or exponent (or integers beyond 64 bits) become doubles.
// - Objects keep their keys in insertion order (configs and plans read as they were written).
// - Parse errors are oom::Error(Errc::parse) naming source, line:column and what was expected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace oom {

class Json {
 public:
  enum class Type : unsigned char { null, boolean, number, string, array, object };
  using Array = std::vector<Json>;
  using Member = std::pair<std::string, Json>;
  using Object = std::vector<Member>;  ///< insertion order; keys are unique

  Json() = default;
  Json(std::nullptr_t) {}
  Json(bool b) : type_(Type::boolean), bool_(b) {}
  Json(int v) : Json(static_cast<long long>(v)) {}
  Json(long v) : Json(static_cast<long long>(v)) {}
  Json(long long v) : type_(Type::number), num_(Num::int64), int_(static_cast<std::int64_t>(v)) {}
  Json(unsigned v) : Json(static_cast<unsigned long long>(v)) {}
  Json(unsigned long v) : Json(static_cast<unsigned long long>(v)) {}
  Json(unsigned long long v);
  Json(double v) : type_(Type::number), num_(Num::real), real_(v) {}
  Json(std::string s) : type_(Type::string), str_(std::move(s)) {}
  Json(const char* s) : Json(std::string(s)) {}
  Json(std::string_view s) : Json(std::string(s)) {}
  Json(Array a) : type_(Type::array), arr_(std::move(a)) {}
  Json(Object o);  ///< throws Errc::invalid_argument on a duplicate key

  [[nodiscard]] static Json array() { return Json(Array{}); }
  [[nodiscard]] static Json object() { return Json(Object{}); }

  [[nodiscard]] Type type() const { return type_; }
  [[nodiscard]] bool is_null() const { return type_ == Type::null; }
  [[nodiscard]] bool is_bool() const { return type_ == Type::boolean; }
  [[nodiscard]] bool is_number() const { return type_ == Type::number; }
  /// A number held exactly as a 64-bit integer (signed or unsigned).
  [[nodiscard]] bool is_integer() const { return type_ == Type::number && num_ != Num::real; }
  [[nodiscard]] bool is_string() const { return type_ == Type::string; }
  [[nodiscard]] bool is_array() const { return type_ == Type::array; }
  [[nodiscard]] bool is_object() const { return type_ == Type::object; }

  // Typed access; a mismatch throws Errc::invalid_argument "expected <what>, got <type>".
  // Use JsonCursor to have the key path named in the message.
  [[nodiscard]] bool as_bool() const;
  [[nodiscard]] std::int64_t as_int64() const;    ///< integers only, and within int64
  [[nodiscard]] std::uint64_t as_uint64() const;  ///< non-negative integers only
  [[nodiscard]] double as_double() const;         ///< any number (integers convert)
  [[nodiscard]] const std::string& as_string() const;
  [[nodiscard]] const Array& as_array() const;
  [[nodiscard]] const Object& as_object() const;

  /// Member by key, or nullptr when absent (or when this is not an object). Linear search.
  [[nodiscard]] const Json* find(std::string_view key) const;
  /// Sets a member, replacing an existing key in place or appending. This must be an object.
  Json& set(std::string key, Json value);
  /// Appends to an array.
  void push_back(Json value);
  /// Elements of an array or members of an object; 0 otherwise.
  [[nodiscard]] std::size_t size() const;

  /// Compact with `indent < 0`; otherwise one member/element per line, `indent` spaces per level.
  [[nodiscard]] std::string dump(int indent = -1) const;

  /// Parses exactly one JSON text (surrounding whitespace allowed). `source` names the text in
  /// error messages (a file path, "<plan>").
  [[nodiscard]] static Json parse(std::string_view text, std::string_view source = "<json>");

  /// Numbers compare by value within their kind: 1 == 1, 1 != 1.0 (an integer is not a double).
  friend bool operator==(const Json& a, const Json& b);

 private:
  enum class Num : unsigned char { int64, uint64, real };
  void write(std::string& out, int indent, int depth) const;

  Type type_ = Type::null;
  Num num_ = Num::int64;
  bool bool_ = false;
  std::int64_t int_ = 0;
  std::uint64_t uint_ = 0;
  double real_ = 0.0;
  std::string str_;
  Array arr_;
  Object obj_;
};

/// Whether `a` and `b` hold the same JSON value as a reader of it sees one: objects with the same
/// members in any order, numbers equal by value (1 and 1.0 alike; as doubles, exact below 2^53),
/// arrays element by element. (operator== also compares the members' order and the numbers' kinds.)
[[nodiscard]] bool same_value(const Json& a, const Json& b);

/// Where `a` and `b` first differ as same_value sees them, for a message: "" where they hold the
/// same value, else the member path and both values, e.g. `torch_dtype: "float32" against
/// "bfloat16"`, `rope.layers[1]: 2.5 against 3`, `x: only in the second` (members in `a`'s order,
/// then those only `b` has; values written compactly, long ones cut at 60 characters).
[[nodiscard]] std::string first_difference(const Json& a, const Json& b);

/// "null", "bool", "number", "string", "array", "object".
const char* to_string(Json::Type t) noexcept;

/// Reads and parses a whole file; I/O failures (a missing or unreadable file, a directory) are
/// Errc::io naming the path and the system's reason, syntax errors Errc::parse naming the path.
Json read_json_file(const std::filesystem::path& path);

/// A read-only view of a value together with its key path ("rope_scaling.factor", "layer_types[3]"),
/// so a missing field or a type mismatch is reported where it is: "rope_scaling.factor: expected
/// number, got string". Indexing a missing key yields an absent cursor rather than throwing, so
/// optional fields read naturally: `if (auto f = cfg["rope_scaling"]; f.present()) ...`.
class JsonCursor {
 public:
  JsonCursor(const Json& value, std::string path = {}) : value_(&value), path_(std::move(path)) {}

  [[nodiscard]] const std::string& path() const { return path_; }
  /// False when the key was absent. A JSON null is present; see present_not_null().
  [[nodiscard]] bool present() const { return value_ != nullptr; }
  [[nodiscard]] bool present_not_null() const { return value_ != nullptr && !value_->is_null(); }
  /// The value; throws Errc::invalid_argument "<path>: missing required field" when absent.
  [[nodiscard]] const Json& value() const;

  [[nodiscard]] JsonCursor operator[](std::string_view key) const;  ///< requires an object (if present)
  [[nodiscard]] JsonCursor operator[](std::size_t index) const;     ///< requires an array, in range

  // As Json's accessors, with the path in the message; absent -> "missing required field".
  [[nodiscard]] bool as_bool() const;
  [[nodiscard]] std::int64_t as_int64() const;
  [[nodiscard]] std::uint64_t as_uint64() const;
  [[nodiscard]] double as_double() const;
  [[nodiscard]] const std::string& as_string() const;
  [[nodiscard]] const Json::Array& as_array() const;
  [[nodiscard]] const Json::Object& as_object() const;
  [[nodiscard]] std::size_t size() const;  ///< of an array or object

 private:
  JsonCursor(const Json* value, std::string path) : value_(value), path_(std::move(path)) {}
  template <class F>
  decltype(auto) typed(F&& f) const;

  const Json* value_;
  std::string path_;
};

}  // namespace oom

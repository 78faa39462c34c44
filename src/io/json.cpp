// JSON value, strict parser and writer (see oom/io/json.hpp).
#include "oom/io/json.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <system_error>
#include <unordered_set>

#include <fmt/format.h>

#include "oom/core/error.hpp"

namespace oom {

const char* to_string(Json::Type t) noexcept {
  switch (t) {
    case Json::Type::null: return "null";
    case Json::Type::boolean: return "bool";
    case Json::Type::number: return "number";
    case Json::Type::string: return "string";
    case Json::Type::array: return "array";
    case Json::Type::object: return "object";
  }
  return "?";
}

namespace {

[[noreturn]] void mismatch(const char* expected, const Json& got) {
  std::string what = std::string("expected ") + expected + ", got " + to_string(got.type());
  if (got.is_number()) what += " " + got.dump();
  OOM_THROW(Errc::invalid_argument, what);
}

}  // namespace

Json::Json(unsigned long long v) : type_(Type::number) {
  // Keep the signed representation whenever it fits, so equal values compare equal.
  if (v <= static_cast<unsigned long long>(std::numeric_limits<std::int64_t>::max())) {
    num_ = Num::int64;
    int_ = static_cast<std::int64_t>(v);
  } else {
    num_ = Num::uint64;
    uint_ = v;
  }
}

Json::Json(Object o) : type_(Type::object) {
  // A hash of the keys rather than set() per member: headers of 100k+ tensors are built this way.
  std::unordered_set<std::string_view> keys;
  keys.reserve(o.size());
  for (const auto& m : o)
    if (!keys.insert(m.first).second)
      OOM_THROW(Errc::invalid_argument, "JSON object: duplicate key \"" + m.first + "\"");
  obj_ = std::move(o);
}

bool Json::as_bool() const {
  if (!is_bool()) mismatch("bool", *this);
  return bool_;
}

std::int64_t Json::as_int64() const {
  if (!is_integer() || num_ == Num::uint64) mismatch("integer", *this);
  return int_;
}

std::uint64_t Json::as_uint64() const {
  if (!is_integer()) mismatch("non-negative integer", *this);
  if (num_ == Num::uint64) return uint_;
  if (int_ < 0) mismatch("non-negative integer", *this);
  return static_cast<std::uint64_t>(int_);
}

double Json::as_double() const {
  if (!is_number()) mismatch("number", *this);
  switch (num_) {
    case Num::int64: return static_cast<double>(int_);
    case Num::uint64: return static_cast<double>(uint_);
    case Num::real: return real_;
  }
  return real_;
}

const std::string& Json::as_string() const {
  if (!is_string()) mismatch("string", *this);
  return str_;
}

const Json::Array& Json::as_array() const {
  if (!is_array()) mismatch("array", *this);
  return arr_;
}

const Json::Object& Json::as_object() const {
  if (!is_object()) mismatch("object", *this);
  return obj_;
}

const Json* Json::find(std::string_view key) const {
  if (!is_object()) return nullptr;
  for (const auto& [k, v] : obj_)
    if (k == key) return &v;
  return nullptr;
}

Json& Json::set(std::string key, Json value) {
  if (!is_object()) mismatch("object", *this);
  for (auto& [k, v] : obj_)
    if (k == key) return v = std::move(value);
  obj_.emplace_back(std::move(key), std::move(value));
  return obj_.back().second;
}

void Json::push_back(Json value) {
  if (!is_array()) mismatch("array", *this);
  arr_.push_back(std::move(value));
}

std::size_t Json::size() const {
  if (is_array()) return arr_.size();
  if (is_object()) return obj_.size();
  return 0;
}

bool operator==(const Json& a, const Json& b) {
  if (a.type_ != b.type_) return false;
  switch (a.type_) {
    case Json::Type::null: return true;
    case Json::Type::boolean: return a.bool_ == b.bool_;
    case Json::Type::number:
      if (a.num_ != b.num_) return false;
      if (a.num_ == Json::Num::int64) return a.int_ == b.int_;
      if (a.num_ == Json::Num::uint64) return a.uint_ == b.uint_;
      return a.real_ == b.real_;
    case Json::Type::string: return a.str_ == b.str_;
    case Json::Type::array: return a.arr_ == b.arr_;
    case Json::Type::object: return a.obj_ == b.obj_;
  }
  return false;
}

bool same_value(const Json& a, const Json& b) {
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Json::Type::number:
      if (a.is_integer() && b.is_integer()) {  // exactly, whatever the kind each is held as
        const bool negative = a.as_double() < 0;
        if (negative != (b.as_double() < 0)) return false;
        return negative ? a.as_int64() == b.as_int64() : a.as_uint64() == b.as_uint64();
      }
      return a.as_double() == b.as_double();
    case Json::Type::array: {
      const auto &x = a.as_array(), &y = b.as_array();
      return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin(), [](const Json& p, const Json& q) { return same_value(p, q); });
    }
    case Json::Type::object: {
      if (a.size() != b.size()) return false;  // keys are unique: the same count and each found is the same set
      for (const auto& [key, value] : a.as_object()) {
        const Json* other = b.find(key);
        if (other == nullptr || !same_value(value, *other)) return false;
      }
      return true;
    }
    default: return a == b;
  }
}

namespace {

std::string short_dump(const Json& v) {
  std::string text = v.dump();
  constexpr std::size_t kMax = 60;
  if (text.size() > kMax) text = text.substr(0, kMax - 3) + "...";
  return text;
}

/// One walk: arrays of one length and objects are compared member by member here (as same_value
/// would: elements in order, members as a set), anything else by same_value.
std::string difference_at(const Json& a, const Json& b, const std::string& path) {
  if (a.type() == b.type() && a.is_array() && a.size() == b.size()) {
    for (std::size_t i = 0; i < a.size(); ++i)
      if (auto d = difference_at(a.as_array()[i], b.as_array()[i], path + "[" + std::to_string(i) + "]"); !d.empty()) return d;
    return "";
  }
  if (a.type() == b.type() && a.is_object()) {
    for (const auto& [key, value] : a.as_object()) {
      const std::string member = path.empty() ? key : path + "." + key;
      const Json* other = b.find(key);
      if (other == nullptr) return member + ": only in the first";
      if (auto d = difference_at(value, *other, member); !d.empty()) return d;
    }
    for (const auto& [key, value] : b.as_object())
      if (a.find(key) == nullptr) return (path.empty() ? key : path + "." + key) + ": only in the second";
    return "";
  }
  if (same_value(a, b)) return "";
  return (path.empty() ? std::string() : path + ": ") + short_dump(a) + " against " + short_dump(b);
}

}  // namespace

std::string first_difference(const Json& a, const Json& b) { return difference_at(a, b, ""); }

// ---------------------------------------------------------------------------------------------
// Writer

namespace {

void write_string(std::string& out, std::string_view s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          static constexpr char hex[] = "0123456789abcdef";
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += static_cast<char>(c);  // UTF-8 passes through unchanged
        }
    }
  }
  out += '"';
}

// Thrown by Json::write at a NaN or an infinity and caught on its way out of each array and object,
// which add the element's place (innermost first): dump() names the value's path as JsonCursor
// spells it ("loss_scale", "losses[3]", "runs[1].loss").
struct NonFinite {
  struct Step {
    bool key;
    std::string text;  ///< the key, or the index
  };
  std::vector<Step> steps;  ///< innermost first

  // JsonCursor's spelling: "[i]" after the prefix, a key after a '.' (none at the start).
  [[nodiscard]] std::string path() const {
    std::string out;
    for (auto s = steps.rbegin(); s != steps.rend(); ++s) {
      if (!s->key) out += '[' + s->text + ']';
      else out += out.empty() ? s->text : '.' + s->text;
    }
    return out;
  }
};

void newline(std::string& out, int indent, int depth) {
  out += '\n';
  out.append(static_cast<std::size_t>(indent) * static_cast<std::size_t>(depth), ' ');
}

}  // namespace

void Json::write(std::string& out, int indent, int depth) const {
  char buf[64];
  switch (type_) {
    case Type::null: out += "null"; return;
    case Type::boolean: out += bool_ ? "true" : "false"; return;
    case Type::number: {
      std::to_chars_result r{};
      if (num_ == Num::int64) {
        r = std::to_chars(buf, buf + sizeof buf, int_);
      } else if (num_ == Num::uint64) {
        r = std::to_chars(buf, buf + sizeof buf, uint_);
      } else {
        if (!std::isfinite(real_)) throw NonFinite{};
        r = std::to_chars(buf, buf + sizeof buf, real_);  // shortest form that round-trips
      }
      std::string_view text(buf, static_cast<std::size_t>(r.ptr - buf));
      out += text;
      // A double must read back as a double: 1.0 is written "1.0", not "1".
      if (num_ == Num::real && text.find_first_of(".eE") == std::string_view::npos) out += ".0";
      return;
    }
    case Type::string: write_string(out, str_); return;
    case Type::array: {
      out += '[';
      for (std::size_t i = 0; i < arr_.size(); ++i) {
        if (i) out += ',';
        if (indent >= 0) newline(out, indent, depth + 1);
        try {
          arr_[i].write(out, indent, depth + 1);
        } catch (NonFinite& e) {
          e.steps.push_back({false, std::to_string(i)});
          throw;
        }
      }
      if (indent >= 0 && !arr_.empty()) newline(out, indent, depth);
      out += ']';
      return;
    }
    case Type::object: {
      out += '{';
      for (std::size_t i = 0; i < obj_.size(); ++i) {
        if (i) out += ',';
        if (indent >= 0) newline(out, indent, depth + 1);
        write_string(out, obj_[i].first);
        out += indent >= 0 ? ": " : ":";
        try {
          obj_[i].second.write(out, indent, depth + 1);
        } catch (NonFinite& e) {
          e.steps.push_back({true, obj_[i].first});
          throw;
        }
      }
      if (indent >= 0 && !obj_.empty()) newline(out, indent, depth);
      out += '}';
      return;
    }
  }
}

std::string Json::dump(int indent) const {
  std::string out;
  try {
    write(out, indent, 0);
  } catch (const NonFinite& e) {
    const std::string path = e.path();  // empty at the top (or under a key "" there, as JsonCursor spells it)
    OOM_THROW(Errc::invalid_argument, path.empty() ? std::string("JSON cannot represent NaN or infinity")
                                                   : fmt::format("JSON cannot represent NaN or infinity (at {})", path));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Parser

namespace {

/// Deep enough for any config or plan; shallow enough that recursion cannot exhaust the stack.
constexpr int max_depth = 512;

class Parser {
 public:
  Parser(std::string_view text, std::string_view source) : s_(text), source_(source) {}

  Json parse_document() {
    skip_ws();
    Json v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("end of input after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(std::string_view expected, std::size_t at) const {
    // Line and column are computed only on failure; columns count bytes, from 1.
    std::size_t line = 1, col = 1;
    for (std::size_t i = 0; i < at && i < s_.size(); ++i) {
      if (s_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    std::string found = at >= s_.size() ? std::string("end of input")
                                        : "'" + std::string(1, s_[at]) + "'";
    if (at < s_.size() && static_cast<unsigned char>(s_[at]) < 0x20) found = "control character";
    OOM_THROW(Errc::parse, std::string(source_) + ":" + std::to_string(line) + ":" + std::to_string(col) +
                               ": expected " + std::string(expected) + ", found " + found);
  }
  [[noreturn]] void fail(std::string_view expected) const { fail(expected, pos_); }

  void skip_ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }

  bool consume_literal(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) != lit) return false;
    pos_ += lit.size();
    return true;
  }

  Json parse_value(int depth) {
    if (depth > max_depth) fail("nesting no deeper than " + std::to_string(max_depth) + " levels");
    if (pos_ >= s_.size()) fail("a value");
    switch (s_[pos_]) {
      case '{': return parse_object(depth);
      case '[': return parse_array(depth);
      case '"': return Json(parse_string());
      case 't': if (consume_literal("true")) return Json(true); break;
      case 'f': if (consume_literal("false")) return Json(false); break;
      case 'n': if (consume_literal("null")) return Json(nullptr); break;
      default:
        if (s_[pos_] == '-' || (s_[pos_] >= '0' && s_[pos_] <= '9')) return parse_number();
    }
    fail("a value (object, array, string, number, true, false or null)");
  }

  Json parse_object(int depth) {
    ++pos_;  // '{'
    Json::Object members;
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return Json(std::move(members));
    }
    // Duplicates are found by hash, not by Json::find (a scan per key): safetensors headers hold
    // up to 100 MB of keys. The set owns copies, as moving `members` may move the keys' bytes.
    std::unordered_set<std::string> keys;
    for (;;) {
      skip_ws();
      if (pos_ >= s_.size() || s_[pos_] != '"') fail("a string key");
      const std::size_t key_at = pos_;
      std::string key = parse_string();
      if (!keys.insert(key).second) fail("a key not already in this object (duplicate \"" + key + "\")", key_at);
      skip_ws();
      if (pos_ >= s_.size() || s_[pos_] != ':') fail("':' after the key");
      ++pos_;
      skip_ws();
      members.emplace_back(std::move(key), parse_value(depth + 1));
      skip_ws();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == '}') {
        ++pos_;
        return Json(std::move(members));
      }
      fail("',' or '}' in an object");
    }
  }

  Json parse_array(int depth) {
    ++pos_;  // '['
    Json arr = Json::array();
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return arr;
    }
    for (;;) {
      skip_ws();
      arr.push_back(parse_value(depth + 1));
      skip_ws();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == ']') {
        ++pos_;
        return arr;
      }
      fail("',' or ']' in an array");
    }
  }

  unsigned parse_hex4() {
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      if (pos_ >= s_.size()) fail("4 hex digits after \\u");
      const char c = s_[pos_];
      unsigned d = 0;
      if (c >= '0' && c <= '9') d = static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') d = static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') d = static_cast<unsigned>(c - 'A' + 10);
      else fail("4 hex digits after \\u");
      v = v * 16 + d;
      ++pos_;
    }
    return v;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  /// Validates one raw UTF-8 sequence starting at pos_ (a lead byte >= 0x80) and copies it:
  /// no overlong forms, no surrogates, nothing above U+10FFFF.
  void copy_utf8(std::string& out) {
    const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(s_[i]); };
    const unsigned char b0 = byte(pos_);
    std::size_t n = 0;
    unsigned cp = 0, min = 0;
    if (b0 >= 0xC2 && b0 <= 0xDF) { n = 2; cp = b0 & 0x1F; min = 0x80; }
    else if (b0 >= 0xE0 && b0 <= 0xEF) { n = 3; cp = b0 & 0x0F; min = 0x800; }
    else if (b0 >= 0xF0 && b0 <= 0xF4) { n = 4; cp = b0 & 0x07; min = 0x10000; }
    else fail("valid UTF-8 in a string");
    if (pos_ + n > s_.size()) fail("valid UTF-8 in a string");
    for (std::size_t i = 1; i < n; ++i) {
      if ((byte(pos_ + i) & 0xC0) != 0x80) fail("valid UTF-8 in a string");
      cp = (cp << 6) | (byte(pos_ + i) & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) fail("valid UTF-8 in a string");
    out.append(s_.substr(pos_, n));
    pos_ += n;
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) fail("'\"' closing the string");
      const auto c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) fail("an escaped control character (\\n, \\t, \\u00XX)");
      if (c >= 0x80) {
        copy_utf8(out);
        continue;
      }
      if (c != '\\') {
        out += static_cast<char>(c);
        ++pos_;
        continue;
      }
      ++pos_;
      if (pos_ >= s_.size()) fail("an escape after '\\'");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          const std::size_t at = pos_ - 2;
          unsigned cp = parse_hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail("a high surrogate before a low surrogate", at);
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (!consume_literal("\\u")) fail("a low surrogate \\uDC00-\\uDFFF after a high surrogate");
            const unsigned lo = parse_hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("a low surrogate \\uDC00-\\uDFFF after a high surrogate", pos_ - 6);
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("one of \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u", pos_ - 1);
      }
    }
  }

  Json parse_number() {
    const std::size_t start = pos_;
    const auto digit = [&] { return pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9'; };
    if (s_[pos_] == '-') ++pos_;
    if (!digit()) fail("a digit");
    if (s_[pos_] == '0') {
      ++pos_;
      if (digit()) fail("no leading zeros in a number", pos_ - 1);
    } else {
      while (digit()) ++pos_;
    }
    bool integral = true;
    if (pos_ < s_.size() && s_[pos_] == '.') {
      integral = false;
      ++pos_;
      if (!digit()) fail("a digit after the decimal point");
      while (digit()) ++pos_;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!digit()) fail("a digit in the exponent");
      while (digit()) ++pos_;
    }
    const char* first = s_.data() + start;
    const char* last = s_.data() + pos_;
    if (integral) {
      std::int64_t i = 0;
      if (auto r = std::from_chars(first, last, i); r.ec == std::errc() && r.ptr == last) return Json(i);
      std::uint64_t u = 0;
      if (auto r = std::from_chars(first, last, u); r.ec == std::errc() && r.ptr == last)
        return Json(static_cast<unsigned long long>(u));
      // Beyond 64 bits: fall through to a double, as other JSON readers do.
    }
    double d = 0;
    auto r = std::from_chars(first, last, d);
    if (r.ec == std::errc::result_out_of_range) fail("a number within double range", start);
    if (r.ec != std::errc() || r.ptr != last) fail("a number", start);
    return Json(d);
  }

  std::string_view s_;
  std::string_view source_;
  std::size_t pos_ = 0;
};

}  // namespace

Json Json::parse(std::string_view text, std::string_view source) { return Parser(text, source).parse_document(); }

Json read_json_file(const std::filesystem::path& path) {
  // read(2) rather than `buf << in.rdbuf()`, which swallows read errors: a directory opens and then
  // reads as nothing, reported as "expected a value, found end of input". Not a map, so a pipe
  // (`--config <(...)`) still reads.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) OOM_THROW(Errc::io, path.string() + ": cannot open: " + std::strerror(errno));
  std::string text;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      // EISDIR reads "Is a directory".
      OOM_THROW(Errc::io, path.string() + ": cannot read: " + std::strerror(err));
    }
    text.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return Json::parse(text, path.string());
}

// ---------------------------------------------------------------------------------------------
// JsonCursor

const Json& JsonCursor::value() const {
  if (value_ == nullptr) OOM_THROW(Errc::invalid_argument, path_ + ": missing required field");
  return *value_;
}

template <class F>
decltype(auto) JsonCursor::typed(F&& f) const {
  const Json& v = value();
  try {
    return f(v);
  } catch (const Error& e) {
    // Re-raise with the path in front, keeping the category.
    throw Error(e.code(), (path_.empty() ? std::string("<root>") : path_) + ": " + e.message());
  }
}

JsonCursor JsonCursor::operator[](std::string_view key) const {
  std::string sub = path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  if (value_ == nullptr) return JsonCursor(nullptr, std::move(sub));
  typed([](const Json& v) -> const Json::Object& { return v.as_object(); });
  return JsonCursor(value_->find(key), std::move(sub));
}

JsonCursor JsonCursor::operator[](std::size_t index) const {
  const auto& arr = typed([](const Json& v) -> const Json::Array& { return v.as_array(); });
  std::string sub = path_ + "[" + std::to_string(index) + "]";
  if (index >= arr.size())
    OOM_THROW(Errc::invalid_argument, sub + ": index out of range (array has " + std::to_string(arr.size()) + ")");
  return JsonCursor(&arr[index], std::move(sub));
}

bool JsonCursor::as_bool() const { return typed([](const Json& v) { return v.as_bool(); }); }
std::int64_t JsonCursor::as_int64() const { return typed([](const Json& v) { return v.as_int64(); }); }
std::uint64_t JsonCursor::as_uint64() const { return typed([](const Json& v) { return v.as_uint64(); }); }
double JsonCursor::as_double() const { return typed([](const Json& v) { return v.as_double(); }); }
const std::string& JsonCursor::as_string() const {
  return typed([](const Json& v) -> const std::string& { return v.as_string(); });
}
const Json::Array& JsonCursor::as_array() const {
  return typed([](const Json& v) -> const Json::Array& { return v.as_array(); });
}
const Json::Object& JsonCursor::as_object() const {
  return typed([](const Json& v) -> const Json::Object& { return v.as_object(); });
}
std::size_t JsonCursor::size() const {
  return typed([](const Json& v) {
    if (!v.is_array() && !v.is_object()) mismatch("array or object", v);
    return v.size();
  });
}

}  // namespace oom

// The procedural corpus: word lists, a few sentence templates, documents of one to three paragraphs.
#include "oom/io/corpus.hpp"

#include <array>
#include <span>
#include <string_view>
#include <vector>

#include "oom/core/error.hpp"
#include "oom/core/hash.hpp"

namespace oom {
namespace {

/// splitmix64: tiny, fixed across platforms, good enough to make text varied.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    const std::uint64_t z = splitmix64(state_);
    state_ += 0x9e3779b97f4a7c15ull;
    return z;
  }
  /// Uniform enough in [0, n) for n far below 2^64 (the bias is below 2^-50).
  std::uint64_t below(std::uint64_t n) { return next() % n; }
  bool chance(unsigned percent) { return below(100) < percent; }
  template <class T, std::size_t N>
  const T& pick(const std::array<T, N>& a) { return a[below(N)]; }

 private:
  std::uint64_t state_;
};

struct Noun {
  std::string_view one, many;
};
struct Verb {
  std::string_view base, third, past;
};

constexpr std::array<Noun, 32> nouns{{
    {"cat", "cats"},       {"dog", "dogs"},         {"bird", "birds"},       {"child", "children"},
    {"farmer", "farmers"}, {"teacher", "teachers"}, {"river", "rivers"},     {"tree", "trees"},
    {"house", "houses"},   {"boat", "boats"},       {"king", "kings"},       {"queen", "queens"},
    {"fox", "foxes"},      {"horse", "horses"},     {"city", "cities"},      {"garden", "gardens"},
    {"apple", "apples"},   {"stone", "stones"},     {"letter", "letters"},   {"song", "songs"},
    {"road", "roads"},     {"window", "windows"},   {"baker", "bakers"},     {"sailor", "sailors"},
    {"mouse", "mice"},     {"wolf", "wolves"},      {"book", "books"},       {"lamp", "lamps"},
    {"hill", "hills"},     {"friend", "friends"},   {"owl", "owls"},         {"door", "doors"},
}};
constexpr std::array<Verb, 24> verbs{{
    {"see", "sees", "saw"},       {"find", "finds", "found"},     {"follow", "follows", "followed"},
    {"carry", "carries", "carried"}, {"watch", "watches", "watched"}, {"help", "helps", "helped"},
    {"paint", "paints", "painted"}, {"visit", "visits", "visited"}, {"call", "calls", "called"},
    {"build", "builds", "built"}, {"lose", "loses", "lost"},       {"keep", "keeps", "kept"},
    {"open", "opens", "opened"},  {"hide", "hides", "hid"},        {"chase", "chases", "chased"},
    {"love", "loves", "loved"},   {"bring", "brings", "brought"},  {"count", "counts", "counted"},
    {"wash", "washes", "washed"}, {"read", "reads", "read"},       {"draw", "draws", "drew"},
    {"greet", "greets", "greeted"}, {"feed", "feeds", "fed"},      {"push", "pushes", "pushed"},
}};
constexpr std::array<std::string_view, 24> adjectives{
    "small", "old",   "red",   "quiet", "happy", "green",  "tall",  "brave", "tired", "bright", "cold", "young",
    "gentle", "dark", "clever", "slow", "golden", "little", "noisy", "kind", "strange", "wet", "proud", "blue"};
constexpr std::array<std::string_view, 16> adverbs{"slowly", "quickly", "again",   "carefully", "today",  "at night",
                                                   "once",   "twice",   "happily", "in silence", "early", "at last",
                                                   "gladly", "often",   "softly",  "every day"};
constexpr std::array<std::string_view, 10> places{"near", "under", "behind", "beside", "across",
                                                  "over", "inside", "around", "along", "past"};
constexpr std::array<std::string_view, 16> names{"Anna", "Ben",  "Clara", "David", "Ella",  "Finn", "Grace", "Hugo",
                                                 "Ida",  "Jack", "Kate",  "Leo",   "Maya",  "Noah", "Olga",  "Paul"};
constexpr std::array<std::string_view, 21> numbers{
    "zero",   "one",     "two",      "three",    "four",     "five",    "six",
    "seven",  "eight",   "nine",     "ten",      "eleven",   "twelve",  "thirteen",
    "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"};

class Writer {
 public:
  Writer(std::string& out, Rng& rng) : out_(out), rng_(rng) {}

  void document(std::uint64_t index) {
    const Noun& n = rng_.pick(nouns);
    out_ += "Story ";
    out_ += std::to_string(index + 1);
    out_ += ": The ";
    capitalised(rng_.pick(adjectives));
    out_ += ' ';
    capitalised(n.one);
    out_ += '\n';
    const std::uint64_t paragraphs = 1 + rng_.below(3);
    for (std::uint64_t p = 0; p < paragraphs; ++p) {
      const std::uint64_t sentences = 3 + rng_.below(6);
      for (std::uint64_t s = 0; s < sentences; ++s) {
        if (s > 0) out_ += ' ';
        sentence();
      }
      out_ += '\n';
    }
    out_ += '\n';
  }

 private:
  /// "the old fox", "a cat", "Maya", "the three wolves"; returns whether it is plural.
  bool noun_phrase(bool allow_name) {
    if (allow_name && rng_.chance(25)) {
      out_ += rng_.pick(names);
      return false;
    }
    const Noun& n = rng_.pick(nouns);
    const bool plural = rng_.chance(30);
    if (plural && rng_.chance(40)) {
      out_ += "the ";
      out_ += numbers[2 + rng_.below(8)];
      out_ += ' ';
    } else {
      out_ += plural ? "the " : (rng_.chance(60) ? "the " : "a ");
    }
    if (rng_.chance(50)) {
      out_ += rng_.pick(adjectives);
      out_ += ' ';
    }
    out_ += plural ? n.many : n.one;
    return plural;
  }

  void sentence() {
    const std::size_t start = out_.size();
    switch (rng_.below(10)) {
      case 0:
      case 1:
      case 2: {  // present tense with agreement: "The small cat sees a dog near the river."
        const bool plural = noun_phrase(true);
        const Verb& v = rng_.pick(verbs);
        out_ += ' ';
        out_ += plural ? v.base : v.third;
        out_ += ' ';
        noun_phrase(true);
        if (rng_.chance(50)) place();
        out_ += '.';
        break;
      }
      case 3:
      case 4: {  // past tense: "Ben found the red apple and carried it slowly."
        noun_phrase(true);
        out_ += ' ';
        out_ += rng_.pick(verbs).past;
        out_ += ' ';
        const bool plural = noun_phrase(false);
        out_ += " and ";
        out_ += rng_.pick(verbs).past;
        out_ += plural ? " them " : " it ";
        out_ += rng_.pick(adverbs);
        out_ += '.';
        break;
      }
      case 5: {  // a question answered by repeating it: the model can learn to copy.
        const std::string_view who = rng_.pick(names);
        const Verb& v = rng_.pick(verbs);
        const std::size_t object_at = out_.size();
        noun_phrase(false);
        const std::string object = out_.substr(object_at);
        out_.resize(object_at);
        const bool yes = rng_.chance(50);
        out_ += "Did ";
        out_ += who;
        out_ += ' ';
        out_ += v.base;
        out_ += ' ';
        out_ += object;
        out_ += yes ? "? Yes, " : "? No, ";
        out_ += who;
        out_ += yes ? " " : " did not ";
        out_ += yes ? v.past : v.base;
        out_ += ' ';
        out_ += object;
        out_ += '.';
        break;
      }
      case 6: {  // arithmetic in words: "Three and four make seven."
        const std::uint64_t a = rng_.below(11), b = rng_.below(11);
        out_ += numbers[a];
        out_ += " and ";
        out_ += numbers[b];
        out_ += " make ";
        out_ += numbers[a + b];
        out_ += '.';
        break;
      }
      case 7: {  // "There are five dogs in the garden."
        const std::uint64_t k = 2 + rng_.below(9);
        const Noun& n = rng_.pick(nouns);
        out_ += "there are ";
        out_ += numbers[k];
        out_ += ' ';
        out_ += n.many;
        out_ += " in the ";
        out_ += rng_.pick(nouns).one;
        out_ += '.';
        break;
      }
      case 8: {  // "The wolf is tired, and the owls are happy."
        bool plural = noun_phrase(false);
        out_ += plural ? " are " : " is ";
        out_ += rng_.pick(adjectives);
        out_ += ", and ";
        plural = noun_phrase(false);
        out_ += plural ? " are " : " is ";
        out_ += rng_.pick(adjectives);
        out_ += '.';
        break;
      }
      default: {  // counting: "Kate counted one, two, three."
        out_ += rng_.pick(names);
        out_ += " counted ";
        const std::uint64_t from = rng_.below(10), len = 3 + rng_.below(4);
        for (std::uint64_t i = 0; i < len; ++i) {
          if (i > 0) out_ += ", ";
          out_ += numbers[from + i];
        }
        out_ += '.';
        break;
      }
    }
    if (out_[start] >= 'a' && out_[start] <= 'z') out_[start] = static_cast<char>(out_[start] - 'a' + 'A');
  }

  void place() {
    out_ += ' ';
    out_ += rng_.pick(places);
    out_ += " the ";
    out_ += rng_.pick(nouns).one;
  }

  void capitalised(std::string_view w) {
    out_ += static_cast<char>(w[0] - 'a' + 'A');
    out_ += w.substr(1);
  }

  std::string& out_;
  Rng& rng_;
};

}  // namespace

CorpusText generate_corpus(std::uint64_t bytes, std::uint64_t seed) {
  CorpusText c;
  c.text.reserve(bytes + 4096);
  Rng rng(seed);
  Writer w(c.text, rng);
  while (c.text.size() < bytes) w.document(c.documents++);
  c.text.resize(bytes);
  return c;
}

TokenFileHeader write_builtin_corpus(const std::filesystem::path& path, std::uint64_t bytes, std::uint64_t seed) {
  const CorpusText c = generate_corpus(bytes, seed);
  std::vector<std::uint32_t> tokens(c.text.begin(), c.text.end());
  for (auto& t : tokens) t &= 0xffu;  // char may be signed; the text is ASCII anyway
  write_token_file(path, tokens, builtin_corpus_vocab, c.documents);
  return TokenFileHeader{DType::uint16, builtin_corpus_vocab, tokens.size(), c.documents};
}

}  // namespace oom

// Pre-tokenizer: splits text into the pieces that byte-level BPE then encodes one by one.
//
// Uses PCRE2 (UTF + UCP, JIT-compiled) rather than ICU or a hand-written table: PCRE2 is
// already one of pp's dependencies, supports the lookahead the Llama-3 pattern needs, takes the
// pattern nearly verbatim from tokenizer.json, and its JIT splits text at hundreds of MB/s, far
// faster than ICU's interpreted regex; the Unicode classes come from PCRE2's own tables.
//
// The patterns are the ones llama.cpp (b4747) uses, adjusted where PCRE2 would read them
// differently from llama.cpp's splitter:
//  * \s is spelled out as Unicode White_Space (llama.cpp's unicode_set_whitespace); PCRE2's
//    UCP \s also matches U+180E;
//  * the case-insensitive contractions are spelled '[sS]... (llama.cpp's adapted pattern);
//    PCRE2's (?i) would also match the long s U+017F.
// Known residual difference: PCRE2 10.42 has Unicode 14 tables, llama.cpp's are newer, so a
// letter or digit added in Unicode 15 (rare CJK extension ideographs, ...) may split differently.
//
// Kinds:
//  * llama3 (tokenizer.ggml.pre = "llama-bpe"): one pattern, Llama-3's tokenizer.json Split.
//  * gpt2_default (pre missing): llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT, four patterns applied
//    in sequence, each splitting the pieces of the previous one into matches and the gaps
//    between them (llama.cpp's unicode_regex_split).
#pragma once

#include <pp/core/error.hpp>
#include <pp/text/utf8.hpp>

// pcre2.h requires the code unit width before inclusion; this header uses the explicit *_8
// names, which every width setting declares.
#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace pp {

enum class PreTokenizerKind {
  llama3,        // "llama-bpe" (and llama.cpp's aliases "llama3", "llama-v3")
  gpt2_default,  // llama.cpp's "default" BPE pre-tokenizer, used when tokenizer.ggml.pre is missing
};

inline const char* pre_tokenizer_name(PreTokenizerKind k) {
  return k == PreTokenizerKind::llama3 ? "llama-bpe" : "default";
}

namespace detail {

// Unicode White_Space, as a character-class body.
inline constexpr std::string_view kWhiteSpace =
    "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
    "\\x{205F}\\x{3000}";

// Replaces every "W" in `shape` with the White_Space class body (patterns read better this way).
inline std::string expand_ws(std::string_view shape) {
  std::string out;
  for (char c : shape) {
    if (c == 'W')
      out += kWhiteSpace;
    else
      out += c;
  }
  return out;
}

// One compiled pattern, immutable and shareable between threads (match data is per call).
class Regex {
 public:
  explicit Regex(const std::string& pattern) {
    int err = 0;
    PCRE2_SIZE err_off = 0;
    pcre2_code_8* code = pcre2_compile_8(reinterpret_cast<PCRE2_SPTR8>(pattern.data()), pattern.size(),
                                         PCRE2_UTF | PCRE2_UCP, &err, &err_off, nullptr);
    if (!code) throw TokenizerError("pre-tokenizer pattern does not compile at offset " +
                                    std::to_string(err_off) + ": " + message(err) + " (" + pattern + ")");
    code_.reset(code, pcre2_code_free_8);
    // Without JIT (e.g. where executable memory is forbidden) pcre2_match interprets the
    // pattern: slower, same result.
    pcre2_jit_compile_8(code, PCRE2_JIT_COMPLETE);
  }

  const pcre2_code_8* code() const { return code_.get(); }

  static std::string message(int err) {
    std::array<PCRE2_UCHAR8, 256> buf{};
    pcre2_get_error_message_8(err, buf.data(), buf.size());
    return reinterpret_cast<const char*>(buf.data());
  }

 private:
  std::shared_ptr<pcre2_code_8> code_;
};

struct MatchDataDeleter {
  void operator()(pcre2_match_data_8* m) const { pcre2_match_data_free_8(m); }
};
using MatchData = std::unique_ptr<pcre2_match_data_8, MatchDataDeleter>;

}  // namespace detail

class PreTokenizer {
 public:
  explicit PreTokenizer(PreTokenizerKind kind) : kind_(kind) {
    using detail::expand_ws;
    if (kind == PreTokenizerKind::llama3) {
      patterns_.emplace_back(expand_ws(
          "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
          "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
          "|\\p{N}{1,3}"
          "| ?[^W\\p{L}\\p{N}]+[\\r\\n]*"
          "|[W]*[\\r\\n]+"
          "|[W]+(?![^W])"
          "|[W]+"));
    } else {
      patterns_.emplace_back("[\\p{P}\\$\\+<=>\\^~\\|]+");
      // llama.cpp's custom gpt2 splitter also takes a lone whitespace before a non-space (\s+).
      patterns_.emplace_back(expand_ws(
          "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^W\\p{L}\\p{N}]+|[W]+(?![^W])|[W]+"));
      patterns_.emplace_back("\\p{N}+");
      patterns_.emplace_back("[0-9][0-9][0-9]");
    }
  }

  PreTokenizerKind kind() const { return kind_; }

  // Calls emit(std::string_view piece) for each non-empty piece of `text`, in order; the pieces
  // concatenate to `text`. `text` must be well-formed UTF-8 (the tokenizer repairs its input
  // first; checking again costs little next to the match). Throws TokenizerError otherwise, or
  // if PCRE2 gives up (match or stack limit), which the patterns' shape (no nested quantifiers)
  // should make impossible.
  template <class Emit>
  void split(std::string_view text, Emit&& emit) const {
    if (const std::size_t good = utf8::valid_prefix(text); good != text.size())
      throw TokenizerError("pre-tokenizer: input is not well-formed UTF-8 at byte " + std::to_string(good) +
                           " of " + std::to_string(text.size()));
    if (text.empty()) return;
    std::vector<detail::MatchData> md;
    md.reserve(patterns_.size());
    for (const auto& p : patterns_) {
      md.emplace_back(pcre2_match_data_create_from_pattern_8(p.code(), nullptr));
      if (!md.back()) throw TokenizerError("out of memory for PCRE2 match data");
    }
    split_level(text, 0, md, emit);
  }

 private:
  template <class Emit>
  void split_level(std::string_view text, std::size_t level, std::vector<detail::MatchData>& md,
                   Emit& emit) const {
    if (level == patterns_.size()) {
      emit(text);
      return;
    }
    const pcre2_code_8* code = patterns_[level].code();
    pcre2_match_data_8* m = md[level].get();
    const auto* subject = reinterpret_cast<PCRE2_SPTR8>(text.data());
    std::size_t pos = 0;  // start of the text not yet emitted
    while (pos < text.size()) {
      const int rc = pcre2_match_8(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, m, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0)
        throw TokenizerError("pre-tokenizer: PCRE2 error at byte " + std::to_string(pos) + " of a " +
                             std::to_string(text.size()) + "-byte fragment: " + detail::Regex::message(rc));
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer_8(m);
      std::size_t begin = ov[0], end = ov[1];
      if (end == begin) {  // the patterns never match empty; guard against looping anyway
        if (begin >= text.size()) break;
        end = begin + utf8::decode_one(text, begin).len;
        if (end > text.size()) end = text.size();
      }
      if (begin > pos) split_level(text.substr(pos, begin - pos), level + 1, md, emit);  // gap
      split_level(text.substr(begin, end - begin), level + 1, md, emit);
      pos = end;
    }
    if (pos < text.size()) split_level(text.substr(pos), level + 1, md, emit);
  }

  PreTokenizerKind kind_;
  std::vector<detail::Regex> patterns_;
};

}  // namespace pp

// Llama-3 byte-level BPE tokenizer read from GGUF metadata: text -> ids exactly as llama.cpp, ids -> text.
//
// Encoding (llama.cpp b4747, llama_vocab::impl::tokenize for LLAMA_VOCAB_TYPE_BPE):
//  1. Special tokens. Control and unknown tokens (only when parse_special) and user-defined
//     tokens (always) found in the text become their ids. As in llama.cpp's
//     tokenizer_st_partition, tokens are tried longest text first (ties: lower id first), each
//     taking every non-overlapping occurrence that lies wholly inside text not yet claimed.
//  2. Repair. Each remaining text fragment is made well-formed UTF-8: every byte that does not
//     belong to a well-formed sequence becomes U+FFFD (utf8.hpp). For lone continuation bytes,
//     truncated sequences and invalid lead bytes this is exactly llama.cpp's result; llama.cpp
//     instead decodes overlong forms and surrogates leniently (and throws on leads F5..F7),
//     where pp replaces each of their bytes by U+FFFD. So encode never throws on any input
//     bytes, and decode(encode(s, false, false)) == utf8::sanitize(s) for every byte string s
//     (with parse_special on, decode with keep_special gives the same).
//  3. Pre-tokenizer split (pretokenizer.hpp, PCRE2).
//  4. Each piece: when the pre-tokenizer is llama-bpe (ignore_merges) and the piece is itself a
//     token, that token; otherwise one symbol per byte (its byte token) merged by rank
//     (bpe.hpp). A byte whose byte token is missing from the vocabulary is dropped, as in
//     llama.cpp (never the case for Llama-3: all 256 byte tokens exist).
// Token texts are converted from the GPT-2 byte alphabet to raw bytes once at load time
// (byte_level.hpp), so encoding hashes raw bytes and merges token ids, never strings.
//
// Decoding concatenates each token's bytes (control tokens left out unless asked for; unused,
// byte and undefined token types produce nothing, as in llama.cpp's token_to_piece) and replaces
// invalid UTF-8 by U+FFFD; StreamDecoder does the same incrementally, one token at a time.
//
// A Tokenizer is immutable after construction; copies share the tables and every member is
// safe to call from several threads.
#pragma once

#include <pp/core/error.hpp>
#include <pp/io/gguf.hpp>
#include <pp/text/bpe.hpp>
#include <pp/text/byte_level.hpp>
#include <pp/text/pretokenizer.hpp>
#include <pp/text/string_index.hpp>
#include <pp/text/utf8.hpp>

#include <algorithm>
#include <array>
#include <bitset>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pp {

// Token types as stored in tokenizer.ggml.token_type (llama.cpp's llama_token_type).
enum class TokenType : int32_t {
  undefined = 0,
  normal = 1,
  unknown = 2,
  control = 3,
  user_defined = 4,
  unused = 5,
  byte = 6,
};

inline constexpr int32_t kMaxTokenType = 6;
inline constexpr int32_t kNoTokenId = -1;

// Everything a tokenizer is built from, whatever the source (GGUF metadata, tokenizer.json).
struct TokenizerData {
  std::vector<std::string> tokens;  // [n_vocab] token text in the GPT-2 byte alphabet ("Ġthe")
  std::vector<TokenType> types;     // [n_vocab], or empty: all normal
  std::vector<std::string> merges;  // "left right" in the byte alphabet, in rank order
  PreTokenizerKind pre = PreTokenizerKind::llama3;
  int32_t bos = kNoTokenId;  // kNoTokenId: none
  int32_t eos = kNoTokenId;
  int32_t eot = kNoTokenId;  // kNoTokenId: detected from the token text, as llama.cpp does
  int32_t eom = kNoTokenId;
  std::optional<bool> add_bos;  // nullopt: llama.cpp's default for `pre` (true for llama-bpe)
};

namespace detail {

// Token texts llama.cpp (b4747, llama_vocab::impl::load) recognises, in the order pp tries them
// (llama.cpp walks a hash map, so with several candidates its choice is unspecified).
inline constexpr std::array<std::string_view, 7> kEotNames = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
    "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>"};  // DeepSeek
inline constexpr std::string_view kEomName = "<|eom_id|>";
// Every token with one of these texts ends generation (and is made a control token). Current llama.cpp
// also lists "<|end_of_text|>" (128001 in Llama-3, where base models end a document; Hugging Face's
// generation config of the instruct models lists it too) and "_<EOT>"; b4747 did not.
inline constexpr std::array<std::string_view, 9> kEogNames = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "<|end_of_text|>"};

// Immutable tables shared by every copy of a Tokenizer.
struct Vocab {
  explicit Vocab(PreTokenizerKind kind) : pre(kind) {}

  int32_t n_vocab = 0;
  std::vector<TokenType> types;         // [n_vocab] after llama.cpp's control overrides
  std::string text_buf;                 // token texts as stored, concatenated
  std::vector<uint32_t> text_off;       // [n_vocab + 1]
  std::string piece_buf;                // what each token decodes to (keep_special), concatenated
  std::vector<uint32_t> piece_off;      // [n_vocab + 1]
  StringIndex bytes_to_id;              // raw bytes of every token whose text is in the byte
                                        // alphabet -> id (last id wins, as llama.cpp)
  std::array<int32_t, 256> byte_token{};                      // byte value -> token id or kNoToken
  bpe::MergeTable merges;
  PreTokenizer pre;
  bool ignore_merges = true;
  bool add_bos = true;
  int32_t bos = kNoTokenId, eos = kNoTokenId, eot = kNoTokenId, eom = kNoTokenId;
  std::vector<int32_t> eog;  // sorted

  // Special-token matching (step 1): candidates, best priority first.
  StringIndex special_by_text;               // text -> priority index (best one for a duplicate)
  std::vector<int32_t> specials;             // [n_special] ids by priority (length desc, id asc)
  std::vector<std::size_t> special_lengths;  // distinct text lengths, descending
  std::bitset<65536> special_prefix2;        // first two bytes of texts of length >= 2
  std::array<bool, 256> special_byte1{};     // texts of length 1
  int special_first_byte = -1;               // the first byte of every text, when they share one
  bool any_user_defined = false;

  std::string_view text(int32_t id) const {
    return std::string_view(text_buf).substr(text_off[std::size_t(id)],
                                             text_off[std::size_t(id) + 1] - text_off[std::size_t(id)]);
  }
  std::string_view piece(int32_t id) const {
    return std::string_view(piece_buf).substr(piece_off[std::size_t(id)],
                                              piece_off[std::size_t(id) + 1] - piece_off[std::size_t(id)]);
  }
};

}  // namespace detail

class Tokenizer {
 public:
  // Builds and validates. Throws TokenizerError naming the offending field, value and limit.
  explicit Tokenizer(const TokenizerData& data);

  // Reads tokenizer.ggml.* metadata. Accepts model "gpt2" (byte-level BPE) with pre "llama-bpe"
  // (or llama.cpp's aliases "llama3", "llama-v3"); a missing pre means llama.cpp's default
  // pre-tokenizer, with a warning on stderr. Refuses anything else, naming it.
  static Tokenizer from_gguf(const gguf::File& f);

  // Token ids for `text`: BOS first when add_bos (TokenizerError if the vocabulary has none),
  // special-token texts as their ids when parse_special. Never throws on malformed UTF-8.
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special = true) const {
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 2);
    if (add_bos) {
      if (v_->bos == kNoTokenId) throw TokenizerError("encode with add_bos: the vocabulary has no BOS token");
      out.push_back(v_->bos);
    }
    if (text.empty()) return out;
    bpe::Scratch scratch;
    std::vector<int32_t> syms;
    const auto raw = [&](std::string_view frag) { encode_fragment(frag, out, syms, scratch); };
    if (!(parse_special ? !v_->specials.empty() : v_->any_user_defined)) {
      raw(text);
      return out;
    }
    for (const Fragment& f : partition(text, parse_special)) {
      if (f.special != kNoTokenId)
        out.push_back(f.special);
      else
        raw(text.substr(f.begin, f.end - f.begin));
    }
    return out;
  }

  // Text for `ids`: control tokens left out unless keep_special; invalid UTF-8 in the result
  // replaced by U+FFFD (never thrown). Throws TokenizerError for an id outside the vocabulary.
  std::string decode(std::span<const int32_t> ids, bool keep_special = false) const {
    std::string out;
    for (int32_t id : ids) append_piece(id, keep_special, out);
    if (utf8::is_valid(out)) return out;
    return utf8::sanitize(out);
  }

  // Per-token accessors; each throws TokenizerError for an id outside the vocabulary.
  // The token's text as stored in the vocabulary (byte alphabet for normal tokens: "Ġthe").
  std::string_view token_text(int32_t id) const { return v_->text(checked(id)); }
  // The bytes the token decodes to (control tokens: their text); may be partial UTF-8.
  std::string_view piece(int32_t id) const { return v_->piece(checked(id)); }
  TokenType token_type(int32_t id) const { return v_->types[std::size_t(checked(id))]; }
  bool is_control(int32_t id) const { return token_type(id) == TokenType::control; }

  int32_t vocab_size() const { return v_->n_vocab; }
  int32_t bos() const { return v_->bos; }  // kNoTokenId when absent
  int32_t eos() const { return v_->eos; }
  int32_t eot() const { return v_->eot; }
  int32_t eom() const { return v_->eom; }
  // Tokens that end generation (eos, eot, eom and every token named like one), sorted.
  const std::vector<int32_t>& eog_ids() const { return v_->eog; }
  bool is_eog(int32_t id) const { return std::binary_search(v_->eog.begin(), v_->eog.end(), id); }
  // Whether a prompt should start with BOS (tokenizer.ggml.add_bos_token, default per pre-tokenizer).
  bool add_bos() const { return v_->add_bos; }
  PreTokenizerKind pre_tokenizer() const { return v_->pre.kind(); }

  // Appends token `id`'s bytes (nothing for a control token unless keep_special).
  void append_piece(int32_t id, bool keep_special, std::string& out) const {
    checked(id);
    if (!keep_special && v_->types[std::size_t(id)] == TokenType::control) return;
    out += v_->piece(id);
  }

 private:
  struct Fragment {
    std::size_t begin, end;  // byte range in the text
    int32_t special;         // the special token's id, or kNoTokenId for plain text
  };

  int32_t checked(int32_t id) const {
    if (id < 0 || id >= v_->n_vocab)
      throw TokenizerError("token id " + std::to_string(id) + " is out of range [0, " +
                           std::to_string(v_->n_vocab) + ")");
    return id;
  }

  // The data of TokenizerData as views (from_gguf points them into the mapped file: no copies).
  struct Source {
    std::span<const std::string_view> tokens;
    std::span<const TokenType> types;
    std::span<const std::string_view> merges;
    PreTokenizerKind pre = PreTokenizerKind::llama3;
    int32_t bos = kNoTokenId, eos = kNoTokenId, eot = kNoTokenId, eom = kNoTokenId;
    std::optional<bool> add_bos;
  };
  explicit Tokenizer(const Source& src) : v_(build(src)) {}
  static std::shared_ptr<const detail::Vocab> build(const Source& d);

  // Steps 2-4 for a fragment without special tokens.
  void encode_fragment(std::string_view frag, std::vector<int32_t>& out, std::vector<int32_t>& syms,
                       bpe::Scratch& scratch) const {
    std::string repaired;
    if (!utf8::is_valid(frag)) {
      repaired = utf8::sanitize(frag);
      frag = repaired;
    }
    const detail::Vocab& v = *v_;
    v.pre.split(frag, [&](std::string_view piece) {
      if (v.ignore_merges) {
        if (const int32_t id = v.bytes_to_id.find(piece); id != StringIndex::kMissing) {
          out.push_back(id);
          return;
        }
      }
      syms.clear();
      for (char c : piece) syms.push_back(v.byte_token[static_cast<uint8_t>(c)]);
      bpe::merge(syms, v.merges, scratch);
      for (int32_t s : syms)
        if (s != bpe::kNoToken) out.push_back(s);
    });
  }

  // Step 1: splits text into plain fragments and special tokens (llama.cpp's
  // tokenizer_st_partition, computed from one scan instead of one search per special token).
  std::vector<Fragment> partition(std::string_view text, bool parse_special) const {
    const detail::Vocab& v = *v_;
    struct Occurrence {
      uint32_t priority;
      std::size_t pos, len;
    };
    std::vector<Occurrence> occ;
    const std::size_t n = text.size();
    for (std::size_t i = 0; i < n; ++i) {
      if (v.special_first_byte >= 0) {  // Llama-3: every special text starts with '<'
        const void* hit = std::memchr(text.data() + i, v.special_first_byte, n - i);
        if (!hit) break;
        i = std::size_t(static_cast<const char*>(hit) - text.data());
      }
      const auto b0 = static_cast<uint8_t>(text[i]);
      const bool maybe1 = v.special_byte1[b0];
      const bool maybe2 = i + 1 < n && v.special_prefix2[(std::size_t(b0) << 8) | static_cast<uint8_t>(text[i + 1])];
      if (!maybe1 && !maybe2) continue;
      for (std::size_t len : v.special_lengths) {
        if (len > n - i || (len == 1 ? !maybe1 : !maybe2)) continue;
        const int32_t priority = v.special_by_text.find(text.substr(i, len));
        if (priority == StringIndex::kMissing) continue;
        const TokenType t = v.types[std::size_t(v.specials[std::size_t(priority)])];
        if (!parse_special && t != TokenType::user_defined) continue;
        occ.push_back({uint32_t(priority), i, len});
      }
    }
    std::sort(occ.begin(), occ.end(), [](const Occurrence& a, const Occurrence& b) {
      return a.priority != b.priority ? a.priority < b.priority : a.pos < b.pos;
    });
    std::map<std::size_t, std::pair<std::size_t, int32_t>> taken;  // begin -> (end, id)
    std::size_t i = 0;
    while (i < occ.size()) {
      const uint32_t priority = occ[i].priority;
      std::size_t last_end = 0;  // the search for this token resumes after its previous match
      for (; i < occ.size() && occ[i].priority == priority; ++i) {
        const std::size_t b = occ[i].pos, e = b + occ[i].len;
        if (b < last_end) continue;
        auto next = taken.lower_bound(b);
        if (next != taken.end() && next->first < e) continue;  // overlaps a later claim
        if (next != taken.begin() && std::prev(next)->second.first > b) continue;  // an earlier one
        taken.emplace(b, std::make_pair(e, v.specials[priority]));
        last_end = e;
      }
    }
    std::vector<Fragment> frags;
    std::size_t pos = 0;
    for (const auto& [b, end_id] : taken) {
      if (b > pos) frags.push_back({pos, b, kNoTokenId});
      frags.push_back({b, end_id.first, end_id.second});
      pos = end_id.first;
    }
    if (pos < n) frags.push_back({pos, n, kNoTokenId});
    return frags;
  }

  std::shared_ptr<const detail::Vocab> v_;
};

inline Tokenizer::Tokenizer(const TokenizerData& data) {
  const std::vector<std::string_view> tokens(data.tokens.begin(), data.tokens.end());
  const std::vector<std::string_view> merges(data.merges.begin(), data.merges.end());
  v_ = build({tokens, data.types, merges, data.pre, data.bos, data.eos, data.eot, data.eom, data.add_bos});
}

inline std::shared_ptr<const detail::Vocab> Tokenizer::build(const Source& d) {
  auto v = std::make_shared<detail::Vocab>(d.pre);
  const std::size_t n = d.tokens.size();
  if (n == 0) throw TokenizerError("tokenizer.ggml.tokens: the vocabulary is empty");
  if (n > std::size_t(std::numeric_limits<int32_t>::max()))
    throw TokenizerError("tokenizer.ggml.tokens: " + std::to_string(n) + " tokens exceed the limit " +
                         std::to_string(std::numeric_limits<int32_t>::max()));
  if (!d.types.empty() && d.types.size() != n)
    throw TokenizerError("tokenizer.ggml.token_type: has " + std::to_string(d.types.size()) +
                         " entries but tokenizer.ggml.tokens has " + std::to_string(n));
  v->n_vocab = int32_t(n);
  v->types = d.types.empty() ? std::vector<TokenType>(n, TokenType::normal)
                             : std::vector<TokenType>(d.types.begin(), d.types.end());
  for (std::size_t i = 0; i < n; ++i) {
    const auto t = int32_t(v->types[i]);
    if (t < 0 || t > kMaxTokenType)
      throw TokenizerError("tokenizer.ggml.token_type[" + std::to_string(i) + "] = " + std::to_string(t) +
                           " is not a token type (0.." + std::to_string(kMaxTokenType) + ")");
  }

  // Texts, and the text -> id index used to resolve merges and llama.cpp's name detection.
  std::size_t total = 0;
  for (const auto& t : d.tokens) total += t.size();
  if (total > std::numeric_limits<uint32_t>::max())
    throw TokenizerError("tokenizer.ggml.tokens: " + std::to_string(total) + " bytes of token text exceed the limit " +
                         std::to_string(std::numeric_limits<uint32_t>::max()));
  v->text_buf.reserve(total);
  v->text_off.reserve(n + 1);
  for (const auto& t : d.tokens) {
    v->text_off.push_back(uint32_t(v->text_buf.size()));
    v->text_buf += t;
  }
  v->text_off.push_back(uint32_t(v->text_buf.size()));
  StringIndex text_to_id;  // last id wins, as llama.cpp's token_to_id
  text_to_id.reserve(n, total);
  for (int32_t i = 0; i < int32_t(n); ++i) text_to_id.set(v->text(i), i);
  const auto find_text = [&](std::string_view t) { return text_to_id.find(t); };

  // Special ids.
  const auto check_id = [&](const char* key, int32_t id) {
    if (id != kNoTokenId && (id < 0 || id >= int32_t(n)))
      throw TokenizerError(std::string(key) + " = " + std::to_string(id) + " is out of range: the vocabulary has " +
                           std::to_string(n) + " tokens (ids 0.." + std::to_string(n - 1) + ")");
    return id;
  };
  v->bos = check_id("tokenizer.ggml.bos_token_id", d.bos);
  v->eos = check_id("tokenizer.ggml.eos_token_id", d.eos);
  v->eot = check_id("tokenizer.ggml.eot_token_id", d.eot);
  v->eom = check_id("tokenizer.ggml.eom_token_id", d.eom);
  // llama.cpp detects eot/eom by name when the metadata has none and makes them control tokens.
  const auto make_control = [&](int32_t id) { v->types[std::size_t(id)] = TokenType::control; };
  if (v->eot == kNoTokenId) {
    for (std::string_view name : detail::kEotNames) {
      if (const int32_t id = find_text(name); id != kNoTokenId) {
        v->eot = id;
        make_control(id);
        break;
      }
    }
  }
  if (v->eom == kNoTokenId) {
    if (const int32_t id = find_text(detail::kEomName); id != kNoTokenId) {
      v->eom = id;
      make_control(id);
    }
  }
  for (std::string_view name : detail::kEogNames) {
    if (const int32_t id = find_text(name); id != kNoTokenId) {
      v->eog.push_back(id);
      make_control(id);
    }
  }
  for (int32_t id : {v->eos, v->eot, v->eom})
    if (id != kNoTokenId) v->eog.push_back(id);
  std::sort(v->eog.begin(), v->eog.end());
  v->eog.erase(std::unique(v->eog.begin(), v->eog.end()), v->eog.end());

  // Raw bytes of every token whose text is in the byte alphabet (the encoder's lookup), and the
  // decoded piece of every token.
  std::string raw_buf;  // raw bytes of each token's text, where it is in the byte alphabet
  raw_buf.reserve(total);
  std::vector<uint32_t> raw_off(n + 1, 0);
  std::vector<bool> in_alphabet(n, false);
  for (std::size_t i = 0; i < n; ++i) {
    raw_off[i] = uint32_t(raw_buf.size());
    in_alphabet[i] = byte_level::decode_append(v->text(int32_t(i)), raw_buf);
  }
  raw_off[n] = uint32_t(raw_buf.size());
  const auto raw = [&](std::size_t i) { return std::string_view(raw_buf).substr(raw_off[i], raw_off[i + 1] - raw_off[i]); };
  v->bytes_to_id.reserve(n, raw_buf.size());
  for (std::size_t i = 0; i < n; ++i)
    if (in_alphabet[i] && !raw(i).empty()) v->bytes_to_id.set(raw(i), int32_t(i));
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(b);
    const int32_t id = v->bytes_to_id.find(std::string_view(&c, 1));
    v->byte_token[std::size_t(b)] = id == StringIndex::kMissing ? bpe::kNoToken : id;
  }
  v->piece_off.reserve(n + 1);
  for (std::size_t i = 0; i < n; ++i) {
    v->piece_off.push_back(uint32_t(v->piece_buf.size()));
    switch (v->types[i]) {
      case TokenType::normal:  // a text outside the byte alphabet is kept as it is
        v->piece_buf += in_alphabet[i] ? raw(i) : v->text(int32_t(i));
        break;
      case TokenType::control: case TokenType::user_defined: case TokenType::unknown:
        v->piece_buf += v->text(int32_t(i));
        break;
      default:  // unused, byte, undefined: llama.cpp's token_to_piece outputs nothing
        break;
    }
  }
  v->piece_off.push_back(uint32_t(v->piece_buf.size()));

  // Merges: "left right", split at the first space after the first byte (llama.cpp); both parts
  // and their concatenation must be tokens.
  v->merges.reserve(d.merges.size());
  if (d.merges.size() > std::size_t(std::numeric_limits<int32_t>::max()))
    throw TokenizerError("tokenizer.ggml.merges: " + std::to_string(d.merges.size()) + " merges exceed the limit " +
                         std::to_string(std::numeric_limits<int32_t>::max()));
  std::string joined;
  for (std::size_t r = 0; r < d.merges.size(); ++r) {
    const std::string_view m = d.merges[r];
    const auto where = [&] { return "tokenizer.ggml.merges[" + std::to_string(r) + "] '" + std::string(m) + "'"; };
    const std::size_t sp = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
    if (sp == std::string_view::npos) throw TokenizerError(where() + ": no space separating the two tokens");
    const std::string_view left = m.substr(0, sp), right = m.substr(sp + 1);
    const int32_t l = find_text(left);
    if (l == kNoTokenId) throw TokenizerError(where() + ": left part '" + std::string(left) + "' is not a token");
    const int32_t rt = find_text(right);
    if (rt == kNoTokenId) throw TokenizerError(where() + ": right part '" + std::string(right) + "' is not a token");
    joined.assign(left);
    joined += right;
    const int32_t res = find_text(joined);
    if (res == kNoTokenId) throw TokenizerError(where() + ": the merged text '" + joined + "' is not a token");
    v->merges.add(l, rt, {int32_t(r), res});
  }

  // Pre-tokenizer and BOS policy (llama.cpp: llama-bpe sets ignore_merges and add_bos).
  v->ignore_merges = d.pre == PreTokenizerKind::llama3;
  v->add_bos = d.add_bos.value_or(d.pre == PreTokenizerKind::llama3);
  if (v->add_bos && v->bos == kNoTokenId)
    throw TokenizerError("tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing");

  // Special tokens for step 1: control, unknown and user-defined tokens with a non-empty text.
  for (int32_t i = 0; i < int32_t(n); ++i) {
    const TokenType t = v->types[std::size_t(i)];
    if ((t == TokenType::control || t == TokenType::unknown || t == TokenType::user_defined) && !v->text(i).empty())
      v->specials.push_back(i);
  }
  std::stable_sort(v->specials.begin(), v->specials.end(),
                   [&](int32_t a, int32_t b) { return v->text(a).size() > v->text(b).size(); });
  for (uint32_t p = 0; p < uint32_t(v->specials.size()); ++p) {
    const int32_t id = v->specials[p];
    const std::string_view t = v->text(id);
    if (v->special_by_text.find(t) == StringIndex::kMissing) v->special_by_text.set(t, int32_t(p));
    if (v->special_lengths.empty() || v->special_lengths.back() != t.size()) v->special_lengths.push_back(t.size());
    if (t.size() == 1)
      v->special_byte1[static_cast<uint8_t>(t[0])] = true;
    else
      v->special_prefix2.set((std::size_t(static_cast<uint8_t>(t[0])) << 8) | static_cast<uint8_t>(t[1]));
    if (v->types[std::size_t(id)] == TokenType::user_defined) v->any_user_defined = true;
    const int first = static_cast<uint8_t>(t[0]);
    v->special_first_byte = p == 0 || v->special_first_byte == first ? first : -2;
  }
  if (v->special_first_byte < 0) v->special_first_byte = -1;
  return v;
}

namespace detail {

// The metadata value `key` as an array of `elem`, or nullptr when absent.
inline const gguf::Value* tokenizer_array(const gguf::File& f, std::string_view key, gguf::ValueType elem,
                                          bool required) {
  const gguf::Value* v = f.find(key);
  if (!v) {
    if (required) throw TokenizerError(std::string(key) + ": missing");
    return nullptr;
  }
  if (v->type != gguf::ValueType::ARRAY)
    throw TokenizerError(std::string(key) + ": expected an array of " + gguf::value_type_name(elem) + ", found " +
                         gguf::value_type_name(v->type));
  if (v->elem != elem)
    throw TokenizerError(std::string(key) + ": expected an array of " + gguf::value_type_name(elem) +
                         ", found an array of " + gguf::value_type_name(v->elem));
  return v;
}

inline std::optional<std::string_view> tokenizer_string(const gguf::File& f, std::string_view key) {
  const gguf::Value* v = f.find(key);
  if (!v) return std::nullopt;
  if (v->type != gguf::ValueType::STRING)
    throw TokenizerError(std::string(key) + ": expected a string, found " + gguf::value_type_name(v->type));
  return v->str;
}

// An optional token id: any integer type, range-checked later against the vocabulary.
inline int32_t tokenizer_id(const gguf::File& f, std::string_view key) {
  const gguf::Value* v = f.find(key);
  if (!v) return kNoTokenId;
  constexpr auto kMax = std::numeric_limits<int32_t>::max();
  const auto out_of_range = [&](const std::string& value) {
    return TokenizerError(std::string(key) + " = " + value + " is out of range [0, " + std::to_string(kMax) + "]");
  };
  switch (v->type) {
    case gguf::ValueType::U8: case gguf::ValueType::U16: case gguf::ValueType::U32: case gguf::ValueType::U64:
      if (v->u > uint64_t(kMax)) throw out_of_range(std::to_string(v->u));
      return int32_t(v->u);
    case gguf::ValueType::I8: case gguf::ValueType::I16: case gguf::ValueType::I32: case gguf::ValueType::I64:
      if (v->i < 0 || v->i > int64_t(kMax)) throw out_of_range(std::to_string(v->i));
      return int32_t(v->i);
    default:
      throw TokenizerError(std::string(key) + ": expected an integer token id, found " + gguf::value_type_name(v->type));
  }
}

}  // namespace detail

inline Tokenizer Tokenizer::from_gguf(const gguf::File& f) {
  using gguf::ValueType;
  const auto model = detail::tokenizer_string(f, "tokenizer.ggml.model");
  if (!model) throw TokenizerError("tokenizer.ggml.model: missing (expected 'gpt2', byte-level BPE)");
  if (*model == "llama")
    throw TokenizerError("tokenizer.ggml.model 'llama' (SentencePiece) is not supported: pp reads byte-level BPE "
                         "vocabularies only (tokenizer.ggml.model 'gpt2')");
  if (*model != "gpt2")
    throw TokenizerError("tokenizer.ggml.model '" + std::string(*model) +
                         "' is not supported: pp reads byte-level BPE vocabularies only (tokenizer.ggml.model 'gpt2')");

  Source d;
  if (const auto pre = detail::tokenizer_string(f, "tokenizer.ggml.pre")) {
    if (*pre == "llama-bpe" || *pre == "llama3" || *pre == "llama-v3")
      d.pre = PreTokenizerKind::llama3;
    else if (*pre == "default")
      d.pre = PreTokenizerKind::gpt2_default;
    else
      throw TokenizerError("tokenizer.ggml.pre '" + std::string(*pre) +
                           "' is not supported: pp implements 'llama-bpe' (Llama-3) and llama.cpp's 'default'");
  } else {
    // llama.cpp does the same and warns the same way.
    std::cerr << "pp: warning: tokenizer.ggml.pre is missing: using llama.cpp's default BPE pre-tokenizer; "
                 "generation quality may be degraded (regenerate the GGUF with a current converter)\n";
    d.pre = PreTokenizerKind::gpt2_default;
  }

  const gguf::Value* tokens = detail::tokenizer_array(f, "tokenizer.ggml.tokens", ValueType::STRING, true);
  std::vector<TokenType> type_buf;
  d.tokens = tokens->strings;
  if (const gguf::Value* types = detail::tokenizer_array(f, "tokenizer.ggml.token_type", ValueType::I32, false)) {
    if (types->count != tokens->count)
      throw TokenizerError("tokenizer.ggml.token_type: has " + std::to_string(types->count) +
                           " entries but tokenizer.ggml.tokens has " + std::to_string(tokens->count));
    type_buf.resize(types->count);
    for (uint64_t i = 0; i < types->count; ++i) {
      const auto t = gguf::File::array_at<int32_t>(*types, i);
      if (t < 0 || t > kMaxTokenType)
        throw TokenizerError("tokenizer.ggml.token_type[" + std::to_string(i) + "] = " + std::to_string(t) +
                             " is not a token type (0.." + std::to_string(kMaxTokenType) + ")");
      type_buf[i] = TokenType(t);
    }
    d.types = type_buf;
  }
  const gguf::Value* merges = detail::tokenizer_array(f, "tokenizer.ggml.merges", ValueType::STRING, true);
  d.merges = merges->strings;

  d.bos = detail::tokenizer_id(f, "tokenizer.ggml.bos_token_id");
  d.eos = detail::tokenizer_id(f, "tokenizer.ggml.eos_token_id");
  d.eot = detail::tokenizer_id(f, "tokenizer.ggml.eot_token_id");
  d.eom = detail::tokenizer_id(f, "tokenizer.ggml.eom_token_id");
  if (const gguf::Value* add = f.find("tokenizer.ggml.add_bos_token")) {
    if (add->type != ValueType::BOOL)
      throw TokenizerError(std::string("tokenizer.ggml.add_bos_token: expected bool, found ") +
                           gguf::value_type_name(add->type));
    d.add_bos = add->u != 0;
  }
  return Tokenizer(d);
}

// Incremental detokenizer for streaming output: feed one token at a time and get back only
// complete UTF-8 characters; an incomplete sequence is held until the next token completes it
// (or flush() ends the stream). The concatenated output equals Tokenizer::decode of all ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(Tokenizer tok, bool keep_special = false)
      : tok_(std::move(tok)), keep_special_(keep_special) {}

  // The complete characters that token `id` finishes (possibly empty). Throws TokenizerError
  // for an id outside the vocabulary.
  std::string feed(int32_t id) {
    bytes_.clear();
    tok_.append_piece(id, keep_special_, bytes_);
    std::string out;
    utf8_.feed(bytes_, out);
    return out;
  }

  // Ends the stream: held-back bytes of an unfinished character become U+FFFD each.
  std::string flush() {
    std::string out;
    utf8_.flush(out);
    return out;
  }

  // Bytes held back waiting for the rest of a character.
  std::size_t pending() const { return utf8_.pending(); }

 private:
  Tokenizer tok_;
  bool keep_special_;
  std::string bytes_;
  utf8::IncrementalDecoder utf8_;
};

}  // namespace pp

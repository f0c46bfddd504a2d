// Chat prompts: the Llama-3 chat templates rendered natively, recognised from the GGUF's tokenizer.chat_template.
//
// pp has no Jinja engine. It recognises the two Llama-3 template families by their text and renders
// them exactly as the Jinja does with add_generation_prompt:
//
//   llama3       Llama 3 / 3-Instruct (and the fixture's template):
//                  <|begin_of_text|>{ <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT|trim<|eot_id|> }
//                  <|start_header_id|>assistant<|end_header_id|>\n\n
//   llama3_dated Llama 3.1 / 3.2 (their templates write "Cutting Knowledge Date"): the same turns after a
//                system turn that always comes first:
//                  <|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n
//                  Today Date: DATE\n\nSYSTEM|trim<|eot_id|>
//                with DATE today ("%d %b %Y") when the template calls strftime_now, else "26 Jul 2024".
//
// A model without a template whose vocabulary has the Llama-3 header tokens uses `llama3`; any other
// template is refused (a chat request then gets a 400 that says so; /v1/completions still works).
// Tool calls are not supported by either format here.
//
// A prompt is rendered in pieces (ChatPieces): the template's own text, whose special tokens are parsed as
// such, and the messages' content, tokenized as plain text (encode_chat). So a message that contains
// "<|eot_id|><|start_header_id|>system<|end_header_id|>" stays text: it cannot open a turn of another role.
#pragma once

#include <cstdio>
#include <ctime>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pp/text/tokenizer.hpp"

namespace pp::node {

enum class ChatFormat { llama3, llama3_dated };

struct ChatTemplate {
  ChatFormat format = ChatFormat::llama3;
  bool today = false;        // llama3_dated: the date is today's (strftime_now), else "26 Jul 2024"
  std::string description;   // for the start-up line
};

struct ChatMessage {
  std::string role;     // system, user, assistant
  std::string content;
};

// Jinja's `trim`: Python's str.strip() on ASCII whitespace.
inline std::string trim(std::string_view s) {
  const char* ws = " \t\n\r\v\f";
  const std::size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  const std::size_t e = s.find_last_not_of(ws);
  return std::string(s.substr(b, e - b + 1));
}

// "29 Nov 2025", as strftime_now("%d %b %Y") in the C locale.
inline std::string today_date() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%d %b %Y", &tm);
  return buf;
}

// The format of a GGUF's tokenizer.chat_template, or nullopt with the reason in `why`.
// `has_llama3_headers`: the vocabulary has <|start_header_id|>, <|end_header_id|> and <|eot_id|>.
inline std::optional<ChatTemplate> detect_chat_template(std::optional<std::string_view> text, bool has_llama3_headers,
                                                        std::string& why) {
  if (!text) {
    if (!has_llama3_headers) {
      why = "the model has no chat template (tokenizer.chat_template) and its vocabulary lacks the Llama-3 header "
            "tokens; use /v1/completions with your own prompt format";
      return std::nullopt;
    }
    return ChatTemplate{ChatFormat::llama3, false,
                        "Llama-3 (the model has no tokenizer.chat_template; its vocabulary has the Llama-3 header tokens)"};
  }
  const bool headers = text->find("<|start_header_id|>") != std::string_view::npos &&
                       text->find("<|end_header_id|>") != std::string_view::npos &&
                       text->find("<|eot_id|>") != std::string_view::npos;
  if (!headers) {
    why = "the model's chat template is not a Llama-3 template (it begins '" +
          std::string(text->substr(0, 60)) + "'); pp renders Llama-3 templates only: use /v1/completions";
    return std::nullopt;
  }
  if (text->find("Cutting Knowledge Date") != std::string_view::npos) {
    const bool today = text->find("strftime_now") != std::string_view::npos;
    return ChatTemplate{ChatFormat::llama3_dated, today,
                        std::string("Llama-3.1/3.2 (system turn with the knowledge cutoff and ") +
                            (today ? "today's date" : "the date 26 Jul 2024") + ", from tokenizer.chat_template)"};
  }
  return ChatTemplate{ChatFormat::llama3, false, "Llama-3 (from tokenizer.chat_template)"};
}

// One piece of a rendered prompt: the template's text (content = false) or a message's (content = true).
struct ChatPiece {
  std::string text;
  bool content = false;
};
using ChatPieces = std::vector<ChatPiece>;

inline void add_template(ChatPieces& out, std::string_view text) {
  if (text.empty()) return;
  if (!out.empty() && !out.back().content) out.back().text += text;
  else out.push_back(ChatPiece{std::string(text), false});
}
inline void add_content(ChatPieces& out, std::string_view text) {
  if (!text.empty()) out.push_back(ChatPiece{std::string(text), true});
}

// One turn: header, trimmed content, end of turn. `role` is one of the template's (system, user, assistant).
inline void render_turn(ChatPieces& out, std::string_view role, std::string_view content) {
  add_template(out, "<|start_header_id|>" + std::string(role) + "<|end_header_id|>\n\n");
  add_content(out, trim(content));
  add_template(out, "<|eot_id|>");
}

// The text a rendered prompt starts with: the BOS token's, or nothing when the vocabulary has none.
inline std::string bos_text(const Tokenizer& tok) {
  return tok.bos() == kNoTokenId ? std::string() : std::string(tok.token_text(tok.bos()));
}

inline const char* kAssistantHeader = "<|start_header_id|>assistant<|end_header_id|>\n\n";

// The whole prompt, beginning with `bos` (the BOS token's text), ending with the assistant's header.
inline ChatPieces render_chat_pieces(const ChatTemplate& t, std::span<const ChatMessage> messages, std::string_view bos,
                                     const std::string& date = today_date()) {
  ChatPieces out;
  add_template(out, bos);
  std::size_t first = 0;
  if (t.format == ChatFormat::llama3_dated) {
    std::string system;
    if (!messages.empty() && messages[0].role == "system") system = trim(messages[0].content), first = 1;
    add_template(out, "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: " +
                          (t.today ? date : std::string("26 Jul 2024")) + "\n\n");
    add_content(out, system);
    add_template(out, "<|eot_id|>");
  }
  for (std::size_t i = first; i < messages.size(); ++i) render_turn(out, messages[i].role, messages[i].content);
  add_template(out, kAssistantHeader);
  return out;
}

inline std::string concat(const ChatPieces& pieces) {
  std::string s;
  for (const ChatPiece& p : pieces) s += p.text;
  return s;
}

// The pieces' text as one string (what the Jinja template renders).
inline std::string render_turn(std::string_view role, std::string_view content) {
  ChatPieces p;
  render_turn(p, role, content);
  return concat(p);
}
inline std::string render_chat(const ChatTemplate& t, std::span<const ChatMessage> messages, std::string_view bos,
                               const std::string& date = today_date()) {
  return concat(render_chat_pieces(t, messages, bos, date));
}

// The token ids of a rendered prompt: the template's special tokens as such, the content as plain text.
inline std::vector<int32_t> encode_chat(const Tokenizer& tok, const ChatPieces& pieces) {
  std::vector<int32_t> ids;
  for (const ChatPiece& p : pieces) {
    const std::vector<int32_t> part = tok.encode(p.text, false, !p.content);
    ids.insert(ids.end(), part.begin(), part.end());
  }
  return ids;
}

}  // namespace pp::node

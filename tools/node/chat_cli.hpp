// pp_node --chat: an interactive terminal chat through the pipeline, one line per message, replies streamed.
#pragma once

#include <atomic>
#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "node/chat_template.hpp"
#include "pp/net/coordinator/scheduler.hpp"

namespace pp::node {

struct ChatOptions {
  std::string system;           // optional system message
  uint32_t max_tokens = 512;    // per reply
  SamplingParams sampling;
  bool ignore_eos = false;
};

// The ids of one user line: the whole chat so far on the first turn (system message, user turn), else the
// user's turn alone (after the end of turn a reply cut by max tokens lacks), then the assistant's header.
// The line is text: special tokens in it are not parsed (encode_chat).
inline std::vector<int32_t> chat_turn_ids(const Tokenizer& tok, const ChatTemplate& tmpl, const std::string& system,
                                          const std::string& line, bool first, bool close_turn) {
  ChatPieces pieces;
  if (first) {
    const std::string bos = bos_text(tok);
    std::vector<ChatMessage> msgs;
    if (!system.empty()) msgs.push_back({"system", system});
    msgs.push_back({"user", line});
    pieces = render_chat_pieces(tmpl, msgs, bos);
  } else {
    if (close_turn) add_template(pieces, "<|eot_id|>");
    render_turn(pieces, "user", line);
    add_template(pieces, kAssistantHeader);
  }
  return encode_chat(tok, pieces);
}

// Reads lines from `in` until EOF, an empty line or *stop; returns the exit status. The conversation's
// session stays open between turns, so each turn feeds only its new tokens.
inline int run_chat(net::Coordinator& engine, const ChatTemplate& tmpl, const ChatOptions& o, std::istream& in,
                    std::ostream& out, const std::atomic<bool>* stop) {
  const Tokenizer& tok = *engine.tokenizer();
  out << "chat: " << tmpl.description << "\n"
      << "type a message and Enter; an empty line or Ctrl-D ends the chat, /reset starts a new conversation\n";
  auto conv = std::make_shared<net::Conversation>();
  bool first = true;
  bool close_turn = false;  // the last reply ended without <|eot_id|> (max tokens): the next turn adds it
  std::string line;
  while (!(stop && stop->load())) {
    out << "\n> " << std::flush;
    if (!std::getline(in, line) || line.empty()) break;
    if (line == "/reset") {
      engine.end_conversation(conv);
      conv = std::make_shared<net::Conversation>();
      first = true;
      close_turn = false;
      out << "(new conversation)\n";
      continue;
    }
    std::vector<int32_t> ids = chat_turn_ids(tok, tmpl, o.system, line, first, close_turn);
    first = false;
    net::GenParams p;
    p.sampling = o.sampling;
    p.max_tokens = o.max_tokens;
    p.ignore_eos = o.ignore_eos;
    std::shared_ptr<net::GenStream> reply = engine.submit(std::move(ids), p, conv);
    std::vector<net::GenStream::Piece> pieces;
    bool more = true;
    while (more) {
      pieces.clear();
      more = reply->next(pieces, std::chrono::milliseconds(100));
      for (const auto& piece : pieces) out << piece.text;
      out << std::flush;
      if (stop && stop->load()) {
        reply->cancel();
        break;
      }
    }
    out << "\n";
    if (reply->finish() == net::Finish::error) {
      out << "(error: " << reply->error() << ")\n";
      first = true;  // the conversation is gone with the session: start over
      conv = std::make_shared<net::Conversation>();
    }
    close_turn = reply->finish() == net::Finish::length;
  }
  engine.end_conversation(conv);
  out << "\n(chat ended)" << std::endl;
  return 0;
}

}  // namespace pp::node

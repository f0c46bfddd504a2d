// pp_node --chat: an interactive terminal chat through the pipeline, one line per message, replies streamed.
#pragma once

#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "node/chat_template.hpp"
#include "node/line_input.hpp"
#include "common/terminal_text.hpp"
#include "pp/net/coordinator/scheduler.hpp"

namespace pp::node {

using tools::visible_controls;

struct ChatOptions {
  std::string system;           // optional system message
  uint32_t max_tokens = 512;    // per reply
  SamplingParams sampling;
  bool ignore_eos = false;
  bool dim_stats = false;       // the stats line goes to a terminal: print it dim
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

namespace chat_detail {

inline constexpr auto kExitWindow = std::chrono::seconds(2);  // Ctrl-C twice at an empty prompt within it: exit

inline constexpr const char* kHelp =
    "commands (a line that starts with / is never sent to the model; start it with // to send a /):\n"
    "  /help                 this list\n"
    "  /reset                start a new conversation (the settings stay)\n"
    "  /system TEXT          set the system message and start a new conversation (/system alone: none)\n"
    "  /set                  show the settings\n"
    "  /set temperature X    0 (argmax: top_k, top_p and min_p off) or (0, 2]\n"
    "  /set top_k N          [1, vocabulary size], or off\n"
    "  /set top_p X          (0, 1], or off\n"
    "  /set seed N           [0, 2^64 - 1]: the draw depends on the seed and the position only\n"
    "  /set tokens N         the reply limit, [1, context size]\n"
    "  /bye, /exit           end the chat\n"
    "keys: Enter sends the line; Ctrl-C stops a reply (the conversation keeps what was shown) or drops the\n"
    "line being typed; Ctrl-C twice at an empty prompt, Ctrl-D or the end of input ends the chat";
inline constexpr const char* kEditKeys =
    "with line editing (a terminal): arrows, Home/End, Ctrl-A/E/K/U/W, Up/Down recall earlier lines";

inline std::string_view strip(std::string_view s) {  // spaces and tabs at both ends
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// The whole of `s` as a number, or nullopt.
template <class T>
std::optional<T> parse_number(std::string_view s) {
  T v{};
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

inline std::string number_text(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

inline std::string settings_text(const ChatOptions& o) {
  const SamplingParams& sp = o.sampling;
  const auto opt = [](const auto& v) { return v ? number_text(double(*v)) : std::string("off"); };
  std::string s = "temperature " + (sp.greedy() ? std::string("0 (argmax)") : number_text(sp.temperature.value_or(1.0)));
  s += ", top_k " + opt(sp.top_k) + ", top_p " + opt(sp.top_p) + ", min_p " + opt(sp.min_p);
  s += ", seed " + std::to_string(sp.seed) + ", tokens " + std::to_string(o.max_tokens);
  if (o.ignore_eos) s += ", ignore-eos";
  s += o.system.empty() ? ", no system message" : ", system message: " + o.system;
  return s;
}

// `/set NAME VALUE`: the new settings, or a one-line error naming the setting and its valid range.
inline std::string apply_set(ChatOptions& o, std::string_view args, uint32_t n_vocab, uint32_t ctx) {
  args = strip(args);
  if (args.empty()) return settings_text(o);
  const auto sp = args.find_first_of(" \t");
  const std::string_view name = args.substr(0, sp);
  const std::string_view value = sp == std::string_view::npos ? std::string_view{} : strip(args.substr(sp));
  const std::string quoted = "'" + std::string(value) + "'";
  const auto bad = [&](const std::string& range) {
    return "error: /set " + std::string(name) + " " + quoted + ": must be " + range;
  };
  if (name == "temperature") {
    const auto v = parse_number<double>(value);
    if (!v || !(*v >= 0.0 && *v <= 2.0)) return bad("a number in [0, 2] (0: argmax)");
    if (*v == 0.0) {
      o.sampling.temperature.reset(), o.sampling.top_k.reset(), o.sampling.top_p.reset(), o.sampling.min_p.reset();
    } else {
      o.sampling.temperature = *v;
    }
  } else if (name == "top_k") {
    const auto v = parse_number<int64_t>(value);
    if (value == "off") o.sampling.top_k.reset();
    else if (!v || *v < 1 || *v > int64_t(n_vocab)) return bad("an integer in [1, " + std::to_string(n_vocab) + "] or off");
    else o.sampling.top_k = *v;
  } else if (name == "top_p") {
    const auto v = parse_number<double>(value);
    if (value == "off") o.sampling.top_p.reset();
    else if (!v || !(*v > 0.0 && *v <= 1.0)) return bad("a number in (0, 1] or off");
    else o.sampling.top_p = *v;
  } else if (name == "seed") {
    const auto v = parse_number<uint64_t>(value);
    if (!v) return bad("an integer in [0, " + std::to_string(std::numeric_limits<uint64_t>::max()) + "]");
    o.sampling.seed = *v;
  } else if (name == "tokens") {
    const auto v = parse_number<uint32_t>(value);
    if (!v || *v < 1 || *v > ctx) return bad("an integer in [1, " + std::to_string(ctx) + "] (the context size)");
    o.max_tokens = *v;
  } else {
    return "error: /set " + std::string(name) + ": unknown setting (temperature, top_k, top_p, seed, tokens)";
  }
  return settings_text(o);
}

inline std::string seconds_text(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f s", s);
  return b;
}

}  // namespace chat_detail

// Reads lines from `in` until the end of input, /bye, Ctrl-C twice at an empty prompt, or *terminate (SIGTERM);
// streams each reply to `out` and a stats line per reply to `err`. Returns the exit status. The
// conversation's session stays open between turns, so each turn feeds only its new tokens.
//
// `stop` is the flag SIGINT sets: the chat takes it (sets it back to false) as "stop this reply" while a
// reply streams and as "drop this line" at the prompt; only a second one at an empty prompt ends the chat.
// A stopped reply ends its session; the chat keeps every token fed and shown (`transcript`) and the next
// turn replays them into a new conversation, so the model goes on from exactly what the user saw.
inline int run_chat(net::Coordinator& engine, const ChatTemplate& tmpl, ChatOptions o, LineInput& in,
                    std::ostream& out, std::ostream& err, std::atomic<bool>* stop,
                    const std::atomic<bool>* terminate = nullptr) {
  using namespace chat_detail;
  using Clock = std::chrono::steady_clock;
  const Tokenizer& tok = *engine.tokenizer();
  const auto terminated = [&] { return terminate && terminate->load(); };
  // A signal while the pipeline came up ends the chat before it starts.
  if (stop && stop->load()) {
    out << "\n(chat ended)" << std::endl;
    return 0;
  }
  out << "type a message and Enter; /help lists the commands, Ctrl-C stops a reply, Ctrl-D or /bye ends the chat\n";
  auto conv = std::make_shared<net::Conversation>();
  bool first = true;
  bool close_turn = false;  // the last reply ended without <|eot_id|> (max tokens, stopped): the next turn adds it
  bool replay = false;      // the last reply was stopped: the next turn starts a new conversation from transcript
  std::vector<int32_t> transcript;  // every token of this conversation: the turns sent and the tokens shown
  const auto new_conversation = [&] {
    engine.end_conversation(conv);
    conv = std::make_shared<net::Conversation>();
    first = true, close_turn = false, replay = false;
    transcript.clear();
  };
  std::optional<Clock::time_point> armed;  // the last Ctrl-C at an empty prompt
  while (!terminated()) {
    out << "\n";
    InputEvent ev = in.read("> ");
    if (terminated() || ev.kind == InputEvent::eof) break;
    if (ev.kind == InputEvent::interrupt) {
      if (stop) stop->store(false);
      if (!strip(ev.text).empty()) {  // Ctrl-C drops the line being typed
        armed.reset();
        continue;
      }
      if (armed && Clock::now() - *armed <= kExitWindow) break;
      armed = Clock::now();
      out << "(Ctrl-C again to exit, or Ctrl-D)\n";
      continue;
    }
    armed.reset();
    std::string line = std::move(ev.text);
    if (strip(line).empty()) continue;
    if (line[0] == '/' && line.rfind("//", 0) != 0) {
      const std::string_view cmd_line = strip(line);
      const auto sp = cmd_line.find_first_of(" \t");
      const std::string_view cmd = cmd_line.substr(0, sp);
      const std::string_view args = sp == std::string_view::npos ? std::string_view{} : strip(cmd_line.substr(sp));
      if (cmd == "/bye" || cmd == "/exit") break;
      if (cmd == "/help") {
        out << kHelp << "\n";
        if (in.editing()) out << kEditKeys << "\n";
      } else if (cmd == "/reset") {
        new_conversation();
        out << "(new conversation)\n";
      } else if (cmd == "/system") {
        o.system = std::string(args);
        new_conversation();
        out << (o.system.empty() ? "(no system message; new conversation)\n" : "(system message set; new conversation)\n");
      } else if (cmd == "/set") {
        out << apply_set(o, args, engine.config().n_vocab, engine.ctx()) << "\n";
      } else {
        out << "unknown command " << visible_controls(cmd) << " (/help lists the commands)\n";
      }
      continue;
    }
    if (line.rfind("//", 0) == 0) line.erase(0, 1);

    std::vector<int32_t> ids = chat_turn_ids(tok, tmpl, o.system, line, first, close_turn);
    transcript.insert(transcript.end(), ids.begin(), ids.end());
    if (replay) ids = transcript;  // a new conversation: everything so far, then this turn
    first = false, replay = false;
    net::GenParams p;
    p.sampling = o.sampling;
    p.max_tokens = o.max_tokens;
    p.ignore_eos = o.ignore_eos;
    const auto t_submit = Clock::now();
    std::optional<Clock::time_point> t_first;
    Clock::time_point t_last = t_submit;
    std::size_t n_tokens = 0;
    bool stopped = false;
    std::shared_ptr<net::GenStream> reply = engine.submit(std::move(ids), p, conv);
    std::vector<net::GenStream::Piece> pieces;
    for (bool more = true; more;) {
      pieces.clear();
      more = reply->next(pieces, std::chrono::milliseconds(100));
      for (const auto& piece : pieces) {
        out << visible_controls(piece.text);
        if (piece.token < 0) continue;
        transcript.push_back(piece.token);
        ++n_tokens;
        t_last = Clock::now();
        if (!t_first) t_first = t_last;
      }
      out << std::flush;
      if ((stop && stop->load()) || terminated()) {
        if (stop) stop->store(false);
        reply->cancel();
        stopped = true;
        break;
      }
    }
    out << "\n";
    if (stopped) {
      // The session goes with the cancel; what was shown is in the transcript, the rest is dropped.
      engine.end_conversation(conv);
      conv = std::make_shared<net::Conversation>();
      replay = true;
      close_turn = transcript.empty() || !tok.is_eog(transcript.back());
      out << "[stopped]\n";
    } else if (reply->finish() == net::Finish::error) {
      out << "(error: " << reply->error() << "; the conversation starts over)\n";
      new_conversation();
    } else {
      close_turn = reply->finish() == net::Finish::length;
      if (close_turn)
        out << "[cut off at " << o.max_tokens << " tokens: /set tokens N for longer replies]\n";
    }
    out << std::flush;
    std::string stats = std::to_string(n_tokens) + (n_tokens == 1 ? " token" : " tokens");
    if (n_tokens >= 2 && t_last > *t_first) {
      char rate[48];
      std::snprintf(rate, sizeof rate, ", %.1f tok/s", double(n_tokens - 1) / std::chrono::duration<double>(t_last - *t_first).count());
      stats += rate;
    }
    if (t_first) stats += ", first after " + seconds_text(std::chrono::duration<double>(*t_first - t_submit).count());
    err << (o.dim_stats ? "\x1b[2m(" : "(") << stats << (o.dim_stats ? ")\x1b[0m" : ")") << std::endl;
  }
  engine.end_conversation(conv);
  out << "\n(chat ended)" << std::endl;
  return 0;
}

}  // namespace pp::node

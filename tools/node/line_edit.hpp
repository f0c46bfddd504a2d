// The terminal chat's input on a terminal: line editing and history through libedit (when pp_node is built with it), else plain lines.
#pragma once

#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <clocale>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <ostream>
#include <string>

#include "node/line_input.hpp"

// PP_HAVE_LIBEDIT is set by meson when libedit (libedit-dev) was found; <histedit.h> declares a global
// `Tokenizer`, so it is included last and only here.
#if PP_HAVE_LIBEDIT
#include <histedit.h>
#endif

namespace pp::node {

#if PP_HAVE_LIBEDIT

// libedit on stdin/stdout: emacs keys, arrows, history of this session (~/.editrc is read). The keys reach
// libedit through our own read function, which waits with poll() so that Ctrl-C (SIGINT sets *stop; the
// terminal keeps ISIG, and libedit installs no handlers of its own) ends the wait: read() then returns an
// interrupt with the line that was being typed.
class EditLineInput final : public LineInput {
 public:
  EditLineInput(const char* argv0, const std::atomic<bool>* stop) : stop_(stop) {
    // libedit converts between the terminal's bytes and wide characters with the locale's codeset.
    std::setlocale(LC_CTYPE, "");
    if (MB_CUR_MAX == 1) std::setlocale(LC_CTYPE, "C.UTF-8");
    hist_ = history_init();
    HistEvent ev;
    history(hist_, &ev, H_SETSIZE, 1000);
    history(hist_, &ev, H_SETUNIQUE, 1);
    el_ = el_init(argv0, stdin, stdout, stderr);
    el_set(el_, EL_CLIENTDATA, static_cast<void*>(this));
    el_set(el_, EL_EDITOR, "emacs");
    el_set(el_, EL_SIGNAL, 0);
    el_set(el_, EL_HIST, history, hist_);
    el_set(el_, EL_PROMPT, &EditLineInput::prompt_of);
    el_set(el_, EL_GETCFN, &EditLineInput::get_char);
    el_source(el_, nullptr);
  }
  EditLineInput(const EditLineInput&) = delete;
  EditLineInput& operator=(const EditLineInput&) = delete;
  ~EditLineInput() override {
    el_end(el_);  // restores the terminal
    history_end(hist_);
  }

  bool editing() const override { return true; }

  InputEvent read(const std::string& prompt) override {
    prompt_ = prompt;
    interrupted_ = false;
    typed_.clear();
    int n = 0;
    const char* got = el_gets(el_, &n);
    if (interrupted_) {
      std::fputs("^C\n", stdout);
      std::fflush(stdout);
      return {InputEvent::interrupt, typed_};
    }
    if (!got || n <= 0) {
      std::fputs("\n", stdout);  // Ctrl-D leaves the cursor after the prompt
      std::fflush(stdout);
      return {InputEvent::eof, {}};
    }
    std::string line(got, std::size_t(n));
    if (!line.empty() && line.back() == '\n') line.pop_back();
    if (line.find_first_not_of(" \t") != std::string::npos) {
      HistEvent ev;
      history(hist_, &ev, H_ENTER, line.c_str());
    }
    return {InputEvent::line, std::move(line)};
  }

 private:
  static EditLineInput* self(EditLine* el) {
    void* p = nullptr;
    el_get(el, EL_CLIENTDATA, &p);
    return static_cast<EditLineInput*>(p);
  }
  static char* prompt_of(EditLine* el) { return self(el)->prompt_.data(); }

  // One character for libedit: 1 (read), 0 (end of input) or -1 (interrupted). The terminal sends UTF-8.
  static int get_char(EditLine* el, wchar_t* c) {
    EditLineInput& me = *self(el);
    unsigned char b0 = 0;
    if (int r = me.byte(b0); r != 1) {
      if (r < 0) {
        me.interrupted_ = true;
        if (const LineInfoW* li = el_wline(el))
          for (const wchar_t* w = li->buffer; w < li->lastchar; ++w) append_utf8(me.typed_, uint32_t(*w));
      }
      return r;
    }
    const int extra = b0 < 0x80 ? 0 : (b0 >> 5) == 0x6 ? 1 : (b0 >> 4) == 0xE ? 2 : (b0 >> 3) == 0x1E ? 3 : -1;
    if (extra < 0) {
      *c = L'\xFFFD';
      return 1;
    }
    uint32_t cp = extra == 0 ? b0 : extra == 1 ? (b0 & 0x1F) : extra == 2 ? (b0 & 0x0F) : (b0 & 0x07);
    for (int i = 0; i < extra; ++i) {
      unsigned char b = 0;
      if (me.byte(b) != 1 || (b & 0xC0) != 0x80) {  // cut short: the character is lost, not the input
        *c = L'\xFFFD';
        return 1;
      }
      cp = (cp << 6) | (b & 0x3F);
    }
    *c = static_cast<wchar_t>(cp);
    return 1;
  }

  static void append_utf8(std::string& s, uint32_t cp) {
    if (cp < 0x80) {
      s += char(cp);
    } else if (cp < 0x800) {
      s += char(0xC0 | (cp >> 6)), s += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += char(0xE0 | (cp >> 12)), s += char(0x80 | ((cp >> 6) & 0x3F)), s += char(0x80 | (cp & 0x3F));
    } else {
      s += char(0xF0 | (cp >> 18)), s += char(0x80 | ((cp >> 12) & 0x3F)), s += char(0x80 | ((cp >> 6) & 0x3F)),
          s += char(0x80 | (cp & 0x3F));
    }
  }

  // One byte of stdin: 1, 0 at the end, -1 when *stop is set (a signal ends the poll at once).
  int byte(unsigned char& b) {
    for (;;) {
      if (stop_ && stop_->load()) return -1;
      pollfd p{STDIN_FILENO, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      const ssize_t n = ::read(STDIN_FILENO, &b, 1);
      if (n == 1) return 1;
      if (n == 0 || errno != EINTR) return 0;
    }
  }

  const std::atomic<bool>* stop_;
  EditLine* el_ = nullptr;
  History* hist_ = nullptr;
  std::string prompt_;
  bool interrupted_ = false;
  std::string typed_;
};

#endif  // PP_HAVE_LIBEDIT

inline constexpr bool kHaveLineEditing =
#if PP_HAVE_LIBEDIT
    true;
#else
    false;
#endif

// The chat's input: libedit when stdin and stdout are terminals (and pp_node has it), else plain lines.
inline std::unique_ptr<LineInput> chat_line_input(const char* argv0, std::ostream& out, const std::atomic<bool>* stop) {
#if PP_HAVE_LIBEDIT
  if (::isatty(STDIN_FILENO) == 1 && ::isatty(STDOUT_FILENO) == 1) return std::make_unique<EditLineInput>(argv0, stop);
#else
  (void)argv0;
#endif
  return std::make_unique<FdLineInput>(STDIN_FILENO, out, stop);
}

}  // namespace pp::node

// Stop strings on streamed text: emit what can no longer turn into a stop string, cut the output where one appears.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pp {

// Text arrives in pieces (whole UTF-8 characters from StreamDecoder). A piece is held back only while
// the text's end could still be the beginning of a stop string, so a stop string can never begin
// inside text already emitted; when one appears, the text before it is the last output (OpenAI's rule:
// the stop string itself is not returned).
class StopMatcher {
 public:
  StopMatcher() = default;
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
    std::erase_if(stops_, [](const std::string& s) { return s.empty(); });
  }

  bool stopped() const { return stopped_; }

  // The text that is now safe to emit (possibly empty). After a stop string, nothing more.
  std::string feed(std::string_view text) {
    if (stopped_) return {};
    held_ += text;
    if (stops_.empty()) return std::exchange(held_, {});
    std::size_t at = std::string::npos;
    for (const std::string& s : stops_) at = std::min(at, held_.find(s));
    if (at != std::string::npos) {
      stopped_ = true;
      std::string out = held_.substr(0, at);
      held_.clear();
      return out;
    }
    // Hold back the longest end of the text that is a proper prefix of some stop string.
    std::size_t keep = 0;
    for (const std::string& s : stops_)
      for (std::size_t l = std::min(s.size() - 1, held_.size()); l > keep; --l)
        if (std::string_view(held_).substr(held_.size() - l) == std::string_view(s).substr(0, l)) {
          keep = l;
          break;
        }
    std::string out = held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return out;
  }

  // The end of the generation: whatever was held back is text after all.
  std::string flush() { return stopped_ ? std::string{} : std::exchange(held_, {}); }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace pp

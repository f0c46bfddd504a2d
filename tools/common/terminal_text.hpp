// Model text made safe for a terminal: control characters shown, never obeyed.
#pragma once

#include <string>
#include <string_view>

namespace pp::tools {

// `text` (UTF-8, whole characters) with every C0 control but \n and \t in caret notation (ESC as ^[, CR as
// ^M), DEL as ^?, and every C1 control (U+0080..U+009F) as U+FFFD: a model's reply cannot move the cursor,
// clear the screen, retitle the window or start an escape sequence.
inline std::string visible_controls(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    const unsigned char b = static_cast<unsigned char>(text[i]);
    if ((b < 0x20 && b != '\n' && b != '\t') || b == 0x7F) {
      out += '^';
      out += b == 0x7F ? '?' : char(b + 0x40);
    } else if (b == 0xC2 && i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) >= 0x80 &&
               static_cast<unsigned char>(text[i + 1]) <= 0x9F) {
      out += "\xEF\xBF\xBD";
      ++i;
    } else {
      out += char(b);
    }
  }
  return out;
}

}  // namespace pp::tools

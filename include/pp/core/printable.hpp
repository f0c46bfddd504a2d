// Text for people: untrusted bytes made safe to print (names from a model file, text from a peer), sizes.
#pragma once

#include <cinttypes>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "pp/core/hex.hpp"

namespace pp {

// `s` on one line with nothing a terminal would act on: control bytes, DEL and every byte >= 0x80 as
// \xNN (so no escape sequence, C1 control or NUL reaches a terminal or cuts a C string short), '\n' as
// \n, '\\' and '"' with a backslash, so the escaped text is unambiguous. Past `max_bytes` the rest is
// elided and counted.
inline std::string printable(std::string_view s, std::size_t max_bytes = 256) {
  std::string out;
  const std::size_t n = s.size() < max_bytes ? s.size() : max_bytes;
  out.reserve(n + 8);
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '\\' || c == '"') {
      out += '\\';
      out += char(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c >= 0x7f) {
      out += "\\x";
      append_hex(out, c);
    } else {
      out += char(c);
    }
  }
  if (s.size() > n) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

// "812 B", "4.0 KiB", "118.4 MiB", "2.30 GiB".
inline std::string format_bytes(uint64_t bytes) {
  char buf[32];
  const double b = double(bytes);
  if (bytes < 1024) std::snprintf(buf, sizeof buf, "%" PRIu64 " B", bytes);
  else if (b < 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024);
  else if (b < 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  return buf;
}

}  // namespace pp

// Exit statuses, one meaning in every tool (docs/CLI.md).
#pragma once

namespace pp::tools {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;  // the run started and failed (pp_node: byte-identity mismatch)
inline constexpr int kExitUsage = 2;   // cannot start: a bad flag, argument or environment value, or a model or file it names
inline constexpr int kExitPeer = 3;    // a peer or the transport failed (pp_node: a worker died, stalled, refused, sent garbage)

inline constexpr const char* kExitFooter =
    "Exit status: 0 done; 1 the run failed; 2 cannot start (bad flag, environment value, or model file); "
    "3 a peer or the transport failed.";

}  // namespace pp::tools

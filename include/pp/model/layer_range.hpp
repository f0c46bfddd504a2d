// How a model's blocks are split across pipeline stages: compute_layer_range and stage roles.
#pragma once

#include <pp/core/error.hpp>

#include <string>

namespace pp {

// The half-open block range [lo, hi) that one stage runs.
struct LayerRange {
  int lo = 0;
  int hi = 0;
  int size() const { return hi - lo; }
  bool operator==(const LayerRange&) const = default;
};

// Stage `stage` of `n` over `total` blocks: k = total / n; [stage * k, (stage + 1) * k), except that
// the last stage ends at `total` (it takes the remainder). (0, 2, 16) -> [0, 8); (1, 2, 15) -> [7, 15).
inline LayerRange compute_layer_range(int stage, int n, int total) {
  if (n < 2) throw Error("layer split: num_stages " + std::to_string(n) + " < 2");
  if (stage < 0 || stage >= n)
    throw Error("layer split: stage " + std::to_string(stage) + " outside [0, " + std::to_string(n) + ")");
  if (total < n)
    throw Error("layer split: total_blocks " + std::to_string(total) + " < num_stages " + std::to_string(n) +
                " (every stage needs at least one block)");
  const int k = total / n;
  return LayerRange{stage * k, stage == n - 1 ? total : (stage + 1) * k};
}

// Stage 0 is First (embeds tokens), stage n-1 is Last (samples), the rest are Middle.
enum class StageRole { first, middle, last };

inline StageRole stage_role(int stage, int n) {
  if (stage == 0) return StageRole::first;
  if (stage == n - 1) return StageRole::last;
  return StageRole::middle;
}

inline const char* role_name(StageRole r) {
  switch (r) {
    case StageRole::first: return "first";
    case StageRole::middle: return "middle";
    case StageRole::last: return "last";
  }
  return "?";
}

}  // namespace pp

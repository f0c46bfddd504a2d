// Rotary position embedding tables: Llama-3 frequencies (freq_base, rope_freqs divisors), per position.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace pp {

class Rope {
 public:
  Rope() = default;
  // theta_i(pos) = pos * base^(-2i / head_dim) / freq_factors[i], for pairs i < head_dim / 2.
  Rope(std::size_t head_dim, double base, const std::vector<float>& freq_factors) : half_(head_dim / 2) {
    inv_freq_.resize(half_);
    for (std::size_t i = 0; i < half_; ++i)
      inv_freq_[i] = std::pow(base, -2.0 * double(i) / double(head_dim)) / double(freq_factors[i]);
  }
  std::size_t pairs() const { return half_; }

  // cos/sin [pairs()] at `pos`; angles in double so long positions keep their precision.
  void table(int64_t pos, float* cos, float* sin) const {
    for (std::size_t i = 0; i < half_; ++i) {
      const double a = double(pos) * inv_freq_[i];
      cos[i] = float(std::cos(a));
      sin[i] = float(std::sin(a));
    }
  }

 private:
  std::size_t half_ = 0;
  std::vector<double> inv_freq_;  // [head_dim / 2], computed once
};

}  // namespace pp

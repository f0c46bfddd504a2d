// Building blocks of the float64 oracles of the kernel and quant tests: random f32 data, weights stored as
// a type holds them, f32 buffers seen as Eigen float64 matrices, and the rounding bound of an f32 chain.
#pragma once

#include <pp/core/dtype.hpp>
#include <pp/core/float16.hpp>

#include <Eigen/Dense>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace pp::test {

// n samples of N(0, scale^2).
inline std::vector<float> randv(std::size_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// rows x cols of the row-major f32 buffer p (rows `stride` floats apart), widened to float64 (exactly).
inline Eigen::MatrixXd f64(const float* p, std::size_t rows, std::size_t cols, std::size_t stride) {
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  return Eigen::Map<const RowMajor, 0, Eigen::OuterStride<>>(p, Eigen::Index(rows), Eigen::Index(cols),
                                                             Eigen::OuterStride<>(Eigen::Index(stride)))
      .cast<double>();
}
inline Eigen::MatrixXd f64(const std::vector<float>& v, std::size_t rows, std::size_t cols) {
  return f64(v.data(), rows, cols, cols);
}

// y[m, rows] = x[m, cols] w[rows, cols]^T in float64 (want), and the sums of |products| (mag) that bound the
// rounding of an f32 result.
struct Dots {
  Eigen::MatrixXd want, mag;
};
inline Dots dots(const std::vector<float>& w, const std::vector<float>& x, std::size_t m, std::size_t rows,
                 std::size_t cols) {
  const Eigen::MatrixXd W = f64(w, rows, cols), X = f64(x, m, cols);
  return {X * W.transpose(), X.cwiseAbs() * W.cwiseAbs().transpose()};
}

// gamma_n = n u / (1 - n u) with u = 2^-24: a chain of n f32 roundings (each FMA, multiply or add) is within
// gamma_n times the sum of the |terms| it combined of the exact result (Higham, Accuracy and Stability, 3.1).
inline double gamma_f32(std::size_t n) {
  const double nu = double(n) * 0x1p-24;
  return nu / (1 - nu);
}

// Stored weights of `type` for values w (rounded to the type), and the f32 values they hold.
struct Stored {
  std::vector<uint8_t> bytes;
  std::vector<float> values;
};
inline Stored store(pp::DType t, const std::vector<float>& w) {
  Stored s;
  s.values.resize(w.size());
  s.bytes.resize(pp::row_bytes(t, w.size()));
  for (std::size_t i = 0; i < w.size(); ++i) {
    if (t == pp::DType::F32) {
      s.values[i] = w[i];
      std::memcpy(&s.bytes[i * 4], &w[i], 4);
    } else {
      const uint16_t h = t == pp::DType::BF16 ? pp::f32_to_bf16(w[i]) : pp::f32_to_f16(w[i]);
      s.values[i] = t == pp::DType::BF16 ? pp::bf16_to_f32(h) : pp::f16_to_f32(h);
      std::memcpy(&s.bytes[i * 2], &h, 2);
    }
  }
  return s;
}

}  // namespace pp::test

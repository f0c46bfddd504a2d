// Test oracle: a plain float64 Llama forward pass over a whole prompt with a sliding-window causal mask.
// Written independently of pp's kernels: the linear algebra is Eigen's (float64), only the loader's tensor
// views are shared. Activations are Mat [tokens, features].
#pragma once

#include <pp/io/llama_loader.hpp>
#include <pp/io/mmap.hpp>
#include <pp/kernels/matmul.hpp>

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace pp::test {

class ReferenceModel {
 public:
  using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  explicit ReferenceModel(const std::string& path) : file_(path), g_(gguf::parse(file_.bytes())), c_(llama::read_config(g_)) {}
  const Config& config() const { return c_; }

  // logits [n, n_vocab] for tokens at positions 0..n-1; position p attends to [max(0, p - window + 1), p].
  std::vector<double> forward(const std::vector<int32_t>& toks, std::size_t window) const {
    const Eigen::Index n = Eigen::Index(toks.size()), E = c_.n_embd, hd = c_.head_dim, H = c_.n_head, KV = c_.n_head_kv;
    const MatView emb = llama::matrix(g_, "token_embd.weight", std::size_t(E), c_.n_vocab);
    Mat x(n, E);
    for (Eigen::Index i = 0; i < n; ++i) x.row(i) = row(emb, std::size_t(toks[std::size_t(i)]));
    const std::vector<float> ff = llama::rope_freq_factors(g_, c_);
    const double scale = 1 / std::sqrt(double(hd));
    for (std::size_t l = 0; l < c_.n_layer; ++l) {
      const BlockWeights w = llama::block_tensors(g_, c_, int(l));
      Mat xn = norm(x, w.attn_norm);
      Mat q = mul(w.wq, xn), k = mul(w.wk, xn), v = mul(w.wv, xn);
      for (Eigen::Index i = 0; i < n; ++i) {
        rope(q.row(i).data(), std::size_t(H), std::size_t(i), ff);
        rope(k.row(i).data(), std::size_t(KV), std::size_t(i), ff);
      }
      Mat att = Mat::Zero(n, H * hd);
      for (Eigen::Index i = 0; i < n; ++i)
        for (Eigen::Index h = 0; h < H; ++h) {
          // Query head h reads KV head g over keys lo..i: softmax(K q / sqrt(hd))^T V.
          const Eigen::Index g = h / (H / KV), lo = i + 1 > Eigen::Index(window) ? i + 1 - Eigen::Index(window) : 0;
          const auto keys = k.block(lo, g * hd, i - lo + 1, hd), values = v.block(lo, g * hd, i - lo + 1, hd);
          Eigen::VectorXd s = keys * q.row(i).segment(h * hd, hd).transpose() * scale;
          s = (s.array() - s.maxCoeff()).exp();
          att.row(i).segment(h * hd, hd) = (s / s.sum()).transpose() * values;
        }
      x += mul(w.wo, att);
      xn = norm(x, w.ffn_norm);
      const Mat gt = mul(w.w_gate, xn), up = mul(w.w_up, xn);
      x += mul(w.w_down, (gt.array() / (1 + (-gt.array()).exp()) * up.array()).matrix());  // SwiGLU
    }
    const Mat logits = mul(llama::output_matrix(g_, c_), norm(x, llama::norm_vector(g_, "output_norm.weight", std::size_t(E))));
    return {logits.data(), logits.data() + logits.size()};
  }

 private:
  Eigen::RowVectorXd row(const MatView& m, std::size_t r) const {
    Eigen::RowVectorXf f(Eigen::Index(m.cols));
    kernels::row_to_f32(m, r, f.data());
    return f.cast<double>();
  }
  // x [n, m.cols] times m^T: [n, m.rows]. The weights are widened to float64 a slice of rows at a time.
  Mat mul(const MatView& m, const Mat& x) const {
    Mat y(x.rows(), Eigen::Index(m.rows));
    constexpr std::size_t kSlice = 256;
    for (std::size_t r0 = 0; r0 < m.rows; r0 += kSlice) {
      const std::size_t nr = std::min(kSlice, m.rows - r0);
      Mat w(Eigen::Index(nr), Eigen::Index(m.cols));
      for (std::size_t r = 0; r < nr; ++r) w.row(Eigen::Index(r)) = row(m, r0 + r);
      y.middleCols(Eigen::Index(r0), Eigen::Index(nr)) = x * w.transpose();
    }
    return y;
  }
  // RMSNorm of each row of x, times the weight vector w.
  Mat norm(const Mat& x, const float* w) const {
    const Eigen::VectorXd s =
        ((x.rowwise().squaredNorm() / double(x.cols())).array() + double(c_.rms_eps)).sqrt().inverse();
    const Eigen::RowVectorXd wd = Eigen::Map<const Eigen::RowVectorXf>(w, x.cols()).cast<double>();
    return s.asDiagonal() * x * wd.asDiagonal();
  }
  // Rotates adjacent pairs of each head in place (v: heads * head_dim values of one position).
  void rope(double* v, std::size_t heads, std::size_t pos, const std::vector<float>& ff) const {
    const std::size_t hd = c_.head_dim;
    for (std::size_t h = 0; h < heads; ++h)
      for (std::size_t i = 0; i < hd / 2; ++i) {
        const double a = double(pos) * std::pow(double(c_.rope_base), -2.0 * double(i) / double(hd)) / double(ff[i]);
        double& x0 = v[h * hd + 2 * i];
        double& x1 = v[h * hd + 2 * i + 1];
        const double r0 = x0 * std::cos(a) - x1 * std::sin(a), r1 = x0 * std::sin(a) + x1 * std::cos(a);
        x0 = r0;
        x1 = r1;
      }
  }

  MappedFile file_;
  gguf::File g_;
  Config c_;
};

}  // namespace pp::test

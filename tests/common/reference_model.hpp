// Test oracle: a plain float64 Llama forward pass over a whole prompt with a sliding-window causal mask.
// Written independently of pp's kernels (naive loops); only the loader's tensor views are shared.
#pragma once

#include <pp/io/llama_loader.hpp>
#include <pp/io/mmap.hpp>
#include <pp/kernels/matmul.hpp>

#include <cmath>
#include <string>
#include <vector>

namespace pp::test {

class ReferenceModel {
 public:
  explicit ReferenceModel(const std::string& path) : file_(path), g_(gguf::parse(file_.bytes())), c_(llama::read_config(g_)) {}
  const Config& config() const { return c_; }

  // logits [n, n_vocab] for tokens at positions 0..n-1; position p attends to [max(0, p - window + 1), p].
  std::vector<double> forward(const std::vector<int32_t>& toks, std::size_t window) const {
    const std::size_t n = toks.size(), E = c_.n_embd, hd = c_.head_dim, H = c_.n_head, KV = c_.n_head_kv;
    std::vector<double> x(n * E);
    const MatView emb = llama::matrix(g_, "token_embd.weight", E, c_.n_vocab);
    for (std::size_t i = 0; i < n; ++i) {
      const auto r = row(emb, std::size_t(toks[i]));
      std::copy(r.begin(), r.end(), x.begin() + i * E);
    }
    const std::vector<float> ff = llama::rope_freq_factors(g_, c_);
    for (std::size_t l = 0; l < c_.n_layer; ++l) {
      const BlockWeights w = llama::block_tensors(g_, c_, int(l));
      std::vector<double> xn = norm(x, n, w.attn_norm);
      std::vector<double> q = mul(w.wq, xn, n), k = mul(w.wk, xn, n), v = mul(w.wv, xn, n);
      for (std::size_t i = 0; i < n; ++i) {
        rope(&q[i * H * hd], H, i, ff);
        rope(&k[i * KV * hd], KV, i, ff);
      }
      std::vector<double> att(n * H * hd, 0.0);
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t h = 0; h < H; ++h) {
          const std::size_t g = h / (H / KV), lo = i + 1 > window ? i + 1 - window : 0;
          std::vector<double> s;
          double mx = -1e300;
          for (std::size_t j = lo; j <= i; ++j) {
            double d = 0;
            for (std::size_t e = 0; e < hd; ++e) d += q[(i * H + h) * hd + e] * k[(j * KV + g) * hd + e];
            s.push_back(d / std::sqrt(double(hd)));
            mx = std::max(mx, s.back());
          }
          double sum = 0;
          for (double& e : s) sum += e = std::exp(e - mx);
          for (std::size_t j = lo; j <= i; ++j)
            for (std::size_t e = 0; e < hd; ++e) att[(i * H + h) * hd + e] += s[j - lo] / sum * v[(j * KV + g) * hd + e];
        }
      add(x, mul(w.wo, att, n));
      xn = norm(x, n, w.ffn_norm);
      std::vector<double> gt = mul(w.w_gate, xn, n), up = mul(w.w_up, xn, n);
      for (std::size_t i = 0; i < gt.size(); ++i) gt[i] = gt[i] / (1 + std::exp(-gt[i])) * up[i];
      add(x, mul(w.w_down, gt, n));
    }
    return mul(llama::output_matrix(g_, c_), norm(x, n, llama::norm_vector(g_, "output_norm.weight", E)), n);
  }

 private:
  std::vector<double> row(const MatView& m, std::size_t r) const {
    std::vector<float> f(m.cols);
    kernels::row_to_f32(m, r, f.data());
    return {f.begin(), f.end()};
  }
  std::vector<double> mul(const MatView& m, const std::vector<double>& x, std::size_t n) const {
    std::vector<double> y(n * m.rows);
    for (std::size_t r = 0; r < m.rows; ++r) {
      const auto w = row(m, r);
      for (std::size_t i = 0; i < n; ++i) {
        double d = 0;
        for (std::size_t j = 0; j < m.cols; ++j) d += w[j] * x[i * m.cols + j];
        y[i * m.rows + r] = d;
      }
    }
    return y;
  }
  std::vector<double> norm(const std::vector<double>& x, std::size_t n, const float* w) const {
    const std::size_t E = c_.n_embd;
    std::vector<double> y(n * E);
    for (std::size_t i = 0; i < n; ++i) {
      double ss = 0;
      for (std::size_t j = 0; j < E; ++j) ss += x[i * E + j] * x[i * E + j];
      const double s = 1 / std::sqrt(ss / double(E) + double(c_.rms_eps));
      for (std::size_t j = 0; j < E; ++j) y[i * E + j] = x[i * E + j] * s * double(w[j]);
    }
    return y;
  }
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
  static void add(std::vector<double>& x, const std::vector<double>& y) {
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += y[i];
  }

  MappedFile file_;
  gguf::File g_;
  Config c_;
};

}  // namespace pp::test

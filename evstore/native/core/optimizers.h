// Fused per-row optimizer updates. Each updater is a small value type called
// as `fn(row, grad)` for one admitted key, with `row` pointing at
//     [ w (dim) | slot 0 (dim) | slot 1 (dim) | ... ]
// and `grad` the key's summed gradient (dim floats). It reads the weights and
// its slots once and writes them in place. The formulas follow the Keras 3
// optimizers (TensorFlow 2.21's tf.keras.optimizers) operation for operation,
// so an EV and a dense tf.Variable trained on the same rows agree to float
// rounding. Learning-rate schedules and Adam's bias correction are evaluated
// by the caller once per step (global beta powers, as TF, DeepRec and TFPlus).
#pragma once
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace evstore {

// Slot requirements of an optimizer: (name, initial value) in row order.
using SlotSpecs = std::vector<std::pair<std::string, float>>;

struct SgdUpdate {
  float lr;
  int dim;
  void operator()(float* w, const float* g) const {
    for (int i = 0; i < dim; ++i) w[i] += -g[i] * lr;
  }
};

// Keras SGD with momentum: m = -lr*g + m*momentum; w += m (nesterov:
// w += -lr*g + m*momentum).
struct MomentumUpdate {
  float lr, momentum;
  bool nesterov;
  int dim, m_off;
  void operator()(float* w, const float* g) const {
    float* m = w + m_off;
    for (int i = 0; i < dim; ++i) {
      m[i] = -g[i] * lr + m[i] * momentum;
      w[i] += nesterov ? (-g[i] * lr + m[i] * momentum) : m[i];
    }
  }
};

// Keras Adagrad: acc += g^2; w -= lr*g / sqrt(acc + eps).
struct AdagradUpdate {
  float lr, eps;
  int dim, acc_off;
  void operator()(float* w, const float* g) const {
    float* a = w + acc_off;
    for (int i = 0; i < dim; ++i) {
      a[i] += g[i] * g[i];
      w[i] -= (lr * g[i]) / std::sqrt(a[i] + eps);
    }
  }
};

// Keras Adam: m += (g-m)(1-b1); v += (g^2-v)(1-b2); w -= m*alpha/(sqrt(v)+eps),
// alpha = lr * sqrt(1-b2^t) / (1-b1^t) computed by the caller.
struct AdamUpdate {
  float alpha, beta1, beta2, eps;
  int dim, m_off, v_off;
  void operator()(float* w, const float* g) const {
    float* m = w + m_off;
    float* v = w + v_off;
    const float c1 = 1.0f - beta1, c2 = 1.0f - beta2;
    for (int i = 0; i < dim; ++i) {
      m[i] += (g[i] - m[i]) * c1;
      v[i] += (g[i] * g[i] - v[i]) * c2;
      w[i] -= (m[i] * alpha) / (std::sqrt(v[i]) + eps);
    }
  }
};

// Keras AdamW: decoupled weight decay w -= w*wd*lr (applied first, as Keras
// does before its update step), then the Adam update. Only rows present in the
// batch decay (a sparse table has no "every row" to decay each step).
struct AdamWUpdate {
  AdamUpdate adam;
  float wd, lr;
  void operator()(float* w, const float* g) const {
    for (int i = 0; i < adam.dim; ++i) w[i] -= w[i] * wd * lr;
    adam(w, g);
  }
};

// Keras Ftrl (TensorFlow's FTRL-proximal, ApplyFtrlV2 semantics), operation
// for operation. Slots: accumulator n, linear z. `l2` already includes Keras'
// beta/(2*lr).
//   g' = g + 2*l2_shrinkage*w;  n' = n + g^2
//   z += g' - (n'^-p - n^-p)/lr * w            (p = learning_rate_power <= 0)
//   w = (clip(z, -l1, l1) - z) / (n'^-p/lr + 2*l2);  n = n'
struct FtrlUpdate {
  float lr, lr_power, l1, l2, l2_shrinkage;
  int dim, acc_off, lin_off;
  float Pow(float x) const { return lr_power == -0.5f ? std::sqrt(x) : std::pow(x, -lr_power); }
  void operator()(float* w, const float* g) const {
    float* n = w + acc_off;
    float* z = w + lin_off;
    const float shrink = 2.0f * l2_shrinkage, two_l2 = 2.0f * l2;
    for (int i = 0; i < dim; ++i) {
      const float gs = g[i] + shrink * w[i];
      const float nn = n[i] + g[i] * g[i];
      const float pn = Pow(nn);
      z[i] += gs - ((pn - Pow(n[i])) / lr) * w[i];
      const float zc = std::min(std::max(z[i], -l1), l1);
      w[i] = (zc - z[i]) / (pn / lr + two_l2);
      n[i] = nn;
    }
  }
};

// Sparse group lasso over one row (the group), shared by GroupAdam and
// GroupAdagrad ("Adaptive Optimizers with Sparse Group Lasso for Neural
// Networks in CTR Prediction", ECML PKDD 2021). Per coordinate the optimizer
// supplies the first-order term d (Adam: m; Adagrad: g) and the FTRL
// denominator Q (Adam: (sqrt(v)+eps)/alpha; Adagrad: sqrt(n+eps)/lr). With z
// the FTRL linear term:
//   z = z_prev + d - (Q - Q_prev) * w
//   s = clip(z, -l1, l1) - z
//   w = 0                                              if ||s|| <= l21*sqrt(dim)
//   w = (1 - l21*sqrt(dim)/||s||) * s / (Q + 2*l2)     otherwise
// The "linear" slot stores u = z + Q*w (z re-centred at the weights it
// produced), so z = u + d - Q*w needs no Q_prev: exact for rows updated at any
// steps and learning-rate schedules, and with l1 = l2 = l21 = 0 it is exactly
// w -= d/Q (Adam, Adagrad) from any initial row.
// `Moments` is called as moments.Step(i, g) -> d (updates its slots) and then
// moments.Q(i) -> Q (reads them), once per coordinate, in the same float
// operations as the dense-variable path. Three simple passes (Q kept in a
// buffer) so the compiler can vectorise the first and the last.
template <typename Moments>
inline void GroupLassoRow(float* w, const float* g, float* u, int dim, float l1, float l2, float l21,
                          const Moments& mo) {
  constexpr int kStack = 256;
  float stack[kStack];
  thread_local std::vector<float> heap;
  float* q = stack;
  if (dim > kStack) {
    heap.resize(dim);
    q = heap.data();
  }
  for (int i = 0; i < dim; ++i) {  // moments, Q, z (held in u until the last pass)
    const float d = mo.Step(i, g[i]);
    q[i] = mo.Q(i);
    u[i] = u[i] + d - q[i] * w[i];
  }
  float norm2 = 0.f;
  for (int i = 0; i < dim; ++i) {
    const float s = std::min(std::max(u[i], -l1), l1) - u[i];
    norm2 += s * s;
  }
  const float thr = l21 * std::sqrt(static_cast<float>(dim));
  const float norm = std::sqrt(norm2);
  const float scale = norm > thr ? 1.0f - thr / norm : 0.0f;
  const float two_l2 = 2.0f * l2;
  if (scale == 0.0f) {  // the group lasso drops the row
    for (int i = 0; i < dim; ++i) w[i] = 0.0f;  // u keeps z
    return;
  }
  for (int i = 0; i < dim; ++i) {
    const float z = u[i];
    const float s = std::min(std::max(z, -l1), l1) - z;
    w[i] = scale * s / (q[i] + two_l2);
    u[i] = z + q[i] * w[i];
  }
}

// GroupAdam: Adam moments (Keras order of operations), Q = (sqrt(v)+eps)/alpha,
// alpha = lr*sqrt(1-b2^t)/(1-b1^t) from the caller (global beta powers).
// Slots: m, v, linear.
struct GroupAdamUpdate {
  float alpha, beta1, beta2, eps, l1, l2, l21;
  int dim, m_off, v_off, lin_off;
  struct Moments {
    float *m, *v;
    float c1, c2, alpha, eps;
    float Step(int i, float g) const {
      m[i] += (g - m[i]) * c1;
      v[i] += (g * g - v[i]) * c2;
      return m[i];
    }
    float Q(int i) const { return (std::sqrt(v[i]) + eps) / alpha; }
  };
  void operator()(float* w, const float* g) const {
    Moments mo{w + m_off, w + v_off, 1.0f - beta1, 1.0f - beta2, alpha, eps};
    GroupLassoRow(w, g, w + lin_off, dim, l1, l2, l21, mo);
  }
};

// GroupAdagrad (Sparse Group FTRL): n += g^2, Q = sqrt(n + eps)/lr, d = g.
// Slots: accumulator, linear.
struct GroupAdagradUpdate {
  float lr, eps, l1, l2, l21;
  int dim, acc_off, lin_off;
  struct Moments {
    float* n;
    float lr, eps;
    float Step(int i, float g) const {
      n[i] += g * g;
      return g;
    }
    float Q(int i) const { return std::sqrt(n[i] + eps) / lr; }
  };
  void operator()(float* w, const float* g) const {
    Moments mo{w + acc_off, lr, eps};
    GroupLassoRow(w, g, w + lin_off, dim, l1, l2, l21, mo);
  }
};

}  // namespace evstore

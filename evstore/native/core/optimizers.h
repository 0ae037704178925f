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

}  // namespace evstore

// Native fused multi-tensor optimizer steps for the host (CPU), used by spmd_ort
// wherever the optimizer update runs on the host (offload_optimizer="cpu").
//
// One OpenMP parallel region covers every tensor of a param group: the tensors
// are cut into cache-sized chunks and the chunks are spread over the threads,
// so small tensors cost no extra dispatch and large ones use every core.  The
// inner loops are `omp simd` loops the compiler vectorizes (AVX2/AVX-512 with
// -march=native).  State is fp32; parameters and gradients are fp32 or bf16
// (bf16 parameters are rounded to nearest even after the fp32 update).
//
// Arithmetic follows torch's vectorized fused CPU AdamW operation by operation
// (constants computed in double, rounded to float; the exp_avg lerp, the
// exp_avg_sq update and Adam's L2 term each one fused multiply-add, as torch's
// build contracts them; nothing else contracted: -ffp-contract=off).  fp32 results equal torch.optim.AdamW(fused=True) bit for
// bit except where torch runs its scalar tail loop (the last < 16 elements of
// a thread's range), which differ by at most one ulp.
//
// Built on first use by torch.utils.cpp_extension (spmd_ort/native.py) and
// registered as torch.ops.spmd_ort_native.{adam_, sgd_}.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kChunk = 16384;  // elements per task: 64 KiB of fp32 per stream

struct Task {
  int64_t tensor, begin, end;
};

std::vector<Task> split(const at::TensorList& ts) {
  std::vector<Task> tasks;
  for (int64_t i = 0; i < static_cast<int64_t>(ts.size()); ++i) {
    const int64_t n = ts[i].numel();
    for (int64_t b = 0; b < n; b += kChunk) tasks.push_back({i, b, std::min(n, b + kChunk)});
  }
  return tasks;
}

template <typename F>
void run_tasks(const std::vector<Task>& tasks, const F& fn) {
  const int64_t n = static_cast<int64_t>(tasks.size());
  const int threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(n)));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t k = 0; k < n; ++k) fn(tasks[k]);
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "spmd_ort_native: ", what); }

void check_lists(const at::TensorList& params, const at::TensorList& grads, const at::TensorList& state,
                 const char* name) {
  check(params.size() == grads.size(), "params and grads differ in length");
  check(state.empty() || state.size() == params.size(), name);
  for (size_t i = 0; i < params.size(); ++i) {
    check(params[i].device().is_cpu() && grads[i].device().is_cpu(), "tensors must be on the CPU");
    check(params[i].is_contiguous() && grads[i].is_contiguous(), "tensors must be contiguous");
    check(params[i].numel() == grads[i].numel(), "param and grad sizes differ");
    const auto pt = params[i].scalar_type();
    check(pt == at::kFloat || pt == at::kBFloat16, "parameters must be float32 or bfloat16");
    const auto gt = grads[i].scalar_type();
    check(gt == at::kFloat || gt == pt, "gradients must be float32 or the parameter's dtype");
    if (!state.empty()) {
      check(state[i].scalar_type() == at::kFloat && state[i].is_contiguous() &&
                state[i].numel() == params[i].numel(),
            "optimizer state must be contiguous float32 of the parameter's size");
    }
  }
}

struct AdamConsts {
  float step_size, beta2, lerp_w, b2c, bc2_sqrt, eps, sign, wd_l2, wd_mul;
  bool small_w, amsgrad;
};

// Branch-free body (loop-invariant choices are folded into constants: sign = -1
// for maximize; AdamW scales p by wd_mul, Adam adds wd_l2 * p to the gradient;
// the unused one is 1 / 0, which changes nothing), so the loop vectorizes.
template <typename P, typename G, bool AMSGRAD>
void adam_range(P* __restrict p, const G* __restrict g, float* __restrict m, float* __restrict v,
                float* __restrict vmax, int64_t n, const AdamConsts& c) {
  const float sign = c.sign, wd_l2 = c.wd_l2, wd_mul = c.wd_mul, beta2 = c.beta2, b2c = c.b2c;
  const float bc2_sqrt = c.bc2_sqrt, eps = c.eps, neg_step = -c.step_size;
  // exp_avg.lerp_(grad, 1 - beta1) from the nearer end: m + w (g - m), or g + (w - 1)(g - m)
  const float coeff = c.small_w ? c.lerp_w : c.lerp_w - 1.0f;
  const bool from_m = c.small_w;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float p0 = static_cast<float>(p[i]);
    const float gi = std::fma(p0, wd_l2, static_cast<float>(g[i]) * sign);
    const float pi = p0 * wd_mul;
    const float mi = std::fma(coeff, gi - m[i], from_m ? m[i] : gi);
    const float vi = std::fma(b2c * gi, gi, v[i] * beta2);
    m[i] = mi;
    v[i] = vi;
    float vd = vi;
    if constexpr (AMSGRAD) {
      vd = std::max(vmax[i], vi);
      vmax[i] = vd;
    }
    const float denom = std::sqrt(vd) / bc2_sqrt + eps;
    p[i] = static_cast<P>(pi + neg_step * mi / denom);
  }
}

template <typename P, typename G>
void adam_task(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
               const at::Tensor* vmax, const Task& t, const AdamConsts& c) {
  P* pp = p.data_ptr<P>() + t.begin;
  const G* gp = g.data_ptr<G>() + t.begin;
  float* mp = m.data_ptr<float>() + t.begin;
  float* vp = v.data_ptr<float>() + t.begin;
  if (vmax) {
    adam_range<P, G, true>(pp, gp, mp, vp, vmax->data_ptr<float>() + t.begin, t.end - t.begin, c);
  } else {
    adam_range<P, G, false>(pp, gp, mp, vp, nullptr, t.end - t.begin, c);
  }
}

void adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
           at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
           double weight_decay, double eps, bool amsgrad, bool maximize, bool decoupled) {
  check_lists(params, grads, exp_avgs, "exp_avgs must match params");
  check_lists(params, grads, exp_avg_sqs, "exp_avg_sqs must match params");
  if (amsgrad) check_lists(params, grads, max_exp_avg_sqs, "max_exp_avg_sqs must match params");
  check(steps.size() == params.size(), "one step tensor per parameter");
  std::vector<AdamConsts> consts(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const double step = steps[i].item<double>();  // the caller has already counted this step
    const double bc1 = 1 - std::pow(beta1, step);
    const double bc2 = 1 - std::pow(beta2, step);
    AdamConsts& c = consts[i];
    c.step_size = static_cast<float>(lr / bc1);
    c.beta2 = static_cast<float>(beta2);
    c.lerp_w = static_cast<float>(1 - beta1);
    c.small_w = std::abs(c.lerp_w) < 0.5f;
    c.b2c = static_cast<float>(1 - beta2);
    c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    c.eps = static_cast<float>(eps);
    c.sign = maximize ? -1.0f : 1.0f;
    c.wd_l2 = decoupled ? 0.0f : static_cast<float>(weight_decay);
    c.wd_mul = decoupled ? static_cast<float>(1 - lr * weight_decay) : 1.0f;
    c.amsgrad = amsgrad;
  }
  run_tasks(split(params), [&](const Task& t) {
    const at::Tensor& p = params[t.tensor];
    const at::Tensor& g = grads[t.tensor];
    const at::Tensor* vm = amsgrad ? &max_exp_avg_sqs[t.tensor] : nullptr;
    const AdamConsts& c = consts[t.tensor];
    const bool bf16 = p.scalar_type() == at::kBFloat16;
    const bool gf32 = g.scalar_type() == at::kFloat;
    if (!bf16) {
      adam_task<float, float>(p, g, exp_avgs[t.tensor], exp_avg_sqs[t.tensor], vm, t, c);
    } else if (gf32) {
      adam_task<c10::BFloat16, float>(p, g, exp_avgs[t.tensor], exp_avg_sqs[t.tensor], vm, t, c);
    } else {
      adam_task<c10::BFloat16, c10::BFloat16>(p, g, exp_avgs[t.tensor], exp_avg_sqs[t.tensor], vm, t, c);
    }
  });
}

struct SgdConsts {
  float lr, momentum, damp1, wd;
  bool nesterov, maximize, first, has_momentum;
};

template <typename P, typename G, bool MOMENTUM, bool FIRST>
void sgd_range(P* __restrict p, const G* __restrict g, float* __restrict buf, int64_t n, const SgdConsts& c) {
  const float sign = c.maximize ? -1.0f : 1.0f, wd = c.wd, momentum = c.momentum, damp1 = c.damp1;
  const float neg_lr = -c.lr, nesterov = c.nesterov ? 1.0f : 0.0f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float pi = static_cast<float>(p[i]);
    float gi = std::fma(pi, wd, static_cast<float>(g[i]) * sign);
    if constexpr (MOMENTUM) {
      // first step: buf = g, never reading buf (a fresh buffer is uninitialised memory, and
      // NaN * 0 is NaN); then buf = momentum * buf + (1 - dampening) * g
      float b;
      if constexpr (FIRST) {
        b = gi;
      } else {
        b = std::fma(buf[i], momentum, gi * damp1);
      }
      buf[i] = b;
      gi = nesterov != 0.0f ? std::fma(b, momentum, gi) : b;
    }
    p[i] = static_cast<P>(std::fma(gi, neg_lr, pi));
  }
}

void sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, double lr, double momentum,
          double dampening, double weight_decay, bool nesterov, bool maximize, bool is_first_step) {
  const bool has_momentum = momentum != 0;
  check_lists(params, grads, has_momentum ? momentum_buffers : at::TensorList(), "momentum_buffers must match params");
  SgdConsts c{static_cast<float>(lr), static_cast<float>(momentum), static_cast<float>(1 - dampening),
              static_cast<float>(weight_decay), nesterov, maximize, is_first_step, has_momentum};
  run_tasks(split(params), [&](const Task& t) {
    const at::Tensor& p = params[t.tensor];
    const at::Tensor& g = grads[t.tensor];
    float* buf = has_momentum ? momentum_buffers[t.tensor].data_ptr<float>() + t.begin : nullptr;
    const int64_t n = t.end - t.begin;
    auto run = [&](auto p_ptr, auto g_ptr) {
      using P = std::remove_pointer_t<decltype(p_ptr)>;
      using G = std::remove_const_t<std::remove_pointer_t<decltype(g_ptr)>>;
      if (!has_momentum) {
        sgd_range<P, G, false, false>(p_ptr, g_ptr, buf, n, c);
      } else if (c.first) {
        sgd_range<P, G, true, true>(p_ptr, g_ptr, buf, n, c);
      } else {
        sgd_range<P, G, true, false>(p_ptr, g_ptr, buf, n, c);
      }
    };
    if (p.scalar_type() == at::kFloat) {
      run(p.data_ptr<float>() + t.begin, g.data_ptr<float>() + t.begin);
    } else if (g.scalar_type() == at::kFloat) {
      run(p.data_ptr<c10::BFloat16>() + t.begin, g.data_ptr<float>() + t.begin);
    } else {
      run(p.data_ptr<c10::BFloat16>() + t.begin, g.data_ptr<c10::BFloat16>() + t.begin);
    }
  });
}

}  // namespace

TORCH_LIBRARY(spmd_ort_native, m) {
  m.def(
      "adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor[] steps, float lr, float beta1, float beta2, float weight_decay, "
      "float eps, bool amsgrad, bool maximize, bool decoupled) -> ()");
  m.def(
      "sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, float lr, float momentum, "
      "float dampening, float weight_decay, bool nesterov, bool maximize, bool is_first_step) -> ()");
}

TORCH_LIBRARY_IMPL(spmd_ort_native, CPU, m) {
  m.impl("adam_", &adam_);
  m.impl("sgd_", &sgd_);
}

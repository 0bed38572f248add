// RMSNorm over the last dimension in one pass per row: y = w * cast(x * rsqrt(mean(x^2) + eps)).
//
// The Llama-family norm (LlamaRMSNorm, Qwen2/3, Mistral, Phi-3, ...) runs as six to eight
// small PyTorch ops in eager mode: widen, square, mean, add, rsqrt, scale, narrow, weight.
// A decode step of the default model calls it 61 times, and on the CPU those ~450 op calls
// cost about a millisecond of a ~20 ms step. Here one call per norm reads each row once for
// its sum of squares (float32) and once to scale it, with the rounding of the original: the
// normalised row is rounded to the input dtype before the weight multiplies it. Which modules
// use it is decided at start-up by comparing it with each module's own forward
// (cpu/routers/norm.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "layer_parts.h"
#include "vec.h"

namespace {

using namespace contbatch_vec;

template <typename T>
void rows_norm(const T* x, const T* w, T* y, int64_t begin, int64_t end, int64_t hidden, float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * hidden;
    T* yr = y + r * hidden;
    float sum = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= hidden; i += 16) {
      const __m512 v = load16(xr + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    sum = _mm512_reduce_add_ps(acc);
#elif defined(CONTBATCH_VEC_AVX2)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= hidden; i += 16) {
      const __m256 v0 = load8(xr + i), v1 = load8(xr + i + 8);
      acc0 = _mm256_fmadd_ps(v0, v0, acc0);
      acc1 = _mm256_fmadd_ps(v1, v1, acc1);
    }
    for (; i + 8 <= hidden; i += 8) {
      const __m256 v = load8(xr + i);
      acc0 = _mm256_fmadd_ps(v, v, acc0);
    }
    sum = hsum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < hidden; ++i) {
      const float v = widen(xr[i]);
      sum += v * v;
    }
    const float scale = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    int64_t j = 0;
#if defined(__AVX512F__)
    // bfloat16 rows were converted to scalars one value at a time: a prefill step's norms took
    // ~2 ms each (7% of a bfloat16 step); sixteen at a time, with the same two roundings.
    const __m512 s = _mm512_set1_ps(scale);
    for (; j + 16 <= hidden; j += 16) {
      const __m512 normed = rounded(yr, _mm512_mul_ps(load16(xr + j), s));  // rounded to the input dtype first
      store16(yr + j, _mm512_mul_ps(load16(w + j), normed));
    }
#elif defined(CONTBATCH_VEC_AVX2)
    const __m256 s = _mm256_set1_ps(scale);
    for (; j + 8 <= hidden; j += 8) {
      const __m256 normed = rounded8(yr, _mm256_mul_ps(load8(xr + j), s));  // rounded to the input dtype first
      store8(yr + j, _mm256_mul_ps(load8(w + j), normed));
    }
#endif
    for (; j < hidden; ++j) {
      const T normed = static_cast<T>(widen(xr[j]) * scale);  // rounded to the input dtype first
      yr[j] = static_cast<T>(widen(w[j]) * widen(normed));
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: x [..., H] and weight [H], both contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  at::Tensor y = at::empty_like(x);
  const int64_t hidden = x.size(-1), rows = hidden ? x.numel() / hidden : 0;
  // Rows of a few KB each: one task per 16 rows, a lone decode row runs inline.
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) { rows_norm<T>(xp, wp, yp, b, e, hidden, static_cast<float>(eps)); });
  };
  float_or_bf16(x.scalar_type(), "rms_norm", run);
  return y;
}

}  // namespace

namespace contbatch_parts {

void rms_norm_rows(const float* x, const float* weight, float* y, int64_t rows, int64_t hidden, double eps) {
  rows_norm<float>(x, weight, y, 0, rows, hidden, static_cast<float>(eps));
}

}  // namespace contbatch_parts

TORCH_LIBRARY_FRAGMENT(contbatch_cpu, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(contbatch_cpu, CPU, m) { m.impl("rms_norm", rms_norm); }

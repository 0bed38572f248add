// Rotary position embedding of a step's queries and keys in one call:
// out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]).
//
// transformers' `apply_rotary_pos_emb` is fourteen small ops a layer (two slices, a negation,
// a concatenation, two products and a sum, for q and for k; docs/cpu.md says what they cost).
// Here each row of q and k is read once, with the original's rounding: each product rounded to
// the dtype, then their sum (no fused multiply-add: native.py builds with -ffp-contract=off),
// so float32 and bfloat16 results equal the original's bit for bit (NaN payloads aside). Which
// models use it is decided at start-up by comparing it with the model's own function
// (cpu/routers/rotary.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "layer_parts.h"
#include "vec.h"

namespace {

using namespace contbatch_vec;

#if defined(__AVX512F__)
inline __m512 negated(__m512 v) {  // flips the sign bit, zeros included, as PyTorch's neg does
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x80000000)));
}
#endif

// One row of D values: out[i] = round(round(x[i] * cos[i]) + round(r[i] * sin[i])), r the row
// rotated by half with the first half negated.
template <typename T>
void rotate_row(const T* x, const T* c, const T* s, T* out, int64_t D) {
  const int64_t half = D / 2;
  int64_t i = 0;
#if defined(__AVX512F__)
  if (half % 16 == 0) {
    T* tag = nullptr;
    for (; i < half; i += 16) {
      const __m512 lo = load16(x + i), hi = load16(x + i + half);
      const __m512 a0 = rounded(tag, _mm512_mul_ps(lo, load16(c + i)));
      const __m512 b0 = rounded(tag, _mm512_mul_ps(negated(hi), load16(s + i)));
      store16(out + i, _mm512_add_ps(a0, b0));
      const __m512 a1 = rounded(tag, _mm512_mul_ps(hi, load16(c + i + half)));
      const __m512 b1 = rounded(tag, _mm512_mul_ps(lo, load16(s + i + half)));
      store16(out + i + half, _mm512_add_ps(a1, b1));
    }
    return;
  }
#endif
  for (; i < half; ++i) {
    const T a = static_cast<T>(widen(x[i]) * widen(c[i]));
    const T b = static_cast<T>(-widen(x[i + half]) * widen(s[i]));
    out[i] = static_cast<T>(widen(a) + widen(b));
  }
  for (i = half; i < D; ++i) {
    const T a = static_cast<T>(widen(x[i]) * widen(c[i]));
    const T b = static_cast<T>(widen(x[i - half]) * widen(s[i]));
    out[i] = static_cast<T>(widen(a) + widen(b));
  }
}

// x, out: [B, H, T, D] (any strides, D contiguous); cos, sin: [B, T, D] (D contiguous).
template <typename T>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t H = x.size(1), S = x.size(2), D = x.size(3);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xb = x.stride(0), xh = x.stride(1), xt = x.stride(2);
  const int64_t ob = out.stride(0), oh = out.stride(1), ot = out.stride(2);
  const int64_t cb = cos.stride(0), ct = cos.stride(1), sb = sin.stride(0), st = sin.stride(1);
  at::parallel_for(0, x.size(0) * H * S, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (H * S), h = (row / S) % H, t = row % S;
      rotate_row<T>(xp + b * xb + h * xh + t * xt, cp + b * cb + t * ct, sp + b * sb + t * st,
                    op + b * ob + h * oh + t * ot, D);
    }
  });
}

at::Tensor rotate_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 3 && sin.dim() == 3, "rotary: x [B, H, T, D], cos/sin [B, T, D]");
  TORCH_CHECK(x.size(-1) % 2 == 0 && cos.size(-1) == x.size(-1) && sin.sizes() == cos.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(2),
              "rotary: cos/sin must be [B, T, D] for x [B, H, T, D], D even");
  TORCH_CHECK(x.stride(3) == 1 && cos.stride(2) == 1 && sin.stride(2) == 1, "rotary: the last dim must be contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: x, cos and sin must share a dtype");
  at::Tensor out = at::empty_like(x);  // the input's layout, as the original's elementwise ops keep it
  float_or_bf16(x.scalar_type(), "rotary", [&](auto tag) { rotate<decltype(tag)>(x, cos, sin, out); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  return {rotate_one(q, cos, sin), rotate_one(k, cos, sin)};
}

}  // namespace

namespace contbatch_parts {

void rotate_row(const float* x, const float* cos, const float* sin, float* out, int64_t dim) {
  ::rotate_row<float>(x, cos, sin, out, dim);
}

}  // namespace contbatch_parts

TORCH_LIBRARY_FRAGMENT(contbatch_cpu, m) { m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(contbatch_cpu, CPU, m) { m.impl("rotary", rotary); }

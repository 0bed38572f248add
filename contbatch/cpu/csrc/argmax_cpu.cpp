// Greedy sampling's argmax over the vocabulary, one row per task, sixteen logits at a time.
//
// aten's argmax over the last dim of a decode step's logits is slow on the CPU (docs/cpu.md
// has the figures); this reads each row once at memory speed. Same answer as aten: the first
// index of the largest value, and the first NaN's index where a row holds one (NaN wins an
// argmax; the sampler then finds the row broken from that one logit).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "vec.h"

namespace {

using namespace contbatch_vec;

template <typename T>
int64_t first_nan(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(widen(x[i]))) return i;
  }
  return -1;
}

template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_i = 0, i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    // Per lane: the largest value so far and its first index (strictly greater replaces).
    __m512 best_v = load16(x);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i best_idx = index;
    __mmask16 nan = _mm512_cmp_ps_mask(best_v, best_v, _CMP_UNORD_Q);
    const __m512i step = _mm512_set1_epi32(16);
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 v = load16(x + i);
      index = _mm512_add_epi32(index, step);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, best_v, _CMP_GT_OQ);
      best_v = _mm512_mask_mov_ps(best_v, greater, v);
      best_idx = _mm512_mask_mov_epi32(best_idx, greater, index);
    }
    if (nan) return first_nan(x, n);
    best = _mm512_reduce_max_ps(best_v);
    const __mmask16 at_best = _mm512_cmp_ps_mask(best_v, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_i = _mm512_reduce_min_epi32(_mm512_mask_mov_epi32(_mm512_set1_epi32(std::numeric_limits<int32_t>::max()),
                                                           at_best, best_idx));
  }
#endif
  for (; i < n; ++i) {
    const float v = widen(x[i]);
    if (std::isnan(v)) return first_nan(x, n);
    if (v > best) {
      best = v;
      best_i = i;
    }
  }
  return best_i;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "argmax_rows: logits [rows, vocab] with a contiguous last dim");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) <= std::numeric_limits<int32_t>::max(),
              "argmax_rows: vocab size out of range");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = logits.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) op[r] = row_argmax<T>(xp + r * stride, vocab);
    });
  };
  float_or_bf16(logits.scalar_type(), "argmax_rows", run);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(contbatch_cpu, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(contbatch_cpu, CPU, m) { m.impl("argmax_rows", argmax_rows); }

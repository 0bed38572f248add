// The register tiles of the panel layout (panel_linear_cpu.cpp, and quant_linear_cpu.cpp's
// batches of packed weights, which dequantize a panel at a time into it): a weight's kPanel
// output features as [in, kPanel], input feature k's kPanel weights one contiguous run. A tile
// keeps up to kTileRows rows x kPanel outputs in registers and adds one input feature after the
// other, a broadcast of x times a column: every output is the same chain of fused multiply-adds
// over k in order, whatever tile, thread or batch its row falls in.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <utility>

#include "vec.h"

namespace contbatch_panel {

constexpr int64_t kPanel = 32;  // output features a panel holds: two AVX-512 vectors
constexpr int64_t kPanelMaxRows = 256;  // rows panel_linear computes on its panels; more take aten's GEMM
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 14;  // 28 accumulators of the 32 registers, two for the column
#else
constexpr int64_t kTileRows = 6;  // AVX2: 12 accumulators of the 16 registers (half a panel)
#endif

// The next panel's lines a tile asks for (into L2) while it computes, so the next panel arrives
// while this one is computed on: `lines` from `from`, `per_step` (one or two) at each of the
// tile's first input features.
struct Ahead {
  const char* from;
  int64_t lines, per_step;
};

// add(i) for every input feature i in order, the first ones each asking for their share of
// `ahead` (a prefetch past the packed weight's end, at most one line, fetches nothing and
// does not fault). Two loops rather than a test at every feature: the tiles of many rows are
// compute-bound, and that test took a share of their time (docs/cpu.md).
template <typename Add>
inline void columns(int64_t in, const Ahead& ahead, Add&& add) {
  const int64_t asking = ahead.per_step ? std::min(in, (ahead.lines + ahead.per_step - 1) / ahead.per_step) : 0;
  int64_t i = 0;
  for (; i < asking; ++i) {
    const char* line = ahead.from + i * ahead.per_step * 64;
    __builtin_prefetch(line, 0, 2);  // prefetcht1
    __builtin_prefetch(line + (ahead.per_step - 1) * 64, 0, 2);
    add(i);
  }
  for (; i < in; ++i) add(i);
}

// One tile: R rows of x ([R, in], row stride ldx) against a panel, into R x `cols` outputs of
// y (row stride ldy), `bias` (the panel's, or null) added to the sums.
#if defined(__AVX512F__)
template <int R>
void tile(const float* x, int64_t ldx, const float* panel, int64_t in, const float* bias, float* y, int64_t ldy,
          int64_t cols, const Ahead& ahead) {
  __m512 a[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  columns(in, ahead, [&](int64_t i) __attribute__((always_inline)) {
    const __m512 w0 = _mm512_loadu_ps(panel + i * kPanel), w1 = _mm512_loadu_ps(panel + i * kPanel + 16);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * ldx + i]);
      a[r][0] = _mm512_fmadd_ps(w0, b, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(w1, b, a[r][1]);
    }
  });
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : (1u << cols) - 1;
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols > 16 ? (1u << (cols - 16)) - 1 : 0;
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, bias ? _mm512_add_ps(a[r][0], b0) : a[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, bias ? _mm512_add_ps(a[r][1], b1) : a[r][1]);
  }
}
#elif defined(CONTBATCH_VEC_AVX2)
// The same on AVX2, a panel as two halves of 16 outputs (two vectors of 8 each), one after
// the other over every input feature.
template <int R>
inline void half_tile(const float* x, int64_t ldx, const float* panel, int64_t in, const float* bias, float* y,
                      int64_t ldy, int64_t cols, const Ahead& ahead) {
  __m256 a[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  columns(in, ahead, [&](int64_t i) __attribute__((always_inline)) {
    const __m256 w0 = _mm256_loadu_ps(panel + i * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + i * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + i);
      a[r][0] = _mm256_fmadd_ps(w0, b, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(w1, b, a[r][1]);
    }
  });
  alignas(32) float out[16];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(out, a[r][0]);
    _mm256_store_ps(out + 8, a[r][1]);
    for (int64_t o = 0; o < cols; ++o) y[r * ldy + o] = bias ? out[o] + bias[o] : out[o];
  }
}

template <int R>
void tile(const float* x, int64_t ldx, const float* panel, int64_t in, const float* bias, float* y, int64_t ldy,
          int64_t cols, const Ahead& ahead) {
  half_tile<R>(x, ldx, panel, in, bias, y, ldy, std::min<int64_t>(16, cols), ahead);
  if (cols > 16)
    half_tile<R>(x, ldx, panel + 16, in, bias ? bias + 16 : nullptr, y + 16, ldy, cols - 16, Ahead{nullptr, 0, 0});
}
#else
// Without AVX2: the same sums in a plain loop (one rounding for the product, one for the add).
template <int R>
void tile(const float* x, int64_t ldx, const float* panel, int64_t in, const float* bias, float* y, int64_t ldy,
          int64_t cols, const Ahead&) {
  for (int r = 0; r < R; ++r)
    for (int64_t o = 0; o < cols; ++o) {
      float sum = 0.f;
      for (int64_t i = 0; i < in; ++i) sum += panel[i * kPanel + o] * x[r * ldx + i];
      y[r * ldy + o] = bias ? sum + bias[o] : sum;
    }
}
#endif

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                        const Ahead&);

template <int... R>
constexpr auto tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{tile<R + 1>...};
}

inline const auto kTiles = tiles(std::make_integer_sequence<int, kTileRows>{});

}  // namespace contbatch_panel

// A packed weight (the row layout) dequantized into float32 (included by quant_linear_cpu.cpp
// only): rows of it (store_rows: quant_dequantize, quant_rows), and, against a batch of rows, a
// panel at a time: kPanel output features are dequantized into the calling thread's buffer in
// panel_tile.h's layout ([in, kPanel], the exact code x scale (+ min) values that store_block
// makes), and every block of rows then runs the float32 panel tiles against it.
//
// Why: the register kernels of quant_bands.h rebuild a weight once per chunk of seven rows and
// load an x value for every product; with tens of rows that arithmetic, not the weight read,
// bounded a step. Here a weight is rebuilt once for all the rows and each product costs a
// fused multiply-add on a broadcast x, as the float32 `panel` kernel's; the weight read stays
// the packed bytes (the next panel's codes are asked for while this one's rows run). An
// output is the chain of fused multiply-adds over the inputs in order on the dequantized
// values: F.linear on the dequantized weight up to the summation order, and the same whatever
// rows share the call.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "panel_tile.h"
#include "quant_bands.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace contbatch_quant {

using contbatch_panel::kPanel;
using contbatch_panel::kTileRows;

// Block b of row o's 32 dequantized weights stored at out[0..31]: the vector kernels' values
// (the same product and sum, one rounding each).
inline void store_block(const Packed& p, int64_t o, int64_t b, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 lo, hi;
  block_vec(p, o, b, lo, hi);
  _mm512_storeu_ps(out, lo);
  _mm512_storeu_ps(out + 16, hi);
#elif defined(CONTBATCH_VEC_AVX2)
  __m256 v[4];
  block_vec(p, o, b, v);
  for (int k = 0; k < 4; ++k) _mm256_storeu_ps(out + 8 * k, v[k]);
#else
  block_scalar(p, o, b, out);
#endif
}

// Rows [begin, end) dequantized into w (float32 [end - begin, in]).
inline void store_rows(const Packed& packed, int64_t begin, int64_t end, float* w) {
  in_pieces(packed, begin, end, [&](const Packed& p, int64_t b0, int64_t b1) {
    for (int64_t o = b0; o < b1; ++o)
      for (int64_t b = 0; b < p.in / kBlock; ++b) store_block(p, o, b, w + (o - begin) * p.in + b * kBlock);
  });
}

// dst[k * kPanel + j] = src[j * kBlock + k] for the kBlock x kBlock block src (output j's 32
// inputs in row j) into a panel's kBlock columns.
inline void transpose_block(const float* src, float* dst) {
#if defined(__AVX2__)
  for (int jb = 0; jb < kBlock; jb += 8)
    for (int kb = 0; kb < kBlock; kb += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src + (jb + j) * kBlock + kb);
      __m256 t[8], s[8];
      for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
      }
      for (int h = 0; h < 8; h += 4) {
        s[h] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
        s[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
        s[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
        s[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
      }
      for (int k = 0; k < 4; ++k) {
        _mm256_storeu_ps(dst + (kb + k) * kPanel + jb, _mm256_permute2f128_ps(s[k], s[k + 4], 0x20));
        _mm256_storeu_ps(dst + (kb + k + 4) * kPanel + jb, _mm256_permute2f128_ps(s[k], s[k + 4], 0x31));
      }
    }
#else
  for (int j = 0; j < kBlock; ++j)
    for (int k = 0; k < kBlock; ++k) dst[k * kPanel + j] = src[j * kBlock + k];
#endif
}

// Output features [o0, o0 + cols) of p (cols <= kPanel; p's fields widened for them) as a panel
// [in, kPanel], the missing outputs zero.
inline void dequantize_panel(const Packed& p, int64_t o0, int64_t cols, float* panel) {
  static_assert(kPanel == kBlock, "a panel's block of codes is square");
  alignas(64) float block[kPanel * kBlock];
  std::fill(block + cols * kBlock, block + kPanel * kBlock, 0.f);
  for (int64_t b = 0; b < p.in / kBlock; ++b) {
    for (int64_t j = 0; j < cols; ++j) store_block(p, o0 + j, b, block + j * kBlock);
    transpose_block(block, panel + b * kBlock * kPanel);
  }
}

// Output features [begin, end) of p against `rows` rows of float32 x ([rows, in]) into y (row
// stride ldy; bias, if any, indexed by output feature).
inline void panel_band(const Packed& packed, const float* x, int64_t rows, const float* bias, float* y, int64_t ldy,
                       int64_t begin, int64_t end) {
  static thread_local std::vector<float> buffer;
  const int64_t in = packed.in;
  if (static_cast<int64_t>(buffer.size()) < in * kPanel) buffer.resize(in * kPanel);
  float* panel = buffer.data();
  const int64_t blocks = (rows + kTileRows - 1) / kTileRows, base = rows / blocks, extra = rows % blocks;
  in_pieces(packed, begin, end, [&](const Packed& p, int64_t b0, int64_t b1) {
    for (int64_t o = b0; o < b1; o += kPanel) {
      const int64_t cols = std::min(kPanel, b1 - o), next = std::min(kPanel, b1 - o - cols);
      dequantize_panel(p, o, cols, panel);
      // The next panel's codes, a share for each block of rows, asked for while they run.
      const int64_t lines = next * p.row_bytes() / 64, share = (lines + blocks - 1) / blocks;
      const char* ahead = reinterpret_cast<const char*>(p.codes + (o + cols) * p.row_bytes());
      for (int64_t j = 0; j < blocks; ++j) {
        const int64_t r0 = j * base + std::min(j, extra), count = base + (j < extra);
        const int64_t ask = std::max<int64_t>(0, std::min(share, lines - j * share));
        contbatch_panel::kTiles[count - 1](x + r0 * in, in, panel, in, bias ? bias + o : nullptr, y + r0 * ldy + o,
                                           ldy, cols, {ahead + j * share * 64, ask, (ask + in - 1) / in});
      }
    }
  });
}

}  // namespace contbatch_quant

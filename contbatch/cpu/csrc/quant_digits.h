// x's rows written as integer digits for the tiled integer kernels of quant_tiles.h (included
// there only; AVX-512 with VNNI).
//
// float32 x is written per block of 32 inputs as integers X = x / d exactly where x has at most
// 22 significant bits below the block's largest magnitude (d a power of two, 2^-22 of the
// block's largest power of two), else rounded to the nearest: an error of at most 2^-23 of the
// block's largest value per input, below what float32 accumulation of the same products rounds
// away in any order. X is split into three signed bytes (X = 2^16 x2 + 2^8 x1 + x0), each
// product code x digit is exact in int32, and a block's value 2^16 D2 + 2^8 D1 + D0 is formed
// with two roundings (int8), or exactly in int32 and rounded once (int4: codes below 16 keep
// it under 2^31); then times d and the group's scale, accumulated in float32 (int4 adds the
// group's min times the block's sum of X d, except a symmetric weight, min = -8 x scale as in
// Q4_0, whose integer sums start at -8 x the digit sums: products of (code - 8) and X, no min
// product). VNNI multiplies unsigned by signed bytes: int8 codes are read with their sign bit
// flipped (code + 128) and 128 x (the block's digit sum) taken off, exactly; int4 codes are
// unsigned already.
//
// bfloat16 x (8 significant bits) takes two digits, d 2^-14 of the block's largest power of
// two: exact for every input within 2^-7 of the block's largest, the others within 2^-15 of it,
// and 2^8 D1 + D0 formed with one rounding. A third of the dot products fewer; the output is
// rounded to bfloat16 (2^-9 of it) after. Float32 models never take this path: their
// massive activations make a block's smaller inputs lose bits that float32 keeps (measured in
// docs/cpu.md).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "quant_bands.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define CONTBATCH_QUANT_TILES 1
#endif

namespace contbatch_quant {

#if defined(CONTBATCH_QUANT_TILES)

// x's rows as digits (three, or two for bfloat16 x): d[k][r * in + i] the k-th byte of input i
// of row r; per row and block, `corr[k]` = 128 x the block's sum of digit k, `step` = d and
// `sum` = the block's sum of X d (float).
struct XDigits {
  int64_t rows = 0, in = 0, blocks = 0;
  int digits = 3;  // 3: X below 2^22 (float32 x); 2: below 2^14 (bfloat16 x)
  std::vector<int8_t> d[3];
  std::vector<int32_t> corr[3];
  std::vector<float> step, sum;
};

// Lane j of the result: op over the 16 lanes of v[j] (a transposing tree: 15 pairs of
// permutes and one op each, instead of a horizontal reduction per vector).
template <typename Op>
inline __m512i reduce16(__m512i (&v)[16], Op op) {
  const __m512i lo1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i lo2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i lo3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i lo4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i los[4] = {lo1, lo2, lo3, lo4};
  const int shift[4] = {8, 4, 2, 1};  // hi = lo + shift
  int n = 16;
  for (int level = 0; level < 4; ++level, n /= 2) {
    const __m512i hi = _mm512_add_epi32(los[level], _mm512_set1_epi32(shift[level]));
    for (int j = 0; j < n / 2; ++j)
      v[j] = op(_mm512_permutex2var_epi32(v[2 * j], los[level], v[2 * j + 1]),
                _mm512_permutex2var_epi32(v[2 * j], hi, v[2 * j + 1]));
  }
  return v[0];
}

// One row's digits, sixteen blocks at a time: the blocks' largest magnitudes, steps and digit
// sums are reduced and worked out in vector lanes (one lane a block). x is float32 or bfloat16
// (vec.h's load16 widens it exactly).
template <int D, typename T>
void digits_of_row(const T* x, int64_t in, int8_t* d0, int8_t* d1, int8_t* d2, int32_t* c0, int32_t* c1,
                   int32_t* c2, float* step, float* sum) {
  constexpr int bits = 8 * D - 2;  // |X| < 2^bits: the top digit stays within a signed byte
  const __m512i half = _mm512_set1_epi32(128), magnitude = _mm512_set1_epi32(0x7fffffff);
  const auto max_u32 = [](__m512i a, __m512i b) { return _mm512_max_epu32(a, b); };
  const auto add = [](__m512i a, __m512i b) { return _mm512_add_epi32(a, b); };
  const int64_t blocks = in / 32;
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int nb = static_cast<int>(std::min<int64_t>(16, blocks - b0));
    const __mmask16 lanes = static_cast<__mmask16>((1u << nb) - 1);
    // Largest magnitude per block as float32 bits (they order as unsigned integers, and NaN's
    // lie above infinity's, so a NaN input makes its block non-finite as an infinite one does).
    __m512i top_v[16];
    for (int j = 0; j < 16; ++j) {
      if (j >= nb) { top_v[j] = _mm512_setzero_si512(); continue; }
      const T* xb = x + 32 * (b0 + j);
      top_v[j] = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(load16(xb)), magnitude),
                                  _mm512_and_si512(_mm512_castps_si512(load16(xb + 16)), magnitude));
    }
    const __m512i top = reduce16(top_v, max_u32);
    const __m512i field = _mm512_srli_epi32(top, 23);
    const __mmask16 finite = _mm512_cmpneq_epi32_mask(field, _mm512_set1_epi32(255));
    // frexp's exponent (top < 2^e) from the bits: field - 126 for normal tops; at least -100
    // (zero and subnormal tops: frexp's 0 for zero kept)
    __m512i e = _mm512_max_epi32(_mm512_sub_epi32(field, _mm512_set1_epi32(126)), _mm512_set1_epi32(-100));
    e = _mm512_mask_mov_epi32(e, _mm512_cmpeq_epi32_mask(top, _mm512_setzero_si512()), _mm512_setzero_si512());
    // d = 2^(e - bits), 1 / d = 2^(bits - e), both normal floats; a non-finite block: d NaN and
    // 1 / d 0, so its outputs are NaN as F.linear's would be
    const __m512 d = _mm512_mask_mov_ps(_mm512_set1_ps(NAN), finite,
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127 - bits)), 23)));
    const __m512 inv = _mm512_maskz_mov_ps(finite,
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(127 + bits), e), 23)));
    alignas(64) float inv_of[16];
    _mm512_store_ps(inv_of, inv);
    // Balanced digits by carries: digit 0 is X's low byte read as a signed byte, and the rest
    // are Y = (X + 128) >> 8's the same way (X = d0 + 2^8 Y exactly), the top one whole. Per
    // block, the sums of X, Y (and Z = (Y + 128) >> 8) give the digit sums.
    __m512i sx_v[16], sy_v[16], sz_v[16];
    for (int j = 0; j < 16; ++j) {
      sx_v[j] = sy_v[j] = sz_v[j] = _mm512_setzero_si512();
      if (j >= nb) continue;
      const int64_t b = b0 + j;
      const __m512 scale = _mm512_set1_ps(inv_of[j]);
      for (int h = 0; h < 2; ++h) {
        const int64_t at = 32 * b + 16 * h;
        const __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + at), scale));  // |X| < 2^bits, nearest
        const __m512i Y = _mm512_srai_epi32(_mm512_add_epi32(X, half), 8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d0 + at), _mm512_cvtepi32_epi8(X));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d1 + at), _mm512_cvtepi32_epi8(Y));
        sx_v[j] = _mm512_add_epi32(sx_v[j], X);
        sy_v[j] = _mm512_add_epi32(sy_v[j], Y);
        if constexpr (D == 3) {
          const __m512i Z = _mm512_srai_epi32(_mm512_add_epi32(Y, half), 8);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(d2 + at), _mm512_cvtepi32_epi8(Z));
          sz_v[j] = _mm512_add_epi32(sz_v[j], Z);
        }
      }
    }
    const __m512i sx = reduce16(sx_v, add), sy = reduce16(sy_v, add);  // |X sum| < 2^27
    const __m512i s2 = D == 3 ? reduce16(sz_v, add) : _mm512_setzero_si512();
    const __m512i s1 = _mm512_sub_epi32(sy, _mm512_slli_epi32(s2, 8));
    const __m512i s0 = _mm512_sub_epi32(sx, _mm512_slli_epi32(sy, 8));
    _mm512_mask_storeu_epi32(c0 + b0, lanes, _mm512_slli_epi32(s0, 7));
    _mm512_mask_storeu_epi32(c1 + b0, lanes, _mm512_slli_epi32(D == 3 ? s1 : sy, 7));
    _mm512_mask_storeu_epi32(c2 + b0, lanes, _mm512_slli_epi32(s2, 7));
    _mm512_mask_storeu_ps(step + b0, lanes, d);
    _mm512_mask_storeu_ps(sum + b0, lanes, _mm512_mul_ps(_mm512_cvtepi32_ps(sx), d));  // the block's sum of X d
  }
}

// x [rows, in] (float32 or bfloat16) as xd's digits
template <typename T>
void make_digits(const T* x, int64_t rows, int64_t in, int digits, XDigits& xd) {
  xd.digits = digits;
  xd.rows = rows;
  xd.in = in;
  xd.blocks = in / 32;
  for (int k = 0; k < 3; ++k) {
    xd.d[k].resize(rows * in);
    xd.corr[k].resize(rows * xd.blocks);
  }
  xd.step.resize(rows * xd.blocks);
  xd.sum.resize(rows * xd.blocks);
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r * in, c = r * xd.blocks;
      auto row = digits == 3 ? digits_of_row<3, T> : digits_of_row<2, T>;
      row(x + o, in, xd.d[0].data() + o, xd.d[1].data() + o, xd.d[2].data() + o, xd.corr[0].data() + c,
          xd.corr[1].data() + c, xd.corr[2].data() + c, xd.step.data() + c, xd.sum.data() + c);
    }
  });
}

#endif

}  // namespace contbatch_quant

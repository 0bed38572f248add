// The tiled layout of quant_linear_cpu.cpp (included there only), for CPUs with AVX-512 VNNI:
// integer dot products of the codes with x written exactly as integers.
//
// Layout (cpu/quant/format.py's `tile` writes it): the output features in tiles of 16; its
// scales (and int4 mins) are [groups][16] fp16. An int8 tile's codes are I / 4 vectors of 64
// bytes, vector v holding inputs 4v..4v+3 of each of the tile's 16 outputs (byte 4j + k:
// output j, input 4v + k); an int4 tile's are I / 8 vectors, byte 4j + k of vector v holding
// input 8v + k of output j in its low nibble and input 8v + 4 + k in its high one. A vector
// (or its low or high nibbles) is then one VNNI operand whose 16 lanes are the 16 outputs, so
// a block's dot products accumulate in integer lanes with no horizontal sums.
//
// x enters the integer products as exact integer digits (quant_digits.h says how, and why that
// keeps float32's precision).
//
// Against the float path's weight rebuilt as code x scale: the same products up to the digits'
// roundings, about as far from F.linear on the dequantized weight as another summation order.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "quant_bands.h"
#include "quant_digits.h"

namespace contbatch_quant {

constexpr int64_t kTile = 16;      // output features a tile
constexpr int64_t kTiledFlag = 256;  // `bits | kTiledFlag`: the op's format word of a tiled weight
// `| kSymmetricFlag`: a tiled int4 weight whose every min is -8 x its scale (Q4_0)
constexpr int64_t kSymmetricFlag = 512;

#if defined(CONTBATCH_QUANT_TILES)

// One block (32 inputs) of O tiles against R rows of D digits: a[o][r][k] += codes . digit k.
// Each broadcast quad of digits serves the O tiles' code vectors before the next is loaded.
// WIDE: int4 tiles unpacked to a byte a code (unpack_tile), read as int8 tiles with no flip.
template <int BITS, int R, int O, int D, bool WIDE = false>
inline void block_dots(const uint8_t* const (&tile)[O], const XDigits& xd, int64_t r0, int64_t b,
                       __m512i (&a)[O][R][3], Ahead ahead) {
  const int64_t in = xd.in;
  const int8_t* digits[3] = {xd.d[0].data() + r0 * in, xd.d[1].data() + r0 * in, xd.d[2].data() + r0 * in};
  auto dots = [&](int64_t i, const __m512i (&w)[O]) {  // inputs i..i+3 of each row's digits against w
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
      for (int k = 0; k < D; ++k) {
        int32_t four;
        std::memcpy(&four, digits[k] + r * in + i, 4);
        const __m512i quad = _mm512_set1_epi32(four);
#pragma GCC unroll 4
        for (int o = 0; o < O; ++o) a[o][r][k] = _mm512_dpbusd_epi32(a[o][r][k], w[o], quad);
      }
  };
  if constexpr (R <= 2 && !WIDE) {  // one or two rows stream the codes: ask for each tile's block `ahead` on
    constexpr int64_t kLines = BITS == 8 ? 8 : 4;  // a block's 64-byte lines of one tile's codes
    if (ahead.bytes) {
#pragma GCC unroll 4
      for (int o = 0; o < O; ++o)
#pragma GCC unroll 8
        for (int64_t q = 0; q < kLines; ++q) prefetch_line(tile[o] + (b * kLines + q) * 64 + ahead.bytes, ahead.l2);
    }
  }
  __m512i w[O];
  if constexpr (BITS == 8 || WIDE) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      const int64_t v = b * 8 + q;
#pragma GCC unroll 4
      for (int o = 0; o < O; ++o) {
        w[o] = _mm512_loadu_si512(tile[o] + v * 64);
        if constexpr (BITS == 8) w[o] = _mm512_xor_si512(w[o], flip);  // unpacked int4 codes are unsigned
      }
      dots(4 * v, w);
    }
  } else {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const int64_t v = b * 4 + q;
#pragma GCC unroll 4
      for (int o = 0; o < O; ++o) w[o] = _mm512_and_si512(_mm512_loadu_si512(tile[o] + v * 64), nibble);
      dots(8 * v, w);
#pragma GCC unroll 4
      for (int o = 0; o < O; ++o)
        w[o] = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(tile[o] + v * 64), 4), nibble);
      dots(8 * v + 4, w);
    }
  }
}

// An int4 tile's codes (`bytes` of them, two a byte) as one byte a code in the int8 tiles'
// layout: vector u's low nibbles (inputs 8u..8u+3) become vector 2u, its high ones vector 2u + 1.
inline void unpack_tile(const uint8_t* codes, int64_t bytes, uint8_t* out) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t u = 0; u < bytes / 64; ++u) {
    const __m512i v = _mm512_loadu_si512(codes + u * 64);
    _mm512_storeu_si512(out + 2 * u * 64, _mm512_and_si512(v, nibble));
    _mm512_storeu_si512(out + (2 * u + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
  }
}

inline __m512 load_fields(const at::Half* fields) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(fields)));
}

// O tiles, t + q * stride for q < O, of a tiled weight against rows [r0, r0 + R) of x's
// digits; outputs into y (row r at y + r * out_stride). The O tiles are O streams of codes
// read from different stretches of the band at once, which the memory keeps busier than one.
template <int BITS, int R, int O, int D, bool WIDE = false, bool SYM = false>
void tiled_rows(const Packed& p, const XDigits& xd, int64_t r0, const float* bias, float* y, int64_t out_stride,
                int64_t t, int64_t stride, const uint8_t* wide = nullptr) {
  constexpr bool kMins = BITS == 4 && !SYM;  // a symmetric weight's min is in its integer sums
  const int64_t groups = p.groups(), per_group = p.group / 32, tile_bytes = kTile * p.row_bytes();
  const Ahead ahead = stream_ahead(kPackedStreams);  // vec.h
  const uint8_t* tile[O];
  __m512 acc[O][R];
#pragma GCC unroll 4
  for (int o = 0; o < O; ++o) {
    tile[o] = WIDE ? wide + o * 2 * tile_bytes : p.codes + (t + o * stride) * tile_bytes;
    for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512 scale[O], min[O];
#pragma GCC unroll 4
    for (int o = 0; o < O; ++o) {
      scale[o] = load_fields(p.scales + ((t + o * stride) * groups + g) * kTile);
      if constexpr (kMins) min[o] = load_fields(p.mins + ((t + o * stride) * groups + g) * kTile);
    }
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      // int8: the sums start at minus the flipped codes' excess, 128 x each digit's sum;
      // symmetric int4: at -8 x each digit's sum (the sums are then of (code - 8) x digit); int4: 0
      __m512i a[O][R][3];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t c = (r0 + r) * xd.blocks + b;
#pragma GCC unroll 3
        for (int k = 0; k < D; ++k) {
          const __m512i start = BITS == 8 ? _mm512_set1_epi32(-xd.corr[k][c])
                                : SYM   ? _mm512_set1_epi32(-(xd.corr[k][c] >> 4))
                                        : _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int o = 0; o < O; ++o) a[o][r][k] = start;
        }
      }
      block_dots<BITS, R, O, D, WIDE>(tile, xd, r0, b, a, ahead);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t c = (r0 + r) * xd.blocks + b;
        const __m512 step = _mm512_set1_ps(xd.step[c]);
#pragma GCC unroll 4
        for (int o = 0; o < O; ++o) {
          __m512 block;
          if constexpr (D == 3 && BITS == 4) {  // int4 codes (0..15, or -8..7): |2^16 D2 + 2^8 D1 + D0| < 2^31
            const __m512i hi = _mm512_add_epi32(_mm512_slli_epi32(a[o][r][2], 16), _mm512_slli_epi32(a[o][r][1], 8));
            block = _mm512_cvtepi32_ps(_mm512_add_epi32(hi, a[o][r][0]));  // exact in int32, one rounding
          } else if constexpr (D == 3) {  // |2^8 D2 + D1| < 2^27: exact in int32; two roundings
            const __m512i hi = _mm512_add_epi32(_mm512_slli_epi32(a[o][r][2], 8), a[o][r][1]);
            block = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(a[o][r][0]));
          } else {  // |2^8 D1 + D0| < 2^28: exact in int32, one rounding
            block = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(a[o][r][1], 8), a[o][r][0]));
          }
          acc[o][r] = _mm512_fmadd_ps(block, _mm512_mul_ps(scale[o], step), acc[o][r]);
          if constexpr (kMins) acc[o][r] = _mm512_fmadd_ps(min[o], _mm512_set1_ps(xd.sum[c]), acc[o][r]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int o = 0; o < O; ++o) {
    const int64_t first = (t + o * stride) * kTile;
    const __m512 bv = bias ? _mm512_loadu_ps(bias + first) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * out_stride + first, _mm512_add_ps(acc[o][r], bv));
  }
}

// Tile t (and O - 1 more, `stride` apart) against every row of xd: one row four streams, two
// rows two, more rows four at a time against one or two tiles (their sums fill the registers);
// WIDE tiles are read from `wide` (unpack_tile) instead of the weight.
template <int BITS, int O, int D, bool WIDE = false, bool SYM = false>
void tiled_all_rows(const Packed& p, const XDigits& xd, const float* bias, float* y, int64_t out_stride, int64_t t,
                    int64_t stride, const uint8_t* wide = nullptr) {
  if (xd.rows == 1) return tiled_rows<BITS, 1, O, D, false, SYM>(p, xd, 0, bias, y, out_stride, t, stride);
  if (xd.rows == 2) {
    constexpr int O2 = O < 2 ? O : 2;
    for (int64_t o = 0; o < O; o += O2)
      tiled_rows<BITS, 2, O2, D, false, SYM>(p, xd, 0, bias, y, out_stride, t + o * stride, stride);
    return;
  }
  if constexpr (O <= 2)  // more rows: at most two tiles at once (4 x 3 x 2 sums fill the registers)
    for (int64_t r = 0; r < xd.rows;) {
      const int64_t n = std::min<int64_t>(4, xd.rows - r);
      float* yr = y + r * out_stride;
      switch (n) {
        case 1: tiled_rows<BITS, 1, O, D, WIDE, SYM>(p, xd, r, bias, yr, out_stride, t, stride, wide); break;
        case 2: tiled_rows<BITS, 2, O, D, WIDE, SYM>(p, xd, r, bias, yr, out_stride, t, stride, wide); break;
        case 3: tiled_rows<BITS, 3, O, D, WIDE, SYM>(p, xd, r, bias, yr, out_stride, t, stride, wide); break;
        default: tiled_rows<BITS, 4, O, D, WIDE, SYM>(p, xd, r, bias, yr, out_stride, t, stride, wide); break;
      }
      r += n;
    }
}

template <int BITS, int D, bool SYM = false>
void tiled_band_bits(const Packed& p, const XDigits& xd, const float* bias, float* y, int64_t out_stride,
                     int64_t begin, int64_t end) {
  const int64_t t0 = begin / kTile, t1 = end / kTile;
  if (xd.rows > 2) {  // two neighbouring tiles at once; int4 unpacked to bytes first, once for all rows
    if constexpr (BITS == 4) {
      const int64_t tile_bytes = kTile * p.row_bytes();
      static thread_local std::vector<uint8_t> wide;
      wide.resize(4 * tile_bytes);
      for (int64_t t = t0; t < t1; t += 2) {
        const int64_t n = std::min<int64_t>(2, t1 - t);
        for (int64_t o = 0; o < n; ++o)
          unpack_tile(p.codes + (t + o) * tile_bytes, tile_bytes, wide.data() + o * 2 * tile_bytes);
        if (n == 2) tiled_all_rows<BITS, 2, D, true, SYM>(p, xd, bias, y, out_stride, t, 1, wide.data());
        else tiled_all_rows<BITS, 1, D, true, SYM>(p, xd, bias, y, out_stride, t, 0, wide.data());
      }
    } else {
      int64_t t = t0;
      for (; t + 2 <= t1; t += 2) tiled_all_rows<BITS, 2, D>(p, xd, bias, y, out_stride, t, 1);
      if (t < t1) tiled_all_rows<BITS, 1, D>(p, xd, bias, y, out_stride, t, 0);
    }
    return;
  }
  const int64_t streams = xd.rows == 1 ? 4 : 2, stride = (t1 - t0) / streams;
  for (int64_t t = t0; t < t0 + stride; ++t) {
    if (streams == 4) tiled_all_rows<BITS, 4, D, false, SYM>(p, xd, bias, y, out_stride, t, stride);
    else tiled_all_rows<BITS, 2, D, false, SYM>(p, xd, bias, y, out_stride, t, stride);
  }
  for (int64_t t = t0 + streams * stride; t < t1; ++t)
    tiled_all_rows<BITS, 1, D, false, SYM>(p, xd, bias, y, out_stride, t, 0);
}

// Output features [begin, end) (multiples of 16) of a tiled weight against every row of xd.
// One or two rows read four or two stretches of the band at once (tiled_rows); more rows
// take two tiles at a time, so that they are read from memory once and from cache by the
// other rows (int4 tiles unpacked to a byte a code first).
inline void tiled_band(const Packed& p, const XDigits& xd, const float* bias, float* y, int64_t out_stride,
                       int64_t begin, int64_t end) {
  if (xd.digits == 3) {
    if (p.bits == 8) tiled_band_bits<8, 3>(p, xd, bias, y, out_stride, begin, end);
    else if (p.symmetric) tiled_band_bits<4, 3, true>(p, xd, bias, y, out_stride, begin, end);
    else tiled_band_bits<4, 3>(p, xd, bias, y, out_stride, begin, end);
  } else {
    if (p.bits == 8) tiled_band_bits<8, 2>(p, xd, bias, y, out_stride, begin, end);
    else if (p.symmetric) tiled_band_bits<4, 2, true>(p, xd, bias, y, out_stride, begin, end);
    else tiled_band_bits<4, 2>(p, xd, bias, y, out_stride, begin, end);
  }
}

// Rows [begin, end) (multiples of 16) of a tiled weight dequantized into w (float32
// [end - begin, in]): code x scale (+ min), one rounding each, as the row layout's kernels
// rebuild it.
inline void tiled_store_rows(const Packed& p, int64_t begin, int64_t end, float* w) {
  const int64_t in = p.in, groups = p.groups(), tile_bytes = kTile * p.row_bytes();
  const __m512i lane_quarter = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
  for (int64_t t = begin / kTile; t < end / kTile; ++t) {
    const uint8_t* tile = p.codes + t * tile_bytes;
    float* rows = w + (t * kTile - begin) * in;
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 scale = load_fields(p.scales + (t * groups + g) * kTile);
      const __m512 min = p.bits == 4 ? load_fields(p.mins + (t * groups + g) * kTile) : _mm512_setzero_ps();
      __m512 qs[4], qm[4];  // lanes 4m..4m+3: output 4q + m's scale and min
      for (int q = 0; q < 4; ++q) {
        const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * q), lane_quarter);
        qs[q] = _mm512_permutexvar_ps(idx, scale);
        qm[q] = _mm512_permutexvar_ps(idx, min);
      }
      // a vector's byte quarters as inputs first..first+3 of outputs 4q..4q+3
      auto store = [&](__m512i bytes, int64_t first, bool signed_codes) {
        const __m128i parts[4] = {_mm512_extracti32x4_epi32(bytes, 0), _mm512_extracti32x4_epi32(bytes, 1),
                                  _mm512_extracti32x4_epi32(bytes, 2), _mm512_extracti32x4_epi32(bytes, 3)};
        for (int q = 0; q < 4; ++q) {
          const __m512i ints = signed_codes ? _mm512_cvtepi8_epi32(parts[q]) : _mm512_cvtepu8_epi32(parts[q]);
          __m512 vals = _mm512_mul_ps(_mm512_cvtepi32_ps(ints), qs[q]);
          if (!signed_codes) vals = _mm512_add_ps(vals, qm[q]);
          alignas(64) float lanes[16];
          _mm512_store_ps(lanes, vals);
          for (int m = 0; m < 4; ++m) std::memcpy(rows + (4 * q + m) * in + first, lanes + 4 * m, 4 * sizeof(float));
        }
      };
      if (p.bits == 8) {
        for (int64_t v = g * p.group / 4; v < (g + 1) * p.group / 4; ++v)
          store(_mm512_loadu_si512(tile + v * 64), 4 * v, true);
      } else {
        const __m512i nibble = _mm512_set1_epi8(0x0F);
        for (int64_t v = g * p.group / 8; v < (g + 1) * p.group / 8; ++v) {
          const __m512i bytes = _mm512_loadu_si512(tile + v * 64);
          store(_mm512_and_si512(bytes, nibble), 8 * v, false);
          store(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble), 8 * v + 4, false);
        }
      }
    }
  }
}

#endif

}  // namespace contbatch_quant

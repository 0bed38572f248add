// The register kernels of quant_linear_cpu.cpp (included there only): a packed weight's layout
// (`Packed`), its fp16 scales and mins widened to float32 a piece of rows at a time (`in_pieces`),
// each block's 32 weights rebuilt in registers (`block_vec`, AVX-512 or AVX2, or `block_scalar`),
// the bands of output features against one to seven rows of x (`band<R>`, picked by `pick`).
// quant_linear_cpu.cpp's file comment says what each path computes and why.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "vec.h"
#if defined(__F16C__) && !defined(__AVX512F__) && !defined(CONTBATCH_VEC_AVX2)
#include <immintrin.h>
#endif

namespace contbatch_quant {

using namespace contbatch_vec;

constexpr int64_t kMaxRows = 7;
constexpr int64_t kBlock = 32;

struct Packed {
  const uint8_t* codes;  // int8 or packed int4 bytes
  const at::Half* scales;
  const at::Half* mins;  // int4 only
  int64_t in, group, bits, out;
  bool tiled = false;  // codes, scales and mins in 16-output tiles (quant_tiles.h)
  bool symmetric = false;  // tiled int4 with every min -8 x its scale (quant_tiles.h's kSymmetricFlag)
  // float32 copies of the scales (and mins) of rows [f0, ...) that the kernels read (in_pieces)
  const float* fscales = nullptr;
  const float* fmins = nullptr;
  int64_t f0 = 0, fstride = 0;  // first row, fields a row
  int64_t row_bytes() const { return bits == 8 ? in : in / 2; }
  int64_t groups() const { return in / group; }
  float scale(int64_t o, int64_t g) const { return fscales[(o - f0) * fstride + g]; }
  float min(int64_t o, int64_t g) const { return fmins[(o - f0) * fstride + g]; }
};

// n fp16 values from src as float32 into dst (which has room for n rounded up to 16).
inline void widen_halves(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  for (; i < n; i += 16) {  // the last sixteen read under a mask, stored whole
    const __mmask16 k = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, src + i)));
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Rows widened at once: most bands are one piece (the decode kernels' O streams then run the
// band's length, as the prefetcher wants), an LM head a few; at most 1 MiB of float32 fields.
constexpr int64_t kPieceRows = 2048, kPieceFields = 1 << 18;

// Calls fn(q, b0, b1) for pieces [b0, b1) of rows [begin, end), q being p with the piece's
// scales and mins widened to float32 in the calling thread's buffer, sixteen to an instruction:
// converting a field per block of 32 weights, or a few rows' fields just before reading them,
// slowed the int4 decode kernels measurably (docs/cpu.md).
template <typename Fn>
void in_pieces(const Packed& p, int64_t begin, int64_t end, Fn&& fn) {
  static thread_local std::vector<float> buffer;
  const int64_t groups = p.groups(), rows = std::clamp<int64_t>(kPieceFields / groups, 1, kPieceRows);
  const int64_t span = rows * groups + 16;  // room for widen_halves' last sixteen
  if (static_cast<int64_t>(buffer.size()) < 2 * span) buffer.resize(2 * span);
  for (int64_t b0 = begin; b0 < end; b0 += rows) {
    const int64_t b1 = std::min(end, b0 + rows);
    Packed q = p;
    q.f0 = b0;
    q.fstride = groups;
    q.fscales = buffer.data();
    widen_halves(p.scales + b0 * groups, (b1 - b0) * groups, buffer.data());
    if (p.bits == 4) {
      q.fmins = buffer.data() + span;
      widen_halves(p.mins + b0 * groups, (b1 - b0) * groups, buffer.data() + span);
    }
    fn(q, b0, b1);
  }
}

// The 32 dequantized weights of block `b` of output row `o`, into w[0..31].
inline void block_scalar(const Packed& p, int64_t o, int64_t b, float* w) {
  const int64_t g = b * kBlock / p.group;
  const float s = p.scale(o, g);
  if (p.bits == 8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(p.codes) + o * p.in + b * kBlock;
    for (int j = 0; j < kBlock; ++j) w[j] = static_cast<float>(c[j]) * s;
  } else {
    const float m = p.min(o, g);
    const uint8_t* c = p.codes + o * p.row_bytes() + b * (kBlock / 2);
    for (int j = 0; j < kBlock / 2; ++j) {
      w[j] = static_cast<float>(c[j] & 0x0F) * s + m;
      w[j + 16] = static_cast<float>(c[j] >> 4) * s + m;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Block b of row o as two 16-lane vectors (inputs 0-15, 16-31).
inline void block_vec(const Packed& p, int64_t o, int64_t b, __m512& lo, __m512& hi) {
  const int64_t g = b * kBlock / p.group;
  const __m512 s = _mm512_set1_ps(p.scale(o, g));
  if (p.bits == 8) {
    const uint8_t* c = p.codes + o * p.in + b * kBlock;
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16))));
    lo = _mm512_mul_ps(q0, s);
    hi = _mm512_mul_ps(q1, s);
  } else {
    // The group's sixteen values code x scale + min, made once for the block's 32 weights and
    // looked up by code (the permute reads each lane's low four bits): the same values as
    // converting and scaling every code, in two operations per sixteen weights fewer.
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_add_ps(_mm512_mul_ps(codes, s), _mm512_set1_ps(p.min(o, g)));
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.codes + o * p.row_bytes() + b * 16)));
    lo = _mm512_permutexvar_ps(bytes, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
}

// The AVX2 int8_outputs (quant_bands_avx2.h) in sixteen lanes: O output features `stride`
// apart, the codes unscaled into x, each group's scale applied once.
template <int R, int O>
void int8_outputs(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t o0,
                  int64_t stride) {
  const int64_t groups = p.groups(), per_group = p.group / kBlock;
  __m512 acc[O][R];
#pragma GCC unroll 8
  for (int q = 0; q < O; ++q)
    for (int r = 0; r < R; ++r) acc[q][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 t[O][R][2];
#pragma GCC unroll 8
    for (int q = 0; q < O; ++q)
      for (int r = 0; r < R; ++r) t[q][r][0] = t[q][r][1] = _mm512_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
#pragma GCC unroll 4
      for (int q = 0; q < O; ++q) {
        const uint8_t* c = p.codes + (o0 + q * stride) * p.in + b * kBlock;
#pragma GCC unroll 2
        for (int k = 0; k < 2; ++k) {
          const __m512 w = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * k))));
#pragma GCC unroll 2
          for (int r = 0; r < R; ++r)
            t[q][r][k] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * p.in + b * kBlock + 16 * k), t[q][r][k]);
        }
      }
    }
#pragma GCC unroll 4
    for (int q = 0; q < O; ++q) {
      const __m512 scale = _mm512_set1_ps(p.scale(o0 + q * stride, g));
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r)
        acc[q][r] = _mm512_fmadd_ps(_mm512_add_ps(t[q][r][0], t[q][r][1]), scale, acc[q][r]);
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < O; ++q)
    for (int r = 0; r < R; ++r) {
      const float sum = _mm512_reduce_add_ps(acc[q][r]);
      const int64_t o = o0 + q * stride;
      y[r * out_stride + o] = bias ? sum + bias[o] : sum;
    }
}
constexpr int kInt8Streams = 4;

// O output features `stride` apart against R rows of x (float32 [R, I]), each weight rebuilt
// exactly (O = 1: exact_band's; int4 weights at one or two rows take O = 4, the streams keeping
// the memory reads going as int8_outputs' do).
template <int R, int O>
void exact_outputs(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t o0,
                   int64_t stride) {
  const int64_t blocks = p.in / kBlock;
  __m512 a[O][R][2];
#pragma GCC unroll 8
  for (int q = 0; q < O; ++q)
    for (int r = 0; r < R; ++r) a[q][r][0] = a[q][r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 4
    for (int q = 0; q < O; ++q) {
      __m512 lo, hi;
      block_vec(p, o0 + q * stride, b, lo, hi);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        a[q][r][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * p.in + b * kBlock), a[q][r][0]);
        a[q][r][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * p.in + b * kBlock + 16), a[q][r][1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < O; ++q)
    for (int r = 0; r < R; ++r) {
      const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a[q][r][0], a[q][r][1]));
      const int64_t o = o0 + q * stride;
      y[r * out_stride + o] = bias ? sum + bias[o] : sum;
    }
}

// Output features [begin, end) against R rows of x (float32 [R, I]), each weight rebuilt exactly.
template <int R>
void exact_band(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t begin,
                int64_t end) {
  for (int64_t o = begin; o < end; ++o) exact_outputs<R, 1>(p, x, bias, y, out_stride, o, 0);
}
#define CONTBATCH_QUANT_INT4_STREAMS 1
#elif defined(CONTBATCH_VEC_AVX2)
#include "quant_bands_avx2.h"
#else
template <int R>
void exact_band(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t begin,
                int64_t end) {
  const int64_t blocks = p.in / kBlock;
  float w[kBlock];
  for (int64_t o = begin; o < end; ++o) {
    float sum[R] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      block_scalar(p, o, b, w);
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < kBlock; ++j) sum[r] += w[j] * x[r * p.in + b * kBlock + j];
    }
    for (int r = 0; r < R; ++r) y[r * out_stride + o] = bias ? sum[r] + bias[o] : sum[r];
  }
}
#endif

// Output features [begin, end) against R rows of x (float32 [R, I]). One or two rows of int8
// weights take the vector int8_outputs, several output features at a time, each from its own
// stretch of the band (int4 weights the same way through exact_outputs, with AVX-512); the
// rest take the exact kernel.
template <int R>
void piece(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t begin,
           int64_t end) {
#if defined(CONTBATCH_VEC_AVX2) || (defined(__AVX512F__) && defined(__AVX512BW__))
  if constexpr (R <= 2) {
    if (p.bits == 8) {
      constexpr int O = R == 1 ? 4 : kInt8Streams;
      const int64_t stride = (end - begin) / O;
      for (int64_t o = begin; o < begin + stride; ++o) int8_outputs<R, O>(p, x, bias, y, out_stride, o, stride);
      for (int64_t o = begin + O * stride; o < end; ++o) int8_outputs<R, 1>(p, x, bias, y, out_stride, o, 0);
      return;
    }
#if defined(CONTBATCH_QUANT_INT4_STREAMS)
    constexpr int O = 4;
    const int64_t stride = (end - begin) / O;
    for (int64_t o = begin; o < begin + stride; ++o) exact_outputs<R, O>(p, x, bias, y, out_stride, o, stride);
    exact_band<R>(p, x, bias, y, out_stride, begin + O * stride, end);
    return;
#endif
  }
#endif
  exact_band<R>(p, x, bias, y, out_stride, begin, end);
}

template <int R>
void band(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t begin,
          int64_t end) {
  in_pieces(p, begin, end, [&](const Packed& q, int64_t b0, int64_t b1) { piece<R>(q, x, bias, y, out_stride, b0, b1); });
}

using BandFn = void (*)(const Packed&, const float*, const float*, float*, int64_t, int64_t, int64_t);

inline BandFn pick(int64_t rows) {
  static const BandFn table[kMaxRows] = {band<1>, band<2>, band<3>, band<4>, band<5>, band<6>, band<7>};
  return table[rows - 1];
}

}  // namespace contbatch_quant

// What the CPU kernels share: the float32/bfloat16 dispatch, widening a value to float32,
// loading sixteen (AVX-512) or eight (AVX2) float32, bfloat16 or float16 values as one float32
// vector and storing them back with the dtype's rounding, and the attention kernels' softmax
// exponent. Included by every csrc/*.cpp; native.py hashes it with them, so a change here
// rebuilds the library.

#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cmath>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// AVX2 code paths where the machine has AVX2 but not AVX-512 (AVX2-only CPUs): without
// them those machines ran the norm and softmax one value at a time and the attention kernels'
// products in generic loops.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define CONTBATCH_VEC_AVX2 1
#endif

namespace contbatch_vec {

// How far ahead a kernel streaming memory for few rows asks for it (software prefetches), and
// into which cache, per kind of stream: kFloatStreams, small_linear's float weight for one row;
// kPackedStreams, the tiled packed kernels' codes for one or two rows; kKvStreams, the decode
// attention's key and value rows (short runs scattered over the cache, too short for the
// hardware prefetcher to ramp up). The hardware prefetcher follows a stream within a 4 KiB page
// and starts over at the next, and a software request a page on keeps the reads going across
// the border. That holds on some CPUs; on others the same requests slow the streams down, or
// speed them up only when they fill L2 rather than L1 (docs/cpu.md has the figures). So the
// setting is the process's, per kind, set through the `stream_prefetch` op from a start-up
// measurement (cpu/prefetch.py): one word, the bytes ahead (a multiple of 64; 0 for no
// requests) plus the level they fill (kFillL1, `prefetcht0`, or kFillL2, `prefetcht1`). The
// weights are asked for a page ahead, the K/V rows 2 KiB ahead (8 rows of a 64-float32 head:
// farther measured slower into L1 on short contexts).
constexpr int64_t kPrefetchBytes = 4096, kKvPrefetchBytes = 2048;
constexpr int64_t kFloatStreams = 0, kPackedStreams = 1, kKvStreams = 2, kStreamKinds = 3;
constexpr int64_t kFillL1 = 1, kFillL2 = 2;
inline std::atomic<int64_t>& stream_prefetch(int64_t kind) {
  static std::atomic<int64_t> setting[kStreamKinds] = {kPrefetchBytes | kFillL1, kPrefetchBytes | kFillL1,
                                                       kKvPrefetchBytes | kFillL1};
  return setting[kind];
}

// A kind's setting as read by a kernel: bytes ahead (0: none) and whether into L2.
struct Ahead {
  int64_t bytes;
  bool l2;
};
inline Ahead stream_ahead(int64_t kind) {
  const int64_t word = stream_prefetch(kind).load(std::memory_order_relaxed);
  return {word & ~int64_t{63}, (word & 63) == kFillL2};
}
inline void prefetch_line(const void* p, bool l2) {  // prefetcht1 or prefetcht0 on x86
  if (l2)
    __builtin_prefetch(p, 0, 2);
  else
    __builtin_prefetch(p, 0, 3);
}

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

// Calls fn(float{}) or fn(at::BFloat16{}) for `type`, the two dtypes the float32/bfloat16
// kernels take; any other is an error naming `op`.
template <typename Fn>
void float_or_bf16(at::ScalarType type, const char* op, Fn&& fn) {
  if (type == at::kFloat) {
    fn(float{});
    return;
  }
  TORCH_CHECK(type == at::kBFloat16, op, ": float32 or bfloat16, got ", type);
  fn(at::BFloat16{});
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bfloat16 is the high half of a float32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// Back from float32 with the dtype's rounding: bfloat16 rounds to nearest even as
// c10::BFloat16 does (NaN to 0x7FC0), so every intermediate matches PyTorch's.
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
// `v` rounded to T and widened again (the tag pointer only picks T).
inline __m512 rounded(float*, __m512 v) { return v; }
inline __m512 rounded(at::BFloat16*, __m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
#endif

// e^x for the softmax's shifted scores (x <= 0), a vector at a time (exp16, exp8): Cephes' expf,
// x = n ln2 + r (ln2 in two parts), e^r by a degree-7 polynomial (coefficients from the
// highest), then 2^n; within ~1 ulp of std::exp. The scalar std::exp per score was most of the
// decode kernel's time: three scores per key on a grouped-query model.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#ifdef CONTBATCH_VEC_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bfloat16 is the high half of a float32
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// As bf16_bits (round to nearest even, NaN to 0x7FC0), eight lanes: the result in the low
// 16 bits of each 32-bit lane.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
inline __m256 rounded8(float*, __m256 v) { return v; }
inline __m256 rounded8(at::BFloat16*, __m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i w = bf16_bits8(v);  // eight 16-bit values in the low halves of the lanes: pack them
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// Eight lanes; 2^n built in the exponent bits (AVX2 has no scalef).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  // n >= -126 here (x >= -87), so 2^n is a normal float: n + 127 in the exponent field.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
// Sixteen lanes (see kExpPoly).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// sg[j] = e^(sg[j] - m) for j < n (a softmax's numerators, in place); returns their sum.
inline float exp_shifted(float* sg, int64_t n, float m) {
  int64_t j = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), mv));
    _mm512_storeu_ps(sg + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (j < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sg + j), mv));
    _mm512_mask_storeu_ps(sg + j, tail, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(tail, e));
    j = n;
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(CONTBATCH_VEC_AVX2)
  __m256 acc = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mv));
    _mm256_storeu_ps(sg + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; j < n; ++j) {
    sg[j] = std::exp(sg[j] - m);
    sum += sg[j];
  }
  return sum;
}

}  // namespace contbatch_vec

// What the CPU kernels share: the float32/bfloat16 dispatch, widening a value to float32, and
// (with AVX-512) loading sixteen
// float32, bfloat16 or float16 values as one float32 vector and storing sixteen back with the
// dtype's rounding. Included by every csrc/*.cpp;
// native.py hashes it with them, so a change here rebuilds the library.

#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace contbatch_vec {

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

}  // namespace contbatch_vec

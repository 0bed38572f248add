// What the CPU kernels share: widening a value to float32, and (with AVX-512) loading sixteen
// float32, bfloat16 or float16 values as one float32 vector. Included by every csrc/*.cpp;
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

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bfloat16 is the high half of a float32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

}  // namespace contbatch_vec

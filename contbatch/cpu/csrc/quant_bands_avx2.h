// quant_bands.h's kernels on AVX2 machines without AVX-512 (included there only, inside
// namespace contbatch_quant): a block's weights as four 8-lane vectors (`block_vec`), the exact
// kernel (`exact_band`), and the kernel of one or two rows of int8 weights that meets x with
// the codes unscaled (`int8_outputs`).

// Block b of row o as four 8-lane vectors (inputs 0-7, 8-15, 16-23, 24-31).
inline void block_vec(const Packed& p, int64_t o, int64_t b, __m256 (&w)[4]) {
  const int64_t g = b * kBlock / p.group;
  const __m256 s = _mm256_set1_ps(p.scale(o, g));
  if (p.bits == 8) {
    const uint8_t* c = p.codes + o * p.in + b * kBlock;
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * k));
      w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), s);
    }
  } else {
    const __m256 m = _mm256_set1_ps(p.min(o, g));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.codes + o * p.row_bytes() + b * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(raw, mask), high = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k)
      w[k] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k])), s), m);
  }
}

template <int R>
void exact_band(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t begin,
                int64_t end) {
  const int64_t blocks = p.in / kBlock;
  constexpr int A = R <= 2 ? 4 : 2;  // accumulators per row: A x R + 4 weight vectors <= 16 registers
  for (int64_t o = begin; o < end; ++o) {
    __m256 a[R][A];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < A; ++k) a[r][k] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 w[4];
      block_vec(p, o, b, w);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k)
          a[r][k % A] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(x + r * p.in + b * kBlock + 8 * k), a[r][k % A]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256 t = a[r][0];
      for (int k = 1; k < A; ++k) t = _mm256_add_ps(t, a[r][k]);
      const float sum = hsum8(t);
      y[r * out_stride + o] = bias ? sum + bias[o] : sum;
    }
  }
}

// One or two rows of int8 weights, O output features at a time: over the groups, scale x
// (codes . x). The codes meet x unscaled and each group's scale is applied once, which saves
// the per-weight product that bounds the exact kernel at one or two rows; the weights are then
// not rebuilt exactly, so the result differs from F.linear on the dequantized weight by float
// rounding. The O output features are `stride` apart: each of the O streams of codes is read
// in order from memory across calls (adjacent rows read interleaved defeat the hardware
// prefetcher when the weights come from DRAM).
template <int R, int O>
void int8_outputs(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t o0,
                  int64_t stride) {
  const int64_t groups = p.groups(), per_group = p.group / kBlock;
  __m256 acc[O][R];
#pragma GCC unroll 8
  for (int q = 0; q < O; ++q)
    for (int r = 0; r < R; ++r) acc[q][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 t[O][R][2];
#pragma GCC unroll 8
    for (int q = 0; q < O; ++q)
      for (int r = 0; r < R; ++r) t[q][r][0] = t[q][r][1] = _mm256_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
#pragma GCC unroll 4
      for (int q = 0; q < O; ++q) {
        const uint8_t* c = p.codes + (o0 + q * stride) * p.in + b * kBlock;
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const __m256 w =
              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * k))));
#pragma GCC unroll 2
          for (int r = 0; r < R; ++r)
            t[q][r][k & 1] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * p.in + b * kBlock + 8 * k), t[q][r][k & 1]);
        }
      }
    }
#pragma GCC unroll 4
    for (int q = 0; q < O; ++q) {
      const __m256 scale = _mm256_set1_ps(p.scale(o0 + q * stride, g));
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r)
        acc[q][r] = _mm256_fmadd_ps(_mm256_add_ps(t[q][r][0], t[q][r][1]), scale, acc[q][r]);
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < O; ++q)
    for (int r = 0; r < R; ++r) {
      const float sum = hsum8(acc[q][r]);
      const int64_t o = o0 + q * stride;
      y[r * out_stride + o] = bias ? sum + bias[o] : sum;
    }
}

constexpr int kInt8Streams = 2;  // at two rows: O x R x 3 accumulators + 4 code vectors in 16 registers

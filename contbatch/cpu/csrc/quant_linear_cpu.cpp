// Weight-only quantized linear layers: y = x W^T + b, W stored as int8 or int4 codes with a
// float32 scale (and, for int4, a float32 min) per group of `group` consecutive inputs.
//
// The layout (cpu/quant/format.py is its Python side, and the reason for it):
//   int8: codes int8 [O, I], w = code * scale
//   int4: codes uint8 [O, I / 2]; within each block of 32 inputs, byte j (0..15) holds input j
//         in its low nibble and input j + 16 in its high one (ggml's Q4_0/Q4_1 block order, so
//         GGUF blocks are copied in as they are); w = code * scale + min
//   scales, mins: float32 [O, I / group]; group is a multiple of 32 dividing I.
// Every weight is rebuilt in registers as the dequantized float32 value exactly (one rounded
// product, then one rounded sum: the library is built with -ffp-contract=off), so the output
// differs from F.linear on the dequantized weight by the summation order only; except one or
// two rows of int8 weights (a lone request decoding), where each group's scale multiplies the
// codes' dot product with x once instead of every code: one product fewer per weight, read from
// several places of the band at once (int8_outputs), at the cost of float rounding.
//
// One to seven rows (decode) read each code once and multiply it into every row while it is
// in registers: the layer reads a quarter (int8) or an eighth (int4) of the float32 bytes.
// Up to kChunkedRows rows run the same kernels seven rows at a time over small bands of
// output features (the codes then come from L1 for every chunk after the first). More rows
// (prompts) dequantize a band of output features at a time into a float32 tile and hand it to
// oneDNN's linear: there the arithmetic, not the weight read, bounds the time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <string_view>
#include <vector>

#include "vec.h"

namespace {

using namespace contbatch_vec;

constexpr int64_t kMaxRows = 7;
constexpr int64_t kBlock = 32;
constexpr int64_t kTileBytes = 4 << 20;  // float32 tile of the prompt path
// Up to this many rows, the register kernels in chunks of kMaxRows beat dequantizing into a
// GEMM (benchmarks/quantized.py's kernel sweep; docs/cpu.md)
constexpr int64_t kChunkedRows = 64;
constexpr int64_t kSubBand = 16;  // output features whose codes the row chunks share from L1

struct Packed {
  const uint8_t* codes;  // int8 or packed int4 bytes
  const float* scales;
  const float* mins;  // int4 only
  int64_t in, group, bits, out;
  int64_t row_bytes() const { return bits == 8 ? in : in / 2; }
  int64_t groups() const { return in / group; }
};

// The 32 dequantized weights of block `b` of output row `o`, into w[0..31].
inline void block_scalar(const Packed& p, int64_t o, int64_t b, float* w) {
  const int64_t g = b * kBlock / p.group;
  const float s = p.scales[o * p.groups() + g];
  if (p.bits == 8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(p.codes) + o * p.in + b * kBlock;
    for (int j = 0; j < kBlock; ++j) w[j] = static_cast<float>(c[j]) * s;
  } else {
    const float m = p.mins[o * p.groups() + g];
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
  const __m512 s = _mm512_set1_ps(p.scales[o * p.groups() + g]);
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
    const __m512 table = _mm512_add_ps(_mm512_mul_ps(codes, s), _mm512_set1_ps(p.mins[o * p.groups() + g]));
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.codes + o * p.row_bytes() + b * 16)));
    lo = _mm512_permutexvar_ps(bytes, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
}

// Output features [begin, end) against R rows of x (float32 [R, I]), each weight rebuilt exactly.
template <int R>
void exact_band(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t begin,
                int64_t end) {
  const int64_t blocks = p.in / kBlock;
  for (int64_t o = begin; o < end; ++o) {
    __m512 a[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 lo, hi;
      block_vec(p, o, b, lo, hi);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        a[r][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * p.in + b * kBlock), a[r][0]);
        a[r][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * p.in + b * kBlock + 16), a[r][1]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0], a[r][1]));
      y[r * out_stride + o] = bias ? sum + bias[o] : sum;
    }
  }
}

// The AVX2 int8_outputs below, sixteen lanes: O output features `stride` apart, the codes
// unscaled into x, each group's scale applied once.
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
      const __m512 scale = _mm512_set1_ps(p.scales[(o0 + q * stride) * groups + g]);
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

// exact_band's products for O output features `stride` apart (int4 weights at one or two rows:
// the streams keep the memory reads going as int8_outputs' do).
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
#pragma GCC unroll 2
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
#define CONTBATCH_QUANT_INT4_STREAMS 1
#elif defined(CONTBATCH_VEC_AVX2)

// Block b of row o as four 8-lane vectors (inputs 0-7, 8-15, 16-23, 24-31).
inline void block_vec(const Packed& p, int64_t o, int64_t b, __m256 (&w)[4]) {
  const int64_t g = b * kBlock / p.group;
  const __m256 s = _mm256_set1_ps(p.scales[o * p.groups() + g]);
  if (p.bits == 8) {
    const uint8_t* c = p.codes + o * p.in + b * kBlock;
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * k));
      w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), s);
    }
  } else {
    const __m256 m = _mm256_set1_ps(p.mins[o * p.groups() + g]);
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
      const __m256 scale = _mm256_set1_ps(p.scales[(o0 + q * stride) * groups + g]);
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
void band(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t begin,
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

using BandFn = void (*)(const Packed&, const float*, const float*, float*, int64_t, int64_t, int64_t);

BandFn pick(int64_t rows) {
  static const BandFn table[kMaxRows] = {band<1>, band<2>, band<3>, band<4>, band<5>, band<6>, band<7>};
  return table[rows - 1];
}

Packed check(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t bits,
             int64_t group, const char* op) {
  TORCH_CHECK(bits == 8 || bits == 4, op, ": bits must be 8 or 4, got ", bits);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.device().is_cpu(), op,
              ": codes must be a contiguous 2-d CPU tensor");
  TORCH_CHECK(codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte), op, ": ", bits == 8 ? "int8" : "uint8",
              " codes for ", bits, "-bit weights, got ", codes.scalar_type());
  const int64_t out = codes.size(0), in = bits == 8 ? codes.size(1) : codes.size(1) * 2;
  TORCH_CHECK(group > 0 && group % kBlock == 0 && in % group == 0, op, ": the group (", group,
              ") must be a multiple of 32 dividing the inputs (", in, ")");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == out && scales.size(1) == in / group,
              op, ": float32 scales [out, in / group]");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(has_mins == (bits == 4), op, ": int4 weights take mins, int8 ones none");
  if (has_mins) {
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->sizes() == scales.sizes(), op,
                ": float32 mins shaped as the scales");
  }
  return Packed{static_cast<const uint8_t*>(codes.data_ptr()),
                scales.data_ptr<float>(), has_mins ? mins->data_ptr<float>() : nullptr, in, group, bits, out};
}

// Block b of row o dequantized into w[0..31]: the vector kernels' values (the same product
// and sum, one rounding each), stored.
inline void block_store(const Packed& p, int64_t o, int64_t b, float* w) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 lo, hi;
  block_vec(p, o, b, lo, hi);
  _mm512_storeu_ps(w, lo);
  _mm512_storeu_ps(w + 16, hi);
#elif defined(CONTBATCH_VEC_AVX2)
  __m256 v[4];
  block_vec(p, o, b, v);
  for (int k = 0; k < 4; ++k) _mm256_storeu_ps(w + 8 * k, v[k]);
#else
  block_scalar(p, o, b, w);
#endif
}

// Output rows [begin, end) dequantized into tile (float32 [end - begin, I]).
void dequantize_rows(const Packed& p, int64_t begin, int64_t end, float* tile) {
  at::parallel_for(begin, end, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t o = lo; o < hi; ++o)
      for (int64_t b = 0; b < p.in / kBlock; ++b) block_store(p, o, b, tile + (o - begin) * p.in + b * kBlock);
  });
}

at::Tensor quant_dequantize(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                            int64_t bits, int64_t group) {
  const Packed p = check(codes, scales, mins, bits, group, "quant_dequantize");
  at::Tensor w = at::empty({codes.size(0), p.in}, scales.options());
  dequantize_rows(p, 0, codes.size(0), w.data_ptr<float>());
  return w;
}

void check_input(const at::Tensor& input, int64_t in, const char* op) {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == in, op, ": x [..., ", in, "], got ", input.sizes());
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 activations, got ", input.scalar_type());
}

at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t out, const char* op) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == out, op, ": one bias value per output feature");
  return bias->to(at::kFloat).contiguous();
}

at::Tensor shaped(const at::Tensor& y, const at::Tensor& input) {
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = y.size(1);
  return y.to(input.scalar_type()).view(shape);
}

// Packed linears of one input x (1 to kMaxRows rows) in one parallel region: each output
// feature is computed by the same band function as quant_linear's, so every output equals
// quant_linear's on that weight bit for bit; one fork and join instead of one per linear.
std::vector<at::Tensor> few_rows(const at::Tensor& input, const std::vector<Packed>& ps,
                                 const std::vector<at::Tensor>& biases) {
  const int64_t in = ps[0].in, rows = input.numel() / in, n = static_cast<int64_t>(ps.size());
  TORCH_CHECK(rows >= 1 && rows <= kChunkedRows, "quant_linears takes 1 to ", kChunkedRows, " rows, got ", rows);
  const at::Tensor x = input.reshape({rows, in}).to(at::kFloat).contiguous();
  std::vector<at::Tensor> ys(n);
  std::vector<int64_t> first(n + 1, 0);  // the outputs of linear i are [first[i], first[i + 1]) end to end
  for (int64_t i = 0; i < n; ++i) {
    ys[i] = at::empty({rows, ps[i].out}, x.options());
    first[i + 1] = first[i] + ps[i].out;
  }
  // More than kMaxRows rows: in chunks of at most kMaxRows (as even as they go), every chunk
  // over a sub-band of kSubBand output features before the next sub-band, so that the codes
  // are read from memory once and from L1 by the other chunks.
  const int64_t chunks = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t sub_band = chunks == 1 ? first[n] : kSubBand;
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, first[n], 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = 0; i < n; ++i) {
      const float* bp = biases[i].defined() ? biases[i].data_ptr<float>() : nullptr;
      float* yp = ys[i].data_ptr<float>();
      const int64_t lo = std::max(begin, first[i]) - first[i], hi = std::min(end, first[i + 1]) - first[i];
      for (int64_t s = lo; s < hi; s += sub_band)
        for (int64_t c = 0, r0 = 0; c < chunks; ++c) {
          const int64_t r = (rows - r0) / (chunks - c);
          pick(r)(ps[i], xp + r0 * in, bp, yp + r0 * ps[i].out, ps[i].out, s, std::min(hi, s + sub_band));
          r0 += r;
        }
    }
  });
  for (int64_t i = 0; i < n; ++i) ys[i] = shaped(ys[i], input);
  return ys;
}

std::vector<at::Tensor> quant_linears(const at::Tensor& input, at::TensorList codes, at::TensorList scales,
                                      const c10::List<std::optional<at::Tensor>>& mins,
                                      const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef bits,
                                      at::IntArrayRef groups) {
  const size_t n = codes.size();
  TORCH_CHECK(n > 0 && scales.size() == n && mins.size() == n && biases.size() == n && bits.size() == n &&
                  groups.size() == n,
              "quant_linears: codes, scales, mins, bias, bits and group for every linear");
  std::vector<Packed> ps;
  std::vector<at::Tensor> bs;
  for (size_t i = 0; i < n; ++i) {
    ps.push_back(check(codes[i], scales[i], mins.get(i), bits[i], groups[i], "quant_linears"));
    TORCH_CHECK(ps[i].in == ps[0].in, "quant_linears: linears of one input size");
    bs.push_back(float_bias(biases.get(i), ps[i].out, "quant_linears"));
  }
  check_input(input, ps[0].in, "quant_linears");
  return few_rows(input, ps, bs);
}

// The calling thread's float32 tile of the prompt path, at least `floats` long. Kept from call
// to call: a tile allocated per call is fresh memory, and its page faults cost more than
// dequantizing into it.
float* tile_buffer(int64_t floats) {
  static thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// x [rows, in] times a dequantized tile [n, in] (+ bias): oneDNN's linear on the plain weight
// where PyTorch has it (faster than at::linear's GEMM on prompt steps: docs/cpu.md), else
// at::linear.
at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& tile, const at::Tensor& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  static const bool use = op.has_value() && at::hasMKLDNN();
  if (!use) return at::linear(x, tile, bias.defined() ? bias : at::Tensor());
  static const auto linear =
      op->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                           c10::List<std::optional<c10::Scalar>>, std::optional<std::string_view>)>();
  return linear.call(x, tile, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, "none",
                     c10::List<std::optional<c10::Scalar>>(), std::string_view(""));
}

at::Tensor quant_linear(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias, int64_t bits,
                        int64_t group) {
  const Packed p = check(codes, scales, mins, bits, group, "quant_linear");
  check_input(input, p.in, "quant_linear");
  const int64_t out = codes.size(0), rows = input.numel() / p.in;
  if (rows >= 1 && rows <= kChunkedRows) return few_rows(input, {p}, {float_bias(bias, out, "quant_linear")})[0];
  const at::Tensor x = input.reshape({rows, p.in}).to(at::kFloat).contiguous();
  const at::Tensor b = float_bias(bias, out, "quant_linear");
  const bool has_bias = b.defined();
  if (rows == 0) return shaped(at::empty({0, out}, x.options()), input);
  const int64_t tile_rows = std::max<int64_t>(16, std::min<int64_t>(out, kTileBytes / 4 / p.in));
  const at::Tensor tile = at::from_blob(tile_buffer(tile_rows * p.in), {tile_rows, p.in}, x.options());
  if (tile_rows == out) {  // the whole weight in one tile: the product is the output
    dequantize_rows(p, 0, out, tile.data_ptr<float>());
    return shaped(tile_linear(x, tile, b), input);
  }
  at::Tensor y = at::empty({rows, out}, x.options());
  for (int64_t o = 0; o < out; o += tile_rows) {
    const int64_t n = std::min(tile_rows, out - o);
    dequantize_rows(p, o, o + n, tile.data_ptr<float>());
    y.narrow(1, o, n).copy_(tile_linear(x, tile.narrow(0, 0, n), has_bias ? b.narrow(0, o, n) : at::Tensor()));
  }
  return shaped(y, input);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(contbatch_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? bias, int bits, int group) -> Tensor");
  m.def("quant_dequantize(Tensor codes, Tensor scales, Tensor? mins, int bits, int group) -> Tensor");
  m.def("quant_linears(Tensor x, Tensor[] codes, Tensor[] scales, Tensor?[] mins, Tensor?[] biases, int[] bits, "
        "int[] groups) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(contbatch_cpu, CPU, m) {
  m.impl("quant_linear", quant_linear);
  m.impl("quant_dequantize", quant_dequantize);
  m.impl("quant_linears", quant_linears);
}

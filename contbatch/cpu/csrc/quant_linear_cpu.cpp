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
// differs from F.linear on the dequantized weight by the summation order only.
//
// One to seven rows (decode) read each code once and multiply it into every row while it is
// in registers: the layer reads a quarter (int8) or an eighth (int4) of the float32 bytes.
// More rows (prompts) dequantize a band of output features at a time into a float32 tile and
// hand it to at::linear: there the arithmetic, not the weight read, bounds the time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace {

using namespace contbatch_vec;

constexpr int64_t kMaxRows = 7;
constexpr int64_t kBlock = 32;
constexpr int64_t kTileBytes = 4 << 20;  // float32 tile of the prompt path

struct Packed {
  const uint8_t* codes;  // int8 or packed int4 bytes
  const float* scales;
  const float* mins;  // int4 only
  int64_t in, group, bits;
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
    const __m512 m = _mm512_set1_ps(p.mins[o * p.groups() + g]);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.codes + o * p.row_bytes() + b * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)));
    lo = _mm512_add_ps(_mm512_mul_ps(q0, s), m);
    hi = _mm512_add_ps(_mm512_mul_ps(q1, s), m);
  }
}

// Output features [begin, end) against R rows of x (float32 [R, I]).
template <int R>
void band(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t begin,
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
void band(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t begin,
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
#else
template <int R>
void band(const Packed& p, const float* x, const float* bias, float* y, int64_t out_stride, int64_t begin,
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
                scales.data_ptr<float>(), has_mins ? mins->data_ptr<float>() : nullptr, in, group, bits};
}

// Output rows [begin, end) dequantized into tile (float32 [end - begin, I]).
void dequantize_rows(const Packed& p, int64_t begin, int64_t end, float* tile) {
  at::parallel_for(begin, end, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t o = lo; o < hi; ++o)
      for (int64_t b = 0; b < p.in / kBlock; ++b) block_scalar(p, o, b, tile + (o - begin) * p.in + b * kBlock);
  });
}

at::Tensor quant_dequantize(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                            int64_t bits, int64_t group) {
  const Packed p = check(codes, scales, mins, bits, group, "quant_dequantize");
  at::Tensor w = at::empty({codes.size(0), p.in}, scales.options());
  dequantize_rows(p, 0, codes.size(0), w.data_ptr<float>());
  return w;
}

at::Tensor quant_linear(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias, int64_t bits,
                        int64_t group) {
  const Packed p = check(codes, scales, mins, bits, group, "quant_linear");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == p.in, "quant_linear: x [..., ", p.in, "], got ", input.sizes());
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
              "quant_linear: float32 or bfloat16 activations, got ", input.scalar_type());
  const int64_t out = codes.size(0), rows = input.numel() / p.in;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == out, "quant_linear: one bias value per output feature");
  const at::Tensor x = input.reshape({rows, p.in}).to(at::kFloat).contiguous();
  const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows >= 1 && rows <= kMaxRows) {
    const BandFn fn = pick(rows);
    const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
    at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
      fn(p, x.data_ptr<float>(), bp, y.data_ptr<float>(), out, begin, end);
    });
  } else if (rows > kMaxRows) {
    const int64_t tile_rows = std::max<int64_t>(16, std::min<int64_t>(out, kTileBytes / 4 / p.in));
    at::Tensor tile = at::empty({tile_rows, p.in}, x.options());
    for (int64_t o = 0; o < out; o += tile_rows) {
      const int64_t n = std::min(tile_rows, out - o);
      dequantize_rows(p, o, o + n, tile.data_ptr<float>());
      at::Tensor part = at::linear(x, tile.narrow(0, 0, n), has_bias ? b.narrow(0, o, n) : at::Tensor());
      y.narrow(1, o, n).copy_(part);
    }
  }
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = out;
  return y.to(input.scalar_type()).view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(contbatch_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? bias, int bits, int group) -> Tensor");
  m.def("quant_dequantize(Tensor codes, Tensor scales, Tensor? mins, int bits, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(contbatch_cpu, CPU, m) {
  m.impl("quant_linear", quant_linear);
  m.impl("quant_dequantize", quant_dequantize);
}

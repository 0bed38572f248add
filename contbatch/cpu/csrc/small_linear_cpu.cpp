// A linear layer over a few rows (a lone request decoding, a handful of requests): y = x W^T + b.
//
// With one to seven rows a linear layer is bound by reading its weight from memory, not by
// arithmetic, and the general GEMM kernels read it slowly (docs/cpu.md has the figures). Here
// each task takes a band of output features; every weight row is read once and multiplied into
// all the input rows while it is in registers, with float32 accumulation (bfloat16 weights are
// widened on the fly), in AVX-512 or AVX2 registers where the machine has them, else in a loop
// the compiler vectorizes. Which layers use it is decided by timing it against aten and oneDNN
// at start-up (cpu/routers/linear.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "decoder_layer.h"
#include "layer_parts.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CONTBATCH_AVX512 1
#elif defined(CONTBATCH_VEC_AVX2)
#define CONTBATCH_AVX2 1
#endif

namespace {

using namespace contbatch_vec;
using contbatch_layer::kMaxRows;

// One output: the sum of row r against weight row o, plus the bias, stored in the weight's dtype.
template <typename W>
inline void store(W* y, int64_t r, int64_t o, int64_t out_stride, float sum, const float* bias) {
  y[r * out_stride + o] = static_cast<W>(bias ? sum + bias[o] : sum);
}

#ifdef CONTBATCH_AVX512
// O output features `stride` apart (o0, o0 + stride, ...) against all R rows of x (float32,
// [R, I]): each weight row is loaded once, 32 values at a time, into two accumulators per input
// row (two independent FMA chains); the last in % 32 values are summed one by one. An output's
// sum is the same whatever O is (its own accumulators, in the same order), so the streams
// change how the weight is read, never a value.
template <int R, int O, typename W>
void outputs(const float* x, const W* w, const float* bias, W* y, int64_t in, int64_t o0, int64_t stride,
             int64_t out_stride) {
  __m512 a[O][R][2];
#pragma GCC unroll 8
  for (int q = 0; q < O; ++q)
    for (int r = 0; r < R; ++r) a[q][r][0] = a[q][r][1] = _mm512_setzero_ps();
  int64_t i = 0;
  // one row streams the weight: ask for the lines this far on (vec.h's stream_prefetch; 0: not)
  const Ahead ahead = R == 1 ? stream_ahead(kFloatStreams) : Ahead{0, false};
  for (; i + 32 <= in; i += 32) {
#pragma GCC unroll 4
    for (int q = 0; q < O; ++q) {
      const W* wr = w + (o0 + q * stride) * in;
      if (R == 1 && ahead.bytes) {
        const char* line = reinterpret_cast<const char*>(wr + i) + ahead.bytes;
        prefetch_line(line, ahead.l2);
        if constexpr (sizeof(W) == 4) prefetch_line(line + 64, ahead.l2);
      }
      const __m512 v0 = load16(wr + i), v1 = load16(wr + i + 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        a[q][r][0] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x + r * in + i), a[q][r][0]);
        a[q][r][1] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x + r * in + i + 16), a[q][r][1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < O; ++q) {
    const int64_t o = o0 + q * stride;
    const W* wr = w + o * in;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float sum = _mm512_reduce_add_ps(_mm512_add_ps(a[q][r][0], a[q][r][1]));
      for (int64_t j = i; j < in; ++j) sum += widen(wr[j]) * x[r * in + j];
      store(y, r, o, out_stride, sum, bias);
    }
  }
}

// Weight rows read at once by R input rows (`band` below): four with one row, two with two.
template <int R>
constexpr int kStreams = R == 1 ? 4 : R == 2 ? 2 : 1;
#elif defined(CONTBATCH_AVX2)
// The same on AVX2 (8 values a vector, 16 registers). The portable loop below ran bfloat16
// weights through a scalar widening and one dependent add chain: on an AVX2-only CPU one
// row read bfloat16 weights at 10-15 GB/s, no faster than float32 ones of twice the bytes.
// A = independent FMA chains per input row: four for one row, fewer as rows add chains of
// their own (and registers run out: O x A x R accumulators + the weight vectors <= 16).
// O output features `stride` apart, as the AVX-512 outputs above; load8 and hsum8 are in vec.h.
template <int R, int O, typename W>
void outputs(const float* x, const W* w, const float* bias, W* y, int64_t in, int64_t o0, int64_t stride,
             int64_t out_stride) {
  constexpr int A = R == 1 ? 4 : R <= 3 ? 2 : 1;
  __m256 a[O][R][A];
#pragma GCC unroll 8
  for (int q = 0; q < O; ++q)
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int k = 0; k < A; ++k) a[q][r][k] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 * A <= in; i += 8 * A) {
#pragma GCC unroll 4
    for (int q = 0; q < O; ++q) {
      const W* wr = w + (o0 + q * stride) * in;
      __m256 v[A];
#pragma GCC unroll 4
      for (int k = 0; k < A; ++k) v[k] = load8(wr + i + 8 * k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int k = 0; k < A; ++k)
          a[q][r][k] = _mm256_fmadd_ps(v[k], _mm256_loadu_ps(x + r * in + i + 8 * k), a[q][r][k]);
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < O; ++q) {
    const int64_t o = o0 + q * stride;
    const W* wr = w + o * in;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256 t = a[q][r][0];
#pragma GCC unroll 4
      for (int k = 1; k < A; ++k) t = _mm256_add_ps(t, a[q][r][k]);
      float sum = hsum8(t);
      for (int64_t j = i; j < in; ++j) sum += widen(wr[j]) * x[r * in + j];
      store(y, r, o, out_stride, sum, bias);
    }
  }
}

// Weight rows read at once: three with one row, two with two (as many streams as the sixteen
// registers hold beside the accumulators).
template <int R>
constexpr int kStreams = R == 1 ? 3 : R == 2 ? 2 : 1;
#else
template <int R, typename W>
void band(const float* x, const W* w, const float* bias, W* y, int64_t in, int64_t begin, int64_t end,
          int64_t out_stride) {
  for (int64_t o = begin; o < end; ++o) {
    const W* wr = w + o * in;
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * in;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < in; ++i) sum += widen(wr[i]) * xr[i];
      store(y, r, o, out_stride, sum, bias);
    }
  }
}
#endif

#if defined(CONTBATCH_AVX512) || defined(CONTBATCH_AVX2)
// Output features [begin, end) against R rows: with one or two rows, kStreams<R> features at a
// time, each from its own stretch of the band. One stream of weight rows left the memory reads
// of a lone request's decode short of the bandwidth that several concurrent streams reach
// (docs/cpu.md); more rows have the arithmetic of several rows to cover the reads.
template <int R, typename W>
void band(const float* x, const W* w, const float* bias, W* y, int64_t in, int64_t begin, int64_t end,
          int64_t out_stride) {
  constexpr int O = kStreams<R>;
  const int64_t stride = (end - begin) / O;
  for (int64_t o = begin; o < begin + stride; ++o) outputs<R, O>(x, w, bias, y, in, o, stride, out_stride);
  for (int64_t o = begin + O * stride; o < end; ++o) outputs<R, 1>(x, w, bias, y, in, o, 0, out_stride);
}
#endif

template <typename W>
using BandFn = void (*)(const float*, const W*, const float*, W*, int64_t, int64_t, int64_t, int64_t);

template <typename W>
BandFn<W> pick(int64_t rows) {
  static const BandFn<W> table[kMaxRows] = {band<1, W>, band<2, W>, band<3, W>, band<4, W>,
                                            band<5, W>, band<6, W>, band<7, W>};
  return table[rows - 1];
}

template <typename T>
std::vector<float> widened(const T* p, int64_t n) {
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = widen(p[i]);
  return out;
}

// Linears of one input in one parallel region (small_linear is the case of one weight; a
// decoder layer's q/k/v and gate/up are several): with one row, each region costs a fork and
// join, ~200 regions a step of the default model, not small beside the weight reading
// (docs/cpu.md). The tasks take bands of the outputs of all weights laid end to end; an
// output's value does not depend on the band it falls in (the same band function on the same
// row), so the results are bit-identical to one call per weight.
template <typename T>
std::vector<at::Tensor> run_many(const at::Tensor& x, at::TensorList weights,
                                 const std::vector<std::optional<at::Tensor>>& biases) {
  const int64_t rows = x.size(0), in = x.size(1), n = static_cast<int64_t>(weights.size());
  // Activations (and biases) in float32 once: a few rows, read from L1 for every weight row.
  std::vector<float> xs;
  const float* xp = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    xp = x.data_ptr<float>();
  } else {
    xs = widened(x.data_ptr<T>(), rows * in);
    xp = xs.data();
  }
  std::vector<at::Tensor> ys(n);
  std::vector<std::vector<float>> bs(n);
  std::vector<const float*> bp(n, nullptr);
  std::vector<int64_t> first(n + 1, 0);  // the outputs of weight i are [first[i], first[i + 1]) end to end
  for (int64_t i = 0; i < n; ++i) {
    const int64_t out = weights[i].size(0);
    ys[i] = at::empty({rows, out}, x.options());
    if (biases[i].has_value() && biases[i]->defined()) {
      bs[i] = widened(biases[i]->contiguous().data_ptr<T>(), out);
      bp[i] = bs[i].data();
    }
    first[i + 1] = first[i] + out;
  }
  const BandFn<T> fn = pick<T>(rows);
  at::parallel_for(0, first[n], 32, [&](int64_t begin, int64_t end) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t lo = std::max(begin, first[i]), hi = std::min(end, first[i + 1]);
      if (lo < hi)
        fn(xp, weights[i].data_ptr<T>(), bp[i], ys[i].data_ptr<T>(), in, lo - first[i], hi - first[i],
           weights[i].size(0));
    }
  });
  return ys;
}

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return run_many<T>(x, weight, {bias})[0];
}

// x is [..., I] like nn.Linear's input (a step's [1, R, I]): flattened and shaped back here, where
// it costs ~0.2 us, rather than in the Python wrapper, where the reshape, contiguous and view
// cost ~10 us on each of a lone request's ~210 linears per step.
at::Tensor small_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() >= 1 && weight.dim() == 2 && input.size(-1) == weight.size(1),
              "small_linear: x [..., I], weight [O, I]");
  const at::Tensor x = input.reshape({-1, input.size(-1)}).contiguous();
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_linear takes 1 to ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(weight.is_contiguous(), "small_linear: the weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "small_linear: x and weight must share a dtype");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type() && bias->numel() == weight.size(0),
                "small_linear: the bias must have the weight's dtype and one value per output feature");
  }
  at::Tensor y;
  float_or_bf16(weight.scalar_type(), "small_linear", [&](auto tag) { y = run<decltype(tag)>(x, weight, bias); });
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = weight.size(0);
  return y.view(shape);
}

std::vector<at::Tensor> small_linears(const at::Tensor& input, at::TensorList weights,
                                      const c10::List<std::optional<at::Tensor>>& biases) {
  TORCH_CHECK(!weights.empty() && biases.size() == weights.size(), "small_linears: one bias (or None) per weight");
  const at::Tensor x = input.reshape({-1, input.size(-1)}).contiguous();
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_linears takes 1 to ", kMaxRows, " rows, got ",
              x.size(0));
  const std::vector<std::optional<at::Tensor>> bias = biases.vec();
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
                "small_linears: contiguous weights [O, I] of the input's dtype");
    if (bias[i].has_value() && bias[i]->defined()) {
      TORCH_CHECK(bias[i]->scalar_type() == w.scalar_type() && bias[i]->numel() == w.size(0),
                  "small_linears: each bias must have its weight's dtype and one value per output feature");
    }
  }
  std::vector<at::Tensor> ys;
  float_or_bf16(x.scalar_type(), "small_linears", [&](auto tag) { ys = run_many<decltype(tag)>(x, weights, bias); });
  for (size_t i = 0; i < ys.size(); ++i) {
    std::vector<int64_t> shape = input.sizes().vec();
    shape.back() = weights[i].size(0);
    ys[i] = ys[i].view(shape);
  }
  return ys;
}

// The kernels a routed layer can take (cpu/ops.py's `ROUTED_CODES`).
using contbatch_layer::kAten, contbatch_layer::kNative, contbatch_layer::kOneDnn, contbatch_layer::kPanel;
using contbatch_layer::kRegimes, contbatch_layer::regime_of;

at::Tensor onednn_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               std::string_view, c10::List<std::optional<c10::Scalar>>,
                                               std::optional<std::string_view>)>();
  const at::Tensor y = op.call(input.reshape({-1, input.size(-1)}).contiguous(), weight, bias, "none",
                               c10::List<std::optional<c10::Scalar>>(), std::string_view(""));
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = weight.size(0);
  return y.view(shape);
}

// A linear layer in a compiled step, its kernel chosen here by the row count (regime_of): `one`
// for one row, `few` for 2-7, `batch` up to kPanelMaxRows, `many` for more. Chosen in Python
// instead, the choice is a branch on the row count that Dynamo traces as one graph per regime:
// four graphs (and four traces of the layers) per start where one serves every row count.
at::Tensor routed_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         int64_t one, int64_t few, int64_t batch, int64_t many) {
  const int64_t rows = input.size(-1) == 0 ? 0 : input.numel() / input.size(-1);
  const int64_t codes[kRegimes] = {one, few, batch, many};
  const int64_t kernel = rows == 0 ? kAten : codes[regime_of(rows)];
  switch (kernel) {
    case kNative:
      TORCH_CHECK(rows <= kMaxRows, "routed_linear: the native kernel takes 1 to ", kMaxRows, " rows");
      return small_linear(input, weight, bias);
    case kOneDnn:
      return onednn_linear(input, weight, bias);
    case kAten:
    case kPanel:  // its packed weight is not an input here: aten's linear (ops.py)
      return at::linear(input, weight, bias);
    default:
      TORCH_CHECK(false, "routed_linear: unknown kernel code ", kernel);
  }
}

// The prefetch setting of one kind of stream (vec.h's stream_prefetch: 0 float weights, 1
// packed codes, 2 decode attention's K/V rows): `bytes` ahead (a multiple of 64, 0 for none)
// filling `level` (1: L1, 2: L2), or only read (bytes -1). Returns the setting before, [bytes,
// level].
std::vector<int64_t> stream_prefetch_op(int64_t kind, int64_t bytes, int64_t level) {
  TORCH_CHECK(kind >= 0 && kind < kStreamKinds, "stream_prefetch: kind 0 (float), 1 (packed) or 2 (kv)");
  TORCH_CHECK(bytes == -1 || (bytes >= 0 && bytes % 64 == 0), "stream_prefetch: bytes a multiple of 64, or -1");
  TORCH_CHECK(bytes == -1 || level == kFillL1 || level == kFillL2, "stream_prefetch: level 1 (L1) or 2 (L2)");
  std::atomic<int64_t>& setting = stream_prefetch(kind);
  const int64_t before = bytes < 0 ? setting.load() : setting.exchange(bytes | level);
  return {before & ~int64_t{63}, before & 63};
}

}  // namespace

namespace contbatch_parts {

// run_many<float>'s work for thread t: its band of the outputs, by the same band function.
void small_linears_share(const float* x, int64_t rows, int64_t in, const FloatRef* linears, int64_t n, int64_t t,
                         int64_t threads) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += linears[i].out;
  const auto [begin, end] = share_of(total, 32, t, threads);
  const BandFn<float> fn = pick<float>(rows);
  for (int64_t i = 0, first = 0; i < n; first += linears[i].out, ++i) {
    const FloatRef& l = linears[i];
    const int64_t lo = std::max(begin, first), hi = std::min(end, first + l.out);
    if (lo < hi) fn(x, l.weight, l.bias, l.y, in, lo - first, hi - first, l.out);
  }
}

}  // namespace contbatch_parts

TORCH_LIBRARY_FRAGMENT(contbatch_cpu, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("small_linears(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor[]");
  m.def("routed_linear(Tensor x, Tensor weight, Tensor? bias, int one, int few, int batch, int many) -> Tensor");
  m.def("stream_prefetch(int kind, int bytes, int level) -> int[]", stream_prefetch_op);
}

TORCH_LIBRARY_IMPL(contbatch_cpu, CPU, m) {
  m.impl("small_linear", small_linear);
  m.impl("small_linears", small_linears);
  m.impl("routed_linear", routed_linear);
}

// Weight-only quantized linear layers: y = x W^T + b, W stored as int8 or int4 codes with a
// fp16 scale (and, for int4, an fp16 min) per group of `group` consecutive inputs.
//
// The layout (cpu/quant/format.py is its Python side, and the reason for it):
//   int8: codes int8 [O, I], w = code * scale
//   int4: codes uint8 [O, I / 2]; within each block of 32 inputs, byte j (0..15) holds input j
//         in its low nibble and input j + 16 in its high one (ggml's Q4_0/Q4_1 block order, so
//         GGUF blocks are copied in as they are); w = code * scale + min
//   scales, mins: float16 [O, I / group] (ggml's block fields as they are); group is a multiple
//         of 32 dividing I.
// Every weight is rebuilt (in registers, or in a panel buffer) as the dequantized float32 value
// exactly (one rounded product, then one rounded sum: the library is built with
// -ffp-contract=off), so the output differs from F.linear on the dequantized weight by the
// summation order only; except one or two rows of int8 weights (a lone request decoding),
// where each group's scale multiplies the codes' dot product with x once instead of every
// code: one product fewer per weight, read from several places of the band at once
// (int8_outputs), at the cost of float rounding.
//
// Where the library has AVX-512 VNNI, weights with a multiple of 16 output features are
// tiled (quant_tiles.h) and every row count runs the integer kernels there; the rest of this
// comment is the row layout's path.
//
// One to seven rows (decode) read each code once and multiply it into every row while it is
// in registers: the layer reads a quarter (int8) or an eighth (int4) of the float32 bytes.
// A few more (up to panel_rows) run the same kernels seven rows at a time over small bands of
// output features (the codes then come from L1 for every chunk after the first). From
// panel_rows on, a panel of 32 output features at a time is dequantized once for all the rows
// and multiplied by them in the float32 panel tiles (quant_panels.h): there the arithmetic,
// not the weight read, bounds the time, and a weight rebuilt once per chunk of seven rows cost
// more than the products (docs/cpu.md). More than kCallRows rows are split into calls of
// kCallRows, for either layout.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "decoder_layer.h"
#include "layer_parts.h"
#include "quant_bands.h"
#include "quant_panels.h"
#include "quant_tiles.h"

namespace {

using namespace contbatch_quant;

// Rows of a few_rows call (decoder_layer.h's kQuantCallRows): more are split into calls of this
// many (x's digits of the tiled layout and the panel path's rows stay small).
constexpr int64_t kCallRows = contbatch_layer::kQuantCallRows;
constexpr int64_t kSubBand = 16;  // output features whose codes the row chunks share from L1
// From this many rows a row-layout weight runs the panel tiles (quant_panels.h): below, the
// chunks of seven rows beat them (measured per the default model's layers: docs/cpu.md).
inline int64_t panel_rows(const Packed& p) { return p.bits == 8 ? 16 : 12; }
constexpr int64_t kUnitsPerThread = 8;  // units of output features per thread and call, many rows (few_rows)


Packed check(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t format,
             int64_t group, const char* op) {
  const bool tiled = (format & kTiledFlag) != 0, symmetric = (format & kSymmetricFlag) != 0;
  const int64_t bits = format & ~(kTiledFlag | kSymmetricFlag);
  TORCH_CHECK(bits == 8 || bits == 4, op, ": bits must be 8 or 4, got ", bits);
  TORCH_CHECK(!symmetric || (tiled && bits == 4), op, ": the symmetric flag is for tiled int4 weights");
#if defined(CONTBATCH_QUANT_TILES)
  TORCH_CHECK(!tiled || (codes.dim() == 2 && codes.size(0) % kTile == 0), op,
              ": tiled weights have a multiple of ", kTile, " output features");
#else
  TORCH_CHECK(!tiled, op, ": tiled weights need AVX-512 VNNI, which this build lacks");
#endif
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.device().is_cpu(), op,
              ": codes must be a contiguous 2-d CPU tensor");
  TORCH_CHECK(codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte), op, ": ", bits == 8 ? "int8" : "uint8",
              " codes for ", bits, "-bit weights, got ", codes.scalar_type());
  const int64_t out = codes.size(0), in = bits == 8 ? codes.size(1) : codes.size(1) * 2;
  TORCH_CHECK(group > 0 && group % kBlock == 0 && in % group == 0, op, ": the group (", group,
              ") must be a multiple of 32 dividing the inputs (", in, ")");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == out && scales.size(1) == in / group,
              op, ": float16 scales [out, in / group]");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(has_mins == (bits == 4), op, ": int4 weights take mins, int8 ones none");
  if (has_mins) {
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->is_contiguous() && mins->sizes() == scales.sizes(), op,
                ": float16 mins shaped as the scales");
  }
  Packed p{static_cast<const uint8_t*>(codes.data_ptr()),
           scales.data_ptr<at::Half>(), has_mins ? mins->data_ptr<at::Half>() : nullptr, in, group, bits, out};
  p.tiled = tiled;
  p.symmetric = symmetric;
  return p;
}


// Output rows [begin, end) dequantized into tile (float32 [end - begin, I]).
void dequantize_rows(const Packed& p, int64_t begin, int64_t end, float* tile) {
#if defined(CONTBATCH_QUANT_TILES)
  if (p.tiled) {  // whole tiles: begin and end are multiples of kTile
    TORCH_CHECK(begin % kTile == 0 && end % kTile == 0, "tiled rows are dequantized a tile at a time");
    at::parallel_for(begin / kTile, end / kTile, 1, [&](int64_t lo, int64_t hi) {
      tiled_store_rows(p, lo * kTile, hi * kTile, tile + (lo * kTile - begin) * p.in);
    });
    return;
  }
#endif
  at::parallel_for(begin, end, 16, [&](int64_t lo, int64_t hi) {
    store_rows(p, lo, hi, tile + (lo - begin) * p.in);
  });
}

at::Tensor quant_dequantize(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                            int64_t bits, int64_t group) {
  const Packed p = check(codes, scales, mins, bits, group, "quant_dequantize");
  at::Tensor w = at::empty({codes.size(0), p.in}, scales.options().dtype(at::kFloat));
  dequantize_rows(p, 0, codes.size(0), w.data_ptr<float>());
  return w;
}

// Output features `ids` of a packed weight (an embedding's lookup) as float32 rows [n, I], each
// by dequantize_rows (so equal to that row of quant_dequantize's output): a row of the row
// layout alone, a tiled weight's whole tile (the unit its layout is read in) and its row kept.
at::Tensor quant_rows(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                      const at::Tensor& ids, int64_t bits, int64_t group) {
  const Packed p = check(codes, scales, mins, bits, group, "quant_rows");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.device().is_cpu(),
              "quant_rows: ids must be a 1-d int64 CPU tensor, got ", ids.scalar_type(), " ", ids.sizes());
  const at::Tensor idx = ids.contiguous();
  const int64_t n = idx.size(0), in = p.in;
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < p.out, "quant_rows: id ", id[i], " is outside the ", p.out, " rows");
  at::Tensor out = at::empty({n, in}, scales.options().dtype(at::kFloat));
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(p.tiled ? kTile * in : 0);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t o = id[i];
      if (!p.tiled) {
        dequantize_rows(p, o, o + 1, y + i * in);
        continue;
      }
      const int64_t first = o - o % kTile;
      dequantize_rows(p, first, first + kTile, tile.data());
      std::copy_n(tile.data() + (o - first) * in, in, y + i * in);
    }
  });
  return out;
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

#if defined(CONTBATCH_QUANT_TILES)
#define QUANT_XD &xd
#else
struct XDigits {};
#define QUANT_XD nullptr
#endif

// Output features [begin, end) of packed linears laid end to end (linear i's are [first[i],
// first[i + 1])) against x: float32 [rows, in] for the row layout, its digits (xd) for tiled
// weights. An output's value does not depend on the band it falls in.
void band_of_linears(const std::vector<Packed>& ps, const float* const* bias, float* const* y, const int64_t* first,
                     [[maybe_unused]] const XDigits* xd, const float* xp, int64_t rows, int64_t begin, int64_t end) {
  const int64_t n = static_cast<int64_t>(ps.size()), in = ps[0].in;
  // More than kMaxRows rows and fewer than panel_rows: in chunks of at most kMaxRows (as even
  // as they go), every chunk over a sub-band of kSubBand output features before the next
  // sub-band, so that the codes are read from memory once and from L1 by the other chunks.
  const int64_t chunks = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t sub_band = chunks == 1 ? first[n] : kSubBand;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lo = std::max(begin, first[i]) - first[i], hi = std::min(end, first[i + 1]) - first[i];
#if defined(CONTBATCH_QUANT_TILES)
    if (ps[i].tiled) {  // whole tiles: a band's ends rounded up to a tile (out is a multiple of one)
      const int64_t t_lo = (lo + kTile - 1) / kTile * kTile, t_hi = (hi + kTile - 1) / kTile * kTile;
      if (lo < hi && t_lo < t_hi) tiled_band(ps[i], *xd, bias[i], y[i], ps[i].out, t_lo, t_hi);
      continue;
    }
#endif
    if (rows >= panel_rows(ps[i])) {
      if (lo < hi) panel_band(ps[i], xp, rows, bias[i], y[i], ps[i].out, lo, hi);
      continue;
    }
    for (int64_t s = lo; s < hi; s += sub_band)
      for (int64_t c = 0, r0 = 0; c < chunks; ++c) {
        const int64_t r = (rows - r0) / (chunks - c);
        pick(r)(ps[i], xp + r0 * in, bias[i], y[i] + r0 * ps[i].out, ps[i].out, s, std::min(hi, s + sub_band));
        r0 += r;
      }
  }
}

// Packed linears of one input x (1 to kCallRows rows) in one parallel region: each output
// feature is computed by the same band function as quant_linear's, so every output equals
// quant_linear's on that weight bit for bit; one fork and join instead of one per linear.
std::vector<at::Tensor> few_rows(const at::Tensor& input, const std::vector<Packed>& ps,
                                 const std::vector<at::Tensor>& biases) {
  const int64_t in = ps[0].in, rows = input.numel() / in, n = static_cast<int64_t>(ps.size());
  const bool all_tiled = std::all_of(ps.begin(), ps.end(), [](const Packed& p) { return p.tiled; });
  [[maybe_unused]] const bool any_tiled = std::any_of(ps.begin(), ps.end(), [](const Packed& p) { return p.tiled; });
  TORCH_CHECK(rows >= 1 && rows <= kCallRows, "quant_linears takes 1 to ", kCallRows, " rows, got ", rows);
  // float32 x for the row layout's kernels; tiled weights read bfloat16 x as it is (make_digits)
  const bool bf16_digits = all_tiled && input.scalar_type() == at::kBFloat16;
  const at::Tensor x = input.reshape({rows, in}).to(bf16_digits ? at::kBFloat16 : at::kFloat).contiguous();
  const at::TensorOptions out_options = x.options().dtype(at::kFloat);
  std::vector<at::Tensor> ys(n);
  std::vector<int64_t> first(n + 1, 0);  // the outputs of linear i are [first[i], first[i + 1]) end to end
  for (int64_t i = 0; i < n; ++i) {
    ys[i] = at::empty({rows, ps[i].out}, out_options);
    first[i + 1] = first[i] + ps[i].out;
  }
  const float* xp = bf16_digits ? nullptr : x.data_ptr<float>();
#if defined(CONTBATCH_QUANT_TILES)
  // x as integer digits once for every tiled linear of the call (quant_digits.h)
  // (a reference: the pool's threads read the calling thread's digits, not their own)
  static thread_local XDigits digits;
  XDigits& xd = digits;
  // bfloat16 x (8 significant bits) in two digits, float32 in three (quant_digits.h)
  const int x_digits = input.scalar_type() == at::kBFloat16 ? 2 : 3;
  if (bf16_digits) make_digits(x.data_ptr<c10::BFloat16>(), rows, in, x_digits, xd);
  else if (any_tiled) make_digits(xp, rows, in, x_digits, xd);
#endif
  std::vector<const float*> bp(n);
  std::vector<float*> yp(n);
  for (int64_t i = 0; i < n; ++i) {
    bp[i] = biases[i].defined() ? biases[i].data_ptr<float>() : nullptr;
    yp[i] = ys[i].data_ptr<float>();
  }
  auto band_of_call = [&](int64_t begin, int64_t end) {
    band_of_linears(ps, bp.data(), yp.data(), first.data(), QUANT_XD, xp, rows, begin, end);
  };
  // The output features are handed out in units on demand (an atomic counter), not as one fixed
  // share per thread: a thread slowed by other work on its core (the server's event loop,
  // tokenizing) then takes fewer units instead of holding the whole team at the region's end.
  // Units are whole pairs of tiles, several per thread where many rows make a unit long
  // arithmetic; one or two rows stream the weights, whose reads are fastest in one long band
  // per thread (measured: eight units each made a lone decode slower).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t per_thread = rows > 2 ? kUnitsPerThread : 1;
  const int64_t unit = std::max<int64_t>(32, (first[n] / (threads * per_thread) + 31) / 32 * 32);
  const int64_t units = (first[n] + unit - 1) / unit;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, units), 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
      const int64_t begin = u * unit, end = std::min(first[n], begin + unit);
      band_of_call(begin, end);
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

at::Tensor quant_linear(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias, int64_t bits,
                        int64_t group) {
  const Packed p = check(codes, scales, mins, bits, group, "quant_linear");
  check_input(input, p.in, "quant_linear");
  const int64_t out = codes.size(0), rows = input.numel() / p.in;
  const at::Tensor b = float_bias(bias, out, "quant_linear");
  if (rows == 0) return shaped(at::empty({0, out}, input.options().dtype(at::kFloat)), input);
  if (rows <= kCallRows) return few_rows(input, {p}, {b})[0];
  const at::Tensor x = input.reshape({rows, p.in});
  std::vector<at::Tensor> parts;
  for (int64_t r0 = 0; r0 < rows; r0 += kCallRows)
    parts.push_back(few_rows(x.narrow(0, r0, std::min(kCallRows, rows - r0)), {p}, {b})[0]);
  return shaped(at::cat(parts, 0), input);
}

// Whether this build has the tiled layout's integer kernels (AVX-512 VNNI).
bool quant_tiles() {
#if defined(CONTBATCH_QUANT_TILES)
  return true;
#else
  return false;
#endif
}

}  // namespace

namespace contbatch_parts {

// few_rows' work for float32 x and one band per thread (as it hands one or two rows out); the
// digits of x are made by every thread for itself, the same digits as few_rows' one copy.
void quant_linears_share(const float* x, int64_t rows, const QuantRef* linears, int64_t n, int64_t t,
                         int64_t threads) {
  std::vector<Packed> ps;
  std::vector<const float*> bias(n);
  std::vector<float*> y(n);
  std::vector<int64_t> first(n + 1, 0);
  [[maybe_unused]] bool any_tiled = false;
  for (int64_t i = 0; i < n; ++i) {
    const QuantRef& l = linears[i];
    ps.push_back(check(*l.codes, *l.scales, *l.mins, l.format, l.group, "quant_linears"));
    any_tiled = any_tiled || ps.back().tiled;
    bias[i] = l.bias;
    y[i] = l.y;
    first[i + 1] = first[i] + ps.back().out;
  }
  const auto [begin, end] = share_of(first[n], 32, t, threads);
  if (begin >= end) return;
#if defined(CONTBATCH_QUANT_TILES)
  static thread_local XDigits digits;
  XDigits& xd = digits;
  if (any_tiled) make_digits(x, rows, ps[0].in, 3, xd);
#endif
  band_of_linears(ps, bias.data(), y.data(), first.data(), QUANT_XD, x, rows, begin, end);
}

}  // namespace contbatch_parts

TORCH_LIBRARY_FRAGMENT(contbatch_cpu, m) {
  m.def("quant_tiles() -> bool", quant_tiles);
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? bias, int bits, int group) -> Tensor");
  m.def("quant_dequantize(Tensor codes, Tensor scales, Tensor? mins, int bits, int group) -> Tensor");
  m.def("quant_rows(Tensor codes, Tensor scales, Tensor? mins, Tensor ids, int bits, int group) -> Tensor");
  m.def("quant_linears(Tensor x, Tensor[] codes, Tensor[] scales, Tensor?[] mins, Tensor?[] biases, int[] bits, "
        "int[] groups) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(contbatch_cpu, CPU, m) {
  m.impl("quant_linear", quant_linear);
  m.impl("quant_dequantize", quant_dequantize);
  m.impl("quant_rows", quant_rows);
  m.impl("quant_linears", quant_linears);
}

// A Llama-family decoder layer as one call: a step's whole layer without Python.
//
// In eager mode a decoder layer of the default model is ~12 module calls and ~40 small op
// calls, each through Python (docs/cpu.md says what they cost). Here the layer calls the same
// kernels in the same order with the same arguments as the Python path does (our RMSNorm,
// linear, rotary, K/V write and decode attention ops, aten's add, silu and mul), so its output
// is bit-identical; the engine checks that at run time, once per layer variant and kind of
// step (cpu/routers/layer.py).
//
// `decoder_stack` runs one or more consecutive layers of a step in one call
// (cpu/routers/fused_layer.py: one while a kind of step is checked, then every layer of the
// model), layer after layer; a decode step of few rows whose linears are all ours runs them
// inside one parallel region instead (decode_region_cpu.cpp), bit for bit the same.
//
// Layout of the arguments (cpu/routers/fused_layer.py builds them), each list one layer after the other:
//   weights: input norm, q, k, v, o, post-attention norm, gate, up, down[, q norm, k norm]
//   biases, packed: one per linear (q, k, v, o, gate, up, down), None where it has none
//   codes: the linears' routes, kRegimes kernel codes each (small_linear_cpu.cpp's routed_linear)
//   eps: the norms' epsilons, in the weights' order
//   key_caches, value_caches, scales, windows: one per layer
//   lora_a, lora_bt: one per linear, None where no adapter of the step applies to it; with
//   lora_rows, lora_drop, lora_inverse and lora_bounds, the step's LoRA groups (lora/segments.py)
//   quant_scales, quant_mins, quant_formats: for a packed linear (cpu/quant/linear.py's QuantLinear,
//   route code kQuant, its codes in `weights`), its scales, mins (int4) and (bits, group); None,
//   None and (0, 0) for a float one

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "decoder_layer.h"

namespace {

using namespace contbatch_layer;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto op =
      find("contbatch_cpu::rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x.contiguous(), weight, eps);
}

// lora/segments.py's `lora_products`, added as lora/hooks.py's `add_lora` adds it, by the same
// ops in the same order (so bit-identical): padded groups all at once as two batched products,
// the padding entries zeroed; segmented groups two products each, into an array whose last
// entry is zero; the products gathered back into row order and added (a row of no adapter adds
// a zero entry).
at::Tensor add_lora(const at::Tensor& x, const at::Tensor& y, int64_t index, const Layer& layer, const Step& step) {
  const std::optional<at::Tensor>& a = layer.lora_a[index];
  if (!a.has_value()) return y;
  const at::Tensor& bt = *layer.lora_bt[index];
  const int64_t in = x.size(-1), out = y.size(-1);
  const at::Tensor x2 = x.reshape({-1, in});
  at::Tensor y2 = y.reshape({-1, out});
  if (step.lora_bounds.empty()) {
    const at::Tensor xs = x2.index_select(0, *step.lora_rows).view({a->size(0), -1, in});
    const at::Tensor h = at::bmm(xs, a->transpose(1, 2)).masked_fill_(*step.lora_drop, 0);
    y2.add_(at::bmm(h, bt).view({-1, out}).index_select(0, *step.lora_inverse));
    return y2.view(y.sizes());
  }
  const at::Tensor xs = x2.index_select(0, *step.lora_rows);
  const int64_t n = xs.size(0);
  const at::ArrayRef<int64_t> bounds = step.lora_bounds;
  at::Tensor h = xs.new_empty({n, a->size(1)});
  at::Tensor products = xs.new_empty({n + 1, out});
  products.select(0, n).zero_();
  for (size_t g = 0; g + 1 < bounds.size(); ++g) {
    const int64_t start = bounds[g], rows = bounds[g + 1] - bounds[g];
    at::Tensor h_g = h.narrow(0, start, rows), products_g = products.narrow(0, start, rows);
    at::mm_out(h_g, xs.narrow(0, start, rows), a->select(0, static_cast<int64_t>(g)).t());
    at::mm_out(products_g, h_g, bt.select(0, static_cast<int64_t>(g)));
  }
  y2.add_(products.index_select(0, *step.lora_inverse));
  return y2.view(y.sizes());
}

// One linear as cpu/routers/linear.py's `_routed_forward` runs it: the route's kernel for this
// row count, oneDNN on the prepacked weight for more than one row where there is one, the panel
// kernel on its packed weight.
at::Tensor linear_only(const at::Tensor& x, int64_t index, const Layer& layer) {
  static const auto small =
      find("contbatch_cpu::small_linear")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  static const auto pointwise =
      find("mkldnn::_linear_pointwise")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                            c10::List<std::optional<c10::Scalar>>, std::optional<std::string_view>)>();
  static const auto panel =
      find("contbatch_cpu::panel_linear")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  static const auto quant =
      find("contbatch_cpu::quant_linear")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&, int64_t, int64_t)>();
  const at::Tensor& weight = layer.weights[kWeightOf[index]];
  const std::optional<at::Tensor>& bias = layer.biases[index];
  const int64_t rows = x.numel() / x.size(-1);
  const int64_t kernel = layer.codes[kRegimes * index + regime_of(rows)];
  if (kernel == kNative) return small.call(x, weight, bias);
  if (kernel == kPanel) {
    TORCH_CHECK(layer.packed[index].has_value(), "decoder_stack: a panel linear without its packed weight");
    return panel.call(x, weight, *layer.packed[index], bias);
  }
  if (kernel == kQuant)  // QuantLinear.forward's call
    return quant.call(x, weight, *layer.quant_scales[index], layer.quant_mins[index], bias,
                      layer.quant_formats[2 * index], layer.quant_formats[2 * index + 1]);
  if (kernel == kOneDnn) {
    const std::optional<at::Tensor>& blocked = layer.packed[index];
    const at::Tensor& w = (rows > 1 && blocked.has_value()) ? *blocked : weight;
    const at::Tensor y = pointwise.call(x.reshape({-1, x.size(-1)}).contiguous(), w, bias, "none",
                                        c10::List<std::optional<c10::Scalar>>(), std::string_view(""));
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = y.size(-1);
    return y.view(shape);
  }
  TORCH_CHECK(kernel == kAten, "decoder_stack: unknown kernel code ", kernel);
  return at::linear(x, weight, bias);
}

// A linear module's call: its kernel, then its LoRA hook's contribution where it has one.
at::Tensor linear(const at::Tensor& x, int64_t index, const Layer& layer, const Step& step) {
  return add_lora(x, linear_only(x, index, layer), index, layer, step);
}

// Linears of one input (q/k/v; gate/up): in one parallel region where all of them take our
// few-row float kernel at this row count, or all are packed (small_linears, quant_linears: the
// same outputs bit for bit, one fork and join instead of one per linear), else one by one.
std::vector<at::Tensor> linears(const at::Tensor& x, std::initializer_list<int64_t> indices, const Layer& layer,
                                const Step& step) {
  static const auto many =
      find("contbatch_cpu::small_linears")
          .typed<std::vector<at::Tensor>(const at::Tensor&, at::TensorList,
                                         const c10::List<std::optional<at::Tensor>>&)>();
  static const auto packed =
      find("contbatch_cpu::quant_linears")
          .typed<std::vector<at::Tensor>(const at::Tensor&, at::TensorList, at::TensorList,
                                         const c10::List<std::optional<at::Tensor>>&,
                                         const c10::List<std::optional<at::Tensor>>&, at::IntArrayRef,
                                         at::IntArrayRef)>();
  const int64_t rows = x.numel() / x.size(-1);
  const int64_t regime = regime_of(rows);
  bool native = true, quant = rows <= kQuantCallRows;
  for (const int64_t index : indices) {
    native = native && layer.codes[kRegimes * index + regime] == kNative;
    quant = quant && layer.codes[kRegimes * index + regime] == kQuant;
  }
  std::vector<at::Tensor> out;
  if (!native && !quant) {
    for (const int64_t index : indices) out.push_back(linear(x, index, layer, step));
    return out;
  }
  std::vector<at::Tensor> weights, scales;
  c10::List<std::optional<at::Tensor>> biases, mins;
  std::vector<int64_t> bits, groups;
  for (const int64_t index : indices) {
    weights.push_back(layer.weights[kWeightOf[index]]);
    biases.push_back(layer.biases[index]);
    if (quant) {
      scales.push_back(*layer.quant_scales[index]);
      mins.push_back(layer.quant_mins[index]);
      bits.push_back(layer.quant_formats[2 * index]);
      groups.push_back(layer.quant_formats[2 * index + 1]);
    }
  }
  out = quant ? packed.call(x, weights, scales, mins, biases, bits, groups) : many.call(x, weights, biases);
  int64_t i = 0;
  for (const int64_t index : indices) {
    out[i] = add_lora(x, out[i], index, layer, step);
    ++i;
  }
  return out;
}

// hidden [1, T, hidden]; cos/sin [1, T, D]; key/value_cache one layer's cache as
// [kv_heads, slots, D]; slots [T] int64. The step's first rows are decode rows (one query
// token each; decode_table [rows, W], decode_kv_lens [rows] int32), the rest prompt chunks
// (chunk_table [chunks, W], chunk_q_start / q_lens / kv_lens [chunks] int32), as the torch
// backend plans them. Returns the layer's output, [1, T, hidden].
at::Tensor layer_forward(const at::Tensor& hidden, const Layer& layer, const Step& step) {
  static const auto rotary = find("contbatch_cpu::rotary")
                                 .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                           const at::Tensor&, const at::Tensor&)>();
  static const auto kv_write = find("contbatch_cpu::kv_write")
                                   .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&)>();
  static const auto decode = find("contbatch_cpu::paged_decode")
                                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                   double, int64_t, double)>();
  static const auto prefill =
      find("contbatch_cpu::paged_prefill")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double, int64_t, double,
                      const at::Tensor&)>();
  const bool qk_norm = layer.weights.size() == 11;
  const at::ArrayRef<at::Tensor> weights = layer.weights;
  const at::ArrayRef<double> eps = layer.eps;
  const int64_t tokens = hidden.size(1), head_dim = step.head_dim;
  const int64_t decode_rows = step.decode_table.has_value() ? step.decode_table->size(0) : 0;
  const bool chunks = step.chunk_table.has_value();

  // Each half in a scope of its own, so that its intermediates are freed when Python's would be
  // (a prompt chunk's are megabytes each).
  at::Tensor mid;
  {  // Attention, as LlamaAttention.forward and attention/paged.py run it.
    const at::Tensor h = rms_norm(hidden, weights[kInNorm], eps[0]);
    const std::vector<at::Tensor> qkv = linears(h, {0, 1, 2}, layer, step);
    at::Tensor q = qkv[0].view({1, tokens, -1, head_dim});
    at::Tensor k = qkv[1].view({1, tokens, -1, head_dim});
    const at::Tensor v = qkv[2].view({1, tokens, -1, head_dim});
    if (qk_norm) {  // Qwen3: a norm over each head's vector before the rotation
      q = rms_norm(q, weights[kQNorm], eps[2]);
      k = rms_norm(k, weights[kKNorm], eps[3]);
    }
    auto [q_rot, k_rot] = rotary.call(q.transpose(1, 2), k.transpose(1, 2), step.cos, step.sin);
    const at::Tensor key = k_rot[0], value = v.transpose(1, 2)[0];  // [kv_heads, T, D]
    kv_write.call(layer.key_cache, layer.value_cache, step.slots, key.stride(-1) == 1 ? key : key.contiguous(),
                  value);
    // attention/torch_backend.py's `attend`: decode rows first, then every prompt chunk in one call.
    const at::Tensor query = q_rot[0].transpose(0, 1);  // [T, heads, D]
    const at::Tensor no_sinks = at::empty({0}, query.options().dtype(at::kFloat));
    at::Tensor attn;
    if (!chunks) {
      attn = decode.call(query.contiguous(), layer.key_cache, layer.value_cache, *step.decode_table,
                         *step.decode_kv_lens, no_sinks, step.block_size, layer.scale, layer.window, 0.0);
    } else {
      attn = at::empty(query.sizes(), query.options());
      if (decode_rows > 0)
        attn.narrow(0, 0, decode_rows)
            .copy_(decode.call(query.narrow(0, 0, decode_rows).contiguous(), layer.key_cache, layer.value_cache,
                               *step.decode_table, *step.decode_kv_lens, no_sinks, step.block_size, layer.scale,
                               layer.window, 0.0));
      prefill.call(query.stride(-1) == 1 ? query : query.contiguous(), layer.key_cache, layer.value_cache,
                   *step.chunk_table, *step.chunk_q_start, *step.chunk_q_lens, *step.chunk_kv_lens, no_sinks,
                   step.block_size, layer.scale, layer.window, 0.0, attn);
    }
    mid = hidden + linear(attn.view({1, tokens, -1}), 3, layer, step);
  }
  at::Tensor product;
  {  // The MLP, as LlamaMLP.forward runs it: down(silu(gate(x)) * up(x)).
    const at::Tensor h2 = rms_norm(mid, weights[kPostNorm], eps[1]);
    const std::vector<at::Tensor> gate_up = linears(h2, {4, 5}, layer, step);
    product = at::silu(gate_up[0]) * gate_up[1];
  }
  return mid + linear(product, 6, layer, step);
}

void check_step(const at::Tensor& hidden, const Step& step) {
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1, "decoder_stack: hidden [1, T, hidden]");
  const int64_t tokens = hidden.size(1);
  const int64_t decode_rows = step.decode_table.has_value() ? step.decode_table->size(0) : 0;
  const bool chunks = step.chunk_table.has_value();
  TORCH_CHECK(chunks == (step.chunk_q_start.has_value() && step.chunk_q_lens.has_value() &&
                         step.chunk_kv_lens.has_value()),
              "decoder_stack: a prompt chunk table with its starts, lengths and key counts");
  TORCH_CHECK(step.slots.size(0) == tokens, "decoder_stack: one slot per token");
  TORCH_CHECK(step.decode_kv_lens.has_value() == (decode_rows > 0) && (chunks || decode_rows == tokens),
              "decoder_stack: decode rows (table and key counts) for the first rows, prompt chunks for the rest");
  TORCH_CHECK(step.lora_rows.has_value() == step.lora_inverse.has_value() &&
                  step.lora_drop.has_value() == (step.lora_rows.has_value() && step.lora_bounds.empty()),
              "decoder_stack: LoRA rows with their inverse, and their padding or their groups' bounds");
}

// Decoder layers of a step, one after the other: what the model's own loop calls layer by layer,
// without a trip through Python (module call, argument lists) of ~30 us each between them.
at::Tensor decoder_stack(const at::Tensor& hidden, at::TensorList weights,
                         const c10::List<std::optional<at::Tensor>>& biases,
                         const c10::List<std::optional<at::Tensor>>& packed, at::IntArrayRef codes,
                         at::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& slots,
                         const std::optional<at::Tensor>& decode_table, const std::optional<at::Tensor>& decode_kv_lens,
                         const std::optional<at::Tensor>& chunk_table, const std::optional<at::Tensor>& chunk_q_start,
                         const std::optional<at::Tensor>& chunk_q_lens, const std::optional<at::Tensor>& chunk_kv_lens,
                         int64_t block_size, at::ArrayRef<double> scales, at::IntArrayRef windows, int64_t head_dim,
                         const c10::List<std::optional<at::Tensor>>& lora_a,
                         const c10::List<std::optional<at::Tensor>>& lora_bt, const std::optional<at::Tensor>& lora_rows,
                         const std::optional<at::Tensor>& lora_drop, const std::optional<at::Tensor>& lora_inverse,
                         at::IntArrayRef lora_bounds, const c10::List<std::optional<at::Tensor>>& quant_scales,
                         const c10::List<std::optional<at::Tensor>>& quant_mins, at::IntArrayRef quant_formats) {
  const int64_t linears = static_cast<int64_t>(biases.size());
  TORCH_CHECK(static_cast<int64_t>(packed.size()) == linears && static_cast<int64_t>(lora_a.size()) == linears &&
                  static_cast<int64_t>(lora_bt.size()) == linears &&
                  static_cast<int64_t>(quant_scales.size()) == linears &&
                  static_cast<int64_t>(quant_mins.size()) == linears,
              "decoder_stack: a bias, packed weight, LoRA factors and scales and mins (or None) for every linear");
  const std::vector<std::optional<at::Tensor>> bias = biases.vec(), blocked = packed.vec();
  const std::vector<std::optional<at::Tensor>> shrink = lora_a.vec(), expand = lora_bt.vec();
  const std::vector<std::optional<at::Tensor>> qscales = quant_scales.vec(), qmins = quant_mins.vec();
  const Step step{cos, sin, slots, decode_table, decode_kv_lens, chunk_table, chunk_q_start, chunk_q_lens,
                  chunk_kv_lens, block_size, head_dim, lora_rows, lora_drop, lora_inverse, lora_bounds};
  return run_stack(hidden,
                   StackView{weights, bias.data(), blocked.data(), codes, eps, key_caches, value_caches, scales,
                             windows, shrink.data(), expand.data(), qscales.data(), qmins.data(), quant_formats,
                             linears},
                   step);
}

}  // namespace

namespace contbatch_layer {

at::Tensor run_stack(const at::Tensor& hidden, const StackView& v, const Step& step) {
  const int64_t layers = static_cast<int64_t>(v.scales.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v.windows.size()) == layers &&
                  static_cast<int64_t>(v.key_caches.size()) == layers &&
                  static_cast<int64_t>(v.value_caches.size()) == layers,
              "decoder_stack: one scale, window and cache per layer");
  const int64_t per_layer = static_cast<int64_t>(v.weights.size()) / layers;
  const int64_t norms = per_layer == 11 ? 4 : 2;
  TORCH_CHECK((per_layer == 9 || per_layer == 11) && static_cast<int64_t>(v.weights.size()) == per_layer * layers,
              "decoder_stack: 9 or 11 weights per layer");
  TORCH_CHECK(v.linears == kLinears * layers && static_cast<int64_t>(v.codes.size()) == kRegimes * kLinears * layers &&
                  static_cast<int64_t>(v.eps.size()) == norms * layers &&
                  static_cast<int64_t>(v.quant_formats.size()) == 2 * kLinears * layers,
              "decoder_stack: per linear a bias, packed weight, LoRA factors, (bits, group) and a route per row regime; "
              "one epsilon per norm");
  check_step(hidden, step);
  for (int64_t i = 0; i < kLinears * layers; ++i) {
    const int64_t layer = i / kLinears, linear = i % kLinears;
    bool any = false, all = true;
    for (int64_t r = 0; r < kRegimes; ++r) {
      const bool q = v.codes[(layer * kLinears + linear) * kRegimes + r] == kQuant;
      any = any || q;
      all = all && q;
    }
    TORCH_CHECK(any == all && all == v.quant_scales[i].has_value(),
                "decoder_stack: a packed linear takes the quantized kernel at every row count, with its scales");
    TORCH_CHECK(v.lora_a[i].has_value() == v.lora_bt[i].has_value() &&
                    (!v.lora_a[i].has_value() || step.lora_rows.has_value()),
                "decoder_stack: LoRA factors in pairs, with the step's LoRA rows");
  }
  std::vector<Layer> each;
  for (int64_t i = 0; i < layers; ++i)
    each.push_back(Layer{v.weights.slice(i * per_layer, per_layer), v.biases + i * kLinears,
                         v.packed + i * kLinears, v.codes.slice(i * kRegimes * kLinears, kRegimes * kLinears),
                         v.eps.slice(i * norms, norms), v.key_caches[i], v.value_caches[i], v.scales[i], v.windows[i],
                         v.lora_a + i * kLinears, v.lora_bt + i * kLinears, v.quant_scales + i * kLinears,
                         v.quant_mins + i * kLinears, v.quant_formats.slice(i * 2 * kLinears, 2 * kLinears)});
  at::Tensor x = decode_region(hidden, each, step);  // a decode step of few rows: one parallel region
  if (x.defined()) return x;
  x = hidden;
  for (const Layer& layer : each) x = layer_forward(x, layer, step);
  return x;
}

}  // namespace contbatch_layer

TORCH_LIBRARY_FRAGMENT(contbatch_cpu, m) {
  m.def(
      "decoder_stack(Tensor hidden, Tensor[] weights, Tensor?[] biases, Tensor?[] packed, int[] codes, float[] eps, "
      "Tensor cos, Tensor sin, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor slots, "
      "Tensor? decode_table, Tensor? decode_kv_lens, Tensor? chunk_table, Tensor? chunk_q_start, "
      "Tensor? chunk_q_lens, Tensor? chunk_kv_lens, int block_size, float[] scales, int[] windows, "
      "int head_dim, Tensor?[] lora_a, Tensor?[] lora_bt, Tensor? lora_rows, Tensor? lora_drop, Tensor? lora_inverse, "
      "int[] lora_bounds, Tensor?[] quant_scales, Tensor?[] quant_mins, int[] quant_formats) -> Tensor");
}

TORCH_LIBRARY_IMPL(contbatch_cpu, CPU, m) {
  m.impl("decoder_stack", decoder_stack);
}

// oneDNN's prepacked weights (opaque tensors of the MkldnnCPU key) among the arguments send the
// call here: the same function, which passes them on to oneDNN's linear.
TORCH_LIBRARY_IMPL(contbatch_cpu, MkldnnCPU, m) {
  m.impl("decoder_stack", decoder_stack);
}

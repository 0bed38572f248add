// A decode step's decoder layers inside one parallel region.
//
// Layer after layer, a decode step of a small model is mostly not its arithmetic: each kernel
// of decoder_layer_cpu.cpp forks and joins the thread pool (five times a layer), and the ops
// around them are called one by one. Here the pool's threads enter once for the whole stack.
// The linears and the attention are shared out (layer_parts.h: each thread a band of outputs
// or a range of tasks, the ops' own band functions), the small serial ops between them
// (norms, rotation, the cache write, the residual sums, SiLU x up) run on the calling thread
// through the same ops layer_forward calls, in the same order, and a barrier separates each
// part from the next. Every output is computed by the same function on the same inputs as
// layer after layer, so the result is bit-identical (and the engine checks it at run time,
// as it checks the stack).
//
// An error of any part (an op's argument check) is kept, every thread leaves at the next
// barrier, and it is raised after the region.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <atomic>
#include <exception>
#include <tuple>
#include <vector>

#include "decoder_layer.h"
#include "layer_parts.h"

namespace contbatch_layer {

namespace {

using contbatch_parts::FloatRef;
using contbatch_parts::QuantRef;

// Whether this layer runs in the region at this row count (regime: 0 one row, 1 two to seven).
bool fits(const Layer& layer, int64_t regime) {
  for (int64_t i = 0; i < kLinears; ++i) {
    const int64_t code = layer.codes[3 * i + regime];
    const at::Tensor& w = layer.weights[kWeightOf[i]];
    const std::optional<at::Tensor>& b = layer.biases[i];
    if (layer.lora_a[i].has_value() || (code != kQuant && code != kNative) || w.dim() != 2) return false;
    if (code == kNative && (w.scalar_type() != at::kFloat || !w.is_contiguous())) return false;
    if (b.has_value() && (b->scalar_type() != at::kFloat || !b->is_contiguous() || b->numel() != w.size(0)))
      return false;
  }
  return true;
}

// The linears [first, last) of a layer on x (float32 [rows, in]): their outputs allocated by
// `prepare` (calling thread), shared out by `run` (every thread).
struct Linears {
  std::vector<QuantRef> quant;
  std::vector<FloatRef> floats;
  std::vector<at::Tensor> outputs;  // float32 [rows, out], in the layer's order
  at::Tensor input;                 // x, kept alive while the threads read it
  const float* x = nullptr;
  int64_t rows = 0, in = 0;

  void prepare(const at::Tensor& from, const Layer& layer, std::initializer_list<int64_t> indices) {
    input = from.reshape({-1, from.size(-1)});
    TORCH_CHECK(input.is_contiguous() && input.scalar_type() == at::kFloat, "decode_region: float32 activations");
    x = input.data_ptr<float>();
    rows = input.size(0);
    in = input.size(1);
    quant.clear();
    floats.clear();
    outputs.clear();
    for (const int64_t i : indices) {
      const at::Tensor& w = layer.weights[kWeightOf[i]];
      const std::optional<at::Tensor>& b = layer.biases[i];
      const bool packed = layer.codes[3 * i + (rows == 1 ? 0 : 1)] == kQuant;
      const int64_t out = w.size(0);  // codes [out, in] or [out, in / 2]
      TORCH_CHECK(packed || w.size(1) == in, "decode_region: a weight of ", w.size(1), " inputs for x of ", in);
      outputs.push_back(at::empty({rows, out}, input.options()));
      float* y = outputs.back().data_ptr<float>();
      const float* bias = b.has_value() ? b->data_ptr<float>() : nullptr;  // float32 (fits)
      if (packed)
        quant.push_back({&w, &*layer.quant_scales[i], &layer.quant_mins[i], layer.quant_formats[2 * i],
                         layer.quant_formats[2 * i + 1], bias, y});
      else
        floats.push_back({w.data_ptr<float>(), bias, y, out});
    }
  }

  void run(int64_t t, int64_t threads) const {
    if (!quant.empty())
      contbatch_parts::quant_linears_share(x, rows, quant.data(), static_cast<int64_t>(quant.size()), t, threads);
    if (!floats.empty())
      contbatch_parts::small_linears_share(x, rows, in, floats.data(), static_cast<int64_t>(floats.size()), t,
                                           threads);
  }

  // Output j viewed as layer_forward's linear returns it: [1, tokens, out].
  at::Tensor view(size_t j, int64_t tokens) const { return outputs[j].view({1, tokens, -1}); }
};

}  // namespace

at::Tensor decode_region(const at::Tensor& hidden, const std::vector<Layer>& layers, const Step& step) {
  const int64_t tokens = hidden.size(1);
  if (hidden.scalar_type() != at::kFloat || step.chunk_table.has_value() || !step.decode_table.has_value() ||
      tokens < 1 || tokens > kMaxRows || step.lora_rows.has_value() || at::in_parallel_region())
    return at::Tensor();
  const int64_t regime = tokens == 1 ? 0 : 1;
  for (const Layer& layer : layers)
    if (!fits(layer, regime)) return at::Tensor();
  static const auto rotary = find("contbatch_cpu::rotary")
                                 .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                           const at::Tensor&, const at::Tensor&)>();
  static const auto kv_write = find("contbatch_cpu::kv_write")
                                   .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&)>();
  const int64_t head_dim = step.head_dim;
  const at::Tensor no_sinks = at::empty({0}, hidden.options());
  // What the calling thread prepares for the parts (read by all after a barrier).
  at::Tensor x = hidden, mid, query, attn, product;
  Linears linears;
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto guarded = [&](auto&& part) {
    try {
      part();
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
    }
  };
  at::internal::lazy_init_num_threads();
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    for (const Layer& layer : layers) {
      const bool qk_norm = layer.weights.size() == 11;
      // q, k, v of the input norm
      if (t == 0) guarded([&] { linears.prepare(rms_norm(x, layer.weights[kInNorm], layer.eps[0]), layer, {0, 1, 2}); });
#pragma omp barrier
      if (failed) break;
      guarded([&] { linears.run(t, threads); });
#pragma omp barrier
      if (failed) break;
      // rotation and the cache write (as layer_forward), then the attention's tasks
      if (t == 0)
        guarded([&] {
          at::Tensor q = linears.view(0, tokens).view({1, tokens, -1, head_dim});
          at::Tensor k = linears.view(1, tokens).view({1, tokens, -1, head_dim});
          const at::Tensor v = linears.view(2, tokens).view({1, tokens, -1, head_dim});
          if (qk_norm) {
            q = rms_norm(q, layer.weights[kQNorm], layer.eps[2]);
            k = rms_norm(k, layer.weights[kKNorm], layer.eps[3]);
          }
          auto [q_rot, k_rot] = rotary.call(q.transpose(1, 2), k.transpose(1, 2), step.cos, step.sin);
          const at::Tensor key = k_rot[0], value = v.transpose(1, 2)[0];
          kv_write.call(layer.key_cache, layer.value_cache, step.slots,
                        key.stride(-1) == 1 ? key : key.contiguous(), value);
          query = q_rot[0].transpose(0, 1).contiguous();  // [T, heads, D]
          const at::Tensor& kc = layer.key_cache;
          const at::Tensor& vc = layer.value_cache;
          TORCH_CHECK(kc.dim() == 3 && vc.dim() == 3 && kc.stride(2) == 1 && vc.stride(2) == 1 &&
                          kc.scalar_type() == query.scalar_type() && vc.scalar_type() == query.scalar_type() &&
                          query.size(1) % kc.size(0) == 0,
                      "decode_region: key/value caches [kv_heads, slots, dim] of the query's dtype");
          TORCH_CHECK(step.decode_table->scalar_type() == at::kInt && step.decode_table->stride(1) == 1 &&
                          step.decode_kv_lens->scalar_type() == at::kInt && step.decode_kv_lens->is_contiguous(),
                      "decode_region: int32 block table and key counts");
          attn = at::empty_like(query);
        });
#pragma omp barrier
      if (failed) break;
      guarded([&] {
        contbatch_parts::paged_decode_share(query, layer.key_cache, layer.value_cache, *step.decode_table,
                                            *step.decode_kv_lens, no_sinks, attn, step.block_size, layer.scale,
                                            layer.window, t, threads);
      });
#pragma omp barrier
      if (failed) break;
      if (t == 0) guarded([&] { linears.prepare(attn.view({1, tokens, -1}), layer, {3}); });
#pragma omp barrier
      if (failed) break;
      guarded([&] { linears.run(t, threads); });
#pragma omp barrier
      if (failed) break;
      // the residual sum, the post-attention norm, gate and up
      if (t == 0)
        guarded([&] {
          mid = x + linears.view(0, tokens);
          linears.prepare(rms_norm(mid, layer.weights[kPostNorm], layer.eps[1]), layer, {4, 5});
        });
#pragma omp barrier
      if (failed) break;
      guarded([&] { linears.run(t, threads); });
#pragma omp barrier
      if (failed) break;
      if (t == 0)
        guarded([&] {
          product = at::silu(linears.view(0, tokens)) * linears.view(1, tokens);
          linears.prepare(product, layer, {6});
        });
#pragma omp barrier
      if (failed) break;
      guarded([&] { linears.run(t, threads); });
#pragma omp barrier
      if (failed) break;
      if (t == 0) guarded([&] { x = mid + linears.view(0, tokens); });
      // (the next layer's first part is the calling thread's too: no barrier needed before it)
    }
  }
  if (error) std::rethrow_exception(error);
  return x;
}

}  // namespace contbatch_layer

// A decode step's decoder layers inside one parallel region.
//
// Layer after layer, a decode step of a small model is mostly not its arithmetic: each kernel
// of decoder_layer_cpu.cpp forks and joins the thread pool (five times a layer), and the ops
// around them are called one by one, each allocating its output. Here the pool's threads enter
// once for the whole stack. The linears and the attention are shared out (layer_parts.h: each
// thread a band of outputs or a range of (row, KV head) tasks, by the ops' own band functions;
// a task's queries and its key are rotated, and its key and value written to the cache, by the
// thread that attends with them). The small steps that need a whole row (the norms, the
// residual sums, SiLU x up) every thread computes for itself, by the ops' own row functions or
// the same aten ops, into buffers made once a call: no thread waits on another's serial work.
// Five barriers a layer separate the parts (six where a head's keys are attended by several
// threads, paged_decode_cpu.cpp's DecodeSplit). Every value is computed by the same function on the
// same inputs as layer after layer, so the output is bit-identical (the engine checks it at run
// time, as it checks the stack).
//
// An error of any part (an argument check) is kept, every thread leaves at that part's
// barrier, and it is raised after the region.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/FunctionRef.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "decoder_layer.h"
#include "layer_parts.h"

namespace contbatch_layer {

namespace {

using contbatch_parts::FloatRef;
using contbatch_parts::QuantRef;

bool float_vector(const at::Tensor& w, int64_t n) {
  return w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1 && w.size(0) == n;
}

// Whether this layer runs in the region at this row count (regime: 0 one row, 1 two to seven):
// every linear ours (few-row float32 or packed) with a float32 bias or none, no adapter,
// float32 norms and caches.
bool fits(const Layer& layer, int64_t regime, int64_t hidden, int64_t head_dim) {
  for (int64_t i = 0; i < kLinears; ++i) {
    const int64_t code = layer.codes[kRegimes * i + regime];
    const at::Tensor& w = layer.weights[kWeightOf[i]];
    const std::optional<at::Tensor>& b = layer.biases[i];
    if (layer.lora_a[i].has_value() || (code != kQuant && code != kNative) || w.dim() != 2) return false;
    if (code == kNative && (w.scalar_type() != at::kFloat || !w.is_contiguous())) return false;
    if (b.has_value() && !float_vector(*b, w.size(0))) return false;
  }
  const bool qk_norm = layer.weights.size() == 11;
  const at::Tensor& kc = layer.key_cache;
  const at::Tensor& vc = layer.value_cache;
  return float_vector(layer.weights[kInNorm], hidden) && float_vector(layer.weights[kPostNorm], hidden) &&
         (!qk_norm || (float_vector(layer.weights[kQNorm], head_dim) && float_vector(layer.weights[kKNorm], head_dim))) &&
         kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.dim() == 3 && vc.dim() == 3 &&
         kc.stride(2) == 1 && vc.stride(2) == 1 && kc.size(2) == head_dim && vc.size(2) == head_dim &&
         layer.weights[kK].size(0) == kc.size(0) * head_dim && layer.weights[kV].size(0) == kc.size(0) * head_dim &&
         vc.size(0) == kc.size(0);
}

// Some linears of a layer on x (float32 [rows, in]) into their buffers (shared by every thread,
// each writing its band): one per thread, set up and run by that thread.
struct Linears {
  std::vector<QuantRef> quant;
  std::vector<FloatRef> floats;
  const float* x = nullptr;
  int64_t rows = 0, in = 0;

  void prepare(const float* input, int64_t rows_, int64_t in_, const Layer& layer,
               std::initializer_list<int64_t> indices, const std::vector<at::Tensor>& outputs) {
    x = input;
    rows = rows_;
    in = in_;
    quant.clear();
    floats.clear();
    for (const int64_t i : indices) {
      const at::Tensor& w = layer.weights[kWeightOf[i]];
      const std::optional<at::Tensor>& b = layer.biases[i];
      const bool packed = layer.codes[kRegimes * i + regime_of(rows)] == kQuant;
      const int64_t out = w.size(0);  // codes [out, in] or (int4: the format word's low byte 4) [out, in / 2]
      const int64_t w_in = packed && (layer.quant_formats[2 * i] & 255) == 4 ? 2 * w.size(1) : w.size(1);
      TORCH_CHECK(w_in == in && outputs[i].numel() == rows * out, "decode_region: a weight of ", w_in,
                  " inputs for x of ", in);
      float* y = outputs[i].data_ptr<float>();
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
};

// y = a + b over n floats (aten's add: one rounding each, whatever the order)
void add(const float* a, const float* b, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

// Every layer's linear i has the same output features (the shared buffers are cut to them).
bool uniform(const std::vector<Layer>& layers) {
  for (const Layer& layer : layers)
    for (int64_t i = 0; i < kLinears; ++i)
      if (layer.weights[kWeightOf[i]].size(0) != layers[0].weights[kWeightOf[i]].size(0)) return false;
  return true;
}

// Whether a row attends to a key another row of the step writes: rows of one sequence (a short
// prompt or a suffix after a cached prefix, draft tokens being verified) run as decode rows.
// Such a row's keys include the later-written slots of the rows before it, so every key must be
// written before any row attends. Another sequence's row never writes a block this row reads
// (a shared block is full), so only blocks that hold the step's positions are looked at: the
// last ones of each row's table (a row's own position is its last key).
bool rows_read_each_other(const int64_t* slot, const int32_t* lens, const at::Tensor& table, int64_t tokens,
                          int64_t block_size) {
  const int32_t* blocks = table.data_ptr<int32_t>();
  for (int64_t r = 0; r < tokens; ++r) {
    const int64_t len = lens[r], last = (len - 1) / block_size;
    const int64_t first = std::max<int64_t>(0, (len - tokens) / block_size);
    for (int64_t other = 0; other < tokens; ++other) {
      if (other == r) continue;
      const int64_t block = slot[other] / block_size, offset = slot[other] % block_size;
      for (int64_t j = first; j <= last && j < table.size(1); ++j)
        if (blocks[r * table.stride(0) + j] == block && j * block_size + offset < len) return true;
    }
  }
  return false;
}

}  // namespace

at::Tensor decode_region(const at::Tensor& hidden, const std::vector<Layer>& layers, const Step& step) {
  const int64_t tokens = hidden.size(1), size = hidden.size(2), head_dim = step.head_dim;
  if (hidden.scalar_type() != at::kFloat || !hidden.is_contiguous() || step.chunk_table.has_value() ||
      !step.decode_table.has_value() || tokens < 1 || tokens > kMaxRows || step.lora_rows.has_value() ||
      at::in_parallel_region() || !uniform(layers))
    return at::Tensor();
  const int64_t regime = tokens == 1 ? 0 : 1;
  for (const Layer& layer : layers)
    if (!fits(layer, regime, size, head_dim)) return at::Tensor();
  const at::Tensor &cos = step.cos, &sin = step.sin, &slots = step.slots;
  if (cos.scalar_type() != at::kFloat || sin.scalar_type() != at::kFloat || cos.dim() != 3 || sin.dim() != 3 ||
      cos.size(1) != tokens || sin.size(1) != tokens || cos.size(2) != head_dim || sin.size(2) != head_dim ||
      cos.stride(2) != 1 || sin.stride(2) != 1 || slots.scalar_type() != at::kLong || !slots.is_contiguous())
    return at::Tensor();
  const at::Tensor& table = *step.decode_table;
  const at::Tensor& kv_lens = *step.decode_kv_lens;
  TORCH_CHECK(table.scalar_type() == at::kInt && table.stride(1) == 1 && kv_lens.scalar_type() == at::kInt &&
                  kv_lens.is_contiguous() && table.size(0) == tokens && kv_lens.size(0) == tokens,
              "decode_region: an int32 block table and key count per row");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (const Layer& layer : layers)
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(slot[t] >= 0 && slot[t] < layer.key_cache.size(1) && slot[t] < layer.value_cache.size(1),
                  "decode_region: slot ", slot[t], " is outside the cache");
  const Layer& first = layers[0];
  const int64_t heads = first.weights[kQ].size(0) / head_dim, kv_heads = first.key_cache.size(0);
  const int64_t group = heads / kv_heads, inter = first.weights[kGate].size(0);

  // Shared buffers, written in bands (or tasks) by every thread and read by all after the
  // part's barrier: the linears' outputs (by linear), the rotated queries, the attention's
  // output [T, heads, D]. Each thread's own: the running hidden state, the residual sum, a
  // norm's output (thread 0's hidden state is the result), SiLU x up, a row of scratch.
  const at::TensorOptions f32 = hidden.options();
  std::vector<at::Tensor> ys(kLinears);
  for (int64_t i = 0; i < kLinears; ++i) ys[i] = at::empty({tokens, first.weights[kWeightOf[i]].size(0)}, f32);
  at::Tensor query = at::empty({tokens, heads, head_dim}, f32), attn = at::empty({tokens, heads, head_dim}, f32);
  const int64_t threads = at::get_num_threads(), n = tokens * size;
  at::Tensor out = at::empty_like(hidden);
  at::Tensor own = at::empty({threads, 3 * n + head_dim}, f32);
  std::vector<at::Tensor> products;
  for (int64_t t = 0; t < threads; ++t) products.push_back(at::empty({tokens, inter}, f32));
  std::vector<Linears> linears(threads);
  const at::Tensor no_sinks = at::empty({0}, f32);
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  contbatch_parts::DecodeSplit split;  // sized for no window: every layer's units fit in it
  split.reserve(contbatch_parts::decode_units(lens, tokens, kv_heads, 0), tokens * kv_heads, group, head_dim);
  const bool shared_keys = tokens > 1 && rows_read_each_other(slot, lens, table, tokens, step.block_size);
  const auto split_needed = [&](int64_t window) {  // the same answer on every thread
    if (shared_keys) return true;
    for (int64_t r = 0; r < tokens; ++r)
      if (contbatch_parts::key_chunks(lens[r], window) > 1) return true;
    return false;
  };
  // A failing part's number and error (the earliest part's, if several fail): every thread
  // leaves after that part's barrier, reading a number set before it (a thread already in
  // the next part may fail too; its number is larger), and the error is raised after the region.
  std::mutex failure;
  std::exception_ptr error;
  std::atomic<int64_t> failed_part{std::numeric_limits<int64_t>::max()};
  const at::ThreadLocalState state;  // the caller's (inference mode) for the aten ops of every thread
  at::internal::lazy_init_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const at::ThreadLocalStateGuard guard(state);
    const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
    float* mine = own.data_ptr<float>() + t * own.size(1);
    float *xo = t == 0 ? out.data_ptr<float>() : mine + 2 * n, *xm = mine, *xn = mine + n, *scratch = mine + 3 * n;
    const float* x = hidden.data_ptr<float>();  // the layer's input: `hidden`, then this thread's `xo`
    Linears& lin = linears[t];
    at::Tensor& product = products[t];
    // q / k, a row of head_dim values, normed (Qwen3: the norm at `norm`, its epsilon after the
    // layer's two) then rotated into dst
    const auto rotate = [&](const Layer& layer, const float* src, int64_t norm, int64_t r, float* dst) {
      if (layer.weights.size() == 11) {
        contbatch_parts::rms_norm_rows(src, layer.weights[norm].data_ptr<float>(), scratch, 1, head_dim,
                                       layer.eps[2 + norm - kQNorm]);
        src = scratch;
      }
      contbatch_parts::rotate_row(src, cos.data_ptr<float>() + r * cos.stride(1),
                                  sin.data_ptr<float>() + r * sin.stride(1), dst, head_dim);
    };
    int64_t number = 0;  // the part's, counted over the layers
    bool stop = false;
    for (const Layer& layer : layers) {
      // A layer's parts, each followed by a barrier. What every thread needs whole (the norms,
      // the residual sums, SiLU x up) each computes for itself: no thread waits for another's
      // serial work, and the values are the same on all.
      const auto qkv = [&] {  // the input norm, then q, k and v
        contbatch_parts::rms_norm_rows(x, layer.weights[kInNorm].data_ptr<float>(), xn, tokens, size, layer.eps[0]);
        lin.prepare(xn, tokens, size, layer, {0, 1, 2}, ys);
        lin.run(t, team);
      };
      const auto attention = [&] {  // this thread's (row, KV head) tasks: rotation and K/V write, then attention
        const at::Tensor &kc = layer.key_cache, &vc = layer.value_cache;
        const float *q = ys[0].data_ptr<float>(), *k = ys[1].data_ptr<float>(), *v = ys[2].data_ptr<float>();
        float *qr = query.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
        const auto [begin, end] = contbatch_parts::share_of(tokens * kv_heads, 1, t, team);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t r = task / kv_heads, h = task % kv_heads;
          for (int64_t j = h * group; j < (h + 1) * group; ++j)
            rotate(layer, q + (r * heads + j) * head_dim, kQNorm, r, qr + (r * heads + j) * head_dim);
          rotate(layer, k + (r * kv_heads + h) * head_dim, kKNorm, r, kp + h * kc.stride(0) + slot[r] * kc.stride(1));
          std::memcpy(vp + h * vc.stride(0) + slot[r] * vc.stride(1), v + (r * kv_heads + h) * head_dim,
                      head_dim * sizeof(float));
        }
        // A head with more than one chunk of keys is attended by several threads' units, which
        // read queries and a key another thread rotated, and a row of one sequence with others
        // reads their keys: they wait for every rotation and write. (Otherwise the units are
        // these tasks, on this thread.)
        if (split_needed(layer.window)) {
#pragma omp barrier
        }
        contbatch_parts::paged_decode_share(query, kc, vc, table, kv_lens, no_sinks, attn, step.block_size,
                                            layer.scale, layer.window, split, t, team);
      };
      const auto o = [&] {
        lin.prepare(attn.data_ptr<float>(), tokens, heads * head_dim, layer, {3}, ys);
        lin.run(t, team);
      };
      const auto gate_up = [&] {  // the residual sum and the post-attention norm, then gate and up
        add(x, ys[3].data_ptr<float>(), xm, n);
        contbatch_parts::rms_norm_rows(xm, layer.weights[kPostNorm].data_ptr<float>(), xn, tokens, size, layer.eps[1]);
        lin.prepare(xn, tokens, size, layer, {4, 5}, ys);
        lin.run(t, team);
      };
      const auto down = [&] {  // silu(gate) * up by aten's ops, as the layer runs them, then down
        at::silu_out(product, ys[4]);
        product.mul_(ys[5]);
        lin.prepare(product.data_ptr<float>(), tokens, inter, layer, {6}, ys);
        lin.run(t, team);
      };
      const c10::function_ref<void()> parts[] = {qkv, attention, o, gate_up, down};
      for (const auto& part : parts) {
        try {
          part();
        } catch (...) {
          const std::lock_guard<std::mutex> lock(failure);
          if (number < failed_part.load()) {
            failed_part.store(number);
            error = std::current_exception();
          }
        }
#pragma omp barrier
        stop = failed_part.load() <= number++;
        if (stop) break;
      }
      if (stop) break;
      add(xm, ys[6].data_ptr<float>(), xo, n);  // the residual sum ending the layer
      x = xo;
    }
  }
  if (error) std::rethrow_exception(error);
  return out;
}

}  // namespace contbatch_layer

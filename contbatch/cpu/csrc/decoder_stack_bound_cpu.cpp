// The decoder stack's fixed arguments, held in C++ from one call to the next.
//
// decoder_stack takes every layer's weights, biases, routes, epsilons, caches and packed formats
// as lists: for the default model ~1,700 entries, converted from Python objects at every call,
// which on a lone request's decode step of a small model is a share of the step worth keeping
// (docs/cpu.md). `StackArgs` holds the lists a step does not change; cpu/routers/fused_layer.py
// makes one, and makes it again when a weight, bias, cache or packed weight's buffer is replaced.
// `decoder_stack_bound` takes it with the step's own arguments and runs the same run_stack as
// decoder_stack, so the output is the same bit for bit.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <utility>
#include <vector>

#include "decoder_layer.h"

namespace {

using namespace contbatch_layer;

using Optionals = c10::List<std::optional<at::Tensor>>;

// decoder_stack's step-independent lists (its header gives the layout), owned here.
struct StackArgs : torch::CustomClassHolder {
  std::vector<at::Tensor> weights, key_caches, value_caches;
  std::vector<std::optional<at::Tensor>> biases, quant_scales, quant_mins;
  std::vector<std::optional<at::Tensor>> nones;  // one None per linear: no packed copy, no adapter
  std::vector<int64_t> codes, windows, quant_formats;
  std::vector<double> eps, scales;

  StackArgs(std::vector<at::Tensor> weights_, Optionals biases_, std::vector<int64_t> codes_,
            std::vector<double> eps_, std::vector<at::Tensor> key_caches_, std::vector<at::Tensor> value_caches_,
            std::vector<double> scales_, std::vector<int64_t> windows_, Optionals quant_scales_,
            Optionals quant_mins_, std::vector<int64_t> quant_formats_)
      : weights(std::move(weights_)),
        key_caches(std::move(key_caches_)),
        value_caches(std::move(value_caches_)),
        biases(biases_.vec()),
        quant_scales(quant_scales_.vec()),
        quant_mins(quant_mins_.vec()),
        nones(biases.size()),
        codes(std::move(codes_)),
        windows(std::move(windows_)),
        quant_formats(std::move(quant_formats_)),
        eps(std::move(eps_)),
        scales(std::move(scales_)) {
    TORCH_CHECK(quant_scales.size() == biases.size() && quant_mins.size() == biases.size(),
                "StackArgs: scales and mins (or None) for every linear");
  }
};

// A per-linear list of the step's: empty stands for None everywhere.
std::vector<std::optional<at::Tensor>> per_linear(const Optionals& given, const StackArgs& args, const char* what) {
  if (given.empty()) return {};
  TORCH_CHECK(given.size() == args.biases.size(), "decoder_stack_bound: ", what, " for every linear, or none");
  return given.vec();
}

at::Tensor decoder_stack_bound(const at::Tensor& hidden, const c10::intrusive_ptr<StackArgs>& args,
                               const Optionals& packed, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& slots, const std::optional<at::Tensor>& decode_table,
                               const std::optional<at::Tensor>& decode_kv_lens,
                               const std::optional<at::Tensor>& chunk_table,
                               const std::optional<at::Tensor>& chunk_q_start,
                               const std::optional<at::Tensor>& chunk_q_lens,
                               const std::optional<at::Tensor>& chunk_kv_lens, int64_t block_size, int64_t head_dim,
                               const Optionals& lora_a, const Optionals& lora_bt,
                               const std::optional<at::Tensor>& lora_rows, const std::optional<at::Tensor>& lora_drop,
                               const std::optional<at::Tensor>& lora_inverse, at::IntArrayRef lora_bounds) {
  const StackArgs& a = *args;
  const std::vector<std::optional<at::Tensor>> blocked = per_linear(packed, a, "a packed weight (or None)");
  const std::vector<std::optional<at::Tensor>> shrink = per_linear(lora_a, a, "LoRA factors (or None)");
  const std::vector<std::optional<at::Tensor>> expand = per_linear(lora_bt, a, "LoRA factors (or None)");
  const auto or_nones = [&](const std::vector<std::optional<at::Tensor>>& v) {
    return v.empty() ? a.nones.data() : v.data();
  };
  const Step step{cos, sin, slots, decode_table, decode_kv_lens, chunk_table, chunk_q_start, chunk_q_lens,
                  chunk_kv_lens, block_size, head_dim, lora_rows, lora_drop, lora_inverse, lora_bounds};
  return run_stack(hidden,
                   StackView{a.weights, a.biases.data(), or_nones(blocked), a.codes, a.eps, a.key_caches,
                             a.value_caches, a.scales, a.windows, or_nones(shrink), or_nones(expand),
                             a.quant_scales.data(), a.quant_mins.data(), a.quant_formats,
                             static_cast<int64_t>(a.biases.size())},
                   step);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(contbatch_cpu, m) {
  m.class_<StackArgs>("StackArgs")
      .def(torch::init<std::vector<at::Tensor>, Optionals, std::vector<int64_t>, std::vector<double>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<double>, std::vector<int64_t>,
                       Optionals, Optionals, std::vector<int64_t>>());
  m.def(
      "decoder_stack_bound(Tensor hidden, __torch__.torch.classes.contbatch_cpu.StackArgs args, Tensor?[] packed, "
      "Tensor cos, Tensor sin, Tensor slots, Tensor? decode_table, Tensor? decode_kv_lens, Tensor? chunk_table, "
      "Tensor? chunk_q_start, Tensor? chunk_q_lens, Tensor? chunk_kv_lens, int block_size, int head_dim, "
      "Tensor?[] lora_a, Tensor?[] lora_bt, Tensor? lora_rows, Tensor? lora_drop, Tensor? lora_inverse, "
      "int[] lora_bounds) -> Tensor");
}

TORCH_LIBRARY_IMPL(contbatch_cpu, CPU, m) {
  m.impl("decoder_stack_bound", decoder_stack_bound);
}

// oneDNN's prepacked weights among the step's arguments (MkldnnCPU) send the call here too.
TORCH_LIBRARY_IMPL(contbatch_cpu, MkldnnCPU, m) {
  m.impl("decoder_stack_bound", decoder_stack_bound);
}

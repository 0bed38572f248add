// A Llama-family decoder layer's arguments as decoder_layer_cpu.cpp takes them (its header
// says their layout), shared with decode_region_cpu.cpp.

#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <vector>

#include "panel_tile.h"

namespace contbatch_layer {

constexpr int64_t kMaxRows = 7;  // rows small_linear_cpu.cpp's kernel takes (ops.py's SMALL_LINEAR_MAX_ROWS)
using contbatch_panel::kPanelMaxRows;  // ops.py's PANEL_MAX_ROWS
constexpr int64_t kRegimes = 4;  // route codes per linear, one per row regime (`regime_of`)
constexpr int64_t kQuantCallRows = 512;  // rows quant_linear_cpu.cpp's quant_linears takes (more: one call each)
// Route codes of a linear (ops.py's ROUTED_CODES and QUANT_CODE), for the layer and routed_linear.
enum Kernel : int64_t { kAten = 0, kOneDnn = 1, kNative = 2, kQuant = 3, kPanel = 4 };
enum Weight : int64_t { kInNorm = 0, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown, kQNorm, kKNorm };
constexpr int64_t kLinears = 7;
constexpr int64_t kWeightOf[kLinears] = {kQ, kK, kV, kO, kGate, kUp, kDown};  // each linear's weight

// A call's row regime, the index of its kernel in a linear's codes (ops.py's row_regime): one row,
// two to kMaxRows, up to kPanelMaxRows (a batched decode step), more (prompt chunks).
inline int64_t regime_of(int64_t rows) { return rows <= 1 ? 0 : rows <= kMaxRows ? 1 : rows <= kPanelMaxRows ? 2 : 3; }

inline c10::OperatorHandle find(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

// One layer's arguments, views into the call's lists (decoder_stack passes every layer's).
struct Layer {
  at::ArrayRef<at::Tensor> weights;        // 9 or 11, in decoder_layer_cpu.cpp's order
  const std::optional<at::Tensor>* biases;  // one per linear
  const std::optional<at::Tensor>* packed;  // one per linear
  at::ArrayRef<int64_t> codes;              // kRegimes per linear
  at::ArrayRef<double> eps;                 // one per norm
  const at::Tensor& key_cache;
  const at::Tensor& value_cache;
  double scale;
  int64_t window;
  const std::optional<at::Tensor>* lora_a;   // one per linear: [G, R, in]
  const std::optional<at::Tensor>* lora_bt;  // one per linear: [G, R, out], the scale folded in
  const std::optional<at::Tensor>* quant_scales;  // one per linear: a packed weight's scales
  const std::optional<at::Tensor>* quant_mins;    // one per linear: its mins (int4)
  at::ArrayRef<int64_t> quant_formats;            // two per linear: bits, group
};

// What every layer of a step shares: its positions, cache slots and attention plan.
struct Step {
  const at::Tensor& cos;
  const at::Tensor& sin;
  const at::Tensor& slots;
  const std::optional<at::Tensor>& decode_table;
  const std::optional<at::Tensor>& decode_kv_lens;
  const std::optional<at::Tensor>& chunk_table;
  const std::optional<at::Tensor>& chunk_q_start;
  const std::optional<at::Tensor>& chunk_q_lens;
  const std::optional<at::Tensor>& chunk_kv_lens;
  int64_t block_size;
  int64_t head_dim;
  const std::optional<at::Tensor>& lora_rows;  // [G * m] int64: each adapter group's rows, padded
  const std::optional<at::Tensor>& lora_drop;  // [G, m, 1] bool: the padding entries (padded groups)
  const std::optional<at::Tensor>& lora_inverse;  // [T] int64: each row's entry (a zero one for base rows)
  at::IntArrayRef lora_bounds;  // segmented groups: G + 1 offsets into lora_rows (empty: padded)
};

// Every layer's arguments of a decoder_stack call, laid end to end (decoder_layer_cpu.cpp's
// header gives the layout): views into lists its caller holds for the call.
struct StackView {
  at::ArrayRef<at::Tensor> weights;
  const std::optional<at::Tensor>* biases;
  const std::optional<at::Tensor>* packed;
  at::ArrayRef<int64_t> codes;
  at::ArrayRef<double> eps;
  at::ArrayRef<at::Tensor> key_caches;
  at::ArrayRef<at::Tensor> value_caches;
  at::ArrayRef<double> scales;
  at::ArrayRef<int64_t> windows;
  const std::optional<at::Tensor>* lora_a;
  const std::optional<at::Tensor>* lora_bt;
  const std::optional<at::Tensor>* quant_scales;
  const std::optional<at::Tensor>* quant_mins;
  at::ArrayRef<int64_t> quant_formats;
  int64_t linears;  // the length of each per-linear array above
};

// The layers of `view` on `hidden`, one after the other (or as one decode region): checks the
// lists' lengths and agreement, then runs them. decoder_stack and decoder_stack_bound both end here.
at::Tensor run_stack(const at::Tensor& hidden, const StackView& view, const Step& step);

// Every decoder layer of a decode step (each row one query token, 1 to kMaxRows rows) inside
// one parallel region (decode_region_cpu.cpp), when every linear of every layer takes our
// few-row float32 kernel or a packed one at this row count, the activations are float32 and
// no adapter applies; returns an undefined tensor (nothing run) otherwise. The output equals
// layer after layer's bit for bit.
at::Tensor decode_region(const at::Tensor& hidden, const std::vector<Layer>& layers, const Step& step);

}  // namespace contbatch_layer

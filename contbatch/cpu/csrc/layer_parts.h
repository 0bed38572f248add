// Thread shares of the decoder layer's parallel kernels, for decode_region_cpu.cpp: there every
// decoder layer of a decode step runs inside one parallel region, each thread calling these
// with its index, instead of one fork and join per kernel.
//
// Each share computes exactly what the op of the same name computes for its part of the
// outputs (the same band functions on the same inputs), so a region's outputs equal the ops'
// bit for bit whatever the thread count. Their arguments are checked before the region (a
// share throws only what the op would).

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace contbatch_parts {

// One packed linear (quant_linear_cpu.cpp's layout: codes, scales, mins, format word, group).
struct QuantRef {
  const at::Tensor* codes;
  const at::Tensor* scales;
  const std::optional<at::Tensor>* mins;
  int64_t format;
  int64_t group;
  const float* bias;  // float32 [out], or nullptr
  float* y;           // float32 [rows, out]
};

// One float32 weight [out, in] (small_linear_cpu.cpp's few-row kernel).
struct FloatRef {
  const float* weight;
  const float* bias;  // or nullptr
  float* y;           // [rows, out]
  int64_t out;
};

// quant_linears on float32 x [rows, in] (1 to 7 rows): thread t of `threads`' band of the
// linears' outputs laid end to end.
void quant_linears_share(const float* x, int64_t rows, const QuantRef* linears, int64_t n, int64_t t,
                         int64_t threads);

// small_linears on float32 x [rows, in] (1 to 7 rows): thread t's band of the outputs.
void small_linears_share(const float* x, int64_t rows, int64_t in, const FloatRef* linears, int64_t n, int64_t t,
                         int64_t threads);

// Keys a unit of decode attention reads: a row's KV head with more keys is cut into chunks
// of this many, each a unit of work, so that a lone request's few KV heads are shared out over
// every thread (whole heads as units, three on two threads would leave one idle a third of the
// attention's time). The chunks' softmax sums are merged in chunk order: the values depend
// neither on the threads nor on the batch.
constexpr int64_t kKeyChunk = 64;

// The chunks of one row's KV head: its visible keys (the last `window` of `len`, or all with
// window <= 0) in kKeyChunk-key chunks, at least one.
inline int64_t key_chunks(int64_t len, int64_t window) {
  const int64_t n = window > 0 ? std::min<int64_t>(len, window) : len;
  return std::max<int64_t>(1, (n + kKeyChunk - 1) / kKeyChunk);
}

// The units of a paged_decode call over `rows` rows of key counts `lens`.
inline int64_t decode_units(const int32_t* lens, int64_t rows, int64_t kv_heads, int64_t window) {
  int64_t units = 0;
  for (int64_t r = 0; r < rows; ++r) units += kv_heads * key_chunks(lens[r], window);
  return units;
}

// What the units of one paged_decode call share: each multi-chunk unit's partial results
// (its [group] score maxima, [group] exponential sums, [group, dim] value sums) and, per row
// and KV head, how many of its units have finished.
struct DecodeSplit {
  int64_t units = 0;
  std::unique_ptr<float[]> partial;  // left uninitialized: every unit writes its own before it is read
  std::unique_ptr<std::atomic<int32_t>[]> done;

  static int64_t unit_floats(int64_t group, int64_t dim) { return group * (2 + dim); }
  // Room for `units` units (decode_units) over `heads` (row, KV head) pairs.
  void reserve(int64_t units, int64_t heads, int64_t group, int64_t dim);
};

// paged_decode's units (DecodeSplit) of thread t, no sinks (`no_sinks` an empty float32
// tensor) and no softcap; `out` as paged_decode returns it. `split` is shared by the threads
// (reserved for these kv_lens without a window, or with this one) and reusable after a barrier.
void paged_decode_share(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& block_table, const at::Tensor& kv_lens, const at::Tensor& no_sinks,
                        at::Tensor& out, int64_t block_size, double scale, int64_t window, DecodeSplit& split,
                        int64_t t, int64_t threads);

// rms_norm on float32 rows [rows, hidden] into y (the op's one function per row).
void rms_norm_rows(const float* x, const float* weight, float* y, int64_t rows, int64_t hidden, double eps);

// rotary's one row of `dim` values (float32), rounded as the op rounds.
void rotate_row(const float* x, const float* cos, const float* sin, float* out, int64_t dim);

// [begin, end) of thread t's share of n items in units of `unit` (contiguous, in order).
inline std::pair<int64_t, int64_t> share_of(int64_t n, int64_t unit, int64_t t, int64_t threads) {
  const int64_t per = std::max<int64_t>(unit, ((n + threads - 1) / threads + unit - 1) / unit * unit);
  return {std::min(n, t * per), std::min(n, (t + 1) * per)};
}

}  // namespace contbatch_parts

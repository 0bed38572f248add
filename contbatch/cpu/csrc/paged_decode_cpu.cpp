// Decode attention on the CPU, reading K/V in place through the block tables.
//
// One unit of work per (request, KV head, chunk of up to kKeyChunk visible keys): the unit
// loads that head's G grouped query heads once, walks its keys block by block straight out of
// the paged cache (no gather into a fresh tensor), and keeps scores, softmax and the weighted
// sum of values in float32 whatever the cache dtype. Units are spread over PyTorch's intra-op
// OpenMP pool, the same pool as the model's other ops; a head's chunks are merged by the last
// of them to finish, in chunk order (DecodeSplit, layer_parts.h). Softmax is two-pass over a
// per-unit score buffer: decode rows have one query each, so that buffer is G x (its keys).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "decode_tiles.h"
#include "layer_parts.h"
#include "vec.h"

namespace {

using namespace contbatch_vec;
using namespace contbatch_decode;

// Where row r's units start (first[r]; first[rows] is the call's count) and how many key
// chunks each of its KV heads has: every thread works the plan out alike from kv_lens.
struct Plan {
  std::vector<int64_t> first, chunks;
};

Plan plan_of(const int32_t* lens, int64_t rows, int64_t kv_heads, int64_t window) {
  Plan plan;
  plan.first.resize(rows + 1);
  plan.chunks.resize(rows);
  plan.first[0] = 0;
  for (int64_t r = 0; r < rows; ++r) {
    plan.chunks[r] = contbatch_parts::key_chunks(lens[r], window);
    plan.first[r + 1] = plan.first[r] + kv_heads * plan.chunks[r];
  }
  return plan;
}

// Units [begin, end) of the call (unit: a row, a KV head and a chunk of kKeyChunk of its keys,
// contbatch_parts::DecodeSplit; `plan` the call's, made once by the caller), on the calling thread. A head whose keys fit one chunk is
// finished by its unit: scores, softmax, weighted values. A longer one's units each leave
// their chunk's score maximum, exponential sum and unnormalized value sum in `split`, and the
// last of them to finish merges them in chunk order, so the result does not depend on which
// thread ran which unit.
template <typename T>
void decode_tasks(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& block_table, const at::Tensor& kv_lens, const at::Tensor& sinks, at::Tensor& out,
                  int64_t block_size, double scale, int64_t window, double softcap, const Plan& plan,
                  contbatch_parts::DecodeSplit& split, int64_t begin, int64_t end) {
  const int64_t heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key.size(0), group = heads / kv_heads;
  const T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const int64_t k_head = key.stride(0), k_slot = key.stride(1);
  const int64_t v_head = value.stride(0), v_slot = value.stride(1);
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_row = block_table.stride(0);
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  const float* sink = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  T* o = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t stride = split.unit_floats(group, dim);
  // The tiles: float32 and bfloat16 (and float16 with AVX-512); double runs the generic loops.
#ifdef CONTBATCH_AVX512
  constexpr bool vectorizable = !std::is_same_v<T, double>;
#else
  constexpr bool vectorizable = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
#endif

  std::vector<float> scores, qf(group * dim), acc(group * dim), inv(group);
#ifdef CONTBATCH_TILES
  std::vector<int64_t> slots;
  std::vector<TileVec> part(kPartVecs);
#endif
  int64_t r = 0;
  for (int64_t unit = begin; unit < end; ++unit) {
    while (plan.first[r + 1] <= unit) ++r;
    const int64_t chunks = plan.chunks[r], h = (unit - plan.first[r]) / chunks, c = (unit - plan.first[r]) % chunks;
    const int64_t len = lens[r];
    const int64_t first = (window > 0 ? std::max<int64_t>(0, len - window) : 0) + c * contbatch_parts::kKeyChunk;
    const int64_t last = std::min<int64_t>(len, first + contbatch_parts::kKeyChunk);
    const int64_t n = std::max<int64_t>(0, last - first);
    scores.resize(group * std::max<int64_t>(n, 1));
    float* sc = scores.data();
    const T* qr = q + (r * heads + h * group) * dim;
    for (int64_t i = 0; i < group * dim; ++i) qf[i] = static_cast<float>(qr[i]);
    const int32_t* blocks = table + r * table_row;
    const T* kh = k + h * k_head;
    const T* vh = v + h * v_head;
    // Scores: each key row is read once and dotted with the group's query heads.
    bool tiled = false;
#ifdef CONTBATCH_TILES
    if constexpr (vectorizable) {
      slots.resize(n);
      for_each_slot(blocks, block_size, first, last, [&](int64_t j, int64_t slot) { slots[j] = slot; });
      tiled = run_tiles<T>(true, kh, k_slot, slots.data(), n, group, dim, qf.data(), sc, part.data(), vh, v_slot);
    }
#endif
    if (!tiled) {
      for_each_slot(blocks, block_size, first, last, [&](int64_t j, int64_t slot) {
        const T* kr = kh + slot * k_slot;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * static_cast<float>(kr[d]);
          sc[g * n + j] = s;
        }
      });
    }
    // One chunk: the sink (if any) enters its softmax here; several: at the merge.
    float* mine = split.partial.get() + unit * stride;  // chunk c's [group] max, [group] sum, [group, dim] sum
    for (int64_t g = 0; g < group; ++g) {
      float* sg = sc + g * n;
      float m = sink && chunks == 1 ? sink[h * group + g] : kNone;
      for (int64_t j = 0; j < n; ++j) {
        float s = sg[j] * fscale;
        if (cap > 0.f) s = std::tanh(s / cap) * cap;
        sg[j] = s;
        m = std::max(m, s);
      }
      const float sum = exp_shifted(sg, n, m) + (sink && chunks == 1 ? std::exp(sink[h * group + g] - m) : 0.f);
      if (chunks == 1) {
        inv[g] = sum > 0.f ? 1.f / sum : 0.f;
      } else {
        mine[g] = m;
        mine[group + g] = sum;
      }
    }
    // Weighted sum of values: each value row is read once, into every group head's sum.
    float* sums = chunks == 1 ? acc.data() : mine + 2 * group;
    std::fill(sums, sums + group * dim, 0.f);
#ifdef CONTBATCH_TILES
    if constexpr (vectorizable)
      if (tiled) run_tiles<T>(false, vh, v_slot, slots.data(), n, group, dim, sums, sc, part.data());
#endif
    if (!tiled) {
      for_each_slot(blocks, block_size, first, last, [&](int64_t j, int64_t slot) {
        const T* vr = vh + slot * v_slot;
        for (int64_t g = 0; g < group; ++g) {
          const float p = sc[g * n + j];
          float* ag = sums + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ag[d] += p * static_cast<float>(vr[d]);
        }
      });
    }
    if (chunks > 1) {
      // The last chunk of this head to finish merges them all (acquiring the others' writes).
      std::atomic<int32_t>& done = split.done[r * kv_heads + h];
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 < chunks) continue;
      done.store(0, std::memory_order_relaxed);  // reused by the next layer, after its barrier
      const float* head = split.partial.get() + (plan.first[r] + h * chunks) * stride;
      for (int64_t g = 0; g < group; ++g) {
        float m = sink ? sink[h * group + g] : kNone;
        for (int64_t cc = 0; cc < chunks; ++cc) m = std::max(m, head[cc * stride + g]);
        float sum = sink ? std::exp(sink[h * group + g] - m) : 0.f;
        float* ag = acc.data() + g * dim;
        std::fill(ag, ag + dim, 0.f);
        for (int64_t cc = 0; cc < chunks; ++cc) {
          const float* from = head + cc * stride;
          const float w = from[g] == kNone ? 0.f : std::exp(from[g] - m);
          sum += w * from[group + g];
          const float* part_sum = from + 2 * group + g * dim;
          for (int64_t d = 0; d < dim; ++d) ag[d] += w * part_sum[d];
        }
        inv[g] = sum > 0.f ? 1.f / sum : 0.f;
      }
    }
    T* orow = o + (r * heads + h * group) * dim;
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < dim; ++d) orow[g * dim + d] = static_cast<T>(acc[g * dim + d] * inv[g]);
  }
}

// query [rows, heads, dim] (contiguous); key/value one layer's cache as [kv_heads, slots, dim]
// (any strides on the first two, dim contiguous); block_table [rows, width] int32; kv_lens
// [rows] int32 (keys each row attends to, its own included); sinks [heads] float32 or empty.
// window <= 0: none; softcap <= 0: none. Returns [rows, heads, dim].
at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& block_table, const at::Tensor& kv_lens, const at::Tensor& sinks,
                        int64_t block_size, double scale, int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [rows, heads, dim] tensor");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key/value must be [kv_heads, slots, dim]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value rows must be contiguous");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "query, key and value must share a dtype");
  TORCH_CHECK(query.size(1) % key.size(0) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && kv_lens.scalar_type() == at::kInt,
              "block_table and kv_lens must be int32");
  TORCH_CHECK(block_table.stride(1) == 1 && kv_lens.is_contiguous(), "block_table rows must be contiguous");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.numel() == query.size(1)),
              "sinks must be empty or float32 [heads]");
  auto out = at::empty_like(query);
  if (query.size(0) == 0) return out;
  const at::Tensor sinks_c = sinks.contiguous();
  const Plan plan = plan_of(kv_lens.data_ptr<int32_t>(), query.size(0), key.size(0), window);
  const int64_t units = plan.first.back();
  contbatch_parts::DecodeSplit split;
  split.reserve(units, query.size(0) * key.size(0), query.size(1) / key.size(0), query.size(2));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      decode_tasks<scalar_t>(query, key, value, block_table, kv_lens, sinks_c, out, block_size, scale, window, softcap,
                             plan, split, begin, end);
    });
  });
  return out;
}

}  // namespace

namespace contbatch_parts {

void paged_decode_share(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& block_table, const at::Tensor& kv_lens, const at::Tensor& no_sinks,
                        at::Tensor& out, int64_t block_size, double scale, int64_t window, DecodeSplit& split,
                        int64_t t, int64_t threads) {
  const Plan plan = plan_of(kv_lens.data_ptr<int32_t>(), query.size(0), key.size(0), window);
  const int64_t units = plan.first.back();
  TORCH_CHECK(units <= split.units, "paged_decode_share: the split holds ", split.units, " units, the call has ", units);
  const auto [begin, end] = share_of(units, 1, t, threads);
  if (begin >= end) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode_tasks<scalar_t>(query, key, value, block_table, kv_lens, no_sinks, out, block_size, scale, window, 0.0,
                           plan, split, begin, end);
  });
}

void DecodeSplit::reserve(int64_t units_, int64_t heads, int64_t group, int64_t dim) {
  units = units_;
  partial.reset(new float[units * unit_floats(group, dim)]);
  done.reset(new std::atomic<int32_t>[heads]);
  for (int64_t i = 0; i < heads; ++i) done[i].store(0, std::memory_order_relaxed);
}

}  // namespace contbatch_parts

TORCH_LIBRARY(contbatch_cpu, m) {
  m.def(
      "paged_decode(Tensor query, Tensor key, Tensor value, Tensor block_table, Tensor kv_lens, Tensor sinks, "
      "int block_size, float scale, int window, float softcap) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}

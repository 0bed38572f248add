// Decode attention on the CPU, reading K/V in place through the block tables.
//
// One task per (request, KV head): the task loads that head's G grouped query heads once,
// walks the request's visible keys block by block straight out of the paged cache (no gather
// into a fresh tensor), and keeps scores, softmax and the weighted sum of values in float32
// whatever the cache dtype. Tasks are spread over PyTorch's intra-op OpenMP pool, the same
// pool as the model's other ops. Softmax is two-pass over a per-task score buffer: decode
// rows have one query each, so that buffer is G x (visible keys) floats.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
void decode(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& block_table,
            const at::Tensor& kv_lens, const at::Tensor& sinks, at::Tensor& out, int64_t block_size, double scale,
            int64_t window, double softcap) {
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
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

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(group * dim), acc(group * dim), inv(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads;
      const int64_t len = lens[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.resize(group * std::max<int64_t>(n, 1));
      const T* qr = q + (r * heads + h * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) qf[i] = static_cast<float>(qr[i]);
      const int32_t* blocks = table + r * table_row;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = first + j;
        const int64_t slot = static_cast<int64_t>(blocks[pos / block_size]) * block_size + pos % block_size;
        const T* kr = k + h * k_head + slot * k_slot;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * static_cast<float>(kr[d]);
          s *= fscale;
          if (cap > 0.f) s = std::tanh(s / cap) * cap;
          scores[g * n + j] = s;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        float m = sink ? sink[h * group + g] : -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) m = std::max(m, sg[j]);
        float sum = sink ? std::exp(sink[h * group + g] - m) : 0.f;
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = std::exp(sg[j] - m);
          sum += sg[j];
        }
        inv[g] = sum > 0.f ? 1.f / sum : 0.f;
      }
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = first + j;
        const int64_t slot = static_cast<int64_t>(blocks[pos / block_size]) * block_size + pos % block_size;
        const T* vr = v + h * v_head + slot * v_slot;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + j];
          float* ag = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ag[d] += p * static_cast<float>(vr[d]);
        }
      }
      T* orow = o + (r * heads + h * group) * dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d) orow[g * dim + d] = static_cast<T>(acc[g * dim + d] * inv[g]);
    }
  });
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(query, key, value, block_table, kv_lens, sinks_c, out, block_size, scale, window, softcap);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(contbatch_cpu, m) {
  m.def(
      "paged_decode(Tensor query, Tensor key, Tensor value, Tensor block_table, Tensor kv_lens, Tensor sinks, "
      "int block_size, float scale, int window, float softcap) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}

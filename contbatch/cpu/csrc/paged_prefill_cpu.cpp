// Prefill attention on the CPU (prompt chunks: several query tokens a request), reading K/V in
// place through the block tables, every request of the step in one call.
//
// aten's SDPA ran the default model's prompts at a quarter of the machine's matmul rate: 9 query
// heads give two cores too few tasks, and at a few hundred tokens its causal mask saves nothing.
// Here one task is (request, KV head, tile of query positions): the tile's queries of the G
// heads sharing that KV head form one M x D float32 matrix (M = G x positions) that walks the
// visible keys 64 at a time with an online softmax (flash attention): S = Q K^T, then
// O += P V, each product a register-tiled loop over small float32 copies of the key block
// (transposed) and value block, whatever the cache dtype. Tasks are taken largest first from a
// shared counter, since causal tiles differ in cost. The step's own keys are read back from the
// cache (written before attention), so a later chunk of a prompt is no different from a first.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

using namespace contbatch_vec;

constexpr int64_t kKeys = 64;  // keys per block: four AVX-512 vectors of scores a row
constexpr int64_t kRows = 6;   // rows of a register tile (6 x 4 vectors of sums)

struct Task {
  int64_t request, head, first, count;  // query positions first .. first+count-1 of the chunk
  int64_t cost;
};

#if defined(CONTBATCH_VEC_AVX2)
// s[r * kKeys + j] = q[r] . kt[:, j] for rows r < P and 32 keys j (kt's rows kKeys apart).
template <int P>
inline void score_rows8(const float* q, int64_t dim, const float* kt, float* s) {
  __m256 acc[P][4];
  for (int r = 0; r < P; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const float* kd = kt + d * kKeys;
    const __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8), k2 = _mm256_loadu_ps(kd + 16),
                 k3 = _mm256_loadu_ps(kd + 24);
    for (int r = 0; r < P; ++r) {
      const __m256 qv = _mm256_broadcast_ss(q + r * dim + d);
      acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(qv, k2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(qv, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < P; ++r)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(s + r * kKeys + c * 8, acc[r][c]);
}

// o[r][0, 8 C) += sum_j p[r * kKeys + j] v[j][0, 8 C) for rows r < P, C <= 4 vectors of sums a row.
template <int P, int C>
inline void value_rows8(const float* p, const float* v, int64_t dim, int64_t n, float* o) {
  __m256 acc[P][C];
  for (int r = 0; r < P; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_loadu_ps(o + r * dim + c * 8);
  for (int64_t j = 0; j < n; ++j) {
    __m256 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = _mm256_loadu_ps(v + j * dim + c * 8);
    for (int r = 0; r < P; ++r) {
      const __m256 pv = _mm256_broadcast_ss(p + r * kKeys + j);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(pv, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < P; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(o + r * dim + c * 8, acc[r][c]);
}

// value_rows8 over a row's 2 W vectors: four at a time, then the two left, for P rows.
template <int P, int W>
inline void value_cols8(const float* p, const float* v, int64_t dim, int64_t n, float* o) {
  int c = 0;
  for (; c + 4 <= 2 * W; c += 4) value_rows8<P, 4>(p, v + c * 8, dim, n, o + c * 8);
  if (c < 2 * W) value_rows8<P, 2>(p, v + c * 8, dim, n, o + c * 8);
}
#endif

// s[r * kKeys + j] = q[r] . kt[:, j] for rows r < R: kt is the key block transposed (dim x kKeys).
template <int R>
inline void score_rows(const float* q, int64_t dim, const float* kt, float* s) {
#if defined(__AVX512F__)
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const float* kd = kt + d * kKeys;
    const __m512 k0 = _mm512_loadu_ps(kd), k1 = _mm512_loadu_ps(kd + 16), k2 = _mm512_loadu_ps(kd + 32),
                 k3 = _mm512_loadu_ps(kd + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * dim + d]);
      acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(qv, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(qv, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kKeys + c * 16, acc[r][c]);
#elif defined(CONTBATCH_VEC_AVX2)
  // 16 AVX2 registers: two rows x 32 keys of sums (8) and the keys' 4 vectors at a time. Each
  // sum is the same chain of FMAs over d as above, so the scores are the AVX-512 path's.
  for (int64_t half = 0; half < kKeys; half += 32) {
    int r = 0;
    for (; r + 2 <= R; r += 2) score_rows8<2>(q + r * dim, dim, kt + half, s + r * kKeys + half);
    if (r < R) score_rows8<1>(q + r * dim, dim, kt + half, s + r * kKeys + half);
  }
#else
  for (int r = 0; r < R; ++r) {
    float acc[kKeys] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const float qv = q[r * dim + d];
      for (int64_t j = 0; j < kKeys; ++j) acc[j] = std::fma(qv, kt[d * kKeys + j], acc[j]);
    }
    std::copy(acc, acc + kKeys, s + r * kKeys);
  }
#endif
}

// o[r][0, 16 W) += sum_j p[r * kKeys + j] v[j][0, 16 W) for rows r < R and keys j < n (v's rows
// `dim` apart): W vectors of a row's running sums held in registers over the block's keys.
template <int R, int W>
inline void value_rows(const float* p, const float* v, int64_t dim, int64_t n, float* o) {
#if defined(__AVX512F__)
  __m512 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) acc[r][c] = _mm512_loadu_ps(o + r * dim + c * 16);
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[W];
    for (int c = 0; c < W; ++c) vv[c] = _mm512_loadu_ps(v + j * dim + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 pv = _mm512_set1_ps(p[r * kKeys + j]);
      for (int c = 0; c < W; ++c) acc[r][c] = _mm512_fmadd_ps(pv, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) _mm512_storeu_ps(o + r * dim + c * 16, acc[r][c]);
#elif defined(CONTBATCH_VEC_AVX2)
  // Two rows at a time (8 sums + 4 value vectors + the weight of 16 registers); the same FMA
  // chain over j per output as above.
  int r = 0;
  for (; r + 2 <= R; r += 2) value_cols8<2, W>(p + r * kKeys, v, dim, n, o + r * dim);
  if (r < R) value_cols8<1, W>(p + r * kKeys, v, dim, n, o + r * dim);
#else
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) {
      const float pv = p[r * kKeys + j];
      for (int64_t d = 0; d < 16 * W; ++d) o[r * dim + d] = std::fma(pv, v[j * dim + d], o[r * dim + d]);
    }
#endif
}

// S = Q K^T for rows [0, m) of the tile, register tile by register tile.
inline void scores(const float* q, int64_t m, int64_t dim, const float* kt, float* s) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) score_rows<kRows>(q + r * dim, dim, kt, s + r * kKeys);
  switch (m - r) {
    case 1: score_rows<1>(q + r * dim, dim, kt, s + r * kKeys); break;
    case 2: score_rows<2>(q + r * dim, dim, kt, s + r * kKeys); break;
    case 3: score_rows<3>(q + r * dim, dim, kt, s + r * kKeys); break;
    case 4: score_rows<4>(q + r * dim, dim, kt, s + r * kKeys); break;
    case 5: score_rows<5>(q + r * dim, dim, kt, s + r * kKeys); break;
    default: break;
  }
}

template <int R>
inline void value_cols(const float* p, const float* v, int64_t dim, int64_t n, float* o) {
  int64_t c = 0;  // 16-float columns, four at a time (dim is a multiple of 16)
  for (; c + 4 <= dim / 16; c += 4) value_rows<R, 4>(p, v + c * 16, dim, n, o + c * 16);
  switch (dim / 16 - c) {
    case 1: value_rows<R, 1>(p, v + c * 16, dim, n, o + c * 16); break;
    case 2: value_rows<R, 2>(p, v + c * 16, dim, n, o + c * 16); break;
    case 3: value_rows<R, 3>(p, v + c * 16, dim, n, o + c * 16); break;
    default: break;
  }
}

// O += P V for rows [0, m) of the tile.
inline void values(const float* p, int64_t m, const float* v, int64_t dim, int64_t n, float* o) {
  if (dim % 16) {  // no 16-float columns: plain loops
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) {
        const float pv = p[r * kKeys + j];
        for (int64_t d = 0; d < dim; ++d) o[r * dim + d] = std::fma(pv, v[j * dim + d], o[r * dim + d]);
      }
    return;
  }
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) value_cols<kRows>(p + r * kKeys, v, dim, n, o + r * dim);
  switch (m - r) {
    case 1: value_cols<1>(p + r * kKeys, v, dim, n, o + r * dim); break;
    case 2: value_cols<2>(p + r * kKeys, v, dim, n, o + r * dim); break;
    case 3: value_cols<3>(p + r * kKeys, v, dim, n, o + r * dim); break;
    case 4: value_cols<4>(p + r * kKeys, v, dim, n, o + r * dim); break;
    case 5: value_cols<5>(p + r * kKeys, v, dim, n, o + r * dim); break;
    default: break;
  }
}

inline float row_max(const float* s, int64_t a, int64_t b) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = a;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(m);
  for (; j + 16 <= b; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
  m = _mm512_reduce_max_ps(mv);
#elif defined(CONTBATCH_VEC_AVX2)
  __m256 mv = _mm256_set1_ps(m);
  for (; j + 8 <= b; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#endif
  for (; j < b; ++j) m = std::max(m, s[j]);
  return m;
}

template <typename T>
struct Prefill {
  const T* q;
  int64_t q_token, q_head;  // strides of the queries (tokens, heads); dims contiguous
  const T* k;
  const T* v;
  int64_t k_head, k_slot, v_head, v_slot;
  const int32_t* table;
  int64_t table_row, block_size;
  const int32_t *q_start, *q_len, *kv_len;
  const float* sink;
  T* out;
  int64_t heads, group, dim;
  float scale, cap;
  int64_t window;

  // The tile's buffers, one set per thread.
  struct Buffers {
    std::vector<float> q, o, s, kt, vb, m, l;
    std::vector<int64_t> slot;
  };

  void run(const Task& t, Buffers& b) const {
    const int64_t rows = group * t.count;  // row g * count + i: head g, position first + i
    const int64_t past = kv_len[t.request] - q_len[t.request];  // keys before this chunk
    const int64_t p0 = past + t.first, p1 = p0 + t.count - 1;  // the tile's first and last position
    const int64_t lo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
    b.q.resize(rows * dim);
    b.o.assign(rows * dim, 0.f);
    b.s.resize(rows * kKeys);
    b.m.resize(rows);
    b.l.resize(rows);
    const float qscale = cap > 0.f ? 1.f : scale;  // soft-capping needs the raw product scaled first
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < t.count; ++i) {
        const T* src = q + (q_start[t.request] + t.first + i) * q_token + (t.head * group + g) * q_head;
        float* dst = b.q.data() + (g * t.count + i) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]) * qscale;
        // A sink joins the denominator as one more logit with no value: start from it.
        b.m[g * t.count + i] = sink ? sink[t.head * group + g] : -std::numeric_limits<float>::infinity();
        b.l[g * t.count + i] = sink ? 1.f : 0.f;
      }
    const int32_t* blocks = table + t.request * table_row;
    const T* kh = k + t.head * k_head;
    const T* vh = v + t.head * v_head;
    for (int64_t k0 = lo; k0 <= p1; k0 += kKeys) {
      const int64_t n = std::min(kKeys, p1 + 1 - k0);
      b.kt.resize(dim * kKeys);  // columns past n are never read back: their scores are zeroed
      b.vb.resize(kKeys * dim);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = k0 + j;
        const int64_t slot = static_cast<int64_t>(blocks[pos / block_size]) * block_size + pos % block_size;
        const T* kr = kh + slot * k_slot;
        const T* vr = vh + slot * v_slot;
        for (int64_t d = 0; d < dim; ++d) b.kt[d * kKeys + j] = static_cast<float>(kr[d]);
        float* vd = b.vb.data() + j * dim;
        for (int64_t d = 0; d < dim; ++d) vd[d] = static_cast<float>(vr[d]);
      }
      scores(b.q.data(), rows, dim, b.kt.data(), b.s.data());
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t p = p0 + row % t.count;  // this row's position
        float* s = b.s.data() + row * kKeys;
        // Visible keys of this row within the block: [a, e).
        const int64_t a = std::clamp<int64_t>((window > 0 ? p - window + 1 : 0) - k0, 0, n);
        const int64_t e = std::clamp<int64_t>(p + 1 - k0, 0, n);
        if (a >= e) {
          std::fill(s, s + kKeys, 0.f);
          continue;
        }
        if (cap > 0.f)
          for (int64_t j = a; j < e; ++j) s[j] = std::tanh(s[j] * scale / cap) * cap;
        const float m_old = b.m[row], m_new = std::max(m_old, row_max(s, a, e));
        const float sum = exp_shifted(s + a, e - a, m_new);
        std::fill(s, s + a, 0.f);
        std::fill(s + e, s + kKeys, 0.f);
        const float alpha = std::exp(m_old - m_new);  // 0 while the row had seen nothing
        if (alpha != 1.f) {
          float* o = b.o.data() + row * dim;
          for (int64_t d = 0; d < dim; ++d) o[d] *= alpha;
        }
        b.l[row] = b.l[row] * alpha + sum;
        b.m[row] = m_new;
      }
      values(b.s.data(), rows, b.vb.data(), dim, n, b.o.data());
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < t.count; ++i) {
        const int64_t row = g * t.count + i;
        const float inv = b.l[row] > 0.f ? 1.f / b.l[row] : 0.f;
        T* dst = out + ((q_start[t.request] + t.first + i) * heads + t.head * group + g) * dim;
        const float* o = b.o.data() + row * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(o[d] * inv);
      }
  }
};

// query [tokens, heads, dim] (dims contiguous, any token/head strides); key/value one layer's
// cache as [kv_heads, slots, dim]; block_table [requests, width], q_start / q_len / kv_len
// [requests] int32 (where each request's chunk starts in `query`, its length, and the keys it
// attends to, the chunk's own included); sinks [heads] float32 or empty; out [tokens, heads,
// dim] contiguous: each chunk's rows are written, the others left as they are.
// window <= 0: none; softcap <= 0: none.
void paged_prefill(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const at::Tensor& block_table, const at::Tensor& q_start, const at::Tensor& q_len,
                   const at::Tensor& kv_len, const at::Tensor& sinks, int64_t block_size, double scale, int64_t window,
                   double softcap, const at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [tokens, heads, dim] with contiguous rows");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.stride(2) == 1 && value.stride(2) == 1,
              "key/value must be [kv_heads, slots, dim] with contiguous rows");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, key, value and out must share a dtype");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must be a contiguous tensor shaped as query");
  TORCH_CHECK(query.size(1) % key.size(0) == 0, "query heads must be a multiple of KV heads");
  for (const at::Tensor* t : {&block_table, &q_start, &q_len, &kv_len})
    TORCH_CHECK(t->scalar_type() == at::kInt, "block_table, q_start, q_len and kv_len must be int32");
  TORCH_CHECK(block_table.stride(1) == 1 && q_start.is_contiguous() && q_len.is_contiguous() && kv_len.is_contiguous(),
              "block_table rows and the per-request vectors must be contiguous");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.numel() == query.size(1)),
              "sinks must be empty or float32 [heads]");
  const int64_t requests = q_len.numel(), kv_heads = key.size(0), group = query.size(1) / kv_heads;
  if (requests == 0) return;
  const at::Tensor sinks_c = sinks.contiguous();
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int32_t* ql = q_len.data_ptr<int32_t>();
  const int32_t* kl = kv_len.data_ptr<int32_t>();
  // Tiles of about 96 rows (32 positions of 3 grouped heads): big enough for the register
  // tiles to pay, small enough that a few prompts still make work for every core.
  const int64_t per_tile = std::max<int64_t>(8, 96 / group);
  std::vector<Task> tasks;
  for (int64_t r = 0; r < requests; ++r) {
    TORCH_CHECK(ql[r] >= 0 && ql[r] <= kl[r] && qs[r] >= 0 && qs[r] + ql[r] <= query.size(0),
                "paged_prefill: request ", r, " has an inconsistent q_start/q_len/kv_len");
    for (int64_t first = 0; first < ql[r]; first += per_tile) {
      const int64_t count = std::min<int64_t>(per_tile, ql[r] - first);
      const int64_t last = kl[r] - ql[r] + first + count;  // keys the tile's last row sees
      const int64_t keys = window > 0 ? std::min<int64_t>(last, window + count) : last;
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({r, h, first, count, keys * count});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_prefill", [&] {
    Prefill<scalar_t> p{query.data_ptr<scalar_t>(), query.stride(0), query.stride(1),
                        key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), key.stride(0), key.stride(1),
                        value.stride(0), value.stride(1), block_table.data_ptr<int32_t>(), block_table.stride(0),
                        block_size, qs, ql, kl, sinks_c.numel() ? sinks_c.data_ptr<float>() : nullptr,
                        out.data_ptr<scalar_t>(), query.size(1), group, query.size(2),
                        static_cast<float>(scale), static_cast<float>(softcap), window};
    std::atomic<size_t> next{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
      typename Prefill<scalar_t>::Buffers buffers;
      for (int64_t w = begin; w < end; ++w)
        for (size_t i = next++; i < tasks.size(); i = next++) p.run(tasks[i], buffers);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(contbatch_cpu, m) {
  m.def(
      "paged_prefill(Tensor query, Tensor key, Tensor value, Tensor block_table, Tensor q_start, Tensor q_len, "
      "Tensor kv_len, Tensor sinks, int block_size, float scale, int window, float softcap, Tensor(a!) out) -> ()");
  m.impl("paged_prefill", c10::DispatchKey::CPU, TORCH_FN(paged_prefill));
}

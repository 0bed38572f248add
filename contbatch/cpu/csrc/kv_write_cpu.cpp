// A step's new keys and values into the paged cache: row (head h, token t) of K and V goes to
// slot slots[t] of head h.
//
// aten's index_copy_ took 40-50 us a call for a 32-request decode step inside the engine (10%
// of a bfloat16 decode step, K and V of 30 layers), against ~6 us on a cache that fits in L3:
// each row lands on a random line of a gigabyte-sized cache, and every store first reads the
// line it overwrites. Rows that fill whole 64-byte lines (head dims of 32 float32 or 64
// bfloat16 values and their multiples, on an aligned cache) are written with streaming stores,
// which skip that read; others are copied as they are.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// One row of `bytes` bytes from src to dst.
inline void copy_row(char* dst, const char* src, int64_t bytes, bool stream) {
#if defined(__AVX512F__)
  if (stream) {
    for (int64_t b = 0; b < bytes; b += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + b),
                          _mm512_loadu_si512(reinterpret_cast<const void*>(src + b)));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// cache [heads, slots, dim] (any strides on the first two, dim contiguous): the key or value
// cache of one layer; rows [heads, tokens, dim] likewise; slots [tokens] int64.
void write(const at::Tensor& cache, const at::Tensor& rows, const int64_t* slot) {
  const int64_t heads = rows.size(0), tokens = rows.size(1);
  const int64_t item = rows.element_size(), bytes = rows.size(2) * item;
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(rows.data_ptr());
  const int64_t c_head = cache.stride(0) * item, c_slot = cache.stride(1) * item;
  const int64_t r_head = rows.stride(0) * item, r_token = rows.stride(1) * item;
  const bool stream = bytes % 64 == 0 && c_slot % 64 == 0 && c_head % 64 == 0 &&
                      reinterpret_cast<uintptr_t>(dst) % 64 == 0;
  // Small writes (a decode step) stay on this thread: waking the pool costs more than they do.
  at::parallel_for(0, heads * tokens, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / tokens, t = i % tokens;
      copy_row(dst + h * c_head + slot[t] * c_slot, src + h * r_head + t * r_token, bytes, stream);
    }
#if defined(__AVX512F__)
    if (stream) _mm_sfence();  // this thread's streaming stores land before the attention reads them
#endif
  });
}

void kv_write(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slots,
              const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots must be a contiguous int64 vector");
  for (const at::Tensor* t : {&key_cache, &value_cache, &key, &value})
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1, "caches and rows must be [heads, n, dim] with contiguous dims");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(1) == slots.size(0), "key/value must be [heads, slots, dim]");
  TORCH_CHECK(key_cache.size(0) == key.size(0) && key_cache.size(2) == key.size(2) &&
                  value_cache.sizes() == key_cache.sizes(),
              "the caches' heads and dim must match the rows'");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "caches and rows must share a dtype");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t rows = key_cache.size(1);
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < rows, "kv_write: slot ", slot[t], " is outside the cache's ", rows, " rows");
  write(key_cache, key, slot);
  write(value_cache, value, slot);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(contbatch_cpu, m) {
  m.def("kv_write(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slots, Tensor key, Tensor value) -> ()");
  m.impl("kv_write", c10::DispatchKey::CPU, TORCH_FN(kv_write));
}

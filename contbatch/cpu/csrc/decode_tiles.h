// The register tiles of the CPU decode attention (paged_decode_cpu.cpp, included there only): the
// score pass (each key row dotted with a KV head's grouped query heads) and the value pass (the
// softmax weights times the value rows), for AVX-512 (16-float vectors) and AVX2 (8-float), with
// the key walk through a request's block table that both passes share.

#pragma once

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace contbatch_decode {

using namespace contbatch_vec;

// The register tiles' vector: 16 floats with AVX-512, 8 with AVX2 (CONTBATCH_VEC_AVX2, vec.h).
#if defined(__AVX512F__)
#define CONTBATCH_AVX512 1
#define CONTBATCH_TILES 1
using TileVec = __m512;
constexpr int kPartVecs = 64;  // 16 keys x up to 4 heads of a tile
#elif defined(CONTBATCH_VEC_AVX2)
#define CONTBATCH_TILES 1
using TileVec = __m256;
constexpr int kHeads = 4;
constexpr int kChunk = 8;
constexpr int kPartVecs = 8 * kHeads;  // 8 keys x up to 4 heads
#endif

#ifdef CONTBATCH_TILES
constexpr int kLanes = sizeof(TileVec) / sizeof(float);

// Keys (or values) a request reads are short runs of rows scattered over the cache, too short
// for the hardware prefetcher to ramp up: ask for the row `keys` on while this one is used
// (vec.h's kKvStreams setting: its bytes ahead in rows of this dtype and dim, at least one;
// none for 0), into the level it names. The score pass asks for the value rows too (`vh`), so
// the value pass after the softmax finds its rows in cache and both streams are in flight at once.
struct KeysAhead {
  int64_t keys;
  bool l2;
};
template <int C, typename T>  // rows of C vectors
inline KeysAhead keys_ahead() {
  const Ahead a = stream_ahead(kKvStreams);
  constexpr int64_t kRow = C * kLanes * sizeof(T);
  return {a.bytes ? std::max<int64_t>(1, a.bytes / kRow) : 0, a.l2};
}
template <int C, typename T>  // a row of C vectors
inline void prefetch_row(const T* row, bool l2) {
  for (size_t b = 0; b < C * kLanes * sizeof(T); b += 64) prefetch_line(reinterpret_cast<const char*>(row) + b, l2);
}
#endif

#ifdef CONTBATCH_AVX512
// Lane i of the result: the sum of the 16 lanes of v[i] (v is overwritten). Pairs of
// vectors are interleaved and added four times over: 45 instructions for 16 sums.
inline __m512 sum16(__m512* v) {
  for (int i = 0; i < 8; ++i)
    v[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(v[2 * i]), y = _mm512_castps_pd(v[2 * i + 1]);
    v[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

// Calls fn(j, slot) for the visible keys j = 0 .. n-1 (positions first .. first+n-1) of one
// request, walking its block table one block at a time (no division per key).
template <typename Fn>
inline void for_each_slot(const int32_t* blocks, int64_t block_size, int64_t first, int64_t len, Fn&& fn) {
  for (int64_t pos = first; pos < len;) {
    const int64_t b = pos / block_size;
    const int64_t stop = std::min(len, (b + 1) * block_size);
    const int64_t base = static_cast<int64_t>(blocks[b]) * block_size - b * block_size;
    for (; pos < stop; ++pos) fn(pos - first, base + pos);
  }
}

#ifdef CONTBATCH_AVX512
// Register tiles for head dims of 32, 64, 128 and 256 (C = dim / 16 vectors a row): GB query
// heads of one KV head at a time, their queries (scores) or running sums (values) held in
// registers over all the request's keys.
template <int C>
constexpr int kGroupTile = C >= 16 ? 1 : C >= 8 ? 2 : 4;

// sc[g * n + j] = q_g . k_j for the tile's GB heads: sixteen keys at a time, each key's
// products with a head summed into one vector, the sixteen vectors reduced together (sum16):
// a few instructions a key instead of one horizontal sum per key and head.
template <int C, int GB, typename T>
void score_tile(const T* kh, int64_t k_slot, const int64_t* slots, int64_t n, const float* qf, float* sc, __m512* part,
                const T* vh, int64_t v_slot) {
  const KeysAhead ahead = keys_ahead<C, T>();
  __m512 qv[GB][C];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_ps(qf + (g * C + c) * 16);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    for (int64_t jj = 0; jj < 16; ++jj) {
      if (jj >= count) {
        for (int g = 0; g < GB; ++g) part[g * 16 + jj] = _mm512_setzero_ps();
        continue;
      }
      if (ahead.keys && j0 + jj + ahead.keys < n) {
        prefetch_row<C>(kh + slots[j0 + jj + ahead.keys] * k_slot, ahead.l2);
        if (vh) prefetch_row<C>(vh + slots[j0 + jj + ahead.keys] * v_slot, ahead.l2);  // the value pass's rows
      }
      const T* kr = kh + slots[j0 + jj] * k_slot;
      __m512 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load16(kr + c * 16);
      for (int g = 0; g < GB; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
        part[g * 16 + jj] = a;
      }
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    for (int g = 0; g < GB; ++g) _mm512_mask_storeu_ps(sc + g * n + j0, mask, sum16(part + g * 16));
  }
}

// acc[g] = sum_j p_gj v_j for the tile's GB heads, sums in registers.
template <int C, int GB, typename T>
void value_tile(const T* vh, int64_t v_slot, const int64_t* slots, int64_t n, const float* sc, float* acc) {
  const KeysAhead ahead = keys_ahead<C, T>();
  __m512 a[GB][C];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (ahead.keys && j + ahead.keys < n) prefetch_row<C>(vh + slots[j + ahead.keys] * v_slot, ahead.l2);
    const T* vr = vh + slots[j] * v_slot;
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(vr + c * 16);
    for (int g = 0; g < GB; ++g) {
      const __m512 p = _mm512_set1_ps(sc[g * n + j]);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(p, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (g * C + c) * 16, a[g][c]);
}

// Both passes for one request and KV head over `group` query heads, tile by tile.
template <int C, typename T>
void tiles(bool scores, const T* kvh, int64_t stride, const int64_t* slots, int64_t n, int64_t group, float* qf_or_acc,
           float* sc, __m512* part, const T* vh, int64_t v_slot) {
  constexpr int GB = kGroupTile<C>;
  for (int64_t g0 = 0; g0 < group; g0 += GB) {
    const int64_t gb = std::min<int64_t>(GB, group - g0);
    float* rowbuf = qf_or_acc + g0 * C * 16;
    float* sg = sc + g0 * n;
#define CONTBATCH_TILE(B)                                                             \
  if (scores) score_tile<C, B>(kvh, stride, slots, n, rowbuf, sg, part, g0 ? nullptr : vh, v_slot); \
  else value_tile<C, B>(kvh, stride, slots, n, sg, rowbuf);
    switch (gb) {
      case 1: { CONTBATCH_TILE(1) break; }
      case 2: { if constexpr (GB >= 2) { CONTBATCH_TILE(2) } break; }
      case 3: { if constexpr (GB >= 3) { CONTBATCH_TILE(3) } break; }
      default: { if constexpr (GB >= 4) { CONTBATCH_TILE(4) } break; }
    }
#undef CONTBATCH_TILE
  }
}
#endif

#ifdef CONTBATCH_VEC_AVX2
// The same two passes in AVX2 registers (8 floats, 16 registers), for AVX2-only CPUs:
// their generic loops ran the decode step's attention 2-3x slower than the AVX-512 tiles on
// the same core. Per pass: up to kHeads query heads' score sums and a chunk of up to kChunk
// vectors of the key row in registers (4 + 8 of 16).

// Lane i of the result: the sum of the 8 lanes of v[i].
inline __m256 sum8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// sc[g * n + j] = q_g . k_j for GB heads, eight keys at a time: each key's products with a
// head summed into one vector, the eight vectors reduced together (sum8).
template <int C, int GB, typename T>
void score_tile(const T* kh, int64_t k_slot, const int64_t* slots, int64_t n, const float* qf, float* sc, __m256* part,
                const T* vh, int64_t v_slot) {
  constexpr int W = C < kChunk ? C : kChunk;
  const KeysAhead ahead = keys_ahead<C, T>();
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - j0);
    for (int64_t jj = 0; jj < 8; ++jj) {
      if (jj >= count) {
        for (int g = 0; g < GB; ++g) part[g * 8 + jj] = _mm256_setzero_ps();
        continue;
      }
      if (ahead.keys && j0 + jj + ahead.keys < n) {
        prefetch_row<C>(kh + slots[j0 + jj + ahead.keys] * k_slot, ahead.l2);
        if (vh) prefetch_row<C>(vh + slots[j0 + jj + ahead.keys] * v_slot, ahead.l2);  // the value pass's rows
      }
      const T* kr = kh + slots[j0 + jj] * k_slot;
      __m256 a[GB];
      for (int g = 0; g < GB; ++g) a[g] = _mm256_setzero_ps();
      for (int c0 = 0; c0 < C; c0 += W) {
        __m256 kv[W];
        for (int c = 0; c < W; ++c) kv[c] = load8(kr + (c0 + c) * 8);
        for (int c = 0; c < W; ++c)
          for (int g = 0; g < GB; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (g * C + c0 + c) * 8), kv[c], a[g]);
      }
      for (int g = 0; g < GB; ++g) part[g * 8 + jj] = a[g];
    }
    for (int g = 0; g < GB; ++g) {
      const __m256 sums = sum8(part + g * 8);
      if (count == 8) {
        _mm256_storeu_ps(sc + g * n + j0, sums);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, sums);
        for (int64_t jj = 0; jj < count; ++jj) sc[g * n + j0 + jj] = tmp[jj];
      }
    }
  }
}

// acc[g] = sum_j p_gj v_j: one head and a chunk of up to kChunk vectors of it at a time, the
// sums in registers; the request's value rows are read once from memory (the first pass
// prefetches them) and again from cache by the other heads and chunks.
template <int C, typename T>
void value_tile(const T* vh, int64_t v_slot, const int64_t* slots, int64_t n, int64_t group, const float* sc, float* acc) {
  constexpr int W = C < kChunk ? C : kChunk;
  const KeysAhead ahead = keys_ahead<C, T>();
  for (int64_t g = 0; g < group; ++g) {
    const float* sg = sc + g * n;
    for (int c0 = 0; c0 < C; c0 += W) {
      __m256 a[W];
      for (int c = 0; c < W; ++c) a[c] = _mm256_setzero_ps();
      const bool first = g == 0 && c0 == 0;
      for (int64_t j = 0; j < n; ++j) {
        if (first && ahead.keys && j + ahead.keys < n)
          prefetch_row<C>(vh + slots[j + ahead.keys] * v_slot, ahead.l2);
        const T* vr = vh + slots[j] * v_slot + c0 * 8;
        const __m256 p = _mm256_set1_ps(sg[j]);
        for (int c = 0; c < W; ++c) a[c] = _mm256_fmadd_ps(p, load8(vr + c * 8), a[c]);
      }
      for (int c = 0; c < W; ++c) _mm256_storeu_ps(acc + g * C * 8 + (c0 + c) * 8, a[c]);
    }
  }
}

template <int C, typename T>
void tiles(bool scores, const T* kvh, int64_t stride, const int64_t* slots, int64_t n, int64_t group, float* qf_or_acc,
           float* sc, __m256* part, const T* vh, int64_t v_slot) {
  if (!scores) {
    value_tile<C>(kvh, stride, slots, n, group, sc, qf_or_acc);
    return;
  }
  for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
    const float* q = qf_or_acc + g0 * C * 8;
    float* sg = sc + g0 * n;
    switch (std::min<int64_t>(kHeads, group - g0)) {
      case 1: score_tile<C, 1>(kvh, stride, slots, n, q, sg, part, g0 ? nullptr : vh, v_slot); break;
      case 2: score_tile<C, 2>(kvh, stride, slots, n, q, sg, part, g0 ? nullptr : vh, v_slot); break;
      case 3: score_tile<C, 3>(kvh, stride, slots, n, q, sg, part, g0 ? nullptr : vh, v_slot); break;
      default: score_tile<C, 4>(kvh, stride, slots, n, q, sg, part, g0 ? nullptr : vh, v_slot); break;
    }
  }
}

#endif

#ifdef CONTBATCH_TILES
// Both passes for head dims of 32, 64, 128 and 256 (C = dim / kLanes vectors a row); false
// for other dims (the caller's generic loops then run).
template <typename T>
bool run_tiles(bool scores, const T* kvh, int64_t stride, const int64_t* slots, int64_t n, int64_t group, int64_t dim,
               float* qf_or_acc, float* sc, TileVec* part, const T* vh = nullptr, int64_t v_slot = 0) {
  switch (dim) {
    case 32: tiles<32 / kLanes>(scores, kvh, stride, slots, n, group, qf_or_acc, sc, part, vh, v_slot); return true;
    case 64: tiles<64 / kLanes>(scores, kvh, stride, slots, n, group, qf_or_acc, sc, part, vh, v_slot); return true;
    case 128: tiles<128 / kLanes>(scores, kvh, stride, slots, n, group, qf_or_acc, sc, part, vh, v_slot); return true;
    case 256: tiles<256 / kLanes>(scores, kvh, stride, slots, n, group, qf_or_acc, sc, part, vh, v_slot); return true;
    default: return false;
  }
}
#endif

}  // namespace contbatch_decode

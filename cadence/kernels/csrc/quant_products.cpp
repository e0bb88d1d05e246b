// The quantized product y = x W^T over packed tiles (quant_layout.h describes the layout
// and the loops; quant_repack.cpp builds the tiles).

#include "quant_layout.h"

namespace cadence_quant {
namespace {

// Whether this build has the bfloat16 pair products (see bf16_pairs).
#if defined(CADENCE_QUANT_AVX2) && defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define CADENCE_QUANT_BF16_DOT 1
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// ---- the product ---------------------------------------------------------------------------
//
// Activations stay float: each row is read as float32 (bfloat16/float16 widened), and per
// tile and group the 8 rows' codes become float32 lanes that multiply the broadcast
// activation of their column. The integer codes are summed against x first and scaled once
// per group: sum_k (s q_k + m) x_k = s * sum_k q_k x_k + m * sum_k x_k (for an offset type,
// s * (sum_k q_k x_k - off * sum_k x_k)), so the float32 result differs from x @ W^T of the
// dequantized matrix only by the order of the float32 sums. (Where the CPU has AVX512_BF16,
// bfloat16 rows are read as bfloat16 pairs instead: see bf16_pairs.)

struct Acts {
  const float* x;            // [m, k] float32 (zero-padded to the blocks' columns)
  std::vector<float> sums;   // [m, groups, 2]: sum of each half-group of a row
  int64_t k;                 // padded columns
  const uint32_t* xp = nullptr;  // [m, k / 2] bfloat16 pairs (pair_rows), where the pair loops run
  bool sixteen = false;          // x came as bfloat16/float16: one order of sums per row
};

at::Tensor float_rows(const at::Tensor& x, int64_t k_padded) {
  // A contiguous float32 copy, padded with zero columns, unless x already is one.
  if (x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == k_padded) return x;
  auto out = at::zeros({x.size(0), k_padded}, x.options().dtype(at::kFloat));
  out.narrow(1, 0, x.size(1)).copy_(x);
  return out;
}

void half_sums(Acts* a, int64_t m, int64_t groups) {
  a->sums.assign(m * groups * 2, 0.f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int h = 0; h < 2; ++h) {
        const float* p = a->x + r * a->k + g * kGroup + 16 * h;
        float s = 0.f;
        for (int i = 0; i < 16; ++i) s += p[i];
        a->sums[(r * groups + g) * 2 + h] = s;
      }
    }
  }
}

// The rows of x (float32 widened from bfloat16: the top halves are the bfloat16 values) as
// bfloat16 pairs, out[r * k / 2 + g * 16 + j] = (column g * 32 + j, column g * 32 + j + 16).
void pair_rows(const float* x, int64_t m, int64_t k, std::vector<uint32_t>* out) {
  out->resize(m * k / 2);
  uint32_t* p = out->data();
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < k; c += kGroup) {
      for (int j = 0; j < 16; ++j, ++p) {
        uint32_t lo, hi;
        std::memcpy(&lo, x + r * k + c + j, 4);
        std::memcpy(&hi, x + r * k + c + j + 16, 4);
        *p = (lo >> 16) | (hi & 0xFFFF0000u);
      }
    }
  }
}

#if defined(CADENCE_QUANT_BF16_DOT)
// Word j of a group's pairs: column j in the low half, column j + 16 in the high one.
alignas(64) constexpr uint16_t kPairOrder[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// What the pair loops read of bfloat16 rows, straight from them: each row's pairs (as
// pair_rows) and half sums (as half_sums), one group of 32 columns a vector, columns past x's
// (the blocks' zero padding) as zeros. The float32 copy of the rows (float_rows) is left out:
// only the float32 loops read it. Before, the copy, the sums and the pairs took three passes
// on one thread ahead of every call: about 1.7 us more a call than this at one row of
// SmolLM2's projections, 2.4 us at 16 (docs/quantization.md).
void bf16_pairs_and_sums(const at::Tensor& x, int64_t k, Acts* a, std::vector<uint32_t>* pairs) {
  const int64_t m = x.size(0), kx = x.size(1), ld = x.stride(0), groups = k / kGroup;
  pairs->resize(m * k / 2);
  a->sums.resize(m * groups * 2);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const __m512i order = _mm512_load_si512(kPairOrder);
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* row = src + r * ld;
    uint32_t* p = pairs->data() + r * (k / 2);
    float* sums = a->sums.data() + r * groups * 2;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t valid = std::clamp<int64_t>(kx - g * kGroup, 0, kGroup);
      const __mmask32 mask = valid == kGroup ? ~__mmask32(0) : (__mmask32(1) << valid) - 1;
      const __m512i v = _mm512_maskz_loadu_epi16(mask, row + g * kGroup);
      _mm512_storeu_si512(p + g * 16, _mm512_permutexvar_epi16(order, v));
      // bfloat16 is the top half of a float32
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
      sums[2 * g] = _mm512_reduce_add_ps(lo);
      sums[2 * g + 1] = _mm512_reduce_add_ps(hi);
    }
  }
}
#endif

template <typename T>
inline void store_tile(const float* acc, const float* bias, T* out, int64_t valid) {
  for (int64_t r = 0; r < valid; ++r) out[r] = static_cast<T>(acc[r] + (bias ? bias[r] : 0.f));
}

// Portable: out[m, tile rows] for one tile, every activation row.
template <typename T>
void tile_portable(int64_t qtype, const Packed& pk, const uint8_t* tile, const Acts& a, int64_t m_total,
                   const float* bias, T* out, int64_t out_stride, int64_t valid) {
  for (int64_t m = 0; m < m_total; ++m) {
    float acc[kRows] = {0};
    for (int64_t g = 0; g < pk.groups; ++g) {
      const float* x = a.x + m * a.k + g * kGroup;
      for (int r = 0; r < kRows; ++r) {
        for (int h = 0; h < 2; ++h) {
          float dot = 0.f;
          for (int kk = 16 * h; kk < 16 * h + 16; ++kk) dot += static_cast<float>(code_at(pk, tile, g, r, kk)) * x[kk];
          const Affine af = affine_at(qtype, pk, tile, g, r, h);
          const float xs = a.sums[(m * pk.groups + g) * 2 + h];
          acc[r] += af.has_min ? af.scale * dot + af.min * xs : af.scale * (dot - static_cast<float>(af.offset) * xs);
        }
      }
    }
    store_tile(acc, bias, out + m * out_stride, valid);
  }
}

#if defined(CADENCE_QUANT_AVX2)
// Codes of columns k and k + 16 (k < 16) of a group for the 8 rows, as int32 lanes.
template <int kBits>
inline void column_pair(const uint8_t* codes, int k, __m256i* lo, __m256i* hi) {
  const int c = k / 4, kk = k % 4;
  if constexpr (kBits == 8) {
    *lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 32 * c + 8 * kk)));
    *hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 32 * (c + 4) + 8 * kk)));
  } else {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 32 * c + 8 * kk)));
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    *lo = _mm256_and_si256(v, low4);
    *hi = _mm256_srli_epi32(v, 4);
    if constexpr (kBits == 5) {
      const __m256i hb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 128 + 8 * kk)));
      const __m256i bit = _mm256_set1_epi32(0x10);
      *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_sllv_epi32(hb, _mm256_set1_epi32(4 - c)), bit));
      *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_srlv_epi32(hb, _mm256_set1_epi32(c)), bit));
    } else if constexpr (kBits == 6) {
      const __m256i two = _mm256_set1_epi32(0x30);
      const __m256i h0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 128 + 8 * kk)));
      const __m256i h1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 160 + 8 * kk)));
      // chunk c's bits sit at 2c of plane 0 (c < 4), chunk c + 4's at 2c of plane 1: move them to bits 4-5.
      const __m256i shift = _mm256_set1_epi32(2 * c);
      *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi32(_mm256_srlv_epi32(h0, shift), 4), two));
      *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_slli_epi32(_mm256_srlv_epi32(h1, shift), 4), two));
    }
  }
}

// How far ahead the product asks for weight bytes (2-16 KiB measured alike on Zen 5).
constexpr int64_t kPrefetchAhead = 4096;

// Asks for the cache lines `ahead` bytes past the part of a run of tiles that group g of G
// reads (a tile's bytes spread evenly over its groups), so the reads of later tiles overlap
// this group's arithmetic. The hardware's stream prefetcher stops at every 4 KiB page and a
// matrix streams from memory once per step: without this, one stream reached 6-12 GB/s of
// the ~38 GB/s two threads can read.
inline void prefetch_group(const uint8_t* tile, int64_t g, int64_t step, int64_t ahead) {
  const uint8_t* p = tile + ahead + g * step;
  for (int64_t off = 0; off < step; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
}

// A tile's factors for group g, one lane per row: the scale (for Q6_K, of columns 0-15, and
// `scale_hi` of 16-31), and the min (Q4_1: added; Q4_K/Q5_K: dmin times the sub-block's m,
// subtracted). Unused ones are zero.
template <int64_t QT>
inline void group_factors(const Packed& pk, const uint8_t* tile, int64_t g, __m256* scale, __m256* scale_hi,
                          __m256* minv) {
  const uint8_t* s = tile + pk.scales_at(g);
  *scale_hi = *minv = _mm256_setzero_ps();
  if constexpr (QT == kQ4_0 || QT == kQ8_0 || QT == kQ4_1) {
    *scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
    if constexpr (QT == kQ4_1) *minv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16)));
  } else {
    const uint8_t* sup = tile + pk.super_at(g / (kSuper / kGroup));
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sup)));
    const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
    const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 8));
    if constexpr (QT == kQ6_K) {
      *scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
      *scale_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
    } else {
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sup + 16)));
      *scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
      *minv = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
    }
  }
}

// Float32 vectors of 8 lanes (one tile's rows) and, on AVX-512, of 16 (two tiles' rows), for
// the loops written once for both widths.
struct F8 {
  using T = __m256;
  static constexpr int kLanes = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float v) { return _mm256_set1_ps(v); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T fnmadd(T a, T b, T c) { return _mm256_fnmadd_ps(a, b, c); }
};
#if defined(__AVX512F__)
struct F16 {
  using T = __m512;
  static constexpr int kLanes = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float v) { return _mm512_set1_ps(v); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T fnmadd(T a, T b, T c) { return _mm512_fnmadd_ps(a, b, c); }
};
#endif

// ---- bfloat16 pair products (AVX512_BF16) -----------------------------------------------
//
// With bfloat16 activations, a group's codes and activations are exact in bfloat16 (the
// codes are integers below 256), and one vdpbf16ps multiplies two columns per lane with
// float32 sums: the instruction runs as fast as a float32 multiply-add on Zen 5 (two a
// cycle, measured) and does twice its work, so the few-row loops of a verify step and the
// batched path take about half the arithmetic. Column j of a group pairs with column j + 16
// (their codes share a byte in the 4-bit layout): a lane holds (j, j + 16), j in the low
// half. The pair sums alternate between two chains, even j into `lo` and odd j into `hi`,
// so one row still keeps two sums in flight; finish_group then adds them as it adds the
// halves' sums of the float32 loops. Q6_K, whose halves have scales of their own, and
// float16 and float32 activations keep the float32 loops.
#if defined(CADENCE_QUANT_BF16_DOT)
// The codes of columns j and j + 16 (int32 lanes) as bfloat16 pairs: a small integer's
// bfloat16 is the top half of its float32.
inline __m256i bf16_pairs(__m256i qlo, __m256i qhi) {
  const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(qlo)), 16);
  return _mm256_mask_blend_epi16(0xAAAA, lo, _mm256_castps_si256(_mm256_cvtepi32_ps(qhi)));
}
inline __m512i bf16_pairs(__m512i qlo, __m512i qhi) {
  const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(qlo)), 16);
  return _mm512_mask_blend_epi16(0xAAAAAAAA, lo, _mm512_castps_si512(_mm512_cvtepi32_ps(qhi)));
}

// acc += the pairs of w times the activation pair at x, broadcast into a register first (in
// isolation, vdpbf16ps with a broadcast memory operand ran at a third of this speed on Zen 5;
// in these loops the two forms measured alike).
inline __m256 dot_pairs(__m256 acc, __m256i w, const uint32_t* x) {
  return _mm256_dpbf16_ps(acc, (__m256bh)w, (__m256bh)_mm256_set1_epi32(static_cast<int>(*x)));
}
inline __m512 dot_pairs(__m512 acc, __m512i w, const uint32_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(static_cast<int>(*x)));
}

// bfloat16 0-15 (the top halves of their float32 bits), then 16 unused words.
alignas(64) constexpr uint16_t kNibbleValues[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                                    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

template <typename I>
inline I nibble_index(I v) {  // (v & 0xF) | ((v >> 4) << 16) for bytes v: 0xA8 is C & (A | B)
  if constexpr (sizeof(I) == 64) {
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
  } else {
    return _mm256_ternarylogic_epi32(v, _mm256_slli_epi32(v, 12), _mm256_set1_epi32(0x000F000F), 0xA8);
  }
}

// The bfloat16 pairs of column k of a group (bf16_pairs), for one tile (8 lanes; for two,
// code_pairs_512). A 4-bit code's byte holds both columns of a pair (k in the low nibble,
// k + 16 in the high one): spread into the two halves of a lane, the nibbles index the table
// above, three operations where converting through float32 takes five.
template <int kBits>
inline __m256i code_pairs(const uint8_t* codes, int k) {
  if constexpr (kBits == 4) {
    const __m256i table = _mm256_load_si256(reinterpret_cast<const __m256i*>(kNibbleValues));
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 32 * (k / 4) + 8 * (k % 4))));
    return _mm256_permutexvar_epi16(nibble_index(v), table);
  } else {
    __m256i qlo, qhi;
    column_pair<kBits>(codes, k, &qlo, &qhi);
    return bf16_pairs(qlo, qhi);
  }
}

#endif

// ---- one order of operations for every row ------------------------------------------------
//
// With 16-bit activations every path computes a row's outputs with the same operations in
// the same order, whatever the number of rows and whichever loop takes them: per group, the
// sum over columns 0-15 (`lo`) and the sum over columns 16-31 (`hi`), each a chain of
// multiply-adds in column order from zero, then `finish_group` (the bfloat16 pair products
// split a group's sums their own way, the same in every loop: bf16_pairs). So a row's result does not
// depend on the other rows of the call: a decode step of one row, a verify step of one
// request's last token and its drafts, a batch of any size and a prefill chunk give each row
// the same bits. Where the result is rounded to bfloat16, a one-ulp float32 difference would
// move a rounded value now and then, and a greedy output would follow the batch's size
// (speculative decoding's outputs must equal the ones without it, and a request must not
// answer differently beside others). The 1-4 row loops (AVX-512: 1-8) keep this order for
// float32 activations too; larger float32 calls take faster orders of their own.

// acc += the group's contribution, from its two column sums.
template <int64_t QT, typename V>
inline typename V::T finish_group(typename V::T acc, typename V::T lo, typename V::T hi, typename V::T scale,
                                  typename V::T scale_hi, typename V::T minv, const float* xs) {
  constexpr bool kHasMin = QT == kQ4_1 || QT == kQ4_K || QT == kQ5_K;
  constexpr float kOffset = QT == kQ4_0 ? 8.f : QT == kQ6_K ? 32.f : 0.f;
  if constexpr (QT == kQ6_K) {  // a scale per half
    acc = V::fmadd(scale, V::sub(lo, V::set1(kOffset * xs[0])), acc);
    return V::fmadd(scale_hi, V::sub(hi, V::set1(kOffset * xs[1])), acc);
  } else {
    typename V::T d = V::add(lo, hi);
    if constexpr (kOffset != 0.f) d = V::sub(d, V::set1(kOffset * (xs[0] + xs[1])));
    acc = V::fmadd(scale, d, acc);
    if constexpr (QT == kQ4_1) {
      acc = V::fmadd(minv, V::set1(xs[0] + xs[1]), acc);
    } else if constexpr (kHasMin) {
      acc = V::fnmadd(minv, V::set1(xs[0] + xs[1]), acc);
    }
    return acc;
  }
}

// Rows [m0, m0 + MB) against NTB adjacent tiles: acc[n * MB + m] += tile n's 8 dot products.
// Two tiles for one or two rows give the multiply-adds enough independent sums (each lane's
// lo and hi chains) to hide their latency; the order of each lane's sums is the same.
template <int64_t QT, int MB, int NTB = 1, bool kDot = false>
inline void tile_block(const Packed& pk, const uint8_t* tile, const Acts& a, int64_t m0, __m256* acc) {
  const int64_t G = pk.groups;
  const int64_t pf_step = (NTB * pk.tile_bytes + G - 1) / G;
  for (int64_t g = 0; g < G; ++g) {
    prefetch_group(tile, g, pf_step, std::max<int64_t>(kPrefetchAhead, NTB * pk.tile_bytes));
    __m256 scale[NTB], scale_hi[NTB], minv[NTB];
    for (int n = 0; n < NTB; ++n) group_factors<QT>(pk, tile + n * pk.tile_bytes, g, &scale[n], &scale_hi[n], &minv[n]);
    __m256 lo[NTB][MB], hi[NTB][MB];
    for (int n = 0; n < NTB; ++n) {
      for (int m = 0; m < MB; ++m) lo[n][m] = hi[n][m] = _mm256_setzero_ps();
    }
    const float* x = kDot ? nullptr : a.x + m0 * a.k + g * kGroup;  // the pair loops read a.xp
#pragma GCC unroll 16  // constant k: the sums stay in registers, the shifts take immediates
    for (int k = 0; k < 16; ++k) {
      for (int n = 0; n < NTB; ++n) {
#if defined(CADENCE_QUANT_BF16_DOT)
        if constexpr (kDot) {
          const __m256i w = code_pairs<bits_of(QT)>(tile + n * pk.tile_bytes + pk.codes_at(g), k);
          const uint32_t* xp = a.xp + m0 * (a.k / 2) + g * 16 + k;
          for (int m = 0; m < MB; ++m) {
            __m256& sum = k % 2 ? hi[n][m] : lo[n][m];
            sum = dot_pairs(sum, w, xp + m * (a.k / 2));
          }
          continue;
        }
#endif
        __m256i qlo, qhi;
        column_pair<bits_of(QT)>(tile + n * pk.tile_bytes + pk.codes_at(g), k, &qlo, &qhi);
        const __m256 wlo = _mm256_cvtepi32_ps(qlo), whi = _mm256_cvtepi32_ps(qhi);
        for (int m = 0; m < MB; ++m) {
          lo[n][m] = _mm256_fmadd_ps(wlo, _mm256_broadcast_ss(x + m * a.k + k), lo[n][m]);
          hi[n][m] = _mm256_fmadd_ps(whi, _mm256_broadcast_ss(x + m * a.k + k + 16), hi[n][m]);
        }
      }
    }
    for (int n = 0; n < NTB; ++n) {
      for (int m = 0; m < MB; ++m) {
        const float* xs = a.sums.data() + ((m0 + m) * G + g) * 2;
        acc[n * MB + m] = finish_group<QT, F8>(acc[n * MB + m], lo[n][m], hi[n][m], scale[n], scale_hi[n], minv[n], xs);
      }
    }
  }
}

// The tile's group g as float32 values, w[k * ldw + r] for column k and row r: gguf's values
// (value = scale * q + min, or scale * (q - offset); the products are exact, so the fused
// multiply-add rounds once, as gguf's separate multiply and add do).
template <int64_t QT>
inline void dequantize_group(const Packed& pk, const uint8_t* tile, int64_t g, float* w, int64_t ldw) {
  constexpr bool kHalves = QT == kQ6_K;
  const uint8_t* codes = tile + pk.codes_at(g);
  const uint8_t* s = tile + pk.scales_at(g);
  __m256 scale, scale_hi, minv = _mm256_setzero_ps();
  if constexpr (QT == kQ4_0 || QT == kQ8_0 || QT == kQ4_1) {
    scale = scale_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
    if constexpr (QT == kQ4_1) minv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16)));
  } else {
    const uint8_t* sup = tile + pk.super_at(g / (kSuper / kGroup));
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sup)));
    const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
    const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 8));
    if constexpr (kHalves) {
      scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
      scale_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
    } else {
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sup + 16)));
      scale = scale_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
      minv = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))));
    }
  }
  constexpr int kOffset = QT == kQ4_0 ? 8 : QT == kQ6_K ? 32 : 0;
  const __m256i off = _mm256_set1_epi32(kOffset);
#pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) {
    __m256i qlo, qhi;
    column_pair<bits_of(QT)>(codes, k, &qlo, &qhi);
    if constexpr (kOffset != 0) {
      qlo = _mm256_sub_epi32(qlo, off);
      qhi = _mm256_sub_epi32(qhi, off);
    }
    _mm256_storeu_ps(w + k * ldw, _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(qlo), minv));
    _mm256_storeu_ps(w + (k + 16) * ldw, _mm256_fmadd_ps(scale_hi, _mm256_cvtepi32_ps(qhi), minv));
  }
}

// Rows [m0, m0 + MB) of x times the dequantized group of NT adjacent tiles, w[k * NT * 8 +
// n * 8 + r] for column k, tile n, row r: acc[m][n] += .... Each broadcast activation feeds
// NT multiply-adds (one per tile) and each loaded weight vector MB.
template <int MB, int NT>
inline void group_gemm(const float* x, int64_t ldx, const float* w, float* acc) {
  __m256 a[MB][NT];
  for (int m = 0; m < MB; ++m) {
    for (int n = 0; n < NT; ++n) a[m][n] = _mm256_loadu_ps(acc + (m * NT + n) * kRows);
  }
  for (int k = 0; k < kGroup; ++k) {
    __m256 wk[NT];
    for (int n = 0; n < NT; ++n) wk[n] = _mm256_loadu_ps(w + (k * NT + n) * kRows);
    for (int m = 0; m < MB; ++m) {
      const __m256 xk = _mm256_broadcast_ss(x + m * ldx + k);
      for (int n = 0; n < NT; ++n) a[m][n] = _mm256_fmadd_ps(wk[n], xk, a[m][n]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int n = 0; n < NT; ++n) _mm256_storeu_ps(acc + (m * NT + n) * kRows, a[m][n]);
  }
}

#if defined(__AVX512F__)
// group_gemm on 512-bit registers for NT = 2 or 4 tiles: a column's 16 or 32 weights are one
// or two registers. A core that runs 512-bit multiply-adds at full width does twice the
// 256-bit loop's work per instruction (measured on AVX-512 Zen 5 in docs/quantization.md).
template <int MB, int NT>
inline void group_gemm_512(const float* x, int64_t ldx, const float* w, float* acc) {
  constexpr int NZ = NT / 2;
  __m512 a[MB][NZ];
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NZ; ++j) a[m][j] = _mm512_loadu_ps(acc + m * NT * kRows + 16 * j);
  }
  for (int k = 0; k < kGroup; ++k) {
    __m512 wk[NZ];
    for (int j = 0; j < NZ; ++j) wk[j] = _mm512_loadu_ps(w + k * NT * kRows + 16 * j);
    for (int m = 0; m < MB; ++m) {
      const __m512 xk = _mm512_set1_ps(x[m * ldx + k]);
      for (int j = 0; j < NZ; ++j) a[m][j] = _mm512_fmadd_ps(wk[j], xk, a[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int j = 0; j < NZ; ++j) _mm512_storeu_ps(acc + m * NT * kRows + 16 * j, a[m][j]);
  }
}
#endif

// Register block (rows of x at a time) of the batched path for NT tiles: as many
// accumulators as the registers allow next to the weights and one broadcast.
template <int NT>
constexpr int gemm_rows() {
#if defined(__AVX512F__)
  return NT == 1 ? 8 : NT == 2 ? 12 : 6;  // 8, 12 or 12 accumulators of 32 registers
#else
  return NT == 1 ? 8 : 6;  // 8 or 12 accumulators of 16 registers
#endif
}

template <int MB, int NT>
inline void group_gemm_block(const float* x, int64_t ldx, const float* w, float* acc) {
#if defined(__AVX512F__)
  if constexpr (NT >= 2) {
    group_gemm_512<MB, NT>(x, ldx, w, acc);
    return;
  }
#endif
  group_gemm<MB, NT>(x, ldx, w, acc);
}

// The last rows (fewer than a register block) of the batched path.
template <int NT, int MB = gemm_rows<NT>() - 1>
inline void group_gemm_rest(int64_t rest, const float* x, int64_t ldx, const float* w, float* acc) {
  if constexpr (MB > 0) {
    if (rest == MB) {
      group_gemm_block<MB, NT>(x, ldx, w, acc);
    } else {
      group_gemm_rest<NT, MB - 1>(rest, x, ldx, w, acc);
    }
  }
}

// Many rows (a decode batch): each group of NT adjacent tiles is dequantized once into NT KiB
// of float32, then multiplies every row in register blocks (`gemm_rows`). Tile n of the run
// has `rows_left - 8 n` valid rows (at most 8). acc: m_total * NT * 8 floats of scratch.
template <int64_t QT, int NT, typename T>
void tile_gemm(const Packed& pk, const uint8_t* tile, const Acts& a, int64_t m_total, const float* bias, T* out,
               int64_t out_stride, int64_t rows_left, float* acc) {
  constexpr int MB = gemm_rows<NT>();
  alignas(64) float w[NT * kGroup * kRows];
  std::fill(acc, acc + m_total * NT * kRows, 0.f);
  const int64_t pf_step = (NT * pk.tile_bytes + pk.groups - 1) / pk.groups;
  for (int64_t g = 0; g < pk.groups; ++g) {
    prefetch_group(tile, g, pf_step, std::max<int64_t>(kPrefetchAhead, NT * pk.tile_bytes));
    for (int n = 0; n < NT; ++n) dequantize_group<QT>(pk, tile + n * pk.tile_bytes, g, w + n * kRows, NT * kRows);
    const float* x = a.x + g * kGroup;
    int64_t m = 0;
    for (; m + MB <= m_total; m += MB) group_gemm_block<MB, NT>(x + m * a.k, a.k, w, acc + m * NT * kRows);
    group_gemm_rest<NT>(m_total - m, x + m * a.k, a.k, w, acc + m * NT * kRows);
  }
  for (int64_t m = 0; m < m_total; ++m) {
    for (int n = 0; n < NT; ++n) {
      const int64_t valid = std::min<int64_t>(kRows, rows_left - n * kRows);
      store_tile(acc + (m * NT + n) * kRows, bias ? bias + n * kRows : nullptr, out + m * out_stride + n * kRows, valid);
    }
  }
}

// Calls run(std::integral_constant<int, MB>, m0) over rows [0, m_total) in blocks of at most
// kMax rows: the few-row loops keep one accumulator per row and tile in registers.
template <int kMax, int MB = kMax - 1, typename Run>
inline void rest_block(int64_t rest, int64_t m0, Run&& run) {
  if constexpr (MB > 0) {
    if (rest == MB) {
      run(std::integral_constant<int, MB>(), m0);
    } else {
      rest_block<kMax, MB - 1>(rest, m0, run);
    }
  }
}

template <int kMax = 4, typename Run>
inline void for_row_blocks(int64_t m_total, Run&& run) {
  int64_t m0 = 0;
  for (; m_total - m0 >= kMax; m0 += kMax) run(std::integral_constant<int, kMax>(), m0);
  rest_block<kMax>(m_total - m0, m0, run);
}

template <int64_t QT, typename T, int NTB = 1, bool kDot = false>
void tile_avx2(const Packed& pk, const uint8_t* tile, const Acts& a, int64_t m_total, const float* bias, T* out,
               int64_t out_stride, int64_t left) {
  for_row_blocks(m_total, [&](auto mb, int64_t m0) {
    constexpr int MB = decltype(mb)::value;
    __m256 acc[NTB * MB];
    for (int i = 0; i < NTB * MB; ++i) acc[i] = _mm256_setzero_ps();
    tile_block<QT, MB, NTB, kDot>(pk, tile, a, m0, acc);
    for (int n = 0; n < NTB; ++n) {
      for (int m = 0; m < MB; ++m) {
        alignas(32) float v[kRows];
        _mm256_store_ps(v, acc[n * MB + m]);
        store_tile(v, bias ? bias + n * kRows : nullptr, out + (m0 + m) * out_stride + n * kRows,
                   std::min<int64_t>(kRows, left - n * kRows));
      }
    }
  });
}

#if defined(__AVX512F__)
// Rows per register block of tile_pair_512: 8 accumulator pairs and 8 sums fit 32 registers.
constexpr int kPairRows = 8;

// The 1-8 row loop for two adjacent tiles in 512-bit registers: lanes 0-7 are the first
// tile's rows, 8-15 the second's, so each code widening, conversion and multiply-add covers
// 16 weights (tile_block covers 8).
// 8 bytes of each of two tiles at `off`, side by side.
inline __m128i both_tiles(const uint8_t* c0, const uint8_t* c1, int off) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c0 + off)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c1 + off)));
}

template <int kBits>
inline void column_pair_512(const uint8_t* c0, const uint8_t* c1, int k, __m512i* lo, __m512i* hi) {
  const int c = k / 4, kk = k % 4;
  auto both = [&](int off) { return both_tiles(c0, c1, off); };
  if constexpr (kBits == 8) {
    *lo = _mm512_cvtepi8_epi32(both(32 * c + 8 * kk));
    *hi = _mm512_cvtepi8_epi32(both(32 * (c + 4) + 8 * kk));
  } else {
    const __m512i v = _mm512_cvtepu8_epi32(both(32 * c + 8 * kk));
    *lo = _mm512_and_si512(v, _mm512_set1_epi32(0x0F));
    *hi = _mm512_srli_epi32(v, 4);
    if constexpr (kBits == 5) {  // as column_pair: the 5th bits in one plane
      const __m512i hb = _mm512_cvtepu8_epi32(both(128 + 8 * kk));
      const __m512i bit = _mm512_set1_epi32(0x10);
      *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_sllv_epi32(hb, _mm512_set1_epi32(4 - c)), bit));
      *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_srlv_epi32(hb, _mm512_set1_epi32(c)), bit));
    } else if constexpr (kBits == 6) {  // the 5th and 6th bits in two planes
      const __m512i two = _mm512_set1_epi32(0x30);
      const __m512i h0 = _mm512_cvtepu8_epi32(both(128 + 8 * kk));
      const __m512i h1 = _mm512_cvtepu8_epi32(both(160 + 8 * kk));
      const __m512i shift = _mm512_set1_epi32(2 * c);
      *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_slli_epi32(_mm512_srlv_epi32(h0, shift), 4), two));
      *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_slli_epi32(_mm512_srlv_epi32(h1, shift), 4), two));
    }
  }
}

inline __m512 join_512(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }

#if defined(CADENCE_QUANT_BF16_DOT)
// code_pairs for two adjacent tiles (16 lanes).
template <int kBits>
inline __m512i code_pairs_512(const uint8_t* c0, const uint8_t* c1, int k) {
  if constexpr (kBits == 4) {
    const __m512i table = _mm512_load_si512(kNibbleValues);
    const __m512i v = _mm512_cvtepu8_epi32(both_tiles(c0, c1, 32 * (k / 4) + 8 * (k % 4)));
    return _mm512_permutexvar_epi16(nibble_index(v), table);
  } else {
    __m512i qlo, qhi;
    column_pair_512<kBits>(c0, c1, k, &qlo, &qhi);
    return bf16_pairs(qlo, qhi);
  }
}
#endif

template <int64_t QT, int MB, bool kDot>
inline void tile_pair_block(const Packed& pk, const uint8_t* tile, const Acts& a, int64_t m0, __m512* acc) {
  const uint8_t* next = tile + pk.tile_bytes;
  const int64_t G = pk.groups;
  const int64_t pf_step = (2 * pk.tile_bytes + G - 1) / G;
  for (int64_t g = 0; g < G; ++g) {
    prefetch_group(tile, g, pf_step, std::max<int64_t>(kPrefetchAhead, 2 * pk.tile_bytes));
    const uint8_t* c0 = tile + pk.codes_at(g);
    const uint8_t* c1 = next + pk.codes_at(g);
    __m256 s0, s0_hi, m0v, s1, s1_hi, m1v;
    group_factors<QT>(pk, tile, g, &s0, &s0_hi, &m0v);
    group_factors<QT>(pk, next, g, &s1, &s1_hi, &m1v);
    __m512 lo[MB], hi[MB];
    for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
    const float* x = kDot ? nullptr : a.x + m0 * a.k + g * kGroup;  // the pair loops read a.xp
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) {
#if defined(CADENCE_QUANT_BF16_DOT)
      if constexpr (kDot) {  // see bf16_pairs
        const __m512i w = code_pairs_512<bits_of(QT)>(c0, c1, k);
        const uint32_t* xp = a.xp + m0 * (a.k / 2) + g * 16 + k;
        for (int m = 0; m < MB; ++m) {
          __m512& sum = k % 2 ? hi[m] : lo[m];
          sum = dot_pairs(sum, w, xp + m * (a.k / 2));
        }
        continue;
      }
#endif
      __m512i qlo, qhi;
      column_pair_512<bits_of(QT)>(c0, c1, k, &qlo, &qhi);
      const __m512 wlo = _mm512_cvtepi32_ps(qlo), whi = _mm512_cvtepi32_ps(qhi);
      for (int m = 0; m < MB; ++m) {
        lo[m] = _mm512_fmadd_ps(wlo, _mm512_set1_ps(x[m * a.k + k]), lo[m]);
        hi[m] = _mm512_fmadd_ps(whi, _mm512_set1_ps(x[m * a.k + k + 16]), hi[m]);
      }
    }
    const __m512 scale = join_512(s0, s1), scale_hi = join_512(s0_hi, s1_hi), minv = join_512(m0v, m1v);
    for (int m = 0; m < MB; ++m) {
      const float* xs = a.sums.data() + ((m0 + m) * G + g) * 2;
      acc[m] = finish_group<QT, F16>(acc[m], lo[m], hi[m], scale, scale_hi, minv, xs);
    }
  }
}

// tile_avx2 for two adjacent tiles: the second has `valid_next` valid rows.
template <int64_t QT, typename T, bool kDot>
void tile_pair_512(const Packed& pk, const uint8_t* tile, const Acts& a, int64_t m_total, const float* bias, T* out,
                   int64_t out_stride, int64_t valid, int64_t valid_next) {
  for_row_blocks<kPairRows>(m_total, [&](auto mb, int64_t m0) {
    constexpr int MB = decltype(mb)::value;
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    tile_pair_block<QT, MB, kDot>(pk, tile, a, m0, acc);
    for (int m = 0; m < MB; ++m) {
      alignas(64) float v[2 * kRows];
      _mm512_store_ps(v, acc[m]);
      store_tile(v, bias, out + (m0 + m) * out_stride, valid);
      store_tile(v + kRows, bias ? bias + kRows : nullptr, out + (m0 + m) * out_stride + kRows, valid_next);
    }
  });
}
#endif

// ---- the row-invariant batched path ----------------------------------------------------
//
// From a few rows on, summing the codes against each row block (tile_block, tile_pair_block)
// re-reads and re-widens the weight once per block. Here each group of a run of NT adjacent
// tiles is widened once into float32 codes (exact: small integers) and its factors, a few KiB
// that stay near the core while every row block multiplies them in the same order as the
// blocks above (lo and hi chains per group, then finish_group, the row's sums kept in memory
// between groups): the same bits per row, with the widening spread over all the rows. It is
// the path of 16-bit activations from 5 rows on (AVX-512: 9), except bfloat16 rows where the
// pair products run (they stay in tile pairs at every size: see kGemmRows); measured on two Zen 5 cores
// (SmolLM2's 210 projections of a step, Q4_1, bfloat16 rows), 96 rows took 55-58 ms against
// 48-49 in tile_gemm, and 512 rows about 295 against 277: what one order costs.

// Group g of the run's nt tiles: codes[k * W + n * 8 + r] for tile n, row r, column k
// (W = nt * 8), and factors[i * W + n * 8 + r]: i = 0 the scale, 1 the second half's scale
// (Q6_K), 2 the min.
template <int64_t QT>
inline void widen_group(const Packed& pk, const uint8_t* tile, int nt, int64_t g, float* codes, float* factors) {
  const int64_t w = nt * kRows;
  for (int n = 0; n < nt; ++n) {
    const uint8_t* t = tile + n * pk.tile_bytes;
    const uint8_t* c = t + pk.codes_at(g);
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) {
      __m256i qlo, qhi;
      column_pair<bits_of(QT)>(c, k, &qlo, &qhi);
      _mm256_storeu_ps(codes + k * w + n * kRows, _mm256_cvtepi32_ps(qlo));
      _mm256_storeu_ps(codes + (k + 16) * w + n * kRows, _mm256_cvtepi32_ps(qhi));
    }
    __m256 scale, scale_hi, minv;
    group_factors<QT>(pk, t, g, &scale, &scale_hi, &minv);
    _mm256_storeu_ps(factors + n * kRows, scale);
    _mm256_storeu_ps(factors + w + n * kRows, scale_hi);
    _mm256_storeu_ps(factors + 2 * w + n * kRows, minv);
  }
}

// Rows [m0, m0 + MB) against a widened group of NV vectors of V (W = NV * V::kLanes
// outputs): acc[m * W + j] += the group's contribution.
template <int64_t QT, typename V, int NV, int MB>
inline void codes_block(const float* codes, const float* factors, int64_t g, const Acts& a, int64_t G, int64_t m0,
                        float* acc) {
  using T = typename V::T;
  constexpr int L = V::kLanes, W = NV * L;
  T lo[MB][NV], hi[MB][NV];
  for (int m = 0; m < MB; ++m) {
    for (int v = 0; v < NV; ++v) lo[m][v] = hi[m][v] = V::zero();
  }
  const float* x = a.x + m0 * a.k + g * kGroup;
  for (int k = 0; k < 16; ++k) {
    T wl[NV], wh[NV];
    for (int v = 0; v < NV; ++v) {
      wl[v] = V::load(codes + k * W + v * L);
      wh[v] = V::load(codes + (k + 16) * W + v * L);
      // In registers, not re-read by every multiply-add: folded into each one as a memory
      // operand (what the compiler chose), the loads bound the loop at 40% of its speed.
      asm("" : "+v"(wl[v]), "+v"(wh[v]));
    }
    for (int m = 0; m < MB; ++m) {
      const T xl = V::set1(x[m * a.k + k]), xh = V::set1(x[m * a.k + k + 16]);
      for (int v = 0; v < NV; ++v) {
        lo[m][v] = V::fmadd(wl[v], xl, lo[m][v]);
        hi[m][v] = V::fmadd(wh[v], xh, hi[m][v]);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const T scale = V::load(factors + v * L), scale_hi = V::load(factors + W + v * L);
    const T minv = V::load(factors + 2 * W + v * L);
    for (int m = 0; m < MB; ++m) {
      const float* xs = a.sums.data() + ((m0 + m) * G + g) * 2;
      float* p = acc + (m0 + m) * W + v * L;
      V::store(p, finish_group<QT, V>(V::load(p), lo[m][v], hi[m][v], scale, scale_hi, minv, xs));
    }
  }
}

// Rows per block of codes_block: the sums (2 * MB * NV vectors) and a column's weights fit.
template <int NV>
constexpr int codes_rows() {
#if defined(__AVX512F__)
  return NV == 1 ? 12 : 6;  // 24 sums of 32 registers (4 rows per block ran 10% slower)
#else
  return NV == 1 ? 5 : 2;  // 10 or 8 of 16
#endif
}

// The rows of x against the run of NT tiles at `tile` (NT * 8 = NV * V::kLanes outputs);
// scratch: this thread's buffer (a widened group, its factors and the rows' sums).
template <int64_t QT, typename V, int NV, typename T>
void tile_codes_gemm(const Packed& pk, const uint8_t* tile, const Acts& a, int64_t m_total, const float* bias, T* out,
                     int64_t out_stride, int64_t rows_left, std::vector<float>* scratch) {
  constexpr int W = NV * V::kLanes, NT = W / kRows, MB = codes_rows<NV>();
  const int64_t G = pk.groups;
  scratch->resize(kGroup * W + 3 * W + m_total * W);
  float* codes = scratch->data();
  float* factors = codes + kGroup * W;
  float* acc = factors + 3 * W;
  std::fill(acc, acc + m_total * W, 0.f);
  const int64_t pf_step = (NT * pk.tile_bytes + G - 1) / G;
  for (int64_t g = 0; g < G; ++g) {
    prefetch_group(tile, g, pf_step, std::max<int64_t>(kPrefetchAhead, NT * pk.tile_bytes));
    widen_group<QT>(pk, tile, NT, g, codes, factors);
    for_row_blocks<MB>(m_total, [&](auto mb, int64_t m0) {
      codes_block<QT, V, NV, decltype(mb)::value>(codes, factors, g, a, G, m0, acc);
    });
  }
  for (int64_t m = 0; m < m_total; ++m) {
    for (int n = 0; n < NT; ++n) {
      const int64_t valid = std::min<int64_t>(kRows, rows_left - n * kRows);
      if (valid <= 0) break;
      store_tile(acc + m * W + n * kRows, bias ? bias + n * kRows : nullptr, out + m * out_stride + n * kRows, valid);
    }
  }
}

// Tiles [t0, t0 + tiles) dequantized side by side into w [K, ldw] (float32): the right-hand
// side of a float32 GEMM for the strip of weight rows they hold.
template <int64_t QT>
void dequantize_strip(const Packed& pk, const uint8_t* packed, int64_t t0, int64_t tiles, float* w, int64_t ldw) {
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = packed + (t0 + t) * pk.tile_bytes;
      for (int64_t g = 0; g < pk.groups; ++g) dequantize_group<QT>(pk, tile, g, w + g * kGroup * ldw + t * kRows, ldw);
    }
  });
}
#endif

// Weight rows per strip of the dense path: K x 256 float32 (0.6 MiB at K = 576, 1.5 MiB at
// 1536) is rewritten per strip and stays in the cache while the GEMM reads it.
constexpr int64_t kStripRows = 256;
// From this many activation rows on (a prefill chunk), an AVX2 build dequantizes strips of
// the weight into float32 and multiplies them with torch's float32 GEMM: there its register
// and cache blocking beat tile_gemm's 256-bit loop, and dequantizing a strip (K x 256
// values) is spread over this many rows. An AVX-512 build never does: its 512-bit tile_gemm
// ran a 512-row prefill of SmolLM2's projections 2.0x faster than the strips (1,812 against
// 904 tok/s on two Zen 5 cores, where torch's GEMM is MKL's), and past oneDNN's packed
// float32 weights (1,666).
#if defined(__AVX512F__)
constexpr int64_t kDenseRows = std::numeric_limits<int64_t>::max();
#else
constexpr int64_t kDenseRows = 128;
#endif

// Most rows per pass of the batched path (each pass dequantizes every group again; its x
// block, rows x K float32, should stay near the core while the weight goes by). A step's
// rows are split into equal passes of at most this many. Measured on two Zen 5 cores
// (SmolLM2's projections, Q4_1): 96-512 rows ran 2-13% faster with at most 192 rows per
// pass than with 64.
constexpr int64_t kRowsPerPass = 192;
// From this many rows on, widening or dequantizing each group once and multiplying every row
// (tile_codes_gemm, tile_gemm) beats summing the codes against each row block (tile_avx2,
// tile_pair_512). AVX-512 builds keep up to 8 rows in tile pairs: SmolLM2's 210 projections
// of a step (Q4_1, bfloat16 rows, two Zen 5 cores) took 6.0 ms for 8 rows against 7.5 ms in
// tile_gemm. The bfloat16 pair products never leave the tile pairs: there re-widening the
// codes per 8-row block costs less than tile_codes_gemm's trips through memory (the same
// projections, pair products in both: 9 rows 5.5 against 6.1 ms, 32 rows 13.6 against 16.8,
// 96 rows 38 against 45, 512 rows 202 against 228).
#if defined(__AVX512F__)
constexpr int64_t kGemmRows = 9;
#else
constexpr int64_t kGemmRows = 5;
#endif
// Tiles the batched path takes at once where the range has them: 4 (two 512-bit registers
// per column) with AVX-512, else 2.
#if defined(__AVX512F__)
constexpr int kGemmTiles = 4;
constexpr bool kPairs1Row = true;  // 1-4 rows: two tiles at a time (tile_pair_512)
#else
constexpr int kGemmTiles = 2;
constexpr bool kPairs1Row = false;
template <int64_t QT, typename T, bool kDot>
void tile_pair_512(const Packed&, const uint8_t*, const Acts&, int64_t, const float*, T*, int64_t, int64_t, int64_t) {}
#endif

#if defined(CADENCE_QUANT_AVX2)
// tile_codes_gemm over the run at `tile` (`run` tiles left in this thread's range): 4 tiles at
// once with AVX-512, 2 with AVX2, fewer at the range's end. Returns the tiles it took.
template <int64_t QT, typename T>
int64_t codes_run(const Packed& pk, const uint8_t* tile, const Acts& a, int64_t m, const float* bias, T* out,
                  int64_t out_stride, int64_t run, int64_t left, std::vector<float>* scratch) {
#if defined(__AVX512F__)
  if (run >= 4) {
    tile_codes_gemm<QT, F16, 2>(pk, tile, a, m, bias, out, out_stride, left, scratch);
    return 4;
  }
  if (run >= 2) {
    tile_codes_gemm<QT, F16, 1>(pk, tile, a, m, bias, out, out_stride, left, scratch);
    return 2;
  }
#else
  if (run >= 2) {
    tile_codes_gemm<QT, F8, 2>(pk, tile, a, m, bias, out, out_stride, left, scratch);
    return 2;
  }
#endif
  tile_codes_gemm<QT, F8, 1>(pk, tile, a, m, bias, out, out_stride, left, scratch);
  return 1;
}
#endif

template <typename T>
void linear_tiles(int64_t qtype, const Packed& pk, const uint8_t* packed, int64_t rows, const Acts& a,
                  int64_t m_total, const float* bias, T* out, bool portable) {
  const int64_t tiles = (rows + kRows - 1) / kRows;
  const int64_t passes = (m_total + kRowsPerPass - 1) / kRowsPerPass;
  const int64_t per_pass = (m_total + passes - 1) / passes;
  // 16-bit activations: every loop keeps one order of operations per row (see finish_group).
  // Float32 ones take the fastest loop for their number of rows: there a different order
  // moves a result by float32 rounding only, far below what decides a token.
  const bool invariant = a.sixteen;
  for (int64_t m0 = 0; m0 < m_total; m0 += per_pass) {
    const int64_t mc = std::min(per_pass, m_total - m0);
    const Acts part{a.x ? a.x + m0 * a.k : nullptr, std::vector<float>(a.sums.begin() + m0 * pk.groups * 2, a.sums.begin() + (m0 + mc) * pk.groups * 2), a.k,
                    a.xp ? a.xp + m0 * (a.k / 2) : nullptr, a.sixteen};
    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(invariant ? 0 : kGemmTiles * mc * kRows);
      static thread_local std::vector<float> scratch;  // tile_codes_gemm's buffer
      for (int64_t t = begin; t < end; ++t) {
        const uint8_t* tile = packed + t * pk.tile_bytes;
        const int64_t valid = std::min<int64_t>(kRows, rows - t * kRows);
        const float* b = bias ? bias + t * kRows : nullptr;
        T* o = out + m0 * rows + t * kRows;
#if defined(CADENCE_QUANT_AVX2)
        if (!portable) {
          const bool blocks = mc < kGemmRows;
          const int64_t run = end - t, left = rows - t * kRows;
          // Multiplies the tiles from `tile` on by the loop for this call; returns how many it took.
          auto step = [&](auto qt, auto pairs) -> int64_t {
            constexpr int64_t QT = decltype(qt)::value;
            // The pair products (bfloat16 rows, bf16_pairs) run in register blocks at every
            // size: see kGemmRows.
            constexpr bool kDot = decltype(pairs)::value && QT != kQ6_K;
            const bool few = blocks || kDot;
            if (few && kPairs1Row && run >= 2) {
              tile_pair_512<QT, T, kDot>(pk, tile, part, mc, b, o, rows, valid, std::min<int64_t>(kRows, left - kRows));
              return 2;
            }
            if (few && mc <= 2 && run >= 2) {  // AVX2: one or two rows, two tiles at once
              tile_avx2<QT, T, 2, kDot>(pk, tile, part, mc, b, o, rows, left);
              return 2;
            }
            if (few) {
              tile_avx2<QT, T, 1, kDot>(pk, tile, part, mc, b, o, rows, left);
              return 1;
            }
            if (invariant) return codes_run<QT>(pk, tile, part, mc, b, o, rows, run, left, &scratch);
            if (kGemmTiles == 4 && run >= 4) {
              tile_gemm<QT, kGemmTiles>(pk, tile, part, mc, b, o, rows, left, acc.data());
              return kGemmTiles;
            }
            if (run >= 2) {
              tile_gemm<QT, 2>(pk, tile, part, mc, b, o, rows, left, acc.data());
              return 2;
            }
            tile_gemm<QT, 1>(pk, tile, part, mc, b, o, rows, left, acc.data());
            return 1;
          };
          auto of_type = [&](auto qt) -> int64_t {
            if constexpr (kBf16Dot && !std::is_same_v<T, c10::Half>) {  // bfloat16 rows, any output
              if (part.xp) return step(qt, std::true_type());
            }
            return step(qt, std::false_type());
          };
          int64_t took = 0;
          switch (qtype) {
            case kQ4_0: took = of_type(std::integral_constant<int64_t, kQ4_0>()); break;
            case kQ4_1: took = of_type(std::integral_constant<int64_t, kQ4_1>()); break;
            case kQ8_0: took = of_type(std::integral_constant<int64_t, kQ8_0>()); break;
            case kQ4_K: took = of_type(std::integral_constant<int64_t, kQ4_K>()); break;
            case kQ5_K: took = of_type(std::integral_constant<int64_t, kQ5_K>()); break;
            case kQ6_K: took = of_type(std::integral_constant<int64_t, kQ6_K>()); break;
          }
          if (took > 0) {
            t += took - 1;
            continue;
          }
        }
#endif
        tile_portable(qtype, pk, tile, part, mc, b, o, rows, valid);
      }
    });
  }
}

#if defined(CADENCE_QUANT_AVX2)
// out [m, rows] = xf [m, k] W^T (+ bias) through float32 strips of W and at::mm.
void linear_dense(int64_t qtype, const Packed& pk, const uint8_t* packed, int64_t rows, const at::Tensor& xf,
                  const at::Tensor& bias, at::Tensor& out) {
  // Strips are independent (each writes its own columns of out): the threads split the
  // strips, and each dequantizes its strip and multiplies it on its own (the GEMM and the
  // dequantization then run one-threaded inside, with no barrier per strip). Measured on 2
  // cores: a 512-row prefill of 576 x 3072 Q4_1 1.27x faster than a strip at a time.
  const int64_t tiles = (rows + kRows - 1) / kRows, strip_tiles = kStripRows / kRows;
  const int64_t strips = (tiles + strip_tiles - 1) / strip_tiles;
  // Too few strips to share evenly (576 rows: 3 strips, 2 threads): one strip at a time,
  // each dequantized and multiplied by all the threads.
  const int64_t grain = strips >= 2 * at::get_num_threads() ? 1 : strips;
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: not inherited
  at::parallel_for(0, strips, grain, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference);  // out may be an inference tensor, written in place
    at::Tensor w = at::empty({pk.groups * kGroup, kStripRows}, xf.options());
    for (int64_t strip = begin; strip < end; ++strip) {
      const int64_t t0 = strip * strip_tiles, nt = std::min(strip_tiles, tiles - t0);
      switch (qtype) {
        case kQ4_0: dequantize_strip<kQ4_0>(pk, packed, t0, nt, w.data_ptr<float>(), kStripRows); break;
        case kQ4_1: dequantize_strip<kQ4_1>(pk, packed, t0, nt, w.data_ptr<float>(), kStripRows); break;
        case kQ8_0: dequantize_strip<kQ8_0>(pk, packed, t0, nt, w.data_ptr<float>(), kStripRows); break;
        case kQ4_K: dequantize_strip<kQ4_K>(pk, packed, t0, nt, w.data_ptr<float>(), kStripRows); break;
        case kQ5_K: dequantize_strip<kQ5_K>(pk, packed, t0, nt, w.data_ptr<float>(), kStripRows); break;
        case kQ6_K: dequantize_strip<kQ6_K>(pk, packed, t0, nt, w.data_ptr<float>(), kStripRows); break;
      }
      const int64_t r0 = t0 * kRows, valid = std::min(nt * kRows, rows - r0);
      at::Tensor y = out.narrow(1, r0, valid);
      if (out.scalar_type() == at::kFloat) {
        at::mm_out(y, xf, w.narrow(1, 0, valid));  // straight into out's columns (ldc = rows)
        if (bias.defined()) y.add_(bias.narrow(0, r0, valid));
      } else {
        at::Tensor part = at::mm(xf, w.narrow(1, 0, valid));
        if (bias.defined()) part.add_(bias.narrow(0, r0, valid));
        y.copy_(part);  // rounded once to x's dtype
      }
    }
  });
}
#endif

// y [m, rows] = x [m, k'] W^T (+ bias), W packed by quant_repack for K = k >= k' columns (the
// columns past k' are zero padding), in x's dtype or float32 (`out_dtype`: a bfloat16 model's
// logits). `portable` forces the loop without SIMD (for tests).
at::Tensor quant_linear_impl(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t rows, int64_t k,
                             const c10::optional<at::Tensor>& bias, c10::optional<at::ScalarType> out_dtype,
                             bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(), "x must be 2-D [m, k] with contiguous rows");
  const Packed pk(qtype, k);
  TORCH_CHECK(x.size(1) <= k && x.size(1) > k - kGroup, "x has ", x.size(1), " columns; the weight has ", k);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(0) == (rows + kRows - 1) / kRows && packed.size(1) == pk.tile_bytes,
              "packed does not hold a [", rows, ", ", k, "] matrix of this type");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "quant_linear: unsupported activation dtype ", x.scalar_type());
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == rows, "bias must have ", rows, " values");
  }
  const at::ScalarType out_type = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(out_type == x.scalar_type() || out_type == at::kFloat,
              "quant_linear: out_dtype must be x's dtype or float32, not ", out_type);
  const int64_t m = x.size(0);
  auto out = at::empty({m, rows}, x.options().dtype(out_type));
  if (m == 0) return out;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  Acts a{nullptr, {}, k};
  a.sixteen = x.scalar_type() != at::kFloat;
  std::vector<uint32_t> pairs;
  at::Tensor xf;
  const bool bf16_pairs = kBf16Dot && x.scalar_type() == at::kBFloat16;
  if (bf16_pairs && !portable && qtype != kQ6_K) {
    // Only the pair loops read these rows (every type but Q6_K, off the portable loop).
#if defined(CADENCE_QUANT_BF16_DOT)
    bf16_pairs_and_sums(x, k, &a, &pairs);
#endif
  } else {
    xf = float_rows(x, k);
#if defined(CADENCE_QUANT_AVX2)
    if (!portable && m >= kDenseRows && x.scalar_type() == at::kFloat) {  // see linear_tiles
      linear_dense(qtype, pk, w, rows, xf, b, out);
      return out;
    }
#endif
    a.x = xf.data_ptr<float>();
    half_sums(&a, m, pk.groups);
    if (bf16_pairs) pair_rows(a.x, m, k, &pairs);
  }
  if (bf16_pairs) a.xp = pairs.data();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  switch (out_type) {
    case at::kFloat: linear_tiles(qtype, pk, w, rows, a, m, bp, out.data_ptr<float>(), portable); break;
    case at::kBFloat16: linear_tiles(qtype, pk, w, rows, a, m, bp, out.data_ptr<c10::BFloat16>(), portable); break;
    default: linear_tiles(qtype, pk, w, rows, a, m, bp, out.data_ptr<c10::Half>(), portable); break;
  }
  return out;
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t rows, int64_t k,
                        const c10::optional<at::Tensor>& bias, c10::optional<at::ScalarType> out_dtype) {
  return quant_linear_impl(x, packed, qtype, rows, k, bias, out_dtype, false);
}

at::Tensor quant_linear_portable(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t rows,
                                 int64_t k, const c10::optional<at::Tensor>& bias,
                                 c10::optional<at::ScalarType> out_dtype) {
  return quant_linear_impl(x, packed, qtype, rows, k, bias, out_dtype, true);
}

// Which inner loop quant_linear runs on this build: "avx512-bf16" (AVX-512 with the bfloat16
// pair products), "avx512" (the AVX2 loops compiled for AVX-512's 32 registers and 512-bit
// tile pairs), "avx2" or "portable".
std::string quant_isa() {
#if defined(CADENCE_QUANT_BF16_DOT)
  return "avx512-bf16";
#elif defined(__AVX512F__) && defined(CADENCE_QUANT_AVX2)
  return "avx512";
#elif defined(CADENCE_QUANT_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace cadence_quant

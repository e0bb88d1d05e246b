// Weight-only quantized projections on GGUF block types (registered as torch.ops.cadence.quant_*).
//
// Weights keep the precision the file gave them: Q4_0, Q4_1, Q8_0 (blocks of 32) and the
// k-quants Q4_K, Q5_K, Q6_K (super-blocks of 256). At load each matrix is repacked once into
// tiles of 8 rows (`quant_repack`): per group of 32 columns, the 8 rows of each column lie in
// 8 consecutive bytes (4-bit codes two columns to a byte, the 5th/6th bits in planes of
// their own), followed by the group's scales (and, for k-quants, each super-block's f16
// factors); a tile is one contiguous run of bytes. The repacking is exact: `quant_dequantize`
// gives gguf's own values bit for bit.
//
// `quant_linear` computes y = x W^T with activations in float32 (bfloat16/float16 rows are
// widened first; the result takes x's dtype). Up to 4 rows (AVX-512: 8), each column's codes
// become float32 lanes that multiply the broadcast activation, summed per group and scaled
// once (tile_block: one tile, 8 lanes; AVX-512 builds take two tiles at once, tile_pair_512,
// in register blocks of up to 8 rows, so a verify step's few rows widen the codes once).
// From 5 rows on (AVX-512: 9; a decode batch, a prefill chunk), each group of a run of
// adjacent tiles is widened once. For bfloat16/float16 activations, into float32 codes that
// every row block multiplies in the same order as the few-row loops (tile_codes_gemm), so
// that a row's result is the same bits in a call of any size (quant_products.cpp,
// finish_group). For float32 ones, dequantized, multiplying the rows in register blocks
// (tile_gemm: runs of 4 tiles in 512-bit registers with AVX-512, of 2 in 256-bit ones with
// AVX2); an AVX2 build takes 128 float32 rows and more as strips of 256 weight rows
// dequantized into float32 and multiplied by torch's float32 GEMM (linear_dense). Every loop prefetches
// the weight bytes ahead of the group it reads. All need AVX2 + FMA + F16C; without them a
// portable loop computes the same sums.
//
// Where the CPU has AVX512_BF16, bfloat16 rows are not widened: a group's codes become
// bfloat16 pairs (exact) that one vdpbf16ps multiplies by a pair of activations, two columns
// per lane with float32 sums, at every number of rows in the tile-pair register blocks
// (quant_products.cpp, bf16_pairs): twice the multiply-adds per instruction. The result is
// x's dtype, or float32 on request (`out_dtype`, a bfloat16 model's logits).

//
// This header holds what every source of the quantized kernels shares: the GGUF types, the
// packed layout and how a tile's codes and scales are read back. quant_repack.cpp turns GGUF
// blocks into tiles (and back), quant_products.cpp multiplies by them, and
// quant_registration.cpp registers the ops.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CADENCE_QUANT_AVX2 1
#include <immintrin.h>
#endif

namespace cadence_quant {

// GGML's type ids.
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// Code width of a type: 4, 5, 6 or 8 (signed) bits.
constexpr int bits_of(int64_t qtype) {
  return qtype == kQ8_0 ? 8 : qtype == kQ5_K ? 5 : qtype == kQ6_K ? 6 : 4;
}

constexpr int kRows = 8;     // rows per tile
constexpr int kGroup = 32;   // columns per group
constexpr int kSuper = 256;  // columns per k-quant super-block

// The packed layout of one type: bytes of codes and of scales per (tile, group), bytes of
// super-block factors per (tile, super-block).
struct Layout {
  int bits;        // code width: 4, 5, 6 or 8 (signed)
  int code_bytes;  // per (tile, group)
  int scale_bytes; // per (tile, group)
  int super_bytes; // per (tile, super-block), 0 without super-blocks
  int block;       // GGUF block size in columns (32 or 256)
  int type_size;   // GGUF bytes per block
};

inline Layout layout_of(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {4, 128, 16, 0, 32, 18};
    case kQ4_1: return {4, 128, 32, 0, 32, 20};
    case kQ8_0: return {8, 256, 16, 0, 32, 34};
    case kQ4_K: return {4, 128, 16, 32, 256, 144};
    case kQ5_K: return {5, 160, 16, 32, 256, 176};
    case kQ6_K: return {6, 192, 16, 16, 256, 210};
    default: TORCH_CHECK(false, "quantized type ", qtype, " is not supported (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)");
  }
}

struct Packed {
  Layout lay;
  int64_t groups, supers, tile_bytes;
  Packed(int64_t qtype, int64_t k) : lay(layout_of(qtype)) {
    TORCH_CHECK(k > 0 && k % lay.block == 0, "K (", k, ") must be a multiple of the block size ", lay.block);
    groups = k / kGroup;
    supers = lay.super_bytes ? k / kSuper : 0;
    tile_bytes = groups * (lay.code_bytes + lay.scale_bytes) + supers * lay.super_bytes;
  }
  int64_t codes_at(int64_t g) const { return g * lay.code_bytes; }
  int64_t scales_at(int64_t g) const { return groups * lay.code_bytes + g * lay.scale_bytes; }
  int64_t super_at(int64_t s) const { return groups * (lay.code_bytes + lay.scale_bytes) + s * lay.super_bytes; }
};

inline float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// Byte of (row r, column kk < 4) of a column-chunk (4 columns) in its 32-byte plane: the 8
// rows of one column are 8 consecutive bytes.
inline int plane_byte(int r, int kk) { return 8 * kk + r; }

// ---- reading tiles back -----------------------------------------------------------------------

// Code of (row r, column k) of group g, unsigned (signed for Q8_0).
inline int code_at(const Packed& pk, const uint8_t* tile, int64_t g, int r, int k) {
  const uint8_t* codes = tile + pk.codes_at(g);
  const int c = k / 4, at = plane_byte(r, k % 4);
  if (pk.lay.bits == 8) return static_cast<int8_t>(codes[32 * c + at]);
  int q = (codes[32 * (c % 4) + at] >> (c < 4 ? 0 : 4)) & 0xF;
  if (pk.lay.bits == 5) q |= ((codes[128 + at] >> c) & 1) << 4;
  if (pk.lay.bits == 6) q |= ((codes[128 + 32 * (c / 4) + at] >> (2 * (c % 4))) & 3) << 4;
  return q;
}

// value = scale * (code - offset) + min, for (row r, group g, half h of 16 columns).
struct Affine {
  float scale, min;
  int offset;
  bool has_min;
};

inline Affine affine_at(int64_t qtype, const Packed& pk, const uint8_t* tile, int64_t g, int r, int h) {
  const uint8_t* s = tile + pk.scales_at(g);
  const uint8_t* sup = pk.lay.super_bytes ? tile + pk.super_at(g / (kSuper / kGroup)) : nullptr;
  switch (qtype) {
    case kQ4_0: return {half_at(s + 2 * r), 0.f, 8, false};
    case kQ4_1: return {half_at(s + 2 * r), half_at(s + 16 + 2 * r), 0, true};
    case kQ8_0: return {half_at(s + 2 * r), 0.f, 0, false};
    case kQ6_K: return {half_at(sup + 2 * r) * static_cast<float>(static_cast<int8_t>(s[8 * h + r])), 0.f, 32, false};
    default:  // Q4_K, Q5_K: (d * sc) * q - dmin * m; x - y is x + (-y), bit for bit
      return {half_at(sup + 2 * r) * static_cast<float>(s[r]),
              -(half_at(sup + 16 + 2 * r) * static_cast<float>(s[8 + r])), 0, true};
  }
}

inline float value_of(const Affine& a, int q) {
  // The order gguf computes in: (d * q) + m, and (d * sc) * q - dmin * m; every product is
  // exact in float32 (at most 24 significant bits), so only the final add rounds.
  return a.has_min ? a.scale * static_cast<float>(q) + a.min : a.scale * static_cast<float>(q - a.offset);
}

// ---- the ops (torch.ops.cadence.quant_*) ---------------------------------------------------

at::Tensor quant_repack(const at::Tensor& raw, int64_t qtype, int64_t k);
at::Tensor quant_dequantize(const at::Tensor& packed, int64_t qtype, int64_t rows, int64_t k,
                            const c10::optional<at::Tensor>& row_ids);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t rows, int64_t k,
                        const c10::optional<at::Tensor>& bias, c10::optional<at::ScalarType> out_dtype);
at::Tensor quant_linear_portable(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t rows,
                                 int64_t k, const c10::optional<at::Tensor>& bias,
                                 c10::optional<at::ScalarType> out_dtype);
std::string quant_isa();

}  // namespace cadence_quant

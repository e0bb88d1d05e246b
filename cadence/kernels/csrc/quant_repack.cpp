// Repacking GGUF blocks into the kernels' tiles, and reading tiles back as float32
// (quant_layout.h describes the layout).

#include "quant_layout.h"

namespace cadence_quant {
namespace {

// ---- repacking: GGUF blocks -> tiles ---------------------------------------------------------

// One row's codes and parameters for a group, decoded from its GGUF block: codes[32] and the
// group's scale bytes as the packed layout stores them (f16 or 6/8-bit integer factors).
struct RowGroup {
  uint8_t codes[kGroup];
  uint8_t scale[4];  // Q4_0/Q8_0: d (f16); Q4_1: d, m (f16); k-quants: sc, m (u8) or sc_lo, sc_hi (i8)
  uint8_t super[4];  // k-quants: d, dmin (f16) or d (f16)
};

void k4_scale_min(int j, const uint8_t* s, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Group g (0-based within the row) of a row whose GGUF bytes start at `row`.
void decode_group(int64_t qtype, const Layout& lay, const uint8_t* row, int64_t g, RowGroup* out) {
  const int64_t per_block = lay.block / kGroup;
  const uint8_t* b = row + (g / per_block) * lay.type_size;
  const int j = static_cast<int>(g % per_block);  // group within the super-block
  switch (qtype) {
    case kQ4_0:
    case kQ4_1: {
      const int head = qtype == kQ4_0 ? 2 : 4;
      std::memcpy(out->scale, b, head);
      for (int i = 0; i < 16; ++i) {
        out->codes[i] = b[head + i] & 0xF;
        out->codes[i + 16] = b[head + i] >> 4;
      }
      break;
    }
    case kQ8_0:
      std::memcpy(out->scale, b, 2);
      std::memcpy(out->codes, b + 2, 32);
      break;
    case kQ4_K:
    case kQ5_K: {
      std::memcpy(out->super, b, 4);
      k4_scale_min(j, b + 4, &out->scale[0], &out->scale[1]);
      const uint8_t* qs = b + (qtype == kQ4_K ? 16 : 48) + 32 * (j / 2);
      for (int i = 0; i < 32; ++i) {
        uint8_t q = (j % 2) ? (qs[i] >> 4) : (qs[i] & 0xF);
        if (qtype == kQ5_K) q |= ((b[16 + i] >> j) & 1) << 4;
        out->codes[i] = q;
      }
      break;
    }
    case kQ6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      std::memcpy(out->super, b + 208, 2);
      out->scale[0] = static_cast<uint8_t>(sc[2 * j]);
      out->scale[1] = static_cast<uint8_t>(sc[2 * j + 1]);
      for (int i = 0; i < 32; ++i) {
        const int p = 32 * j + i, h = p / 128, e = p % 128;
        const int lo = (ql[h * 64 + e % 64] >> (4 * (e / 64))) & 0xF;
        const int hi = (qh[h * 32 + e % 32] >> (2 * (e / 32))) & 3;
        out->codes[i] = static_cast<uint8_t>(lo | (hi << 4));
      }
      break;
    }
  }
}


void write_group(int64_t qtype, const Packed& pk, uint8_t* tile, int64_t g, int r, const RowGroup& rg) {
  uint8_t* codes = tile + pk.codes_at(g);
  for (int k = 0; k < kGroup; ++k) {
    const int c = k / 4, at = plane_byte(r, k % 4);
    const uint8_t q = rg.codes[k];
    if (pk.lay.bits == 8) {
      codes[32 * c + at] = q;
      continue;
    }
    codes[32 * (c % 4) + at] |= (c < 4 ? (q & 0xF) : (q & 0xF) << 4);
    if (pk.lay.bits == 5) codes[128 + at] |= ((q >> 4) & 1) << c;
    if (pk.lay.bits == 6) codes[128 + 32 * (c / 4) + at] |= ((q >> 4) & 3) << (2 * (c % 4));
  }
  uint8_t* scales = tile + pk.scales_at(g);
  switch (qtype) {
    case kQ4_0:
    case kQ8_0: std::memcpy(scales + 2 * r, rg.scale, 2); break;
    case kQ4_1:
      std::memcpy(scales + 2 * r, rg.scale, 2);
      std::memcpy(scales + 16 + 2 * r, rg.scale + 2, 2);
      break;
    default:  // k-quants: two bytes per row, then the super-block's f16 factors
      scales[r] = rg.scale[0];
      scales[8 + r] = rg.scale[1];
      if (g % (kSuper / kGroup) == 0) {
        uint8_t* sup = tile + pk.super_at(g / (kSuper / kGroup));
        std::memcpy(sup + 2 * r, rg.super, 2);
        if (qtype != kQ6_K) std::memcpy(sup + 16 + 2 * r, rg.super + 2, 2);
      }
  }
}

}  // namespace

at::Tensor quant_repack(const at::Tensor& raw, int64_t qtype, int64_t k) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(),
              "raw must be contiguous uint8 [rows, row_bytes]");
  const Packed pk(qtype, k);
  TORCH_CHECK(raw.size(1) == k / pk.lay.block * pk.lay.type_size, "raw rows do not hold K = ", k,
              " columns of this type");
  const int64_t rows = raw.size(0), tiles = (rows + kRows - 1) / kRows;
  auto out = at::zeros({tiles, pk.tile_bytes}, raw.options());  // missing rows: codes and scales 0
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    RowGroup rg;
    for (int64_t t = begin; t < end; ++t) {
      for (int r = 0; r < kRows && t * kRows + r < rows; ++r) {
        const uint8_t* row = src + (t * kRows + r) * raw.size(1);
        for (int64_t g = 0; g < pk.groups; ++g) {
          decode_group(qtype, pk.lay, row, g, &rg);
          write_group(qtype, pk, dst + t * pk.tile_bytes, g, r, rg);
        }
      }
    }
  });
  return out;
}

// Rows `row_ids` (or all rows) of a packed matrix as float32 [n, k].
at::Tensor quant_dequantize(const at::Tensor& packed, int64_t qtype, int64_t rows, int64_t k,
                            const c10::optional<at::Tensor>& row_ids) {
  const Packed pk(qtype, k);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == (rows + kRows - 1) / kRows && packed.size(1) == pk.tile_bytes,
              "packed does not hold a [", rows, ", ", k, "] matrix of this type");
  at::Tensor ids = row_ids.has_value() ? row_ids->to(at::kLong).contiguous() : at::arange(rows, packed.options().dtype(at::kLong));
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < rows, "row id ", id[i], " out of range");
  auto out = at::empty({n, k}, packed.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const uint8_t* src = packed.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* tile = src + (id[i] / kRows) * pk.tile_bytes;
      const int r = static_cast<int>(id[i] % kRows);
      for (int64_t g = 0; g < pk.groups; ++g) {
        for (int h = 0; h < 2; ++h) {
          const Affine a = affine_at(qtype, pk, tile, g, r, h);
          for (int kk = 16 * h; kk < 16 * h + 16; ++kk) dst[i * k + g * kGroup + kk] = value_of(a, code_at(pk, tile, g, r, kk));
        }
      }
    }
  });
  return out;
}

}  // namespace cadence_quant

"""Weights kept in a GGUF block type, and the projections that compute from them.

A `QuantizedWeight` is what the loader hands the model instead of a float tensor for a
matrix the file stores quantized (or that `--quantization` quantized at load): its rows as
the file's own blocks, untouched. The model only moves rows around (fusing q|k|v, the rotary
row order) and passes it to `Platform.make_linear`; it never needs to know the type. The CPU
platform's `QuantLinear` repacks it once into the layout of Cadence's kernels
(`cadence/kernels/csrc/quant_*.cpp`); elsewhere, or where the kernels cannot be built,
`DequantizedLinear` widens it once to float32 and projects with `F.linear`.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cadence.layers.linear import Linear

logger = logging.getLogger(__name__)

# GGML type ids and (columns per block, bytes per block) of the types kept quantized.
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
DENSE = "F32"  # a part held as float rows (a fused projection whose pieces differ in kind)


def _part(data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data, requires_grad=False)


class QuantizedWeight(nn.Module):
    """A [out_features, in_features] matrix kept as the file's blocks, in row ranges ("parts")
    of one type each: a fused q|k|v may hold Q4_K rows and Q6_K rows.

    Each part is a uint8 parameter [rows, row_bytes] of GGUF blocks (a `DENSE` part: float
    rows [rows, in_features]); loading and weight updates write these parameters, so a
    model's `parameters()` carry them like any other weight. `in_features` may be less than
    the blocks' columns: `--quantization` pads rows to whole blocks with zeros.
    """

    def __init__(self, qtypes: list[str], parts: list[torch.Tensor], in_features: int):
        super().__init__()
        for qtype in qtypes:
            if qtype not in BLOCKS and qtype != DENSE:
                raise ValueError(f"quantized type {qtype!r} is not supported")
        self.qtypes = list(qtypes)
        self.parts = nn.ParameterList([_part(p) for p in parts])
        self.in_features = in_features
        self.part_rows = [p.shape[0] for p in parts]
        self._rows_from = None  # a projection built from these blocks, once they are released

    @classmethod
    def from_blocks(cls, qtype: str, blocks, in_features: int | None = None) -> QuantizedWeight:
        """Rows of `qtype` blocks, uint8 [rows, row_bytes] (a numpy array is copied)."""
        data = torch.from_numpy(np.array(blocks, dtype=np.uint8, copy=True))
        block, size = BLOCKS[qtype]
        if data.dim() != 2 or data.shape[1] % size:
            raise ValueError(
                f"{qtype} rows must be whole {size}-byte blocks, got {tuple(data.shape)}"
            )
        columns = data.shape[1] // size * block
        return cls([qtype], [data], columns if in_features is None else in_features)

    @classmethod
    def dense(cls, rows: torch.Tensor) -> QuantizedWeight:
        return cls([DENSE], [rows.detach().float().contiguous()], rows.shape[1])

    @classmethod
    def cat(cls, weights: list[QuantizedWeight]) -> QuantizedWeight:
        """The rows of `weights`, one after the other (parts of one type stay separate parts)."""
        if len({w.in_features for w in weights}) != 1:
            raise ValueError("weights to fuse must have the same number of columns")
        qtypes = [q for w in weights for q in w.qtypes]
        return cls(qtypes, [p.data for w in weights for p in w.parts], weights[0].in_features)

    @property
    def out_features(self) -> int:
        return sum(self.part_rows)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def columns(self) -> int:
        """Columns the blocks hold: in_features rounded up to whole blocks."""
        qtype, part = self.qtypes[0], self.parts[0]
        if qtype == DENSE:
            return self.in_features
        block, size = BLOCKS[qtype]
        return part.shape[1] // size * block

    def __getitem__(self, rows) -> QuantizedWeight:
        """The given rows (an index array) of a one-part weight, e.g. to reorder rotary rows."""
        if len(self.parts) != 1:
            raise ValueError("only a weight of one part can be indexed by rows")
        index = torch.as_tensor(np.asarray(rows), dtype=torch.int64)
        return type(self)(self.qtypes, [self.parts[0].data[index]], self.in_features)

    def columns_slice(self, start: int, end: int) -> QuantizedWeight:
        """Columns [start, end) of every row: a row-parallel projection's share. Blocks move
        whole, so both ends must fall on a block boundary (or `end` on in_features)."""
        parts = []
        for qtype, part in zip(self.qtypes, self.parts):
            data = part.data
            if qtype == DENSE:
                parts.append(data[:, start:end].contiguous())
                continue
            block, size = BLOCKS[qtype]
            last = end == self.in_features
            if start % block or (end % block and not last):
                raise ValueError(
                    f"columns [{start}, {end}) of a {qtype} weight cut its {block}-column blocks"
                )
            stop = data.shape[1] if last else end // block * size
            parts.append(data[:, start // block * size : stop].contiguous())
        return type(self)(self.qtypes, parts, end - start)

    def rows_slice(self, start: int, end: int) -> QuantizedWeight:
        """Rows [start, end): a column-parallel projection's or a vocabulary's share."""
        return self[np.arange(start, end)]

    def check_parts(self) -> None:
        """Raises ValueError when a part no longer matches its type (new weights of another kind)."""
        for qtype, rows, part in zip(self.qtypes, self.part_rows, self.parts):
            if qtype == DENSE:
                ok = tuple(part.shape) == (rows, self.in_features)
            else:
                block, size = BLOCKS[qtype]
                ok = part.dim() == 2 and part.shape[0] == rows and part.shape[1] % size == 0
            if not ok:
                raise ValueError(
                    f"weights changed kind: a {qtype} part of {rows} rows holds {tuple(part.shape)}; "
                    "load a file quantized like the served one, or restart the server"
                )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix in `dtype`: gguf's own dequantization of each part."""
        return torch.cat([self._dequantize_part(i) for i in range(len(self.parts))]).to(dtype)

    def _dequantize_part(self, i: int, rows=None) -> torch.Tensor:
        qtype, data = self.qtypes[i], self.parts[i].data
        if rows is not None:
            data = data[rows]
        if qtype == DENSE:
            return data.float()
        import gguf

        values = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[qtype])
        return torch.from_numpy(np.ascontiguousarray(values[:, : self.in_features]))

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantized, in `dtype`: an embedding lookup on a quantized table."""
        if self._rows_from is not None:
            return self._rows_from.rows(ids).to(dtype=dtype, device=ids.device)
        if len(self.parts) != 1:
            raise ValueError("an embedding table must be of one type")
        return self._dequantize_part(0, ids.cpu()).to(dtype=dtype, device=ids.device)

    def release(self) -> None:
        """Frees the blocks once a projection keeps its own copy (new weights may refill them)."""
        self._rows_from = None
        for part in self.parts:
            part.data = torch.empty(0, dtype=part.dtype, device=part.device)

    def read_rows_from(self, linear) -> None:
        """Frees the blocks and reads rows (`embedding`) from `linear`, a projection built from
        them that keeps its own copy: a tied embedding table and LM head then share one copy."""
        if getattr(linear, "holds_weight", True) or not hasattr(linear, "rows"):
            return
        self.release()
        self._rows_from = linear

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for qtype in self.qtypes:
            counts[qtype] = counts.get(qtype, 0) + 1
        return counts


class DequantizedLinear(Linear):
    """A quantized weight widened once to float32: the portable path, where no kernel reads
    the blocks. Correct everywhere, with the memory and speed of a float32 model."""

    holds_weight = False

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__(weight.dequantize(torch.float32), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(torch.float32)
        return F.linear(x.to(torch.float32), self.weight, bias).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, float32 [n, in_features]."""
        return self.weight[ids.cpu()]


class QuantLinear(Linear):
    """y = x W^T (+ b) on the quantized blocks, through `torch.ops.cadence.quant_linear`.

    The weight is repacked once into the kernel's tiles (an exact copy, see csrc/quant_layout.h);
    the blocks it came from are no longer read. Activations keep their dtype (float32,
    bfloat16 or float16) in and out; inside, the kernel sums exact products in float32
    (activations are not quantized: it reads them as float32, or as bfloat16 pairs where the
    CPU multiplies those), so the result is the dequantized weight's up to the order of the
    sums.
    """

    holds_weight = False

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        weight.check_parts()
        ops = torch.ops.cadence
        self.parts = []  # (qtype id or None for float rows, packed tiles or float rows, rows)
        for qtype, data in _runs_of_one_type(weight):
            if qtype == DENSE:
                self.parts.append((None, data.clone(), data.shape[0]))
            else:
                packed = ops.quant_repack(data.contiguous(), QTYPES[qtype], weight.columns)
                self.parts.append((QTYPES[qtype], packed, data.shape[0]))
        self.qtypes = list(weight.qtypes)
        self.columns = weight.columns
        self.weight = None
        self.bias = None if bias is None else bias.detach()
        self.out_features, self.in_features = weight.shape
        # One quantized part: [T, K] rows go straight to the kernel (a decode step makes ~120
        # of these calls; the general path below costs ~2 us more each).
        one = len(self.parts) == 1 and self.parts[0][0] is not None
        self._one = (self.parts[0][1], self.parts[0][0], self.parts[0][2]) if one else None
        self._op = ops.quant_linear.default

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        one = self._one
        if one is not None and x.dim() == 2 and x.stride(1) == 1:
            return self._op(x, one[0], one[1], one[2], self.columns, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if len(self.parts) == 1 and self.parts[0][0] is not None:
            qtype, packed, rows = self.parts[0]
            y = torch.ops.cadence.quant_linear(x2, packed, qtype, rows, self.columns, self.bias)
        else:
            y = torch.cat([self._part(x2, part) for part in self.parts], dim=1)
            if self.bias is not None:
                y += self.bias.to(y.dtype)
        return y.view(*lead, self.out_features)

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """y in float32 from rows of any float dtype (a model's logits). Bfloat16 rows go to
        the kernel as they are: where the CPU has AVX512_BF16 it multiplies them in its pair
        products (one order of sums for every row count, csrc/quant_products.cpp) instead of
        float32 copies."""
        one = self._one
        if one is not None and x.dim() == 2 and x.stride(1) == 1:
            return self._op(x, one[0], one[1], one[2], self.columns, self.bias, torch.float32)
        return self(x.float())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, float32 [n, in_features]: gguf's values, from the tiles."""
        if len(self.parts) != 1 or self.parts[0][0] is None:
            raise ValueError("rows are read from a weight of one quantized type")
        qtype, packed, rows = self.parts[0]
        out = torch.ops.cadence.quant_dequantize(packed, qtype, rows, self.columns, ids.cpu())
        return out[:, : self.in_features].contiguous()

    def _part(self, x: torch.Tensor, part) -> torch.Tensor:
        qtype, data, rows = part
        if qtype is None:
            return F.linear(x.to(data.dtype), data).to(x.dtype)
        return torch.ops.cadence.quant_linear(x, data, qtype, rows, self.columns, None)


def _runs_of_one_type(weight: QuantizedWeight) -> list[tuple[str, torch.Tensor]]:
    """The weight's parts with adjacent parts of one type joined: (type, rows). A block is a
    piece of one row, so joining rows is exact; a fused q|k|v of one type then runs as one
    kernel call, one stream through memory, without a concatenation of the outputs."""
    runs: list[tuple[str, list[torch.Tensor]]] = []
    for qtype, part in zip(weight.qtypes, weight.parts):
        if runs and runs[-1][0] == qtype:
            runs[-1][1].append(part.data)
        else:
            runs.append((qtype, [part.data]))
    return [(qtype, rows[0] if len(rows) == 1 else torch.cat(rows)) for qtype, rows in runs]


def make_quantized_linear(weight: QuantizedWeight, bias=None, kernels: bool = True) -> Linear:
    """`QuantLinear` where Cadence's CPU kernels are loaded, else `DequantizedLinear` (logged once)."""
    if kernels:
        return QuantLinear(weight, bias)
    _warn_dequantized()
    return DequantizedLinear(weight, bias)


_warned = False


def _warn_dequantized() -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(
            "quantized weights are served dequantized to float32: this platform has no kernel "
            "for them (on CPU, Cadence's kernels could not be built; see the warning above)"
        )

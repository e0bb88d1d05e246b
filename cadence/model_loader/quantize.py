"""`--quantization int8|int4`: float weights quantized at load, weight-only and group-wise.

Each row is cut into groups of 32 columns (the last one padded with zeros) and stored in a
GGUF block type, so the kernels that serve GGUF files serve these too:

- int8 is Q8_0: per group, d = max|w| / 127 (stored as float16) and codes round(w / d) in
  [-127, 127]. Each weight is off by at most d/2 plus the float16 rounding of d over 127
  codes: |w - w'| <= 0.5625 * max|w| / 127 within its group.
- int4 is Q4_1: per group, d = (max - min) / 15 and m = min (both float16), codes
  round((w - min) / d) in [0, 15]. |w - w'| <= 0.5075 * (max - min) / 15 + |min| / 2048.

Both are gguf's own reference quantizers (bit for bit llama.cpp's). The projections, the LM
head and the embedding table are quantized; norms and biases stay float.
"""

from __future__ import annotations

import numpy as np

from cadence.layers.quantized import BLOCKS, QuantizedWeight

SCHEMES = {"int8": "Q8_0", "int4": "Q4_1"}
_MATRICES = ("_proj.weight", "lm_head.weight", "embed_tokens.weight")


def quantize_matrix(weight, qtype: str) -> QuantizedWeight:
    """A float matrix [rows, columns] as `qtype` blocks (columns padded to whole blocks)."""
    import gguf

    array = (
        weight.float().numpy()
        if hasattr(weight, "numpy") and not isinstance(weight, np.ndarray)
        else weight
    )
    array = np.asarray(array, dtype=np.float32)
    rows, columns = array.shape
    block = BLOCKS[qtype][0]
    padded = -(-columns // block) * block
    if padded != columns:
        array = np.pad(array, ((0, 0), (0, padded - columns)))
    blocks = gguf.quants.quantize(np.ascontiguousarray(array), gguf.GGMLQuantizationType[qtype])
    return QuantizedWeight.from_blocks(qtype, blocks, in_features=columns)


def quantize_floats(weights, scheme: str, served: dict[str, dict]):
    """The (name, weight) stream with every float matrix of the model quantized by `scheme`;
    `served` (file type -> {"tensors", "served_as"}) records what they became."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    qtype = SCHEMES[scheme]
    for name, weight in weights:
        if isinstance(weight, QuantizedWeight) or not name.endswith(_MATRICES) or weight.ndim != 2:
            yield name, weight
            continue
        kind = str(weight.dtype).replace("torch.", "").upper().replace("FLOAT", "F")
        entry = served.get(kind)
        if entry is not None and entry["served_as"] == "float":
            entry["tensors"] -= 1
            if not entry["tensors"]:
                del served[kind]
        target = served.setdefault(f"{kind} -> {qtype}", {"tensors": 0, "served_as": qtype})
        target["tensors"] += 1
        yield name, quantize_matrix(weight, qtype)

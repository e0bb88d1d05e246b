"""GGUF files: architecture from metadata, weights kept quantized (or dequantized on request),
tokenizer converted once.

A matrix stored in a type Cadence's kernels read (`cadence.layers.quantized.QTYPES`) is
handed to the model as a `QuantizedWeight` of the file's own blocks; every other tensor (and
every tensor with `dequantize=True`) is dequantized to float32 by gguf, as before.

llama.cpp's converter stores the Q and K projection rows of Llama-family models permuted
(interleaved rotary pairs). Our rotary embedding uses the Hugging Face (half-split) layout,
so those two weights are un-permuted here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import numpy as np

from cadence.layers.quantized import BLOCKS, QTYPES, QuantizedWeight
from cadence.models.config import ModelConfig

logger = logging.getLogger(__name__)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _reader(path: str):
    from cadence.model_loader.gguf_file import read_gguf

    return read_gguf(path)


def _field(reader, key: str, default=None):
    from cadence.model_loader.gguf_file import field_value

    return field_value(reader, key, default)


def read_config(path: str, reader=None) -> ModelConfig:
    reader = reader or _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: llama, qwen2)")
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", ()))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def unpermute_rotary(weight, num_heads: int):
    """Undo llama.cpp's Q/K row permutation: per head, rows [pairs..., 2] -> [2, pairs...].
    Rows of an array or of a QuantizedWeight (a row's blocks move whole: exact)."""
    rows = weight.shape[0]
    order = np.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).swapaxes(1, 2)
    return weight[order.reshape(-1)]


def _tensor_weight(tensor, keep_quantized: bool, rows=None, cols=None):
    """(the tensor as the model receives it, what it is served as). A quantized matrix's
    `rows` and block-aligned `cols` ranges are cut before its blocks are copied."""
    import gguf

    qtype = tensor.tensor_type.name
    shape = tuple(
        int(d) for d in reversed(tensor.shape)
    )  # GGUF lists the innermost dimension first
    if keep_quantized and qtype in QTYPES and len(shape) == 2:
        blocks, in_features = tensor.data.reshape(shape[0], -1), shape[1]
        if rows is not None:
            blocks = blocks[rows.start : rows.stop]
        block, size = BLOCKS[qtype]
        if cols is not None and cols.start % block == 0 and cols.stop % block == 0:
            blocks = blocks[:, cols.start // block * size : cols.stop // block * size]
            in_features = len(cols)
        return QuantizedWeight.from_blocks(qtype, blocks, in_features), qtype
    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    return data.reshape(shape), "float"


def iter_weights(
    path: str,
    config: ModelConfig,
    reader=None,
    progress: bool = True,
    keep_quantized: bool = False,
    served: dict[str, dict] | None = None,
    wanted=None,
    shard_of=None,
) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
    """Yield (Hugging Face name, weight) for every tensor: a QuantizedWeight of the file's
    blocks where `keep_quantized` and the type is one Cadence serves quantized, else a float32
    array. `served` collects {file type: {"tensors": n, "served_as": type or "float"}}.
    `wanted(name)` False skips a tensor unread (another pipeline stage's); `shard_of(name)`
    gives the (rows, columns) to read of a quantized matrix, None for all (a rank's share:
    only those blocks are copied out of the file)."""
    from tqdm import tqdm

    reader = reader or _reader(path)
    for tensor in tqdm(
        reader.tensors, desc="Loading GGUF weights", unit="tensor", disable=not progress
    ):
        match = _BLOCK.match(tensor.name)
        if match:
            layer, suffix = match.groups()
            if suffix not in _LAYER_NAMES:
                raise ValueError(
                    f"GGUF tensor {tensor.name!r} is not understood by the llama loader"
                )
            name = f"model.layers.{layer}.{_LAYER_NAMES[suffix]}"
        elif tensor.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[tensor.name]
        elif tensor.name == "rope_freqs.weight":
            continue  # only used by llama3-style rope scaling, which we do not support yet
        else:
            raise ValueError(f"GGUF tensor {tensor.name!r} is not understood by the llama loader")
        if wanted is not None and not wanted(name):
            continue
        rows, cols = shard_of(name) if shard_of is not None else (None, None)
        data, served_as = _tensor_weight(tensor, keep_quantized, rows, cols)
        if served is not None:
            entry = served.setdefault(
                tensor.tensor_type.name, {"tensors": 0, "served_as": served_as}
            )
            entry["tensors"] += 1
        if match and suffix.startswith(("attn_q.", "attn_k.")):  # per head: a share's heads too
            data = unpermute_rotary(data, data.shape[0] // config.head_dim)
        yield name, data

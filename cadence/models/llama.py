"""The Llama family (Llama, SmolLM2, Qwen2-style GQA) in plain PyTorch on our KV pool.

Weights are kept fused where that saves kernel launches at decode time: q/k/v in one
matrix, gate/up in one matrix. Loading maps the checkpoint's separate tensors into them.
A weight the loader keeps quantized arrives as a `QuantizedWeight` and replaces the float
parameter it was meant for; the model only reorders and fuses its rows and hands it to
`make_linear`, whatever its type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cadence.distributed.layout import ModelShard
from cadence.layers.attention import AttentionBackend
from cadence.layers.forward_batch import ForwardBatch
from cadence.layers.layer_ops import LayerOps
from cadence.layers.linear import Linear
from cadence.layers.quantized import QuantizedWeight
from cadence.models.config import ModelConfig


class RotaryEmbedding:
    """Rotary embedding in the interleaved layout: dims (2i, 2i+1) of a head form pair i.

    The model stores its Q/K projection rows in that order (see `interleave_rotary_rows`),
    which is the same attention as Hugging Face's half-split layout — q·k sums over the head
    dimension, so permuting both alike changes nothing — but lets one in-place complex
    multiply rotate every head at once.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.cis = (
            torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)
        )  # [pos, D/2]

    def step_factors(self, positions: torch.Tensor, head_scales: torch.Tensor) -> torch.Tensor:
        """Complex factors [T, heads, D/2] for this step: rotation times each head's scale."""
        return self.cis[positions].unsqueeze(1) * head_scales.view(1, -1, 1)


def interleave_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Hugging Face (half-split) Q/K rows -> interleaved rows, per head: [a..., b...] -> [a0, b0, a1, b1, ...]."""
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(num_heads, 2, rows // num_heads // 2).transpose(1, 2)
    return weight[order.reshape(-1)]  # rows of a tensor or of a QuantizedWeight


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class LlamaDecoderLayer(nn.Module):
    """One decoder layer, or a tensor-parallel rank's share of it: its query and key-value
    heads (q|k|v and gate|up split by rows), o and down split by columns, each of those two
    followed by `reduce` (an all-reduce over the ranks; nothing on one rank)."""

    def __init__(self, config: ModelConfig, layer_id: int, shard: ModelShard | None = None):
        super().__init__()
        self.layer_id = layer_id  # this rank's index: its layer of the KV pool
        self.eps = config.rms_norm_eps
        dims = local_dims(config, shard or ModelShard())
        h, q_dim, kv_dim, inter = config.hidden_size, dims.q_dim, dims.kv_dim, dims.intermediate
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_attention_norm = nn.Parameter(torch.ones(h))
        self.qkv_proj = nn.Parameter(torch.empty(q_dim + 2 * kv_dim, h))  # rows: q | k | v
        self.qkv_bias = (
            nn.Parameter(torch.zeros(q_dim + 2 * kv_dim)) if config.attention_bias else None
        )
        self.o_proj = nn.Parameter(torch.empty(h, q_dim))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * inter, h))  # rows: gate | up
        self.down_proj = nn.Parameter(torch.empty(h, inter))
        self.reduce = _same

    def build_linears(self, make_linear) -> list[tuple[nn.Parameter, Linear]]:
        self.qkv = make_linear(self.qkv_proj, self.qkv_bias)
        self.o = make_linear(self.o_proj)
        self.gate_up = make_linear(self.gate_up_proj)
        self.down = make_linear(self.down_proj)
        return [
            (self.qkv_proj, self.qkv),
            (self.o_proj, self.o),
            (self.gate_up_proj, self.gate_up),
            (self.down_proj, self.down),
        ]

    def forward(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        rope_factors,
        attn: AttentionBackend,
        batch: ForwardBatch,
        ops: LayerOps,
    ) -> torch.Tensor:
        """Adds the previous layer's output `delta` (None for the first layer) and this layer's
        attention to `residual` in place; returns this layer's MLP output for the next to add."""
        if delta is None:
            x = ops.rms_norm(residual, self.input_norm, self.eps)
        else:
            x = ops.add_rms_norm_(residual, delta, self.input_norm, self.eps)
        lora, i = batch.lora, self.layer_id
        qkv = self.qkv(x)  # [T, (H + 2 KVH) * D]
        if lora is not None:
            qkv = lora.apply(i, "qkv", x, qkv, ops)
        if qkv.dtype != attn.kv_pool.dtype:
            qkv = qkv.to(attn.kv_pool.dtype)
        # Rotary on q and k (and the softmax scale on q), the K/V store, attention.
        o = attn.forward_qkv(qkv, rope_factors, ops, self.layer_id, batch)
        if o.dtype != residual.dtype:
            o = o.to(residual.dtype)
        reduce = self.reduce
        if lora is None:
            x = ops.add_rms_norm_(residual, reduce(self.o(o)), self.post_attention_norm, self.eps)
            return reduce(self.down(ops.silu_and_mul(self.gate_up(x))))
        x = ops.add_rms_norm_(
            residual, lora.apply(i, "o", o, self.o(o), ops), self.post_attention_norm, self.eps
        )
        h = ops.silu_and_mul(lora.apply(i, "gate_up", x, self.gate_up(x), ops))
        return lora.apply(i, "down", h, self.down(h), ops)


@dataclass(frozen=True)
class LocalDims:
    """One rank's sizes of a model's split dimensions (the whole model's on one rank)."""

    q_heads: range
    kv_heads: range
    intermediate_range: range
    vocab_range: range
    head_dim: int

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def intermediate(self) -> int:
        return len(self.intermediate_range)


def local_dims(config: ModelConfig, shard: ModelShard) -> LocalDims:
    c = config
    return LocalDims(
        q_heads=shard.q_heads(c.num_attention_heads, c.num_key_value_heads),
        kv_heads=shard.kv_heads(c.num_key_value_heads),
        intermediate_range=shard.intermediate(c.intermediate_size),
        vocab_range=shard.vocab(c.vocab_size),
        head_dim=c.head_dim,
    )


def lm_head_in_layers(config: ModelConfig) -> float:
    """The LM head's weights in layers' worth: what the first pipeline stage computes beyond
    its layers, so that it takes fewer (SmolLM2-135M's is worth ~8 of its 30 layers)."""
    c = config
    per_layer = c.hidden_size * (2 * c.q_dim + 2 * c.kv_dim + 3 * c.intermediate_size)
    return c.vocab_size * c.hidden_size / per_layer


def pp_layer_partition() -> list[int] | None:
    from cadence import envs

    return envs.pp_layer_partition()


class LlamaForCausalLM(nn.Module):
    """The whole model on one rank, or one rank's share of it (`ModelShard`): its pipeline
    stage's layers (the first stage also holds the embedding table and the LM head, the last
    the final norm) and its tensor-parallel share of each (`LlamaDecoderLayer`; the vocabulary
    split by rows). `comm` (set in `setup`) carries what crosses ranks: all-reduces, the
    gathered logits, the stage-to-stage activations."""

    def __init__(self, config: ModelConfig, shard: ModelShard | None = None):
        super().__init__()
        self.config = config
        self.shard = shard = shard or ModelShard()
        self.dims = dims = local_dims(config, shard)
        self.layer_ids = shard.layers(  # this stage's, of the model's
            config.num_hidden_layers, lm_head_in_layers(config), pp_layer_partition()
        )
        h, first = config.hidden_size, shard.is_first_stage
        self.embed_tokens = nn.Parameter(torch.empty(len(dims.vocab_range), h)) if first else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i - self.layer_ids.start, shard) for i in self.layer_ids
        )
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = (
            None
            if config.tie_word_embeddings or not first
            else nn.Parameter(torch.empty(len(dims.vocab_range), h))
        )
        self.rope: RotaryEmbedding | None = None
        self.attn: AttentionBackend | None = None
        self.ops = LayerOps()
        self.comm = None

    def setup(
        self,
        attn: AttentionBackend,
        max_positions: int,
        make_linear=Linear,
        ops: LayerOps | None = None,
        comm=None,
    ) -> None:
        """Attach the attention backend, the layer ops and the ranks' communication (None on
        one rank), build rotary tables and the projections (after weights are loaded)."""
        c, d = self.config, self.dims
        self.ops = ops or LayerOps()
        self.comm = comm
        if comm is not None and self.shard.tp_size > 1:
            for layer in self.layers:
                layer.reduce = comm.all_reduce_
        self.build_linears(make_linear)
        self.rope = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, self.norm.device)
        scales = [c.head_dim**-0.5] * d.num_heads + [1.0] * d.num_kv_heads
        self.head_scales = torch.tensor(scales, dtype=torch.complex64, device=self.norm.device)
        self.attn = attn

    @property
    def lm_head_weight(self) -> torch.Tensor | None:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def build_linears(self, make_linear) -> None:
        """Turn every projection weight into what the forward pass calls (`Platform.make_linear`).

        A projection that keeps its own copy of the weight (a packed layout) leaves the
        parameter unused, so its memory is released: the parameter becomes an empty tensor.
        To load new weights, give every parameter its tensor again and call this once more
        (see `ModelRunner.adopt_weights`). The embedding table and the LM head weight stay:
        lookups and the float32 refinement of the top logits read them.
        """
        pairs = [pair for layer in self.layers for pair in layer.build_linears(make_linear)]
        if self.lm_head_weight is not None:  # the first pipeline stage's
            self.lm_head_linear = make_linear(self.lm_head_weight)  # its weight stays
        for param, linear in pairs:
            if not linear.holds_weight:
                _release(param)
        if isinstance(self.lm_head_weight, QuantizedWeight):
            # Its only other reader is the embedding lookup (tied): rows come from the projection.
            self.lm_head_weight.read_rows_from(self.lm_head_linear)

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Returns the final hidden states of the rows in `batch.logits_indices`: [rows, hidden]
        (every row when it is None). With pipeline stages, the first stage gets them back from
        the last; the other stages return None."""
        shard, comm = self.shard, self.comm
        if shard.is_first_stage:
            residual = self._embed(batch.input_ids)
        else:
            residual = comm.recv_from_prev(self._shape_in(batch), self.norm.dtype)
        out = self._run_layers(batch, residual)
        if shard.is_last_stage:
            if shard.is_first_stage:
                return out
            comm.send_to_first(out)
            return None
        comm.send_to_next(out)
        if not shard.is_first_stage:
            return None
        return comm.recv_from_last(self._shape_out(batch), self.norm.dtype)

    def forward_micro(self, batches: list[ForwardBatch], finish=None) -> list[torch.Tensor] | None:
        """`forward` of several micro-batches with pipeline stages, in flight together: while
        stage s + 1 runs micro-batch k, stage s runs k + 1. The first stage returns each one's
        final rows, in order, or `finish(rows)` of each (the logits), computed as each comes
        back while the later stages still run the others; the other stages return None."""
        started = [self.forward_start(batch) for batch in batches]  # each sent on at once
        out = []
        for batch, begun in zip(batches, started, strict=True):
            rows = self.forward_end(batch, begun)  # None on the later stages
            out.append(rows if finish is None or rows is None else finish(rows))
        return out if self.shard.is_first_stage else None

    def forward_start(self, batch: ForwardBatch) -> tuple[Any, torch.Tensor]:
        """The first half of `forward` with pipeline stages, for a step that stays in flight
        while the stages run others (`forward_end` takes it back): this stage's layers over
        the batch (the first embeds it, the others receive the previous stage's rows), their
        output sent on (the last stage's to the first). Returns the send and its tensor,
        which stays unchanged until the send is done."""
        shard, comm = self.shard, self.comm
        if shard.is_first_stage:
            residual = self._embed(batch.input_ids)
        else:
            residual = comm.recv_from_prev(self._shape_in(batch), self.norm.dtype)
        x = self._run_layers(batch, residual).contiguous()
        if shard.is_last_stage:
            return comm.isend_to_first(x), x
        return comm.isend_to_next(x), x

    def forward_end(self, batch: ForwardBatch, started: tuple[Any, torch.Tensor]):
        """The end of a step begun by `forward_start`: the first stage receives the final
        rows from the last one and returns them; every stage waits for its send."""
        work, _ = started
        rows = None
        if self.shard.is_first_stage:
            rows = self.comm.recv_from_last(self._shape_out(batch), self.norm.dtype)
        work.wait()
        return rows

    def _shape_in(self, batch: ForwardBatch) -> tuple[int, int]:
        return (batch.input_ids.shape[0], self.config.hidden_size)

    def _shape_out(self, batch: ForwardBatch) -> tuple[int, int]:
        rows = (
            batch.input_ids.shape[0] if batch.logits_indices is None else len(batch.logits_indices)
        )
        return (rows, self.config.hidden_size)

    def _run_layers(self, batch: ForwardBatch, residual: torch.Tensor) -> torch.Tensor:
        """This stage's layers over `residual` (updated in place). Returns it with the last
        layer's output added, or, on the last stage, the final rows normed (those of
        `batch.logits_indices`, or all)."""
        factors = self.ops.rope_factors(self.rope.step_factors(batch.positions, self.head_scales))
        delta = None
        for layer in self.layers:
            delta = layer(residual, delta, factors, self.attn, batch, self.ops)
        if not self.shard.is_last_stage:
            return residual.add_(delta)
        eps = self.config.rms_norm_eps
        if batch.logits_indices is None:
            return self.ops.add_rms_norm_(residual, delta, self.norm, eps)
        residual.add_(delta)
        return self.ops.rms_norm(residual[batch.logits_indices], self.norm, eps)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the embedding table; with a split vocabulary each rank looks up the ids it
        holds, zeros the others, and the ranks' rows are summed."""
        table, vocab = self.embed_tokens, self.dims.vocab_range
        split = self.shard.tp_size > 1
        if split:
            inside = (ids >= vocab.start) & (ids < vocab.stop)
            ids = torch.where(inside, ids - vocab.start, 0)
        if isinstance(table, QuantizedWeight):
            rows = table.embedding(ids, self.norm.dtype)
        else:
            rows = F.embedding(ids, table)
        if split:
            rows.masked_fill_(~inside.unsqueeze(1), 0)
            self.comm.all_reduce_(rows)
        return rows

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> float32 logits [rows, vocab]. From a bfloat16/float16 model the
        logits near each row's maximum are recomputed in float32 (`refine_top_logits`). A
        quantized LM head gives float32 sums of the rows as they are (`float_out`). With a
        split vocabulary each rank computes its share and the shares are gathered."""
        if isinstance(self.lm_head_weight, QuantizedWeight):
            logits = self.lm_head_linear.float_out(hidden)
        else:
            logits = self.lm_head_linear(hidden)
            if hidden.dtype in (torch.bfloat16, torch.float16):
                logits = self.ops.refined_logits(logits, hidden, self.lm_head_weight)
            logits = logits.float()
        if self.shard.tp_size == 1:
            return logits
        vocab_size = self.config.vocab_size
        return self.comm.all_gather_vocab(logits, self.shard.vocab_rows(vocab_size))[:, :vocab_size]

    # ---- weight loading -------------------------------------------------------------

    def wants_weight(self, name: str) -> bool:
        """Whether this rank holds any of the checkpoint tensor `name` (a pipeline stage skips
        the other stages' layers, and the embedding and LM head unless it is the first)."""
        if name.startswith("model.layers."):
            return int(name.split(".", 3)[2]) in self.layer_ids
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self.shard.is_first_stage
        return True

    def shard_of(self, name: str) -> tuple[range | None, range | None]:
        """(rows, columns) of checkpoint tensor `name` this rank keeps, None where it keeps
        them all. A loader that can read just those (a GGUF file's blocks) hands over only
        them; `load_weights` cuts what comes whole."""
        d, hd = self.dims, self.config.head_dim
        if self.shard.tp_size == 1:
            return None, None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return d.vocab_range, None
        if not name.startswith("model.layers."):
            return None, None
        q = range(d.q_heads.start * hd, d.q_heads.stop * hd)
        kv = range(d.kv_heads.start * hd, d.kv_heads.stop * hd)
        rows = {"q_proj": q, "k_proj": kv, "v_proj": kv}
        rows.update({"gate_proj": d.intermediate_range, "up_proj": d.intermediate_range})
        cols = {"o_proj": q, "down_proj": d.intermediate_range}
        proj = name.split(".")[4]
        return rows.get(proj), cols.get(proj)

    def _local_part(self, name: str, tensor):
        """This rank's share of checkpoint tensor `name` (the whole tensor on one rank)."""
        rows, cols = self.shard_of(name)
        if rows is not None:
            tensor = _take_rows(tensor, rows)
        if cols is not None:
            tensor = _take_columns(tensor, cols)
        return tensor  # norms: every rank holds them whole

    def load_weights(self, weights) -> None:
        """Copy (Hugging Face name, array) pairs into our fused parameters: this rank's share
        of each (`wants_weight`, `_local_part`)."""
        d = self.dims
        q, kv, inter = d.q_dim, d.kv_dim, d.intermediate
        fused = {
            "self_attn.q_proj.weight": ("qkv_proj", 0, q),
            "self_attn.k_proj.weight": ("qkv_proj", q, q + kv),
            "self_attn.v_proj.weight": ("qkv_proj", q + kv, q + 2 * kv),
            "self_attn.q_proj.bias": ("qkv_bias", 0, q),
            "self_attn.k_proj.bias": ("qkv_bias", q, q + kv),
            "self_attn.v_proj.bias": ("qkv_bias", q + kv, q + 2 * kv),
            "mlp.gate_proj.weight": ("gate_up_proj", 0, inter),
            "mlp.up_proj.weight": ("gate_up_proj", inter, 2 * inter),
        }
        plain = {
            "self_attn.o_proj.weight": "o_proj",
            "mlp.down_proj.weight": "down_proj",
            "input_layernorm.weight": "input_norm",
            "post_attention_layernorm.weight": "post_attention_norm",
        }
        loaded: set[str] = set()
        kept: dict[tuple[nn.Module, str], list] = {}  # (module, attr) -> [(row, QuantizedWeight)]
        with torch.no_grad():
            for name, array in weights:
                if not self.wants_weight(name):
                    continue
                if isinstance(array, QuantizedWeight):
                    tensor = array
                else:
                    if not isinstance(array, torch.Tensor) and not array.flags.writeable:
                        array = array.copy()  # memory-mapped file data; torch wants writable memory
                    tensor = torch.as_tensor(array)
                if name.startswith("model.layers."):
                    _, _, idx, rest = name.split(".", 3)
                    layer = self.layers[int(idx) - self.layer_ids.start]
                    if rest in fused:
                        attr, lo, hi = fused[rest]
                        tensor = self._local_part(name, tensor)
                        if rest.startswith("self_attn.q_proj"):
                            tensor = interleave_rotary_rows(tensor, d.num_heads)
                        elif rest.startswith("self_attn.k_proj"):
                            tensor = interleave_rotary_rows(tensor, d.num_kv_heads)
                        if isinstance(tensor, QuantizedWeight):
                            kept.setdefault((layer, attr), []).append((lo, tensor))
                        else:
                            getattr(layer, attr)[lo:hi].copy_(tensor)
                    elif rest in plain:
                        tensor = self._local_part(name, tensor)
                        if isinstance(tensor, QuantizedWeight):
                            kept[(layer, plain[rest])] = [(0, tensor)]
                        else:
                            getattr(layer, plain[rest]).copy_(tensor)
                    elif rest.endswith("rotary_emb.inv_freq"):
                        continue
                    else:
                        raise ValueError(f"unexpected weight {name!r} for a llama model")
                elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                    attr = "embed_tokens" if name == "model.embed_tokens.weight" else "lm_head"
                    if getattr(self, attr) is None:  # a tied LM head: the table serves as one
                        continue
                    tensor = self._local_part(name, tensor)
                    if isinstance(tensor, QuantizedWeight):
                        kept[(self, attr)] = [(0, tensor)]
                    else:
                        getattr(self, attr).copy_(tensor)
                elif name == "model.norm.weight":
                    self.norm.copy_(tensor)
                else:
                    raise ValueError(f"unexpected weight {name!r} for a llama model")
                loaded.add(name)
            for (module, attr), pieces in kept.items():
                _install_quantized(module, attr, pieces)
        if self.shard.is_first_stage and "model.embed_tokens.weight" not in loaded:
            raise ValueError("the checkpoint has no model.embed_tokens.weight")
        if self.lm_head is not None and "lm_head.weight" not in loaded:
            raise ValueError(
                "the checkpoint has no lm_head.weight and the config does not tie embeddings"
            )


def _take_rows(tensor, rows: range):
    if tensor.shape[0] == len(rows):  # this share already (or the whole on one rank)
        return tensor
    if isinstance(tensor, QuantizedWeight):
        return tensor.rows_slice(rows.start, rows.stop)
    return tensor[rows.start : rows.stop]


def _take_columns(tensor, cols: range):
    if tensor.shape[-1] == len(cols):  # this share already (or the whole on one rank)
        return tensor
    if isinstance(tensor, QuantizedWeight):
        return tensor.columns_slice(cols.start, cols.stop)
    return tensor[:, cols.start : cols.stop]


def _release(param) -> None:
    """Frees a weight a projection no longer reads (a weight update refills it)."""
    if isinstance(param, QuantizedWeight):
        param.release()
    else:
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _install_quantized(module: nn.Module, attr: str, pieces: list) -> None:
    """Replaces the float parameter `attr` by one QuantizedWeight of its rows: the quantized
    pieces (row offset, weight) where they came, float rows (pieces loaded as tensors) between."""
    param = getattr(module, attr)
    parts, row = [], 0
    for lo, weight in sorted(pieces, key=lambda p: p[0]):
        if lo > row:
            parts.append(QuantizedWeight.dense(param[row:lo]))
        parts.append(weight)
        row = lo + weight.out_features
    if row < param.shape[0]:
        parts.append(QuantizedWeight.dense(param[row:]))
    delattr(module, attr)  # a registered parameter can only be replaced by a parameter
    setattr(module, attr, QuantizedWeight.cat(parts) if len(parts) > 1 else parts[0])

"""The BERT family as an encoder: BertModel (sentence-transformers' layout included) and
BertForSequenceClassification, in plain PyTorch.

An encoder keeps no KV cache: every request is one forward pass over its whole input and
leaves nothing behind. Requests of a batch arrive packed, their tokens concatenated
([num_tokens] with `seq_lens`), so the projections (most of the work) never compute a
padding row; only attention, whose cost is small at these lengths, runs on a padded
[batch, heads, longest, head_dim] view of the same rows.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from cadence.layers.linear import Linear

ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")
ENCODER_MODEL_TYPES = ("bert",)


@dataclass(frozen=True)
class BertConfig:
    """The shape of a BERT encoder, read from a Hugging Face config.json."""

    architecture: str
    """BertModel (hidden states, pooled into embeddings) or BertForSequenceClassification
    (a classification head over the pooled [CLS] state)."""
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    id2label: tuple[str, ...] = field(default_factory=tuple)
    """Class names of a classification model, by class index (empty for BertModel)."""
    is_matryoshka: bool = False
    """The model was trained so that a prefix of its embedding is an embedding itself
    (config.json `is_matryoshka` or `matryoshka_dimensions`)."""
    matryoshka_dimensions: tuple[int, ...] = ()
    """The prefix lengths it was trained for; empty: any length."""
    # What runtime_facts and the shared loader code read of every model's config.
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @property
    def is_classifier(self) -> bool:
        return self.architecture == "BertForSequenceClassification"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported for BERT")

    @classmethod
    def from_hf_dir(cls, path: str) -> BertConfig:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        archs = cfg.get("architectures") or ["BertModel"]
        arch = next((a for a in archs if a in ENCODER_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"architectures {archs} are not supported for an encoder "
                f"(supported: {', '.join(ENCODER_ARCHITECTURES)})"
            )
        kind = cfg.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"position_embedding_type {kind!r} is not supported (absolute only)")
        labels: tuple[str, ...] = ()
        if arch == "BertForSequenceClassification":
            id2label = cfg.get("id2label") or {}
            num = int(cfg.get("num_labels") or len(id2label) or 2)
            labels = tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(num))
        dims = cfg.get("matryoshka_dimensions") or ()
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            hidden_act=cfg.get("hidden_act", "gelu"),
            pad_token_id=int(cfg.get("pad_token_id") or 0),
            id2label=labels,
            is_matryoshka=bool(cfg.get("is_matryoshka")) or bool(dims),
            matryoshka_dimensions=tuple(int(d) for d in dims),
        )


def _activation(name: str):
    if name == "gelu":
        return F.gelu
    if name == "relu":
        return F.relu
    return lambda x: F.gelu(x, approximate="tanh")


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        h = c.hidden_size
        self.qkv_weight = nn.Parameter(torch.empty(3 * h, h))  # query | key | value rows
        self.qkv_bias = nn.Parameter(torch.empty(3 * h))
        self.o_weight = nn.Parameter(torch.empty(h, h))
        self.o_bias = nn.Parameter(torch.empty(h))
        self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.up_weight = nn.Parameter(torch.empty(c.intermediate_size, h))
        self.up_bias = nn.Parameter(torch.empty(c.intermediate_size))
        self.down_weight = nn.Parameter(torch.empty(h, c.intermediate_size))
        self.down_bias = nn.Parameter(torch.empty(h))
        self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.num_heads = c.num_attention_heads
        self.act = _activation(c.hidden_act)

    def build_linears(self, make_linear) -> None:
        self.qkv = make_linear(self.qkv_weight, self.qkv_bias)
        self.o = make_linear(self.o_weight, self.o_bias)
        self.up = make_linear(self.up_weight, self.up_bias)
        self.down = make_linear(self.down_weight, self.down_bias)

    def forward(self, x: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
        """x: [num_tokens, hidden] packed rows -> the same shape."""
        attn = layout.attention(self.qkv(x), self.num_heads)
        x = self.attn_norm(x + self.o(attn))
        return self.out_norm(x + self.down(self.act(self.up(x))))


class PaddedLayout:
    """Where each packed row sits in the padded [batch, longest] view attention runs on,
    computed once per forward and shared by every layer."""

    def __init__(self, seq_lens: list[int], device: torch.device):
        self.seq_lens = seq_lens
        self.batch_size, self.width = len(seq_lens), max(seq_lens)
        self.is_dense = all(n == self.width for n in seq_lens)
        if self.is_dense:
            self.rows = self.mask = None
            return
        offsets = torch.arange(self.width, device=device)
        lens = torch.tensor(seq_lens, device=device)
        valid = offsets.unsqueeze(0) < lens.unsqueeze(1)  # [B, W]
        self.rows = valid.view(-1).nonzero().squeeze(1)  # [num_tokens] int64: padded row of each
        # [B, 1, 1, W] bool, True where a key may be attended (broadcast over heads and queries)
        self.mask = valid.view(self.batch_size, 1, 1, self.width)

    def attention(self, qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Bidirectional attention within each sequence. qkv: [num_tokens, 3 * hidden] ->
        [num_tokens, hidden]."""
        b, w = self.batch_size, self.width
        hidden = qkv.shape[1] // 3
        if self.is_dense:
            padded = qkv.view(b, w, 3, num_heads, hidden // num_heads)
        else:
            padded = qkv.new_zeros(b * w, qkv.shape[1])
            padded.index_copy_(0, self.rows, qkv)
            padded = padded.view(b, w, 3, num_heads, hidden // num_heads)
        q, k, v = padded.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, W, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        out = out.transpose(1, 2).reshape(b * w, hidden)
        return out if self.is_dense else out.index_select(0, self.rows)


class BertEncoder(nn.Module):
    """BertModel or BertForSequenceClassification over packed requests."""

    def __init__(self, config: BertConfig):
        super().__init__()
        c = self.config = config
        h = c.hidden_size
        self.word_embeddings = nn.Parameter(torch.empty(c.vocab_size, h))
        self.position_embeddings = nn.Parameter(torch.empty(c.max_position_embeddings, h))
        self.token_type_embeddings = nn.Parameter(torch.empty(c.type_vocab_size, h))
        self.embed_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))
        # The [CLS] pooler (dense + tanh) and the classification head of a classifier.
        self.pooler_weight = nn.Parameter(torch.empty(h, h)) if c.is_classifier else None
        self.pooler_bias = nn.Parameter(torch.empty(h)) if c.is_classifier else None
        self.classifier_weight = (
            nn.Parameter(torch.empty(c.num_labels, h)) if c.is_classifier else None
        )
        self.classifier_bias = nn.Parameter(torch.empty(c.num_labels)) if c.is_classifier else None

    def build_linears(self, make_linear=Linear) -> None:
        """Turn every projection weight into what the forward pass calls
        (`Platform.make_linear`); call again after loading new weights."""
        for layer in self.layers:
            layer.build_linears(make_linear)
        if self.config.is_classifier:
            self.pooler = make_linear(self.pooler_weight, self.pooler_bias)
            self.classifier = make_linear(self.classifier_weight, self.classifier_bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor,
        seq_lens: list[int],
    ) -> torch.Tensor:
        """input_ids, positions, token_type_ids: [num_tokens] int64, requests concatenated.
        Returns the final hidden states [num_tokens, hidden]."""
        x = (
            F.embedding(input_ids, self.word_embeddings)
            + F.embedding(positions, self.position_embeddings)
            + F.embedding(token_type_ids, self.token_type_embeddings)
        )
        x = self.embed_norm(x)
        layout = PaddedLayout(seq_lens, x.device)
        for layer in self.layers:
            x = layer(x, layout)
        return x

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:
        """[batch, hidden] final [CLS] states -> [batch, num_labels] logits."""
        return self.classifier(torch.tanh(self.pooler(cls_states)))

    # ---- weights -----------------------------------------------------------------------

    _PLAIN = {
        "embeddings.word_embeddings.weight": "word_embeddings",
        "embeddings.position_embeddings.weight": "position_embeddings",
        "embeddings.token_type_embeddings.weight": "token_type_embeddings",
        "embeddings.LayerNorm.weight": "embed_norm.weight",
        "embeddings.LayerNorm.bias": "embed_norm.bias",
        "pooler.dense.weight": "pooler_weight",
        "pooler.dense.bias": "pooler_bias",
        "classifier.weight": "classifier_weight",
        "classifier.bias": "classifier_bias",
    }
    _LAYER = {
        "attention.output.dense.weight": "o_weight",
        "attention.output.dense.bias": "o_bias",
        "attention.output.LayerNorm.weight": "attn_norm.weight",
        "attention.output.LayerNorm.bias": "attn_norm.bias",
        "intermediate.dense.weight": "up_weight",
        "intermediate.dense.bias": "up_bias",
        "output.dense.weight": "down_weight",
        "output.dense.bias": "down_bias",
        "output.LayerNorm.weight": "out_norm.weight",
        "output.LayerNorm.bias": "out_norm.bias",
    }
    _QKV = ("query", "key", "value")

    def load_weights(self, weights) -> None:
        """Copies (name, array) pairs of a Hugging Face checkpoint in; `bert.` prefixes (a
        classifier's) are optional. Raises ValueError for a missing or unexpected weight."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        h = self.config.hidden_size
        with torch.no_grad():
            for name, array in weights:
                if not isinstance(array, torch.Tensor) and not array.flags.writeable:
                    array = array.copy()  # memory-mapped file data; torch wants writable memory
                tensor = torch.as_tensor(array)
                key = name.removeprefix("bert.")
                if key.endswith("position_ids") or key.endswith("LayerNorm.gamma"):
                    continue  # a buffer, not a weight
                target, rows = self._target(key, h)
                if key.startswith("pooler.") and not self.config.is_classifier:
                    continue  # BertModel's pooler: sentence-transformers never uses it
                if target is None or target not in params:
                    raise ValueError(f"unexpected weight {name!r} for a BERT model")
                param = params[target]
                (param if rows is None else param[rows]).copy_(tensor)
                loaded.add(target if rows is None else f"{target}[{rows.start}]")
        expected = {n for n in params if not n.startswith("layers.")} | {
            f"layers.{i}.{attr}" for i in range(len(self.layers)) for attr in self._LAYER.values()
        }
        missing = sorted(n for n in expected if n not in loaded and n in params)
        qkv = {n for n in loaded if "qkv" in n}
        if missing or len(qkv) != 6 * len(self.layers):
            raise ValueError(
                f"the checkpoint lacks weights of the BERT model: {missing[:4] or 'query/key/value'}"
            )

    def _target(self, key: str, h: int) -> tuple[str | None, slice | None]:
        if key in self._PLAIN:
            return self._PLAIN[key], None
        if not key.startswith("encoder.layer."):
            return None, None
        _, _, idx, rest = key.split(".", 3)
        if rest in self._LAYER:
            return f"layers.{idx}.{self._LAYER[rest]}", None
        for i, part in enumerate(self._QKV):
            for kind in ("weight", "bias"):
                if rest == f"attention.self.{part}.{kind}":
                    return f"layers.{idx}.qkv_{kind}", slice(i * h, (i + 1) * h)
        return None, None

"""Pooling: one vector per request out of its final hidden states.

Requests arrive packed (their rows concatenated, `seq_lens` tokens each), as the encoder and
the decoder's extend step produce them. The modes are sentence-transformers' (`Pooling`'s
config: cls, mean, max, mean_sqrt_len, lasttoken), computed in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len", "last")


@dataclass(frozen=True)
class PoolingConfig:
    """How a model turns its hidden states into an embedding."""

    mode: str = "cls"
    """cls (the first token), mean, max, mean_sqrt_len (sum / sqrt(length)) or last (the
    last token: decoders)."""
    normalize: bool = False
    """Scale every embedding to unit length (sentence-transformers' Normalize module)."""

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {', '.join(POOLING_MODES)}")


def pool(hidden: torch.Tensor, seq_lens: list[int], config: PoolingConfig) -> torch.Tensor:
    """hidden: [num_tokens, hidden] packed rows -> [batch, hidden] float32."""
    hidden = hidden.float()
    device = hidden.device
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    ends = lens.cumsum(0)
    mode = config.mode
    if mode == "cls":
        out = hidden.index_select(0, ends - lens)
    elif mode == "last":
        out = hidden.index_select(0, ends - 1)
    elif mode == "max":
        out = torch.stack([rows.amax(0) for rows in hidden.split(seq_lens)])
    else:
        segment = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens)
        sums = hidden.new_zeros(len(seq_lens), hidden.shape[1]).index_add_(0, segment, hidden)
        scale = lens.to(hidden.dtype).unsqueeze(1)
        out = sums / (scale if mode == "mean" else scale.sqrt())
    return F.normalize(out, dim=-1) if config.normalize else out

"""Logit processors a test plugin registers (entry-point group `cadence.logit_processors`):
what a request names with `custom_logit_processor`, never code sent over the wire."""

import torch


def ban_tokens(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Masks the `token_ids` of each row's custom_params."""
    for row, p in enumerate(params):
        ids = (p or {}).get("token_ids", [])
        if ids:
            logits[row, ids] = float("-inf")
    return logits


def explode(logits: torch.Tensor, params: list) -> None:
    """A buggy processor: fails the requests that named it, and only those."""
    raise RuntimeError("the explode processor always fails")

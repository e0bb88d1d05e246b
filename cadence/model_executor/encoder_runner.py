"""Runs an encoder (the BERT family) for the scheduler: embeddings and class logits, one
forward pass per step over whole inputs, with no KV cache at all.

The scheduler still borrows a KV allocator from every runner; this one's pool is bookkeeping
only (no tensor behind it), sized to one context so that what the server reports about its
capacity stays meaningful, and no embedding request ever takes a page of it.
"""

from __future__ import annotations

import logging

import torch

from cadence.layers.pooler import PoolingConfig, pool
from cadence.model_executor.runner import EmbedItem, ItemResult, Runner, ScheduleBatch
from cadence.model_loader.encoder_loader import load_encoder, read_pooling
from cadence.platforms import get_current_platform
from cadence.server_args import ServerArgs

logger = logging.getLogger(__name__)

# BERT with no sentence-transformers files: SGLang's default, the [CLS] state normalized.
DEFAULT_POOLING = PoolingConfig("cls", normalize=True)


class EncoderRunner(Runner):
    is_generation = False

    def __init__(self, args: ServerArgs, model_path: str):
        self.args = args
        self.platform = get_current_platform()
        self.platform.init_backend()
        self.device = self.platform.device
        # Encoders are small and judged against their float32 reference: "auto" is float32.
        self.dtype = (
            torch.float32 if args.dtype == "auto" else self.platform.resolve_dtype(args.dtype)
        )
        self.kv_dtype = self.dtype
        self.platform.weights_loading()
        self.config, self.model = load_encoder(model_path, self.dtype, self.device)
        self.model.build_linears(self.platform.make_linear)
        self.platform.weights_loaded()
        cfg = self.config
        self.pooling = read_pooling(model_path, DEFAULT_POOLING)
        if cfg.is_classifier:
            self.pooling = PoolingConfig("cls")  # the classification head reads [CLS]
        self.eos_token_ids = ()
        self.context_len = args.context_length or cfg.max_position_embeddings
        if self.context_len > cfg.max_position_embeddings:
            raise ValueError(
                f"context_length {self.context_len} exceeds the encoder's "
                f"{cfg.max_position_embeddings} positions"
            )
        self.page_size = args.page_size
        num_pages = -(-self.context_len // self.page_size)
        self.max_total_tokens = num_pages * self.page_size
        self.kv_allocator = self.platform.make_allocator(num_pages, self.page_size)
        logger.info(
            "Encoder: %s pooling%s, %d positions",
            self.pooling.mode,
            ", normalized" if self.pooling.normalize else "",
            self.context_len,
        )

    def run(self, batch: ScheduleBatch) -> list[ItemResult]:
        raise RuntimeError("an encoder serves embeddings only; the front refuses generation")

    @torch.inference_mode()
    def embed(self, items: list[EmbedItem]) -> list[list[float]]:
        dev = self.device
        lens = [len(item.token_ids) for item in items]
        ids = torch.tensor([t for item in items for t in item.token_ids], device=dev)
        positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
        if any(item.token_type_ids for item in items):
            types = torch.tensor(
                [t for item in items for t in (item.token_type_ids or [0] * len(item.token_ids))],
                device=dev,
            )
        else:
            types = torch.zeros_like(ids)
        hidden = self.model(ids, positions, types, lens)
        pooled = pool(hidden, lens, self.pooling)
        if self.config.is_classifier:
            pooled = self.model.classify(pooled.to(self.dtype)).float()
        return pooled.cpu().tolist()

    def embedding_facts(self) -> dict:
        cfg = self.config
        return {
            "embedding_dim": cfg.num_labels if cfg.is_classifier else cfg.hidden_size,
            "pooling": self.pooling.mode,
            "normalizes": self.pooling.normalize,
            "id2label": list(cfg.id2label),
            "type_vocab_size": cfg.type_vocab_size,
            "matryoshka_dimensions": (
                list(cfg.matryoshka_dimensions) if cfg.is_matryoshka else None
            ),
        }

    def load_weights(self, model_path: str, load_format: str | None) -> str:
        from cadence.model_loader.locate import check_load_format, resolve_model_path

        path = resolve_model_path(model_path)
        check_load_format(path, load_format)
        self.platform.weights_loading()
        try:
            config, model = load_encoder(path, self.dtype, self.device)
            if config != self.config:
                raise ValueError(
                    "the new weights have a different architecture; restart the server"
                )
            model.build_linears(self.platform.make_linear)
            self.model = model
        finally:
            self.platform.weights_loaded()  # the old weights serve on if the load failed
        return path

    def profiler_activities(self) -> list:
        return self.platform.profiler_activities()

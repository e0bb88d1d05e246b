"""A scheduler played by the test, for the front's LoRA checks: it keeps a loaded set of
adapters, answers loads, unloads and listings with LoRAUpdateOutput (every adapter loaded
after the call, as the real one does), and finishes every generation at once with one
token. Every message crosses the real codec both ways. Shared by the front, serving, gRPC
and HTTP tests; no model, no process."""

from __future__ import annotations

import asyncio
import uuid

from cadence import io_struct
from cadence.front.client import FrontClient
from cadence.front.engine_client import ModelInfo
from cadence.front.tokenizer import FrontTokenizer
from cadence.io_struct import (
    BatchStrOutput,
    GetLoRAAdaptersReqInput,
    LoadLoRAAdapterReqInput,
    LoRAAdapterInfo,
    LoRAUpdateOutput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
)

MODEL = "base-model"


def adapter(name: str, path: str | None = None, rank: int = 8) -> LoRAAdapterInfo:
    path = path or f"/adapters/{name}"
    lora_id = uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex  # SGLang's id
    return LoRAAdapterInfo(name=name, path=path, lora_id=lora_id, rank=rank)


class CharTokenizer:
    """One token per character (id = code point)."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, tokenize=True, chat_template=None, **kwargs):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class LoRAScheduler:
    def __init__(self, loaded=("sql", "chat")):
        self.loaded = {name: adapter(name) for name in loaded}
        self.sent: list = []
        self.client: FrontClient | None = None

    @property
    def requests(self) -> list[TokenizedGenerateReqInput]:
        return [m for m in self.sent if isinstance(m, TokenizedGenerateReqInput)]

    @property
    def lookups(self) -> int:
        return sum(isinstance(m, GetLoRAAdaptersReqInput) for m in self.sent)

    def send(self, msg) -> None:
        msg = io_struct.decode(io_struct.encode(msg))
        self.sent.append(msg)
        reply = self.reply(msg)
        if reply is not None:
            reply = io_struct.decode(io_struct.encode(reply))
            asyncio.get_running_loop().call_soon(self.client.on_message, reply)

    def reply(self, msg):
        if isinstance(msg, TokenizedGenerateReqInput):
            return BatchStrOutput(
                rids=[msg.rid],
                http_worker_ipcs=[None],
                finished_reasons=[{"type": "length", "length": 1}],
                output_strs=["x"],
                output_ids=[[ord("x")]],
                prompt_tokens=[len(msg.input_ids)],
                completion_tokens=[1],
                cached_tokens=[0],
            )
        if isinstance(msg, LoadLoRAAdapterReqInput):
            if msg.lora_name in self.loaded:
                return self._answer(
                    msg, f"Failed to load LoRA adapter {msg.lora_name} because it is already loaded"
                )
            self.loaded[msg.lora_name] = adapter(msg.lora_name, msg.lora_path)
            return self._answer(msg)
        if isinstance(msg, UnloadLoRAAdapterReqInput):
            if self.loaded.pop(msg.lora_name, None) is None:
                return self._answer(msg, f"LoRA with name {msg.lora_name} does not exist")
            return self._answer(msg)
        if isinstance(msg, GetLoRAAdaptersReqInput):
            return self._answer(msg)
        return None

    def _answer(self, msg, error: str = "") -> LoRAUpdateOutput:
        return LoRAUpdateOutput(
            success=not error,
            error_message=error,
            loaded_adapters=list(self.loaded.values()),
            cid=msg.cid,
        )


def make_client(
    scheduler: LoRAScheduler | None = None,
    enabled: bool = True,
    known: tuple[str, ...] | None = None,
    max_loaded_loras: int | None = None,
) -> tuple[FrontClient, LoRAScheduler]:
    """A FrontClient over `scheduler`, whose copy starts with the adapters `known` (by
    default every one the scheduler has loaded)."""
    from cadence.front.request_checks import RequestOptions

    scheduler = scheduler or LoRAScheduler()
    names = tuple(scheduler.loaded) if known is None else known
    info = ModelInfo(
        model_path="/models/base",
        tokenizer_path=None,
        served_model_name=MODEL,
        served_model_names=(MODEL,),
        context_len=256,
        vocab_size=0x3000,
        max_total_tokens=4096,
        lora_enabled=enabled,
        lora_adapters=tuple(scheduler.loaded[n] for n in names if n in scheduler.loaded),
    )
    client = FrontClient(
        FrontTokenizer(CharTokenizer()),
        info,
        scheduler.send,
        max_pending=64,
        options=RequestOptions(max_loaded_loras=max_loaded_loras),
    )
    scheduler.client = client
    return client, scheduler

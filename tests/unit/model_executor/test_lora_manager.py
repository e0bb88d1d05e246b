"""The LoRA adapters a server holds (`LoraManager`), over tiny PEFT adapters written here:
names, who holds what, unloading while requests still run, eviction under
--max-loaded-loras (lru and fifo; pinned and in-use adapters stay), and uids that are never
reused (the prefix cache's namespaces)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from cadence.model_executor.lora_manager import LoraManager, lora_id
from cadence.model_loader.lora_loader import LoraLoadError
from cadence.models.config import ModelConfig
from cadence.server_args import ServerArgs

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
)
SHAPES = {"q_proj": (16, 16), "v_proj": (8, 16), "o_proj": (16, 16)}


def write_adapter(path, rank: int = 4, modules=("q_proj", "v_proj"), seed: int = 0) -> str:
    os.makedirs(path, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(modules)}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(CONFIG.num_hidden_layers):
        for module in modules:
            out, inp = SHAPES[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def manager(max_loaded=None, policy="lru", **args) -> LoraManager:
    args.setdefault("max_lora_rank", 8)
    args.setdefault("lora_target_modules", ["q_proj", "v_proj"])
    server_args = ServerArgs(
        enable_lora=True, max_loaded_loras=max_loaded, lora_eviction_policy=policy, **args
    )
    return LoraManager(server_args, CONFIG, torch.float32, "cpu")


@pytest.fixture
def adapters(tmp_path):
    """Paths of four valid adapters, a..d."""
    return {name: write_adapter(tmp_path / name, seed=i) for i, name in enumerate("abcd")}


# ---- load, acquire, release ------------------------------------------------------------


def test_load_acquire_release(adapters):
    lm = manager()
    loaded = lm.load("a", adapters["a"])
    assert loaded.name == "a" and loaded.info.rank == 4 and not loaded.pinned
    assert set(loaded.weights.layers[0]) == {"qkv"}
    assert lm.acquire("a") is loaded and lm.acquire("a") is loaded
    assert lm.num_in_use == 2 and loaded.num_requests == 2
    lm.release(loaded)
    lm.release(loaded)
    assert lm.num_in_use == 0
    with pytest.raises(RuntimeError, match="released more often than acquired"):
        lm.release(loaded)
    with pytest.raises(KeyError):
        lm.acquire("never-loaded")


def test_describe_lists_the_loaded_adapters(adapters):
    lm = manager()
    lm.load("a", adapters["a"])
    lm.load("b", adapters["b"], pinned=True)
    infos = {info.name: info for info in lm.describe()}
    assert set(infos) == {"a", "b"}
    assert infos["b"].pinned and not infos["a"].pinned and infos["a"].rank == 4
    assert infos["a"].path == adapters["a"]
    assert infos["a"].lora_id == lora_id("a", adapters["a"]) != lora_id("b", adapters["b"])
    assert lora_id("a", adapters["a"]) == lora_id("a", adapters["a"])  # deterministic


def test_a_name_is_loaded_once(adapters):
    lm = manager()
    first = lm.load("a", adapters["a"])
    with pytest.raises(LoraLoadError, match="a because it is already loaded"):
        lm.load("a", adapters["b"])
    assert lm.adapters["a"] is first
    with pytest.raises(LoraLoadError, match="lora_name"):
        lm.load("", adapters["b"])


def test_a_refused_adapter_leaves_nothing_behind(adapters, tmp_path):
    lm = manager(max_loaded=1)
    lm.load("a", adapters["a"])
    big = write_adapter(tmp_path / "big", rank=16)
    with pytest.raises(LoraLoadError, match="--max-lora-rank 8"):
        lm.load("big", big)
    wide = write_adapter(tmp_path / "wide", modules=("q_proj", "o_proj"))
    with pytest.raises(LoraLoadError, match="--lora-target-modules"):
        lm.load("wide", wide)
    assert list(lm.adapters) == ["a"]  # the check comes before any eviction


def test_unknown_unload_names_the_loaded_ones(adapters):
    lm = manager()
    lm.load("b", adapters["b"])
    lm.load("a", adapters["a"])
    with pytest.raises(
        LoraLoadError, match=r"LoRA with name x does not exist. Loaded LoRAs: \['a', 'b'\]"
    ):
        lm.unload("x")


# ---- unloading while requests run -------------------------------------------------------


def test_unload_in_use_takes_the_name_now_and_frees_after_the_last_release(adapters):
    lm = manager()
    a = lm.load("a", adapters["a"])
    held = [lm.acquire("a"), lm.acquire("a")]
    lm.unload("a")
    assert "a" not in lm.adapters and a.is_unloaded
    with pytest.raises(KeyError):
        lm.acquire("a")
    assert lm.num_in_use == 2
    assert len(a.weights.layers) == 2  # still serving the two requests
    lm.release(held[0])
    assert len(a.weights.layers) == 2 and lm.num_in_use == 1
    lm.release(held[1])
    assert a.weights.layers == [] and a.weights.nbytes == 0
    assert lm.num_in_use == 0


def test_unload_idle_frees_at_once(adapters):
    lm = manager()
    a = lm.load("a", adapters["a"])
    lm.unload("a")
    assert a.weights.layers == [] and lm.adapters == {} and lm.num_in_use == 0


def test_freeing_an_adapter_empties_the_batches_arguments(adapters):
    """LoraBatch's cache of gathered arguments is keyed by adapters' ids: it is emptied when
    an adapter's weights are freed, so neither a freed tensor nor a reused id outlives it."""
    lm = manager()
    lm.load("a", adapters["a"])
    b = lm.load("b", adapters["b"])
    lm.batch_args[(1, 2)] = {}
    lm.unload("a")
    assert lm.batch_args == {}
    held = lm.acquire("b")
    lm.batch_args[(2,)] = {}
    lm.unload("b")
    assert lm.batch_args == {(2,): {}}  # b still serves a request
    lm.release(held)
    assert lm.batch_args == {} and b.weights.layers == []


def test_every_load_gets_a_fresh_uid(adapters):
    lm = manager()
    first = lm.load("a", adapters["a"])
    lm.unload("a")
    again = lm.load("a", adapters["a"])
    assert again.uid != first.uid
    # the same name while its previous load still drains: a third uid, both counted
    lm.acquire("a")
    lm.unload("a")
    third = lm.load("a", adapters["a"])
    assert len({first.uid, again.uid, third.uid}) == 3
    lm.acquire("a")
    assert lm.num_in_use == 2
    lm.release(again)
    lm.release(third)
    assert lm.num_in_use == 0 and again.weights.layers == []
    assert lm.adapters["a"] is third and len(third.weights.layers) == 2


# ---- --max-loaded-loras -----------------------------------------------------------------


@pytest.mark.parametrize(("policy", "victim"), [("lru", "b"), ("fifo", "a")])
def test_eviction_policy_picks_its_victim(adapters, policy, victim):
    lm = manager(max_loaded=2, policy=policy)
    a = lm.load("a", adapters["a"])
    lm.load("b", adapters["b"])
    lm.release(lm.acquire("a"))  # a: loaded first, used last
    assert a.last_used > lm.adapters["b"].last_used
    lm.load("c", adapters["c"])
    assert set(lm.adapters) == {"a", "b", "c"} - {victim}


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_pinned_and_in_use_adapters_are_never_evicted(adapters, policy):
    lm = manager(max_loaded=3, policy=policy)
    lm.load("a", adapters["a"], pinned=True)  # first loaded, least recently used
    b = lm.acquire(lm.load("b", adapters["b"]).name)  # in use
    lm.load("c", adapters["c"])
    lm.load("d", adapters["d"])  # only c may go
    assert set(lm.adapters) == {"a", "b", "d"}
    lm.release(b)
    assert lm.num_in_use == 0


def test_a_load_with_nothing_evictable_is_refused(adapters, tmp_path):
    lm = manager(max_loaded=2)
    lm.load("a", adapters["a"], pinned=True)
    b = lm.acquire(lm.load("b", adapters["b"]).name)
    with pytest.raises(
        LoraLoadError, match=r"cannot load c: all 2 loaded adapters .*pinned or in use"
    ):
        lm.load("c", adapters["c"])
    assert set(lm.adapters) == {"a", "b"}
    lm.release(b)  # b is idle now: it gives way
    lm.load("c", adapters["c"])
    assert set(lm.adapters) == {"a", "c"} and lm.num_in_use == 0


# ---- adapters given at start ----------------------------------------------------------


def test_limits_default_to_the_adapters_given_at_start(tmp_path):
    small = write_adapter(tmp_path / "small", rank=2, modules=("q_proj",))
    wide = write_adapter(tmp_path / "wide", rank=4, modules=("v_proj", "o_proj"))
    pinned = json.dumps({"lora_name": "w", "lora_path": wide, "pinned": True})
    args = ServerArgs(lora_paths=[f"s={small}", pinned])
    lm = LoraManager(args, CONFIG, torch.float32, "cpu")
    assert set(lm.adapters) == {"s", "w"} and lm.adapters["w"].pinned
    assert lm.max_rank == 4
    assert lm.allowed == ("o_proj", "q_proj", "v_proj")
    with pytest.raises(LoraLoadError, match="--max-lora-rank 4"):
        lm.load("big", write_adapter(tmp_path / "big", rank=8, modules=("q_proj",)))
    assert lm.adapters["s"].uid != lm.adapters["w"].uid

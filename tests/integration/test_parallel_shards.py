"""Each rank loads and keeps only its share of the weights, and a share is exactly the
whole model's rows or columns (GGUF blocks are moved whole, never re-quantized)."""

from __future__ import annotations

import pytest
import torch

from cadence.distributed.layout import ModelShard
from cadence.layers.quantized import QuantizedWeight
from cadence.model_loader.loader import load_model
from cadence.model_loader.locate import default_model_path


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def whole():
    _, model = load_model(default_model_path(), torch.float32, progress=False)
    return model


@pytest.mark.parametrize("tp", [2, 3])
def test_tensor_parallel_ranks_each_keep_about_one_nth(whole, tp):
    full = weight_bytes(whole)
    shares = []
    for rank in range(tp):
        _, model = load_model(
            default_model_path(), torch.float32, progress=False, shard=ModelShard(rank, tp)
        )
        shares.append(weight_bytes(model))
    # Norms are the only tensors every rank holds whole: well under 1% of this model.
    assert sum(shares) == pytest.approx(full, rel=0.01)
    for share in shares:
        assert share / full == pytest.approx(1 / tp, abs=0.07), shares


def test_pipeline_stages_hold_their_layers_and_nothing_twice(whole):
    full = weight_bytes(whole)
    stages = [
        load_model(default_model_path(), torch.float32, progress=False,
                   shard=ModelShard(pp_rank=p, pp_size=2))[1]
        for p in range(2)
    ]  # fmt: skip
    # The first stage also runs the LM head (worth ~8 of the 30 layers here): fewer layers.
    assert [len(s.layers) for s in stages] == [11, 19]
    assert stages[0].layer_ids == range(0, 11) and stages[1].layer_ids == range(11, 30)
    assert stages[1].embed_tokens is None  # the first stage embeds and computes the logits
    assert sum(weight_bytes(s) for s in stages) == pytest.approx(full, rel=0.01)


def test_a_share_is_the_whole_weights_rows_and_columns_exactly(whole):
    _, rank1 = load_model(
        default_model_path(), torch.float32, progress=False, shard=ModelShard(1, 2)
    )
    d = rank1.dims
    # down_proj, row-parallel: rank 1's columns of the whole matrix; gate|up, column-parallel:
    # its rows.
    down_whole = whole.layers[0].down_proj.dequantize()
    down_share = rank1.layers[0].down_proj.dequantize()
    cols, inter = d.intermediate_range, whole.config.intermediate_size
    assert torch.equal(down_share, down_whole[:, cols.start : cols.stop])
    gate_up = whole.layers[0].gate_up_proj.dequantize()
    mine = torch.cat(
        [gate_up[cols.start : cols.stop], gate_up[inter + cols.start : inter + cols.stop]]
    )
    assert torch.equal(rank1.layers[0].gate_up_proj.dequantize(), mine)
    # The embedding table, split by rows: rank 1 holds the second half.
    vocab = d.vocab_range
    some = torch.tensor([0, 1, len(vocab) - 1])
    assert isinstance(rank1.embed_tokens, QuantizedWeight)
    assert torch.equal(
        rank1.embed_tokens.embedding(some, torch.float32),
        whole.embed_tokens.embedding(some + vocab.start, torch.float32),
    )


def test_a_column_cut_through_a_block_is_refused():
    blocks = torch.zeros(2, 2 * 20, dtype=torch.uint8)  # two Q4_1 blocks (32 columns) per row
    weight = QuantizedWeight(["Q4_1"], [blocks], 64)
    assert weight.columns_slice(32, 64).in_features == 32
    with pytest.raises(ValueError, match="cut its 32-column blocks"):
        weight.columns_slice(16, 64)


def test_the_gguf_loader_copies_out_only_a_ranks_blocks():
    from cadence.model_loader import gguf_loader
    from cadence.models.llama import LlamaForCausalLM

    path = default_model_path()
    reader = gguf_loader._reader(path)
    config = gguf_loader.read_config(path, reader)
    with torch.device("meta"):
        rank1 = LlamaForCausalLM(config, ModelShard(1, 2))
    shapes = {
        name: tuple(weight.shape)
        for name, weight in gguf_loader.iter_weights(
            path, config, reader, progress=False, keep_quantized=True,
            wanted=rank1.wants_weight, shard_of=rank1.shard_of,
        )
        if name.startswith(("model.layers.0.", "model.embed_tokens"))
    }  # fmt: skip
    d = rank1.dims
    hidden, inter = config.hidden_size, config.intermediate_size
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (d.q_dim, hidden)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (d.kv_dim, hidden)
    assert shapes["model.layers.0.mlp.up_proj.weight"] == (d.intermediate, hidden)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (hidden, d.intermediate)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (hidden, d.q_dim)
    assert shapes["model.embed_tokens.weight"] == (len(d.vocab_range), hidden)
    assert d.intermediate < inter and d.q_dim < config.q_dim

"""Which slice of the model each rank holds, and the parallel flags' checks."""

from __future__ import annotations

import pytest

from cadence.distributed.layout import ModelShard, RankLayout, split_evenly, stage_layer_counts
from cadence.server_args import ServerArgs


def test_split_evenly_covers_everything_once_in_whole_units():
    for total, parts, unit in [(9, 2, 1), (1536, 2, 256), (1536, 4, 32), (30, 4, 1), (3, 3, 1)]:
        pieces = [split_evenly(total, parts, i, unit) for i in range(parts)]
        assert pieces[0][0] == 0 and pieces[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert all(start % unit == 0 and end % unit == 0 for start, end in pieces)
        sizes = [end - start for start, end in pieces]
        assert max(sizes) - min(sizes) <= unit


def test_ranks_are_numbered_tensor_parallel_first():
    layout = RankLayout(tp_size=2, pp_size=2, nnodes=2)
    assert [(layout.pp_rank(r), layout.tp_rank(r)) for r in range(4)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert list(layout.node_ranks(0)) == [0, 1] and list(layout.node_ranks(1)) == [2, 3]
    assert layout.tp_group(1) == [2, 3]


def test_heads_follow_their_key_value_group_even_when_uneven():
    # SmolLM2-135M: 9 query heads in 3 groups over 2 ranks -> 2 groups and 1 group.
    shards = [ModelShard(tp_rank=r, tp_size=2) for r in range(2)]
    assert [s.kv_heads(3) for s in shards] == [range(0, 2), range(2, 3)]
    assert [s.q_heads(9, 3) for s in shards] == [range(0, 6), range(6, 9)]


def test_mlp_columns_fall_on_whole_quantized_blocks():
    for tp in (2, 4):
        for r in range(tp):
            cols = ModelShard(tp_rank=r, tp_size=tp).intermediate(1536)
            assert cols.start % 32 == 0 and cols.stop % 32 == 0


def test_vocabulary_shares_are_equal_with_padding_at_the_end():
    shards = [ModelShard(tp_rank=r, tp_size=4) for r in range(4)]
    assert [s.vocab(10) for s in shards] == [range(0, 3), range(3, 6), range(6, 9), range(9, 10)]
    assert all(s.vocab_rows(10) == 3 for s in shards)


def test_stages_take_contiguous_layers():
    stages = [ModelShard(pp_rank=p, pp_size=4) for p in range(4)]
    assert [s.layers(30) for s in stages] == [
        range(0, 8),
        range(8, 16),
        range(16, 23),
        range(23, 30),
    ]
    assert stages[0].is_first_stage and stages[-1].is_last_stage


def test_the_first_stage_takes_fewer_layers_for_its_lm_head():
    assert stage_layer_counts(30, 2, 8.0) == [11, 19]
    assert stage_layer_counts(30, 4, 8.0) == [2, 10, 9, 9]
    assert stage_layer_counts(2, 2, 100.0) == [1, 1]  # never an empty stage
    assert ModelShard(pp_rank=1, pp_size=2).layers(30, 8.0) == range(11, 30)


def test_a_given_partition_is_followed_or_refused():
    assert ModelShard(pp_rank=1, pp_size=2).layers(30, 8.0, [12, 18]) == range(12, 30)
    with pytest.raises(ValueError, match="SGLANG_PP_LAYER_PARTITION"):
        ModelShard(pp_rank=0, pp_size=2).layers(30, 0.0, [30, 0])


def test_more_ranks_than_the_model_has_heads_or_layers_is_a_clear_error():
    with pytest.raises(ValueError, match="tp_size .4. exceeds the model's 3 key-value heads"):
        ModelShard(tp_rank=0, tp_size=4).kv_heads(3)
    with pytest.raises(ValueError, match="pp_size .3. exceeds the model's 2 layers"):
        ModelShard(pp_rank=0, pp_size=3).layers(2)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"tp_size": 0}, "tp_size must be ≥ 1"),
        ({"nnodes": 2, "tp_size": 2}, "dist_init_addr: --nnodes > 1 needs"),
        ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank must be in"),
        ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "nnodes .2. must divide"),
        ({"dist_init_addr": "nohost"}, "dist_init_addr must be host:port"),
        ({"dist_init_addr": "h:99999"}, "dist_init_addr must be host:port"),
        ({"dist_timeout": 0}, "dist_timeout must be > 0"),
        (
            {
                "tp_size": 2,
                "enable_lora": True,
                "max_lora_rank": 8,
                "lora_target_modules": ["q_proj"],
            },
            "enable_lora is not served with",
        ),  # fmt: skip
    ],
)
def test_bad_parallel_flags_name_the_field(flags, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**flags)


def test_parallel_flags_read_flat_with_derived_sizes():
    args = ServerArgs(tp_size=2, pp_size=2, nnodes=2, node_rank=1, dist_init_addr="[::1]:5000")
    assert args.world_size == 4 and args.is_parallel
    assert not ServerArgs().is_parallel

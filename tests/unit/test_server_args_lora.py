"""The LoRA flags (SGLang's): --lora-paths in its three forms through the real CLI parser,
what --enable-lora needs without them, the target-module names, the eviction policy, and
the limits checked against each other."""

from __future__ import annotations

import argparse
import json
import pickle

import pytest

from cadence.server_args import LORA_TARGET_MODULES, ServerArgs, add_cli_args, from_cli_args


def parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return from_cli_args(parser.parse_args(["--model-path", "m.gguf", *argv]))


PINNED = json.dumps({"lora_name": "c", "lora_path": "/ad/c", "pinned": True})


def test_lora_is_off_by_default():
    args = parse()
    assert not args.enable_lora and args.lora_paths is None and args.lora_entries == []
    assert args.max_loras_per_batch == 8 and args.lora_eviction_policy == "lru"


def test_the_three_lora_paths_forms_on_the_command_line():
    args = parse("--lora-paths", "a=/ad/a", "/ad/b", PINNED)
    assert args.enable_lora
    assert args.lora_entries == [
        ("a", "/ad/a", False),
        ("/ad/b", "/ad/b", False),
        ("c", "/ad/c", True),
    ]
    # canonical: NAME=PATH, the JSON object kept where it says more (pinned)
    assert args.lora_paths[:2] == ("a=/ad/a", "/ad/b=/ad/b")
    assert json.loads(args.lora_paths[2]) == {
        "lora_name": "c",
        "lora_path": "/ad/c",
        "pinned": True,
    }
    again = pickle.loads(pickle.dumps(args))
    assert again == args and again.lora_entries == args.lora_entries


def test_lora_paths_as_python_values():
    one = ServerArgs(lora_paths="a=/ad/a")
    assert one.lora_entries == [("a", "/ad/a", False)]
    obj = ServerArgs(lora_paths=[{"lora_name": "b", "lora_path": "/ad/b"}])
    assert obj.lora_entries == [("b", "/ad/b", False)] and obj.enable_lora
    assert ServerArgs(lora_paths=obj.lora_paths) == obj  # the canonical form reads back


def test_a_json_entry_with_an_unpinned_adapter_reads_back_the_same():
    entry = json.dumps({"lora_name": "d", "lora_path": "/ad/d", "pinned": False})
    assert ServerArgs(lora_paths=[entry]).lora_entries == [("d", "/ad/d", False)]


def test_the_flags_that_set_limits():
    args = parse(
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj",
        "--max-loaded-loras", "3", "--max-loras-per-batch", "2", "--lora-eviction-policy", "fifo",
    )  # fmt: skip
    assert args.enable_lora and args.max_lora_rank == 16
    assert args.lora_target_modules == ("q_proj", "v_proj")
    assert (args.max_loaded_loras, args.max_loras_per_batch) == (3, 2)
    assert args.lora_eviction_policy == "fifo"
    assert args.lora == args.replace(port=31000).lora


@pytest.mark.parametrize(
    "paths",
    [["a=/ad/1", "a=/ad/2"], ["/ad/b", "/ad/b"], ["c=/ad/x", PINNED], ["/x=/ad/1", "/x"]],
)
def test_a_name_given_twice_is_refused(paths):
    with pytest.raises(ValueError, match="given twice"):
        ServerArgs(lora_paths=paths)


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ('{"lora_name": "a",}', "not valid JSON"),
        ('{"lora_name": "a"}', "needs lora_name and lora_path"),
        ("", "NAME=PATH, PATH or a JSON object"),
        (3, "NAME=PATH, PATH or a JSON object"),
    ],
)
def test_bad_lora_paths_entries_name_the_flag(entry, needle):
    with pytest.raises(ValueError, match="lora_paths") as err:
        ServerArgs(lora_paths=[entry])
    assert needle in str(err.value)


def test_an_empty_lora_paths_flag_enables_nothing():
    args = parse("--lora-paths")
    assert args.lora_paths == () and not args.enable_lora


def test_enable_lora_without_paths_needs_the_limits_adapters_must_fit():
    for argv in ([], ["--max-lora-rank", "8"], ["--lora-target-modules", "all"]):
        with pytest.raises(ValueError, match="--max-lora-rank and --lora-target-modules"):
            parse("--enable-lora", *argv)
    args = parse("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all")
    assert args.enable_lora and args.lora_entries == []


def test_with_paths_the_limits_may_be_left_to_the_adapters():
    args = ServerArgs(lora_paths=["a=/ad/a"])
    assert args.max_lora_rank is None and args.lora_target_modules is None


def test_all_means_every_module_and_stands_alone():
    assert (
        ServerArgs(
            enable_lora=True, max_lora_rank=8, lora_target_modules=["all"]
        ).lora_target_modules
        == LORA_TARGET_MODULES
    )
    assert ServerArgs(lora_target_modules="all").lora_target_modules == LORA_TARGET_MODULES
    with pytest.raises(ValueError, match="'all' must be given alone"):
        ServerArgs(lora_target_modules=["all", "q_proj"])


def test_fused_names_expand_to_their_parts_once():
    args = ServerArgs(lora_target_modules=["qkv_proj", "q_proj", "gate_up_proj", "down_proj"])
    assert args.lora_target_modules == (
        "q_proj",
        "k_proj",
        "v_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


@pytest.mark.parametrize("name", ["lm_head", "embed_tokens", "qkv"])
def test_a_module_we_cannot_serve_is_named(name):
    with pytest.raises(ValueError, match=f"lora_target_modules: '{name}' cannot be served"):
        ServerArgs(lora_target_modules=["q_proj", name])


def test_eviction_policy_choices():
    assert parse("--lora-eviction-policy", "lru").lora_eviction_policy == "lru"
    with pytest.raises(SystemExit):
        parse("--lora-eviction-policy", "random")
    with pytest.raises(ValueError, match="lora_eviction_policy must be lru or fifo, got 'lfu'"):
        ServerArgs(lora_eviction_policy="lfu")


def test_max_loaded_loras_below_the_number_of_paths_is_refused():
    paths = ["a=/ad/a", "b=/ad/b", "c=/ad/c"]
    with pytest.raises(ValueError, match=r"max_loaded_loras \(2\) .*lora_paths \(3\)"):
        ServerArgs(lora_paths=paths, max_loaded_loras=2)
    assert ServerArgs(lora_paths=paths, max_loaded_loras=3).max_loaded_loras == 3
    with pytest.raises(ValueError, match="max_loaded_loras"):
        ServerArgs(enable_lora=True, max_lora_rank=8, lora_target_modules="all", max_loaded_loras=0)


@pytest.mark.parametrize(
    ("flags", "field"),
    [({"max_loras_per_batch": 0}, "max_loras_per_batch"), ({"max_lora_rank": 0}, "max_lora_rank")],
)
def test_limits_below_one_are_refused(flags, field):
    with pytest.raises(ValueError, match=field):
        ServerArgs(lora_paths=["a=/ad/a"], **flags)


def test_a_json_name_with_an_equals_sign_reads_back_unchanged():
    entry = json.dumps({"lora_name": "style=formal", "lora_path": "/ad/f"})
    assert ServerArgs(lora_paths=[entry]).lora_entries == [("style=formal", "/ad/f", False)]

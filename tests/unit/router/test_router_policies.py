"""Routing policies and the cache_aware prefix tree."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from cadence.router.config import RouterConfig
from cadence.router.policies import (
    CacheAwarePolicy,
    LeastRequestPolicy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    make_policy,
)
from cadence.router.radix_tree import PrefixTree, common_prefix_len
from cadence.router.request_meta import RouteMeta
from cadence.router.workers import Worker

NO_META = RouteMeta()


def workers(*loads: int) -> list[Worker]:
    return [Worker(url=f"http://w{i}", id=f"w{i}", model=None, capabilities=None, active=load)
            for i, load in enumerate(loads)]  # fmt: skip


def test_make_policy_builds_each_named_policy():
    for name in ("round_robin", "least_request", "random", "power_of_two", "cache_aware"):
        policy = make_policy(RouterConfig(policy=name))
        assert isinstance(policy, RoutingPolicy) and policy.name == name


def test_round_robin_cycles_in_order():
    ws = workers(0, 5, 0)
    policy = RoundRobinPolicy()
    assert [policy.select(ws, NO_META).id for _ in range(6)] == ["w0", "w1", "w2"] * 2


def test_least_request_picks_fewest_and_rotates_ties():
    policy = LeastRequestPolicy()
    assert {policy.select(workers(3, 1, 2), NO_META).id for _ in range(5)} == {"w1"}
    ties = workers(1, 0, 0)
    assert [policy.select(ties, NO_META).id for _ in range(4)].count("w0") == 0
    assert set(policy.select(ties, NO_META).id for _ in range(4)) == {"w1", "w2"}


def test_random_covers_all_candidates_and_only_them():
    ws = workers(0, 0, 0)
    policy = RandomPolicy(random.Random(7))
    picks = Counter(policy.select(ws, NO_META).id for _ in range(300))
    assert set(picks) == {"w0", "w1", "w2"} and min(picks.values()) > 50


def test_power_of_two_never_picks_the_busiest_of_three():
    ws = workers(9, 0, 1)
    policy = PowerOfTwoPolicy(random.Random(3))
    picks = Counter(policy.select(ws, NO_META).id for _ in range(300))
    assert "w0" not in picks  # any pair including w0 has a less busy member
    assert picks["w1"] > picks["w2"]  # w1 wins every pair it is in
    assert policy.select(ws[:1], NO_META).id == "w0"


def cache_policy(**overrides) -> CacheAwarePolicy:
    return CacheAwarePolicy(RouterConfig(policy="cache_aware", **overrides))


def test_cache_aware_sends_a_shared_prefix_back_to_the_same_worker():
    policy = cache_policy(cache_threshold=0.5)
    ws = workers(0, 0)
    prefix = "You are a helpful assistant. " * 20
    first = policy.select(ws, RouteMeta(prefix_text=prefix + "question one"))
    for i in range(5):
        assert policy.select(ws, RouteMeta(prefix_text=prefix + f"question {i}")) is first
    first.active = 1
    other = policy.select(ws, RouteMeta(prefix_text="completely different text " * 5))
    assert other is not first  # no match: the least loaded


def test_cache_aware_below_threshold_goes_least_loaded():
    policy = cache_policy(cache_threshold=0.9)
    ws = workers(0, 0)
    chosen = policy.select(ws, RouteMeta(prefix_text="abcdefghij"))
    chosen.active = 1
    other = policy.select(ws, RouteMeta(prefix_text="abcdeXXXXX"))  # 50% match < 90%
    assert other is not chosen


def test_cache_aware_falls_back_to_least_loaded_when_imbalanced():
    policy = cache_policy(balance_abs_threshold=4, balance_rel_threshold=2.0)
    ws = workers(0, 0)
    text = "shared prefix " * 10
    owner = policy.select(ws, RouteMeta(prefix_text=text))
    owner.active = 4  # difference 4: not beyond the absolute threshold
    assert policy.select(ws, RouteMeta(prefix_text=text)) is owner
    owner.active = 10  # 10 - 0 > 4 and 10 > 2 x 0: imbalanced
    assert policy.select(ws, RouteMeta(prefix_text=text)) is not owner


def test_cache_aware_forgets_a_removed_worker():
    policy = cache_policy()
    ws = workers(0, 0)
    text = "x" * 100
    owner = policy.select(ws, RouteMeta(prefix_text=text))
    policy.remove_worker(owner.id)
    assert policy.tree.match(text, [owner.id]) == (0, set())
    assert policy.tree.num_chars == 0


@pytest.mark.parametrize(("a", "b", "n"), [("", "x", 0), ("abc", "abd", 2), ("abc", "abc", 3),
                                           ("abc", "abcdef", 3), ("x" * 999 + "a", "x" * 999 + "b", 999)])  # fmt: skip
def test_common_prefix_len(a, b, n):
    assert common_prefix_len(a, b) == n == common_prefix_len(b, a)


def test_prefix_tree_splits_edges_and_tracks_tenants():
    tree = PrefixTree(max_chars=10_000)
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    assert tree.num_chars == len("hello world") + len("there")
    assert tree.match("hello world!", ["a", "b"]) == (11, {"a"})
    assert tree.match("hello wxyz", ["a", "b"]) == (7, {"a"})
    assert tree.match("hello zzz", ["a", "b"]) == (6, {"a", "b"})
    assert tree.match("hello there", ["a"]) == (6, {"a"})  # b's branch is not a's
    assert tree.match("goodbye", ["a", "b"]) == (0, set())


def test_prefix_tree_evicts_least_recently_used_under_the_bound():
    tree = PrefixTree(max_chars=100)
    tree.insert("A" * 40, "w")
    tree.insert("B" * 40, "w")
    tree.insert("A" * 40, "w")  # touch A: B is now the least recently used
    tree.insert("C" * 40, "w")  # 120 > 100: evict down to 90
    assert tree.num_chars <= 100
    assert tree.match("A" * 40, ["w"])[0] == 40
    assert tree.match("C" * 40, ["w"])[0] == 40
    assert tree.match("B" * 40, ["w"])[0] == 0


def test_prefix_tree_stays_bounded_under_many_inserts():
    tree = PrefixTree(max_chars=5_000)
    rng = random.Random(0)
    for i in range(2_000):
        tree.insert("".join(rng.choice("abcd") for _ in range(60)), f"w{i % 3}")
    assert 0 < tree.num_chars <= 5_000

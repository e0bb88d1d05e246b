"""An approximate radix tree of recent prompt prefixes, shared by all workers.

Each node is an edge label (a run of characters) plus the set of workers ("tenants")
that were sent a prompt passing through it. Because an insert touches every node on
its path, a node's tenants always include its children's tenants and its last access
time is never older than theirs; eviction relies on both.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection


class _Node:
    __slots__ = ("key", "parent", "children", "tenants", "last_access")

    def __init__(self, key: str, parent: _Node | None, tick: int) -> None:
        self.key = key  # edge label from the parent; "" only for the root
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character of child.key -> child
        self.tenants: set[str] = set()
        self.last_access = tick


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, by binary search over C-level slice compares."""
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixTree:
    """Prefix tree with per-node tenants and LRU eviction under a character budget."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.num_chars = 0  # sum of all edge label lengths
        self._ticks = itertools.count(1)
        self._root = _Node("", None, 0)

    def insert(self, text: str, tenant: str) -> None:
        """Record that `text` was sent to `tenant`."""
        tick = next(self._ticks)
        node, pos = self._root, 0
        node.tenants.add(tenant)
        node.last_access = tick
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                child = _Node(text[pos:], node, tick)
                node.children[text[pos]] = child
                self.num_chars += len(child.key)
            else:
                common = common_prefix_len(child.key, text[pos:])
                if common < len(child.key):
                    child = self._split(child, common)
            child.tenants.add(tenant)
            child.last_access = tick
            pos += len(child.key)
            node = child
        if self.num_chars > self.max_chars:
            self.evict(int(self.max_chars * 0.9))

    def match(self, text: str, tenants: Collection[str]) -> tuple[int, set[str]]:
        """Longest prefix of `text` seen by any of `tenants`: (its length, who saw it)."""
        best_len = 0
        best: set[str] = set()
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            owners = child.tenants.intersection(tenants)
            if not owners:
                break
            common = common_prefix_len(child.key, text[pos:])
            best_len, best = pos + common, owners
            if common < len(child.key):
                break
            pos += common
            node = child
        return best_len, best

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything sent to `tenant` (the worker was removed)."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            node.tenants.discard(tenant)
            for key, child in list(node.children.items()):
                if tenant not in child.tenants:
                    continue  # nor in any node below it
                if len(child.tenants) == 1:
                    del node.children[key]  # only this tenant below: drop the subtree
                    self.num_chars -= _subtree_chars(child)
                else:
                    stack.append(child)

    def evict(self, target_chars: int) -> None:
        """Drop least recently used leaves until at most `target_chars` remain."""
        heap = [(n.last_access, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        while heap and self.num_chars > target_chars:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None:
                continue
            del parent.children[leaf.key[0]]
            self.num_chars -= len(leaf.key)
            if not parent.children and parent is not self._root:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut child's edge after `at` characters; return the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.key[:at], parent, child.last_access)
        upper.tenants = set(child.tenants)
        parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                leaves.append(node)
        return leaves


def _subtree_chars(node: _Node) -> int:
    total, stack = 0, [node]
    while stack:
        current = stack.pop()
        total += len(current.key)
        stack.extend(current.children.values())
    return total

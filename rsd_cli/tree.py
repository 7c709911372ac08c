"""The draft tree: tokens, parents, depths, draw order, and the attention pattern over it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """Node 0 is the root: the last emitted token, which no cache holds yet.

    ``draws[i]`` lists node i's children in the order they were drawn; with i.i.d. drafts
    (mss, spectr) a child appears once per draw of its token, and duplicate draws share one
    node (a token already rejected at a node is never accepted there later, so a second
    subtree under it could never be reached).
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    draws: list[list[int]]
    q: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> (V,) draft distribution

    @classmethod
    def rooted_at(cls, token: int) -> "DraftTree":
        return cls([token], [-1], [0], [[]])

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, node: int, token: int) -> int | None:
        for c in self.draws[node]:
            if self.tokens[c] == token:
                return c
        return None

    def add_draw(self, node: int, token: int) -> tuple[int, bool]:
        """Record that `token` was drawn under `node`; returns (child id, whether it is new)."""
        existing = self.child(node, token)
        if existing is not None:
            self.draws[node].append(existing)
            return existing, False
        self.tokens.append(token)
        self.parents.append(node)
        self.depths.append(self.depths[node] + 1)
        self.draws.append([])
        child = len(self.tokens) - 1
        self.draws[node].append(child)
        return child, True

    def path_to(self, node: int) -> list[int]:
        """Node ids from the root to `node`, both included."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def children(self, node: int) -> list[int]:
        return list(dict.fromkeys(self.draws[node]))

    def ancestry(self, nodes: list[int] | None = None) -> torch.Tensor:
        """(len(nodes), len(self)) bool: which tree nodes each node attends to (itself included)."""
        nodes = range(len(self)) if nodes is None else nodes
        seen = torch.zeros(len(nodes), len(self), dtype=torch.bool)
        for row, node in enumerate(nodes):
            seen[row, self.path_to(node)] = True
        return seen

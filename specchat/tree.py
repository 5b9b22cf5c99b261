"""Draft trees and the rule that verifies them, as pure functions (no I/O, no models).

A tree is several drafts that share prefixes, verified in one target batch: node i holds a token, its
parent (-1: the root, the context's last token) and `q[i]`, the distribution it was drawn from given its
earlier siblings (None: chosen without randomness, as lookup's continuations and a draft's top candidates
are). A chain is a tree with one branch. The target's rows are p[0] at the root and p[i + 1] after node i,
each conditioned on the node's own path (penalties too: `path_history`).

The walk (`verify_tree`) draws from the target the way sampling.verify does for a chain, and tries a node's
children in order with the rule for one proposal:
    accept child c with probability min(1, r(c) / q_c(c)); else r <- normalize(max(0, r - q_c))
where r starts as the target's p at the node. After the last child is rejected, the next token is drawn
from what is left of r; if a child is accepted the walk goes on from it.
- Candidates chosen without the target's randomness (q_c = one-hot): accept with r(c), remove c from r.
  Exact for any choice of candidates (EAGLE's reference rule; SGLang's tree verification): it is sampling
  from p and following the child that matches.
- Children drawn independently from one q (SpecInfer's recursive rejection sampling): q_c = q for each.
- Children drawn from q without replacement (Jeon et al. 2024; Sequoia): q_c = q with the earlier
  siblings removed, renormalised (`without`). Exact because a rejected c has no mass left in r.
Both are exact whatever the tree's shape, because each child's test is the one-proposal rule against the
current residual, which is the distribution the output still owes. Greedy: follow the child equal to the
target's argmax (`verify_tree_greedy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .sampling import Dist, one_hot, residual, sample

ROOT = -1


@dataclass
class DraftTree:
    """Nodes in an order where each parent comes before its children (parents[i] < i)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: a child of the root
    # q[i]: the distribution node i was drawn from, given its earlier siblings; None = chosen without
    # randomness (one-hot)
    q: list[Dist | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.q:
            self.q = [None] * len(self.tokens)
        if not (len(self.tokens) == len(self.parents) == len(self.q)):
            raise ValueError("a tree needs one parent and one q per token")
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise ValueError(f"node {i}'s parent {parent} must be -1 or an earlier node")
        self._children: dict[int, list[int]] | None = None

    @classmethod
    def chain(cls, tokens: Sequence[int], q: Sequence[Dist | None] | None = None) -> DraftTree:
        tokens = list(tokens)
        return cls(tokens, list(range(-1, len(tokens) - 1)), list(q) if q is not None else [None] * len(tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """The children of `node` (ROOT for the root's), in the order the walk tries them."""
        if self._children is None:
            kids: dict[int, list[int]] = {}
            for i, parent in enumerate(self.parents):
                kids.setdefault(parent, []).append(i)
            self._children = kids
        return self._children.get(node, [])

    def add(self, token: int, parent: int = ROOT, q: Dist | None = None) -> int:
        """Append a node; returns its index."""
        if not ROOT <= parent < len(self.tokens):
            raise ValueError(f"no node {parent} to hang a child on")
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.q.append(q)
        self._children = None
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (empty for the root)."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    def depths(self) -> list[int]:
        """depths()[i]: node i's depth (1 for the root's children)."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent == ROOT else out[parent] + 1)
        return out

    def depth(self) -> int:
        return max(self.depths(), default=0)

    def leaves(self) -> list[int]:
        has_child = set(self.parents)
        return [i for i in range(len(self.tokens)) if i not in has_child]

    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def leaf_sets(self) -> list[list[int]]:
        """For each node, the indices (into leaves()) of every leaf at or below it: the sequences a node
        belongs to when the tree is decoded as one batch."""
        leaves = self.leaves()
        out: list[list[int]] = [[] for _ in self.tokens]
        for s, leaf in enumerate(leaves):
            for node in self.path(leaf):
                out[node].append(s)
        return out


def without(q: Dist | np.ndarray, drawn: Sequence[int]) -> Dist:
    """q with the tokens already drawn removed, renormalised: the distribution of the next draw without
    replacement."""
    q = Dist.of(q)
    removed = set(int(t) for t in drawn)
    ids, probs = q.lists()
    kept = [(t, x) for t, x in zip(ids, probs) if t not in removed and x > 0]
    total = sum(x for _, x in kept)
    if total <= 0:
        raise ValueError("nothing left to draw without replacement")
    return Dist.of_lists([t for t, _ in kept], [x / total for _, x in kept], q.n_vocab)


def verify_tree(p, tree: DraftTree, rng) -> tuple[list[int], int]:
    """The walk. p[0] is the target's processed distribution at the root, p[i + 1] after node i (rows may
    be made lazily: only those on the walk are read). Returns (the accepted nodes, root to deepest, and
    the next token: the residual's draw where the walk stopped, or the bonus after a leaf)."""
    node, path = ROOT, []
    while True:
        r = Dist.of(p[node + 1])
        for child in tree.children(node):
            token, q_c = tree.tokens[child], tree.q[child]
            q_d = 1.0 if q_c is None else Dist.of(q_c).prob(token)
            # u < r/q accepts with probability min(1, r/q); q_d > 0 because the child was drawn from q_c
            if rng.random() * q_d < r.prob(token):
                path.append(child)
                node = child
                break
            r = residual(r, one_hot(token, r.n_vocab) if q_c is None else q_c)
        else:
            return path, sample(r, rng)


def verify_tree_greedy(argmax, tree: DraftTree) -> tuple[list[int], int]:
    """Temperature 0: follow the child equal to the target's argmax at each node; the next token is the
    argmax where no child matches."""
    node, path = ROOT, []
    while True:
        best = argmax[node + 1]
        for child in tree.children(node):
            if tree.tokens[child] == best:
                path.append(child)
                node = child
                break
        else:
            return path, best


def ends_at_leaf(tree: DraftTree, path: Sequence[int]) -> bool:
    """Whether the walk's next token is a bonus (its last node has no children) or a correction."""
    return not tree.children(path[-1] if path else ROOT)


def path_history(recent: Sequence[int], tree: DraftTree):
    """history(i): what the penalties of row i read: the context's window plus the tokens on the path to
    node i - 1 (row 0 is the root's)."""
    recent = list(recent)
    return lambda i: recent + tree.path_tokens(i - 1) if i > 0 else recent

"""Draft trees from drafters: a draft that carries a tree (`TreeDraft`), trees from prompt lookup
(SuffixDecoding-style: the several continuations that followed the context's tail before, scored by how
often) and from a draft model (its runners-up beside its chain, by cumulative probability), and
`TreePolicy`, which widens the draft its inner policy picked into a tree of at most N nodes where that
pays against the chain.

The engine verifies `TreeDraft.tree` in one batch where the target can (engine.tree_to_verify); everything
else (the policy, the drafter's `learn`, the statistics of a chain) reads `tokens`, the tree's main branch.
"""

from __future__ import annotations

import dataclasses
import heapq
from contextlib import ExitStack
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .drafters import Draft, DraftModel, members
from .errors import UserError
from .lookup import CANDIDATES, ORDER, PromptLookup
from .sampling import SamplingParams
from .tree import ROOT, DraftTree


@dataclass
class TreeDraft(Draft):
    tree: DraftTree | None = None  # the tree to verify; `tokens` is its main branch (first children)


def best_first(branches: Sequence[tuple[float, Sequence[int]]], nodes: int, depth: int) -> DraftTree:
    """A tree of at most `nodes` nodes and `depth` levels from weighted token sequences: their trie, each
    trie node scored by the product of count(child) / count(parent) along its path (the empirical chance
    that its whole path is right, SuffixDecoding's score), best first. Each node's children come best
    first, and the nodes are numbered depth-first, so the best branch is nodes 0, 1, 2, ..."""
    trie: list[dict] = [{"children": {}, "count": 0.0}]  # 0: the root
    for weight, tokens in branches:
        node = 0
        trie[0]["count"] += weight
        for token in list(tokens)[:depth]:
            kids = trie[node]["children"]
            if token not in kids:
                kids[token] = len(trie)
                trie.append({"children": {}, "count": 0.0})
            node = kids[token]
            trie[node]["count"] += weight
    tree = DraftTree()
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, order, trie node, token, tree parent)
    order = 0

    def push(trie_node: int, score: float, parent: int) -> None:
        nonlocal order
        total = trie[trie_node]["count"]
        for token, child in trie[trie_node]["children"].items():
            heapq.heappush(heap, (-score * trie[child]["count"] / total, order, child, token, parent))
            order += 1

    push(0, 1.0, ROOT)
    while heap and len(tree) < nodes:
        neg, _, child, token, parent = heapq.heappop(heap)
        push(child, -neg, tree.add(token, parent))
    return _children_in_order(tree)


def _children_in_order(tree: DraftTree) -> DraftTree:
    """The same tree with nodes renumbered depth-first (each node's first child right after it), so that
    the first branch is nodes 0, 1, 2, ...: the main branch."""
    out = DraftTree()

    def visit(node: int, parent: int) -> None:
        for child in sorted(tree.children(node)):
            visit(child, out.add(tree.tokens[child], parent, tree.q[child]))

    visit(ROOT, ROOT)
    return out


def main_branch(tree: DraftTree) -> list[int]:
    """The first child at each level, root to leaf: the chain the tree widens."""
    out, node = [], ROOT
    while kids := tree.children(node):
        node = kids[0]
        out.append(node)
    return out


def lookup_tree(lookup: PromptLookup, context: Sequence[int], draft: Draft, nodes: int) -> Draft:
    """Widen lookup's chain `draft` (proposed for `context`) into a tree of at most `nodes` nodes, no
    deeper than the chain: the chain first (it weighs as much as all the other continuations together),
    then the continuations of the tail's other earlier occurrences, best first."""
    if not draft.tokens or nodes <= len(draft.tokens):
        return draft
    depth = len(draft.tokens)
    others = lookup_continuations_indexed(lookup, depth)
    weight = 1e6 * (sum(w for w, _ in others) + 1.0)
    tree = best_first([(weight, draft.tokens), *others], nodes, depth)
    if tree.is_chain():
        return draft
    chain = [tree.tokens[i] for i in main_branch(tree)]
    assert chain == list(draft.tokens), (chain, draft.tokens)
    return TreeDraft(list(draft.tokens), list(draft.q), draft.source, draft.evidence, draft.drafter, draft.planned,
                     tree=tree)


def lookup_continuations_indexed(lookup: PromptLookup, depth: int) -> list[tuple[float, list[int]]]:
    """(weight, continuation) for the earlier occurrences of the context's tail in the lookup's n-gram
    index (which follows the context): what followed each, up to `depth` tokens and never past the end
    of the context, weighted by the length of its match with the tail, so a continuation after a long
    match counts more than one after a common token. The longest indexed n-gram's occurrences first,
    then shorter ones' until CANDIDATES occurrences were found."""
    index = lookup.index
    ids = index.ids
    end = len(ids) - 1
    if end < 1:
        return []
    out: list[tuple[float, list[int]]] = []
    seen: set[int] = set()
    for order in range(min(ORDER, end, lookup.max_ngram), 0, -1):
        gram = [int(t) for t in ids[end - order + 1 : end + 1]]
        for p in index.latest(gram):
            if p >= end or p in seen:
                continue
            seen.add(p)
            follow = ids[p + 1 : min(p + 1 + depth, end + 1)]
            if not follow:
                continue
            length = order
            while length < min(lookup.max_ngram, p + 1) and ids[p - length] == ids[end - length]:
                length += 1
            out.append((float(length), follow))
            if len(seen) >= CANDIDATES:
                return out
    return out


# TreePolicy's pricing. Before any tree is verified, a tree is expected to add this many tokens per step
# over its chain: enough to try one, after which the measured gain decides. (Not measured: a starting point.)
GAIN_PRIOR = 0.5
GAIN_DECAY = 0.9  # per observed tree step: the gain estimate follows the last ten or so
PROBE_EVERY = 16  # a tree declined this many steps in a row is sent once, so the estimate can recover ...
PROBE_MAX = 256  # ... and twice as many after a probe that gained nothing, up to this


class TreePolicy:
    """Another policy's draft, widened into a tree of at most `nodes` nodes where its drafter can branch
    (prompt lookup: other continuations; a draft model: its runners-up): `--draft-tree N`.

    With a fixed inner policy (`--draft-fixed K --draft-tree N`) the tree goes every step, for experiments.
    With a priced one (the adaptive policy, which has the target's verify costs) the tree goes only where
    it pays against its own chain: (tau + gain) / cost(nodes + 1) > tau / cost(k + 1), with tau the tokens
    a step of the chain keeps and gain the extra tokens a tree step kept over what its chain would have
    (both measured: the common prefix of the kept path and the chain is what the chain would have kept).
    The inner policy is told of every step as if its chain had gone (that prefix accepted, the batch's time
    scaled to the chain's size), so its own estimates and costs stay those of chains."""

    def __init__(self, inner, nodes: int):
        if nodes < 0:
            raise ValueError(f"--draft-tree must be >= 0, got {nodes}")
        self.inner = inner
        self.nodes = nodes
        self.gain = GAIN_PRIOR  # extra tokens per tree step, measured
        self.chain_tokens = 1.0  # tokens a chain step keeps (its accepted + the target's), measured
        self.declined = 0  # trees held back in a row
        self.probe_every = PROBE_EVERY
        self._probing = False  # this step's tree is a probe
        self.trees_sent = 0
        self._sent: Draft | None = None  # this step's tree draft, until observe

    @property
    def last_note(self):
        return self.inner.last_note

    @property
    def drafting_possible(self) -> bool:
        return self.inner.drafting_possible

    def _verify_cost(self):
        """The target's verify costs where the inner policy prices drafts (None: it sends what it is told)."""
        return getattr(self.inner, "verify_cost", None)

    def draft(self, drafter, context: Sequence[int], limit: int, params: SamplingParams,
              rng: np.random.Generator) -> Draft:
        self._sent = None
        if not self.nodes:
            return self.inner.draft(drafter, context, limit, params, rng)
        recorders = {id(m): _RowRecorder(m.backend) for m in members(drafter) if isinstance(m, DraftModel)}
        with ExitStack() as stack:
            for recorder in recorders.values():
                stack.enter_context(recorder)
            draft = self.inner.draft(drafter, context, limit, params, rng)
        member = draft.drafter if draft.drafter is not None else drafter
        if not draft.tokens:
            return draft
        if isinstance(member, PromptLookup):
            widened = lookup_tree(member, context, draft, self.nodes)
        elif id(member) in recorders:
            widened = model_tree(draft, recorders[id(member)].rows, self.nodes)
        else:
            return draft
        tree = getattr(widened, "tree", None)
        if tree is None or not self._pays(len(draft.tokens), len(tree)):
            return draft
        self._sent = widened
        self.trees_sent += 1
        return widened

    def _pays(self, k: int, nodes: int) -> bool:
        cost = self._verify_cost()
        if cost is None:
            return True
        pays = (self.chain_tokens + self.gain) * cost(k + 1) > self.chain_tokens * cost(nodes + 1)
        if pays or self.declined >= self.probe_every:
            self._probing, self.declined = not pays, 0
            return True
        self.declined += 1
        return False

    def observe(self, step, emitted) -> None:
        sent, self._sent = self._sent, None
        if sent is None or not step.nodes:  # a chain (or nothing) went: its tokens per step
            if step.drafted:
                self.chain_tokens = GAIN_DECAY * self.chain_tokens + (1 - GAIN_DECAY) * (step.accepted + 1)
            self.inner.observe(step, emitted)
            return
        chain = list(sent.tokens)
        kept = list(emitted[: step.accepted])
        chain_kept = next((i for i, (a, b) in enumerate(zip(chain, kept)) if a != b), min(len(chain), len(kept)))
        self.gain = GAIN_DECAY * self.gain + (1 - GAIN_DECAY) * (step.accepted - chain_kept)
        if self._probing:  # a probe that gained nothing: the next one waits twice as long
            self.probe_every = PROBE_EVERY if step.accepted > chain_kept else min(2 * self.probe_every, PROBE_MAX)
            self._probing = False
        self.chain_tokens = GAIN_DECAY * self.chain_tokens + (1 - GAIN_DECAY) * (chain_kept + 1)
        cost = self._verify_cost()
        scale = cost(len(chain) + 1) / cost(step.nodes + 1) if cost is not None else 1.0
        as_chain = dataclasses.replace(step, drafted=len(chain), accepted=chain_kept, nodes=0,
                                       verify_seconds=step.verify_seconds * scale)
        self.inner.observe(as_chain, emitted)

    def enter(self, phase: str) -> None:
        self.inner.enter(phase)

    def finish(self) -> None:
        self.inner.finish()

    def __getattr__(self, name):  # the inner policy's other attributes (notes, estimates) as they are
        return getattr(self.inner, name)


MAX_TREE_NODES = 255  # llama.cpp's most sequences a context may have is 256 (one per leaf, the root's row too)


def check_draft_tree(nodes: int, fixed: int | None, no_spec: bool) -> None:
    """--draft-tree's value, checked before anything loads (a mistake is one line)."""
    if not 0 <= nodes <= MAX_TREE_NODES:
        raise UserError(f"--draft-tree must be between 0 (chains only) and {MAX_TREE_NODES} nodes, got {nodes}")
    if nodes and no_spec:
        raise UserError(f"--draft-tree {nodes} drafts, --no-spec does not: give one of them")
    if nodes and fixed is not None and nodes < fixed:
        raise UserError(f"--draft-tree {nodes} is fewer nodes than --draft-fixed {fixed} deep: a tree holds its "
                        "main branch; give at least as many nodes")


def tree_policy(policy, nodes: int):
    """The run's policy, widened into trees of at most `nodes` nodes (none for 0)."""
    return TreePolicy(policy, nodes) if nodes else policy


def tree_note(target, nodes: int) -> str | None:
    """One line where --draft-tree asked for trees this target cannot verify (None where it can)."""
    if not nodes:
        return None
    capacity = getattr(target, "tree_capacity", lambda: 0)()
    if getattr(target, "memory", None) is not None and target.memory.kind != "kv":
        return (f"--draft-tree: {target.name} keeps a recurrent state (it cannot share a batch between "
                "branches): drafts go as chains")
    if capacity < 2:
        return f"--draft-tree: {target.name}'s context holds one sequence: drafts go as chains"
    return None


# -- trees from a draft model ------------------------------------------------------------------------------

ALTERNATIVES = 3  # a draft position's runners-up considered as branches


class _RowRecorder:
    """While a draft model proposes: a copy of the logits row each of its evaluations returns (the row
    after the context, then one after each draft token), so the runners-up at every position are known
    without another forward."""

    def __init__(self, backend):
        self.backend, self.rows = backend, []

    def __enter__(self):
        self._own = "eval" in vars(self.backend)
        self._real = self.backend.eval

        def recording(tokens, logits_at, *, in_place=False):
            out = self._real(tokens, logits_at, in_place=in_place)
            if len(out):
                self.rows.append(np.array(out[-1], dtype=np.float32))
            return out

        self.backend.eval = recording
        return self

    def __exit__(self, *exc):
        if self._own:
            self.backend.eval = self._real
        else:
            del self.backend.eval


def model_tree(draft: Draft, rows: Sequence[np.ndarray], nodes: int) -> Draft:
    """Widen a draft model's chain into a tree (EAGLE-2's expansion by cumulative probability, over the
    chain's runners-up): every chain position's ALTERNATIVES best other tokens become leaves beside the
    chain token, each scored by the draft's probability of the chain up to it times its own, and the
    best `nodes - len(chain)` of them are kept, so the tree branches where the draft was unsure. Leaves
    need no draft forward: a chosen candidate is verified as one-hot (tree.verify_tree), whatever q the
    chain tokens were drawn from."""
    k = len(draft.tokens)
    if k == 0 or nodes <= k or len(rows) < k:
        return draft
    scored: list[tuple[float, int, int]] = []  # (-score, position, token)
    path = 1.0
    for i, (token, row) in enumerate(zip(draft.tokens, rows)):
        z = np.asarray(row, dtype=np.float64)
        top = np.argpartition(-z, ALTERNATIVES)[: ALTERNATIVES + 1] if len(z) > ALTERNATIVES + 1 else np.arange(len(z))
        e = np.exp(z[top] - z.max())
        norm = float(np.exp(z - z.max()).sum())
        for t, w in zip(top.tolist(), (e / norm).tolist()):
            if t != token and w > 0:
                scored.append((-path * w, i, t))
        path *= float(np.exp(z[token] - z.max()) / norm)
    scored.sort()
    tree = DraftTree.chain(draft.tokens, draft.q)
    for _, i, t in scored[: nodes - k]:
        tree.add(t, i - 1)
    return TreeDraft(list(draft.tokens), list(draft.q), draft.source, draft.evidence, draft.drafter, draft.planned,
                     tree=tree)

"""Drafters: every way of proposing a candidate tree, behind one interface.

A ``Drafter`` holds the drafting state of one sequence and is driven by the decode loop
(``generate.py``) and by tuning (``draftheads.tuning``) through the same four calls:

- ``prefill(features, next_ids)``: start a sequence from the base model's features at positions
  0..T-1 and the tokens at positions 1..T (the last one is the first root);
- ``propose(root, position, tree) -> Draft``: a candidate tree whose node 0 is ``root``, the base
  model's own token at ``position``; whatever the drafter wrote while drafting is rolled back;
- ``commit(features, next_ids, position)``: the verifier accepted tokens; the base features at
  positions ``position..position+n-1`` and the tokens one position later;
- ``path_candidates(root, position, path, top_k)``: the drafter's top-k at each depth along a given
  path (teacher forcing), which is what tuning measures acceptance with.

Implementations, chosen by the head's ``drafting`` style through ``DRAFTERS``:

- ``ParallelDrafter`` (Medusa; Cai et al. 2024): the head's K distributions come from the features of
  the last accepted position (no pass of its own) and fill a static tree: the node at path
  [i1, ..., id] gets the i_d-th best token of head d.
- ``AutoregressiveDrafter`` (EAGLE, EAGLE-3; Li et al. 2024): the head runs ``draft_step`` once per
  tree depth on its own KV cache and builds either a static tree (the i-th best token of the
  drafter's distribution at the parent) or an EAGLE-2 dynamic tree. The drafter pairs the token at
  position j + 1 with its state at position j, so a depth-d node (its token at ``root_position + d``)
  is expanded at drafter position ``root_position + d - 1`` and attends to its tree ancestors.
- ``BlockDrafter`` (DFlash, ``block.py``) and ``CausalBlockDrafter`` (P-EAGLE, ``causal_block.py``):
  every depth from one head forward per step (``BlockForward``, ``ChainForward``), filling a static
  tree as ``ParallelDrafter`` does.
- ``ModulePerDepthDrafter`` (DeepSeek-V3 MTP; DeepSeek-AI 2024, sec. 2.2): depth d is module d, and
  every module acts at the last accepted position ``root_position - 1``, seeing its own cache
  prefix and itself, never the other depths' entries.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Generator
from dataclasses import dataclass
from typing import ClassVar

import torch

from draftheads.heads.layers import additive_mask
from draftheads.infer.cache import cache_lengths, crop_to_lengths
from draftheads.infer.limits import TreeFitError
from draftheads.infer.tree import (
    ROOT_PARENT,
    DynamicTree,
    StaticTree,
    TreeTopology,
    select_dynamic_nodes,
    tree_topology,
)


@dataclass(frozen=True)
class Draft:
    """One candidate tree: real node tokens (root first) and its topology (maybe padded); per node,
    who proposed it (``sources``, "" for the root) and the drafter's own estimate of the probability
    that its whole path is accepted (``scores``, 1 for the root)."""

    tokens: torch.Tensor  # (num_nodes,) base-vocabulary ids, tokens[0] is the root
    topology: TreeTopology
    sources: tuple[str, ...]
    scores: tuple[float, ...]

    @property
    def padded_tokens(self) -> torch.Tensor:
        return self.topology.pad_tokens(self.tokens)  # (N,)


def next_token_ids(input_ids: torch.Tensor, root: int) -> torch.Tensor:
    """(1, T) the token after each position of ``input_ids`` (1, T): its own next ids, then ``root``
    (the base model's token after the last): what ``Drafter.prefill`` and ``commit`` pair features
    with."""
    return torch.cat([input_ids[:, 1:], input_ids.new_tensor([[root]])], dim=1)


def root_only(root: int) -> Draft:
    """The tree of the root alone: verifying it is a plain decoding step."""
    return Draft(torch.tensor([root], dtype=torch.long), tree_topology([ROOT_PARENT]), ("",), (1.0,))


@functools.lru_cache(maxsize=64)
def static_topology(tree: StaticTree, pad_to_multiple: int) -> TreeTopology:
    """A static tree's topology, built once per (tree, padding)."""
    return tree.topology(pad_to_multiple)


@dataclass(frozen=True)
class Expansion:
    """One ``draft_step`` a drafter needs: ``nodes`` tree nodes expanded at ``depth`` on the drafter's
    own cache (``cache``, from ``head.new_cache()``, holding ``keys`` entries: its accepted prefix
    and what this tree wrote so far). ``visible`` (n, keys + n) says which cache entries and which of
    the new nodes each node sees."""

    head: object
    cache: object
    cache_index: int  # which of ``head.draft_caches(cache)`` the step reads and extends
    depth: int
    parent_states: torch.Tensor  # (n, h)
    token_ids: torch.Tensor  # (n,)
    position_ids: torch.Tensor  # (n,)
    visible: torch.Tensor  # (n, keys + n) bool

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The expansion alone: ``draft_step`` on its own cache; (n, h) states and (n, V) logits."""
        mask = additive_mask(self.visible, self.parent_states.dtype)
        states, logits = self.head.draft_step(
            self.cache,
            self.depth,
            self.parent_states[None],
            self.token_ids[None],
            self.position_ids[None],
            mask[None, None].to(self.parent_states.device),
        )
        return states[0], logits[0]


@dataclass(frozen=True)
class CatchUp:
    """The forward a drafter owes before it drafts: ``head.catch_up`` on its own ``cache`` over the
    accepted positions it has not seen yet (features (1, n, F), next_ids (1, n), position_ids (1, n))."""

    head: object
    cache: object
    features: torch.Tensor
    next_ids: torch.Tensor
    position_ids: torch.Tensor

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up alone: (1, h) drafter state and (1, V_draft) logits at the last position."""
        return self.head.catch_up(self.cache, self.features, self.next_ids, self.position_ids)


@dataclass(frozen=True)
class DepthLogits:
    """The forward a parallel drafter (Medusa) owes before it fills a tree: every depth's
    distribution from the features at the last accepted position (``features`` (1, 1, F))."""

    head: object
    features: torch.Tensor

    def run(self) -> torch.Tensor:
        """The forward alone: (K, V) logits, row d - 1 for depth d."""
        return self.head.draft_logits(self.features)[0, -1]


@dataclass(frozen=True)
class BlockForward:
    """The forward a block drafter (DFlash) owes for a tree at root ``position``: ``head.draft_block``
    on its own context ``cache`` (positions 0 .. position - n - 1), appending the ``features``
    (1, n, F) committed since its last block, with the root token ``root``."""

    head: object
    cache: object
    features: torch.Tensor
    position: int
    root: int

    def run(self) -> torch.Tensor:
        """The forward alone: (K - 1, V) logits, row d - 1 for depth d."""
        roots = torch.tensor([self.root], dtype=torch.long, device=self.features.device)
        return self.head.draft_block(self.cache, self.features, self.position, roots)[0]


@dataclass(frozen=True)
class ChainForward:
    """The forward a causal-block drafter (P-EAGLE) owes for a tree at root ``position``:
    ``head.draft_chain`` on its drafter ``cache`` (positions 0 .. position - n - 1), appending the
    ``features`` (1, n, F) committed since its last forward and their ``next_ids`` (1, n)."""

    head: object
    cache: object
    features: torch.Tensor
    next_ids: torch.Tensor
    position: int
    depths: int

    def run(self) -> torch.Tensor:
        """The forward alone: (depths, N) draft-vocabulary logits, row d - 1 for depth d."""
        return self.head.draft_chain(self.cache, self.features, self.next_ids, self.position, self.depths)[0]


# A head forward a drafter may need; ``draftheads.infer.batch_draft`` runs one of each kind for all
# the rows of a batch that need it.
HeadForward = Expansion | CatchUp | DepthLogits | BlockForward | ChainForward

# A drafting generator yields the head forwards it needs (an ``Expansion`` per tree depth, a
# ``CatchUp`` first where accepted tokens are pending; one ``DepthLogits``, ``BlockForward`` or
# ``ChainForward`` for the drafters that draft every depth at once), is sent each one's result,
# returns the Draft.
DraftSteps = Generator[HeadForward, object, "Draft"]


def run_steps(steps: Generator[HeadForward, object, object]):
    """Drive a drafting generator alone: run each forward it yields; return what it returns."""
    try:
        expansion = next(steps)
        while True:
            expansion = steps.send(expansion.run())
    except StopIteration as done:
        return done.value


# ---- the interface ------------------------------------------------------------------------------


class Drafter:
    """Proposes a candidate tree per decoding step for one sequence; see the module docstring.

    Args:
        head: the ``DraftHead`` (attached to the base model that verifies).
        pad_to_multiple: pad each proposed tree to a multiple of this many tokens.
    """

    # Default tree per device type: small on CPU, where verifying N tokens grows with N well before
    # N = 16 (docs/inference.md, "Measured facts the code relies on"); the papers' trees on GPU.
    default_trees: ClassVar[dict[str, str]] = {}
    dynamic_trees: ClassVar[bool] = False  # can it draft an EAGLE-2 dynamic tree?

    def __init__(self, head, pad_to_multiple: int = 1):
        self.head = head
        self.pad_to_multiple = pad_to_multiple

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The base model's ``hidden_states`` indices the drafter reads."""
        return tuple(self.head.feature_layers)

    @property
    def max_depth(self) -> int:
        """The deepest tree it can draft (Medusa K heads, MTP D modules); -1: no limit."""
        return self.head.num_draft_steps

    @property
    def source(self) -> str:
        """How statistics name this drafter's proposals."""
        return self.head.kind

    def select_features(self, hidden_states, index: torch.Tensor | None = None) -> torch.Tensor | None:
        """(1, T, F) drafter features from the base model's ``hidden_states``, or (1, A, F) at the
        positions ``index`` (A,); None for a drafter that reads none."""
        features = self.head.select_features(hidden_states)
        return features if index is None else features[:, index]

    def check_tree(self, tree: StaticTree | DynamicTree) -> None:
        """Raise TreeFitError (a ValueError) if this drafter cannot fill ``tree``."""
        if isinstance(tree, DynamicTree) and not self.dynamic_trees:
            raise TreeFitError(
                f"{self.head.kind} heads draft all depths at once; give a static tree, not '{tree.name}'"
            )

    def fork(self) -> Drafter:
        """A drafter in the same state whose later calls leave this one's state untouched."""
        return copy.copy(self)

    def prefill(self, features: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Start a sequence: features (1, T, F) at positions 0..T-1, next_ids (1, T) at 1..T."""
        raise NotImplementedError

    def start(self, hidden_states, input_ids: torch.Tensor, root: int) -> None:
        """``prefill`` from the prompt's forward: its ``hidden_states``, its (1, T) ids, and the base
        model's first token ``root`` (at position T)."""
        self.prefill(self.select_features(hidden_states), next_token_ids(input_ids, root))

    def commit(self, features: torch.Tensor, next_ids: torch.Tensor, position: int) -> None:
        """Accepted: features (1, n, F) at positions position.., next_ids (1, n) one position later.
        A drafter may defer the work until it next proposes (``flush``)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Do any committed work still deferred (``propose`` does it first anyway)."""

    def record(self, draft: Draft, accepted_nodes: tuple[int, ...]) -> None:
        """What the verifier accepted of the last proposed ``draft`` (node indices, root first);
        drafters that learn from it online (``draftheads.infer.adaptive``) override this."""

    def propose(self, root: int, position: int, tree: StaticTree | DynamicTree) -> Draft:
        """A candidate tree after the committed prefix, ``root`` (node 0) at ``position``."""
        raise NotImplementedError

    def propose_steps(self, root: int, position: int, tree: StaticTree | DynamicTree) -> DraftSteps:
        """``propose`` as a generator that yields each head forward it needs (a ``CatchUp``, an
        ``Expansion`` per depth) and is sent back its result, so that a batch's drafters can share
        one forward each (``draftheads.infer.batch_draft``). Drafters with no forward of their own
        yield nothing."""
        return self.propose(root, position, tree)
        yield  # a generator that returns at once

    def path_candidates(self, root: int, position: int, path: torch.Tensor, top_k: int) -> torch.Tensor:
        """(len(path) + 1, top_k) base-vocabulary candidates: row d - 1 holds the drafter's best
        tokens at depth d when the nodes above are ``root`` and ``path[:d - 1]`` (the true path)."""
        raise NotImplementedError


DRAFTERS: dict[str, type[Drafter]] = {}  # a head's ``drafting`` style -> its Drafter


def register_drafter(style: str):
    """Class decorator: the Drafter for heads whose ``drafting`` is ``style``."""

    def register(cls: type[Drafter]) -> type[Drafter]:
        if style in DRAFTERS:
            raise ValueError(f"drafting style '{style}' registered twice")
        DRAFTERS[style] = cls
        return cls

    return register


def drafter_for(head, pad_to_multiple: int = 1) -> Drafter:
    """The Drafter for ``head``'s drafting style."""
    import draftheads.infer.block  # registers the block drafter (it imports this module)
    import draftheads.infer.causal_block  # noqa: F401  (registers the causal-block drafter, likewise)

    style = getattr(head, "drafting", None)
    if style not in DRAFTERS:
        raise ValueError(
            f"{head.kind} head has unknown drafting style '{style}'; known: {', '.join(sorted(DRAFTERS))}"
        )
    return DRAFTERS[style](head, pad_to_multiple)


# ---- parallel heads (Medusa) --------------------------------------------------------------------


@register_drafter("parallel")
class ParallelDrafter(Drafter):
    default_trees: ClassVar[dict[str, str]] = {"cpu": "cpu-8", "cuda": "mc_sim_7b_63"}

    def __init__(self, head, pad_to_multiple: int = 1):
        super().__init__(head, pad_to_multiple)
        self.last_features: torch.Tensor | None = None  # (1, 1, F) at the last accepted position
        self.depth_logits: torch.Tensor | None = None  # (K, V) from them, once a tree asked for it

    def prefill(self, features, next_ids) -> None:
        self.last_features = features[:, -1:] if features.shape[1] else None
        self.depth_logits = None

    def commit(self, features, next_ids, position) -> None:
        self.last_features = features[:, -1:]
        self.depth_logits = None

    def _depth_logits_steps(self, root: int, position: int) -> Generator[HeadForward, object, torch.Tensor]:
        """Yield the head forward for the (K, V) draft logits of depths 1..K of a tree at ``root`` and
        ``position`` (nothing if they are known already), take its result, return them. The heads
        read the last committed features only, so the logits hold until the next commit (a block
        drafter's depend on the root too: ``BlockDrafter``)."""
        if self.depth_logits is None:
            self.depth_logits = yield DepthLogits(self.head, self.last_features)
        return self.depth_logits

    def _ranked(self, logits: torch.Tensor, depth: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(depth, count) base-vocabulary ids, best first, of ``logits`` (K, V) depths 1..depth, and
        their probabilities."""
        logits = logits[:depth].float()  # (D, V)
        best = torch.topk(logits, count, dim=-1)
        probabilities = (best.values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()  # (D, count)
        return self.head.draft_to_target(best.indices), probabilities

    def propose(self, root, position, tree) -> Draft:
        return run_steps(self.propose_steps(root, position, tree))

    def propose_steps(self, root, position, tree) -> DraftSteps:
        self.check_tree(tree)
        topology = static_topology(tree, self.pad_to_multiple)
        device = self.last_features.device
        tokens = torch.full((tree.num_nodes,), root, dtype=torch.long, device=device)  # (M,)
        if tree.depth == 0:
            return Draft(tokens, topology, ("",), (1.0,))
        logits = yield from self._depth_logits_steps(root, position)  # (K, V)
        widest = max(tree.top_k(d) for d in range(1, tree.depth + 1))
        candidates, probabilities = self._ranked(logits, tree.depth, widest)  # (D, widest) each
        depths = topology.depths[1 : tree.num_nodes].to(device)  # (M - 1,)
        ranks = torch.tensor(tree.ranks[1:], dtype=torch.long, device=device)  # (M - 1,)
        tokens[1:] = candidates[depths - 1, ranks]
        node_probabilities = [1.0] + probabilities[depths - 1, ranks].tolist()  # each depth's own head
        scores = [1.0] * tree.num_nodes
        for node in range(1, tree.num_nodes):  # the heads are independent: a path multiplies
            scores[node] = scores[tree.parents[node]] * node_probabilities[node]
        return Draft(tokens, topology, ("",) + (self.source,) * (tree.num_nodes - 1), tuple(scores))

    def path_candidates(self, root, position, path, top_k) -> torch.Tensor:
        logits = run_steps(self._depth_logits_steps(root, position))
        return self._ranked(logits, len(path) + 1, top_k)[0]  # each head's view is independent of the path


# ---- autoregressive heads (EAGLE, EAGLE-3) and MTP ----------------------------------------------


class _Proposals:
    """Everything the drafter proposed for one tree (root excluded), depth by depth, and the drafter
    cache entries it wrote. Local bookkeeping of one ``propose`` or ``path_candidates`` call."""

    def __init__(self):
        self.tokens: list[torch.Tensor] = []  # per proposal: 0-d base-vocabulary id
        self.parents: list[int] = []  # index in this list, ROOT_PARENT for children of the root
        self.scores: list[torch.Tensor] = []  # cumulative draft log-probability (0-d)
        self.cached: list[int] = []  # proposal behind each drafter cache entry written while drafting
        self.states: dict[int, torch.Tensor] = {}  # proposal -> (h,) drafter state at that node

    def add(self, parent: int, tokens: torch.Tensor, scores: torch.Tensor) -> list[int]:
        first = len(self.tokens)
        self.tokens.extend(tokens.unbind(0))
        self.scores.extend(scores.unbind(0))
        self.parents.extend([parent] * tokens.numel())
        return list(range(first, len(self.tokens)))

    def is_ancestor_or_self(self, candidate: int, node: int) -> bool:
        while node != ROOT_PARENT:
            if node == candidate:
                return True
            node = self.parents[node]
        return False


def _drafter_visible(
    proposals: _Proposals, nodes: list[int], prefix_length: int, attends_ancestors: bool
) -> torch.Tensor:
    """(n, prefix + written + n) bool: what expanding ``nodes`` sees: the cache prefix, the nodes' own
    ancestors among the entries written while drafting (EAGLE only), and themselves."""
    written = proposals.cached if attends_ancestors else []
    visible = torch.zeros(len(nodes), prefix_length + len(written) + len(nodes), dtype=torch.bool)
    visible[:, :prefix_length] = True
    for row, node in enumerate(nodes):
        for column, entry in enumerate(written):
            visible[row, prefix_length + column] = proposals.is_ancestor_or_self(entry, node)
        visible[row, prefix_length + len(written) + row] = True
    return visible


def _children(head, log_probabilities: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``count`` children per row of (n, V_draft) log-probs: base-vocabulary ids and log-probs."""
    count = min(count, log_probabilities.shape[-1])
    best = torch.topk(log_probabilities, count, dim=-1)
    return head.draft_to_target(best.indices), best.values  # (n, count) each


def _finish(
    proposals: _Proposals, kept: list[int], root_token: torch.Tensor, pad_to_multiple: int, source: str
) -> Draft:
    """Turn the kept proposals (ascending, parents first) into a Draft with the root as node 0."""
    node_of = {proposal: index + 1 for index, proposal in enumerate(kept)}
    parents = [ROOT_PARENT] + [
        0 if proposals.parents[p] == ROOT_PARENT else node_of[proposals.parents[p]] for p in kept
    ]
    tokens = torch.stack([root_token] + [proposals.tokens[p] for p in kept])  # (M,)
    scores = torch.stack([proposals.scores[p] for p in kept]).exp().tolist() if kept else []
    return Draft(
        tokens, tree_topology(parents, pad_to_multiple), ("",) + (source,) * len(kept), (1.0, *scores)
    )


@register_drafter("autoregressive")
class AutoregressiveDrafter(Drafter):
    default_trees: ClassVar[dict[str, str]] = {"cpu": "dynamic-cpu", "cuda": "dynamic-gpu"}
    dynamic_trees = True
    attends_ancestors: ClassVar[bool] = True  # a node sees its tree ancestors written while drafting

    def __init__(self, head, pad_to_multiple: int = 1):
        super().__init__(head, pad_to_multiple)
        self.cache = None  # the head's own KV cache(s), holding the accepted prefix only
        self.state: torch.Tensor | None = None  # (1, h) drafter state at the last accepted position
        self.logits: torch.Tensor | None = None  # (1, V_draft) its distribution for the root
        # Committed but not yet caught up: (features, next_ids, position) per commit. A step that
        # does not ask this drafter for a tree (adaptive drafting) then costs it nothing, and the
        # next proposal catches up on all of it in one call.
        self.pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def fork(self) -> Drafter:
        other = copy.copy(self)
        other.cache = copy.deepcopy(self.cache)
        other.pending = list(self.pending)
        return other

    def prefill(self, features, next_ids) -> None:
        self.cache = self.head.new_cache()
        self.pending = []
        if features.shape[1]:
            self.commit(features, next_ids, 0)

    def commit(self, features, next_ids, position) -> None:
        if self.pending:
            _, last_ids, start = self.pending[-1]
            if start + last_ids.shape[1] != position:
                raise ValueError(f"commit at position {position} does not follow {start + last_ids.shape[1]}")
        self.pending.append((features, next_ids, position))

    def flush(self) -> None:
        run_steps(self._catch_up_steps())

    def _catch_up_steps(self) -> Generator[CatchUp, tuple[torch.Tensor, torch.Tensor], None]:
        """Yield the ``CatchUp`` over every pending commit (nothing if none), take its result."""
        if not self.pending:
            return
        features = torch.cat([f for f, _, _ in self.pending], dim=1)  # (1, n, F)
        next_ids = torch.cat([i for _, i, _ in self.pending], dim=1)  # (1, n)
        position = self.pending[0][2]
        self.pending = []
        positions = position + torch.arange(next_ids.shape[1], device=next_ids.device)[None]  # (1, n)
        self.state, self.logits = yield CatchUp(self.head, self.cache, features, next_ids, positions)

    # Where a depth-d expansion sits in the drafter's caches (overridden by MTP).

    def _prefix_length(self, lengths: list[int], written: int, depth: int) -> int:
        """Cache entries every node being expanded sees (the accepted prefix)."""
        return lengths[0] - written

    def _position(self, root_position: int, depth: int) -> int:
        return root_position + depth - 1

    def _cache_index(self, depth: int) -> int:
        """Which of the head's draft caches a depth-d expansion reads and extends."""
        return 0

    def _expand(self, proposals: _Proposals, nodes: list[int], depth: int, root_position: int):
        """Generator: yield the ``Expansion`` of ``nodes`` (all at ``depth``), get its (n, h) states and
        (n, V_draft) logits back; record the states and return the children's log-probabilities."""
        root_state = self.state[0]
        lengths = cache_lengths(self.head.draft_caches(self.cache))
        prefix_length = self._prefix_length(lengths, len(proposals.cached), depth)
        parent_states = torch.stack(
            [
                root_state if proposals.parents[n] == ROOT_PARENT else proposals.states[proposals.parents[n]]
                for n in nodes
            ]
        )  # (n, h)
        token_ids = torch.stack([proposals.tokens[n] for n in nodes])  # (n,)
        position_ids = torch.full_like(token_ids, self._position(root_position, depth))  # (n,)
        visible = _drafter_visible(proposals, nodes, prefix_length, self.attends_ancestors)
        states, logits = yield Expansion(
            self.head,
            self.cache,
            self._cache_index(depth),
            depth,
            parent_states,
            token_ids,
            position_ids,
            visible,
        )
        if self.attends_ancestors:
            proposals.cached.extend(nodes)
        for node, state in zip(nodes, states):
            proposals.states[node] = state
        return torch.log_softmax(logits.float(), dim=-1)  # (n, V_draft)

    def propose(self, root, position, tree) -> Draft:
        return run_steps(self.propose_steps(root, position, tree))

    def propose_steps(self, root, position, tree) -> DraftSteps:
        self.check_tree(tree)
        yield from self._catch_up_steps()
        caches = self.head.draft_caches(self.cache)
        lengths = cache_lengths(caches)
        root_token = torch.tensor(root, dtype=torch.long, device=self.state.device)
        if isinstance(tree, StaticTree):
            proposals, kept = yield from self._static(tree, position)
        else:
            proposals, kept = yield from self._dynamic(tree, position)
        crop_to_lengths(caches, lengths)  # drafted entries are rebuilt from real features on commit
        return _finish(proposals, kept, root_token, self.pad_to_multiple, self.source)

    def _static(self, tree: StaticTree, position: int) -> tuple[_Proposals, list[int]]:
        """Fill a static tree; proposal i is tree node i + 1 (nodes listed depth by depth)."""
        head, proposals = self.head, _Proposals()
        node_depths = [len(path) for path in ((),) + tree.choices]
        by_node: dict[int, int] = {}  # tree node -> proposal
        log_probabilities = {0: torch.log_softmax(self.logits[0].float(), dim=-1)}  # node -> (V_draft,)
        for depth in range(1, tree.depth + 1):
            layer = [n for n in range(1, tree.num_nodes) if node_depths[n] == depth]
            candidates: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # parent -> (ids, scores)
            for node in layer:
                parent, rank = tree.parents[node], tree.ranks[node]
                if parent not in candidates:
                    width = 1 + max(tree.ranks[c] for c in layer if tree.parents[c] == parent)
                    candidates[parent] = _children(head, log_probabilities[parent][None], width)
                ids, scores = candidates[parent]
                proposal_parent = ROOT_PARENT if parent == 0 else by_node[parent]
                above = 0.0 if parent == 0 else proposals.scores[proposal_parent]  # cumulative
                by_node[node] = proposals.add(
                    proposal_parent, ids[0, rank : rank + 1], above + scores[0, rank : rank + 1]
                )[0]
            expanding = [n for n in layer if n in set(tree.parents)]
            if expanding:
                rows = yield from self._expand(proposals, [by_node[n] for n in expanding], depth, position)
                log_probabilities.update(zip(expanding, rows))
        return proposals, list(range(len(proposals.tokens)))

    def _dynamic(self, tree: DynamicTree, position: int) -> tuple[_Proposals, list[int]]:
        """EAGLE-2 (Li et al. 2024, sec. 4): expand the top_k best frontier nodes at each depth, score a
        node by its cumulative draft log-probability, keep the best total_tokens - 1 over all depths."""
        proposals = _Proposals()
        root_log_probabilities = torch.log_softmax(self.logits[0].float(), dim=-1)[None]  # (1, V_draft)
        ids, scores = _children(self.head, root_log_probabilities, tree.top_k)  # (1, k)
        frontier = proposals.add(ROOT_PARENT, ids[0], scores[0])
        for depth in range(1, tree.depth):
            rows = yield from self._expand(proposals, frontier, depth, position)  # (k, V_draft)
            ids, scores = _children(self.head, rows, tree.top_k)  # (k, k)
            frontier_scores = torch.stack([proposals.scores[n] for n in frontier])  # (k,)
            cumulative = frontier_scores[:, None] + scores  # (k, k)
            layer = []
            for row, parent in enumerate(frontier):
                layer.extend(proposals.add(parent, ids[row], cumulative[row]))
            best = torch.topk(cumulative.flatten(), min(tree.top_k, cumulative.numel())).indices
            frontier = [layer[int(i)] for i in best.sort().values]
        kept = select_dynamic_nodes(torch.stack(proposals.scores), proposals.parents, tree.total_tokens)
        return proposals, kept

    def path_candidates(self, root, position, path, top_k) -> torch.Tensor:
        self.flush()
        caches = self.head.draft_caches(self.cache)
        lengths = cache_lengths(caches)
        proposals = _Proposals()
        log_probabilities = torch.log_softmax(self.logits[0].float(), dim=-1)[None]  # (1, V_draft)
        rows = [_children(self.head, log_probabilities, top_k)[0][0]]  # depth 1: (top_k,)
        parent = ROOT_PARENT
        for depth, token in enumerate(path.tolist(), start=1):  # expand the true depth-d node
            node = proposals.add(parent, torch.tensor([token], device=self.state.device), torch.zeros(1))[0]
            log_probabilities = run_steps(self._expand(proposals, [node], depth, position))  # (1, V_draft)
            rows.append(_children(self.head, log_probabilities, top_k)[0][0])
            parent = node
        crop_to_lengths(caches, lengths)
        return torch.stack(rows)  # (len(path) + 1, top_k)


@register_drafter("module-per-depth")
class ModulePerDepthDrafter(AutoregressiveDrafter):
    attends_ancestors = False

    def _prefix_length(self, lengths, written, depth) -> int:
        return lengths[depth]  # module depth + 1 sees its own cache and itself

    def _cache_index(self, depth: int) -> int:
        return depth  # module d + 1 drafts depth d, on its own cache

    def _position(self, root_position, depth) -> int:
        return root_position - 1  # every module acts at the last accepted position

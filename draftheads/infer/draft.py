"""Proposals: a draft head's candidate tree for one decoding step.

- Parallel heads (Medusa): ``draft_parallel`` reads the head's K distributions, computed from the
  features of the last accepted node of the previous verification forward (no extra pass), and
  fills a static tree: the node at path [i1, ..., id] gets the i_d-th best token of head d.
- Autoregressive heads (EAGLE, EAGLE-3, MTP): ``draft_autoregressive`` runs the head's ``draft_step``
  once per tree depth on its own cache, from the ``catch_up`` state, and builds either a static tree
  (the i-th best token of the drafter's distribution at the parent) or an EAGLE-2 dynamic tree.

Positions: the drafter pairs the token at position j + 1 with its state at position j (``catch_up``
is called with the positions j of the features). A depth-d node (its token at ``root_position + d``)
is therefore expanded at drafter position ``root_position + d - 1``, when the head attends to its
ancestors (EAGLE). MTP's modules all act at the last accepted position, ``root_position - 1``, each
seeing its cache prefix and itself (``DraftHead.draft_attends_ancestors``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftheads.infer.cache import cache_lengths
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
    """One candidate tree: real node tokens (root first) and its topology (maybe padded)."""

    tokens: torch.Tensor  # (num_nodes,) base-vocabulary ids, tokens[0] is the root
    topology: TreeTopology

    @property
    def padded_tokens(self) -> torch.Tensor:
        return self.topology.pad_tokens(self.tokens)  # (N,)


# ---- parallel heads (Medusa) --------------------------------------------------------------------


def draft_parallel(
    head, features: torch.Tensor, root_token: int, tree: StaticTree, topology: TreeTopology
) -> Draft:
    """Fill a static tree from a parallel head.

    Args:
        features: (1, 1, F) base features at the last accepted position (``select_features``).
        root_token: the base model's token after that position (node 0).
        topology: ``tree.topology(...)`` (built once by the caller, maybe padded).
    """
    depth = tree.depth
    device = features.device
    tokens = torch.full((tree.num_nodes,), root_token, dtype=torch.long, device=device)  # (M,)
    if depth == 0:
        return Draft(tokens, topology)
    logits = head.draft_logits(features)[0, -1, :depth].float()  # (D, V)
    widest = max(tree.top_k(d) for d in range(1, depth + 1))
    candidates = head.draft_to_target(torch.topk(logits, widest, dim=-1).indices)  # (D, widest)
    depths = topology.depths[1 : tree.num_nodes].to(device)  # (M - 1,)
    ranks = torch.tensor(tree.ranks[1:], dtype=torch.long, device=device)  # (M - 1,)
    tokens[1:] = candidates[depths - 1, ranks]
    return Draft(tokens, topology)


# ---- autoregressive heads (EAGLE, EAGLE-3, MTP) -------------------------------------------------


class _Proposals:
    """Everything the drafter proposed for one tree (root excluded), depth by depth, and the drafter
    cache entries it wrote. Local bookkeeping of one ``draft_autoregressive`` call."""

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


def _drafter_mask(
    proposals: _Proposals, nodes: list[int], prefix_length: int, attends_ancestors: bool, dtype, device
) -> torch.Tensor:
    """(1, 1, n, prefix + written + n) additive mask for expanding ``nodes``: the cache prefix, the
    nodes' own ancestors among the entries written while drafting (EAGLE only), and themselves."""
    written = proposals.cached if attends_ancestors else []
    visible = torch.zeros(len(nodes), prefix_length + len(written) + len(nodes), dtype=torch.bool)
    visible[:, :prefix_length] = True
    for row, node in enumerate(nodes):
        for column, entry in enumerate(written):
            visible[row, prefix_length + column] = proposals.is_ancestor_or_self(entry, node)
        visible[row, prefix_length + len(written) + row] = True
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None].to(device)  # (1, 1, n, K)


def _expand(
    head, cache, proposals: _Proposals, nodes: list[int], depth: int, root_state, root_position: int
) -> torch.Tensor:
    """Run ``draft_step`` on ``nodes`` (all at ``depth``); return (n, V_draft) log-probabilities of
    their children and record their drafter states."""
    device, dtype = root_state.device, root_state.dtype
    lengths = cache_lengths(head.draft_caches(cache))
    if head.draft_attends_ancestors:
        prefix_length = lengths[0] - len(proposals.cached)
        position = root_position + depth - 1
    else:
        # MTP: module depth + 1 acts at the last accepted position and sees its own cache + itself.
        prefix_length = lengths[depth]
        position = root_position - 1
    parent_states = torch.stack(
        [
            root_state if proposals.parents[n] == ROOT_PARENT else proposals.states[proposals.parents[n]]
            for n in nodes
        ]
    )[None]  # (1, n, h)
    token_ids = torch.stack([proposals.tokens[n] for n in nodes])[None]  # (1, n)
    position_ids = torch.full_like(token_ids, position)  # (1, n)
    mask = _drafter_mask(proposals, nodes, prefix_length, head.draft_attends_ancestors, dtype, device)
    states, logits = head.draft_step(cache, depth, parent_states, token_ids, position_ids, mask)
    if head.draft_attends_ancestors:
        proposals.cached.extend(nodes)
    for node, state in zip(nodes, states[0]):
        proposals.states[node] = state
    return torch.log_softmax(logits[0].float(), dim=-1)  # (n, V_draft)


def _children(head, log_probabilities: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``count`` children per row of (n, V_draft) log-probs: base-vocabulary ids and log-probs."""
    count = min(count, log_probabilities.shape[-1])
    best = torch.topk(log_probabilities, count, dim=-1)
    return head.draft_to_target(best.indices), best.values  # (n, count) each


def _finish(proposals: _Proposals, kept: list[int], root_token: torch.Tensor, pad_to_multiple: int) -> Draft:
    """Turn the kept proposals (ascending, parents first) into a Draft with the root as node 0."""
    node_of = {proposal: index + 1 for index, proposal in enumerate(kept)}
    parents = [ROOT_PARENT] + [
        0 if proposals.parents[p] == ROOT_PARENT else node_of[proposals.parents[p]] for p in kept
    ]
    tokens = torch.stack([root_token] + [proposals.tokens[p] for p in kept])  # (M,)
    return Draft(tokens, tree_topology(parents, pad_to_multiple))


def draft_autoregressive(
    head,
    cache,
    root_token: int,
    root_state: torch.Tensor,
    root_logits: torch.Tensor,
    root_position: int,
    tree: StaticTree | DynamicTree,
    pad_to_multiple: int = 1,
) -> Draft:
    """Draft a tree with an autoregressive head; ``cache`` gains entries (the caller rolls it back).

    Args:
        cache: the head's cache after ``catch_up`` up to position ``root_position - 1``.
        root_token: the base model's last token, at position ``root_position`` (node 0).
        root_state: (1, h) and root_logits: (1, V_draft), as returned by ``catch_up``.
        tree: a static shape (candidates by rank at each parent) or EAGLE-2 settings.
    """
    device = root_state.device
    proposals = _Proposals()
    root = torch.tensor(root_token, dtype=torch.long, device=device)
    root_log_probabilities = torch.log_softmax(root_logits[0].float(), dim=-1)[None]  # (1, V_draft)

    if isinstance(tree, StaticTree):
        # Proposal i is tree node i + 1; nodes are listed depth by depth, parents first.
        node_depths = [len(path) for path in ((),) + tree.choices]
        by_node: dict[int, int] = {}  # tree node -> proposal
        log_probabilities = {0: root_log_probabilities[0]}  # tree node -> (V_draft,) at that node
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
                by_node[node] = proposals.add(
                    proposal_parent, ids[0, rank : rank + 1], scores[0, rank : rank + 1]
                )[0]
            expanding = [n for n in layer if n in set(tree.parents)]
            if expanding:
                rows = _expand(
                    head,
                    cache,
                    proposals,
                    [by_node[n] for n in expanding],
                    depth,
                    root_state[0],
                    root_position,
                )
                log_probabilities.update(zip(expanding, rows))
        return _finish(proposals, list(range(len(proposals.tokens))), root, pad_to_multiple)

    # EAGLE-2 (Li et al. 2024, sec. 4): expand the top_k best frontier nodes at each depth, score a
    # node by its cumulative draft log-probability, keep the best total_tokens - 1 over all depths.
    ids, scores = _children(head, root_log_probabilities, tree.top_k)  # (1, k)
    frontier = proposals.add(ROOT_PARENT, ids[0], scores[0])
    for depth in range(1, tree.depth):
        rows = _expand(head, cache, proposals, frontier, depth, root_state[0], root_position)  # (k, V)
        ids, scores = _children(head, rows, tree.top_k)  # (k, k)
        frontier_scores = torch.stack([proposals.scores[n] for n in frontier])  # (k,)
        cumulative = frontier_scores[:, None] + scores  # (k, k)
        layer = []
        for row, parent in enumerate(frontier):
            layer.extend(proposals.add(parent, ids[row], cumulative[row]))
        best = torch.topk(cumulative.flatten(), min(tree.top_k, cumulative.numel())).indices
        frontier = [layer[int(i)] for i in best.sort().values]
    kept = select_dynamic_nodes(torch.stack(proposals.scores), proposals.parents, tree.total_tokens)
    return _finish(proposals, kept, root, pad_to_multiple)

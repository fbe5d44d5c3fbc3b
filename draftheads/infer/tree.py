"""Draft trees: their shapes, the tree attention mask, and root-to-leaf retrieve paths.

A tree holds N nodes; node 0 is the root (the token the base model produced last), and every other
node has a parent with a smaller index, so one forward can verify all of them (Miao et al. 2024,
"SpecInfer"; Cai et al. 2024, "Medusa", sec. 2.1.2).

- ``TreeTopology``: the shape of one tree (parents, depths, ancestor matrix, retrieve paths), without
  tokens. Built once for a static tree, once per step for a dynamic one.
- ``StaticTree``: a shape from a Medusa-style choice list; path ``[i1, ..., id]`` is "the i_d-th best
  candidate at depth d below the node ``[i1, ..., i(d-1)]``" (Medusa: of head d; an autoregressive
  drafter: of its distribution at the parent).
- ``DynamicTree``: the EAGLE-2 settings (top_k, depth, total_tokens); ``select_dynamic_nodes`` picks
  the kept nodes from draft scores.
- ``tree_attention_mask`` / ``tree_position_ids``: the verification forward's inputs.

Padding: in fp32 on CPU MKL's GEMM with 2-3 rows can be slower than with 4 (docs/inference.md,
"Measured facts the code relies on"), so a topology may carry padding nodes after the real ones. A
padding node sees the prefix and itself, has no parent and no children, and is in no retrieve path,
so it can never be accepted.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ROOT_PARENT = -1  # parent index of the root and of padding nodes
PATH_PAD = -1  # retrieve-path padding: never a node index nor a token id (Medusa pads with 0)


# ---- topology -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeTopology:
    """The shape of a tree of ``size`` nodes, the first ``num_nodes`` real and the rest padding."""

    parents: tuple[int, ...]  # (N,) parent index, ROOT_PARENT for the root and padding
    depths: torch.Tensor  # (N,) long, root 0, padding 0
    ancestor_mask: torch.Tensor  # (N, N) bool, [n, a] = a is n itself or an ancestor of n
    retrieve_paths: torch.Tensor  # (L, D + 1) long, one row per leaf: root .. leaf, PATH_PAD after
    children: tuple[tuple[int, ...], ...]  # children of each node, in candidate order
    num_nodes: int  # real nodes; indices num_nodes .. size-1 are padding

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        """Deepest real node's depth (0 for a root-only tree)."""
        return int(self.depths[: self.num_nodes].max())

    def pad_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """(num_nodes,) real node tokens -> (size,), padding repeats the root token (never accepted)."""
        if tokens.shape[-1] != self.num_nodes:
            raise ValueError(f"expected {self.num_nodes} node tokens, got {tokens.shape[-1]}")
        padding = tokens[..., :1].expand(*tokens.shape[:-1], self.size - self.num_nodes)
        return torch.cat([tokens, padding], dim=-1)


def padded_size(num_nodes: int, pad_to_multiple: int) -> int:
    """Tokens verified for a tree of ``num_nodes``: the next multiple of ``pad_to_multiple``, except
    that a root-only tree is never padded."""
    if num_nodes == 1:
        return 1
    return -(-num_nodes // pad_to_multiple) * pad_to_multiple


def tree_topology(parents: Sequence[int], pad_to_multiple: int = 1) -> TreeTopology:
    """Build a topology from the parent index of each node (node 0 the root, parents first).

    ``pad_to_multiple`` appends padding nodes until the size is a multiple of it; a root-only tree
    stays one token (padding helps small GEMMs, and one row is not one: it is plain decoding).
    Topologies are immutable and shared: the same parents give the same object (the decode loop
    builds the same few small trees every step).
    """
    return _topology(tuple(int(p) for p in parents), pad_to_multiple)


@functools.lru_cache(maxsize=4096)
def _topology(parents: tuple[int, ...], pad_to_multiple: int) -> TreeTopology:
    parents = list(parents)
    if not parents or parents[0] != ROOT_PARENT:
        raise ValueError(f"node 0 must be the root (parent {ROOT_PARENT}); got parents {parents[:4]}")
    for node, parent in enumerate(parents[1:], start=1):
        if not 0 <= parent < node:
            raise ValueError(f"node {node} has parent {parent}; a parent must be an earlier node")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    num_nodes = len(parents)
    size = padded_size(num_nodes, pad_to_multiple)
    all_parents = parents + [ROOT_PARENT] * (size - num_nodes)

    depths = [0] * size
    ancestor_mask = torch.eye(size, dtype=torch.bool)  # (N, N)
    children: list[list[int]] = [[] for _ in range(size)]
    for node in range(1, num_nodes):
        parent = parents[node]
        depths[node] = depths[parent] + 1
        ancestor_mask[node] |= ancestor_mask[parent]
        children[parent].append(node)

    leaves = [node for node in range(num_nodes) if not children[node]]
    max_depth = max(depths[:num_nodes])
    retrieve_paths = torch.full((len(leaves), max_depth + 1), PATH_PAD, dtype=torch.long)  # (L, D+1)
    for row, leaf in enumerate(leaves):
        path = ancestor_mask[leaf, :num_nodes].nonzero().flatten()  # ancestors in index order = depth order
        retrieve_paths[row, : len(path)] = path

    return TreeTopology(
        parents=tuple(all_parents),
        depths=torch.tensor(depths, dtype=torch.long),
        ancestor_mask=ancestor_mask,
        retrieve_paths=retrieve_paths,
        children=tuple(tuple(c) for c in children),
        num_nodes=num_nodes,
    )


def tree_attention_mask(
    topology: TreeTopology,
    past_length: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    batch_size: int = 1,
) -> torch.Tensor:
    """The additive float mask (B, 1, N, past + N) for verifying the tree after ``past_length`` tokens:
    0 where a node may attend (the whole prefix, itself, its ancestors), ``finfo(dtype).min`` elsewhere.

    A float mask, because transformers 5.x eager attention silently misreads a bool one."""
    if not dtype.is_floating_point:
        raise ValueError(f"the tree mask must be a floating dtype (the model's), got {dtype}")
    size = topology.size
    mask = torch.zeros(size, past_length + size, dtype=dtype, device=device)  # (N, past + N)
    blocked = ~topology.ancestor_mask.to(device)  # (N, N)
    mask[:, past_length:].masked_fill_(blocked, torch.finfo(dtype).min)
    return mask[None, None].expand(batch_size, 1, size, past_length + size)  # (B, 1, N, past + N)


def tree_position_ids(
    topology: TreeTopology, past_length: int, device: torch.device | str = "cpu", batch_size: int = 1
) -> torch.Tensor:
    """(B, N) absolute positions: past_length + depth (every sibling shares its depth's position)."""
    positions = (past_length + topology.depths).to(device)  # (N,)
    return positions[None].expand(batch_size, -1)  # (B, N)


def rows_attention_mask(
    topologies: Sequence[TreeTopology],
    slots: torch.Tensor,
    size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The additive float mask (B, 1, size, L + size) for verifying one tree per row of a batch
    whose cache rows occupy ``slots`` (B, L) bool (``cache.keep_accepted_rows``; the free slots
    are masked). Row b's tree fills the first ``topologies[b].size`` of ``size`` nodes; the nodes
    after it are padding: each sees the row's entries and itself, so no attention row is ever
    fully masked. One row that fills its cache gives exactly ``tree_attention_mask``."""
    if not dtype.is_floating_point:
        raise ValueError(f"the tree mask must be a floating dtype (the model's), got {dtype}")
    if slots.dim() != 2 or slots.dtype != torch.bool or slots.shape[0] != len(topologies):
        raise ValueError(
            f"{len(topologies)} trees need slots of shape ({len(topologies)}, L) bool, got "
            f"{tuple(slots.shape)} {slots.dtype}"
        )
    batch, cache_length = slots.shape
    blocked = torch.finfo(dtype).min
    mask = torch.full((batch, size, cache_length + size), blocked, dtype=dtype)  # (B, N, L + N)
    mask[:, :, :cache_length].masked_fill_(slots[:, None, :].cpu(), 0)
    mask[:, :, cache_length:].diagonal(dim1=1, dim2=2).fill_(0)  # every node sees itself
    for row, topology in enumerate(topologies):
        n = topology.size
        if n > size:
            raise ValueError(f"row {row}: a tree of {n} nodes in {size}")
        if n > 1:
            mask[row, :n, cache_length : cache_length + n].masked_fill_(topology.ancestor_mask, 0)
    return mask[:, None].to(device)  # (B, 1, N, L + N)


def rows_position_ids(
    topologies: Sequence[TreeTopology], lengths: Sequence[int], size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """(B, size) absolute positions: row b's length + node depth; padding nodes at the row's length."""
    positions = torch.tensor(lengths, dtype=torch.long)[:, None].repeat(1, size)  # (B, N)
    for row, topology in enumerate(topologies):
        positions[row, : topology.size] += topology.depths
    return positions.to(device)


# ---- static trees -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree shape from a Medusa-style choice list (see the module docstring)."""

    name: str
    choices: tuple[tuple[int, ...], ...]  # sorted by (length, lexicographic)
    parents: tuple[int, ...] = field(init=False)  # (N,) with the root first
    ranks: tuple[int, ...] = field(init=False)  # (N,) candidate rank of each node at its parent (root 0)

    def __post_init__(self):
        choices = tuple(
            sorted({tuple(int(i) for i in path) for path in self.choices}, key=lambda p: (len(p), p))
        )
        if len(choices) != len(self.choices):
            raise ValueError(f"tree '{self.name}': duplicate paths in choices")
        index = {(): 0}
        parents, ranks = [ROOT_PARENT], [0]
        for path in choices:
            if not path or min(path) < 0:
                raise ValueError(f"tree '{self.name}': path {list(path)} must be non-empty with ranks >= 0")
            if path[:-1] not in index:
                raise ValueError(
                    f"tree '{self.name}': path {list(path)} has no parent path "
                    f"{list(path[:-1])} in the choices"
                )
            index[path] = len(parents)
            parents.append(index[path[:-1]])
            ranks.append(path[-1])
        object.__setattr__(self, "choices", choices)
        object.__setattr__(self, "parents", tuple(parents))
        object.__setattr__(self, "ranks", tuple(ranks))

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max((len(path) for path in self.choices), default=0)

    def top_k(self, depth: int) -> int:
        """How many candidates per parent the tree reads at ``depth`` (1-based): max rank + 1."""
        return 1 + max((path[-1] for path in self.choices if len(path) == depth), default=-1)

    def truncated(self, max_depth: int) -> StaticTree:
        """The same tree without the nodes deeper than ``max_depth`` (negative: no limit)."""
        if max_depth < 0 or self.depth <= max_depth:
            return self
        kept = tuple(path for path in self.choices if len(path) <= max_depth)
        return StaticTree(f"{self.name}[:{max_depth}]", kept)

    def topology(self, pad_to_multiple: int = 1) -> TreeTopology:
        return tree_topology(self.parents, pad_to_multiple)

    @property
    def max_nodes(self) -> int:
        return self.num_nodes


def chain_choices(depth: int) -> tuple[tuple[int, ...], ...]:
    """A single path of ``depth`` top-1 candidates (speculative decoding without a tree)."""
    return tuple((0,) * d for d in range(1, depth + 1))


# ---- dynamic trees (EAGLE-2) --------------------------------------------------------------------


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 tree settings (Li et al. 2024, "EAGLE-2", sec. 4): expand the ``top_k`` best frontier
    nodes ``depth`` times, keep the ``total_tokens - 1`` best-scored nodes (+ the root)."""

    name: str
    top_k: int
    depth: int
    total_tokens: int  # tree size including the root

    def __post_init__(self):
        for key in ("top_k", "depth", "total_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"dynamic tree '{self.name}': {key} must be >= 1, got {getattr(self, key)}")

    @property
    def max_nodes(self) -> int:
        return self.total_tokens

    def truncated(self, max_depth: int) -> DynamicTree:
        """The same settings with depth at most ``max_depth`` (negative: no limit)."""
        if max_depth < 0 or self.depth <= max_depth:
            return self
        return DynamicTree(f"{self.name}[:{max_depth}]", self.top_k, max_depth, self.total_tokens)


def select_dynamic_nodes(scores: torch.Tensor, parents: Sequence[int], total_tokens: int) -> list[int]:
    """Pick the nodes EAGLE-2 keeps from everything the drafter proposed.

    Args:
        scores: (S,) cumulative draft log-probability of each proposed node, listed depth by depth
            (so a parent always comes before its children).
        parents: (S,) index of each node's parent in the same list, ROOT_PARENT for depth-1 nodes.
        total_tokens: tree size including the root; ``total_tokens - 1`` nodes are kept.
    Returns:
        Kept indices, ascending. A score never increases along a path, so the best nodes form a
        connected tree; a stable sort (parents listed first) keeps it connected on ties too.
    """
    scores = torch.nan_to_num(scores.float(), nan=float("-inf"))  # (S,)
    keep = min(total_tokens - 1, scores.numel())
    order = torch.sort(scores, descending=True, stable=True).indices[:keep]
    kept = set(order.tolist())
    for node in list(kept):  # -inf ties could still drop an ancestor; put it back (never on finite scores)
        parent = parents[node]
        while parent != ROOT_PARENT and parent not in kept:
            kept.add(parent)
            parent = parents[parent]
    return sorted(kept)


# ---- the named trees ----------------------------------------------------------------------------

# Medusa's hand-tuned 63-path tree for Vicuna-7B (Cai et al. 2024; FasterDecoding/Medusa
# medusa/model/medusa_choices.py `mc_sim_7b_63`): 64 nodes with the root, depth 4, top-10 per head.
MC_SIM_7B_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0),
    (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0),
    (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5),
    (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9),
    (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5),
    (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip

# EAGLE-1's default static tree (SafeAILab/EAGLE model/choices.py, also named mc_sim_7b_63 there):
# 26 nodes with the root, depth 5, top-4.
EAGLE1_26 = (
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (0, 0, 0),
    (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0), (0, 0, 0, 0),
    (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)  # fmt: skip

# Small trees for CPU decoding, where verifying N tokens grows with N well before N = 16
# (docs/inference.md, "Measured facts the code relies on"): most nodes on the top-1 spine, a few
# second choices near the root.
CPU_8 = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0))
CPU_16 = (
    (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 2), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0),
)  # fmt: skip

TREES: dict[str, StaticTree | DynamicTree] = {
    "chain-2": StaticTree("chain-2", chain_choices(2)),
    "chain-4": StaticTree("chain-4", chain_choices(4)),
    "chain-6": StaticTree("chain-6", chain_choices(6)),
    "cpu-8": StaticTree("cpu-8", CPU_8),
    "cpu-16": StaticTree("cpu-16", CPU_16),
    "eagle1-26": StaticTree("eagle1-26", EAGLE1_26),
    "mc_sim_7b_63": StaticTree("mc_sim_7b_63", MC_SIM_7B_63),
    # EAGLE-2 settings: the paper's GPU range (top_k 10, depth 6-7, 48-60 tokens) and a CPU size.
    "dynamic-cpu": DynamicTree("dynamic-cpu", top_k=4, depth=4, total_tokens=12),
    "dynamic-gpu": DynamicTree("dynamic-gpu", top_k=10, depth=6, total_tokens=60),
}


def resolve_tree(tree: str | StaticTree | DynamicTree | Sequence[Sequence[int]]) -> StaticTree | DynamicTree:
    """A tree by registered name, as an object, or as a raw choice list."""
    if isinstance(tree, (StaticTree, DynamicTree)):
        return tree
    if isinstance(tree, str):
        if tree not in TREES:
            raise ValueError(f"unknown tree '{tree}'; known trees: {', '.join(TREES)}")
        return TREES[tree]
    return StaticTree("custom", tuple(tuple(path) for path in tree))


# ---- tuned trees (``draftheads tune-tree``) -----------------------------------------------------

TUNED_TREE_FILE = "tree.json"  # in a head directory, next to config.json
TUNED_TREE_FORMAT = "draftheads-tuned-tree"


def tuned_tree_key(dtype: torch.dtype | str, device: torch.device | str) -> str:
    """The setting a tuned tree is valid for, e.g. ``cpu/float32``: costs differ by device and dtype."""
    return f"{torch.device(device).type}/{str(dtype).removeprefix('torch.')}"


def tree_to_dict(tree: StaticTree | DynamicTree) -> dict:
    if isinstance(tree, StaticTree):
        return {"type": "static", "name": tree.name, "choices": [list(path) for path in tree.choices]}
    return {
        "type": "dynamic",
        "name": tree.name,
        "top_k": tree.top_k,
        "depth": tree.depth,
        "total_tokens": tree.total_tokens,
    }


def tree_from_dict(data: dict, where: str) -> StaticTree | DynamicTree:
    """Inverse of ``tree_to_dict``, for a tree read from a file; bad input raises HeadFormatError (a
    ValueError) naming ``where`` and the field."""
    from draftheads.heads.base import HeadFormatError  # lazily: this module needs no transformers

    if not isinstance(data, dict) or data.get("type") not in ("static", "dynamic"):
        raise HeadFormatError(f"{where}: 'type' must be 'static' or 'dynamic', got {data!r:.80}")
    name = str(data.get("name", "tuned"))
    try:
        if data["type"] == "static":
            return StaticTree(name, tuple(tuple(int(i) for i in path) for path in data["choices"]))
        return DynamicTree(name, int(data["top_k"]), int(data["depth"]), int(data["total_tokens"]))
    except KeyError as err:
        raise HeadFormatError(f"{where}: missing field {err}") from err
    except (TypeError, ValueError) as err:
        raise HeadFormatError(f"{where}: {err}") from err


def read_tuned_entry(path, dtype: torch.dtype | str, device: torch.device | str = "cpu"):
    """``(file, entry)``: what ``draftheads tune-tree`` saved for this device and dtype (its tree,
    verify-cost curves and machine), or None if it has not been tuned for them. ``path`` is a head
    directory (reads its ``tree.json``) or a tuned-tree file; one that is not such a file raises
    HeadFormatError naming it and the field."""
    import json
    from pathlib import Path

    from draftheads.heads.base import HeadFormatError, inside_head  # lazily: needs no transformers

    path = Path(path)
    if path.is_dir():
        path = inside_head(path, path / TUNED_TREE_FILE)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HeadFormatError(f"{path}: invalid JSON: {err}") from err
    if not isinstance(saved, dict) or saved.get("format") != TUNED_TREE_FORMAT:
        raise HeadFormatError(f"{path}: 'format' must be '{TUNED_TREE_FORMAT}'")
    trees = saved.get("trees", {})
    if not isinstance(trees, dict):
        raise HeadFormatError(f"{path}: 'trees' must be a JSON object (setting -> entry), got {trees!r:.80}")
    key = tuned_tree_key(dtype, device)
    entry = trees.get(key)
    if entry is not None and not isinstance(entry, dict):
        raise HeadFormatError(f"{path}: 'trees.{key}' must be a JSON object, got {entry!r:.80}")
    return None if entry is None else (path, entry)


def load_tuned_tree(
    path, dtype: torch.dtype | str, device: torch.device | str = "cpu"
) -> StaticTree | DynamicTree | None:
    """The tree ``draftheads tune-tree`` chose for this device and dtype, or None if it has not been
    tuned for them. ``path`` is a head directory (reads its ``tree.json``) or a tuned-tree file."""
    found = read_tuned_entry(path, dtype, device)
    if found is None:
        return None
    path, entry = found
    return tree_from_dict(entry.get("tree"), f"{path}: trees.{tuned_tree_key(dtype, device)}.tree")

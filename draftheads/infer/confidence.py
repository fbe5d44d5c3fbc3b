"""A learned acceptance confidence for adaptive drafting: a small head that predicts, for every
drafted node, the probability that the base accepts it given that it accepts its parent.

SpecDec++ (Huang et al. 2024, arXiv:2405.19715) trains such an acceptance-prediction head on
decoding traces and stops a chain where the predicted chance of a rejection gets too high. Here the
head reads what every drafter already reports per node (``Draft.scores`` and ``sources``) plus the
node's place in the tree, so one head serves a head's, the context's and merged trees alike:

- the drafter's conditional probability of the node (its path score over its parent's) and its
  parent's path score, as logarithms;
- its depth and its rank among its siblings (one-hot, the last bucket open-ended);
- who proposed it: the head, the text (context or suffix drafts), or both.

A node's path probability is the product of the conditional ones along its path, so a child never
counts as likelier than its parent. Adaptive drafting (``adaptive.py``) prices nodes with these in
place of its online ``Calibration``; the verification keeps the output identical either way.
``draftheads fit-confidence`` decodes prompts with full (unpruned) trees, fits the head on every
verified node whose parent was accepted, and saves it beside the head (``CONFIDENCE_FILE``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from draftheads.heads.base import HeadFormatError, inside_head
from draftheads.infer.draft import Draft
from draftheads.infer.hybrid import BOTH
from draftheads.settings import ConfigError
from draftheads.storage import check_free_space, write_atomically, write_text_atomically

CONFIDENCE_FILE = "confidence.safetensors"
CONFIDENCE_CONFIG = "confidence.json"
CONFIDENCE_FORMAT = 1
TEXT_SOURCES = ("context", "suffix")  # the text drafters' sources; any other names a head
DEPTH_BUCKETS = 7  # depths 1 .. 6, then 7 and deeper
RANK_BUCKETS = 4  # sibling ranks 0 .. 2, then 3 and lower
LOG_FLOOR = -20.0  # log-probability of a score of 0 (a text drafter's unscored node)
FEATURES = (
    ("log_conditional_score", "log_parent_score")
    + tuple(f"depth_{d}" for d in range(1, DEPTH_BUCKETS))
    + (f"depth_{DEPTH_BUCKETS}+",)
    + tuple(f"rank_{r}" for r in range(RANK_BUCKETS - 1))
    + (f"rank_{RANK_BUCKETS - 1}+", "from_head", "from_text")
)
DEFAULT_HIDDEN = 16
DEFAULT_FIT_STEPS = 500  # full-batch optimiser steps
FIT_LEARNING_RATE = 0.02
# Beyond the weights: confidence.json (the fit's record) and filesystem blocks.
CONFIDENCE_SPACE_MARGIN = 2**20
NEEDS_ADAPTIVE = "a confidence head prices adaptive drafting's nodes: pass adaptive=True with it"


def _log(value: float) -> float:
    return max(math.log(value), LOG_FLOOR) if value > 0 else LOG_FLOOR


def node_features(draft: Draft) -> torch.Tensor:
    """(num_nodes - 1, len(FEATURES)) float32: one row per non-root node of ``draft``, in order.
    Built as Python lists and made a tensor once: adaptive drafting calls this every step."""
    count = draft.topology.num_nodes
    parents = list(draft.topology.parents[:count])
    scores = draft.scores
    depth = [0] * count
    siblings: dict[int, list[int]] = {}
    for node in range(1, count):
        depth[node] = depth[parents[node]] + 1
        siblings.setdefault(parents[node], []).append(node)
    rank = [0] * count
    for group in siblings.values():
        for place, node in enumerate(sorted(group, key=lambda n: (-scores[n], n))):
            rank[node] = place
    rows = []
    for node in range(1, count):
        parent_score = scores[parents[node]]
        conditional = scores[node] / parent_score if parent_score > 0 else 0.0
        row = [0.0] * len(FEATURES)
        row[0] = _log(min(conditional, 1.0))
        row[1] = _log(min(parent_score, 1.0))
        row[2 + min(depth[node], DEPTH_BUCKETS) - 1] = 1.0
        row[2 + DEPTH_BUCKETS + min(rank[node], RANK_BUCKETS - 1)] = 1.0
        parts = draft.sources[node].split(BOTH)
        row[-2] = float(any(part not in TEXT_SOURCES for part in parts))
        row[-1] = float(any(part in TEXT_SOURCES for part in parts))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(FEATURES))


class ConfidenceHead(nn.Module):
    """P(node accepted | parent accepted) from ``node_features``: a two-layer MLP."""

    def __init__(self, hidden: int = DEFAULT_HIDDEN):
        super().__init__()
        self.hidden = hidden
        self.net = nn.Sequential(nn.Linear(len(FEATURES), hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(n, len(FEATURES)) -> (n,) logits."""
        return self.net(features).squeeze(-1)

    @torch.no_grad()
    def path_probabilities(self, draft: Draft) -> list[float]:
        """Every real node's probability of being accepted (root first, 1.0): the product of the
        conditional probabilities along its path."""
        count = draft.topology.num_nodes
        parents = draft.topology.parents[:count]
        conditional = torch.sigmoid(self(node_features(draft))).tolist() if count > 1 else []
        path = [1.0] * count
        for node in range(1, count):
            path[node] = path[int(parents[node])] * conditional[node - 1]
        return path


# ---- traces ---------------------------------------------------------------------------------------


@dataclass
class Traces:
    """Verified steps, as the decode loop reports them: each step's draft and accepted nodes."""

    steps: list[tuple[Draft, tuple[int, ...]]] = field(default_factory=list)

    def record(self, draft: Draft, accepted_nodes: tuple[int, ...]) -> None:
        if draft.topology.num_nodes > 1:  # a plain step teaches nothing
            self.steps.append((draft, tuple(accepted_nodes)))

    def conditional_samples(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, labels) of every node whose parent was accepted: labels 1.0 where the node was."""
        features, labels = [], []
        for draft, accepted in self.steps:
            parents = draft.topology.parents[: draft.topology.num_nodes]
            kept = set(accepted)
            rows = [node for node in range(1, len(parents)) if int(parents[node]) in kept]
            if rows:
                features.append(node_features(draft)[[node - 1 for node in rows]])
                labels.append(torch.tensor([float(node in kept) for node in rows]))
        if not features:
            return torch.zeros(0, len(FEATURES)), torch.zeros(0)
        return torch.cat(features), torch.cat(labels)


def fit_confidence(
    features: torch.Tensor,
    labels: torch.Tensor,
    hidden: int = DEFAULT_HIDDEN,
    steps: int = DEFAULT_FIT_STEPS,
    seed: int = 0,
) -> ConfidenceHead:
    """A ``ConfidenceHead`` fitted to (features, labels) by full-batch Adam on the binary
    cross-entropy; refuses an empty or one-class sample, which cannot teach a probability."""
    if labels.numel() == 0 or labels.min() == labels.max():
        raise ConfigError(
            f"fitting a confidence head needs accepted and rejected nodes; got {labels.numel()} nodes, "
            f"{int(labels.sum())} accepted: decode more prompts (--prompts) or longer (--max-new-tokens)"
        )
    torch.manual_seed(seed)
    head = ConfidenceHead(hidden)
    optimizer = torch.optim.Adam(head.parameters(), lr=FIT_LEARNING_RATE)
    loss_fn = nn.BCEWithLogitsLoss()
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn(head(features), labels).backward()
        optimizer.step()
    return head.eval()


def path_scores(steps: list[tuple[Draft, tuple[int, ...]]], estimate, learn=None) -> dict[str, float]:
    """How well ``estimate(draft)`` (path probabilities, root first) predicts which nodes were
    accepted, over every non-root node of ``steps``: log loss, Brier score, the mean estimate and
    the accepted share. ``learn(draft, accepted)``, if given, runs after each step's estimate (an
    online estimator is scored on what it knew before the step)."""
    loss = brier = predicted = accepted_count = 0.0
    nodes = 0
    for draft, accepted in steps:
        probabilities = estimate(draft)
        kept = set(accepted)
        for node in range(1, draft.topology.num_nodes):
            p = min(max(probabilities[node], 0.0), 1.0)
            label = float(node in kept)
            clipped = min(max(p, 1e-6), 1 - 1e-6)  # a certain miss costs log(1e6), not infinity
            loss -= label * math.log(clipped) + (1 - label) * math.log(1 - clipped)
            brier += (p - label) ** 2
            predicted += p
            accepted_count += label
            nodes += 1
        if learn is not None:
            learn(draft, accepted)
    if not nodes:
        return {"nodes": 0}
    return {
        "nodes": nodes,
        "log_loss": loss / nodes,
        "brier": brier / nodes,
        "mean_estimate": predicted / nodes,
        "accepted_share": accepted_count / nodes,
    }


# ---- saving and loading ---------------------------------------------------------------------------


class ConfidenceFormatError(HeadFormatError):
    """A confidence head's files cannot be read; the message names the file and the field."""


def check_confidence_space(directory: str | Path, hidden: int) -> None:
    """Refuse (InsufficientSpaceError naming the file) a ``directory`` without room for a
    confidence head of width ``hidden``: its fp32 weights plus ``CONFIDENCE_SPACE_MARGIN``."""
    with torch.device("meta"):  # the sizes, without the memory
        weights = sum(tensor.numel() * 4 for tensor in ConfidenceHead(hidden).state_dict().values())
    directory = Path(directory)
    check_free_space(
        directory,
        weights + CONFIDENCE_SPACE_MARGIN,
        f"the confidence head ({directory / CONFIDENCE_FILE}, {CONFIDENCE_CONFIG})",
    )


def save_confidence(head: ConfidenceHead, directory: str | Path, record: dict) -> list[Path]:
    """Write the head's weights and its config (``record``: how it was fitted and measured), each
    replaced whole (``write_atomically``: a link there is replaced, not written through), once the
    free space is checked (``check_confidence_space``)."""
    from safetensors.torch import save

    directory = Path(directory)
    check_confidence_space(directory, head.hidden)
    weights, config = directory / CONFIDENCE_FILE, directory / CONFIDENCE_CONFIG
    tensors = {name: tensor.contiguous() for name, tensor in head.state_dict().items()}
    # Serialised in memory (a few hundred bytes) and written by Python, whose close reports a full
    # disk as ENOSPC: safetensors' ``save_file`` returned without an error when its writes failed.
    data = save(tensors)
    write_atomically(weights, lambda temporary: temporary.write_bytes(data))
    settings = {"format": CONFIDENCE_FORMAT, "features": list(FEATURES), "hidden": head.hidden}
    write_text_atomically(config, json.dumps(settings | record, indent=2) + "\n")
    return [weights, config]


def load_confidence(directory: str | Path) -> ConfidenceHead:
    """The head saved in ``directory`` (weights read as tensors only, never unpickled)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = inside_head(directory, directory / CONFIDENCE_CONFIG)
    weights_path = inside_head(directory, directory / CONFIDENCE_FILE)
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise ConfidenceFormatError(
            f"{config_path}: cannot read the confidence head's config ({err})"
        ) from err
    if not isinstance(config, dict):
        raise ConfidenceFormatError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    if config.get("format") != CONFIDENCE_FORMAT:
        raise ConfidenceFormatError(
            f"{config_path}: format: expected {CONFIDENCE_FORMAT}, got {config.get('format')!r}"
        )
    if config.get("features") != list(FEATURES):
        raise ConfidenceFormatError(
            f"{config_path}: features: {config.get('features')!r} are not this version's {list(FEATURES)}"
        )
    hidden = config.get("hidden")
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
        raise ConfidenceFormatError(f"{config_path}: hidden: expected a positive integer, got {hidden!r}")
    try:
        state = load_file(str(weights_path))  # as large as the file, no larger
    except (OSError, SafetensorError) as err:
        detail = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise ConfidenceFormatError(f"{weights_path}: {detail} (config hidden: {hidden})") from err
    # ``hidden`` is checked against the tensors' shapes before the head is built: a hand-edited
    # width (10**12) is refused from the numbers, not by an attempt to allocate it.
    with torch.device("meta"):
        expected = ConfidenceHead(hidden).state_dict()
    if set(state) != set(expected):
        raise ConfidenceFormatError(
            f"{weights_path}: tensors {sorted(state)}, expected {sorted(expected)} (config hidden: {hidden})"
        )
    width = state["net.0.weight"].shape[0]
    if width != hidden:
        raise ConfidenceFormatError(
            f"{config_path}: hidden: {hidden}, but {weights_path} holds a width of {width}"
        )
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise ConfidenceFormatError(
                f"{weights_path}: {name} has shape {tuple(state[name].shape)}, a confidence head of "
                f"hidden {hidden} needs {tuple(tensor.shape)}"
            )
    for name, tensor in state.items():
        # a NaN probability prices every node at nothing: adaptive drafting would draft the root alone
        finite = torch.isfinite(tensor)
        if not finite.all():
            raise ConfidenceFormatError(
                f"{weights_path}: {name}: {int((~finite).sum())} of {tensor.numel()} values are not finite "
                "(NaN or infinite); fit the confidence head again (draftheads fit-confidence)"
            )
    head = ConfidenceHead(hidden)
    head.load_state_dict(state)
    return head.eval()

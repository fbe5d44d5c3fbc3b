"""Acceptance rules: which path of a verified tree the base model keeps, and its next token.

Each verifier is a pure function of (tree logits, node tokens, topology, sampling params, generator)
-> ``Acceptance`` (Leviathan et al. 2023 and Chen et al. 2023 for the sampling rule; Cai et al. 2024,
"Medusa", sec. 2.3.1 for typical acceptance):

- ``verify_greedy`` (T = 0, lossless): a child is accepted iff its token is the argmax at its parent.
- ``verify_sampling`` (T > 0, lossless): rejection sampling with deterministic (one-hot) proposals, as
  in EAGLE: at a node with target distribution p, try its children in candidate order; accept child x
  with probability p(x) / sum(p); on rejection set p(x) = 0 (renormalising implicitly); when every
  child is rejected, sample the next token from what remains of p. The emitted token at each node is
  then distributed exactly as p, so the output has the base model's sampling distribution.
- ``verify_typical`` (Medusa's typical acceptance, Cai et al. 2024 sec. 2.3.1): accept a child when
  p(x) > min(epsilon, delta * exp(-H(p))). LOSSY: the output no longer follows the base model's
  distribution. Opt-in only (``SamplingParams(acceptance="typical")``).
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real

import torch

from draftheads.infer.tree import PATH_PAD, TreeTopology

ACCEPTANCE_RULES = ("exact", "typical")
# Temperatures below this decode greedily, as vLLM's SamplingParams does (vllm/sampling_params.py,
# _SAMPLING_EPS): dividing logits by less overflows float32 to inf, and the softmax to NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


def _check_number(name: str, value, integer: bool = False) -> None:
    """Raise TypeError naming ``name``, ``value`` and the expected type unless ``value`` is a real
    number (an integer with ``integer``); a bool is neither."""
    expected = Integral if integer else Real
    if isinstance(value, bool) or not isinstance(value, expected):
        kind = "an integer" if integer else "a number"
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class SamplingParams:
    """How the base model's next-token distribution is shaped and how draft tokens are accepted.
    A temperature below ``GREEDY_BELOW_TEMPERATURE`` (1e-5) decodes greedily, as 0 does."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling: keep the smallest set with this much probability
    top_k: int = 0  # keep the k most likely tokens (0: all)
    acceptance: str = "exact"  # exact (lossless) | typical (Medusa, lossy)
    typical_epsilon: float = 0.09  # Medusa's posterior_threshold
    typical_delta: float = 0.3  # Medusa's posterior_alpha

    def __post_init__(self):
        _check_number("temperature", self.temperature)
        _check_number("top_p", self.top_p)
        _check_number("top_k", self.top_k, integer=True)
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got '{self.acceptance}'")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True)
class Acceptance:
    """The verified outcome of one tree: accepted node indices (root first) and the next token."""

    nodes: tuple[int, ...]  # root (0), then one accepted node per depth
    next_token: int  # the base model's own token after the last accepted node

    @property
    def accepted_drafts(self) -> int:
        """Draft tokens accepted (the accepted path's depth)."""
        return len(self.nodes) - 1


# ---- target distributions -----------------------------------------------------------------------


def target_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) fp32 probabilities after temperature, top-k and top-p, in the order
    transformers' ``generate`` applies them. Needs temperature > 0."""
    if params.greedy:
        raise ValueError("target_probabilities needs temperature > 0 (greedy decoding takes the argmax)")
    logits = logits.float() / params.temperature  # (..., V)
    if 0 < params.top_k < logits.shape[-1]:
        kth_best = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)  # (..., V)
    if params.top_p < 1:
        sorted_probabilities, order = torch.sort(probabilities, dim=-1, descending=True)
        # Drop a token when the tokens strictly more likely already hold top_p (the best always stays).
        mass_before = torch.cumsum(sorted_probabilities, dim=-1) - sorted_probabilities  # (..., V)
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probabilities = probabilities.masked_fill(drop, 0.0)
        probabilities = probabilities / probabilities.sum(dim=-1, keepdim=True)
    return probabilities


def sample_token(probabilities: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from (V,) probabilities (they need not sum to one)."""
    return int(torch.multinomial(probabilities, 1, generator=generator))


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Plain (non-speculative) choice of the next token from (V,) logits."""
    if params.greedy:
        return int(logits.argmax())
    return sample_token(target_probabilities(logits.cpu(), params), generator)


# ---- verifiers ----------------------------------------------------------------------------------


def _path_tokens(tokens: torch.Tensor, topology: TreeTopology) -> tuple[torch.Tensor, torch.Tensor]:
    """Per retrieve path (L, D): the child node of each edge and whether that edge exists."""
    paths = topology.retrieve_paths.to(tokens.device)  # (L, D + 1)
    children = paths[:, 1:]  # (L, D)
    exists = children != PATH_PAD
    return children, exists


def _best_path(edge_accepted: torch.Tensor, topology: TreeTopology) -> tuple[int, ...]:
    """The longest accepted prefix over retrieve paths (first path on ties) from (L, D) edge flags."""
    paths = topology.retrieve_paths  # (L, D + 1)
    if paths.shape[1] == 1:
        return (0,)
    accept_lengths = torch.cumprod(edge_accepted.long().cpu(), dim=1).sum(dim=1)  # (L,)
    best = int(accept_lengths.argmax())
    return tuple(paths[best, : int(accept_lengths[best]) + 1].tolist())


def verify_greedy(logits: torch.Tensor, tokens: torch.Tensor, topology: TreeTopology) -> Acceptance:
    """Lossless greedy acceptance.

    Args:
        logits: (N, V) base logits at each tree node (padding included).
        tokens: (N,) the nodes' token ids.
    """
    predictions = logits.argmax(dim=-1)  # (N,)
    children, exists = _path_tokens(tokens, topology)  # (L, D)
    parents = topology.retrieve_paths.to(tokens.device)[:, :-1].clamp(min=0)  # (L, D)
    edge_accepted = exists & (tokens[children.clamp(min=0)] == predictions[parents])  # (L, D)
    nodes = _best_path(edge_accepted, topology)
    return Acceptance(nodes=nodes, next_token=int(predictions[nodes[-1]]))


def verify_sampling(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    topology: TreeTopology,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Lossless rejection sampling over the tree (see the module docstring).

    Args:
        logits: (N, V) base logits at each tree node; tokens: (N,) node tokens.
        generator: a CPU generator (the walk runs on CPU: it touches one row per depth).
    """
    node_tokens = tokens.tolist()
    node, accepted = 0, [0]
    while True:
        probabilities = target_probabilities(logits[node].cpu(), params)  # (V,)
        chosen = None
        for child in topology.children[node]:
            token = node_tokens[child]
            remaining = float(probabilities.sum())
            accept_probability = float(probabilities[token]) / remaining
            if float(torch.rand((), generator=generator)) < accept_probability:
                chosen = child
                break
            probabilities[token] = 0.0  # rejected: the residual is p without x, renormalised
        if chosen is None:
            return Acceptance(nodes=tuple(accepted), next_token=sample_token(probabilities, generator))
        accepted.append(chosen)
        node = chosen


def verify_typical(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    topology: TreeTopology,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Medusa's typical acceptance (LOSSY; see the module docstring). The longest path whose every
    token passes the threshold at its parent wins; the next token is sampled from p at its end."""
    probabilities = target_probabilities(logits, params)  # (N, V)
    entropy = -(probabilities * torch.log(probabilities.clamp(min=1e-20))).sum(dim=-1)  # (N,)
    threshold = torch.minimum(
        torch.full_like(entropy, params.typical_epsilon), params.typical_delta * torch.exp(-entropy)
    )  # (N,)
    children, exists = _path_tokens(tokens, topology)  # (L, D)
    parents = topology.retrieve_paths.to(tokens.device)[:, :-1].clamp(min=0)  # (L, D)
    child_probability = probabilities[parents, tokens[children.clamp(min=0)]]  # (L, D)
    edge_accepted = exists & (child_probability > threshold[parents])
    nodes = _best_path(edge_accepted, topology)
    return Acceptance(nodes=nodes, next_token=sample_token(probabilities[nodes[-1]].cpu(), generator))


def verify_tree(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    topology: TreeTopology,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Dispatch on ``params``: greedy at T = 0, else exact rejection sampling or typical acceptance."""
    if params.greedy:
        return verify_greedy(logits, tokens, topology)
    if params.acceptance == "typical":
        return verify_typical(logits, tokens, topology, params, generator)
    return verify_sampling(logits, tokens, topology, params, generator)

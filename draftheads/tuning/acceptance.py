"""How often a head's drafts would be accepted, measured on held-out text through its Drafter.

On a held-out prompt and the base model's greedy continuation, one base forward gives the base's
greedy token g[t] after every prefix. At position t (root x[t+1] = g[t]) the depth-d draft is judged
against g[t+d], counted only while the true path is the greedy path (x[t+1+j] = g[t+j] for j < d).
The drafter is driven exactly as in decoding (``Drafter.commit`` over the accepted prefix) and asked
for its top-k along the true path (``Drafter.path_candidates``, teacher forcing). The rank of the
true token among them gives ``acceptance[d][r]`` = P(rank-r candidate at depth d is the base's token
| the path to its parent was accepted, i.e. every earlier depth within the top-k).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftheads.infer.draft import Drafter, drafter_for

# ---- the acceptance model -----------------------------------------------------------------------


@dataclass(frozen=True)
class AcceptanceModel:
    """``probabilities[d][r]``: P(the rank-r candidate at depth d + 1 is the base model's token | the
    path to its parent was accepted); ``counts[d]``: positions behind depth d + 1's estimate."""

    probabilities: tuple[tuple[float, ...], ...]  # (D, K)
    counts: tuple[int, ...]  # (D,)

    @property
    def depth(self) -> int:
        return len(self.probabilities)

    @property
    def top_k(self) -> int:
        return len(self.probabilities[0]) if self.probabilities else 0

    def path_probability(self, path: Sequence[int]) -> float:
        """P(every node on ``path`` (ranks by depth) is accepted), under the factorised model."""
        probability = 1.0
        for depth, rank in enumerate(path):
            if depth >= self.depth or rank >= self.top_k:
                return 0.0
            probability *= self.probabilities[depth][rank]
        return probability


def acceptance_from_ranks(ranks: torch.Tensor, top_k: int) -> AcceptanceModel:
    """Estimate the model from (P, D) ranks of the true token per position and depth: ``top_k`` for
    a miss, -1 where the depth cannot be judged (the true path left the greedy path, or the end)."""
    ranks = ranks.long()
    probabilities, counts = [], []
    for depth in range(ranks.shape[1]):
        parents_in_reach = (ranks[:, :depth] >= 0).all(dim=1) & (ranks[:, :depth] < top_k).all(dim=1)  # (P,)
        judged = ranks[parents_in_reach & (ranks[:, depth] >= 0), depth]  # (M,)
        counts.append(int(judged.numel()))
        hits = torch.bincount(judged.clamp(max=top_k), minlength=top_k + 1)[:top_k].double()  # (K,)
        probabilities.append(tuple((hits / max(judged.numel(), 1)).tolist()))
    return AcceptanceModel(tuple(probabilities), tuple(counts))


def true_token_ranks(candidates: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(M, K) candidate ids best first, (M,) true ids -> (M,) rank of the true id, K if absent."""
    hits = candidates == targets[:, None]  # (M, K)
    first = hits.int().argmax(dim=1)  # (M,)
    return torch.where(hits.any(dim=1), first, torch.full_like(first, candidates.shape[1]))


def judgeable(tokens: torch.Tensor, greedy: torch.Tensor, start: int, depth: int) -> torch.Tensor:
    """(P, D) bool for positions t = start .. T-2: may the depth-d draft at t be judged? Yes iff the
    true tokens up to depth d - 1, root included, are the base's greedy ones (x[t+1+j] = g[t+j],
    j < d), so that g[t+d] is what greedy verification would compare it with."""
    length = tokens.shape[0]
    matches = tokens[1:] == greedy[:-1]  # (T-1,) x[t+1] == g[t]
    positions = torch.arange(start, length - 1)  # (P,)
    result = torch.zeros(len(positions), depth, dtype=torch.bool)
    chain = torch.ones(len(positions), dtype=torch.bool)
    for d in range(1, depth + 1):
        index = positions + d - 1  # the newest link of the chain
        inside = index <= length - 2
        chain = chain & inside & matches[index.clamp(max=length - 2)]
        result[:, d - 1] = chain
    return result


# ---- measuring acceptance -----------------------------------------------------------------------


@torch.no_grad()
def base_forward(model, head, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One base forward over (T,) tokens: (T, V) next-token logits and (1, T, F) head features."""
    output = model(tokens[None].to(model.device), output_hidden_states=list(head.feature_layers))
    return output.logits[0], head.select_features(output.hidden_states)


def base_pass(model, head, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One base forward over (T,) tokens: (T,) greedy next tokens and (1, T, F) head features."""
    logits, features = base_forward(model, head, tokens)
    return logits.argmax(dim=-1).cpu(), features


@torch.no_grad()
def drafter_ranks(
    drafter: Drafter, features, tokens, greedy, start: int, depth: int, top_k: int
) -> torch.Tensor:
    """(P, depth) ranks of the true token among the drafter's top-k, positions t = start .. T-2.

    The drafter sees what it sees in decoding: ``prefill`` and ``commit`` over the true prefix, one
    position at a time, then ``path_candidates`` along the true path as far as it can be judged."""
    length = tokens.shape[0]
    valid = judgeable(tokens, greedy, start, depth)  # (P, D), each row true up to some depth
    ranks = torch.full(valid.shape, -1, dtype=torch.long)
    ids = tokens.to(features.device)
    drafter.prefill(features[:, :start], ids[None, 1 : start + 1])  # row i: features i, token i + 1
    for t in range(start, length - 1):
        drafter.commit(features[:, t : t + 1], ids[None, t + 1 : t + 2], t)
        row = t - start
        reach = int(valid[row].sum())
        if reach == 0:
            continue
        path = ids[t + 2 : t + 1 + reach]  # the true nodes at depths 1 .. reach - 1
        candidates = drafter.path_candidates(int(ids[t + 1]), t + 1, path, top_k).cpu()  # (reach, K)
        ranks[row, :reach] = true_token_ranks(candidates, greedy[t + 1 : t + 1 + reach])
    return torch.where(valid, ranks, torch.full_like(ranks, -1))


def measured_depth(head, max_depth: int) -> int:
    """Depths to measure: the head's own (Medusa K heads, MTP D modules), else ``max_depth``."""
    return head.num_draft_steps if head.num_draft_steps > 0 else max_depth


def measure_acceptance(
    model, head, sequences: Sequence[tuple[torch.Tensor, int]], depth: int, top_k: int, progress: bool = True
) -> AcceptanceModel:
    """The acceptance model over ``sequences`` of ((T,) tokens, index of the first generated token)."""
    from tqdm.auto import tqdm

    if top_k > head_vocab_size(head):
        raise ValueError(f"top_k {top_k} exceeds the head's vocabulary of {head_vocab_size(head)}")
    all_ranks = []
    for tokens, generated_from in tqdm(sequences, desc="acceptance", unit="seq", disable=not progress):
        greedy, features = base_pass(model, head, tokens)
        start = generated_from - 1  # the first root is the first generated token
        all_ranks.append(drafter_ranks(drafter_for(head), features, tokens, greedy, start, depth, top_k))
    return acceptance_from_ranks(torch.cat(all_ranks), top_k)


def head_vocab_size(head) -> int:
    return getattr(head, "draft_vocab_size", None) or head.base_spec.vocab_size

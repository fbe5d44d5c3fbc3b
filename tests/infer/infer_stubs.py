"""Shared by the infer tests (not named conftest.py, see tests/heads/head_fixtures.py).

Stub draft heads that know the base model's greedy future: always right or never right.

They follow the ``DraftHead`` drafting interface exactly and check what the decoder hands them
(positions continue the cache, masks cover cache + nodes), so a bookkeeping slip in
``draftheads.infer`` fails loudly instead of only lowering acceptance.

``reference`` is the base model's greedy token sequence (prompt + continuation, no EOS stop), long
enough to cover every position drafted. A right stub proposes ``reference[j]`` for position j; a
wrong one gives that token the lowest logit, so every candidate it ranks is wrong.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import DynamicCache

from draftheads.compat import cache_kwargs
from draftheads.heads.base import DraftHead, HeadConfig
from draftheads.infer.step_gate import StepGate

CONFIDENT = 30.0  # logit gap of a stub's choice


@torch.no_grad()
def greedy_reference(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """(T + new_tokens,) plain greedy decoding, token by token, ignoring EOS."""
    cache = DynamicCache(config=model.config)
    sequence = prompt[0].tolist()
    logits = model(prompt, **cache_kwargs(cache), use_cache=True).logits[0, -1]
    for _ in range(new_tokens):
        sequence.append(int(logits.argmax()))
        logits = model(torch.tensor([[sequence[-1]]]), **cache_kwargs(cache), use_cache=True).logits[0, -1]
    return torch.tensor(sequence)


def stub_logits(
    reference: torch.Tensor, positions: torch.Tensor, vocab_size: int, right: bool
) -> torch.Tensor:
    """(..., V) logits for the tokens at ``positions`` (...,): the reference token first (right) or
    last (wrong); positions past the reference get uniform logits."""
    logits = torch.zeros(*positions.shape, vocab_size)
    inside = positions < len(reference)
    targets = reference[positions.clamp(max=len(reference) - 1)]
    value = CONFIDENT if right else -CONFIDENT
    logits.scatter_(-1, targets[..., None], torch.where(inside, value, 0.0)[..., None])
    return logits


class _StubHead(DraftHead):
    config_class = HeadConfig
    batch_drafting = False  # their caches carry per-sequence bookkeeping besides key/value entries

    def __init__(self, model, reference: torch.Tensor, right: bool):
        super().__init__(HeadConfig(), model.config)
        self.reference = reference
        self.right = right
        self.attach(model)

    def _logits(self, positions: torch.Tensor) -> torch.Tensor:
        return stub_logits(self.reference, positions, self.base_spec.vocab_size, self.right)


class ParallelStub(_StubHead):
    """Medusa-like: finds the position of the features it is given in a table of the reference's
    features, and proposes the K tokens after the next one."""

    kind: ClassVar[str] = "stub-parallel"
    drafting: ClassVar[str] = "parallel"

    def __init__(self, model, reference: torch.Tensor, right: bool, num_heads: int = 4):
        super().__init__(model, reference, right)
        self.num_heads = num_heads
        with torch.no_grad():
            output = model(reference[None], output_hidden_states=True)
        self.table = self.select_features(output.hidden_states)[0]  # (S, h)

    @property
    def num_draft_steps(self) -> int:
        return self.num_heads

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        distances = torch.cdist(
            features.float(), self.table[None].float(), compute_mode="donot_use_mm_for_euclid_dist"
        )  # (B, T, S)
        position = distances.argmin(dim=-1)  # (B, T)
        assert float(distances.min(dim=-1).values.max()) < 1e-3, "features match no reference position"
        ahead = torch.arange(2, self.num_heads + 2)  # head k predicts k + 2 ahead
        return self._logits(position[..., None] + ahead)  # (B, T, K, V)


class AutoregressiveStub(_StubHead):
    """EAGLE-like: one cache; a depth-d node sits at the last catch-up position + d and sees its
    ancestors. Its state is its drafter position."""

    kind: ClassVar[str] = "stub-autoregressive"
    drafting: ClassVar[str] = "autoregressive"

    def new_cache(self):
        return DynamicCache()

    @staticmethod
    def _append(cache: DynamicCache, count: int) -> None:
        cache.update(torch.zeros(1, 1, count, 1), torch.zeros(1, 1, count, 1), 0)

    def catch_up(self, cache, features, next_token_ids, position_ids):
        past = cache.get_seq_length()
        expected = torch.arange(past, past + features.shape[1])
        assert torch.equal(position_ids[0].cpu(), expected), (
            f"catch_up positions {position_ids} after {past} rows"
        )
        accepted = self.reference[past + 1 : past + 1 + features.shape[1]]  # greedy decoding accepts these
        assert torch.equal(next_token_ids[0].cpu(), accepted), "catch_up must get the accepted tokens"
        self._append(cache, features.shape[1])
        last = position_ids[:, -1]  # (B,)
        return last[:, None].float(), self._logits(last + 2)  # (B, 1), (B, V)

    def draft_step(self, cache, depth, hidden, token_ids, position_ids, attention_mask):
        count = token_ids.shape[1]
        past = cache.get_seq_length()
        assert attention_mask.shape == (1, 1, count, past + count), (attention_mask.shape, past, count)
        assert torch.equal(position_ids.float(), hidden[..., 0] + 1), "a node must sit one after its parent"
        self._append(cache, count)
        return position_ids[..., None].float(), self._logits(position_ids + 2)  # (B, N, 1), (B, N, V)


class ModuleStub(_StubHead):
    """MTP-like: one cache per depth; every depth acts at the last catch-up position and sees only
    its cache and itself. Its state is (position, depth)."""

    kind: ClassVar[str] = "stub-modules"
    drafting: ClassVar[str] = "module-per-depth"

    def __init__(self, model, reference: torch.Tensor, right: bool, num_modules: int = 3):
        super().__init__(model, reference, right)
        self.num_modules = num_modules

    @property
    def num_draft_steps(self) -> int:
        return self.num_modules

    def new_cache(self):
        return [DynamicCache() for _ in range(self.num_modules)]

    def draft_caches(self, cache):
        return tuple(cache)

    def catch_up(self, cache, features, next_token_ids, position_ids):
        past = cache[0].get_seq_length()
        assert torch.equal(position_ids[0].cpu(), torch.arange(past, past + features.shape[1]))
        AutoregressiveStub._append(cache[0], features.shape[1])
        last = position_ids[:, -1]  # (B,)
        state = torch.stack([last.float(), torch.zeros_like(last, dtype=torch.float)], dim=-1)  # (B, 2)
        return state, self._logits(last + 2)

    def draft_step(self, cache, depth, hidden, token_ids, position_ids, attention_mask):
        count = token_ids.shape[1]
        assert 1 <= depth < self.num_modules, depth
        past = cache[depth].get_seq_length()
        assert attention_mask.shape == (1, 1, count, past + count), (attention_mask.shape, past, count)
        assert torch.equal(position_ids.float(), hidden[..., 0]), "every module acts at the catch-up position"
        assert bool((hidden[..., 1] == depth - 1).all()), (
            "a node's parent state comes from the previous depth"
        )
        AutoregressiveStub._append(cache[depth], count)
        state = torch.stack(
            [position_ids.float(), torch.full_like(position_ids, depth, dtype=torch.float)], dim=-1
        )
        return state, self._logits(position_ids + depth + 2)


class _History(DynamicCache):
    """A stub drafter cache that also remembers the accepted tokens."""

    def __init__(self, first_token: int):
        super().__init__()
        self.tokens = [first_token]


class SelfDraftStub(_StubHead):
    """Drafts with the base model itself, recomputed from scratch at every node: its proposals are
    the base model's own most likely tokens, so acceptance is high (sampling tests need both many
    acceptances and many rejections). The state of a node is its path of draft tokens (-1 padded)."""

    kind: ClassVar[str] = "stub-self-draft"
    drafting: ClassVar[str] = "autoregressive"
    MAX_DEPTH = 8

    def __init__(self, model, first_token: int):
        super().__init__(model, torch.zeros(0, dtype=torch.long), right=True)
        self._base = (model,)  # a tuple: not registered as a submodule
        self.first_token = first_token

    def new_cache(self):
        return _History(self.first_token)

    def _base_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            return self._base[0](torch.tensor(sequences)).logits[:, -1].float()  # (n, V)

    def catch_up(self, cache, features, next_token_ids, position_ids):
        AutoregressiveStub._append(cache, features.shape[1])
        cache.tokens.extend(next_token_ids[0].tolist())
        state = torch.full((1, self.MAX_DEPTH), -1.0)
        return state, self._base_logits([cache.tokens])  # (1, L), (1, V)

    def draft_step(self, cache, depth, hidden, token_ids, position_ids, attention_mask):
        AutoregressiveStub._append(cache, token_ids.shape[1])
        paths = hidden[0].clone()  # (N, L)
        paths[:, depth - 1] = token_ids[0].float()
        sequences = [cache.tokens + [int(t) for t in path[:depth]] for path in paths]
        return paths[None], self._base_logits(sequences)[None]  # (1, N, L), (1, N, V)


def gate_that_measured(drafting_pays: bool, batch: int = 1) -> StepGate:
    """A step gate that has measured ``batch``-row steps: drafting emitting twice the tokens per
    second of plain steps, or a quarter; it never probes the other kind. Tests that need every
    step to draft (or none) on a tiny model, whose wall-clock would make the choice, set it."""
    gate = StepGate(probe_every=10**9, warmup_steps=1)
    gate.record(batch, True, tokens=2, seconds=1.0 if drafting_pays else 8.0)
    gate.record(batch, False, tokens=1, seconds=1.0)
    return gate

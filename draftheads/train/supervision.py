"""Where a batch's predictions are scored, laid out before the batch moves to the device.

Each objective (``draftheads.train.objective``) scores draft step s's prediction of a supervised
token q at one drafter row: Medusa head k and MTP module k at row q - (k + 2), EAGLE-1 at q - 2,
EAGLE-3's step j at the slot of row q - (j + 2) (``ChainSlots``), DFlash's block row k at the
block anchored at q - k. Finding those rows reads the masks' values (``nonzero``, the widths of
EAGLE-3's steps, DFlash's anchors): on a GPU each read makes the host wait
for every queued kernel. Everything they depend on, the masks, the rows' seeds and the head's
sampling settings, is on the host before the batch moves, so the training loop lays the rows out
there (``draftheads.train.batching.with_host_inputs``) and the objective only indexes device
tensors with them. A batch that comes without (evaluation, tests) gets the same layout from the
same functions on its own device: the objective's result does not depend on where it was made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass, replace

import torch

from draftheads.heads.eagle3 import ChainSlots, Eagle3Config
from draftheads.heads.layers import shift_left
from draftheads.train import draws


@dataclass(frozen=True)
class PredictedRows:
    """One draft step's scored predictions, each (M,) long: the batch row, the drafter row making
    the prediction (EAGLE-3: its slot in ``ChainSlots``), the position q of the token it predicts,
    and (EAGLE-3) the row of q in the objective's table of the base's targets."""

    batch: torch.Tensor
    row: torch.Tensor
    position: torch.Tensor
    table_row: torch.Tensor | None = None


@dataclass(frozen=True)
class Supervision:
    """The scored predictions of a batch, per draft step; EAGLE-3 adds its chains' slots and
    ``targets``, the (batch, position) pairs of the distinct tokens its steps predict (its table
    of targets holds one row per pair, in this order); DFlash its blocks' anchors and, for base
    targets, the positions whose base argmax it needs."""

    steps: tuple[PredictedRows, ...]
    chains: ChainSlots | None = None
    targets: tuple[torch.Tensor, torch.Tensor] | None = None
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None  # DFlash: (anchors, valid), each (B, N)

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> Supervision:
        """The same layout with ``function`` applied to every tensor (``.to(device)``, pinning)."""
        return _map(self, function)

    def to(self, device, non_blocking: bool = False) -> Supervision:
        """Every tensor on ``device`` (from pinned host memory the copies do not make the host wait)."""
        return self.map(lambda tensor: tensor.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Supervision:
        return self.map(torch.Tensor.pin_memory)


def _map(value, function):
    """``value`` (tensors, ints, None, tuples and dataclasses of them) with ``function`` applied
    to every tensor."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, tuple):
        return tuple(_map(item, function) for item in value)
    if is_dataclass(value):
        return replace(value, **{f.name: _map(getattr(value, f.name), function) for f in fields(value)})
    return value


# ---- what a step scores -----------------------------------------------------------------------


def supervised_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, T) bool: the supervised tokens (``loss_mask`` 1, not padding)."""
    supervised = loss_mask.bool()
    if attention_mask is not None:
        supervised = supervised & attention_mask.bool()
    return supervised


def batch_seeds(sample_seed: int | torch.Tensor | None, batch_size: int) -> torch.Tensor:
    """(B,) the seed of each row's draws: ``sample_seed`` itself when it is one per row (the
    training loop's ``draws.row_seeds``); for one int, seeds of the rows by batch slot (a row's
    draws then follow its slot); for None, seeds from torch's global RNG."""
    if sample_seed is None:
        return torch.randint(0, draws.MASK + 1, (batch_size,))
    if isinstance(sample_seed, torch.Tensor) and sample_seed.dim() == 1:
        if sample_seed.numel() != batch_size:
            raise ValueError(f"{sample_seed.numel()} row seeds for a batch of {batch_size} rows")
        return sample_seed
    return draws.row_seeds(int(sample_seed), 0, range(batch_size))


def sample_keep(seeds: torch.Tensor, length: int, fraction: float, device=None) -> torch.Tensor | None:
    """(B, T) bool, each entry True with probability ``fraction``: position t of row b is kept iff
    its ``draws.uniform`` (of ``seeds[b]``, t) is below ``fraction``, whatever T or the other
    rows. None when ``fraction`` >= 1 (keep everything)."""
    if fraction >= 1.0:
        return None
    return draws.uniform(seeds, draws.LOSS_TOKENS, length, device=device) < fraction


def cod_chain_steps(seeds: torch.Tensor, length: int, config: Eagle3Config, device=None) -> torch.Tensor:
    """(B, T) long in [1, ttt_steps]: the TTT steps each row's chain runs under COD sampling. Step
    j >= 1 is reached iff the row's ``draws.uniform`` is below max(cod_ratio^j, cod_ratio_min):
    the thresholds never rise, so a chain that stops at step j reaches no later step."""
    uniform = draws.uniform(seeds, draws.CHAIN_STEPS, length, device=device)  # (B, T)
    steps = torch.ones_like(uniform, dtype=torch.long)
    for step in range(1, config.ttt_steps):
        steps += uniform < max(config.cod_ratio**step, config.cod_ratio_min)
    return steps


# ---- per kind ---------------------------------------------------------------------------------


def offset_rows(supervised: torch.Tensor, offsets: range) -> tuple[PredictedRows, ...]:
    """Per offset o: the rows q - o >= 0 that predict a supervised token q."""
    batch, position = supervised.nonzero(as_tuple=True)
    steps = []
    for offset in offsets:
        reach = position >= offset
        steps.append(PredictedRows(batch[reach], position[reach] - offset, position[reach]))
    return tuple(steps)


def token_steps(head, supervised, keep, seeds) -> Supervision:
    """Medusa head k and MTP module k + 1: row q - (k + 2) predicts t_q."""
    kept = supervised if keep is None else supervised & keep
    return Supervision(offset_rows(kept, range(2, head.num_draft_steps + 2)))


def eagle_steps(head, supervised, keep, seeds) -> Supervision:
    """EAGLE-1's one step: row q - 2 predicts t_q through the feature of q - 1."""
    kept = supervised if keep is None else supervised & keep
    return Supervision(offset_rows(kept, range(2, 3)))


def eagle3_steps(head, supervised, keep, seeds) -> Supervision:
    """EAGLE-3's training-time test: row i's chain predicts t_{i+2+j} at step j. It runs past step
    0 only if one of those is supervised (prompt rows do not), and only if sampled (``keep``
    samples chains, not tokens; COD sampling, by ``seeds``, how far each chain runs)."""
    config = head.config
    length = supervised.shape[1]
    targets_of_row = [shift_left(supervised, 2 + step) for step in range(config.ttt_steps)]  # S x (B, T)
    rows = torch.stack(targets_of_row).any(dim=0)  # (B, T)
    if keep is not None:
        rows = rows & keep
    if seeds is not None and config.cod_ratio < 1.0:
        rows = rows.long() * cod_chain_steps(seeds, length, config, rows.device)  # (B, T)
    chains = ChainSlots.of(rows, config.ttt_steps)
    pairs = []
    for step in range(config.ttt_steps):
        index, reaches = chains.at_step(step)  # (B, R_j) each
        target = (index + 2 + step).clamp(max=length - 1)  # (B, R_j)
        scored = reaches & (index + 2 + step < length) & supervised.gather(1, target)
        batch, slot = scored.nonzero(as_tuple=True)
        pairs.append((batch, slot, target[batch, slot]))
    # One row of targets per distinct token q: its target distribution is the base model's at q - 1.
    needed = torch.zeros_like(supervised)
    for batch, _, position in pairs:
        needed[batch, position] = True
    needed_batch, needed_position = needed.nonzero(as_tuple=True)
    lookup = torch.full(needed.shape, -1, dtype=torch.long, device=needed.device)
    lookup[needed_batch, needed_position] = torch.arange(needed_batch.numel(), device=needed.device)
    steps = tuple(PredictedRows(b, s, q, lookup[b, q]) for b, s, q in pairs)
    return Supervision(steps, chains, (needed_batch, needed_position))


def dflash_steps(head, supervised, keep, seeds) -> Supervision:
    """DFlash (``draftheads.train.objective.dflash_objective``): blocks anchored at positions a
    whose next token is supervised, up to ``anchors_per_sequence`` a row (by the rows' ``seeds``
    in training, evenly spaced without); block row k predicts t_{a+k}, a step per k."""
    from draftheads.heads.dflash import choose_anchors

    length = supervised.shape[1]
    candidates = shift_left(supervised, 1)  # (B, T): t_{a+1} is supervised
    candidates[:, 0] = False  # a block reads the context before its anchor: none at 0
    if keep is not None:
        candidates = candidates & keep
    priority = (
        None if seeds is None else draws.uniform(seeds, draws.ANCHORS, length, device=supervised.device)
    )
    anchors, valid = choose_anchors(candidates, head.config.anchors_per_sequence, priority)  # (B, N) each
    steps = []
    needed = torch.zeros_like(supervised)
    for row in range(1, head.block_size):
        target = anchors + row  # (B, N)
        scored = valid & (target < length) & supervised.gather(1, target.clamp(max=length - 1))
        batch, slot = scored.nonzero(as_tuple=True)
        steps.append(PredictedRows(batch, slot, target[batch, slot]))
        needed[batch, target[batch, slot]] = True
    targets = needed.nonzero(as_tuple=True) if head.config.targets == "base" else None
    return Supervision(tuple(steps), targets=targets, anchors=(anchors, valid))


PLANNERS: dict[str, Callable[..., Supervision]] = {
    "medusa": token_steps,
    "mtp": token_steps,
    "eagle": eagle_steps,
    "eagle3": eagle3_steps,
    "peagle": eagle3_steps,  # EAGLE-3's training-time test with mask rows (heads.peagle)
    "dflash": dflash_steps,
}


def plan_supervision(
    head,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor | None,
    token_fraction: float = 1.0,
    seeds: torch.Tensor | None = None,
) -> Supervision:
    """What ``head``'s objective scores on a batch, on the masks' device. ``seeds`` (B,): the rows'
    seeds in training (``batch_seeds``), by which ``token_fraction`` samples what is scored
    (``sample_keep``), COD sampling ends chains and DFlash draws anchors; None (evaluation) scores
    everything."""
    if head.kind not in PLANNERS:
        raise ValueError(
            f"no supervision planner for head kind '{head.kind}'; known: {', '.join(sorted(PLANNERS))}"
        )
    keep = None if seeds is None else sample_keep(seeds, loss_mask.shape[1], token_fraction, loss_mask.device)
    return PLANNERS[head.kind](head, supervised_mask(loss_mask, attention_mask), keep, seeds)


def training_supervision(head, batch: dict, token_fraction: float) -> Supervision:
    """``plan_supervision`` of a training ``batch`` (input_ids, loss_mask, attention_mask and each
    row's ``sample_seed``), as the objective of ``head`` in training mode lays it out."""
    seeds = batch_seeds(batch.get("sample_seed"), batch["input_ids"].shape[0])
    return plan_supervision(head, batch["loss_mask"], batch["attention_mask"], token_fraction, seeds)

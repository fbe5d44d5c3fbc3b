"""What a training step scores, laid out on the host (``draftheads.train.supervision``): the
objective's loss, gradients and counts are the ones it gets laying the rows out itself; and the
frozen base's states of a right-padded batch need no padding mask."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from draftheads.heads import DFlashConfig, Eagle3Config, build_head
from draftheads.train.batching import with_host_inputs
from draftheads.train.draws import row_seeds
from draftheads.train.hidden_states import OnlineHiddenStates
from draftheads.train.metrics import base_hidden_states
from draftheads.train.objective import compute_objective
from draftheads.train.supervision import training_supervision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "heads"))
from head_fixtures import HEAD_CONFIGS

CONFIGS = {
    **HEAD_CONFIGS,
    "eagle3-cod": Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=3, cod_ratio=0.5),
    "dflash": DFlashConfig(feature_layers=(1, 2), block_size=4, anchors_per_sequence=3),
    "dflash-base-targets": DFlashConfig(feature_layers=(1, 2), block_size=4, targets="base"),
}


def _host_batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 256, (3, 20), generator=generator)
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, :5] = 0  # a prompt
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 14:] = 0  # right padding
    attention_mask[2, 9:] = 0
    loss_mask = loss_mask * attention_mask
    seeds = row_seeds(7, 0, range(3))
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        "sample_seed": seeds,
    }


def _objective(head, base, batch, fraction, supervision=None):
    head.zero_grad()
    hidden = base_hidden_states(base, batch["input_ids"], batch["attention_mask"])
    output = compute_objective(
        head,
        hidden,
        batch["input_ids"],
        batch["loss_mask"],
        batch["attention_mask"],
        fraction,
        batch["sample_seed"],
        supervision=supervision,
    )
    output.loss.backward()
    grads = [p.grad.clone() for p in head.parameters() if p.grad is not None]
    return output, grads


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_the_host_layout_gives_the_objective_its_own_result(kind, fraction, tiny_llama):
    head = build_head(tiny_llama, CONFIGS[kind]).train()
    batch = _host_batch()
    prepare = functools.partial(training_supervision, head, token_fraction=fraction)
    planned = with_host_inputs(batch, lambda host_batch: {"supervision": prepare(host_batch)})
    assert planned["supervision"] is not None
    inline, inline_grads = _objective(head, tiny_llama, batch, fraction)
    given, given_grads = _objective(head, tiny_llama, batch, fraction, planned["supervision"])
    assert torch.equal(given.loss, inline.loss)
    assert torch.equal(given.counted, inline.counted) and torch.equal(given.top1_correct, inline.top1_correct)
    assert len(given_grads) == len(inline_grads) and all(map(torch.equal, given_grads, inline_grads))
    if fraction < 1.0:  # the control: the layout of another sampling scores other tokens
        everything = training_supervision(head, batch, 1.0)
        other, _ = _objective(head, tiny_llama, batch, fraction, everything)
        assert not torch.equal(other.counted, given.counted)


def test_the_layout_is_made_from_host_tensors_only():
    batch = _host_batch()
    batch["attention_mask"] = batch["attention_mask"].to("meta")
    with pytest.raises(ValueError, match="attention_mask"):
        with_host_inputs(batch, lambda b: {})


def test_every_objective_has_a_planner():
    from draftheads.train.objective import OBJECTIVES
    from draftheads.train.supervision import PLANNERS

    assert set(PLANNERS) == set(OBJECTIVES)


@pytest.mark.parametrize("factory", ["make_tiny_llama", "make_tiny_gemma3"])
def test_base_states_of_a_right_padded_batch_need_no_padding_mask(factory):
    """Online training drops the padding mask (OnlineHiddenStates): every real token's states are
    those of the masked forward, on a full-attention base and on one with sliding windows shorter
    than the rows. Left padding, the control, would change them."""
    from tests import conftest

    model = getattr(conftest, factory)()
    batch = _host_batch()
    online = OnlineHiddenStates(model)(batch, "train")
    masked = base_hidden_states(model, batch["input_ids"], batch["attention_mask"])
    real = batch["attention_mask"].bool()
    for got, expected in zip(online, masked, strict=True):
        torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)

    left_ids = torch.stack([row.roll(int((~mask).sum())) for row, mask in zip(batch["input_ids"], real)])
    left_mask = torch.stack([mask.roll(int((~mask).sum())) for mask in real])
    unmasked = base_hidden_states(model, left_ids, None)[-1][left_mask]
    assert not torch.allclose(
        unmasked, base_hidden_states(model, left_ids, left_mask.long())[-1][left_mask], atol=1e-3
    )

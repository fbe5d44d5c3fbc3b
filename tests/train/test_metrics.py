import pytest
import torch

from draftheads.train.metrics import chain_acceptance, evaluate
from draftheads.train.objective import ObjectiveOutput


def test_chain_acceptance():
    assert chain_acceptance([]) == 1.0
    assert chain_acceptance([1.0, 1.0, 1.0]) == 4.0
    assert chain_acceptance([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert chain_acceptance([0.0, 0.9]) == 1.0


def test_evaluate_sums_counts_over_batches():
    outputs = iter(
        [
            ObjectiveOutput(
                torch.tensor(2.0), torch.tensor([3, 1]), torch.tensor([4, 2]), torch.tensor([4, 4])
            ),
            ObjectiveOutput(
                torch.tensor(4.0), torch.tensor([1, 0]), torch.tensor([2, 1]), torch.tensor([4, 2])
            ),
        ]
    )
    seen = []

    def objective(batch):
        seen.append(batch["input_ids"].tolist())
        return next(outputs)

    batch = {
        "input_ids": torch.tensor([[5, 6, 7]]),
        "attention_mask": torch.ones(1, 3, dtype=torch.long),
        "loss_mask": torch.ones(1, 3, dtype=torch.long),
    }
    result = evaluate(objective, [batch, batch], torch.device("cpu"))
    assert seen == [[[5, 6, 7]]] * 2  # each batch once
    assert result.loss == pytest.approx(3.0)
    assert result.top1 == pytest.approx((4 / 8, 1 / 6))
    assert result.top5 == pytest.approx((6 / 8, 3 / 6))
    assert result.counted == (8, 6)
    assert result.chain_acceptance == pytest.approx(1 + 0.5 + 0.5 / 6)

"""The acceptance confidence head: its features on hand-made drafts, its path probabilities, the
samples it learns from, fitting on a signal it must find, saving and refusing broken files, greedy
output identical to the base's when it prices adaptive drafting, and ``fit-confidence`` end to end."""

from __future__ import annotations

import json

import pytest
import torch
from infer_stubs import greedy_reference

from draftheads.heads import Eagle3Config, MtpConfig, build_head
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.adaptive import AdaptiveDrafter, Calibration
from draftheads.infer.confidence import (
    CONFIDENCE_CONFIG,
    CONFIDENCE_FILE,
    FEATURES,
    LOG_FLOOR,
    ConfidenceFormatError,
    ConfidenceHead,
    Traces,
    fit_confidence,
    load_confidence,
    node_features,
    path_scores,
    save_confidence,
)
from draftheads.infer.draft import Draft
from draftheads.infer.tree import tree_topology
from draftheads.infer.verify_cost import CostCurve
from tests.conftest import make_tiny_llama
from tests.data.data_fixtures import save_tiny_base

pytestmark = pytest.mark.usefixtures("single_thread")

COLUMN = {name: index for index, name in enumerate(FEATURES)}


def draft_of(parents, sources, scores) -> Draft:
    return Draft(torch.arange(len(parents)), tree_topology(parents), tuple(sources), tuple(scores))


# root; two children of the root (head, then context); a grandchild proposed by both
SMALL = draft_of([-1, 0, 0, 1], ["", "eagle3", "context", "eagle3+context"], [1.0, 0.5, 0.8, 0.25])


def test_features_name_each_node_by_score_depth_rank_and_source():
    rows = node_features(SMALL)
    assert rows.shape == (3, len(FEATURES))
    first, second, third = rows
    assert first[COLUMN["log_conditional_score"]] == pytest.approx(torch.log(torch.tensor(0.5)))
    assert first[COLUMN["log_parent_score"]] == 0.0  # the root's score is 1
    assert third[COLUMN["log_conditional_score"]] == pytest.approx(torch.log(torch.tensor(0.5)))  # 0.25 / 0.5
    assert third[COLUMN["log_parent_score"]] == pytest.approx(torch.log(torch.tensor(0.5)))
    assert first[COLUMN["depth_1"]] == second[COLUMN["depth_1"]] == third[COLUMN["depth_2"]] == 1.0
    assert second[COLUMN["rank_0"]] == 1.0 and first[COLUMN["rank_1"]] == 1.0  # 0.8 outranks 0.5
    assert (first[COLUMN["from_head"]], first[COLUMN["from_text"]]) == (1.0, 0.0)
    assert (second[COLUMN["from_head"]], second[COLUMN["from_text"]]) == (0.0, 1.0)
    assert (third[COLUMN["from_head"]], third[COLUMN["from_text"]]) == (1.0, 1.0)
    assert rows.sum(dim=1)[0] == pytest.approx(float(torch.log(torch.tensor(0.5))) + 3)  # one-hots: 3 ones
    deep = draft_of(list(range(-1, 11)), [""] + ["suffix"] * 11, [1.0] + [0.0] * 11)
    last = node_features(deep)[-1]
    assert last[COLUMN["depth_7+"]] == 1.0 and last[COLUMN["log_conditional_score"]] == LOG_FLOOR


def test_path_probabilities_multiply_down_the_tree():
    head = ConfidenceHead()
    conditional = torch.sigmoid(head(node_features(SMALL))).tolist()
    path = head.path_probabilities(SMALL)
    assert path[0] == 1.0
    assert path[1:3] == pytest.approx(conditional[:2])
    assert path[3] == pytest.approx(conditional[0] * conditional[2])
    assert head.path_probabilities(draft_of([-1], [""], [1.0])) == [1.0]


def test_samples_are_the_nodes_whose_parent_was_accepted():
    traces = Traces()
    traces.record(SMALL, (0, 1))  # node 1 accepted, so node 3 (its child) was judged; node 2 was not
    traces.record(draft_of([-1], [""], [1.0]), (0,))  # a plain step: nothing to learn
    features, labels = traces.conditional_samples()
    assert len(traces.steps) == 1
    assert labels.tolist() == [1.0, 0.0, 0.0]  # nodes 1, 2 (children of the root), 3 (child of 1)
    assert torch.equal(features, node_features(SMALL))
    traces.record(SMALL, (0,))  # nothing accepted: only the root's children were judged
    assert traces.conditional_samples()[1].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def synthetic_samples(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features whose conditional score alone decides acceptance (accepted above e^-1)."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.zeros(count, len(FEATURES))
    features[:, COLUMN["log_conditional_score"]] = -3 * torch.rand(count, generator=generator)
    features[:, COLUMN["depth_1"]] = 1.0
    return features, (features[:, COLUMN["log_conditional_score"]] > -1.0).float()


def test_fitting_finds_the_signal_and_refuses_one_class():
    features, labels = synthetic_samples(400, seed=0)
    head = fit_confidence(features, labels, steps=300)
    test_features, test_labels = synthetic_samples(200, seed=1)
    predicted = torch.sigmoid(head(test_features))
    assert ((predicted > 0.5).float() == test_labels).float().mean() > 0.95
    untrained = torch.sigmoid(ConfidenceHead()(test_features))  # negative control: no signal learnt
    assert ((untrained > 0.5).float() == test_labels).float().mean() < 0.9
    with pytest.raises(ValueError, match="accepted and rejected"):
        fit_confidence(features, torch.ones(400))


def test_path_scores_grade_estimates_against_what_was_accepted():
    steps = [(SMALL, (0, 1, 3))] * 4
    perfect = path_scores(steps, lambda draft: [1.0, 1.0, 0.0, 1.0])
    wrong = path_scores(steps, lambda draft: [1.0, 0.0, 1.0, 0.0])
    assert perfect["log_loss"] < 1e-4 and perfect["brier"] == 0.0 and perfect["nodes"] == 12
    assert wrong["log_loss"] > 10 and wrong["brier"] == 1.0
    assert perfect["accepted_share"] == pytest.approx(2 / 3)
    # an online estimator is scored before it learns each step: it starts from its prior
    calibration = Calibration()
    learning = path_scores(
        steps, calibration.path_probabilities, lambda d, a: calibration.record(d.sources, d.scores, a)
    )
    assert learning["log_loss"] > path_scores(steps, calibration.path_probabilities)["log_loss"]


def test_saved_head_loads_back_and_broken_files_are_named(tmp_path):
    head = fit_confidence(*synthetic_samples(200, seed=0), steps=50)
    paths = save_confidence(head, tmp_path, {"note": "test"})
    assert [p.name for p in paths] == [CONFIDENCE_FILE, CONFIDENCE_CONFIG]
    loaded = load_confidence(tmp_path)
    assert loaded.path_probabilities(SMALL) == head.path_probabilities(SMALL)
    config = json.loads((tmp_path / CONFIDENCE_CONFIG).read_text())
    assert config["note"] == "test" and config["features"] == list(FEATURES)
    broken = {
        "features": (dict(config, features=["x"]), "features: "),
        "hidden": (dict(config, hidden=0), "hidden: expected a positive integer, got 0"),
        "format": (dict(config, format=9), "format: expected 1, got 9"),
    }
    for content, message in broken.values():
        (tmp_path / CONFIDENCE_CONFIG).write_text(json.dumps(content))
        with pytest.raises(ConfidenceFormatError, match=message):
            load_confidence(tmp_path)
    (tmp_path / CONFIDENCE_CONFIG).write_text("{not json")
    with pytest.raises(ConfidenceFormatError, match=CONFIDENCE_CONFIG):
        load_confidence(tmp_path)
    (tmp_path / CONFIDENCE_CONFIG).write_text(json.dumps(config))
    (tmp_path / CONFIDENCE_FILE).write_bytes(b"\x00" * 16)
    with pytest.raises(ConfidenceFormatError, match=CONFIDENCE_FILE):
        load_confidence(tmp_path)
    assert (tmp_path / CONFIDENCE_CONFIG).read_text() == json.dumps(config)  # nothing rewritten


COST = CostCurve((1, 4, 8, 16), (1.0, 1.3, 1.6, 2.2))


@pytest.mark.parametrize(
    "config", [Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64), MtpConfig(num_modules=2)]
)
def test_greedy_output_is_the_base_models_with_the_confidence_head(config, monkeypatch):
    model = make_tiny_llama()
    torch.manual_seed(0)
    head = build_head(model, config)
    confidence = fit_confidence(*synthetic_samples(200, seed=0), steps=50)
    generator = SpeculativeGenerator(
        model, head, context=True, adaptive=True, cost=COST, confidence=confidence
    )
    assert generator.method.endswith("+context/adaptive/confidence")
    traces = Traces()
    generator.step_observers.append(traces.record)
    priced = []  # the trees the confidence head priced: proof that adaptive drafting asked it
    original = ConfidenceHead.path_probabilities
    monkeypatch.setattr(ConfidenceHead, "path_probabilities", lambda h, d: priced.append(d) or original(h, d))
    proposals = []  # each tree is priced once, when it is drafted, not again for the step gate
    propose_steps = AdaptiveDrafter.propose_steps
    monkeypatch.setattr(
        AdaptiveDrafter, "propose_steps", lambda a, *args: proposals.append(args) or propose_steps(a, *args)
    )
    for seed in range(2):
        prompt = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(seed))
        result = generator.generate(prompt, max_new_tokens=24)
        assert result.sequences[0].tolist() == greedy_reference(model, prompt, 24).tolist()
    assert traces.steps  # the observer saw the verified steps
    assert len(priced) >= len(traces.steps) // 2  # most steps drafted, each tree priced by the head
    assert len(priced) == len(proposals)
    with pytest.raises(ValueError, match="adaptive=True"):
        SpeculativeGenerator(model, head, confidence=confidence)


def test_fit_confidence_command_saves_a_head_bench_and_the_generator_use(tmp_path):
    from draftheads.base_model import load_base
    from draftheads.bench import speculative_methods
    from draftheads.cli import main

    tiny_base_dir = save_tiny_base(tmp_path / "base")
    model, tokenizer = load_base(str(tiny_base_dir), dtype="float32")
    head_dir = tmp_path / "head"
    torch.manual_seed(0)
    build_head(model, MtpConfig(num_modules=2), str(tiny_base_dir)).save_pretrained(head_dir)
    before = sorted(p.name for p in head_dir.iterdir())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [f"Say {i} twice."]}) + "\n" for i in range(4)))
    arguments = ["fit-confidence", "--heads", str(head_dir), "--data", str(prompts), "--skip", "0"]
    assert (
        main([*arguments, "--prompts", "4", "--max-new-tokens", "24", "--steps", "50", "--pack", "off"]) == 0
    )
    assert sorted(p.name for p in head_dir.iterdir()) == sorted([*before, CONFIDENCE_CONFIG, CONFIDENCE_FILE])
    record = json.loads((head_dir / CONFIDENCE_CONFIG).read_text())
    assert record["fitting"]["prompts"] == 3 and record["held_out"]["prompts"] == 1
    for name in ("confidence", "calibration"):
        assert record["held_out"][name]["nodes"] > 0 and 0 <= record["held_out"][name]["brier"] <= 1
    loaded = SpeculativeGenerator.from_pretrained(head_dir, dtype="float32", confidence=True, pack=False)
    assert loaded.method == "mtp+context/adaptive/confidence"
    names = [
        m.name for m in speculative_methods([str(head_dir)], model, tokenizer, None, "cpu", adaptive=True)
    ]
    assert [name.split(":")[0] for name in names] == ["mtp", "mtp/adaptive", "mtp/adaptive/confidence"]

"""Tree tuning: the choice on synthetic acceptance/cost models is the known optimum; acceptance is
measured right on stub heads that are always / never right and is a distribution on real heads;
the saved tree loads back and is the default of the generator and of bench."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from draftheads.heads import DFlashConfig, Eagle3Config, MedusaConfig, MtpConfig, build_head
from draftheads.infer.draft import BlockForward, DepthLogits, Expansion
from draftheads.infer.packed import packing_supported
from draftheads.infer.tree import DynamicTree, StaticTree, load_tuned_tree, padded_size, tuned_tree_key
from draftheads.infer.verify_cost import load_tuned_costs
from draftheads.machine import machine_info
from draftheads.tuning.acceptance import AcceptanceModel, acceptance_from_ranks, judgeable, measure_acceptance
from draftheads.tuning.report import describe
from draftheads.tuning.search import choose_dynamic_tree, choose_static_tree, dynamic_proposals
from draftheads.tuning.step_cost import STEP_TOKENS, CostCurve, DecodingBench, isotonic
from draftheads.tuning.tune import TuneSettings, save_tuned_tree, timing_check
from tests.data.data_fixtures import save_tiny_base
from tests.infer.infer_stubs import AutoregressiveStub, ModuleStub, ParallelStub, greedy_reference

pytestmark = pytest.mark.usefixtures("single_thread")


# ---- choosing a tree on synthetic models --------------------------------------------------------

SYNTHETIC = AcceptanceModel(((0.7, 0.2), (0.6, 0.25), (0.5, 0.3)), (100, 100, 100))


def _closed_subsets(depth: int, top_k: int):
    """Every tree (set of paths closed under taking parents) in the full top_k-ary tree of ``depth``."""
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(top_k), repeat=d)]
    for mask in range(1 << len(paths)):
        chosen = {p for i, p in enumerate(paths) if mask >> i & 1}
        if all(p[:-1] in chosen or len(p) == 1 for p in chosen):
            yield chosen


@pytest.mark.parametrize("pad", [1, 4])
def test_static_choice_is_the_brute_force_optimum(pad):
    def verify(n):
        return 1.0 + 0.12 * (n - 1)

    def draft(tree):
        return 0.05

    best, candidates = choose_static_tree(SYNTHETIC, verify, draft, max_nodes=15, pad_to_multiple=pad)
    optimum, optimum_tree = 0.0, None
    for subset in _closed_subsets(3, 2):
        expected = 1 + sum(SYNTHETIC.path_probability(p) for p in subset)
        size = len(subset) + 1
        speedup = expected / (verify(padded_size(size, pad)) + 0.05)
        if speedup > optimum + 1e-12:
            optimum, optimum_tree = speedup, subset
    assert best.expected_speedup == pytest.approx(optimum)
    assert set(best.tree.choices) == optimum_tree
    assert [c.nodes for c in candidates] == list(range(1, 16))  # every size scored
    # the greedy trees are nested: each adds the most likely remaining node
    for smaller, larger in itertools.pairwise(candidates):
        assert set(smaller.tree.choices) < set(larger.tree.choices)


def test_static_choice_follows_the_cost_curve():
    cheap = choose_static_tree(SYNTHETIC, lambda n: 1.0, lambda t: 0.0, max_nodes=15)[0]
    dear = choose_static_tree(SYNTHETIC, lambda n: 1.0 + 0.5 * (n - 1), lambda t: 0.0, max_nodes=15)[0]
    assert cheap.nodes == 15  # free verification: take everything
    assert dear.tree.choices == ((0,),)  # each node costs half a step: only the likeliest pays


def test_a_hopeless_head_gets_the_root_only_tree_unpadded_and_a_warning():
    weak = AcceptanceModel(((0.05, 0.02), (0.05, 0.02)), (100, 100))
    best, _ = choose_static_tree(
        weak, lambda n: 1.0 + 0.5 * (n - 1), lambda t: 0.0, max_nodes=7, pad_to_multiple=4
    )
    assert best.nodes == 1 and best.expected_speedup == pytest.approx(1.0)  # one token, not padded to 4
    record = {
        "acceptance": {"probabilities": [[0.05, 0.02], [0.05, 0.02]], "counts": [100, 100]},
        "verify_cost": {
            "sizes": [1, 4],
            "relative": [1.0, 2.5],
            "seconds": [0.05, 0.125],
            "ceiling": {"speedup": 1.6, "tokens": 4, "at_tau": [1.5, 1.4, 1.6]},
        },
        "setting": "cpu/float32",
        "chosen": {
            "tree": {"name": "tuned-3"},
            "nodes": 3,
            "expected_tokens": 1.07,
            "cost": 2.6,
            "expected_speedup": 0.41,
        },
    }
    assert "no draft tree is expected to beat plain decoding" in describe(record)
    assert "ceiling on this machine: 1.60x" in describe(record)
    assert "at tau 2 / 3 / 4 at most 1.50x / 1.40x / 1.60x" in describe(record)
    record["chosen"]["expected_speedup"] = 1.3
    assert "warning" not in describe(record)
    record["timing_check"] = timing_check(0.0220, 0.0235)
    assert record["timing_check"]["quiet"] and "warning" not in describe(record)
    record["timing_check"] = timing_check(0.0287, 0.0220)
    assert not record["timing_check"]["quiet"]
    assert "22.0 ms at the end (30% apart, more than 10%)" in describe(record)


def test_dynamic_proposals_follow_eagle2_selection():
    model = AcceptanceModel(((0.6, 0.3), (0.5, 0.2)), (10, 10))
    assert dynamic_proposals(model, top_k=2, depth=2) == pytest.approx([0.6, 0.3, 0.3, 0.12, 0.15, 0.06])
    # with top_k 1, only the best frontier node is expanded
    assert dynamic_proposals(model, top_k=1, depth=2) == pytest.approx([0.6, 0.3])


def test_dynamic_choice_is_the_known_optimum():
    # A perfect top-1 chain: depth d accepts d drafts. Verification is flat up to 4 tokens, then
    # dear; drafting costs 0.01 per (top_k x depth). The best is a 3-deep chain, 4 tokens, top_k 1.
    chain = AcceptanceModel(tuple((1.0, 0.0, 0.0) for _ in range(6)), (50,) * 6)

    def verify(n):
        return 1.0 if n <= 4 else 1.0 + (n - 4)

    def draft(tree):
        return 0.01 * tree.top_k * tree.depth

    best, candidates = choose_dynamic_tree(chain, verify, draft, max_top_k=3, max_depth=6, max_nodes=12)
    assert (best.tree.top_k, best.tree.depth, best.tree.total_tokens) == (1, 3, 4)
    assert best.expected_tokens == pytest.approx(4.0)
    assert best.expected_speedup == pytest.approx(4.0 / 1.03)
    assert isinstance(best.tree, DynamicTree) and len(candidates) > 50


# ---- the acceptance model from ranks ------------------------------------------------------------


def test_acceptance_is_conditional_on_the_parent_in_reach():
    # ranks per position and depth: 2 = a miss (top_k 2), -1 = not judgeable
    ranks = torch.tensor([[0, 0, 1], [0, 1, -1], [1, 2, 0], [2, 0, 0], [0, -1, -1]])
    model = acceptance_from_ranks(ranks, top_k=2)
    assert model.counts == (5, 3, 1)  # depth 2: the rows whose depth 1 hit; depth 3: rows hitting both
    assert model.probabilities[0] == pytest.approx((3 / 5, 1 / 5))
    assert model.probabilities[1] == pytest.approx((1 / 3, 1 / 3))
    assert model.probabilities[2] == pytest.approx((0.0, 1.0))
    assert SYNTHETIC.path_probability((0, 1)) == pytest.approx(0.7 * 0.25)
    assert SYNTHETIC.path_probability((0, 0, 0, 0)) == 0.0  # deeper than measured


def test_judgeable_follows_the_greedy_chain():
    tokens = torch.tensor([5, 6, 7, 9, 9])
    greedy = torch.tensor([6, 7, 8, 9, 1])  # g[2] = 8 but x[3] = 9: the true path leaves greedy at t = 2
    valid = judgeable(tokens, greedy, start=0, depth=3)
    assert valid.tolist() == [
        [True, True, False],  # t = 0: roots 6, 7 match; depth 3 needs x[3] == g[2]
        [True, False, False],
        [False, False, False],
        [True, False, False],  # t = 3: root x[4] = g[3]; depth 2 would need position 5
    ]


def test_ceiling_is_the_best_all_accepted_chain():
    # cost 1.0, 1.2, 2.0, 4.0, 4.4 for 1, 2, 4, 8, 9 tokens: all-accepted chains give 1, 1.67, 2, 2, 2.05
    assert CostCurve((1, 2, 4, 8, 9), (0.1, 0.12, 0.2, 0.4, 0.44)).ceiling() == pytest.approx((9 / 4.4, 9))
    assert CostCurve((1, 2, 4, 8), (0.1, 0.12, 0.2, 0.4)).ceiling() == pytest.approx((2.0, 4))  # tie: fewer
    # bf16 on a CPU without bf16 instructions (measured: 1.58x for 2, 3.08x for 4): ~1.3x at most
    assert CostCurve((1, 2, 4), (0.1, 0.158, 0.308)).ceiling() == pytest.approx((4 / 3.08, 4))


def test_speedup_bound_needs_ceil_tau_nodes():
    curve = CostCurve((1, 2, 4, 8), (0.1, 0.12, 0.2, 0.4))  # relative 1, 1.2, 2, 4 (3: 1.6)
    assert curve.speedup_bound(2.0) == pytest.approx(2 / 1.2)  # 2 nodes
    assert curve.speedup_bound(2.6) == pytest.approx(2.6 / 1.6)  # 3 nodes: a 2-deep tree at least
    assert curve.speedup_bound(1.0) == pytest.approx(1.0)


def test_cost_curve_interpolates_over_an_isotonic_fit():
    curve = CostCurve((1, 4, 8, 12), (0.1, 0.22, 0.18, 0.3))  # noise made 8 look cheaper than 4
    assert curve.fitted() == pytest.approx([0.1, 0.2, 0.2, 0.3])  # pooled, not lifted to 0.22
    assert curve.relative(1) == pytest.approx(1.0)
    assert curve.relative(4) == pytest.approx(2.0)
    assert curve.relative(8) == pytest.approx(2.0)
    assert curve.relative(2) == pytest.approx(1 + 1 / 3)
    assert curve.relative(10) == pytest.approx(2.5)
    assert curve.relative(16) == pytest.approx(4.0)  # beyond the last size: the last segment extended
    assert isotonic([3.0, 1.0, 2.0, 5.0]) == pytest.approx([2.0, 2.0, 2.0, 5.0])


# ---- measuring acceptance on stubs and tiny heads -----------------------------------------------

PROMPT_LENGTH, NEW_TOKENS = 6, 24


@pytest.fixture
def reference(tiny_llama):
    prompt = torch.randint(3, 256, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(1))
    return greedy_reference(tiny_llama, prompt, NEW_TOKENS + 12)  # stubs need the future past the end


@pytest.mark.parametrize("stub", [ParallelStub, AutoregressiveStub, ModuleStub])
@pytest.mark.parametrize("right", [True, False])
def test_stub_heads_are_measured_always_or_never_right(tiny_llama, reference, stub, right):
    head = stub(tiny_llama, reference, right)
    sequence = reference[: PROMPT_LENGTH + NEW_TOKENS]
    depth = 3
    model = measure_acceptance(tiny_llama, head, [(sequence, PROMPT_LENGTH)], depth, top_k=4, progress=False)
    assert len(model.probabilities) == depth and all(len(row) == 4 for row in model.probabilities)
    expected_first = 1.0 if right else 0.0
    assert model.probabilities[0][0] == expected_first
    assert model.counts[0] == NEW_TOKENS  # every generated token is a root once; g after the last exists
    if right:
        assert all(row == (1.0, 0.0, 0.0, 0.0) for row in model.probabilities)
        assert model.counts == (NEW_TOKENS, NEW_TOKENS - 1, NEW_TOKENS - 2)
    else:
        assert all(sum(row) == 0.0 for row in model.probabilities[:1]) and model.counts[1:] == (0, 0)


TINY_HEADS = {
    "medusa": MedusaConfig(num_heads=3, num_layers=1),
    "eagle3": Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=2),
    "mtp": MtpConfig(num_modules=3),
}


@pytest.mark.parametrize("kind", sorted(TINY_HEADS))
def test_real_heads_give_probabilities_of_the_right_shape(tiny_llama, reference, kind):
    head = build_head(tiny_llama, TINY_HEADS[kind]).eval()
    sequence = reference[: PROMPT_LENGTH + NEW_TOKENS]
    model = measure_acceptance(tiny_llama, head, [(sequence, PROMPT_LENGTH)] * 2, 3, top_k=5, progress=False)
    assert len(model.probabilities) == 3 and all(len(row) == 5 for row in model.probabilities)
    for row in model.probabilities:
        assert all(0.0 <= p <= 1.0 for p in row) and sum(row) <= 1.0 + 1e-9
    assert model.counts[0] == 2 * NEW_TOKENS


@pytest.mark.parametrize("kind", ["medusa", "eagle3", "mtp"])
def test_timing_runs_the_real_drafting_code(tiny_llama, kind):
    head = build_head(tiny_llama, TINY_HEADS[kind]).eval()
    bench = DecodingBench(tiny_llama, head, torch.arange(3, 40), pad_to_multiple=4, repeats=2)
    curve = bench.verify_cost([1, 4, 8], progress=False)
    assert curve.sizes == (1, 4, 8) and all(s > 0 for s in curve.seconds)
    assert bench.cache.get_seq_length() == bench.past  # every timed verification was rolled back
    trees = [StaticTree("t", ((0,), (1,), (0, 0)))]
    if kind != "medusa":
        trees.append(DynamicTree("d", top_k=2, depth=2, total_tokens=4))
    for tree in trees:
        assert bench.draft_seconds(tree) > 0
        assert bench.draft_seconds(tree) == bench.draft_seconds(tree)  # memoised


@pytest.mark.parametrize(
    "config",
    [TINY_HEADS["medusa"], DFlashConfig(block_size=4, feature_layers=(1, 2, 3)), TINY_HEADS["eagle3"]],
    ids=["medusa", "dflash", "eagle3"],
)
def test_every_timed_draft_runs_the_head_forward(tiny_llama, monkeypatch, config):
    """Drafters that keep a step's distributions until the next commit (Medusa, block heads) must
    not answer a timed propose from the warm-up's: each of the repeats runs the head itself, on
    what a decoding step hands it."""
    head = build_head(tiny_llama, config).eval()
    bench = DecodingBench(tiny_llama, head, torch.arange(3, 40), pad_to_multiple=4, repeats=3)
    forwards = []
    for kind in (DepthLogits, BlockForward, Expansion):
        run = kind.run
        monkeypatch.setattr(kind, "run", lambda self, run=run: forwards.append(self) or run(self))
    bench.draft_seconds(StaticTree("t", ((0,), (1,), (0, 0))))
    assert len(forwards) >= 1 + 3  # the warm-up and each timed repeat: at least one head forward
    # a block head's forward takes in what one step committed, not the whole prefix
    assert all(f.features.shape[1] <= STEP_TOKENS for f in forwards if isinstance(f, BlockForward))


# ---- saving and using the choice ----------------------------------------------------------------


def test_saved_tree_loads_back_per_device_and_dtype(tmp_path):
    from draftheads.tuning.search import Candidate

    static = Candidate(StaticTree("tuned-4", ((0,), (1,), (0, 0))), 4, 2.1, 1.2, 1.75)
    dynamic = Candidate(DynamicTree("tuned-k2", 2, 3, 9), 9, 2.5, 1.5, 1.67)
    record = {
        "machine": {"cpu": "test"},
        "acceptance": {"probabilities": [[0.5, 0.2]], "counts": [4]},
        "verify_cost": {
            "sizes": [1, 4],
            "relative": [1.0, 1.2],
            "seconds": [0.1, 0.12],
            "fitted_seconds": [0.1, 0.12],
        },
        "setting": "cpu/float32",
        "chosen": {"nodes": 4, "tree": {"name": "tuned-4"}},
        "candidates": [{"nodes": 4, "expected_speedup": 1.75}],
    }
    costs = {1: CostCurve((1, 4), (0.1, 0.12)), 4: CostCurve((1, 4), (0.2, 0.5))}
    save_tuned_tree(tmp_path, tuned_tree_key(torch.float32, "cpu"), static, record, costs)
    save_tuned_tree(tmp_path, tuned_tree_key(torch.bfloat16, "cpu"), dynamic, record, {})
    assert load_tuned_tree(tmp_path, torch.float32, "cpu") == static.tree
    assert load_tuned_tree(tmp_path, torch.bfloat16, "cpu") == dynamic.tree
    assert load_tuned_tree(tmp_path, torch.float32, "cuda") is None  # never tuned there
    assert load_tuned_tree(tmp_path / "elsewhere", torch.float32, "cpu") is None
    assert (tmp_path / "tune-cpu-float32.png").stat().st_size > 0
    # verify costs are used only on the machine that measured them
    assert load_tuned_costs(tmp_path, torch.float32, "cpu") == {}  # "cpu": "test" is not this machine
    here = json.loads((tmp_path / "tree.json").read_text())
    here["trees"]["cpu/float32"]["machine"] = machine_info(torch.float32, "cpu")
    (tmp_path / "tree.json").write_text(json.dumps(here))
    assert load_tuned_costs(tmp_path, torch.float32, "cpu") == costs
    assert load_tuned_costs(tmp_path, torch.bfloat16, "cpu") == {}  # none measured
    saved = json.loads((tmp_path / "tree.json").read_text())
    saved["trees"]["cpu/float32"]["tree"] = {"type": "static", "choices": [[0, 0]]}  # no parent path
    (tmp_path / "tree.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"tree.json: trees.cpu/float32.tree.*no parent path"):
        load_tuned_tree(tmp_path, torch.float32, "cpu")


@pytest.fixture
def tiny_base_dir(tmp_path):
    """The tiny Llama and a byte-level chat tokenizer in one directory (a valid ``--base``)."""
    return save_tiny_base(tmp_path / "base")


def test_tune_tree_saves_a_tree_the_generator_and_bench_use(tmp_path, tiny_base_dir):
    from draftheads.base_model import load_base
    from draftheads.bench import bench_tree
    from draftheads.cli import main
    from draftheads.infer import SpeculativeGenerator

    model, _tokenizer = load_base(str(tiny_base_dir), dtype="float32")
    head_dir = tmp_path / "head"
    build_head(model, MtpConfig(num_modules=2), str(tiny_base_dir)).save_pretrained(head_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [f"Say {i}."]}) + "\n" for i in range(3)))
    arguments = [
        "tune-tree",
        "--heads",
        str(head_dir),
        "--data",
        str(prompts),
        "--skip",
        "0",
        "--prompts",
        "2",
        "--max-new-tokens",
        "12",
        "--max-nodes",
        "8",
        "--repeats",
        "1",
        "--prefix-tokens",
        "16",
        "--pack",
        "on",  # packed for every forward where oneDNN can (auto would measure which pays here)
    ]
    assert main(arguments) == 0
    record = json.loads((head_dir / "tune-cpu-float32.json").read_text())
    cost = record["verify_cost"]
    # packed where oneDNN can (then unpadded: every size from 1), else padded to 4
    assert cost["packed_linears"] == packing_supported(model)
    expected_sizes = [1, 2, 3, 4, 5, 6, 8] if cost["packed_linears"] else [1, 4, 8]
    assert record["setting"] == "cpu/float32" and cost["sizes"] == expected_sizes
    assert cost["ceiling"]["tokens"] in expected_sizes and cost["ceiling"]["speedup"] >= 1.0
    assert len(record["acceptance"]["probabilities"]) == 2  # MTP with 2 modules drafts 2 deep
    tuned = load_tuned_tree(head_dir, torch.float32, "cpu")
    assert isinstance(tuned, StaticTree) and tuned.name == record["chosen"]["tree"]["name"]
    loaded = SpeculativeGenerator.from_pretrained(head_dir, dtype="float32", context=False)
    assert loaded.tree == tuned.truncated(2)
    # the verify costs tune-tree measured (one row and batches) are what adaptive drafting weighs
    assert sorted(record["verify_cost_by_batch"]) == ["1", "16", "2", "4", "8"]
    check = record["timing_check"]
    assert check["one_token_seconds"][0] == cost["seconds"][0] and check["one_token_seconds"][1] > 0
    assert loaded.cost is not None and sorted(loaded.batch_costs) == [1, 2, 4, 8, 16]
    assert loaded.batch_costs[4].seconds == tuple(record["verify_cost_by_batch"]["4"]["seconds"])
    assert SpeculativeGenerator.from_pretrained(head_dir, dtype="float32").tree.head == tuned.truncated(2)
    assert (
        SpeculativeGenerator.from_pretrained(head_dir, dtype="float32", tree="chain-2").tree.head.name
        == "chain-2"
    )
    assert bench_tree(None, str(head_dir), model) == tuned
    assert bench_tree("cpu-8", str(head_dir), model) == "cpu-8"
    assert TuneSettings().skip > 2200  # the shipped configs train on ShareGPT's first 2,200


def test_tune_tree_refuses_bad_arguments(tmp_path, capsys):
    from draftheads.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["tune-tree", "--heads", str(tmp_path), "--top-k", "0"])
    assert exit_info.value.code == 2
    assert "argument --top-k: must be >= 1, got 0" in capsys.readouterr().err
    assert main(["tune-tree", "--heads", str(tmp_path)]) == 4
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["prompts.jsonl", "prompts.jsonl.gz"])
def test_held_out_prompts_read_prompt_files_plain_or_gzipped(tmp_path, name):
    import gzip

    from draftheads.data.sources import DataError
    from draftheads.tuning.held_out import held_out_prompts
    from tests.data.data_fixtures import make_byte_tokenizer

    text = "".join(json.dumps({"id": i, "turns": [f"Count to {i}."]}) + "\n" for i in range(5))
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    tokenizer = make_byte_tokenizer()
    prompts = held_out_prompts(str(path), 2, 8, tokenizer, 256)
    expected = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Count to {i}."}], add_generation_prompt=True, return_dict=False
        )
        for i in (2, 3, 4)
    ]
    assert [p.tolist() for p in prompts] == expected
    with pytest.raises(
        DataError, match=rf"{path}: none of the 3 prompts after skipping 2 has at most 4 tokens"
    ):
        held_out_prompts(str(path), 2, 8, tokenizer, 4)


def test_held_out_prompts_render_plain_dialogue_for_a_base_without_a_chat_template(tmp_path):
    """A pretrained base's tokenizer (no chat template, a bos before any text): each first turn as
    the plain dialogue its head trained on; ``--template chat`` refused in one line."""
    from draftheads.prompt_format import TemplateError
    from draftheads.tuning.held_out import held_out_prompts
    from tests.data.data_fixtures import make_pretrained_byte_tokenizer

    text = "".join(json.dumps({"id": i, "turns": [f"Count to {i}."]}) + "\n" for i in range(4))
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    tokenizer = make_pretrained_byte_tokenizer()
    expected = [
        tokenizer(f"<|im_start|>User: Count to {i}.\n\nAssistant:", add_special_tokens=False)["input_ids"]
        for i in (1, 2, 3)
    ]
    assert [p.tolist() for p in held_out_prompts(str(path), 1, 8, tokenizer, 256)] == expected
    assert [p.tolist() for p in held_out_prompts(str(path), 1, 8, tokenizer, 256, "plain")] == expected
    with pytest.raises(TemplateError, match=r"^--template=chat, but the tokenizer .* has no chat template"):
        held_out_prompts(str(path), 1, 8, tokenizer, 256, "chat")

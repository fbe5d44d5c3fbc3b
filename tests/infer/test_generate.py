"""The decode loop on the tiny random Llama: greedy output identical to ``model.generate``, stub
heads giving tau = depth + 1 / tau = 1 exactly, EOS / max_new_tokens / context limits, input guards."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from infer_stubs import AutoregressiveStub, ModuleStub, ParallelStub, greedy_reference

from draftheads.heads import Eagle3Config, EagleConfig, MedusaConfig, MtpConfig, PEagleConfig, build_head
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.forward import TreeInputError, check_tree_inputs
from draftheads.infer.tree import DynamicTree
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

HEAD_CONFIGS = {
    "medusa": MedusaConfig(num_heads=4, num_layers=1),
    "eagle": EagleConfig(),
    "eagle3": Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64),
    "eagle3-2-layers": Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, num_layers=2),
    "eagle3.1": Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, fc_norm=True, norm_output=True),
    "mtp": MtpConfig(num_modules=3),
    "peagle": PEagleConfig(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=3),
}
# (head kind, tree, pad_to_multiple): 14 cases x 3 prompts x 64 tokens = 42 prompts; every head
# kind, static and dynamic trees, padded (None: the default, 4 in fp32 on CPU) and unpadded (1).
GREEDY_CASES = [
    ("medusa", "cpu-8", None),
    ("medusa", "mc_sim_7b_63", None),
    ("medusa", "cpu-16", 1),
    ("eagle", "dynamic-cpu", None),
    ("eagle", "eagle1-26", None),
    ("eagle", "dynamic-cpu", 1),
    ("eagle3", DynamicTree("wide", top_k=3, depth=5, total_tokens=10), None),
    ("eagle3", "chain-4", None),
    ("eagle3-2-layers", DynamicTree("wide", top_k=3, depth=5, total_tokens=10), None),
    ("eagle3.1", DynamicTree("wide", top_k=3, depth=5, total_tokens=10), None),
    ("mtp", "dynamic-cpu", None),
    ("mtp", "cpu-8", None),
    ("peagle", "chain-4", None),
    ("peagle", "cpu-8", 1),
]


def prompts(count: int, seed: int, vocab_size: int = 256):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            3, vocab_size, (1, int(torch.randint(4, 24, (), generator=generator))), generator=generator
        )
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama()


@pytest.mark.parametrize(
    "kind,tree,pad_to_multiple",
    GREEDY_CASES,
    ids=[f"{k}-{getattr(t, 'name', t)}-pad{p}" for k, t, p in GREEDY_CASES],
)
def test_greedy_matches_generate(model, kind, tree, pad_to_multiple):
    torch.manual_seed(0)  # untrained heads are random: fix them
    head = build_head(model, HEAD_CONFIGS[kind])
    generator = SpeculativeGenerator(model, head, tree=tree, pad_to_multiple=pad_to_multiple)
    for index, prompt in enumerate(prompts(3, seed=GREEDY_CASES.index((kind, tree, pad_to_multiple)))):
        expected = model.generate(prompt, max_new_tokens=64, do_sample=False)
        result = generator.generate(prompt, max_new_tokens=64)
        assert result.sequences.tolist() == expected.tolist(), f"{kind} {tree} prompt {index}"
        assert result.stats.verification_steps + 1 == result.stats.forward_passes


@pytest.mark.parametrize("tree", ["chain-4", "cpu-8", "mc_sim_7b_63"])
def test_parallel_stub_tau_exact(model, tree):
    prompt = prompts(1, seed=3)[0]
    reference = greedy_reference(model, prompt, 64 + 8)
    for right in (True, False):
        generator = SpeculativeGenerator(model, ParallelStub(model, reference, right), tree=tree)
        result = generator.generate(prompt, max_new_tokens=48)
        assert result.sequences[0].tolist() == reference[: prompt.shape[1] + 48].tolist()
        depth = generator.tree.depth
        assert result.stats.tau == (depth + 1.0 if right else 1.0)
        steps = result.stats.verification_steps
        assert result.stats.accepted_per_depth == ((steps,) * depth if right else ())


@pytest.mark.parametrize("stub", [AutoregressiveStub, ModuleStub])
@pytest.mark.parametrize("tree", ["chain-2", "cpu-8", DynamicTree("d", top_k=3, depth=3, total_tokens=9)])
def test_autoregressive_stub_tau_exact(model, stub, tree):
    prompt = prompts(1, seed=4)[0]
    reference = greedy_reference(model, prompt, 64 + 8)
    for right in (True, False):
        generator = SpeculativeGenerator(model, stub(model, reference, right), tree=tree)
        result = generator.generate(prompt, max_new_tokens=40)
        assert result.sequences[0].tolist() == reference[: prompt.shape[1] + 40].tolist()
        assert result.stats.tau == (generator.tree.depth + 1.0 if right else 1.0)


def test_mtp_tree_capped_by_modules(model):
    head = build_head(model, MtpConfig(num_modules=2))
    assert SpeculativeGenerator(model, head, tree="dynamic-cpu").tree.depth == 2
    assert SpeculativeGenerator(model, head, tree="cpu-16").tree.depth == 2


def test_medusa_needs_a_static_tree(model):
    head = build_head(model, HEAD_CONFIGS["medusa"])
    with pytest.raises(ValueError, match="static tree"):
        SpeculativeGenerator(model, head, tree="dynamic-cpu")


def test_eos_inside_accepted_path_stops_there(model):
    prompt = prompts(1, seed=5)[0]
    reference = greedy_reference(model, prompt, 40)
    continuation = reference[prompt.shape[1] :]
    eos = int(continuation[9])  # make the 10th greedy token the EOS: the stub accepts it mid-path
    first = continuation.tolist().index(eos)
    original = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        generator = SpeculativeGenerator(model, ParallelStub(model, reference, right=True), tree="chain-4")
        result = generator.generate(prompt, max_new_tokens=30)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    finally:
        model.generation_config.eos_token_id = original
    assert result.new_tokens == continuation[: first + 1].tolist()
    assert result.sequences.tolist() == expected.tolist()


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 7])
def test_max_new_tokens_exact(model, max_new_tokens):
    prompt = prompts(1, seed=6)[0]
    reference = greedy_reference(model, prompt, 20)
    generator = SpeculativeGenerator(model, ParallelStub(model, reference, right=True), tree="chain-4")
    result = generator.generate(prompt, max_new_tokens=max_new_tokens)
    assert result.new_tokens == reference[prompt.shape[1] : prompt.shape[1] + max_new_tokens].tolist()


@pytest.mark.parametrize("stub", [ParallelStub, AutoregressiveStub])
def test_context_limit_respected(stub):
    model = make_tiny_llama(max_position_embeddings=40)
    prompt = prompts(1, seed=7)[0][:, :20]
    reference = greedy_reference(model, prompt, 30)
    generator = SpeculativeGenerator(model, stub(model, reference, True), tree="chain-6")
    result = generator.generate(prompt, max_new_tokens=64)
    assert result.sequences.shape[1] == 40
    assert result.sequences[0].tolist() == reference[:40].tolist()
    with pytest.raises(ValueError, match="context is 40"):
        generator.generate(torch.randint(3, 256, (1, 40)), max_new_tokens=4)


def test_empty_and_text_prompts_refused(model):
    generator = SpeculativeGenerator(model, build_head(model, HEAD_CONFIGS["eagle"]))
    with pytest.raises(ValueError, match="empty"):
        generator.generate([])
    with pytest.raises(ValueError, match="need a tokenizer"):
        generator.generate("hello")


# ---- the verification-input guards (each of these is silently wrong in transformers 5.x) ----


def guard_inputs(model, past=5, count=3):
    input_ids = torch.zeros(1, count, dtype=torch.long)
    mask = torch.zeros(1, 1, count, past + count)
    positions = torch.arange(past, past + count)[None]
    return input_ids, mask, positions, past


def test_guard_accepts_good_inputs(model):
    check_tree_inputs(model, *guard_inputs(model)[:3], past_length=5)


def test_guard_refuses_2d_mask(model):
    input_ids, _, positions, past = guard_inputs(model)
    with pytest.raises(TreeInputError, match="4D"):
        check_tree_inputs(model, input_ids, torch.ones(1, past + 3), positions, past)


def test_guard_refuses_bool_mask(model):
    input_ids, mask, positions, past = guard_inputs(model)
    with pytest.raises(TreeInputError, match="additive float"):
        check_tree_inputs(model, input_ids, mask == 0, positions, past)


def test_guard_refuses_wrong_mask_values_and_shape(model):
    input_ids, mask, positions, past = guard_inputs(model)
    with pytest.raises(TreeInputError, match="values"):
        check_tree_inputs(model, input_ids, mask - 1.0, positions, past)
    with pytest.raises(TreeInputError, match="expected"):
        check_tree_inputs(model, input_ids, mask[..., 1:], positions, past)


def test_guard_refuses_missing_position_ids(model):
    input_ids, mask, _, past = guard_inputs(model)
    with pytest.raises(TreeInputError, match="position_ids"):
        check_tree_inputs(model, input_ids, mask, None, past)


def test_guard_refuses_flash_attention():
    model = make_tiny_llama()
    model.config._attn_implementation = "flash_attention_2"
    input_ids, mask, positions, past = guard_inputs(model)
    with pytest.raises(TreeInputError, match="flash_attention_2"):
        check_tree_inputs(model, input_ids, mask, positions, past)
    with pytest.raises(TreeInputError, match="sdpa"):
        SpeculativeGenerator(model, build_head(model, HEAD_CONFIGS["medusa"]))


def test_eager_attention_also_exact():
    model = make_tiny_llama()
    model.config._attn_implementation = "eager"
    torch.manual_seed(0)
    generator = SpeculativeGenerator(model, build_head(model, HEAD_CONFIGS["eagle"]), tree="cpu-8")
    for prompt in prompts(2, seed=8):
        expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
        assert generator.generate(prompt, max_new_tokens=24).sequences.tolist() == expected.tolist()


def test_import_is_light():
    code = (
        "import sys, draftheads.infer, draftheads.infer.generate;"
        "from draftheads.infer import SpeculativeGenerator;"
        "bad = [m for m in ('deepspeed', 'wandb', 'datasets') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- context drafts and hybrid trees --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["context-only", *HEAD_CONFIGS])
def test_context_and_hybrid_drafting_greedy_matches_generate(model, kind):
    """No head (context drafts alone) and every head kind with context drafts merged in."""
    torch.manual_seed(0)
    head = None if kind == "context-only" else build_head(model, HEAD_CONFIGS[kind])
    generator = SpeculativeGenerator(model, head, context=head is not None)
    proposed: dict[str, int] = {}
    for prompt in prompts(3, seed=11):
        reference = greedy_reference(model, prompt, 48)
        result = generator.generate(prompt, max_new_tokens=48)
        assert result.sequences[0].tolist() == reference.tolist()
        for source, count in result.stats.proposed_by_source.items():
            proposed[source] = proposed.get(source, 0) + count
    assert proposed.get("context", 0) > 0  # the tiny model repeats itself: the context drafted
    if head is not None:
        assert proposed.get(head.kind, 0) > 0


@pytest.mark.parametrize("kind", ["context-only", *HEAD_CONFIGS])
@pytest.mark.parametrize("context", [False, True])
def test_every_drafter_stops_cleanly_at_the_context_limit(kind, context):
    """Default trees (EAGLE's and MTP's dynamic ones included) up to the last position: the final
    steps verify the root alone instead of asking a drafter for a depth-0 tree."""
    if kind == "context-only" and not context:
        pytest.skip("without a head the context drafter is the only one")
    model = make_tiny_llama(max_position_embeddings=40)
    torch.manual_seed(0)
    head = None if kind == "context-only" else build_head(model, HEAD_CONFIGS[kind])
    generator = SpeculativeGenerator(model, head, context=context and head is not None)
    for prompt in prompts(2, seed=12):
        reference = greedy_reference(model, prompt, 40 - prompt.shape[1])
        result = generator.generate(prompt, max_new_tokens=64)
        assert result.sequences.shape[1] == 40
        assert result.sequences[0].tolist() == reference.tolist()

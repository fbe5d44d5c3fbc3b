"""Suffix drafting: the matching and scoring rules on hand-made sequences, the bounded history of
earlier answers, and greedy output identical to the base model's with suffix drafts alone, merged
into a head's trees, adaptive, and in batches."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from infer_stubs import greedy_reference

import draftheads.infer.adaptive
import draftheads.infer.generate
from draftheads.heads import Eagle3Config, MedusaConfig, MtpConfig, build_head
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.context import ContextTree
from draftheads.infer.generate import text_settings
from draftheads.infer.suffix import (
    SEPARATOR,
    SuffixCorpus,
    SuffixDrafter,
    SuffixHistory,
    SuffixTree,
    choose_pattern,
    continuations_after,
    occurrences,
    ranked_occurrences,
    suffix_draft,
)
from draftheads.infer.tree import ROOT_PARENT
from draftheads.infer.verify_cost import CostCurve
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

EVERYTHING = {"min_score": 0.0, "alpha": 16.0}  # every node may be drafted: the rules under test alone


def corpus_of(answers: list[list[int]], text: list[int]) -> SuffixCorpus:
    history = SuffixHistory()
    for answer in answers:
        history.add(answer)
    return SuffixCorpus.of(history.flat(), text)


# ---- matching -----------------------------------------------------------------------------------


def test_match_lengths_count_back_from_the_end_within_one_sequence():
    corpus = corpus_of([[5, 1, 2, 3, 4], [9, 2], [3, 7]], [8, 1, 2, 3])
    ends, lengths = occurrences(corpus, max_pattern=64)
    tokens = corpus.tokens.tolist()
    found = {(tokens[e + 1], int(n)) for e, n in zip(ends, lengths)}
    # "1 2 3" in the first answer (then 4); "3" opening the third (then 7): the "2" before it ends
    # the second answer, and a match never runs across two sequences
    assert found == {(4, 3), (7, 1)}
    assert occurrences(corpus, max_pattern=2)[1].tolist() == [2, 1]  # capped at max_pattern
    # the text's own end is no earlier occurrence; a repeated token matches itself one back
    assert occurrences(corpus_of([], [4, 6]), 64)[0].size == 0
    ends, lengths = occurrences(corpus_of([], [5, 5, 5]), 64)
    assert lengths.tolist() == [1, 2]  # "5" at 1 (after the separator), "5 5" at 2


def test_pattern_never_extends_into_the_history_before_the_text():
    corpus = corpus_of([[1, 2, 3, 1, 2]], [3])  # the text is "3"; the answer's "2 3" is before it
    assert occurrences(corpus, 64)[1].tolist() == [1]


def test_ranking_keeps_the_longest_matches_then_the_most_recent():
    corpus = corpus_of([], [1, 2, 3, 0, 2, 3, 0, 2, 3, 9, 1, 2, 3])
    ends, lengths = ranked_occurrences(corpus, SuffixTree(max_matches=2))
    assert lengths.tolist() == [3, 2]  # "1 2 3" first, then the newest "2 3"
    assert ends.tolist()[1] > ranked_occurrences(corpus, SuffixTree())[0].tolist()[2]
    assert ranked_occurrences(corpus, SuffixTree(min_pattern=3))[1].tolist() == [3]


def test_continuations_end_with_their_sequence():
    corpus = corpus_of([[1, 2], [1, 4, 5, 6]], [1])
    ends, _ = occurrences(corpus, 64)
    assert continuations_after(corpus, ends, [3, 3]) == [[2], [4, 5, 6]]
    assert continuations_after(corpus, ends, [1, 2]) == [[2], [4, 5]]
    assert corpus.tokens[corpus.length] == SEPARATOR


# ---- scoring and sizing -------------------------------------------------------------------------


def test_scores_are_frequencies_counting_the_current_occurrence():
    # "7" occurred three times before, followed by 4 5, 4 6 and 4 5: the pattern's count is 4
    corpus = corpus_of([[7, 4, 5], [7, 4, 6], [7, 4, 5]], [3, 7])
    trie = suffix_draft(corpus, SuffixTree(**EVERYTHING))
    assert trie.tokens == (4, 5, 6)
    assert trie.parents == (ROOT_PARENT, 0, 0)
    assert trie.scores == pytest.approx((3 / 4, 2 / 4, 1 / 4))
    # min_score: 6 (1/4) is dropped, 5 (1/2) is kept
    assert suffix_draft(corpus, SuffixTree(alpha=16.0, min_score=0.3)).tokens == (4, 5)


def test_tree_size_grows_with_the_match_length():
    assert [SuffixTree(alpha=1.0).size(m) for m in (1, 3, 40)] == [1, 3, 15]
    assert [SuffixTree(alpha=0.5).size(m) for m in (1, 2, 5)] == [0, 1, 2]
    answer = list(range(10, 30))
    short = corpus_of([answer], [99, 10])  # one token matched
    long = corpus_of([answer], [99, 10, 11, 12, 13])  # four matched
    assert suffix_draft(short, SuffixTree(min_score=0.0)).tokens == (11,)
    assert suffix_draft(long, SuffixTree(min_score=0.0)).tokens == (14, 15, 16, 17)
    assert suffix_draft(long, SuffixTree(min_score=0.0, alpha=2.0)).tokens == tuple(range(14, 22))
    assert suffix_draft(long, SuffixTree(min_score=0.0, total_tokens=3)).tokens == (14, 15)


def test_the_best_scoring_pattern_length_drafts_ties_to_the_longer():
    tree = SuffixTree(min_score=0.0, alpha=1.0)
    # the 3-token match's 3 nodes (1/2 each) beat the 1-token match's one node (3/5)
    assert choose_pattern([[7, 8, 9], [4], [4], [4]], [3, 1, 1, 1], tree) == (3, 1)
    # with alpha 2, the shorter pattern's two nodes (4/6 each) beat the longer's two (1/2 each)
    wide = SuffixTree(min_score=0.0, alpha=2.0)
    assert choose_pattern([[7, 8], [4, 5], [4, 5], [4, 5], [4, 5]], [2, 1, 1, 1, 1], wide) == (1, 5)
    # a tie (1/2 and 2/4) goes to the longer pattern
    assert choose_pattern([[4], [4], [9]], [2, 1, 1], tree) == (2, 1)
    assert choose_pattern([], [], tree) == (0, 0)
    assert choose_pattern([[]], [3], tree) == (0, 0)  # an occurrence at its sequence's end


def test_settings_are_checked():
    with pytest.raises(ValueError, match="min_pattern <= max_pattern"):
        SuffixTree(min_pattern=5, max_pattern=4)
    with pytest.raises(ValueError, match="alpha > 0"):
        SuffixTree(alpha=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixHistory(max_tokens=-1)
    assert SuffixTree().truncated(3).depth == 3 and SuffixTree().truncated(-1) == SuffixTree()


# ---- the history --------------------------------------------------------------------------------


def test_history_is_bounded_oldest_dropped_first():
    history = SuffixHistory(max_tokens=6)
    history.add([1, 2, 3])
    history.add([4, 5])
    assert history.flat().tolist() == [1, 2, 3, SEPARATOR, 4, 5, SEPARATOR]
    history.add([6, 7])  # 7 tokens: the oldest answer goes
    assert history.stored == 4 and history.flat().tolist() == [4, 5, SEPARATOR, 6, 7, SEPARATOR]
    history.add(list(range(10, 20)))  # longer than the bound alone: its last 6 tokens stay
    assert history.flat().tolist() == [14, 15, 16, 17, 18, 19, SEPARATOR]
    history.add([])
    assert history.stored == 6
    history.clear()
    assert history.flat().size == 0
    none = SuffixHistory(max_tokens=0)
    none.add([1, 2])
    assert none.flat().size == 0


def test_drafter_drafts_from_the_history_it_started_with():
    history = SuffixHistory()
    history.add([40, 41, 42, 43, 44, 45])
    drafter = SuffixDrafter(history, pad_to_multiple=4)
    drafter.prefill(None, torch.tensor([[7, 40, 41, 42]]))  # the text ends with the root
    draft = drafter.propose(42, 4, SuffixTree(min_score=0.0))
    assert draft.tokens.tolist() == [42, 43, 44, 45]  # "40 41 42" matched: up to 3 nodes
    history.add([42, 43, 99])  # stored after the sequence started: not in its corpus
    assert drafter.corpus.text_start == 1 + 7
    drafter.commit(None, torch.tensor([[43]]), 4)
    draft = drafter.propose(43, 5, SuffixTree(min_score=0.0, alpha=0.5))  # 4 matched: 2 nodes
    assert draft.tokens.tolist() == [43, 44, 45]
    assert draft.sources == ("", "suffix", "suffix") and draft.topology.size == 4
    fork = drafter.fork()
    fork.commit(None, torch.tensor([[1, 2, 3]]), 5)
    assert drafter.corpus.length + 3 == fork.corpus.length
    assert SuffixDrafter(None).propose(5, 0, SuffixTree()).tokens.tolist() == [5]
    with pytest.raises(TypeError, match="SuffixTree"):
        drafter.propose(43, 5, ContextTree())


def test_path_candidates_rank_the_continuations_of_the_longest_match():
    drafter = SuffixDrafter(None)
    drafter.prefill(None, torch.tensor([[1, 2, 5, 6, 1, 2, 5, 7, 9, 2]]))
    candidates = drafter.path_candidates(2, 10, torch.tensor([5]), top_k=2)
    assert candidates.tolist() == [[5, -1], [7, 6]]  # newest first among equals


# ---- the decode loop ----------------------------------------------------------------------------


HEADS = {
    "eagle3": (Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64), "chain-4"),
    "medusa": (MedusaConfig(num_heads=3, num_layers=1), "cpu-8"),
    "mtp": (MtpConfig(num_modules=3), "cpu-8"),
}
COST = CostCurve((1, 4, 8, 16), (1.0, 1.3, 1.6, 2.2))


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama()


def prompts(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (1, 6 + 5 * i), generator=generator) for i in range(count)]


def generator_for(model, kind: str | None, adaptive: bool = False) -> SpeculativeGenerator:
    torch.manual_seed(0)
    if kind is None:
        return SpeculativeGenerator(model, None, tree=SuffixTree(), adaptive=adaptive, cost=COST)
    config, tree = HEADS[kind]
    head = build_head(model, config)
    return SpeculativeGenerator(model, head, tree=tree, context=SuffixTree(), adaptive=adaptive, cost=COST)


@pytest.fixture
def steady_clock(monkeypatch):
    """Clocks that count work, not the machine's load, in the modules that time drafting and steps:
    every read of the decode loop's clock advances it 1 ms, so a step of either kind (drafting or
    plain) takes about the same time and the head gate keeps whichever emits more tokens a step; the
    adaptive drafter's clock stands still, so its trees are priced by the cost curve alone. The
    same decode then chooses the same drafts on every run."""
    ticks = iter(range(1 << 62))
    ticking = SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3)
    monkeypatch.setattr(draftheads.infer.generate, "time", ticking)
    monkeypatch.setattr(draftheads.infer.adaptive, "time", SimpleNamespace(perf_counter=lambda: 0.0))


@pytest.mark.parametrize("kind", [None, *HEADS])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_matches_generate_and_the_history_drafts(model, kind, adaptive, steady_clock):
    """Suffix drafts alone and merged into each head's trees: each prompt decoded twice, the second
    time with its own first answer in the history, so that the history's drafts are verified too."""
    generator = generator_for(model, kind, adaptive)
    assert generator.method == ("suffix" if kind is None else f"{kind}+suffix") + ("/adaptive" * adaptive)
    accepted = []
    for prompt in prompts(2, seed=3):
        reference = greedy_reference(model, prompt, 32)
        for _ in range(2):
            result = generator.generate(prompt, max_new_tokens=32)
            assert result.sequences[0].tolist() == reference.tolist()
            accepted.append(result.stats.accepted_by_source)
    assert generator.history.stored == 4 * 32  # every answer recorded
    first, again = accepted[0], accepted[1]  # prompt 0, then prompt 0 with its answer stored
    suffix_first = sum(n for source, n in first.items() if "suffix" in source)
    suffix_again = sum(n for source, n in again.items() if "suffix" in source)
    assert suffix_again > suffix_first  # the stored answer drafted the repeat


def test_batches_match_generate_row_by_row(model):
    generator = generator_for(model, "eagle3", adaptive=True)
    batch = [p[0] for p in prompts(4, seed=5)]
    batch = [torch.cat([p, p]) if row % 2 else p for row, p in enumerate(batch)]  # text repeats itself
    for batch_size in (None, 2):  # every row at once, then continuous batching
        result = generator.generate(batch, max_new_tokens=24, batch_size=batch_size)
        for row, prompt in enumerate(batch):
            expected = model.generate(prompt[None], max_new_tokens=24, do_sample=False)[0].tolist()
            assert result.results[row].sequences[0].tolist() == expected, f"row {row}"
    alone = generator_for(model, None)
    result = alone.generate(batch, max_new_tokens=24, batch_size=2)
    for row, prompt in enumerate(batch):
        expected = model.generate(prompt[None], max_new_tokens=24, do_sample=False)[0].tolist()
        assert result.results[row].sequences[0].tolist() == expected, f"row {row}"
    assert result.stats.tau > 1.0


def test_continuous_rows_draft_from_the_answers_of_rows_finished_before_them(model):
    generator = generator_for(model, None)
    prompt = prompts(1, seed=9)[0][0]
    result = generator.generate([prompt, prompt.clone()], max_new_tokens=32, batch_size=1)
    first, second = (row.stats.accepted_by_source.get("suffix", 0) for row in result.results)
    assert second > first  # the second row started with the first one's answer stored
    assert [a.tolist() for a in generator.history.answers] == [row.new_tokens for row in result.results]


def test_generator_settings_and_from_pretrained_options(model):
    assert SpeculativeGenerator(model, None).history is None  # context drafts keep no history
    assert SpeculativeGenerator(model, None, context=SuffixTree()).method == "suffix"
    head = build_head(model, HEADS["eagle3"][0])
    assert SpeculativeGenerator(model, head, context=True).history is None
    hybrid = SpeculativeGenerator(model, head, context=SuffixTree(name="mine"))
    assert hybrid.method == "eagle3+suffix" and hybrid.tree.name.endswith("+mine")
    with pytest.raises(ValueError, match="ContextTree or a SuffixTree"):
        SpeculativeGenerator(model, None, tree="cpu-8")
    assert text_settings(True, suffix=True) == SuffixTree()
    assert text_settings(ContextTree(), suffix=False) == ContextTree()
    assert text_settings(SuffixTree(depth=4), suffix=True) == SuffixTree(depth=4)
    with pytest.raises(ValueError, match="give context=True"):
        text_settings(False, suffix=True)


def test_history_holds_answers_not_prompts(model):
    generator = generator_for(model, None)
    prompt = prompts(1, seed=8)[0]
    result = generator.generate(prompt, max_new_tokens=8)
    assert np.array_equal(generator.history.answers[0], result.new_tokens)


def test_from_pretrained_swaps_in_suffix_drafts(tmp_path):
    from tests.data.data_fixtures import save_tiny_base

    base = save_tiny_base(tmp_path / "base")
    alone = SpeculativeGenerator.from_pretrained(None, base=str(base), pack=False, suffix=True)
    assert alone.method == "suffix/adaptive" and alone.history is not None
    model = alone.model
    head_dir = tmp_path / "head"
    build_head(model, HEADS["eagle3"][0], str(base)).save_pretrained(head_dir)
    merged = SpeculativeGenerator.from_pretrained(head_dir, pack=False, suffix=True, adaptive=False)
    assert merged.method == "eagle3+suffix" and isinstance(merged.tree.context, SuffixTree)
    with pytest.raises(ValueError, match="give context=True"):
        SpeculativeGenerator.from_pretrained(head_dir, pack=False, suffix=True, context=False)


def test_generate_command_drafts_suffix_with_the_flag_only(tmp_path, capsys):
    """``draftheads generate --suffix`` decodes with suffix drafts (the summary line names the
    method); without it, context drafts; with --no-context it is refused as a usage error."""
    from draftheads.cli import main
    from tests.data.data_fixtures import save_tiny_base

    base = save_tiny_base(tmp_path / "base")
    common = ["generate", "--base", str(base), "--no-pack", "--no-adaptive", "--max-new-tokens", "4"]
    for flags, method in (([], "[context,"), (["--suffix"], "[suffix,")):
        assert main([*common, *flags, "--prompt", "one two one two"]) == 0
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(method)
    assert main([*common, "--suffix", "--no-context", "--prompt", "x"]) == 2
    assert "--suffix drafts in place of the context drafts" in capsys.readouterr().err

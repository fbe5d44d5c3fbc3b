"""draftheads bench: interleaved runs, summaries (tau, speedup, overhead, acceptance), outputs."""

import json
from types import SimpleNamespace

import pytest
import torch

from draftheads.bench import (
    BenchPrompt,
    HFMethod,
    Sample,
    SpeculativeMethod,
    markdown_table,
    run_bench,
    summarize,
    write_results,
)
from draftheads.heads import build_head
from draftheads.heads.medusa import MedusaConfig
from draftheads.infer import SpeculativeGenerator


def _sample(method, category, tokens, seconds, forwards, accepted=(), steps=0, agrees=True):
    return Sample(
        method, f"{category}-{method}", category, tokens, seconds, forwards, list(accepted), steps, agrees
    )


def test_summary_arithmetic():
    samples = [
        _sample("generate", "a", 10, 1.0, 10),
        _sample("generate", "b", 10, 3.0, 10),
        _sample("head", "a", 10, 0.5, 5, accepted=(4, 1), steps=4),
        _sample("head", "b", 10, 1.0, 4, accepted=(3, 2), steps=3, agrees=False),
    ]
    summaries = {(s.method, s.category): s for s in summarize(samples, "generate")}
    overall = summaries[("head", "all")]
    assert overall.tau == pytest.approx(20 / 9)
    assert overall.tokens_per_second == pytest.approx(20 / 1.5)
    assert overall.speedup == pytest.approx((20 / 1.5) / (20 / 4.0))
    assert overall.implied_overhead == pytest.approx(overall.tau / overall.speedup)
    assert overall.acceptance_by_depth == pytest.approx([7 / 7, 3 / 7])
    assert overall.agreement == pytest.approx(0.5)
    assert summaries[("head", "a")].speedup == pytest.approx(2.0)
    assert summaries[("generate", "all")].tau == pytest.approx(1.0)


def test_bench_on_tiny_model_writes_results(tmp_path, tiny_llama):
    tokenizer = SimpleNamespace(pad_token_id=0)
    head = build_head(tiny_llama, MedusaConfig(num_heads=2))
    methods = [
        HFMethod("generate", tiny_llama, tokenizer),
        HFMethod("prompt-lookup", tiny_llama, tokenizer, prompt_lookup=3),
        SpeculativeMethod("medusa", SpeculativeGenerator(tiny_llama, head)),
    ]
    torch.manual_seed(0)
    prompts = [BenchPrompt(str(i), ["x", "y"][i % 2], torch.randint(3, 256, (1, 12))) for i in range(4)]
    samples = run_bench(methods, prompts, max_new_tokens=12, temperature=0.0, progress=False)
    assert len(samples) == 12
    # Greedy speculative decoding and prompt lookup are lossless: identical to plain generate.
    assert all(s.agrees for s in samples)
    summaries = summarize(samples, "generate")
    paths = write_results(samples, summaries, {"cpu": "test"}, {"max_new_tokens": 12}, tmp_path)
    assert {p.name for p in paths} == {
        "bench.json",
        "bench.md",
        "speedup_by_category.png",
        "acceptance_by_depth.png",
    }
    record = json.loads((tmp_path / "bench.json").read_text())
    assert "tau_convention" in record and len(record["samples"]) == 12
    assert {s["category"] for s in record["summaries"]} == {"all", "x", "y"}
    assert "| all | medusa |" in (tmp_path / "bench.md").read_text()


class _ScriptedMethod:
    """A bench method whose runs take the seconds it is given, in order, and log who ran when."""

    def __init__(self, name, seconds, log):
        self.name, self.seconds, self.log = name, list(seconds), log

    def run(self, prompts, max_new_tokens, temperature, seed, batch_size=None):
        self.log.append(self.name)
        seconds = self.seconds.pop(0)
        return [Sample(self.name, p.id, p.category, 4, seconds, 4, tokens=[1, 2, 3, 4]) for p in prompts]


def test_repeats_alternate_between_methods_and_keep_the_median():
    log = []
    # warm-up first (not timed), then three timed repeats each
    a = _ScriptedMethod("a", [9.0, 1.0, 5.0, 3.0], log)
    b = _ScriptedMethod("b", [9.0, 2.0, 7.0, 4.0], log)
    prompts = [BenchPrompt("0", "x", torch.ones(1, 3, dtype=torch.long))]
    samples = run_bench([a, b], prompts, max_new_tokens=4, temperature=0.0, repeats=3, progress=False)
    assert log == ["a", "b", "a", "b", "a", "b", "a", "b"]
    assert [(s.method, s.seconds) for s in samples] == [("a", 3.0), ("b", 4.0)]


def test_each_repeat_gives_its_own_speedup_against_the_reference_repeat_beside_it(tmp_path):
    # two prompts of one category; b's repeats take 1, 2, 4 s per prompt, a's (the reference) 2 s
    a = _ScriptedMethod("a", [9.0, 2.0, 2.0, 2.0], [])
    b = _ScriptedMethod("b", [9.0, 1.0, 2.0, 4.0], [])
    prompts = [BenchPrompt(str(i), "x", torch.ones(1, 3, dtype=torch.long)) for i in range(2)]
    samples = run_bench(
        [a, b], prompts, max_new_tokens=4, temperature=0.0, repeats=3, progress=False, batch_size=2
    )
    assert [s.repeat_seconds for s in samples] == [[2.0, 2.0, 2.0]] * 2 + [[1.0, 2.0, 4.0]] * 2
    summaries = {(s.method, s.category): s for s in summarize(samples, "a")}
    assert summaries[("b", "all")].speedup == pytest.approx(1.0)  # medians: 2 s against 2 s
    assert summaries[("b", "all")].speedup_by_repeat == pytest.approx([2.0, 1.0, 0.5])
    assert summaries[("a", "x")].speedup_by_repeat == pytest.approx([1.0, 1.0, 1.0])
    write_results(samples, list(summaries.values()), {"cpu": "test"}, {}, tmp_path)
    assert "| all | b | 2 | 1.00 | 2.0 | 1.00x (0.50-2.00) |" in (tmp_path / "bench.md").read_text()
    # one repeat: no spread to report
    single = run_bench(
        [_ScriptedMethod("a", [9.0, 2.0], []), _ScriptedMethod("b", [9.0, 1.0], [])],
        prompts[:1],
        max_new_tokens=4,
        temperature=0.0,
        progress=False,
    )
    assert all(s.speedup_by_repeat == [] for s in summarize(single, "a"))


def test_method_names_use_the_run_name_and_stay_distinct(tmp_path):
    from draftheads.bench import method_name

    methods = [SimpleNamespace(name="generate")]
    for run in ("medusa-smollm2", "medusa-joint-smollm2"):
        methods.append(SimpleNamespace(name=method_name("medusa", str(tmp_path / run / "head"), methods)))
    methods.append(
        SimpleNamespace(name=method_name("medusa", str(tmp_path / "medusa-smollm2" / "head"), methods))
    )
    methods.append(
        SimpleNamespace(name=method_name("medusa", str(tmp_path / "medusa-smollm2" / "head"), methods))
    )
    assert [m.name for m in methods[1:]] == [
        "medusa:medusa-smollm2",
        "medusa:medusa-joint-smollm2",
        "medusa:medusa-smollm2#2",
        "medusa:medusa-smollm2#3",
    ]
    assert method_name("eagle3", str(tmp_path / "my-head"), []) == "eagle3:my-head"


def test_results_without_matplotlib_are_written_without_charts(tmp_path, monkeypatch):
    import draftheads.bench as bench_module

    monkeypatch.setattr(bench_module, "available", lambda module: module != "matplotlib")
    samples = [
        _sample("generate", "a", 10, 1.0, 10),
        _sample("medusa", "a", 10, 0.5, 5, accepted=(3,), steps=4),
    ]
    summaries = summarize(samples, "generate")
    with pytest.warns(UserWarning, match=r"draftheads\[plots\]"):
        paths = write_results(samples, summaries, {"cpu": "test"}, {}, tmp_path)
    assert {p.name for p in paths} == {"bench.json", "bench.md"}


def test_bench_settings_refuse_a_run_without_base_or_heads():
    from draftheads.bench import BenchError, BenchSettings, bench

    with pytest.raises(BenchError, match="--base"):
        bench(BenchSettings(), progress=False)


def test_bench_refuses_what_would_fail_after_the_runs_before_loading_anything(tmp_path, monkeypatch):
    """An --out that cannot take the results, one holding an earlier run's, an unknown tree name:
    refused before the base model loads (the timed runs take hours)."""
    import draftheads.base_model
    from draftheads.bench import BenchError, BenchSettings, bench

    def no_loading(*args, **kwargs):
        raise AssertionError("the base model was loaded before the settings were checked")

    monkeypatch.setattr(draftheads.base_model, "load_base", no_loading)
    base = "smollm2-135m-instruct"
    a_file = tmp_path / "afile"
    a_file.write_text("keep")
    with pytest.raises(BenchError, match="exists and is not a directory"):
        bench(BenchSettings(base=base, out=str(a_file)), progress=False)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "bench.json").write_text("{}")
    with pytest.raises(BenchError, match=r"holds an earlier run's results \(bench.json\); pass --overwrite"):
        bench(BenchSettings(base=base, out=str(earlier)), progress=False)
    assert (earlier / "bench.json").read_text() == "{}" and a_file.read_text() == "keep"
    with pytest.raises(BenchError, match="--tree cpu16: not a tree name"):
        bench(BenchSettings(base=base, tree="cpu16", out=str(tmp_path / "new")), progress=False)
    with pytest.raises(AssertionError, match="was loaded"):  # --overwrite lets it through
        bench(BenchSettings(base=base, out=str(earlier), overwrite=True), progress=False)


def test_unknown_categories_and_methods_name_what_there_is():
    from draftheads.bench import BenchError, build_prompts, check_methods

    with pytest.raises(BenchError, match=r"mt-bench has no 'maths'; its categories: coding, .*math"):
        build_prompts("mt-bench", None, None, ["maths"])
    check_methods(("eagle3",), {"generate", "eagle3"})
    check_methods(None, {"generate"})
    with pytest.raises(BenchError, match=r"no method 'eagle3\+ctx' in this run; available: eagle3, generate"):
        check_methods(("eagle3", "eagle3+ctx"), {"generate", "eagle3"})


def test_context_and_hybrid_methods_report_acceptance_by_source(tmp_path, tiny_llama):
    from draftheads.bench import speculative_methods

    head_dir = tmp_path / "runs" / "medusa-run" / "head"
    build_head(tiny_llama, MedusaConfig(num_heads=2)).save_pretrained(head_dir)
    tokenizer = SimpleNamespace(pad_token_id=0)
    methods = speculative_methods(  # the run directory stands for its head/
        [str(head_dir.parent)], tiny_llama, None, "cpu-8", "cpu", context_only=True, hybrid=True
    )
    assert [m.name for m in methods] == ["context", "medusa:medusa-run", "medusa+context:medusa-run"]
    methods = [HFMethod("generate", tiny_llama, tokenizer), *methods]
    torch.manual_seed(0)
    prompts = [BenchPrompt(str(i), "x", torch.randint(3, 256, (1, 12))) for i in range(2)]
    samples = run_bench(methods, prompts, max_new_tokens=24, temperature=0.0, progress=False)
    assert all(s.agrees for s in samples)
    summaries = {s.method: s for s in summarize(samples, "generate") if s.category == "all"}
    assert set(summaries["context"].accepted_by_source) <= {"context"}
    assert set(summaries["medusa+context:medusa-run"].accepted_by_source) <= {
        "medusa",
        "context",
        "medusa+context",
    }
    table = write_results(samples, list(summaries.values()), {}, {}, tmp_path)[1].read_text()
    assert "accepted per step by source" in table


def test_a_head_benched_in_several_draft_dtypes_runs_once_per_dtype(tmp_path, tiny_llama):
    from draftheads.bench import speculative_methods
    from draftheads.heads.eagle3 import Eagle3Config

    head_dir = tmp_path / "e3"
    build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64)).save_pretrained(
        head_dir
    )
    methods = speculative_methods(
        [str(head_dir)], tiny_llama, None, "chain-2", "cpu", draft_dtypes=("float32", "bfloat16")
    )
    assert [m.name for m in methods] == ["eagle3:e3@float32", "eagle3:e3@bfloat16"]
    assert [next(m.generator.head.parameters()).dtype for m in methods] == [torch.float32, torch.bfloat16]
    methods = [HFMethod("generate", tiny_llama, SimpleNamespace(pad_token_id=0)), *methods]
    torch.manual_seed(0)
    prompts = [BenchPrompt(str(i), "x", torch.randint(3, 256, (1, 12))) for i in range(2)]
    samples = run_bench(methods, prompts, max_new_tokens=16, temperature=0.0, progress=False)
    assert all(s.agrees for s in samples)  # the base verifies in fp32 whatever the head drafts in
    # one dtype: the names stay as they were
    [method] = speculative_methods(
        [str(head_dir)], tiny_llama, None, "chain-2", "cpu", draft_dtypes=("float32",)
    )
    assert method.name == "eagle3:e3"


def test_batched_bench_agrees_with_batched_generate_and_reports_by_batch(tmp_path, tiny_llama):
    tokenizer = SimpleNamespace(pad_token_id=0)
    torch.manual_seed(0)
    head = build_head(tiny_llama, MedusaConfig(num_heads=2))
    methods = [
        HFMethod("generate", tiny_llama, tokenizer),
        SpeculativeMethod("medusa", SpeculativeGenerator(tiny_llama, head, tree="cpu-8")),
    ]
    lengths = [5, 21, 9, 14, 30]  # ragged: HF left-pads, draftheads keeps each row's own length
    prompts = [BenchPrompt(str(i), "x", torch.randint(3, 256, (1, n))) for i, n in enumerate(lengths)]
    samples, summaries = [], []
    for batch_size in (1, 2, 4):
        batch_samples = run_bench(methods, prompts, 16, 0.0, progress=False, batch_size=batch_size)
        assert len(batch_samples) == 2 * len(prompts)
        assert {s.batch_size for s in batch_samples} == {batch_size}
        assert all(s.agrees for s in batch_samples), batch_size
        samples += batch_samples
        summaries += summarize(batch_samples, "generate")
    overall = [s for s in summaries if s.category == "all" and s.method == "medusa"]
    assert [s.batch_size for s in overall] == [1, 2, 4]
    paths = write_results(samples, summaries, {}, {}, tmp_path)
    assert "throughput_by_batch.png" in {p.name for p in paths}
    assert "| all | medusa | 4 |" in (tmp_path / "bench.md").read_text()


def test_continuous_batches_keep_b_rows_and_agree_with_batched_generate(tmp_path, tiny_llama, monkeypatch):
    """--continuous: the draftheads method decodes all five prompts in one call, two at a time;
    generate runs batches of two (2, 2, 1); every row agrees, and bench.md says how it ran."""
    tokenizer = SimpleNamespace(pad_token_id=0)
    torch.manual_seed(0)
    generator = SpeculativeGenerator(
        tiny_llama, build_head(tiny_llama, MedusaConfig(num_heads=2)), tree="cpu-8"
    )
    calls = []
    original = generator.generate

    def recording(prompts, **kwargs):
        calls.append((len(prompts), kwargs["batch_size"]))
        return original(prompts, **kwargs)

    monkeypatch.setattr(generator, "generate", recording)
    hf_batches = []
    original_hf = tiny_llama.generate

    def recording_hf(ids, **kwargs):
        hf_batches.append(ids.shape[0])
        return original_hf(ids, **kwargs)

    monkeypatch.setattr(tiny_llama, "generate", recording_hf)
    methods = [HFMethod("generate", tiny_llama, tokenizer), SpeculativeMethod("medusa", generator)]
    prompts = [
        BenchPrompt(str(i), "x", torch.randint(3, 256, (1, n))) for i, n in enumerate([5, 21, 9, 14, 30])
    ]
    samples = run_bench(methods, prompts, 16, 0.0, progress=False, batch_size=2, continuous=True)
    assert calls == [(5, 2), (5, 2)]  # warm-up, then the timed run
    assert hf_batches == [2, 2, 1, 2, 2, 1]
    assert len(samples) == 10 and all(s.agrees for s in samples) and {s.batch_size for s in samples} == {2}
    summaries = summarize(samples, "generate")
    write_results(samples, summaries, {}, {"continuous": True}, tmp_path)
    assert "each finished row replaced by the next prompt" in (tmp_path / "bench.md").read_text()


def test_quiet_speedup_keeps_the_batches_the_probe_found_at_full_speed(tmp_path):
    # three one-prompt batches, two methods: a probe before the first run and after every run, so
    # batch i's repeat sees the probes before it, between its runs and after them (shared with the
    # next batch): batch 0 max(1.0, 1.01, 1.0) = 1.01, batch 1 max(1.0, 1.3, 1.2) = 1.3, batch 2
    # max(1.2, 1.25, 1.02) = 1.25; within 5% of the fastest (1.01): batch 0 alone.
    probes = iter([1.0, 1.01, 1.0, 1.3, 1.2, 1.25, 1.02])
    # generate (reference) slows more in the slow spell (batches 1-2) than b does
    a = _ScriptedMethod("generate", [9.0, 2.0, 3.0, 3.0], [])
    b = _ScriptedMethod("b", [9.0, 1.6, 2.0, 2.0], [])
    prompts = [BenchPrompt(str(i), "x", torch.ones(1, 3, dtype=torch.long)) for i in range(3)]
    samples = run_bench(
        [a, b], prompts, max_new_tokens=4, temperature=0.0, progress=False, probe=lambda: next(probes)
    )
    assert next(probes, None) is None  # every probe taken
    assert [s.repeat_probe_seconds for s in samples if s.method == "b"] == [[1.01], [1.3], [1.25]]
    assert [s.quiet_repeats for s in samples if s.method == "b"] == [[True], [False], [False]]
    summaries = {(s.method, s.category): s for s in summarize(samples, "generate")}
    overall = summaries[("b", "all")]
    assert overall.speedup == pytest.approx(8.0 / 5.6)  # every prompt: 1.43x, the slow spell's included
    assert overall.quiet_speedup == pytest.approx(2.0 / 1.6)  # the quiet batch alone: 1.25x
    assert overall.quiet_runs == 1
    assert summaries[("generate", "all")].quiet_speedup == pytest.approx(1.0)
    write_results(samples, list(summaries.values()), {"cpu": "test"}, {}, tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "| all | b | 1.00 | 2.1 | 1.43x | 1.43x (generate) | 1.25x (1) |" in text
    assert "batch 1: fastest 1010.00 ms, median 1250.00 ms, slowest 1300.00 ms; 1 of 3 within 5%" in text
    record = json.loads((tmp_path / "bench.json").read_text())
    assert [s["quiet_repeats"] for s in record["samples"] if s["method"] == "b"] == [[True], [False], [False]]


def test_quiet_repeats_of_one_batch_are_told_apart_and_a_lone_run_is_not_called_quiet(tmp_path):
    # one batch of two prompts (as a continuous run is), three repeats: repeat 1 runs slow
    probes = iter([1.0, 1.0, 1.0, 1.4, 1.0, 1.0, 1.02])  # repeats: 1.0, 1.4, 1.02
    a = _ScriptedMethod("generate", [9.0, 2.0, 3.0, 2.0], [])
    b = _ScriptedMethod("b", [9.0, 1.0, 2.5, 1.0], [])
    prompts = [BenchPrompt(str(i), "x", torch.ones(1, 3, dtype=torch.long)) for i in range(2)]
    samples = run_bench(
        [a, b], prompts, 4, 0.0, repeats=3, progress=False, batch_size=2, probe=lambda: next(probes)
    )
    assert all(s.quiet_repeats == [True, False, True] for s in samples)
    overall = {s.method: s for s in summarize(samples, "generate") if s.category == "all"}["b"]
    assert overall.speedup_by_repeat == pytest.approx([2.0, 1.2, 2.0])
    assert (overall.quiet_speedup, overall.quiet_runs) == (pytest.approx(2.0), 4)
    # a single run of a single batch: its probe is recorded, but there is nothing to call it quiet against
    probes = iter([1.0, 1.1, 1.2])
    lone = run_bench(
        [_ScriptedMethod("generate", [9.0, 2.0], []), _ScriptedMethod("b", [9.0, 1.0], [])],
        prompts,
        4,
        0.0,
        progress=False,
        batch_size=2,
        probe=lambda: next(probes),
    )
    assert all(s.repeat_probe_seconds == [1.2] and s.quiet_repeats == [] for s in lone)
    summaries = summarize(lone, "generate")
    assert all(s.quiet_speedup is None for s in summaries)
    write_results(lone, summaries, {"cpu": "test"}, {}, tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "batch 2: fastest 1200.00 ms" in text and "quiet speedup (runs)" not in text


def test_without_probes_there_is_no_quiet_speedup(tmp_path):
    a = _ScriptedMethod("generate", [9.0, 2.0], [])
    b = _ScriptedMethod("b", [9.0, 1.0], [])
    prompts = [BenchPrompt("0", "x", torch.ones(1, 3, dtype=torch.long))]
    samples = run_bench([a, b], prompts, max_new_tokens=4, temperature=0.0, progress=False)
    summaries = summarize(samples, "generate")
    assert all(s.quiet_speedup is None and s.quiet_runs == 0 for s in summaries)
    write_results(samples, summaries, {"cpu": "test"}, {}, tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "quiet" not in text and "| all | b | 1.00 | 4.0 | 2.00x | 2.00x (generate) | 0.50 |" in text


def test_the_probe_times_a_one_token_forward_of_the_model(tiny_llama):
    from draftheads.speed_probe import forward_seconds, summarize_probes

    calls = []
    handle = tiny_llama.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(kwargs), with_kwargs=True
    )
    try:
        seconds = forward_seconds(tiny_llama, torch.tensor([[5]]), runs=2)
    finally:
        handle.remove()
    assert seconds > 0 and len(calls) == 2
    assert all(c["input_ids"].shape == (1, 1) and c["use_cache"] is False for c in calls)
    with pytest.raises(ValueError, match="runs must be >= 1, got 0"):
        forward_seconds(tiny_llama, torch.tensor([[5]]), runs=0)
    summary = summarize_probes([0.020, 0.0209, 0.025, 0.0215])
    assert (summary.fastest, summary.slowest, summary.quiet, summary.count) == (0.020, 0.025, 2, 4)
    assert summarize_probes([]) is None


def test_every_method_is_compared_with_the_fastest_plain_decoding_and_names_it():
    samples = [
        _sample("generate@fp32-default", "a", 10, 2.0, 10),
        _sample("generate@fp32-packed", "a", 10, 1.0, 10),
        _sample("generate@bf16", "a", 10, 1.6, 10, agrees=False),
        _sample("eagle3:x", "a", 10, 0.5, 5),
    ]
    summaries = {s.method: s for s in summarize(samples, "generate@fp32-default") if s.category == "all"}
    head = summaries["eagle3:x"]
    assert head.speedup == pytest.approx(4.0) and head.reference == "generate@fp32-default"
    assert head.speedup_over_fastest_plain == pytest.approx(2.0)
    assert head.fastest_plain == "generate@fp32-packed"
    assert summaries["generate@fp32-default"].speedup_over_fastest_plain == pytest.approx(0.5)
    assert "| 4.00x | 2.00x (generate@fp32-packed) |" in markdown_table(list(summaries.values()))


def test_plain_baselines_are_default_packed_and_native_bf16(tiny_llama, monkeypatch):
    import draftheads.bench
    from draftheads.bench import plain_baselines

    monkeypatch.setattr(draftheads.bench, "native_bf16", lambda: True)
    methods = plain_baselines(tiny_llama, None, packable=True)
    assert [m.name for m in methods] == ["generate@fp32-default", "generate@fp32-packed", "generate@bf16"]
    assert methods[2].model.dtype == torch.bfloat16 and tiny_llama.dtype == torch.float32
    monkeypatch.setattr(draftheads.bench, "native_bf16", lambda: False)
    assert [m.name for m in plain_baselines(tiny_llama, None, packable=False)] == ["generate@fp32-default"]
    assert [m.name for m in plain_baselines(tiny_llama.to(torch.bfloat16), None, True)] == ["generate@bf16"]


def test_bench_on_a_base_without_a_chat_template_renders_plain_prompts(tmp_path):
    """A 2-prompt file on the tiny random Gemma 3 whose tokenizer has no chat template (and puts a
    bos before any text, as Gemma's): each prompt is the plain dialogue its heads train on, with
    the stop string that rendering implies, and every method agrees with plain generate."""
    from draftheads.base_model import load_tokenizer
    from draftheads.bench import BenchSettings, bench, build_prompts
    from tests.data.data_fixtures import save_tiny_gemma3_base, write_jsonl

    base = save_tiny_gemma3_base(tmp_path / "base")
    questions = [{"id": i, "prompt": f"Say {i} twice, then count to five."} for i in range(2)]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", questions)
    settings = BenchSettings(
        base=str(base),
        prompts=str(prompts),
        max_new_tokens=6,
        adaptive=False,
        hybrid=False,
        prompt_lookup=False,
        pack=False,
        out=str(tmp_path / "out"),
    )
    summaries, _ = bench(settings, progress=False)
    overall = {s.method: s for s in summaries if s.category == "all"}
    assert "context" in overall and all(s.agreement == 1.0 for s in overall.values())
    record = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert record["settings"]["template"] == "auto" and len(record["samples"]) == 2 * len(overall)
    tokenizer = load_tokenizer(str(base))
    for question, prompt in zip(questions, build_prompts(str(prompts), tokenizer, None)):
        text = f"<|im_start|>User: {question['prompt']}\n\nAssistant:"
        assert prompt.input_ids[0].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert prompt.stop == ("\n\nUser:",)

"""``draftheads bench`` keeps its results and nobody else's: a bench.json that appears during the run
is left alone (the results go to bench-<unique>.json, said on stderr), an interrupted run keeps what
it measured (``"partial": true``), a bad ``--methods`` creates nothing, and ``--overwrite`` removes a
stale chart of bench's own but no other file: bench claims and removes only what its outputs
manifest lists, and refuses (exit 6) a chart of the same name it did not write. Each runs a tiny
bench on the tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import draftheads.bench
from draftheads.bench import BenchError, BenchSettings, SpeculativeMethod, bench
from draftheads.bench_output import OUTPUTS_NAME
from draftheads.cli import EXIT_REFUSED, main
from draftheads.optional import available
from tests.data.data_fixtures import save_tiny_base, write_jsonl

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def tiny_bench(tmp_path):
    """Settings of a tiny bench: the tiny base, two prompts, 4 tokens, generate and the context drafter."""
    base = save_tiny_base(tmp_path / "base")
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl", [{"id": i, "prompt": f"Say {i} twice."} for i in range(2)]
    )
    return BenchSettings(
        base=str(base),
        prompts=str(prompts),
        max_new_tokens=4,
        adaptive=False,
        hybrid=False,
        prompt_lookup=False,
        pack=False,
        out=str(tmp_path / "out"),
    )


def test_a_bench_json_that_appears_during_the_run_is_left_alone(tiny_bench, monkeypatch, capsys):
    out = tiny_bench.out
    run_bench = draftheads.bench.run_bench

    def another_run_writes_meanwhile(*args, **kwargs):
        with open(f"{out}/bench.json", "w") as file:  # replaces the file this run claimed
            file.write('{"another": "run"}')
        return run_bench(*args, **kwargs)

    monkeypatch.setattr(draftheads.bench, "run_bench", another_run_writes_meanwhile)
    _, paths = bench(tiny_bench, progress=False)
    assert json.loads(Path(out, "bench.json").read_text()) == {"another": "run"}
    diverted = [p for p in paths if p.suffix == ".json"]
    assert len(diverted) == 1 and diverted[0].name.startswith("bench-")
    record = json.loads(diverted[0].read_text())
    assert record["partial"] is False and {s["method"] for s in record["summaries"]} >= {"context"}
    assert diverted[0].with_suffix(".md").is_file()
    assert f"this run's results go to {diverted[0].stem}.json" in capsys.readouterr().err


def test_an_interrupted_run_keeps_what_it_measured(tiny_bench, monkeypatch):
    run = SpeculativeMethod.run
    calls = []

    def interrupted_on_the_second_prompt(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the warm-up, the first prompt, then Ctrl-C
            raise KeyboardInterrupt
        return run(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeMethod, "run", interrupted_on_the_second_prompt)
    with pytest.raises(KeyboardInterrupt):
        bench(tiny_bench, progress=False)
    record = json.loads(Path(tiny_bench.out, "bench.json").read_text())
    assert record["partial"] is True
    assert {s["prompt_id"] for s in record["samples"]} == {"0"}
    assert "context" in {s["method"] for s in record["samples"]}
    assert "Partial results" in Path(tiny_bench.out, "bench.md").read_text()


def test_unknown_methods_are_refused_before_out_is_created(tiny_bench):
    from dataclasses import replace

    with pytest.raises(BenchError, match="--methods: no method 'eagle3'"):
        bench(replace(tiny_bench, methods=("eagle3",)), progress=False)
    assert not Path(tiny_bench.out).exists()


def test_overwrite_removes_a_stale_chart_of_bench_and_nothing_else(tiny_bench):
    from dataclasses import replace

    from draftheads.optional import available

    out = Path(tiny_bench.out)
    out.mkdir()
    earlier = [("bench.json", "{}"), ("bench.md", "old"), ("throughput_by_batch.png", "old chart")]
    for name, text in earlier:
        (out / name).write_text(text)
    listed = {"written_by": "draftheads bench", "files": [name for name, _ in earlier]}
    (out / OUTPUTS_NAME).write_text(json.dumps(listed))  # an earlier run with several batch sizes
    (out / "notes.txt").write_text("mine")
    _, paths = bench(replace(tiny_bench, overwrite=True), progress=False)
    assert not (out / "throughput_by_batch.png").exists()  # from a run with several batch sizes
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "bench.json").read_text())["partial"] is False
    if available("matplotlib"):
        assert (out / "speedup_by_category.png") in paths


def test_a_chart_bench_did_not_write_is_refused_before_the_run(tiny_bench, capsys):
    out = Path(tiny_bench.out)
    out.mkdir()
    (out / "speedup_by_category.png").write_text("the user's chart")
    arguments = ["bench", "--base", tiny_bench.base, "--prompts", tiny_bench.prompts, "--out", str(out)]
    assert main([*arguments, "--max-new-tokens", "4", "--device", "cpu"]) == EXIT_REFUSED
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{out / 'speedup_by_category.png'}" in err
    assert (out / "speedup_by_category.png").read_text() == "the user's chart"
    assert sorted(p.name for p in out.iterdir()) == ["speedup_by_category.png"]


def test_overwrite_keeps_a_batch_chart_no_run_wrote(tiny_bench):
    from dataclasses import replace

    out = Path(tiny_bench.out)
    bench(tiny_bench, progress=False)  # batch size 1: no throughput_by_batch.png
    (out / "throughput_by_batch.png").write_text("the user's chart")
    with pytest.raises(FileExistsError, match="throughput_by_batch.png"):
        bench(replace(tiny_bench, overwrite=True), progress=False)
    assert (out / "throughput_by_batch.png").read_text() == "the user's chart"
    listed = json.loads((out / OUTPUTS_NAME).read_text())["files"]
    assert {"bench.json", "bench.md"} <= set(listed) and "throughput_by_batch.png" not in listed
    if available("matplotlib"):
        assert "speedup_by_category.png" in listed

"""The llama.cpp side of the engine check (draftheads.serving.llamacpp and its verdicts in engines/check.py),
without llama.cpp: the server command, the counters read from its /metrics text, the acceptance gap.

The metric names are those llama-server prints with ``--metrics`` (ggml-org/llama.cpp
tools/server/server-task.cpp: ``llamacpp:spec_decode_num_drafts_total`` (verification steps),
``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
``..._num_accepted_tokens_per_pos_total{position="i"}``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from draftheads.serving import llamacpp

ROOT = Path(__file__).resolve().parents[2]


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def check():
    yield load("engine_check_gguf", ROOT / "engines" / "check.py")
    del sys.modules["engine_check_gguf"]


METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
llamacpp:spec_decode_num_draft_tokens_total 90
llamacpp:spec_decode_num_accepted_tokens_total 41
llamacpp:spec_decode_num_drafts_total 30
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 13
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 20
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 8
"""


def test_counters_are_read_from_the_server_metrics():
    assert llamacpp.spec_counts(METRICS) == {
        "drafts": 30,
        "draft_tokens": 90,
        "accepted_tokens": 41,
        "accepted_per_position": [20, 13, 8],
    }
    without_draft = "llamacpp:prompt_tokens_total 120\nllamacpp:spec_decode_num_drafts_total 0\n"
    assert llamacpp.spec_counts(without_draft) is None


def test_server_drafts_exactly_the_chain_only_when_given_a_draft(tmp_path):
    plain = llamacpp.server_command(tmp_path / "base.gguf", 8080, None, 0)
    assert "-md" not in plain and "--spec-type" not in plain and "--metrics" in plain
    assert plain[plain.index("-ctk") + 1] == "f32" and plain[plain.index("-ctv") + 1] == "f32"
    drafted = llamacpp.server_command(tmp_path / "base.gguf", 8080, tmp_path / "d.gguf", 3)

    def value(flag):
        return drafted[drafted.index(flag) + 1]

    assert value("-md") == str(tmp_path / "d.gguf") and value("--spec-type") == "draft-eagle3"
    assert value("--spec-draft-n-max") == "3" and value("--spec-draft-p-min") == "0"
    assert value("--spec-draft-n-min") == "0" and value("-ctkd") == "f32"
    assert drafted[: len(plain)] == plain


def test_a_missing_server_is_reported_not_raised(tmp_path):
    result = llamacpp.decode(tmp_path / "base.gguf", [[1, 2]], 4, tmp_path / "log", root=tmp_path / "absent")
    assert "make engines" in result["error"]


def test_acceptance_gap_is_relative_to_ours(check):
    ours = {"drafts": 10, "accepted_per_position": [6, 4, 2]}  # 1.2 per draft
    assert check.acceptance_gap(ours, {"drafts": 10, "accepted_per_position": [6, 4, 2]}) == 0
    assert check.acceptance_gap(ours, {"drafts": 20, "accepted_per_position": [12, 9, 6]}) == pytest.approx(
        0.125
    )
    assert check.acceptance_gap(ours, {"drafts": 0, "accepted_per_position": []}) is None


def test_the_gguf_export_is_checked_in_llama_cpp(check):
    assert "gguf" in check.LLAMACPP_FORMATS and "gguf" not in check.VLLM_METHODS
    assert "gguf" not in check.NO_ENGINE_HERE


def test_a_run_can_be_limited_to_llama_cpp(check):
    assert check.engine_formats("eagle3", ("llama.cpp",)) == ["gguf"]
    assert check.engine_formats("eagle3", ("vllm",)) == ["eagle3", "speculators"]
    assert check.engine_formats("eagle3", check.ENGINE_NAMES) == ["eagle3", "speculators", "gguf"]
    assert check.engine_formats("eagle", ("llama.cpp",)) == []
    # formats no engine here serves are reported with vLLM's runs, not with llama.cpp's
    assert [row.format for row in check.uncovered_formats([], ("llama.cpp",))] == ["gguf"]
    assert "eagle-sglang" in [row.format for row in check.uncovered_formats([], ("vllm",))]


def test_gguf_differences_name_tensors_and_keys_that_differ(tmp_path):
    import numpy as np
    from gguf import GGUFValueType

    from draftheads.export.gguf import write_gguf_file

    def write(path, layers, tensors):
        fields = [
            ("eagle3.target_layers", layers, GGUFValueType.ARRAY, GGUFValueType.INT32),
            ("general.name", path.stem, GGUFValueType.STRING, None),  # names may differ
        ]
        write_gguf_file(path, "eagle3", fields, tensors)
        return path

    fc = np.arange(6, dtype=np.float32).reshape(2, 3)
    ours = write(tmp_path / "ours.gguf", [2, 15, 27], {"fc.weight": fc, "d2t": np.arange(4)})
    same = write(tmp_path / "same.gguf", [2, 15, 27], {"fc.weight": fc.copy(), "d2t": np.arange(4)})
    assert not any(
        llamacpp.gguf_differences(ours, same)[k] for k in ("only_ours", "differing", "key_differences")
    )
    other = write(tmp_path / "other.gguf", [1, 15, 27], {"fc.weight": fc + 1, "output.weight": fc})
    differences = llamacpp.gguf_differences(ours, other)
    assert differences["differing"] == ["fc.weight"]
    assert differences["only_ours"] == ["d2t"] and differences["only_converted"] == ["output.weight"]
    assert differences["key_differences"] == {"eagle3.target_layers": [[2, 15, 27], [1, 15, 27]]}


def test_dflash_is_checked_in_llama_cpp_through_its_converter(check):
    assert check.converted_formats("dflash", ("llama.cpp",)) == ["dflash"]
    assert check.converted_formats("dflash", ("vllm",)) == []
    assert check.converted_formats("eagle3", check.ENGINE_NAMES) == []
    assert check.LLAMACPP_CONVERTED["dflash"] == "draft-dflash"


def test_the_server_drafts_with_the_spec_type_it_is_given(tmp_path):
    command = llamacpp.server_command(
        tmp_path / "base.gguf", 8080, tmp_path / "d.gguf", 7, spec_type="draft-dflash"
    )
    assert command[command.index("--spec-type") + 1] == "draft-dflash"
    assert command[command.index("--spec-draft-n-max") + 1] == "7"


def converted_run(check, tmp_path):
    request = {"base": str(tmp_path / "hf"), "prompts": [[1, 5], [1, 6]]}
    reference = {"outputs": [[7, 2], [8, 2]], "seconds": 1.0, "decode_tokens_per_second": 50.0}
    llamacpp_run = {"target": str(tmp_path / "base.gguf"), "reference": reference}
    return check.BaseRun(None, None, str(tmp_path / "hf"), request, {}, {}, llamacpp_run)


@pytest.mark.parametrize(
    "outputs, accepted, failing",
    [
        ([[7, 2], [8, 2]], [3, 1], set()),
        ([[7, 2], [8, 4]], [3, 1], {"output_equals_engine_without_draft"}),
        ([[7, 2], [8, 2]], [1, 0], {"acceptance_near_ours"}),
    ],
)
def test_a_converted_dflash_draft_is_held_to_the_same_verdicts(
    check, tmp_path, monkeypatch, outputs, accepted, failing
):
    calls = {}
    monkeypatch.setattr(check, "export", lambda *args, **kwargs: None)

    def convert(checkpoint, target_dir, out, log):
        calls["convert"] = (checkpoint.name, target_dir, out.name)

    def decode(target, prompts, max_new_tokens, log, draft=None, chain=0, spec_type=None):
        calls["decode"] = (draft.name, chain, spec_type)
        counts = {
            "drafts": 4,
            "draft_tokens": 28,
            "accepted_tokens": sum(accepted),
            "accepted_per_position": accepted,
        }
        return {
            "outputs": outputs,
            "spec_decode": counts,
            "seconds": 1.0,
            "decode_tokens_per_second": 60.0,
            "command": ["llama-server"],
        }

    monkeypatch.setattr(check.llamacpp, "convert", convert)
    monkeypatch.setattr(check.llamacpp, "decode", decode)
    monkeypatch.setattr(check.llamacpp, "version", lambda: "test")
    monkeypatch.setattr(check, "head_kind", lambda head_dir: "dflash")
    ours = {"outputs": [[7, 2], [8, 2]], "drafts": 4, "accepted_per_position": [3, 1]}
    run = converted_run(check, tmp_path)
    outcome = check.check_llamacpp_converted(
        tmp_path / "head", "dflash", run, ours, 7, check.CheckSettings(), tmp_path
    )
    assert calls["convert"] == ("head.dflash.for-llamacpp", tmp_path / "hf", "head.dflash.converted.gguf")
    assert calls["decode"] == ("head.dflash.converted.gguf", 7, "draft-dflash")
    assert (outcome.engine, outcome.format) == ("llama.cpp", "dflash")
    assert {name for name, ok in outcome.checks.items() if not ok} == failing


def test_a_converter_error_is_an_engine_error(check, tmp_path, monkeypatch):
    monkeypatch.setattr(check, "export", lambda *args, **kwargs: None)
    monkeypatch.setattr(check.llamacpp, "convert", lambda *args: "convert_hf_to_gguf.py exited 1: KeyError")
    monkeypatch.setattr(check, "head_kind", lambda head_dir: "dflash")
    run = converted_run(check, tmp_path)
    outcome = check.check_llamacpp_converted(
        tmp_path / "head", "dflash", run, {}, 7, check.CheckSettings(), tmp_path
    )
    assert outcome.status == "engine-error" and "KeyError" in outcome.error


def test_draft_flags_stop_a_chain_early_only_when_asked(tmp_path):
    whole = llamacpp.draft_flags(tmp_path / "d.gguf", 4)
    assert whole[whole.index("--spec-draft-p-min") + 1] == "0"
    early = llamacpp.draft_flags(tmp_path / "d.gguf", 4, p_min=0.5)
    assert early[early.index("--spec-draft-p-min") + 1] == "0.5"
    assert early[early.index("--spec-draft-n-max") + 1] == "4"


def test_drafts_are_sampled_on_the_host_with_a_flag_llamacpp_knows(tmp_path):
    """Backend draft sampling collapses acceptance with concurrent slots (docs/engines.md): every
    draft server turns it off, with a flag the pinned llama.cpp tree defines."""
    flags = llamacpp.draft_flags(tmp_path / "d.gguf", 3)
    assert flags.count(llamacpp.DRAFT_SAMPLING) == 1
    arguments = llamacpp.source_path() / "common" / "arg.cpp"
    if not arguments.is_file():
        pytest.skip("llama.cpp's source is not here (make engines-llamacpp)")
    assert f'"{llamacpp.DRAFT_SAMPLING}"' in arguments.read_text()

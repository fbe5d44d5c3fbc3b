"""The engine check's own logic (engines/check.py), without the engines: its comparisons, the requests
it sends vLLM, its verdicts and report, and that its fresh heads are ones the engine formats take."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from draftheads.export import write_head
from draftheads.heads import DFlashConfig, PEagleConfig, build_head
from draftheads.heads.base import head_config_from_dict

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("engine_check", ROOT / "engines" / "check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_default_heads_are_the_shipped_heads_an_engine_serves(check):
    from draftheads.shipped import SHIPPED_HEADS

    assert set(check.UNSERVED_HEADS) <= set(SHIPPED_HEADS)  # no stale name
    defaults = check.CheckSettings().heads
    assert "eagle3-smollm2" in defaults and "eagle3-gemma3" not in defaults
    (row,) = check.unserved_outcomes(defaults)  # listed in the report with its reason
    assert (row.head, row.kind, row.status) == ("eagle3-gemma3", "eagle3", "unserved")
    assert "SupportsEagle3" in row.error and check.unserved_outcomes(("eagle3-gemma3",)) == []


def test_first_difference_locates_the_first_differing_token(check):
    reference = [[1, 2, 3], [4, 5, 6, 7]]
    assert check.first_difference(reference, [[1, 2, 3], [4, 5, 6, 7]]) is None
    assert check.first_difference(reference, [[1, 2, 3], [4, 5, 9, 7]]) == {
        "prompt": 1,
        "token": 2,
        "expected": [6, 7],
        "got": [9, 7],
    }
    # one output stopping early differs where the shorter ends
    assert check.first_difference(reference, [[1, 2], [4, 5, 6, 7]])["token"] == 2
    assert check.first_difference(reference, [[1, 2, 3]]) == {"prompts": [2, 1]}


def test_acceptance_matches_needs_the_same_drafts_and_counts_per_position(check):
    ours = {"drafts": 142, "accepted_per_position": [39, 12, 5]}
    assert check.acceptance_matches(ours, {"drafts": 142, "accepted_per_position": [39, 12, 5]})
    assert not check.acceptance_matches(ours, {"drafts": 141, "accepted_per_position": [39, 12, 5]})
    assert not check.acceptance_matches(ours, {"drafts": 142, "accepted_per_position": [39, 13, 5]})
    # trailing zeros are the same counts (a position nobody reached)
    none = {"drafts": 10, "accepted_per_position": [0, 0, 0]}
    assert check.acceptance_matches(none, {"drafts": 10, "accepted_per_position": []})


def test_speculators_verdicts_fail_on_any_key_or_tensor_difference(check):
    load = {"missing": [], "unexpected": [], "altered": [], "ignored_missing": ["embed_tokens.weight"]}
    convert = {"only_converted": [], "only_ours": [], "differing": [], "config_differences": {}}
    assert check.speculators_checks({"load": load, "convert": convert}) == {
        "speculators_loads": True,
        "converter_round_trip": True,
    }
    for key in ("missing", "unexpected", "altered"):
        verdict = check.speculators_checks({"load": {**load, key: ["fc.weight"]}, "convert": convert})
        assert verdict["speculators_loads"] is False, key
    for key in ("only_converted", "only_ours", "differing"):
        verdict = check.speculators_checks({"load": load, "convert": {**convert, key: ["d2t"]}})
        assert verdict["converter_round_trip"] is False, key
    differs = {**convert, "config_differences": {"draft_vocab_size": {"converted": 8192, "ours": 4096}}}
    assert check.speculators_checks({"load": load, "convert": differs})["converter_round_trip"] is False
    # a load-only algorithm (P-EAGLE: no converter reads a layout of ours) is judged on its load alone
    assert check.speculators_checks({"load": load}) == {"speculators_loads": True}
    assert check.speculators_checks({"load": {"error": "KeyError"}}) == {"speculators_loads": False}
    errors = check.speculators_checks({"load": {"error": "KeyError: x"}, "convert": {"error": "OSError: y"}})
    assert errors == {"speculators_loads": False, "converter_round_trip": False}


def test_vllm_requests_name_the_method_or_let_a_speculators_export_name_its_verifier(check, tmp_path):
    run = check.BaseRun(None, None, "/base", {"base": "/base", "prompts": [[1]]}, {}, {})
    eagle3 = check.vllm_request(run, "eagle3", tmp_path / "e3", chain=3)
    assert eagle3["speculative_config"] == {
        "method": "eagle3",
        "model": str(tmp_path / "e3"),
        "num_speculative_tokens": 3,
    }
    assert "model" not in eagle3
    medusa = check.vllm_request(run, "medusa-vllm", tmp_path / "m", chain=2)
    assert medusa["speculative_config"]["method"] == "medusa"
    speculators = check.vllm_request(run, "speculators", tmp_path / "s", chain=3)
    assert speculators["model"] == str(tmp_path / "s") and speculators["speculative_config"] is None
    dflash = check.vllm_request(run, "dflash", tmp_path / "d", chain=7)
    assert dflash["speculative_config"] == {
        "method": "dflash",
        "model": str(tmp_path / "d"),
        "num_speculative_tokens": 7,
    }
    dflash_speculators = check.vllm_request(run, "dflash-speculators", tmp_path / "ds", chain=7)
    assert dflash_speculators["model"] == str(tmp_path / "ds")
    assert dflash_speculators["speculative_config"] is None
    assert run.request == {"base": "/base", "prompts": [[1]]}  # not modified


def test_a_block_head_drafts_its_whole_block_in_every_engine(check, tiny_llama):
    """vLLM's DFlash block is 1 + num_speculative_tokens rows attending to each other, ours the trained
    block: a shorter chain would draft other tokens, so a DFlash head is checked at block_size - 1."""
    torch.manual_seed(0)
    dflash = build_head(tiny_llama, DFlashConfig(block_size=5, feature_layers=(1, 2, 3)), "tiny")
    assert check.engine_chain(dflash, chain=3) == 4
    eagle = build_head(tiny_llama, head_config_from_dict(check.UNTRAINED_HEADS["eagle"]), "tiny")
    assert check.engine_chain(eagle, chain=3) == 3
    # vLLM's parallel drafting: the root's row and num_speculative_tokens - 1 mask rows.
    peagle = build_head(tiny_llama, PEagleConfig(ttt_steps=2, feature_layers=(1, 2, 3)), "tiny")
    assert check.engine_chain(peagle, chain=3) == 2
    fresh = head_config_from_dict({**check.UNTRAINED_HEADS["peagle"], "feature_layers": [1, 2, 3]})
    assert check.engine_chain(build_head(tiny_llama, fresh, "tiny"), chain=3) == 3  # as the others


def test_report_shows_failed_checks_and_the_engines_last_error_line(check):
    outcomes = [
        check.Outcome("h", "eagle3", "eagle3", "vllm", "fail", checks={"acceptance_equals_ours": False}),
        check.Outcome(
            "h",
            "mtp",
            "mtp-deepseek",
            "none",
            "refused",
            error="draftheads export: no\nmtp needs deepseek_v3",
        ),
    ]
    outcomes[0].details = {
        "engine_acceptance": {"drafts": 3, "accepted_per_position": [1]},
        "our_acceptance": {"drafts": 3, "accepted_per_position": [2]},
    }
    report = {
        "machine": {"cpu": "cpu", "cores": 2, "cpu_flags": ["avx2"]},
        "settings": {"prompts": ["a"], "max_new_tokens": 8, "chain": 3},
        "seconds": 1.0,
        "outcomes": [json.loads(json.dumps(check.asdict(o))) for o in outcomes],
    }
    page = check.report_markdown(report)
    assert "| h | eagle3 | vllm | fail | acceptance_equals_ours NO | 3: [1] | 3: [2] |" in page
    assert "`mtp needs deepseek_v3`" in page


def test_fresh_heads_fit_the_engine_formats_they_are_made_for(check, tiny_llama, tmp_path):
    """The fresh EAGLE-1 head exists to reach vLLM's `eagle` layout, which refuses an fc bias."""
    directories = check.untrained_heads(tiny_llama, "tiny", ["eagle", "medusa"], tmp_path)
    assert [check.head_kind(d) for d in directories] == ["eagle", "medusa"]
    from draftheads.heads import load_head

    eagle = load_head(directories[0], tiny_llama)
    write_head(eagle, tmp_path / "eagle-vllm", "eagle")  # raises FormatError for a head with an fc bias
    medusa = load_head(directories[1], tiny_llama)
    write_head(medusa, tmp_path / "medusa-vllm", "medusa-vllm")
    assert json.loads((tmp_path / "medusa-vllm" / "config.json").read_text())["num_heads"] == 3


def test_the_fresh_dflash_head_exports_layer_configs_the_engines_accept(check, tiny_llama, tmp_path):
    """vLLM reads the dflash layout with transformers' AutoConfig (a Qwen3Config), speculators and vLLM
    build Qwen3Config from the speculators layout's transformer_layer_config (speculators
    models/dflash/config.py); transformers validates num_hidden_layers against layer_types."""
    from transformers import AutoConfig, Qwen3Config

    # The fresh head's config, with feature layers that exist in the tiny base (its defaults need 6+).
    config = head_config_from_dict({**check.UNTRAINED_HEADS["dflash"], "feature_layers": [1, 2, 3]})
    torch.manual_seed(0)
    head = build_head(tiny_llama, config, "tiny")
    assert check.engine_chain(head, chain=3) == 3  # as the other fresh heads
    write_head(head, tmp_path / "dflash", "dflash")
    assert AutoConfig.from_pretrained(tmp_path / "dflash").num_hidden_layers == 1
    write_head(head, tmp_path / "dflash-speculators", "dflash-speculators")
    speculators = json.loads((tmp_path / "dflash-speculators" / "config.json").read_text())
    assert Qwen3Config(**speculators["transformer_layer_config"]).num_hidden_layers == 1


def test_every_engine_format_no_head_reached_is_reported(check):
    from draftheads.export import FORMAT_REGISTRY

    reached = [check.Outcome("h", "eagle3", "eagle3", "vllm", "pass")]
    rows = check.uncovered_formats(reached)
    expected = {name for name in FORMAT_REGISTRY if name not in ("draftheads", "eagle3")}
    assert {row.format for row in rows} == expected
    assert all(row.status == "no-head" and row.error for row in rows)


class WordTokenizer:
    """Decodes ids as words, dropping the end-of-turn id 2 as a special token."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"w{i}" for i in ids if not (skip_special_tokens and i == 2))


def http_run(check, reference):
    request = {"base": "/base", "prompts": [[1, 5], [1, 6]]}
    return check.BaseRun(None, WordTokenizer(), "/base", request, {"outputs": reference}, {})


def answers(outputs, prompts=([1, 5], [1, 6])):
    return [
        {
            "text": WordTokenizer().decode(ids, skip_special_tokens=True),
            "token_ids": ids,
            "prompt_token_ids": list(p),
            "finish_reason": "stop",
        }
        for ids, p in zip(outputs, prompts)
    ]


@pytest.mark.parametrize(
    "served, failing",
    [
        ({"answers": answers([[7, 8, 2], [9, 2]])}, set()),
        ({"answers": answers([[7, 8, 2], [9, 4]])}, {"output_equals_offline", "text_equals_offline"}),
        ({"answers": answers([[7, 8, 2], [9, 2]], prompts=([1, 5], [1, 7]))}, {"prompt_ids_equal_ours"}),
        ({"answers": answers([[7, 8, 2], [9, 2]]), "counts": [4, 1]}, {"acceptance_equals_offline"}),
    ],
)
def test_the_http_check_fails_on_any_difference_from_the_offline_run(
    check, tmp_path, monkeypatch, served, failing
):
    offline_counts = {"drafts": 5, "accepted_per_position": [4, 2]}
    counts = {"drafts": 5, "accepted_per_position": served.get("counts", [4, 2])}
    result = {"answers": served["answers"], "spec_decode": counts, "seconds": 1.0}
    monkeypatch.setattr(check, "decode_over_http", lambda *args: result)
    offline = check.Outcome(
        "h", "eagle3", "eagle3", "vllm", "pass", details={"engine_acceptance": offline_counts}
    )
    run = http_run(check, [[7, 8, 2], [9, 2]])
    outcome = check.check_vllm_http(
        Path("h"), "eagle3", offline, tmp_path, run, 3, check.CheckSettings(), tmp_path
    )
    assert outcome.engine == "vllm-http"
    assert {name for name, ok in outcome.checks.items() if not ok} == failing


def test_a_server_that_cannot_start_is_an_engine_error(check, tmp_path, monkeypatch):
    monkeypatch.setattr(check, "decode_over_http", lambda *args: {"error": "ServerError: exited 1"})
    offline = check.Outcome("h", "eagle3", "speculators", "vllm", "pass")
    run = http_run(check, [[7, 2], [9, 2]])
    outcome = check.check_vllm_http(
        Path("h"), "speculators", offline, tmp_path, run, 3, check.CheckSettings(), tmp_path
    )
    assert outcome.status == "engine-error" and "exited 1" in outcome.error


def test_the_speculators_export_is_served_as_the_model_with_the_base_tokenizer(check, tmp_path):
    run = check.BaseRun(None, None, "/base", {"base": "/base", "prompts": [[1]]}, {}, {})
    assert check.http_server_settings(run, "speculators", tmp_path, 3) == {
        "model": str(tmp_path),
        "tokenizer": "/base",
        "speculative_config": None,
    }
    eagle3 = check.http_server_settings(run, "eagle3", tmp_path, 3)
    assert eagle3["model"] == "/base" and eagle3["tokenizer"] is None
    assert eagle3["speculative_config"]["method"] == "eagle3"
    assert check.HTTP_FORMATS == ("eagle3", "speculators")

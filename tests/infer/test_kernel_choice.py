"""Which linear kernels decode: chosen by (scripted) timings, cached per machine and model, never
cached from a busy machine, overridden by ``pack=True/False``, and visible in the results."""

from __future__ import annotations

import json

import pytest
import torch

from draftheads.infer import kernel_choice
from draftheads.infer.kernel_choice import FORMS, LAYOUTS, cache_key, choose_kernels
from draftheads.infer.packed import (
    MULTI_TOKEN,
    ONE_TOKEN,
    PackedLinear,
    has_packed_linears,
    packing_supported,
)
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.nn.Linear(2, 2)), reason="this torch build or CPU has no oneDNN fp32 packing"
)


def scripted(one_token: tuple[float, float], multi_token: tuple[float, float], rounds: int = 3, spread=1.0):
    """A ``measure`` that returns (default, packed) seconds per form without timing anything, and
    counts its calls; ``spread`` multiplies every other round (a busy machine)."""
    calls = []

    def measure(model):
        calls.append(model)
        figures = {ONE_TOKEN: one_token, MULTI_TOKEN: multi_token}
        return {
            (form, layout): [figures[form][i] * (spread if r % 2 else 1.0) for r in range(rounds)]
            for form in FORMS
            for i, layout in enumerate(LAYOUTS)
        }

    measure.calls = calls
    return measure


def test_each_form_gets_its_faster_kernel_and_the_choice_is_cached(tmp_path):
    cache = tmp_path / "kernels.json"
    model = make_tiny_llama()
    measure = scripted(one_token=(1.0, 1.3), multi_token=(2.0, 1.1))  # packing wins verification only
    choice = choose_kernels(model, "auto", cache, measure)
    assert choice.packed == {MULTI_TOKEN} and choice.source == "measured" and len(measure.calls) == 1
    assert has_packed_linears(model, MULTI_TOKEN) and not has_packed_linears(model, ONE_TOKEN)
    assert "one-token default, multi-token packed" in choice.describe()
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["key"] == cache_key(model) and entry["packed"] == [MULTI_TOKEN]

    again = make_tiny_llama()
    never = scripted((1.0, 1.0), (1.0, 1.0))
    cached = choose_kernels(again, "auto", cache, never)
    assert cached.packed == {MULTI_TOKEN} and cached.source == "cached" and never.calls == []
    assert has_packed_linears(again, MULTI_TOKEN) and not has_packed_linears(again, ONE_TOKEN)


def test_the_key_names_cpu_flags_threads_torch_model_and_dtype_and_a_change_re_measures(
    tmp_path, monkeypatch
):
    cache = tmp_path / "kernels.json"
    key = cache_key(make_tiny_llama())
    assert set(key) == {"cpu", "cpu_flags", "threads", "torch", "model", "dtype"}
    assert key["dtype"] == "float32" and key["threads"] == torch.get_num_threads()
    choose_kernels(make_tiny_llama(), "auto", cache, scripted((1.0, 2.0), (1.0, 2.0)))
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    measure = scripted((2.0, 1.0), (2.0, 1.0))
    choice = choose_kernels(make_tiny_llama(), "auto", cache, measure)
    assert choice.source == "measured" and choice.packed == set(FORMS) and len(measure.calls) == 1
    monkeypatch.setattr("draftheads.machine.cpu_name", lambda: "another CPU")
    assert choose_kernels(make_tiny_llama(), "auto", cache, measure).source == "measured"
    bigger = make_tiny_llama(hidden_size=96)
    assert cache_key(bigger)["model"] != key["model"]
    assert len(json.loads(cache.read_text())) == 3  # one entry per key, none replaced


def test_a_measurement_on_a_busy_machine_is_used_but_not_cached(tmp_path):
    cache = tmp_path / "kernels.json"
    busy = scripted((1.0, 2.0), (2.0, 1.0), rounds=3, spread=2.5)
    choice = choose_kernels(make_tiny_llama(), "auto", cache, busy)
    assert choice.packed == {MULTI_TOKEN} and "busy" in choice.source and not cache.exists()
    quiet = scripted((1.0, 2.0), (2.0, 1.0))
    assert choose_kernels(make_tiny_llama(), "auto", cache, quiet).source == "measured" and cache.exists()


def test_pack_true_or_false_wins_over_measurement_and_cache(tmp_path):
    cache = tmp_path / "kernels.json"
    choose_kernels(make_tiny_llama(), "auto", cache, scripted((1.0, 2.0), (1.0, 2.0)))  # cached: default
    never = scripted((1.0, 1.0), (1.0, 1.0))
    model = make_tiny_llama()
    forced = choose_kernels(model, True, cache, never)
    assert forced.packed == set(FORMS) and forced.source == "requested" and never.calls == []
    assert has_packed_linears(model, ONE_TOKEN) and has_packed_linears(model, MULTI_TOKEN)
    off = choose_kernels(model, False, cache, never)
    assert off.packed == set() and not any(isinstance(m, PackedLinear) for m in model.modules())
    with pytest.raises(ValueError, match="pack must be 'auto', True or False"):
        choose_kernels(model, "yes", cache, never)


def test_a_per_form_choice_decodes_as_the_default_kernels_do(tmp_path):
    """Packed verification with default one-token forwards: greedy output as on the default kernels."""
    reference = make_tiny_llama()
    model = make_tiny_llama()
    choose_kernels(model, "auto", tmp_path / "kernels.json", scripted((1.0, 2.0), (2.0, 1.0)))
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.inference_mode():
        expected = reference.generate(ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), expected)


def test_the_choice_is_in_the_generator_and_every_result(tmp_path, monkeypatch):
    from draftheads.infer import SpeculativeGenerator
    from tests.data.data_fixtures import save_tiny_base

    base = save_tiny_base(tmp_path / "base")
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_choice, "time_forwards", scripted((1.0, 2.0), (2.0, 1.0)))
    generator = SpeculativeGenerator.from_pretrained(None, base=str(base))
    assert generator.kernels == "one-token default, multi-token packed (measured)"
    result = generator.generate([1, 5, 9], max_new_tokens=4)
    assert result.stats.kernels == generator.kernels
    assert (tmp_path / "cache" / "kernels.json").is_file()
    forced = SpeculativeGenerator.from_pretrained(None, base=str(base), pack=False)
    assert forced.kernels == "one-token default, multi-token default (requested)"

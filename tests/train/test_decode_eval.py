"""The decode evaluation (``train.decode_eval_prompts``): at every evaluation, the head's acceptance
on the base model's greedy continuations of held-out prompts, through its Drafter.

Tiny runs on a tiny random Llama with a byte-level chat tokenizer; the heads train on the base's
own continuations of the evaluation prompts (self-distilled), so that they learn what decoding
asks of them and the acceptance measured is not zero everywhere.
"""

from __future__ import annotations

import copy
import json
import math

import datasets
import pytest
import torch

from draftheads.config import TrainConfig, load_run_config
from draftheads.data.feature_identity import CacheIdentity
from draftheads.data.features import write_feature_cache
from draftheads.heads import build_head, load_head, load_head_and_base
from draftheads.settings import ConfigError
from draftheads.train import decode_eval
from draftheads.train.loop import run_training
from draftheads.train.reporting import read_metrics
from draftheads.tuning.acceptance import measure_acceptance
from draftheads.tuning.held_out import held_out_prompts
from tests.conftest import make_tiny_llama
from tests.data.data_fixtures import make_byte_tokenizer, make_pretrained_byte_tokenizer, make_tiny_gemma3_for
from tests.train.tiny_runs import HEAD_OVERRIDES

PROMPTS, NEW_TOKENS, DEPTH = 4, 16, 3
KINDS = {
    **HEAD_OVERRIDES,
    "dflash": ["head.kind=dflash", "head.num_layers=1", "head.block_size=4", "head.feature_layers=[1,2,3]"],
    "medusa2": [
        *HEAD_OVERRIDES["medusa"],
        "head.joint=true",
        "joint.lora_rank=4",
        "joint.lora_alpha=8",
        "joint.base_loss=lm",
    ],
}
# Depths measured: Medusa's heads, MTP's modules, DFlash's block less its root; EAGLE: DEPTH.
EXPECTED_DEPTH = {"medusa": 2, "medusa2": 2, "mtp": 2, "dflash": 3, "eagle": DEPTH, "eagle3": DEPTH}


@pytest.fixture
def tokenizer():
    return make_byte_tokenizer()


@pytest.fixture
def chat_llama(tokenizer):
    """The tiny Llama over the byte tokenizer's vocabulary, its lm_head sharpened (peaked targets,
    as ``test_loop.confident_llama``)."""
    model = make_tiny_llama(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "turns": [f"Count to {i}."]}) + "\n" for i in range(6)))
    return path


def distilled_splits(model, tokenizer, prompt_file):
    """(train, validation): the base's greedy continuations of the evaluation prompts, supervised
    on the continuation."""
    ids, masks = [], []
    for prompt in held_out_prompts(str(prompt_file), 0, PROMPTS, tokenizer, 256):
        tokens = decode_eval.greedy_continuation(model, prompt, NEW_TOKENS, tokenizer.pad_token_id)
        ids.append(tokens.tolist())
        masks.append([0] * len(prompt) + [1] * (len(tokens) - len(prompt)))
    dataset = datasets.Dataset.from_dict(
        {
            "input_ids": ids,
            "loss_mask": masks,
            "length": [len(row) for row in ids],
            "id": [str(index) for index in range(len(ids))],
        }
    )
    return dataset, dataset


def _config(tmp_path, kind, prompt_file, *overrides):
    return load_run_config(
        None,
        KINDS[kind]
        + [
            f"train.output_dir={tmp_path / kind}",
            "train.max_steps=20",
            "train.micro_batch_size=4",
            "train.learning_rate=2e-2",
            "train.warmup_steps=1",
            "train.log_every=5",
            "train.eval_every=10",
            "train.save_every=10",
            "train.base_throughput_batches=0",
            f"train.decode_eval_prompts={PROMPTS}",
            f"train.decode_eval_source={prompt_file}",
            f"train.decode_eval_max_new_tokens={NEW_TOKENS}",
            f"train.decode_eval_depth={DEPTH}",
            *overrides,
        ],
    )


def cached_sequences(output_dir):
    record = json.loads((output_dir / decode_eval.CONTINUATIONS_NAME).read_text())
    return [(torch.tensor(s["tokens"]), s["prompt_length"]) for s in record["sequences"]]


def assert_is_the_tune_tree_measurement(decode: dict, model, head, sequences, depth: int) -> None:
    """``decode`` (a summary's eval["decode"]) is ``measure_acceptance`` on the same head and
    sequences, and its chain acceptance is 1 + sum_d prod_{j<=d} top1_j."""
    direct = measure_acceptance(model, head.eval(), sequences, depth, top_k=1, progress=False)
    assert len(decode["top1"]) == depth
    assert list(decode["top1"]) == [row[0] for row in direct.probabilities]
    assert list(decode["counted"]) == list(direct.counts)
    chain = 1 + sum(math.prod(decode["top1"][: d + 1]) for d in range(depth))
    assert decode["chain_acceptance"] == pytest.approx(chain)
    assert decode["prompts"] == len(sequences) == PROMPTS


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_decode_eval_is_the_tune_tree_measurement_for_every_head_kind(
    tmp_path, chat_llama, tokenizer, prompt_file, kind, capsys
):
    splits = distilled_splits(chat_llama, tokenizer, prompt_file)
    original_base = copy.deepcopy(chat_llama)  # Medusa-2's adapter goes into chat_llama in place
    summary = run_training(
        _config(tmp_path, kind, prompt_file), base_model=chat_llama, tokenizer=tokenizer, datasets=splits
    )
    output_dir = tmp_path / kind
    sequences = cached_sequences(output_dir)
    # The cached continuations are the base's own greedy tokens (one full forward's argmax).
    for tokens, prompt_length in sequences:
        assert len(tokens) == prompt_length + NEW_TOKENS
        greedy = original_base(tokens[None]).logits[0].argmax(-1)  # (T,)
        assert torch.equal(tokens[prompt_length:], greedy[prompt_length - 1 : -1])
    if kind == "medusa2":  # verified by the base with the trained adapter merged
        head, model = load_head_and_base(output_dir / "head", original_base)
    else:
        head, model = load_head(output_dir / "head", original_base), original_base
    decode = summary.eval["decode"]
    assert_is_the_tune_tree_measurement(decode, model, head, sequences, EXPECTED_DEPTH[kind])
    assert decode["top1"][0] > 0  # trained on these continuations, the first draft is often right
    # Every evaluation records it next to the held-out numbers, and the log line says it.
    evaluations = [r["eval"] for r in read_metrics(output_dir) if "eval" in r]
    assert len(evaluations) == 2 and all(
        len(e["decode"]["top1"]) == EXPECTED_DEPTH[kind] for e in evaluations
    )
    assert f"step 20 eval: loss {summary.eval['loss']:.4f}" in capsys.readouterr().out
    assert (output_dir / "curves.png").stat().st_size > 0


@pytest.mark.parametrize("setting", ["offline", "zero3"])
def test_decode_eval_reads_the_same_head_offline_and_under_zero3(
    tmp_path, chat_llama, tokenizer, prompt_file, setting
):
    """With a feature cache the base is loaded all the same and runs the measurement; under
    ZeRO-3 with every parameter partitioned, each head module gathers its own as it runs."""
    splits = distilled_splits(chat_llama, tokenizer, prompt_file)
    if setting == "offline":
        features = tmp_path / "features"
        head = build_head(chat_llama, load_run_config(None, KINDS["eagle3"]).head)
        named = {"train": splits[0], "validation": splits[1]}
        identity = CacheIdentity.build(chat_llama, "tiny", tokenizer, head, named, max_length=1024)
        write_feature_cache(chat_llama, named, features, identity, progress=False)
        overrides = [f"data.features={features}"]
    else:
        deepspeed_config = tmp_path / "zero3.json"
        deepspeed_config.write_text(
            json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
        )
        overrides = [f"train.deepspeed_config={deepspeed_config}"]
    run = _config(tmp_path, "eagle3", prompt_file, *overrides)
    summary = run_training(run, base_model=chat_llama, tokenizer=tokenizer, datasets=splits)
    head = load_head(tmp_path / "eagle3" / "head", chat_llama)
    sequences = cached_sequences(tmp_path / "eagle3")
    assert_is_the_tune_tree_measurement(summary.eval["decode"], chat_llama, head, sequences, DEPTH)


def test_decode_eval_is_off_by_default_and_changes_nothing_the_head_learns(
    tmp_path, chat_llama, tokenizer, prompt_file, monkeypatch
):
    splits = distilled_splits(chat_llama, tokenizer, prompt_file)
    short = ["train.max_steps=4", "train.eval_every=2", "train.log_every=1"]

    def refuse(*args, **kwargs):
        raise AssertionError("the decode evaluation ran while off")

    with monkeypatch.context() as patches:
        patches.setattr("draftheads.train.setup.prepare_continuations", refuse)
        patches.setattr("draftheads.train.loop.decode_acceptance", refuse)
        assert TrainConfig().decode_eval_prompts == 0
        off = _config(tmp_path / "off", "eagle", prompt_file, *short, "train.decode_eval_prompts=0")
        summary = run_training(off, base_model=chat_llama, tokenizer=tokenizer, datasets=splits)
    assert "decode" not in summary.eval
    assert not any("decode" in r["eval"] for r in read_metrics(tmp_path / "off" / "eagle") if "eval" in r)
    assert not (tmp_path / "off" / "eagle" / decode_eval.CONTINUATIONS_NAME).exists()
    # On, it measures without touching training (EAGLE draws feature noise: no RNG is consumed).
    on = _config(tmp_path / "on", "eagle", prompt_file, *short)
    run_training(on, base_model=chat_llama, tokenizer=tokenizer, datasets=splits)
    losses = {
        name: [r["loss"] for r in read_metrics(tmp_path / name / "eagle") if "loss" in r]
        for name in ("off", "on")
    }
    assert len(losses["on"]) == 4 and losses["on"] == losses["off"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.decode_eval_prompts=-1", "train.decode_eval_prompts must be >= 0, got -1"),
        ("train.decode_eval_skip=-2", "train.decode_eval_skip must be >= 0, got -2"),
        ("train.decode_eval_max_new_tokens=0", "train.decode_eval_max_new_tokens must be >= 1, got 0"),
        ("train.decode_eval_max_prompt_tokens=0", "train.decode_eval_max_prompt_tokens must be >= 1, got 0"),
        ("train.decode_eval_depth=0", "train.decode_eval_depth must be >= 1, got 0"),
        ("train.decode_eval_source=' '", "train.decode_eval_source must name prompts"),
    ],
)
def test_bad_decode_eval_values_are_refused_naming_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, ["head.kind=medusa", override])


def test_what_setup_cannot_use_is_refused_naming_the_field(tmp_path, chat_llama, tokenizer, prompt_file):
    splits = distilled_splits(chat_llama, tokenizer, prompt_file)
    missing = tmp_path / "missing.jsonl"
    run = _config(tmp_path, "medusa", prompt_file, f"train.decode_eval_source={missing}")
    with pytest.raises(ConfigError, match=rf"train.decode_eval_source={missing}: .*missing.jsonl"):
        run_training(run, base_model=chat_llama, tokenizer=tokenizer, datasets=splits)
    run = _config(tmp_path, "medusa", prompt_file, "train.decode_eval_max_prompt_tokens=8")
    with pytest.raises(
        ConfigError,
        match="train.decode_eval_source=.*none of the 6 prompts after skipping 0 has at most 8 tokens",
    ):
        run_training(run, base_model=chat_llama, tokenizer=tokenizer, datasets=splits)
    with pytest.raises(ConfigError, match="train.decode_eval_prompts=4 needs the base model's tokenizer"):
        run_training(_config(tmp_path, "medusa", prompt_file), base_model=chat_llama, datasets=splits)


def test_a_resumed_run_reads_its_continuations_and_regenerates_only_for_new_settings(
    tmp_path, chat_llama, tokenizer, prompt_file, monkeypatch
):
    splits = distilled_splits(chat_llama, tokenizer, prompt_file)
    short = ["train.max_steps=4", "train.eval_every=2", "train.save_every=2"]
    run_training(
        _config(tmp_path, "eagle3", prompt_file, *short),
        base_model=chat_llama,
        tokenizer=tokenizer,
        datasets=splits,
    )
    cache = tmp_path / "eagle3" / decode_eval.CONTINUATIONS_NAME
    written = cache.read_text()
    generated = []
    real_continuation = decode_eval.greedy_continuation

    def counting_continuation(*args, **kwargs):
        generated.append(args[1])
        return real_continuation(*args, **kwargs)

    monkeypatch.setattr(decode_eval, "greedy_continuation", counting_continuation)
    resumed = _config(tmp_path, "eagle3", prompt_file, *short, "train.max_steps=6", "train.resume=true")
    summary = run_training(resumed, base_model=chat_llama, tokenizer=tokenizer, datasets=splits)
    assert generated == [] and cache.read_text() == written
    assert summary.steps == 6 and len(summary.eval["decode"]["top1"]) == DEPTH
    # Other continuation settings (free to change on resume) make new ones.
    resumed = _config(
        tmp_path,
        "eagle3",
        prompt_file,
        *short,
        "train.max_steps=8",
        "train.resume=true",
        "train.decode_eval_max_new_tokens=8",
    )
    summary = run_training(resumed, base_model=chat_llama, tokenizer=tokenizer, datasets=splits)
    assert len(generated) == PROMPTS
    assert [len(tokens) - length for tokens, length in cached_sequences(tmp_path / "eagle3")] == [8] * PROMPTS
    assert summary.eval["decode"]["counted"][0] == 8 * PROMPTS


def test_decode_eval_renders_prompts_as_the_runs_data_template(tmp_path, prompt_file):
    """For a base without a chat template (the tiny Gemma 3 over a byte tokenizer with a bos, as
    Gemma's), ``data.template`` auto renders the held-out prompts as the plain dialogue the head
    trains on, and each continuation is HF greedy ``generate``'s, ending where a plain answer ends;
    ``data.template=chat`` is refused naming the field, and a cache is not read across templates."""
    tokenizer = make_pretrained_byte_tokenizer()
    model = make_tiny_gemma3_for(tokenizer)
    sequences = decode_eval.prepare_continuations(
        _config(tmp_path, "eagle3", prompt_file), model, tokenizer, tokenizer.pad_token_id, 0, 1, print
    )
    assert len(sequences) == PROMPTS
    for index, (tokens, prompt_length) in enumerate(sequences):
        text = f"<|im_start|>User: Count to {index}.\n\nAssistant:"
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokens[:prompt_length].tolist() == prompt
        expected = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            stop_strings=["\n\nUser:"],
            tokenizer=tokenizer,
        )
        assert tokens.tolist() == expected[0].tolist()
    chat = _config(tmp_path, "eagle3", prompt_file, "data.template=chat")  # the same output_dir
    with pytest.raises(ConfigError, match=r"^data\.template=chat, but the tokenizer .* has no chat template"):
        decode_eval.prepare_continuations(chat, model, tokenizer, tokenizer.pad_token_id, 0, 1, print)

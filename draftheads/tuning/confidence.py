"""Fit a head's acceptance confidence (``draftheads.infer.confidence``) on this head's own decoding.

Prompts from a conversation source (after the ones the head trained on) are decoded greedily with
the head's tree and context drafts merged in, unpruned, so every drafted node is verified and
labelled. The head is fitted on the first prompts' steps and scored on the last ones' against the
online calibration adaptive drafting uses without it (scored on what it had learnt before each
step, having learnt from the fitting prompts first, as a generator carries it from one sequence to
the next). Saved beside the head: ``confidence.safetensors`` and ``confidence.json`` (how it was
fitted, both scores).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from draftheads.base_model import DEFAULT_DTYPE
from draftheads.device import DEFAULT_DEVICE
from draftheads.infer.adaptive import Calibration
from draftheads.infer.confidence import (
    DEFAULT_FIT_STEPS,
    DEFAULT_HIDDEN,
    Traces,
    fit_confidence,
    path_scores,
    save_confidence,
)
from draftheads.prompt_format import DEFAULT_TEMPLATE, choose_template, stop_strings
from draftheads.settings import ConfigError
from draftheads.tuning.held_out import held_out_prompts


@dataclass(frozen=True)
class ConfidenceSettings:
    """Every default of ``draftheads fit-confidence`` (the CLI only overrides these)."""

    data: str = "sharegpt"  # a conversation source (first user turns) or a prompt file
    template: str = DEFAULT_TEMPLATE
    skip: int = 10000  # prompts skipped first: keep the head's training prompts out (as tune-tree)
    prompts: int = 32
    held_out: float = 0.25  # the share of the prompts (the last ones) scored, not fitted on
    max_new_tokens: int = 128
    max_prompt_tokens: int = 256
    hidden: int = DEFAULT_HIDDEN
    steps: int = DEFAULT_FIT_STEPS
    seed: int = 0
    dtype: str = DEFAULT_DTYPE
    device: str = DEFAULT_DEVICE


def decode_traces(generator, prompts, max_new_tokens: int, stop, progress: bool = True) -> list[Traces]:
    """One ``Traces`` per prompt: every verified step of its greedy decoding with ``generator``."""
    from tqdm.auto import tqdm

    traces = []
    for prompt in tqdm(prompts, desc="decoding", unit="prompt", disable=not progress):
        trace = Traces()
        generator.step_observers.append(trace.record)
        try:
            generator.generate(prompt, max_new_tokens=max_new_tokens, stop=stop)
        finally:
            generator.step_observers.remove(trace.record)
        traces.append(trace)
    return traces


def calibration_scores(fitting: list[Traces], scored: list[Traces]) -> dict:
    """The online calibration's ``path_scores`` on ``scored``, having first learnt from ``fitting``."""
    calibration = Calibration()

    def learn(draft, accepted) -> None:
        calibration.record(draft.sources, draft.scores, accepted)

    for trace in fitting:
        for draft, accepted in trace.steps:
            learn(draft, accepted)
    steps = [step for trace in scored for step in trace.steps]
    return path_scores(steps, calibration.path_probabilities, learn)


def fit_head_confidence(
    generator, tokenizer, head_dir: str | Path, settings: ConfidenceSettings, progress=True
):
    """Decode, fit, score and save; returns (the head, the record written to ``confidence.json``)."""
    from draftheads.machine import machine_info

    if generator.adaptive:
        raise ValueError("fit on unpruned trees: the generator must not be adaptive")
    template = choose_template(settings.template, tokenizer, "--template")
    prompts = held_out_prompts(
        settings.data, settings.skip, settings.prompts, tokenizer, settings.max_prompt_tokens, template
    )
    if len(prompts) < 2:
        raise ConfigError(
            f"--prompts: fitting and scoring need 2 prompts or more; {settings.data} gave {len(prompts)}"
        )
    traces = decode_traces(generator, prompts, settings.max_new_tokens, stop_strings(template), progress)
    scored_count = min(len(traces) - 1, max(1, math.ceil(settings.held_out * len(traces))))
    fitting, scored = traces[:-scored_count], traces[-scored_count:]
    features, labels = Traces([s for t in fitting for s in t.steps]).conditional_samples()
    head = fit_confidence(features, labels, settings.hidden, settings.steps, settings.seed)
    held_out_steps = [step for trace in scored for step in trace.steps]
    record = {
        "settings": asdict(settings),
        "method": generator.method,
        "fitting": {"prompts": len(fitting), "nodes": int(labels.numel()), "accepted": int(labels.sum())},
        "held_out": {
            "prompts": len(scored),
            "confidence": path_scores(held_out_steps, head.path_probabilities),
            "calibration": calibration_scores(fitting, scored),
        },
        "machine": machine_info(generator.model.dtype, str(generator.model.device)),
    }
    record["paths"] = [str(path) for path in save_confidence(head, head_dir, record)]
    return head, record


def describe(record: dict) -> str:
    """The scores as a few lines for the terminal."""
    held = record["held_out"]
    fitting = record["fitting"]
    lines = [
        (
            f"fitted on {fitting['nodes']} nodes ({fitting['accepted']} accepted) of {fitting['prompts']} "
            f"prompts; scored on {held['prompts']} held-out prompts ({held['confidence']['nodes']} nodes, "
            f"{held['confidence']['accepted_share']:.3f} accepted):"
        )
    ]
    for name in ("confidence", "calibration"):
        scores = held[name]
        lines.append(
            f"  {name:<12} log loss {scores['log_loss']:.4f}  Brier {scores['brier']:.4f}  "
            f"mean estimate {scores['mean_estimate']:.3f}"
        )
    return "\n".join(lines)

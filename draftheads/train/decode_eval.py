"""The decode evaluation (``train.decode_eval_prompts``): acceptance as decoding sees it.

The held-out evaluation (``draftheads.train.metrics.evaluate``) teacher-forces the head on the
data's tokens and scores each draft step on its own. Decoding is judged otherwise: a draft counts
only where it is the base model's greedy continuation of a prompt, the drafter is driven through
its ``Drafter`` (``draftheads.infer.draft``) as decoding drives it, and a chain stops at its first
miss. The two can differ widely (docs/training.md, "What a run measures"), so this evaluation
measures what decoding sees:

- at setup, once per run, the base model's greedy continuations of held-out prompts
  (``draftheads.tuning.held_out.held_out_prompts``, rendered as the run's data is:
  ``data.template``, ending where a plain answer ends), cached in the output directory
  (``CONTINUATIONS_NAME``) so a resumed run reads them instead of generating them again;
- at every evaluation, ``draftheads.tuning.acceptance.measure_acceptance`` on them, the measurement
  ``draftheads tune-tree`` makes, with the head in eval mode.

Ranks: rank 0 reads or generates the continuations and sends them to every rank; at each
evaluation every rank measures the same head on the same sequences, so all get the same result and
all make the same calls (the only collectives are ZeRO-3's gathers of each module's parameters as
it runs, which therefore line up).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from draftheads.config import RunConfig
from draftheads.prompt_format import TemplateError, choose_template, stop_strings
from draftheads.settings import ConfigError
from draftheads.storage import write_text_atomically
from draftheads.train.metrics import DecodeEvalResult
from draftheads.tuning.acceptance import measure_acceptance, measured_depth
from draftheads.tuning.held_out import held_out_prompts

CONTINUATIONS_NAME = "decode_eval_continuations.json"
CONTINUATIONS_FORMAT = 1
# One candidate per depth: depth d is then judged only where depths 1 .. d - 1 were the drafter's
# first choice, so prod_{j<=d} top1_j is the probability that a greedy chain accepts d drafts.
CHAIN_TOP_K = 1

Sequences = list[tuple[torch.Tensor, int]]  # ((T,) prompt + continuation, prompt length)


# ---- the continuations ------------------------------------------------------------------------


def continuation_settings(run: RunConfig, dtype: torch.dtype) -> dict:
    """What the continuations depend on; a cache made with other settings is not reused."""
    train = run.train
    return {
        "base": run.model.base,
        "template": run.data.template,
        "dtype": str(dtype).removeprefix("torch."),
        "source": train.decode_eval_source,
        "skip": train.decode_eval_skip,
        "prompts": train.decode_eval_prompts,
        "max_new_tokens": train.decode_eval_max_new_tokens,
        "max_prompt_tokens": train.decode_eval_max_prompt_tokens,
    }


@torch.no_grad()
def greedy_continuation(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    pad_token_id: int,
    stop: tuple[str, ...] = (),
    tokenizer=None,
) -> torch.Tensor:
    """(T,) ``prompt`` (P,) and the base model's greedy continuation of it, up to
    ``max_new_tokens`` tokens (fewer where it ends the answer: EOS, or a ``stop`` string, whose
    completing token is kept; stop strings need the ``tokenizer``)."""
    ids = prompt[None].to(model.device)  # (1, P)
    stopping = {"stop_strings": list(stop), "tokenizer": tokenizer} if stop else {}
    output = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
        **stopping,
    )
    return output[0].cpu()


def generate_continuations(model, tokenizer, run: RunConfig, pad_token_id: int) -> Sequences:
    """The base's greedy continuations of ``train.decode_eval_prompts`` held-out prompts, rendered
    by ``data.template`` (refused as that field: ``chat`` for a base without a chat template)."""
    train = run.train
    template = choose_template(run.data.template, tokenizer, "data.template")
    try:
        prompts = held_out_prompts(
            train.decode_eval_source,
            train.decode_eval_skip,
            train.decode_eval_prompts,
            tokenizer,
            train.decode_eval_max_prompt_tokens,
            template,
        )
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"train.decode_eval_source={train.decode_eval_source}: {err}") from err
    stop, new_tokens = stop_strings(template), train.decode_eval_max_new_tokens
    return [
        (greedy_continuation(model, prompt, new_tokens, pad_token_id, stop, tokenizer), len(prompt))
        for prompt in prompts
    ]


def read_continuations(path: Path, settings: dict) -> Sequences | None:
    """The sequences cached at ``path`` if they were made with ``settings``, else None."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if record.get("format") != CONTINUATIONS_FORMAT or record.get("settings") != settings:
        return None
    return [
        (torch.tensor(sequence["tokens"], dtype=torch.long), int(sequence["prompt_length"]))
        for sequence in record["sequences"]
    ]


def write_continuations(path: Path, settings: dict, sequences: Sequences) -> None:
    """Cache ``sequences`` at ``path`` (written whole, then renamed into place)."""
    record = {
        "format": CONTINUATIONS_FORMAT,
        "settings": settings,
        "sequences": [
            {"tokens": tokens.tolist(), "prompt_length": prompt_length} for tokens, prompt_length in sequences
        ],
    }
    write_text_atomically(path, json.dumps(record) + "\n")


def prepare_continuations(
    run: RunConfig,
    model,
    tokenizer,
    pad_token_id: int,
    rank: int,
    world_size: int,
    log: Callable[[str], None],
) -> Sequences:
    """Every rank's copy of the continuations: rank 0 reads them from ``train.output_dir`` or, if
    none were cached with these settings, generates and caches them; a refusal stops every rank."""
    if tokenizer is None:
        raise ConfigError(
            f"train.decode_eval_prompts={run.train.decode_eval_prompts} needs the base model's tokenizer "
            "(it renders the prompts); give it with the base model, or set "
            "train.decode_eval_prompts=0"
        )
    answer = [None, None]  # (sequences, refusal)
    if rank == 0:
        path = Path(run.train.output_dir) / CONTINUATIONS_NAME
        settings = continuation_settings(run, model.dtype)
        sequences = read_continuations(path, settings)
        if sequences is not None:
            log(f"decode eval: {len(sequences)} continuations from {path}")
        else:
            try:
                sequences = generate_continuations(model, tokenizer, run, pad_token_id)
            except (ConfigError, TemplateError) as err:
                answer = [None, str(err)]
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_continuations(path, settings, sequences)
                log(f"decode eval: generated {len(sequences)} greedy continuations into {path}")
        if answer[1] is None:
            answer = [sequences, None]
    if world_size > 1:
        torch.distributed.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise ConfigError(answer[1])
    return answer[0]


# ---- the measurement --------------------------------------------------------------------------


@torch.no_grad()
def decode_acceptance(model, head, sequences: Sequences, max_depth: int) -> DecodeEvalResult:
    """Top-1 acceptance by depth and the greedy chain's tokens per step of ``head`` (in eval
    mode, on ``model``'s device) over ``sequences``; the head's own depth where it has one (Medusa,
    MTP, DFlash), else ``max_depth``."""
    depth = measured_depth(head, max_depth)
    acceptance = measure_acceptance(model, head, sequences, depth, CHAIN_TOP_K, progress=False)
    return DecodeEvalResult.from_acceptance(acceptance, len(sequences))

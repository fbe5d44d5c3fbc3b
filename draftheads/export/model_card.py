"""The README.md model card written next to an exported head (Hugging Face Hub format).

Everything in the card is read from what the run recorded: the head's config.json (head kind and
config, base model, and the ``training`` block the trainer adds: steps, tokens, data source,
held-out ``eval``), and a ``bench.json`` from ``draftheads bench`` if one sits in the head
directory. What was not recorded is said to be missing, never filled in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftheads.base_model import hub_name
from draftheads.heads.base import HeadFormatError, inside_head, json_type_name, read_json_object

BENCH_NAME = "bench.json"
# Hub card metadata: https://huggingface.co/docs/hub/model-cards (YAML front matter).
CARD_TAGS = ("draftheads", "speculative-decoding")


def _format_number(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_format_number(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _eval_section(evaluation: dict | None) -> str:
    if not evaluation or not evaluation.get("top1"):
        return "Held-out accuracy: not recorded with this head.\n"
    rows = [
        [step + 1, top1, top5, counted]
        for step, (top1, top5, counted) in enumerate(
            zip(
                evaluation["top1"],
                evaluation.get("top5", [None] * len(evaluation["top1"])),
                evaluation.get("counted", [None] * len(evaluation["top1"])),
            )
        )
    ]
    text = (
        "Held-out accuracy per draft step "
        "(step k predicts the token k + 1 positions after the base model's own):\n\n"
    )
    text += _table(["draft step", "top-1", "top-5", "tokens counted"], rows) + "\n"
    if evaluation.get("chain_acceptance") is not None:
        text += (
            f"\nChain acceptance estimate 1 + sum_k prod_(j<=k) top1_j = "
            f"{_format_number(evaluation['chain_acceptance'])} "
            f"(held-out loss {_format_number(evaluation.get('loss'))}).\n"
        )
    return text


def _bench_section(bench: dict | None) -> str:
    if not bench:
        return ""
    rows = [
        [
            s["method"],
            s.get("prompts"),
            s.get("tau"),
            s.get("tokens_per_second"),
            s.get("speedup"),
            s.get("agreement"),
        ]
        for s in bench.get("summaries", [])
        if s.get("category") == "all"
    ]
    if not rows:
        return ""
    text = "## Benchmark\n\nFrom `draftheads bench` (`bench.json` in this repository); "
    text += f"tau = {bench.get('tau_convention', 'tokens per base-model forward')}.\n\n"
    text += _table(["method", "prompts", "tau", "tokens/s", "speedup", "identical to greedy"], rows) + "\n"
    machine = bench.get("machine")
    if machine:
        text += f"\nMachine: `{json.dumps(machine)}`\n"
    return text


def render_model_card(
    config: dict[str, Any], parameters: int, bench: dict | None = None, repo_id: str | None = None
) -> str:
    """Markdown (with Hub YAML front matter) for a head whose draftheads ``config`` is given.

    Args:
        config: the head's draftheads config.json as a dict.
        parameters: number of tensor elements in the head's own weights.
        bench: a parsed ``bench.json``, if one was recorded.
        repo_id: where the card will live (used in the usage snippet; default a local path).
    """
    kind = config["head_kind"]
    base = config.get("base_model", {})
    base_name = base.get("name_or_path") or "unknown base model"
    training = config.get("training") or {}
    location = repo_id or "path/to/this/head"
    front = ["---", "library_name: draftheads", f"base_model: {hub_name(base_name)}", "tags:"]
    front += [f"  - {tag}" for tag in (*CARD_TAGS, kind)]
    front.append("---")
    summary_rows = [
        [
            "base model",
            (
                f"`{base_name}` ({base.get('model_type')}, {base.get('num_hidden_layers')} layers, "
                f"hidden {base.get('hidden_size')}, vocab {base.get('vocab_size')})"
            ),
        ],
        ["head kind", kind],
        ["head config", f"`{json.dumps(config.get('head_config', {}))}`"],
        ["head parameters", f"{parameters:,}"],
        ["training data", training.get("data_source", "not recorded")],
        ["training steps", training.get("steps", "not recorded")],
        ["training tokens", training.get("tokens", "not recorded")],
        ["training examples", training.get("train_examples", "not recorded")],
    ]
    text = "\n".join(front) + "\n\n"
    text += f"# {kind} draft head for {base_name}\n\n"
    text += (
        "A speculative-decoding draft head trained with draftheads on the frozen base model. "
        "Decoding with it is lossless: at temperature 0 the output is the base model's greedy output, "
        "and sampling keeps the base model's distribution.\n\n"
    )
    if config.get("head_config", {}).get("joint"):
        text += (
            "**Medusa-2: outputs follow the adapted base.** These heads were trained jointly with a LoRA "
            "adapter on the base model (in `adapter/`, peft format). Loading the head (`load_head_and_base`) "
            f"merges the adapter into a copy of `{base_name}`, so decoding is lossless with respect to the "
            "*adapted* base model, not the original one.\n\n"
        )
    text += (
        "\n".join(
            ["| | |", "|---|---|"] + [f"| {name} | {_format_number(value)} |" for name, value in summary_rows]
        )
        + "\n\n"
    )
    text += "## Held-out evaluation\n\n" + _eval_section(training.get("eval")) + "\n"
    bench_text = _bench_section(bench)
    if bench_text:
        text += bench_text + "\n"
    text += (
        "## Usage\n\n```python\nfrom draftheads.infer import SpeculativeGenerator\n\n"
        f'generator = SpeculativeGenerator.from_pretrained("{location}", base="{base_name}")\n'
        'messages = [{"role": "user", "content": "Explain speculative decoding in one sentence."}]\n'
        "result = generator.generate(messages, max_new_tokens=64)  # sequences + stats (tau, tokens/s)\n"
        "```\n\n"
        "Serving in vLLM or SGLang: `draftheads export --heads DIR --format FORMAT` writes the engine "
        "layouts; see docs/export.md in the draftheads repository.\n"
    )
    return text


def read_bench(directory: Path) -> dict | None:
    """The ``bench.json`` recorded in a head directory, if any. One the card cannot read (not a JSON
    object, ``summaries`` not a list of objects each naming its ``method``) raises HeadFormatError
    naming the file and the field."""
    path = inside_head(Path(directory), Path(directory) / BENCH_NAME)
    if not path.is_file():
        return None
    bench = read_json_object(path)
    summaries = bench.get("summaries", [])
    if not isinstance(summaries, list):
        raise HeadFormatError(
            f"{path}: field 'summaries' must be a list, got {json_type_name(summaries)} {summaries!r:.80}"
        )
    for index, summary in enumerate(summaries):
        if not isinstance(summary, dict) or "method" not in summary:
            raise HeadFormatError(
                f"{path}: field 'summaries[{index}]' must be an object with a 'method', got {summary!r:.80}"
            )
    return bench

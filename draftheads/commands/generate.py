"""``draftheads generate``: stream an answer decoded with a draft head, then print tau and tokens/s.

    draftheads generate --heads runs/eagle-smollm2/head --prompt "Explain KV caches." --max-new-tokens 128

Several ``--prompt``s (or ``--prompts-file``: text, JSONL or JSON, ``draftheads.prompts_file``)
decode together as one batch: each answer is printed under its prompt's number, then each row's and
the batch's statistics, each row's with its finish reason (eos, stop, length, or context: the base
model's context is full). ``--batch-size B`` decodes at most B of them at once, each finished row
replaced by the next prompt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftheads.arguments import (
    add_draft_dtype_argument,
    add_pack_argument,
    add_template_argument,
    device_name,
    dtype_name,
    non_empty_text,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
)
from draftheads.base_model import DEFAULT_DTYPE
from draftheads.device import DEFAULT_DEVICE
from draftheads.infer.generate import (
    DEFAULT_MAX_NEW_TOKENS,
    RECOMMENDED_ADAPTIVE,
    RECOMMENDED_CONTEXT,
    RECOMMENDED_SUFFIX,
)
from draftheads.infer.tree import TREES
from draftheads.infer.verify import SamplingParams
from draftheads.prompt_format import choose_template
from draftheads.prompts_file import read_prompts_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sampling = SamplingParams()
    parser.add_argument(
        "--heads",
        default=None,
        help=(
            "head directory (config.json + model.safetensors); without it, context drafts alone (give --base)"
        ),
    )
    parser.add_argument(
        "--base", default=None, help="base model (default: the one recorded in the head's config)"
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="user message, rendered by --template; repeat it to decode a batch",
    )
    parser.add_argument(
        "--prompts-file",
        type=Path,
        default=None,
        help="a batch of prompts: a text file with one prompt per line, JSONL (a string or an object with "
        "a 'prompt' string per line) or a JSON list of them; read by suffix (.txt, .jsonl, .json, any "
        "case), else by content",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="with several prompts: decode at most B at once, replacing each finished row with the next "
        "prompt (default: all at once)",
    )
    parser.add_argument(
        "--stop",
        type=non_empty_text,
        action="append",
        default=None,
        help="stop string (repeatable); the answer ends before it",
    )
    parser.add_argument(
        "--stop-token-id",
        type=non_negative_int,
        action="append",
        default=None,
        help="stop token id (repeatable)",
    )
    add_template_argument(parser)
    parser.add_argument(
        "--raw", action="store_true", help="use the prompt as the text to continue, without --template"
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=sampling.temperature,
        help="0 (or below 1e-5): greedy (lossless either way)",
    )
    parser.add_argument("--top-p", type=probability, default=sampling.top_p)
    parser.add_argument("--top-k", type=non_negative_int, default=sampling.top_k)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--tree", default=None, choices=sorted(TREES), help="draft tree (default: by head and device)"
    )
    parser.add_argument(
        "--dtype",
        type=dtype_name,
        default=DEFAULT_DTYPE,
        help="auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16",
    )
    parser.add_argument("--device", type=device_name, default=DEFAULT_DEVICE)
    parser.add_argument(
        "--no-context",
        dest="context",
        action="store_false",
        default=RECOMMENDED_CONTEXT,
        help="draft with the head alone (default: context drafts merged into the head's tree)",
    )
    parser.add_argument(
        "--suffix",
        action="store_true",
        default=RECOMMENDED_SUFFIX,
        help="suffix drafts in place of context drafts: they also match this run's earlier answers "
        "(alone without --heads, else merged into the head's tree)",
    )
    parser.add_argument(
        "--no-adaptive",
        dest="adaptive",
        action="store_false",
        default=RECOMMENDED_ADAPTIVE,
        help="verify every drafted node (default: prune each tree to what pays on this machine, and "
        "let a head that does not pay sit steps out)",
    )
    add_draft_dtype_argument(parser)
    add_pack_argument(parser)


def usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with how the command was called (exit status 2), or None."""
    if not args.prompt and args.prompts_file is None:
        return "give a prompt: --prompt TEXT (repeatable) or --prompts-file FILE"
    if args.raw and any(not prompt for prompt in args.prompt or ()):
        return "--raw --prompt '' is empty: give the text the model should continue"
    if args.heads is None and args.base is None:
        return "give a head directory (--heads) or, to draft from the context alone, --base"
    if args.heads is None and args.tree is not None:
        return f"--tree {args.tree} is a head's tree; without --heads the context drafts alone"
    if args.suffix and not args.context:
        return "--suffix drafts in place of the context drafts that --no-context turns off: give one"
    return None


def context_note(generator, index: int, stats) -> str | None:
    """A line for a row cut at the base model's context, or None."""
    if stats.finish_reason != "context":
        return None
    return (
        f"[prompt {index}] the base model's context ({generator.max_length} positions) is full: "
        "the answer is cut there"
    )


def run(args: argparse.Namespace) -> int:
    from draftheads.infer.generate import SpeculativeGenerator

    problem = usage_problem(args)
    if problem is not None:
        print(f"draftheads generate: {problem}", file=sys.stderr)
        return 2
    # An unreadable --prompts-file (PromptsFileError), like a bad head directory or device, ends
    # the command as one line with the exit status of its kind, in draftheads.cli.main.
    prompts = list(args.prompt or []) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    generator = SpeculativeGenerator.from_pretrained(
        args.heads,
        base=args.base,
        dtype=args.dtype,
        device=args.device,
        tree=args.tree,
        pack=args.pack,
        context=args.context,
        suffix=args.suffix,
        adaptive=args.adaptive,
        draft_dtype=args.draft_dtype,
    )
    if not args.raw:  # --template chat on a base without a chat template: refused naming the flag
        choose_template(args.template, generator.tokenizer, "--template")
    inputs = [p if args.raw else [{"role": "user", "content": p}] for p in prompts]
    options = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "stop_token_ids": args.stop_token_id or (),
        "template": args.template,
    }
    if len(inputs) == 1:
        stream = generator.generate(inputs[0], stream=True, **options)
        for piece in stream:
            print(piece, end="", flush=True)
        print()
        stats = stream.result.stats
        summary = f"{stats.summary()}; {stats.forward_passes} base forwards"
        print(f"[{generator.method}, tree {stats.tree}, kernels {stats.kernels}] {summary}", file=sys.stderr)
        notes = [context_note(generator, 0, stats)]
    else:
        result = generator.generate(inputs, batch_size=args.batch_size, **options)
        for index, row in enumerate(result.results):
            print(f"--- prompt {index}: {prompts[index][:60]!r}")
            print(row.text)
            print(f"[prompt {index}] {row.stats.summary()}", file=sys.stderr)
        print(
            f"[{generator.method}, tree {generator.tree.name}, kernels {generator.kernels}] "
            f"{result.stats.summary()}",
            file=sys.stderr,
        )
        notes = [context_note(generator, index, row.stats) for index, row in enumerate(result.results)]
    for note in filter(None, notes):
        print(note, file=sys.stderr)
    return 0

"""Write a random-weight base with a real model's layer widths and only a few layers.

Training memory and time at the widths users train (hidden 4096, vocabularies of 128k-152k) can be
measured on a CPU with such a base: every tensor of a layer, the embeddings and the lm_head have
their real shapes, only the depth is cut. The shapes come from a ``config.json`` (configs/bases/);
the tokenizer (with its chat template) is the embedded SmolLM2's, whose ids all fall inside the
larger vocabularies, so the embedded data trains it as it is.

    python scripts/wide_base.py --shape configs/bases/llama3-8b.json --layers 4 --out runs/bases/llama3-8b-4l

It also writes ``conversations.jsonl`` beside the weights: long conversations whose every row fills
``data.max_length`` (``data.source=OUT/conversations.jsonl``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

TOKENIZER = "smollm2-135m-instruct"
CONVERSATIONS = "conversations.jsonl"


def write_long_conversations(path: Path, count: int, words: int = 3000) -> None:
    """``count`` ShareGPT records whose answers run to ``words`` numbers (well over 4,096 tokens), so
    that every training row fills ``data.max_length``: a step's memory is then that of T tokens."""
    with path.open("w") as out:
        for index in range(count):
            answer = " ".join(str(index * 7 + word) for word in range(words))
            turns = [
                {"from": "human", "value": f"Count on from {index * 7}."},
                {"from": "gpt", "value": answer},
            ]
            out.write(json.dumps({"id": f"long-{index}", "conversations": turns}) + "\n")


def wide_config(shape: dict, layers: int, tie: bool):
    from transformers import AutoConfig

    fields = {**shape, "num_hidden_layers": layers, "tie_word_embeddings": tie}
    fields.pop("max_window_layers", None)  # Qwen3's: must not exceed the layer count
    if "layer_types" in fields:
        fields["layer_types"] = fields["layer_types"][:layers]
    return AutoConfig.for_model(**fields)


def main() -> None:
    from transformers import AutoModelForCausalLM

    from draftheads.base_model import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=Path, required=True, help="a config.json whose widths to keep")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--tie", action="store_true", help="tie lm_head to the embeddings")
    parser.add_argument("--out", type=Path, required=True, help="a new directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--conversations", type=int, default=32, help=f"long conversations written to OUT/{CONVERSATIONS}"
    )
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"--out {args.out} exists: give a new directory")
    tokenizer = load_tokenizer(TOKENIZER)
    config = wide_config(json.loads(args.shape.read_text()), args.layers, args.tie)
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    write_long_conversations(args.out / CONVERSATIONS, args.conversations)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {config.model_type}, {args.layers} layers, {parameters / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main()

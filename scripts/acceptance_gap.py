"""Where the gap between training's held-out top-1 and decode-time acceptance comes from
(docs/log.md, 2026-11-24: the acceptance gap).

Every number here is one measurement, the one `draftheads tune-tree` makes: acceptance through
the head's own Drafter along the base model's greedy path (``draftheads.tuning.acceptance``),
recorded per position and then split by what differs between training and decoding:

- the prompts: held-out conversations of the shipped distilled corpus (SmolLM2's own greedy
  answers to ShareGPT: the training distribution), MT-bench first turns, HumanEval problems;
- where the drafted token sits in its answer (answer tokens 0-31, 32-63, 64-127, 128-255) and how
  long the context is (under 192 tokens, the old training windows, or 192-511);
- which answer of a conversation (the first, or a later one after the model's own earlier answers);
- the features' precision: fp32 as decoding computes them, or rounded to bf16 as the feature
  cache stored them for training (first head, corpus text);
- how sure the base itself is of the token the draft must match (its softmax probability of its
  own greedy token there): a text whose answers the base writes with less confidence is harder to
  draft whatever the head trained on, so comparing texts within one confidence bucket separates
  what the text's prompts cost from what data could fix.

    python scripts/acceptance_gap.py OUT_DIR --heads HEAD [HEAD ...] \
        [--chunks 5 6] [--conversations 48] [--prompts 48] [--max-new-tokens 192] [--depth 4]

The corpus conversations are taken evenly across the given chunks (source conversations a head
trained on must not be among them); MT-bench and HumanEval continuations are the base's greedy
ones (decoded once, saved in OUT_DIR, reused by a re-run). Writes OUT_DIR/results.json, prints
a table and draws OUT_DIR/top1_by_split.png (`--replot` redraws it from results.json alone).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draftheads.base_model import load_base
from draftheads.data.corpus import Corpus
from draftheads.data.sources import read_conversations
from draftheads.data.template import encode_conversation
from draftheads.heads import load_head_and_base, resolve_base_model
from draftheads.heads.base import resolve_head_dir
from draftheads.infer.draft import drafter_for
from draftheads.infer.generate import SpeculativeGenerator
from draftheads.machine import machine_info
from draftheads.tuning.acceptance import acceptance_from_ranks, base_forward, drafter_ranks
from draftheads.tuning.held_out import held_out_prompts

CORPUS = "docs/results/corpus/smollm2-sharegpt"
MAX_LENGTH = 512  # the corpus's windows
ANSWER_BUCKETS = ((0, 32), (32, 64), (64, 128), (128, 256))
CONTEXT_BUCKETS = ((0, 192), (192, MAX_LENGTH))
CONFIDENCE_EDGES = (0.5, 0.8, 0.95)  # buckets of the base's p(greedy token): [0, 0.5), ..., [0.95, 1]
TOP_K = 8


# ---- the text ------------------------------------------------------------------------------------


def corpus_sequences(tokenizer, chunks: list[int], count: int) -> list[dict]:
    """``count`` conversations spread evenly over ``chunks`` of the shipped corpus: token ids in a
    512-token window, the answer each token belongs to (-1 outside answers), and its offset in it."""
    corpus = Corpus.load(CORPUS)
    files = corpus.files()
    conversations = []
    for chunk in chunks:
        read, _ = read_conversations(str(files[chunk]))
        conversations.extend(read)
    step = max(len(conversations) // count, 1)
    picked = conversations[::step][:count]
    sequences = []
    for conversation in picked:
        encoded = encode_conversation(tokenizer, conversation.messages, MAX_LENGTH)
        mask = torch.tensor(encoded.loss_mask)
        starts = (mask[1:] == 1) & (mask[:-1] == 0)  # an answer begins where the mask turns on
        answer = torch.cumsum(torch.cat([mask[:1] == 1, starts]).long(), 0) - 1
        answer = torch.where(mask == 1, answer, torch.full_like(answer, -1))
        offset = torch.zeros_like(answer)
        for index in range(1, len(mask)):
            if mask[index] == 1 and mask[index - 1] == 1:
                offset[index] = offset[index - 1] + 1
        sequences.append({"tokens": torch.tensor(encoded.input_ids), "answer": answer, "offset": offset})
    return sequences


def prompt_sequences(
    generator, tokenizer, source: str, count: int, max_new_tokens: int, cache: Path
) -> list[dict]:
    """The base's greedy continuations of ``count`` prompts of ``source`` (one answer each)."""
    if cache.is_file():
        saved = torch.load(cache)
    else:
        prompts = held_out_prompts(source, 0, count, tokenizer, max_prompt_tokens=256)
        started = time.perf_counter()
        results = generator.generate(prompts, max_new_tokens=max_new_tokens).results
        print(f"[gap] {source}: {len(results)} greedy continuations in {time.perf_counter() - started:.0f} s")
        saved = [(r.sequences[0], r.prompt_length) for r in results]
        torch.save(saved, cache)
    sequences = []
    for tokens, prompt_length in saved:
        positions = torch.arange(len(tokens))
        inside = positions >= prompt_length
        sequences.append(
            {
                "tokens": tokens,
                "answer": torch.where(inside, 0, -1),
                "offset": torch.where(inside, positions - prompt_length, 0),
            }
        )
    return sequences


# ---- the measurement -----------------------------------------------------------------------------


def position_ranks(model, head, sequence: dict, depth: int, bf16_features: bool) -> dict:
    """Ranks (P, depth) of the true token among the drafter's top-8 at every root inside an answer,
    with the root's answer index, answer offset and context length."""
    tokens = sequence["tokens"]
    logits, features = base_forward(model, head, tokens)
    confidence, greedy = (part.cpu() for part in logits.float().softmax(dim=-1).max(dim=-1))
    if bf16_features:
        features = features.to(torch.bfloat16).to(features.dtype)
    first = int((sequence["answer"] >= 0).nonzero()[0])  # the first answer token
    start = first - 1  # row t judges the root x[t+1] = g[t] and drafts g[t+1 ..]
    ranks = drafter_ranks(drafter_for(head), features, tokens, greedy, start, depth, TOP_K)
    roots = torch.arange(start, len(tokens) - 1) + 1
    # Decoding drafts after a root the base produced inside its answer, for a token of the answer.
    answer = sequence["answer"]
    keep = (roots + 1 < len(tokens)) & (answer[roots] >= 0)
    keep &= answer[(roots + 1).clamp(max=len(tokens) - 1)] >= 0
    return {
        "ranks": ranks[keep],
        "answer": sequence["answer"][roots][keep],
        "offset": sequence["offset"][roots][keep],
        "context": roots[keep] + 1,
        # depth 1 drafts g[t+1], the base's greedy token at the root's position
        "confidence": confidence[roots][keep],
    }


def merged(parts: list[dict]) -> dict:
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def summary(ranks: torch.Tensor, confidence: torch.Tensor) -> dict:
    model = acceptance_from_ranks(ranks, TOP_K)
    top1 = [row[0] for row in model.probabilities]
    chain, product = 1.0, 1.0
    for p in top1:
        product *= p
        chain += product
    return {
        "top1_by_depth": [round(p, 4) for p in top1],
        "top8_depth1": round(sum(model.probabilities[0]), 4),
        "greedy_chain_tokens": round(chain, 4),
        "positions": list(model.counts),
        "mean_base_confidence": round(float(confidence.mean()), 4),
    }


def splits(data: dict) -> dict:
    rows = {"all": torch.ones(len(data["answer"]), dtype=torch.bool)}
    for low, high in ANSWER_BUCKETS:
        rows[f"answer tokens {low}-{high - 1}"] = (data["offset"] >= low) & (data["offset"] < high)
    for low, high in CONTEXT_BUCKETS:
        rows[f"context {low}-{high - 1}"] = (data["context"] >= low) & (data["context"] < high)
    if (data["answer"] > 0).any():
        rows["first answer"] = data["answer"] == 0
        rows["later answers"] = data["answer"] > 0
    bucket = torch.bucketize(data["confidence"], torch.tensor(CONFIDENCE_EDGES), right=True)
    for index, (low, high) in enumerate(zip((0.0, *CONFIDENCE_EDGES), (*CONFIDENCE_EDGES, 1.0))):
        rows[f"base p {low:.2f}-{high:.2f}"] = bucket == index
    return {
        name: summary(data["ranks"][mask], data["confidence"][mask])
        for name, mask in rows.items()
        if mask.any()
    }


def _label(head: str) -> str:
    """A head directory's short name: the run's name for a run's ``head/`` output."""
    path = Path(head)
    return f"{path.parent.name}/{path.name}" if path.name == "head" else path.name


def plot(results: dict, path: Path) -> None:
    """One panel per text, a bar per split and head: top-1 acceptance at depth 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = results["heads"]
    texts = [t for t in next(iter(heads.values())) if "bf16" not in t]
    fig, axes = plt.subplots(1, len(texts), figsize=(5 * len(texts), 4.2), sharey=True)
    width = 0.8 / len(heads)
    for ax, text in zip(axes, texts):
        splits_here = list(next(iter(heads.values()))[text])
        for i, (head, by_text) in enumerate(heads.items()):
            values = [by_text[text][s]["top1_by_depth"][0] for s in splits_here]
            ax.bar([x + i * width for x in range(len(splits_here))], values, width, label=_label(head))
        ax.set_xticks([x + width * (len(heads) - 1) / 2 for x in range(len(splits_here))], splits_here)
        ax.tick_params(axis="x", rotation=60, labelsize=8)
        ax.set_title(text)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("top-1 acceptance at depth 1")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--heads", nargs="+", help="head directories (all but --replot)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[5, 6], help="corpus chunks held out")
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=48, help="MT-bench and HumanEval prompts each")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--replot", action="store_true", help="only redraw the chart from results.json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        plot(json.loads((args.out / "results.json").read_text()), args.out / "top1_by_split.png")
        return
    if not args.heads:
        parser.error("--heads is required (unless --replot)")
    torch.manual_seed(0)

    head_dirs = [resolve_head_dir(h) for h in args.heads]
    model, tokenizer = load_base(resolve_base_model(head_dirs[0], None), dtype="float32")
    head, model = load_head_and_base(head_dirs[0], model)
    generator = SpeculativeGenerator(model, head, tokenizer)
    texts = {
        "corpus (held out)": corpus_sequences(tokenizer, args.chunks, args.conversations),
        "mt-bench": prompt_sequences(
            generator, tokenizer, "mt-bench", args.prompts, args.max_new_tokens, args.out / "mt-bench.pt"
        ),
        "humaneval": prompt_sequences(
            generator, tokenizer, "humaneval", args.prompts, args.max_new_tokens, args.out / "humaneval.pt"
        ),
    }
    results = {"machine": machine_info(model.dtype, "cpu"), "settings": vars(args) | {"out": str(args.out)}}
    results["settings"]["heads"] = [str(h) for h in head_dirs]
    results["heads"] = {}
    for head_dir in head_dirs:
        head, model = load_head_and_base(head_dir, model)
        by_text = {}
        for name, sequences in texts.items():
            # The bf16 check once, on the corpus and the first head: it answers the same question for all.
            check = name.startswith("corpus") and head_dir == head_dirs[0]
            variants = [("", False)] + ([(" + bf16 features", True)] if check else [])
            for suffix, bf16 in variants:
                started = time.perf_counter()
                data = merged([position_ranks(model, head, s, args.depth, bf16) for s in sequences])
                by_text[name + suffix] = splits(data)
                seconds, count = time.perf_counter() - started, len(data["answer"])
                top1 = by_text[name + suffix]["all"]["top1_by_depth"]
                print(f"[gap] {head_dir}: {name + suffix}: {count} positions, {seconds:.0f} s, {top1}")
        results["heads"][str(head_dir)] = by_text
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "top1_by_split.png")
    for head_dir, by_text in results["heads"].items():
        header = "| text | split | top-1 by depth | top-8, depth 1 | chain | positions | base p |"
        print(f"\n{head_dir}\n{header}")
        print("|---|---|---|---:|---:|---:|---:|")
        for name, rows in by_text.items():
            for split, s in rows.items():
                depths = " / ".join(f"{p:.3f}" for p in s["top1_by_depth"])
                chain, top8, count = s["greedy_chain_tokens"], s["top8_depth1"], s["positions"][0]
                numbers = f"{top8:.3f} | {chain:.2f} | {count} | {s['mean_base_confidence']:.3f}"
                print(f"| {name} | {split} | {depths} | {numbers} |")


if __name__ == "__main__":
    main()

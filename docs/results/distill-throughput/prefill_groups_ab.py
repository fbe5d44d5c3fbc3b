"""The in-process engine with its prompts prefilled in one right-padded forward (as before
``prefill_groups``) against grouped by length, alternating in one process on the same
conversations (docs/training.md, "Throughput: today's path vs the engines"):

    LIMIT=160 python docs/results/distill-throughput/prefill_groups_ab.py OUT_DIR

Settings of the shipped corpus (``--max-new-tokens 256 --max-length 512``), fp32, 32 slots, packed
linears. Prints tokens/s (answer tokens over the wall time), prefill time and padded prompt
tokens for each pass, and whether both write the same answers.
"""

import json
import os
import sys
import time
from pathlib import Path

from draftheads.base_model import load_base
from draftheads.config import DistillConfig
from draftheads.data import distill_hf
from draftheads.data.distill import distill
from draftheads.data.sources import read_conversations
from draftheads.infer.packed import pack_linears

LIMIT = int(os.environ.get("LIMIT", "160"))


def one_group(lengths: list[int], forward_tokens: int = 0) -> list[list[int]]:
    """Every prompt in one right-padded forward: the engine before ``prefill_groups``."""
    return [sorted(range(len(lengths)), key=lambda i: lengths[i])]


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    conversations, _ = read_conversations("sharegpt", None, LIMIT)
    model, tokenizer = load_base("smollm2-135m-instruct")
    pack_linears(model)
    config = DistillConfig(max_new_tokens=256, batch_size=32)
    grouped = distill_hf.prefill_groups
    together = distill_hf.ContinuousBatcher._prefill_together
    counts = {"seconds": 0.0, "padded": 0, "forwards": 0}

    def timed_prefill(self, cache, turns):
        started = time.perf_counter()
        tokens = together(self, cache, turns)
        counts["seconds"] += time.perf_counter() - started
        counts["padded"] += len(turns) * max(len(turn.prompt_ids) for _, turn in turns)
        counts["forwards"] += 1
        return tokens

    distill_hf.ContinuousBatcher._prefill_together = timed_prefill
    results, written = {}, {}
    for name in ("one forward", "grouped", "one forward", "grouped"):
        distill_hf.prefill_groups = one_group if name == "one forward" else grouped
        counts.update(seconds=0.0, padded=0, forwards=0)
        path = out_dir / f"{name.replace(' ', '-')}.jsonl"
        path.unlink(missing_ok=True)
        started = time.perf_counter()
        distill(model, tokenizer, conversations, path, config, 512, False)
        seconds = time.perf_counter() - started
        answers = {
            (record["id"], k): turn["value"]
            for record in map(json.loads, path.read_text().splitlines())
            for k, turn in enumerate(t for t in record["conversations"] if t["from"] == "gpt")
        }
        tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in answers.values())
        row = {
            "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / seconds, 1),
            "prefill_seconds": round(counts["seconds"], 1),
            "prefill_forwards": counts["forwards"],
            "padded_prompt_tokens": counts["padded"],
            "answers": len(answers),
        }
        if name in written:
            row["same_answers_as_first_pass"] = written[name] == answers
        written.setdefault(name, answers)
        results.setdefault(name, []).append(row)
        print(name, row, flush=True)
    results["answers identical between the two"] = written["one forward"] == written["grouped"]
    print(results["answers identical between the two"])
    (out_dir / "prefill_groups_ab.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

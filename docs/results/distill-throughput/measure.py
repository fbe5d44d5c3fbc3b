"""Distillation throughput, every engine on the same conversations in one run (docs/training.md,
"Distillation"). Today's path is ``distill`` as of commit 55a5992 (HF ``generate``, left-padded
batches), read from a copy of that file:

    git show 55a5992:draftheads/data/distill.py > /tmp/old_distill.py
    OMP_NUM_THREADS=1 taskset -c 0 python docs/results/distill-throughput/measure.py OUT_DIR old spec hf vllm

LIMIT (conversations, 64), SLOTS (the hf engine's slot counts, "32,64"), FLIGHT (the vllm engine's
requests in flight, "64"), NEW and LENGTH (``--max-new-tokens`` and ``--max-length``, 112 and 192:
the documented recipe when this was first measured; the shipped corpus uses 256 and 512) come from
the environment. Every engine's answers are compared with today's, when today's ran.

tokens/s counts the answer tokens written (re-tokenized, so every engine is counted alike) over
the wall time of the distillation, model loading and server start excluded.
"""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from transformers import AutoConfig

from draftheads.base_model import load_base, resolve_base_path
from draftheads.config import DistillConfig
from draftheads.data.distill import context_limit, distill
from draftheads.data.sources import read_conversations

BASE, BATCH = "smollm2-135m-instruct", 32
NEW = int(os.environ.get("NEW", "112"))  # --max-new-tokens
MAX_LENGTH = int(os.environ.get("LENGTH", "192"))  # --max-length
LIMIT = int(os.environ.get("LIMIT", "64"))  # conversations
SLOTS = [int(n) for n in os.environ.get("SLOTS", "32,64").split(",")]  # hf engine slot counts tried
FLIGHT = [int(n) for n in os.environ.get("FLIGHT", "64").split(",")]  # vllm requests in flight tried


def answers(path: Path) -> dict[tuple[str, int], str]:
    """(conversation id, answer index) -> answer; engines write conversations in different orders."""
    written = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        texts = [turn["value"] for turn in record["conversations"] if turn["from"] == "gpt"]
        written.update({(record["id"], index): text for index, text in enumerate(texts)})
    return written


def main(out_dir: Path, which: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    conversations, _ = read_conversations("sharegpt", None, LIMIT)
    model, tokenizer = load_base(BASE)
    config = DistillConfig(max_new_tokens=NEW, batch_size=BATCH)
    results = {"settings": {"conversations": LIMIT, "max_new_tokens": NEW, "max_length": MAX_LENGTH}}

    def record(name: str, path: Path, seconds: float, **extra) -> None:
        written = answers(path)
        tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in written.values())
        results[name] = {
            "seconds": round(seconds, 1),
            "answers": len(written),
            "answer_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1),
        }
        reference = out_dir / "old.jsonl"
        if name != "today" and "today" in results and reference.is_file():
            today = answers(reference)
            same = sum(written.get(key) == text for key, text in today.items())
            results[name]["identical_to_today"] = f"{same} / {len(today)}"
            results[name]["speedup"] = round(
                results[name]["tokens_per_s"] / results["today"]["tokens_per_s"], 2
            )
        results[name].update(extra)
        print(name, results[name], flush=True)

    def timed(name: str, file: str, run) -> None:
        path = out_dir / file
        path.unlink(missing_ok=True)
        started = time.perf_counter()
        run(path)
        record(name, path, time.perf_counter() - started)

    if "old" in which:
        spec = importlib.util.spec_from_file_location("old_distill", "/tmp/old_distill.py")
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_distill"] = old  # dataclasses look their module up there
        spec.loader.exec_module(old)
        timed(
            "today",
            "old.jsonl",
            lambda p: old.distill(model, tokenizer, conversations, p, config, MAX_LENGTH, False),
        )
    if "spec" in which or "hf" in which:
        from draftheads.infer.packed import pack_linears

        pack_linears(model)
    if "spec" in which:
        from draftheads.infer.generate import SpeculativeGenerator

        generator = SpeculativeGenerator(model, None, tokenizer)

        def spec_engine(queue):  # batches of up to BATCH turns, no refill, context drafts
            while True:
                turns = []
                while len(turns) < BATCH and (turn := queue.take()) is not None:
                    turns.append(turn)
                if not turns:
                    return
                batch = generator.generate([t.prompt_ids for t in turns], max_new_tokens=NEW)
                for turn, result in zip(turns, batch.results):
                    queue.give(turn.key, result.new_tokens)

        timed(
            "context",
            "spec.jsonl",
            lambda p: distill(model, tokenizer, conversations, p, config, MAX_LENGTH, False, spec_engine),
        )
    if "hf" in which:
        for slots in SLOTS:
            slotted = DistillConfig(max_new_tokens=NEW, batch_size=slots)
            timed(
                f"hf{slots}",
                f"hf{slots}.jsonl",
                lambda p, c=slotted: distill(model, tokenizer, conversations, p, c, MAX_LENGTH, False),
            )
    if "vllm" in which:
        from draftheads.data.distill_vllm import ServerEngine, check_server
        from draftheads.data.vllm_server import vllm_server

        base = resolve_base_path(BASE)
        model_config = AutoConfig.from_pretrained(base)
        context = context_limit(model_config, MAX_LENGTH)
        started = time.perf_counter()
        with vllm_server("engines/.venvs/vllm", base, out_dir / "vllm.log", max_model_len=context) as url:
            results["vllm_server_start_s"] = round(time.perf_counter() - started, 1)
            checked = check_server(url, base, tokenizer, context)
            for count in FLIGHT:
                flying = DistillConfig(max_new_tokens=NEW, requests_in_flight=count, server=url)
                engine = ServerEngine(url, checked, flying)
                timed(
                    f"vllm{count}",
                    f"vllm{count}.jsonl",
                    lambda p, c=flying, e=engine: distill(
                        None, tokenizer, conversations, p, c, MAX_LENGTH, False, e.run, model_config
                    ),
                )
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])

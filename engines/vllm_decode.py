"""Greedy decoding in vLLM, with or without a draft, run by the engine check inside vLLM's own
virtualenv (it imports nothing from draftheads).

    python engines/vllm_decode.py REQUEST.json RESULT.json

REQUEST: {"base": model dir, "dtype": "float32", "prompts": [[token ids]], "max_new_tokens": N,
"speculative_config": vLLM's dict or null, "model": optional model dir that replaces "base"
(a speculators export names its verifier itself)}. RESULT: {"outputs": [[new token ids]],
"spec_decode": {"drafts", "draft_tokens", "accepted_tokens", "accepted_per_position"} or null,
"vllm_version", "seconds"}; on an engine error, {"error": the engine's exception, "traceback"}.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def spec_decode_counts(metrics) -> dict | None:
    """vLLM's speculative-decoding counters (``LLM.get_metrics``) as plain numbers; None when the
    engine ran without a drafter."""
    by_name = {metric.name: metric for metric in metrics}
    if "vllm:spec_decode_num_drafts" not in by_name:
        return None
    return {
        "drafts": int(by_name["vllm:spec_decode_num_drafts"].value),
        "draft_tokens": int(by_name["vllm:spec_decode_num_draft_tokens"].value),
        "accepted_tokens": int(by_name["vllm:spec_decode_num_accepted_tokens"].value),
        "accepted_per_position": [
            int(v) for v in by_name["vllm:spec_decode_num_accepted_tokens_per_pos"].values
        ],
    }


def decode(request: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=request.get("model") or request["base"],
        tokenizer=request["base"],
        dtype=request["dtype"],
        speculative_config=request["speculative_config"],
        max_model_len=request["max_model_len"],
        enforce_eager=request["enforce_eager"],
        disable_log_stats=False,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {
        "outputs": [list(out.outputs[0].token_ids) for out in outputs],
        "spec_decode": spec_decode_counts(llm.get_metrics()),
        "vllm_version": vllm.__version__,
        "seconds": time.perf_counter() - started,
    }


def main(argv: list[str]) -> int:
    request_path, result_path = argv
    with open(request_path) as handle:
        request = json.load(handle)
    try:
        result = decode(request)
    except Exception as err:  # noqa: BLE001 (the engine's own error is the finding: reported)
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    with open(result_path, "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

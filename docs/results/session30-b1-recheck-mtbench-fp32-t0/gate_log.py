"""What the step gate records on the first MT-bench prompt, one prompt at a time: the bench's
warm-up (16 tokens), then the prompt (128 tokens), each step as (drafted, tokens the gate counts,
milliseconds, whether the head was catching up), and the gate's summary. Run it a few times: the
gate's choice on this prompt differs between runs.

Run from the repository root: .venv/bin/python <this file>
"""

from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.step_gate import StepGate

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont2"


def main() -> None:
    log = []
    record = StepGate.record

    def logged(self, batch, drafted, tokens, seconds, emitted=None, expected=None, catching_up=False):
        log.append((drafted, round(tokens, 2), round(seconds * 1000, 1), catching_up))
        return record(self, batch, drafted, tokens, seconds, emitted, expected, catching_up)

    StepGate.record = logged
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32")
    prompt = build_prompts("mt-bench", generator.tokenizer, 16)[0].input_ids
    generator.generate(prompt, max_new_tokens=16)
    print("warm-up:", log)
    log.clear()
    result = generator.generate(prompt, max_new_tokens=128)
    print("prompt:", result.stats.forward_passes, "forwards;", log[:30])
    print(generator.step_gate.summary())


if __name__ == "__main__":
    main()

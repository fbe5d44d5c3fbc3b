"""What a drafting step costs for each head architecture of the methods table (docs/log.md,
2026-12-03: methods side by side, on one short schedule).

Every architecture is built with random weights on SmolLM2-135M-Instruct (the time of a forward
does not depend on the weights) and prepared as decoding prepares a head (linear kernels chosen by
``pack="auto"``, the default drafting dtype). Timing uses tune-tree's bench
(``draftheads.tuning.step_cost.DecodingBench``): after a prefix of the first MT-bench first turns,
the median time of proposing a chain of 1, 2 and 3 drafts plus the commit of a step's accepted
tokens, each on its own fork of the drafter, beside one verification forward of the base on 1 and
4 tokens. The architectures alternate round by round, and each figure is the fastest round's.
The heads whose rows differ only in the training objective share the first row.

Run from the repository root:
    .venv/bin/python scripts/draft_step_cost.py [ROUNDS [REPEATS]]
"""

import sys

import torch

from draftheads.base_model import load_base
from draftheads.bench import build_prompts
from draftheads.heads import Eagle3Config, PEagleConfig, build_head
from draftheads.infer.kernel_choice import choose_kernels, prepare_drafting_head
from draftheads.infer.tree import StaticTree, chain_choices
from draftheads.machine import cpu_flags
from draftheads.tuning.step_cost import DecodingBench

BASE = "smollm2-135m-instruct"
LAYERS = (2, 15, 27)  # the fused layers of every row (configs/smollm2_eagle3-objectives_cpu.yaml)
ARCHITECTURES = {
    "EAGLE-3, 8,192 ids (soft_ce, log/kl_acceptance, HASS)": Eagle3Config(
        feature_layers=LAYERS, draft_vocab_size=8192
    ),
    "EAGLE-3.1 (fc_norm, norm_output)": Eagle3Config(
        feature_layers=LAYERS, draft_vocab_size=8192, fc_norm=True, norm_output=True
    ),
    "EAGLE-3, 4,096 ids": Eagle3Config(feature_layers=LAYERS, draft_vocab_size=4096),
    "P-EAGLE, one layer": PEagleConfig(feature_layers=LAYERS, draft_vocab_size=8192, ttt_steps=3),
    "P-EAGLE, two layers": PEagleConfig(
        feature_layers=LAYERS, draft_vocab_size=8192, ttt_steps=3, num_layers=2
    ),
}
DEPTHS = (1, 2, 3)
PREFIX_TOKENS = 200  # as tune-tree's default prefix


def prefix_ids(tokenizer) -> torch.Tensor:
    prompts = build_prompts("mt-bench", tokenizer, 8)
    return torch.cat([prompt.input_ids[0] for prompt in prompts])[:PREFIX_TOKENS]


def main(rounds: int = 5, repeats: int = 20) -> None:
    torch.manual_seed(0)
    model, tokenizer = load_base(BASE, dtype="float32")
    kernels = choose_kernels(model)
    prefix = prefix_ids(tokenizer)
    heads = {name: build_head(model, config) for name, config in ARCHITECTURES.items()}
    dtypes = {name: prepare_drafting_head(head, model, kernels) for name, head in heads.items()}
    trees = [StaticTree(f"chain-{d}", chain_choices(d)) for d in DEPTHS]
    best = {name: [float("inf")] * len(DEPTHS) for name in heads}
    one_token = four_tokens = float("inf")
    for _ in range(rounds):  # architectures interleaved round by round: a slow spell falls on all
        for name, head in heads.items():
            bench = DecodingBench(model, head, prefix, 1, repeats)  # a fresh bench: nothing memoised
            seconds = [bench.draft_seconds(tree) for tree in trees]
            best[name] = [min(old, new) for old, new in zip(best[name], seconds)]
        one, four = bench.verify_cost([1, 4], progress=False).seconds
        one_token, four_tokens = min(one_token, one), min(four_tokens, four)
    print(f"CPU flags: {' '.join(cpu_flags())}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"linear kernels: {kernels.describe()}; prefix {len(prefix)} tokens")
    print(f"fastest of {rounds} rounds, each a median of {repeats}; ms a step (propose + commit)")
    header = " | ".join(f"chain-{d}" for d in DEPTHS)
    print(f"| architecture | drafts in | {header} | chain-3 in one-token forwards |")
    print("|---|---|" + "---:|" * (len(DEPTHS) + 1))
    for name, seconds in best.items():
        cells = " | ".join(f"{1e3 * s:.2f}" for s in seconds)
        print(f"| {name} | {dtypes[name]} | {cells} | {seconds[-1] / one_token:.2f} |")
    print(f"base verification forward: 1 token {1e3 * one_token:.2f} ms, 4 tokens {1e3 * four_tokens:.2f} ms")


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:3]))

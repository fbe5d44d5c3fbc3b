"""An untrained EAGLE-3 head for SmolLM2 (three fused layers, 8,192 draft tokens, 4 TTT steps), random
weights: what adaptive drafting does with a head that never agrees (docs/benchmarks.md).

Usage: python scripts/make_random_head.py OUT_DIR
"""

import sys

import torch

from draftheads.base_model import load_base
from draftheads.heads import Eagle3Config, build_head

torch.manual_seed(0)
model, _ = load_base("smollm2-135m-instruct", dtype="float32")
head = build_head(model, Eagle3Config(feature_layers=(2, 15, 27), draft_vocab_size=8192, ttt_steps=4))
head.save_pretrained(sys.argv[1])

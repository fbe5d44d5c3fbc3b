"""The attention call of one decoder layer in a plain batched step (8 rows, SmolLM2's 9 query
heads on 3 key/value heads folded to 3 x 3 queries, 273 cache entries), timed in isolation: keys
and values as a view of a larger buffer (draftheads' in-place cache) or contiguous (transformers'
concatenated cache), under a float additive mask, a bool mask or none.

Run from the repository root: .venv/bin/python <this file>
"""

import time

import torch
import torch.nn.functional as F

BATCH, KV_HEADS, GROUP, LENGTH, DIM = 8, 3, 3, 273, 64


def timed(call, repeats: int = 2000) -> float:
    for _ in range(50):
        call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats * 1e6


def main() -> None:
    torch.manual_seed(0)
    query = torch.randn(BATCH, KV_HEADS, GROUP, DIM)
    key_buffer, value_buffer = torch.randn(2, BATCH, KV_HEADS, 2 * LENGTH, DIM)
    view = key_buffer[:, :, :LENGTH], value_buffer[:, :, :LENGTH]
    contiguous = view[0].contiguous(), view[1].contiguous()
    additive = torch.zeros(BATCH, 1, 1, LENGTH)
    additive[:, :, :, :5] = torch.finfo(torch.float32).min  # left padding
    masks = {"float": additive, "bool": additive == 0, "none": None}
    for layout, (key, value) in (("view", view), ("contiguous", contiguous)):
        for name, mask in masks.items():
            microseconds = timed(
                lambda k=key, v=value, m=mask: F.scaled_dot_product_attention(query, k, v, attn_mask=m)
            )
            print(f"{layout:>10} {name:>5} mask: {microseconds:.1f} us")


if __name__ == "__main__":
    main()

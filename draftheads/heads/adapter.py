"""A Medusa-2 head's base adapter: the LoRA weights trained together with the heads (issue 7).

The adapter lives in ``<head dir>/adapter`` in peft's format (``adapter_config.json`` +
``adapter_model.safetensors``). The heads learned to predict the *adapted* base, so decoding
verifies with the adapted base: ``load_head(dir, base_model)`` merges the adapter into the base
weights (W <- W + (alpha / r) B A, peft ``merge_and_unload``). Merged, the adapted base costs
exactly what the original does per token; an unmerged adapter adds two rank-r matmuls to every
linear layer (SmolLM2, rank 32 on all linear layers, fp32, 2-core CPU, interleaved medians: one
decoding forward after a 200-token prefix 75 ms unmerged vs 48 ms merged; 1.6-2x slower for 1
and 16 new tokens in a noisier rerun).

The merge happens in place, once: the base config records the adapter's fingerprint
(``MERGED_ADAPTER_KEY``), so loading the same head again does not merge twice and loading a head
with another adapter into an already-adapted base is refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED_ADAPTER_KEY = "draftheads_merged_adapter"


def adapter_path(head_dir: str | Path) -> Path:
    return Path(head_dir) / ADAPTER_DIR


def adapter_fingerprint(head_dir: str | Path) -> str:
    """Hash of the adapter weights file."""
    path = adapter_path(head_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: a joint (Medusa-2) head needs its base adapter, saved by training in "
            f"{adapter_path(head_dir)}"
        )
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def merge_adapter(base_model, head_dir: str | Path):
    """Merge the head's base adapter into ``base_model`` in place and return it (frozen, eval mode).

    Raises ``HeadMismatchError`` if ``base_model`` already holds another merged adapter."""
    from draftheads.heads.base import HeadMismatchError

    fingerprint = adapter_fingerprint(head_dir)
    merged = getattr(base_model.config, MERGED_ADAPTER_KEY, None)
    if merged == fingerprint:
        return base_model
    if merged is not None:
        raise HeadMismatchError(
            f"the base model already has adapter {merged} merged into its weights; the head in {head_dir} "
            f"needs adapter {fingerprint}: load a fresh base model"
        )
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(base_model, str(adapter_path(head_dir)))
    model = adapted.merge_and_unload()  # the same module tree, LoRA folded into its linear weights
    model.eval().requires_grad_(False)
    setattr(model.config, MERGED_ADAPTER_KEY, fingerprint)
    return model

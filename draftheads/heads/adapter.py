"""A Medusa-2 head's base adapter: the LoRA weights trained together with the heads (Medusa-2
fine-tunes the backbone jointly with the heads; Cai et al. 2024, arXiv:2401.10774).

The adapter lives in ``<head dir>/adapter`` in peft's format (``adapter_config.json`` +
``adapter_model.safetensors``). The heads learned to predict the *adapted* base, so decoding
verifies with the adapted base: ``adapted_base`` returns a copy of the base model with the adapter
merged into its weights (W <- W + (alpha / r) B A, peft ``merge_and_unload``), which costs per token
what the original does (an unmerged adapter adds two rank-r matmuls to every adapted linear layer;
measured in docs/export.md, "Medusa-2 heads: the adapter travels with the heads"). The base model
it is given is never modified.

The adapted copy's config records the adapter's fingerprint (``MERGED_ADAPTER_KEY``): ``load_head``
attaches a joint head only to a model carrying its own adapter, and no adapter is merged twice.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

from draftheads.heads.base import HeadMismatchError
from draftheads.optional import require

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


def merged_adapter(model) -> str | None:
    """The fingerprint of the adapter merged into ``model``'s weights, or None for an original base."""
    return getattr(model.config, MERGED_ADAPTER_KEY, None)


def check_adapted(model, head_dir: str | Path) -> None:
    """Raise HeadMismatchError unless ``model`` carries the adapter of the joint head in ``head_dir``."""
    fingerprint = adapter_fingerprint(head_dir)
    merged = merged_adapter(model)
    if merged == fingerprint:
        return
    if merged is None:
        raise HeadMismatchError(
            f"the head in {head_dir} is a joint (Medusa-2) head: it drafts for its base with adapter "
            f"{fingerprint} merged, and this base model has none. Load the pair with "
            "load_head_and_base(head_dir, base_model), which returns the adapted copy "
            "and leaves the base as it is"
        )
    raise HeadMismatchError(
        f"the base model already has adapter {merged} merged into its weights; the head in {head_dir} "
        f"needs adapter {fingerprint}: use load_head_and_base(head_dir, base_model) with the original base"
    )


def adapted_base(base_model, head_dir: str | Path, copy_base: bool = True):
    """A new model: a copy of ``base_model`` with the adapter of the joint head in ``head_dir`` merged
    into its weights, frozen, in eval mode, its config recording the adapter's fingerprint.
    ``base_model`` is left as it is; it must be an original base (HeadMismatchError otherwise).
    ``copy_base=False``: the caller hands ``base_model`` over and it is adapted in place (no second
    copy of the weights in memory; ``SpeculativeGenerator.from_pretrained`` does this with the base
    it loaded itself)."""
    fingerprint = adapter_fingerprint(head_dir)
    merged = merged_adapter(base_model)
    if merged is not None:
        raise HeadMismatchError(
            f"the base model already has adapter {merged} merged into its weights; the adapter of the head "
            f"in {head_dir} ({fingerprint}) goes on the original base: pass that"
        )
    peft = require("peft", "adapters", "merging a Medusa-2 head's LoRA adapter")

    # peft injects the LoRA layers into the module it is given: give it the copy.
    target = copy.deepcopy(base_model) if copy_base else base_model
    adapted = peft.PeftModel.from_pretrained(target, str(adapter_path(head_dir)))
    model = adapted.merge_and_unload()  # the copy's module tree, LoRA folded into its linear weights
    model.eval().requires_grad_(False)
    setattr(model.config, MERGED_ADAPTER_KEY, fingerprint)
    return model

"""What a draft tree may ask of its head: candidate ranks within the draft vocabulary, and a dynamic
tree's expansion within the memory free on the device.

A static tree's path ``[..., r]`` takes the r-th best candidate of the head's distribution, so r
must be below the head's draft vocabulary size. A dynamic (EAGLE-2) tree expands ``top_k`` nodes per
depth, each into its ``top_k`` best children, so one drafting step holds (top_k, V_draft) draft
log-probabilities and (top_k, top_k x depth) masks and scores: a top_k of 100000 on a 49152-token
vocabulary (at most 49152 children a node) asks for over 130 GiB, which a machine answers by killing
the process. Both are checked
when a generator is built, so such a tree is refused with the limit named instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftheads.infer.tree import DynamicTree, StaticTree
from draftheads.storage import format_bytes

MEMINFO = Path("/proc/meminfo")


class TreeFitError(ValueError):
    """A tree its drafter cannot fill: a kind it cannot draft, a rank beyond its vocabulary, or a
    dynamic expansion larger than the free memory."""


def draft_vocabulary_size(head) -> int:
    """The number of tokens ``head`` ranks candidates from: an EAGLE-3 head's reduced draft
    vocabulary, else the base model's."""
    return getattr(head, "draft_vocab_size", None) or head.base_spec.vocab_size


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device``: CUDA's free memory, or the system's MemAvailable on
    a CPU; None where it cannot be read (the memory check is then skipped)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def dynamic_step_bytes(top_k: int, depth: int, vocabulary: int) -> int:
    """A lower bound on the bytes one dynamic drafting step holds at once: the expanded nodes' logits
    and log-probabilities (2 x (top_k, V) fp32), their children's scores and ids (top_k, top_k) and the
    drafter attention mask over the nodes written so far (top_k, top_k x (depth + 1), float + bool)."""
    return top_k * (8 * vocabulary + 16 * top_k + 5 * (depth + 1) * top_k)


def widest_fitting_top_k(depth: int, vocabulary: int, free_bytes: int) -> int:
    """The largest top_k whose ``dynamic_step_bytes`` fits in ``free_bytes`` (0 if none does)."""
    low, high = 0, vocabulary
    while low < high:
        middle = (low + high + 1) // 2
        if dynamic_step_bytes(middle, depth, vocabulary) <= free_bytes:
            low = middle
        else:
            high = middle - 1
    return low


def check_tree_fits(tree: StaticTree | DynamicTree, vocabulary: int, device: torch.device) -> None:
    """Raise TreeFitError naming the tree, the value and the limit if ``tree`` asks for a candidate
    rank at or beyond ``vocabulary`` (the head's draft vocabulary size) or, for a dynamic tree, for
    more memory per drafting step than ``device`` has free."""
    if isinstance(tree, StaticTree):
        for path in tree.choices:
            if path[-1] >= vocabulary:
                raise TreeFitError(
                    f"tree '{tree.name}': path {list(path)} asks for candidate {path[-1]} but the head "
                    f"drafts from {vocabulary} tokens (ranks 0..{vocabulary - 1})"
                )
        return
    if not isinstance(tree, DynamicTree):
        return
    if tree.top_k > vocabulary:
        raise TreeFitError(
            f"dynamic tree '{tree.name}': top_k {tree.top_k} exceeds the head's draft vocabulary of "
            f"{vocabulary} tokens"
        )
    free = available_memory(torch.device(device))
    needed = dynamic_step_bytes(tree.top_k, tree.depth, vocabulary)
    if free is not None and needed > free:
        widest = widest_fitting_top_k(tree.depth, vocabulary, free)
        raise TreeFitError(
            f"dynamic tree '{tree.name}': top_k {tree.top_k} needs about {format_bytes(needed)} per "
            f"drafting step and {format_bytes(free)} is free on {device}: at most top_k {widest} fits"
        )

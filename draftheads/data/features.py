"""Offline hidden-state caches: the frozen base model's hidden states, computed once.

Training many epochs, or many head variants, on the same data runs the base model's body for
every batch again; offline training reads its hidden states from disk instead. A cache holds,
for every example of the train and validation splits, only what the configured head reads:
``head.required_hidden_states``, i.e. its feature layers plus ``hs[L]``, the normed state that
enters lm_head (HF ``output_hidden_states`` indices, see ``draftheads.heads.base``). Training
reads it for any head kind whose hidden states it holds, on the same base, tokenizer and rows.

Soft targets (EAGLE-1, EAGLE-3) are ``lm_head(hs[L])``, recomputed at training time from the
stored ``hs[L]``: exact, and h values per token. The base's top-k logits would cost k values plus
k indices per token (6k bytes in bf16 + int32) and drop the tail of the distribution, so they are
smaller only for k < h / 3 (192 for SmolLM2's h = 576) and never exact; this cache does not store them.
It does store the base model's argmax at every position whose next token is supervised (4 bytes
a token, computed from the unrounded ``hs[L]`` as the cache is written): EAGLE-3 needs the
full-vocabulary argmax only to know whether the base's token is a draft token, and its soft
targets only over the draft vocabulary, so with the argmax at hand it projects ``hs[L]`` onto the
draft vocabulary's rows of lm_head alone (8,192 of SmolLM2's 49,152 rows) instead of the whole
vocabulary, the largest matmul of a step read from a cache (docs/training.md, "Feature caches").
Caches written before it hold no argmax; training then recomputes it.

Layout::

    .draftheads-features                marker: the directory was made for this cache (written first)
    index.json                          identity + progress (rewritten after every shard)
    train/shard-00000.safetensors       examples [0, E) of the split, E = examples_per_shard
    validation/shard-00000.safetensors

A shard holds ``hidden_states.{i}`` (N, h) for each stored index i, concatenated over its
examples' tokens (no padding), ``offsets`` (E' + 1,) int64, ``input_ids`` (N,) int32 (checked
against the batch on reading, so a cache can never be read against other rows) and
``base_argmax`` (N,) int32, the base model's next-token argmax at each position whose next token
is supervised (-1 at the others). Shards are
written atomically (a shard file exists only once complete), so an interrupted run resumes with
the shards it lacks. Training reads a batch's rows with ``draftheads.data.shard_file``: their bytes
alone, with no read-ahead, since a cache can be larger than memory.

Under a launcher (``torchrun`` / ``deepspeed``, N processes), rank r of N writes shards
r, r + N, r + 2N, ... of each split; rank 0 writes the one index, first with the identity, last
with the shards found complete. The cache is the same files whatever N wrote it, and training
reads it whatever its own world size.

This module writes the cache (``write_feature_cache``); ``draftheads.data.feature_reader``
reads it (``FeatureCache``) and ``draftheads.data.feature_identity`` fingerprints what it was
made for (``CacheIdentity``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftheads.data.feature_identity import CacheIdentity, FeatureCacheError, check_identity, grown_splits
from draftheads.data.feature_reader import (
    ARGMAX_KEY,
    FORMAT,
    FORMAT_VERSION,
    INDEX_NAME,
    NO_ARGMAX,
    open_shard,
    read_index,
    shard_offsets,
    shard_path,
)
from draftheads.data.pipeline import row_lengths
from draftheads.distributed import barrier
from draftheads.storage import write_atomically, write_text_atomically

MARKER_NAME = ".draftheads-features"  # written first into the directory a new cache is made in
SPLITS = ("train", "validation")
DEFAULT_DTYPE = "bfloat16"  # half fp32's size; float32 caches reproduce fp32 training bit for bit
DEFAULT_EXAMPLES_PER_SHARD = 256
DEFAULT_BATCH_SIZE = 8
ARGMAX_CHUNK = 4096  # positions per lm_head call when writing the argmax
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CacheDirectoryError(FileExistsError):
    """A directory a feature cache will not be written into: it holds files of no cache of ours."""


def bytes_per_token(hidden_size: int, layers: int, dtype: torch.dtype) -> int:
    """Disk bytes per cached token: ``layers`` states of ``hidden_size`` plus the int32 token id and
    the int32 argmax."""
    return layers * hidden_size * torch.empty((), dtype=dtype).element_size() + 8


def _write_index(directory: Path, index: dict) -> None:
    write_text_atomically(directory / INDEX_NAME, json.dumps(index, indent=2) + "\n")


def _extend_index(directory: Path, index: dict, identity: CacheIdentity, grown: dict[str, int]) -> None:
    """Rewrite ``index`` for ``identity``, whose ``grown`` splits gained rows after the cached
    ones: every full shard of cached rows is kept; a split's last, partial shard is removed (its
    rows are written again with the first new ones)."""
    per_shard = int(index["examples_per_shard"])
    for name, cached in grown.items():
        keep = cached // per_shard
        for shard in range(keep, -(-cached // per_shard)):  # the cache's shards past ``keep``, no other file
            shard_path(directory, name, shard).unlink(missing_ok=True)
        index["complete_shards"][name] = min(index["complete_shards"][name], keep)
        index["shard_tokens"][name] = index["shard_tokens"][name][:keep]
        print(
            f"[draftheads] feature cache {directory}: split '{name}' grew from {cached:,} to "
            f"{identity.examples[name]:,} rows; keeping its first {keep} shards, writing the rest"
        )
    index["identity"] = dataclasses.asdict(identity)
    _write_index(directory, index)


def check_new_cache_directory(directory: Path) -> None:
    """Refuse (CacheDirectoryError, naming the directory and what it holds) to start a cache in a
    ``directory`` that holds anything but the marker of a cache this code began there and was
    interrupted before its index: a cache writes index.json and train/ and validation/ among the
    files it finds, and a user's file where a shard goes would be read as one."""
    if not os.path.lexists(directory):
        return
    if not directory.is_dir():
        raise CacheDirectoryError(f"data.features: {directory} exists and is not a directory")
    entries = {path.name for path in directory.iterdir()}
    ours = {MARKER_NAME} if (directory / MARKER_NAME).is_file() else set()
    if entries - ours:
        shown = ", ".join(sorted(entries - ours)[:5]) + (" and more" if len(entries - ours) > 5 else "")
        raise CacheDirectoryError(
            f"data.features: {directory} is not empty and holds no feature cache (no {INDEX_NAME}; it "
            f"holds {shown}); give a new or empty directory for the cache"
        )


def _existing_index(
    directory: Path, identity: CacheIdentity, settings: dict, splits: dict[str, Any]
) -> tuple[dict | None, dict[str, int]]:
    """``(index, grown)``: the index already in ``directory`` (None when there is none) after
    checking it was made for ``identity`` and ``settings``, except for splits whose cached rows the
    run's ``splits`` extend (``grown``, see ``grown_splits``; the caller extends the cache)."""
    if not (directory / INDEX_NAME).is_file():
        check_new_cache_directory(directory)
        return None, {}
    index = read_index(directory)
    found = CacheIdentity.from_dict(index["identity"])
    grown = grown_splits(found, identity, splits)
    if not grown:
        check_identity(found, identity, f"feature cache {directory}")
    for name, value in settings.items():
        if name == "compute_dtype" and name not in index:  # caches written before it was recorded
            continue
        if index[name] != value:
            raise FeatureCacheError(
                f"feature cache {directory} is being written with {name}={index[name]!r}; "
                f"resume with the same value (got {value!r}) or choose another directory"
            )
    return index, grown


def _new_index(identity: CacheIdentity, settings: dict, base_model, splits: dict) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "identity": dataclasses.asdict(identity),
        **settings,
        "hidden_size": base_model.config.hidden_size,
        "complete_shards": {name: 0 for name in splits},
        "shard_tokens": {name: [] for name in splits},
    }


def _with_progress(index: dict, directory: Path, splits: dict, examples_per_shard: int) -> dict:
    """``index`` with ``complete_shards`` (the leading run of shard files present: readers need
    every shard up to the split's last) and their token counts."""
    complete, shard_tokens = {}, {}
    for name, dataset in splits.items():
        counts = []
        for shard in range(-(-len(dataset) // examples_per_shard)):
            path = shard_path(directory, name, shard)
            if not path.is_file():
                break
            with open_shard(path) as shard:
                counts.append(shard_offsets(shard)[-1])
        complete[name], shard_tokens[name] = len(counts), counts
    return {**index, "complete_shards": complete, "shard_tokens": shard_tokens}


@torch.no_grad()
def _base_outputs(
    base_model, rows: list[list[int]], targets: list[list[bool]], layers: tuple[int, ...]
) -> list[tuple[dict[int, torch.Tensor], torch.Tensor]]:
    """Per row, ``({index: (T_i, h)}, (T_i,) argmax)``: the base model's hidden_states for a
    right-padded batch, and its next-token argmax at the positions ``targets`` marks (the next
    token is supervised: nothing reads it elsewhere, and lm_head over every position costs about a
    third of the base's forward here); ``NO_ARGMAX`` at the others. Right padding with a causal
    mask leaves every real position's states as computed alone."""
    device = base_model.device
    longest = max(len(row) for row in rows)
    input_ids = torch.zeros((len(rows), longest), dtype=torch.long, device=device)  # (B, T)
    attention_mask = torch.zeros_like(input_ids)  # (B, T)
    wanted = torch.zeros((len(rows), longest), dtype=torch.bool, device=device)  # (B, T)
    for index, (row, marks) in enumerate(zip(rows, targets, strict=True)):
        input_ids[index, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        attention_mask[index, : len(row)] = 1
        wanted[index, : len(row)] = torch.as_tensor(marks, dtype=torch.bool)
    last_layer = base_model.config.num_hidden_layers
    outputs = base_model.base_model(  # only the stored states (and the last, for the argmax) are kept
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=sorted({*layers, last_layer}),
        use_cache=False,
    )
    lm_head = base_model.get_output_embeddings()
    last = outputs.hidden_states[last_layer][wanted]  # (M, h): transformers 5.x gives the normed state here
    argmax = torch.full((len(rows), longest), NO_ARGMAX, dtype=torch.long, device=device)  # (B, T)
    if len(last):  # in chunks, so the (chunk, V) logits stay a few hundred MB
        argmax[wanted] = torch.cat([lm_head(part).argmax(-1) for part in last.split(ARGMAX_CHUNK)])
    return [
        (
            {layer: outputs.hidden_states[layer][index, : len(row)] for layer in layers},
            argmax[index, : len(row)],
        )
        for index, row in enumerate(rows)
    ]


def argmax_positions(example: dict) -> list[bool]:
    """Where a cache stores the base's argmax for one example: each position whose next token is
    supervised (``loss_mask``); every position of an example without one."""
    length = len(example["input_ids"])
    mask = example.get("loss_mask")
    if mask is None:
        return [True] * length
    return [bool(mask[position + 1]) for position in range(length - 1)] + [False]


def _write_shard(
    path: Path, states: dict[int, torch.Tensor], argmax: torch.Tensor, rows: list[list[int]]
) -> None:
    """One shard file: ``states`` {layer: (N, h)} and ``argmax`` (N,) of ``rows``' N tokens, in row
    order (``_shard_features``), with the rows' ``offsets`` and ``input_ids``."""
    from safetensors.torch import save_file

    lengths = torch.tensor([0] + [len(row) for row in rows], dtype=torch.int64)
    tensors = {f"hidden_states.{layer}": state for layer, state in states.items()}  # each (N, h)
    tensors["offsets"] = lengths.cumsum(0)  # (E' + 1,)
    tensors["input_ids"] = torch.tensor([token for row in rows for token in row], dtype=torch.int32)  # (N,)
    tensors[ARGMAX_KEY] = argmax  # (N,) int32
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda temporary: save_file(tensors, str(temporary), metadata={"format": "pt"}))


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} TB"


@dataclass(frozen=True)
class CacheSummary:
    """What ``write_feature_cache`` did."""

    directory: str
    tokens: int
    examples: int
    written_examples: int  # in this call (fewer than ``examples`` after a resume)
    estimated_bytes: int
    actual_bytes: int
    bytes_per_token: float
    seconds: float


def cache_size(directory: str | Path) -> int:
    """Bytes on disk of every shard and the index."""
    directory = Path(directory)
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _storage_settings(base_model, dtype: str, examples_per_shard: int, batch_size: int) -> dict:
    """The settings an index records and a resumed write must repeat; bad values raise
    ``FeatureCacheError``."""
    if dtype not in STORAGE_DTYPES:
        raise FeatureCacheError(f"feature cache dtype must be one of {sorted(STORAGE_DTYPES)}, got '{dtype}'")
    if examples_per_shard < 1 or batch_size < 1:
        raise FeatureCacheError(
            f"examples_per_shard and batch_size must be >= 1, got {examples_per_shard}, {batch_size}"
        )
    return {
        "dtype": dtype,
        "examples_per_shard": examples_per_shard,
        "compute_dtype": str(base_model.dtype).removeprefix("torch."),
    }


def _prepare_index(
    directory: Path,
    identity: CacheIdentity,
    settings: dict,
    base_model,
    splits: dict[str, Any],
    rank: int,
    world_size: int,
) -> dict:
    """The index every rank writes against: the existing one (checked, and extended for grown
    splits) or, when there is none, a new one rank 0 writes, after the marker, into a directory
    ``check_new_cache_directory`` allowed."""
    # Every rank checks an existing index before rank 0 may write a new one.
    index, grown = _existing_index(directory, identity, settings, splits)
    barrier(world_size)
    if grown:
        if rank == 0:
            _extend_index(directory, index, identity, grown)
        barrier(world_size)
        index = read_index(directory)
    if index is None:
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            write_text_atomically(directory / MARKER_NAME, json.dumps({"format": FORMAT}) + "\n")
            _write_index(directory, _new_index(identity, settings, base_model, splits))
        barrier(world_size)
        index = read_index(directory)
    return index


def _pending_shards(
    directory: Path, splits: dict[str, Any], examples_per_shard: int, rank: int, world_size: int
) -> dict[str, list[tuple[int, int, int]]]:
    """This rank's shards not written yet: split -> [(shard, first row, row after the last)]."""
    return {
        name: [
            (shard, shard * examples_per_shard, min((shard + 1) * examples_per_shard, len(dataset)))
            for shard in range(rank, -(-len(dataset) // examples_per_shard), world_size)
            if not shard_path(directory, name, shard).is_file()
        ]
        for name, dataset in splits.items()
    }


def _shard_features(
    base_model,
    rows: list[list[int]],
    targets: list[list[bool]],
    layers: tuple[int, ...],
    storage: torch.dtype,
    batch_size: int,
    on_batch: Callable[[int], None],
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The shard's stored hidden states {layer: (N, h)} (on CPU, in ``storage``) and argmax (N,)
    int32 over its rows' N tokens in row order. Each forward's rows are copied straight into their
    place, so the host holds the shard once (not per-row pieces and their concatenation).
    ``on_batch(tokens)`` is called after each base forward."""
    starts = [0]
    for row in rows:
        starts.append(starts[-1] + len(row))
    hidden_size = base_model.config.hidden_size
    states = {layer: torch.empty((starts[-1], hidden_size), dtype=storage) for layer in layers}
    argmax = torch.empty(starts[-1], dtype=torch.int32)
    # Similar lengths share a forward (less padding); each row goes to its own place.
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    for first in range(0, len(order), batch_size):
        group = order[first : first + batch_size]
        outputs = _base_outputs(base_model, [rows[i] for i in group], [targets[i] for i in group], layers)
        for row, (row_states, row_argmax) in zip(group, outputs):
            place = slice(starts[row], starts[row + 1])
            for layer, state in row_states.items():
                states[layer][place] = state.to(dtype=storage, device="cpu")
            argmax[place] = row_argmax.to(dtype=torch.int32, device="cpu")
        on_batch(sum(len(rows[i]) for i in group))
    return states, argmax


def _write_pending(
    base_model,
    splits: dict[str, Any],
    directory: Path,
    index: dict,
    todo: dict[str, list[tuple[int, int, int]]],
    layers: tuple[int, ...],
    storage: torch.dtype,
    batch_size: int,
    single_writer: bool,
    on_batch: Callable[[int], None],
) -> int:
    """Write the shards of ``todo``; returns the examples written. A single writer writes shards
    in order and records each in the index as it completes, so an interrupted run loses at most
    the shard in progress."""
    written = 0
    for name, dataset in splits.items():
        for shard, start, stop in todo[name]:
            rows = [list(dataset[i]["input_ids"]) for i in range(start, stop)]
            targets = [argmax_positions(dataset[i]) for i in range(start, stop)]
            states, argmax = _shard_features(base_model, rows, targets, layers, storage, batch_size, on_batch)
            _write_shard(shard_path(directory, name, shard), states, argmax, rows)
            written += len(rows)
            if single_writer and shard == index["complete_shards"][name]:
                index["complete_shards"][name] = shard + 1
                index["shard_tokens"][name] = index["shard_tokens"][name][:shard] + [
                    sum(len(row) for row in rows)
                ]
                _write_index(directory, index)
    return written


def write_feature_cache(
    base_model,
    splits: dict[str, Any],
    directory: str | Path,
    identity: CacheIdentity,
    dtype: str = DEFAULT_DTYPE,
    examples_per_shard: int = DEFAULT_EXAMPLES_PER_SHARD,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> CacheSummary:
    """Write (or continue writing) the hidden-state cache of ``splits`` into ``directory``.

    Args:
        base_model: the frozen base causal LM (its ``base_model`` body runs, not lm_head).
        splits: split name -> dataset with ``input_ids`` rows (train and validation).
        identity: ``CacheIdentity.build(...)`` for this base, tokenizer, head and rows; its
            ``hidden_state_layers`` are the indices stored.
        dtype: storage dtype name (``STORAGE_DTYPES``); bf16 halves fp32's size.
            The base runs in its own dtype, recorded as ``compute_dtype`` in the index; the identity
            (``identity.base_weights_hash``) names the weights the run trains against, so a base
            cast to bf16 after ``CacheIdentity.build`` writes a cache its fp32 original reads.
        examples_per_shard: examples per file (the unit of resumption).
        batch_size: examples per base forward.
        rank, world_size: this process's place among the launched ones (every rank calls, each
            writes its shards; ``draftheads.distributed.join_process_group``).
    Prints the estimated size before and the actual size after. An existing index in
    ``directory`` must have the same identity and storage settings; writing resumes with the
    shards not yet written.
    """
    from tqdm import tqdm

    settings = _storage_settings(base_model, dtype, examples_per_shard, batch_size)
    started = time.perf_counter()
    directory = Path(directory)
    index = _prepare_index(directory, identity, settings, base_model, splits, rank, world_size)

    storage = STORAGE_DTYPES[dtype]
    layers = tuple(identity.hidden_state_layers)
    per_token = bytes_per_token(base_model.config.hidden_size, len(layers), storage)
    lengths = {name: row_lengths(dataset) for name, dataset in splits.items()}
    tokens = sum(sum(values) for values in lengths.values())
    estimate = tokens * per_token
    todo = _pending_shards(directory, splits, examples_per_shard, rank, world_size)
    remaining = sum(sum(lengths[name][start:stop]) for name in todo for _, start, stop in todo[name])
    if rank == 0:
        print(
            f"[draftheads] feature cache {directory}: {len(layers)} hidden state(s) {list(layers)} x "
            f"{base_model.config.hidden_size} in {dtype} = {per_token} bytes/token; {tokens:,} tokens -> "
            f"about {_human(estimate)} on disk"
            + (f"; {world_size} processes" if world_size > 1 else "")
            + (f" ({remaining:,} tokens left to write)" if world_size == 1 and remaining < tokens else "")
        )
    bar = tqdm(
        total=remaining,
        unit="tok",
        desc="cache-features",
        disable=not progress or rank != 0,
        dynamic_ncols=True,
    )
    written = _write_pending(
        base_model, splits, directory, index, todo, layers, storage, batch_size, world_size == 1, bar.update
    )
    if world_size > 1:
        shards = sum(len(shard_list) for shard_list in todo.values())
        print(
            f"[draftheads] feature cache rank {rank}/{world_size}: "
            f"wrote {written} examples in {shards} shards"
        )
    barrier(world_size)
    if rank == 0:
        _write_index(directory, _with_progress(index, directory, splits, examples_per_shard))
    barrier(world_size)
    bar.close()
    actual = cache_size(directory)
    summary = CacheSummary(
        directory=str(directory),
        tokens=tokens,
        examples=sum(len(dataset) for dataset in splits.values()),
        written_examples=written,
        estimated_bytes=estimate,
        actual_bytes=actual,
        bytes_per_token=actual / max(1, tokens),
        seconds=time.perf_counter() - started,
    )
    if rank == 0:
        print(
            f"[draftheads] feature cache {directory}: {_human(actual)} on disk "
            f"({summary.bytes_per_token:.0f} bytes/token; estimated {_human(estimate)})"
        )
    return summary

"""What a feature cache was made for (``CacheIdentity``): the base model's config and weights,
the tokenizer, the head's hidden-state layers and the rows of each split, each as a fingerprint;
and the checks that refuse a cache made for anything else (``FeatureCacheError``, naming the
first field that differs). The cache itself is described in ``draftheads.data.features``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftheads.data.sources import DataError

# Entries of the base config that do not change what the model computes.
VOLATILE_CONFIG_KEYS = (
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "_attn_implementation",
    "attn_implementation",
    "_commit_hash",
    "architectures",
)


class FeatureCacheError(DataError):
    """A feature cache that cannot be used: another base model, tokenizer, head or data; or damaged."""


def base_config_hash(config) -> str:
    """Hash of everything in the base config that shapes the hidden states."""
    data = {key: value for key, value in config.to_dict().items() if key not in VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def base_weights_hash(model, probe: int = 4096) -> str:
    """Cheap fingerprint of the weights: name, shape and the first and last ``probe`` values of
    every tensor. Two checkpoints of one architecture (another seed, a fine-tune) differ here
    while reading O(number of tensors) values, not the whole model. Tensors a skeleton base
    (``draftheads.base_skeleton``) holds on the meta device are sampled from its files instead."""
    from draftheads.base_skeleton import probe_values, weight_files

    files = None
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if tensor.is_meta:
            files = files or weight_files(Path(model.name_or_path))
            sample = probe_values(files, name, probe, tensor.dtype)
        else:
            flat = tensor.detach().reshape(-1)
            sample = torch.cat([flat[:probe], flat[-probe:]])
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(sample.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def tokenizer_hash(tokenizer) -> str:
    """Hash of the tokenizer's vocabulary, special tokens and chat template."""
    from draftheads.data.pipeline import tokenizer_identity

    return tokenizer_identity(tokenizer)[:16]


def rows_fingerprint(dataset) -> str:
    """Hash of a split's rows (input_ids and loss_mask, in order): the cache's rows must be the
    training rows, whatever config or file produced them."""
    import numpy

    digest = hashlib.sha256()
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"]):
        digest.update(numpy.asarray(ids, dtype=numpy.int32).tobytes())
        digest.update(numpy.asarray(mask, dtype=numpy.int8).tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class CacheIdentity:
    """What a cache was made for. Training refuses a cache whose identity differs in any field
    but ``base_model`` (a name; the hashes identify the model wherever it was loaded from)."""

    base_model: str
    base_config_hash: str
    base_weights_hash: str
    tokenizer_vocab_size: int | None  # None: rows given without a tokenizer (tests)
    tokenizer_hash: str | None
    head_kind: str
    hidden_state_layers: tuple[int, ...]
    max_length: int | None
    rows: dict[str, str]  # split -> rows_fingerprint
    examples: dict[str, int]  # split -> rows

    @classmethod
    def build(
        cls, base_model, base_name: str, tokenizer, head, splits: dict[str, Any], max_length: int | None
    ):
        return cls(
            base_model=base_name,
            base_config_hash=base_config_hash(base_model.config),
            base_weights_hash=base_weights_hash(base_model),
            tokenizer_vocab_size=len(tokenizer) if tokenizer is not None else None,
            tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer is not None else None,
            head_kind=head.kind,
            hidden_state_layers=tuple(head.required_hidden_states),
            max_length=max_length,
            rows={name: rows_fingerprint(dataset) for name, dataset in splits.items()},
            examples={name: len(dataset) for name, dataset in splits.items()},
        )

    @classmethod
    def from_dict(cls, data: dict) -> CacheIdentity:
        return cls(**{**data, "hidden_state_layers": tuple(data["hidden_state_layers"])})


# field -> what differs, for the refusal message. The data fields must match for any use; the head
# fields too when resuming a write (the same cache), but not when reading one for training.
_DATA_CHECKS = (
    ("base_config_hash", "base model (config)"),
    ("base_weights_hash", "base model (weights)"),
    ("tokenizer_vocab_size", "tokenizer (vocabulary size)"),
    ("tokenizer_hash", "tokenizer (vocabulary, special tokens or chat template)"),
    ("examples", "data (number of examples per split)"),
    ("rows", "data (tokens or loss masks; data config or source changed)"),
)
_HEAD_CHECKS = (
    ("head_kind", "head kind"),
    ("hidden_state_layers", "head feature layers"),
)
_REBUILD = (
    "rebuild it with `draftheads cache-features` (rows added after the cached training rows, as "
    "data.extra_sources adds them, are written on without rewriting the rest) or point "
    "data.features elsewhere"
)


def _check_fields(found: CacheIdentity, expected: CacheIdentity, where: str, checks) -> None:
    for name, meaning in checks:
        have, want = getattr(found, name), getattr(expected, name)
        if name.startswith("tokenizer") and (have is None or want is None):
            continue
        if have != want:
            raise FeatureCacheError(
                f"{where} was made for another {meaning}: {name} is {have!r} in the cache "
                f"(base model '{found.base_model}', head '{found.head_kind}') but {want!r} for this run "
                f"(base model '{expected.base_model}', head '{expected.head_kind}'); {_REBUILD}"
            )


def check_identity(found: CacheIdentity, expected: CacheIdentity, where: str) -> None:
    """Resuming a write: raise FeatureCacheError naming the first field where the cache differs.
    Tokenizer fields are compared only when both sides know their tokenizer."""
    _check_fields(found, expected, where, _DATA_CHECKS + _HEAD_CHECKS)


def check_readable(found: CacheIdentity, expected: CacheIdentity, where: str) -> None:
    """Training from a cache: the same base, tokenizer and rows, and every hidden state the run's
    head reads among those stored. Any head kind may read it: one EAGLE-3 cache (hs[2, 15, 27, L])
    also serves Medusa, EAGLE and MTP (hs[L])."""
    _check_fields(found, expected, where, _DATA_CHECKS)
    missing = sorted(set(expected.hidden_state_layers) - set(found.hidden_state_layers))
    if missing:
        raise FeatureCacheError(
            f"{where} lacks hidden states {missing} that the {expected.head_kind} head reads: "
            f"hidden_state_layers is {list(found.hidden_state_layers)} in the cache (made for a "
            f"{found.head_kind} head) but the run needs {list(expected.hidden_state_layers)}; {_REBUILD}"
        )


def grown_splits(found: CacheIdentity, expected: CacheIdentity, splits: dict[str, Any]) -> dict[str, int]:
    """Splits whose rows are the cache's followed by new ones (``data.extra_sources`` added to a
    run's training split), as {split: rows cached}; empty when no split grew or anything else
    differs (the caller's ``check_identity`` then names it)."""
    grown = {}
    for name, dataset in splits.items():
        cached = found.examples.get(name, 0)
        if found.rows.get(name) == expected.rows.get(name) or not 0 < cached < len(dataset):
            continue
        if rows_fingerprint(dataset.select(range(cached))) == found.rows[name]:
            grown[name] = cached
    if not grown:
        return {}
    rows = {**expected.rows, **{name: found.rows[name] for name in grown}}
    examples = {**expected.examples, **grown}
    try:  # all else must be the cache's: the same base, tokenizer, head layers and other splits
        check_identity(found, dataclasses.replace(expected, rows=rows, examples=examples), "")
    except FeatureCacheError:
        return {}
    return grown

"""Reading a feature cache (its layout: ``draftheads.data.features``): the index, and the hidden
states of any of its rows, read from the shard files alone (``draftheads.data.shard_file``: no
read-ahead, since a cache can be larger than memory) and padded into a batch. The index format
and shard paths named here are the ones the writer writes.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import torch

from draftheads.data.feature_identity import CacheIdentity, FeatureCacheError, check_readable
from draftheads.data.shard_file import MissingTensorError, ShardFile, ShardFileError

INDEX_NAME = "index.json"
FORMAT = "draftheads-features"
FORMAT_VERSION = 1
MAX_OPEN_SHARDS = 128  # shard files a reader keeps open (one descriptor each), well within `ulimit -n`
ARGMAX_KEY = "base_argmax"  # the shard tensor of the base's next-token argmax (absent in older caches)
NO_ARGMAX = -1  # stored where the next token is not supervised (no objective reads it there)


def shard_path(directory: Path, split: str, shard: int) -> Path:
    return directory / split / f"shard-{shard:05d}.safetensors"


def read_index(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / INDEX_NAME
    if not path.is_file():
        raise FeatureCacheError(
            f"data.features: {directory} holds no feature cache ({INDEX_NAME} missing); "
            "write one with `draftheads cache-features --config FILE`"
        )
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise FeatureCacheError(f"{path}: invalid JSON: {err}") from err
    if index.get("format") != FORMAT or index.get("format_version") != FORMAT_VERSION:
        raise FeatureCacheError(
            f"{path}: not a {FORMAT} v{FORMAT_VERSION} index (format {index.get('format')!r}, "
            f"version {index.get('format_version')!r})"
        )
    return index


def _damaged(path: Path, err: Exception) -> FeatureCacheError:
    reason = err.reason if isinstance(err, ShardFileError) else str(err)
    return FeatureCacheError(
        f"feature cache shard {path} is damaged ({reason}); delete it and run `draftheads cache-features` "
        "again to rewrite it"
    )


def open_shard(path: Path) -> ShardFile:
    """A shard open for row reads; a damaged file is named with what to do."""
    try:
        return ShardFile(path)
    except (ShardFileError, OSError) as err:
        raise _damaged(path, err) from err


def _read_rows(shard: ShardFile, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of tensor ``name`` of ``shard``; a damaged file is named as above (a
    tensor it does not hold raises ``MissingTensorError``, naming the file and what it holds)."""
    try:
        return shard.rows(name, start, stop)
    except (ShardFileError, OSError) as err:
        raise _damaged(shard.path, err) from err


def shard_offsets(shard: ShardFile) -> list[int]:
    """The shard's ``offsets``: where each example's tokens start, then the tokens it holds."""
    try:
        ends = shard.shape("offsets")[0]
    except MissingTensorError as err:
        raise _damaged(shard.path, err) from err
    return _read_rows(shard, "offsets", 0, ends).tolist()


class FeatureCache:
    """Reads a complete cache: hidden states of any rows of a split, padded into a batch."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.index = read_index(self.directory)
        self.identity = CacheIdentity.from_dict(self.index["identity"])
        self.examples_per_shard = int(self.index["examples_per_shard"])
        # Open shards, least recently read first, each with its ``offsets`` (read once at opening).
        self._shards: OrderedDict[Path, tuple[ShardFile, list[int]]] = OrderedDict()
        for split, examples in self.identity.examples.items():
            needed = -(-examples // self.examples_per_shard)
            if self.index["complete_shards"].get(split, 0) < needed:
                raise FeatureCacheError(
                    f"feature cache {self.directory} is incomplete: "
                    f"{self.index['complete_shards'].get(split, 0)} of {needed} '{split}' shards written; "
                    "run `draftheads cache-features` again to finish it"
                )

    @property
    def layers(self) -> tuple[int, ...]:
        return self.identity.hidden_state_layers

    def check(self, expected: CacheIdentity) -> None:
        check_readable(self.identity, expected, f"feature cache {self.directory}")

    def _shard(self, split: str, shard: int) -> tuple[ShardFile, list[int]]:
        """The shard, open, and its ``offsets``; the least recently read shards are closed beyond
        ``MAX_OPEN_SHARDS``."""
        path = shard_path(self.directory, split, shard)
        if path in self._shards:
            self._shards.move_to_end(path)
            return self._shards[path]
        if not path.is_file():
            raise FeatureCacheError(f"feature cache shard missing: {path}")
        opened = open_shard(path)
        try:
            self._shards[path] = opened, shard_offsets(opened)
        except FeatureCacheError:
            opened.close()
            raise
        while len(self._shards) > MAX_OPEN_SHARDS:
            self._shards.popitem(last=False)[1][0].close()
        return self._shards[path]

    def _span(self, split: str, row: int) -> tuple[ShardFile, int, int]:
        """``(shard, start, stop)``: where example ``row`` of ``split`` lies in its shard."""
        if not 0 <= row < self.identity.examples.get(split, 0):
            raise FeatureCacheError(f"feature cache {self.directory}: no row {row} in split '{split}'")
        shard, offsets = self._shard(split, row // self.examples_per_shard)
        local = row % self.examples_per_shard
        return shard, offsets[local], offsets[local + 1]

    def row(
        self, split: str, row: int, layers: tuple[int, ...] | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``(input_ids (T,), {index: (T, h)})`` of example ``row`` of ``split``, for ``layers``
        (default: every stored one)."""
        shard, start, stop = self._span(split, row)
        input_ids = _read_rows(shard, "input_ids", start, stop)  # (T,)
        states = {
            layer: _read_rows(shard, f"hidden_states.{layer}", start, stop) for layer in layers or self.layers
        }  # (T, h)
        return input_ids, states

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype the hidden states are stored in (``cache-features --dtype``)."""
        return getattr(torch, self.index["dtype"])

    def base_argmax(self, split: str, rows: list[int], input_ids: torch.Tensor) -> torch.Tensor | None:
        """(B, T) the base model's next-token argmax at each position of ``rows`` of ``split``
        whose next token is supervised (``NO_ARGMAX`` at the others, 0 on padding), aligned with
        ``input_ids`` (B, T) as ``batch`` is; None if a shard they are in was written before the
        cache stored it."""
        out = torch.zeros(input_ids.shape, dtype=torch.long, device=input_ids.device)  # (B, T)
        for position, row in enumerate(rows):
            shard, start, stop = self._span(split, row)
            if ARGMAX_KEY not in shard:
                return None
            argmax = _read_rows(shard, ARGMAX_KEY, start, stop)  # (T,)
            out[position, : stop - start] = argmax.to(out.device, torch.long)
        return out

    def batch(
        self,
        split: str,
        rows: list[int],
        input_ids: torch.Tensor,
        dtype: torch.dtype,
        layers: tuple[int, ...] | None = None,
    ) -> dict[int, torch.Tensor]:
        """{index: (B, T, h)} for ``rows`` of ``split`` and ``layers`` (default: all stored),
        right-padded with zeros to ``input_ids`` (B, T); raises if a cached row's tokens differ
        from the batch's."""
        batch_size, length = input_ids.shape
        hidden_size = int(self.index["hidden_size"])
        layers = layers or self.layers
        out = {
            layer: torch.zeros((batch_size, length, hidden_size), dtype=dtype, device=input_ids.device)
            for layer in layers
        }  # each (B, T, h)
        for position, row in enumerate(rows):
            cached_ids, states = self.row(split, row, layers)
            count = cached_ids.numel()
            if count > length or not torch.equal(
                cached_ids.to(input_ids.device, torch.long), input_ids[position, :count]
            ):
                raise FeatureCacheError(
                    f"feature cache {self.directory}: row {row} of '{split}' holds other tokens "
                    "than the batch; the cache was written for other data"
                )
            for layer, state in states.items():
                out[layer][position, :count] = state.to(device=input_ids.device, dtype=dtype)
        return out

"""The head a run starts from: built for the base, then a saved head's weights
(``train.init_head``) or its own start from the training data."""

from __future__ import annotations

import dataclasses
import random
import warnings

import torch

from draftheads.config import RunConfig
from draftheads.settings import ConfigError


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass


def init_from_saved_head(head, directory: str, base_model, token_counts: torch.Tensor | None = None) -> None:
    """Copy a saved head's weights (and buffers, e.g. EAGLE-3's vocabulary maps) into ``head``
    (``train.init_head``); refused unless the saved head is the same kind with the same settings
    (a ``GROWABLE`` one may be larger here: the head grows the saved weights, choosing what it adds
    from ``token_counts`` where that depends on the data) and fits ``base_model``."""
    from draftheads.heads import HeadMismatchError, load_head
    from draftheads.heads.base import GROWABLE, INIT_ONLY, TRAINING_ONLY

    where = f"train.init_head={directory}"
    try:
        saved = load_head(directory)
        saved.base_spec.check_fits(base_model.config, where=where)
    except (FileNotFoundError, ValueError, HeadMismatchError) as err:
        raise ConfigError(f"{where}: {err}") from err
    if saved.kind != head.kind:
        raise ConfigError(f"{where}: a '{saved.kind}' head, but head.kind is '{head.kind}'")
    for field in dataclasses.fields(head.config):
        if any(field.metadata.get(key) for key in (INIT_ONLY, GROWABLE, TRAINING_ONLY)):
            # INIT_ONLY: it chose the first weights, replaced here; GROWABLE: load_saved checks;
            # TRAINING_ONLY: it shapes this run's loss, not the saved weights
            continue
        ours, theirs = getattr(head.config, field.name), getattr(saved.config, field.name)
        if ours != theirs:
            raise ConfigError(f"{where}: its head.{field.name} is {theirs!r}, this run's is {ours!r}")
    try:
        head.load_saved(saved, token_counts)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from err


def supervised_token_counts(dataset, vocab_size: int) -> torch.Tensor:
    """(V,) how often each token is a supervised target (loss_mask 1) in ``dataset``; heads build
    data-dependent state from it (EAGLE-3's draft vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"]):
        ids = torch.as_tensor(ids, dtype=torch.long)
        counts += torch.bincount(ids[torch.as_tensor(mask, dtype=torch.bool)], minlength=vocab_size)[
            :vocab_size
        ]
    return counts


def initial_head(run: RunConfig, base_model, train_dataset):
    """The head in training mode: built for ``base_model``, then ``train.init_head``'s weights or
    its own start from the data. Its first weights depend only on ``train.seed``, never on the
    rank or the data order."""
    from draftheads.heads import build_head

    seed_everything(run.train.seed)
    try:
        head = build_head(base_model, run.head, run.model.base)
    except (ValueError, IndexError) as err:
        raise ConfigError(f"head ({run.head.kind}): {err}") from err
    if (problem := head.engine_layout_problem()) is not None:
        warnings.warn(f"{problem}; the run goes on", stacklevel=2)
    token_counts = supervised_token_counts(train_dataset, base_model.config.vocab_size)
    if run.train.init_head:
        init_from_saved_head(head, run.train.init_head, base_model, token_counts)
    else:
        head.init_from_data(token_counts)
    return head.train()

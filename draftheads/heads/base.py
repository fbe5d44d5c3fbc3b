"""The draft-head interface, the registry ``kind -> class``, and save/load.

A head is an ``nn.Module`` that owns only its trainable weights. The frozen parts it reuses from the
base model (token embedding, lm_head) are *references* given by ``attach(base_model)``: they are not
registered submodules, so they are never saved with the head, never handed to the optimiser and
never partitioned by DeepSpeed.

Conventions shared by every head (HF ``output_hidden_states`` tuple ``hs`` of length L + 1):
- ``hs[0]`` is the embedding output, ``hs[i]`` the output of decoder layer i, and ``hs[L]`` the final,
  *normed* hidden state that enters lm_head (transformers 5.x replaces the last entry by it).
- ``feature_layers`` lists the indices of ``hs`` a head reads; ``select_features(hs)`` turns them
  into the (B, T, F) tensor the head consumes (training, feature caches and inference alike).

How a head drafts is its ``drafting`` class attribute, the key of its Drafter in
``draftheads.infer.draft.DRAFTERS`` (heads never import ``infer``):
- ``"parallel"`` (Medusa): ``draft_logits(features)`` gives, from the features at the last accepted
  position, one distribution per depth at once; proposals ride on the verification forward.
- ``"autoregressive"`` (EAGLE, EAGLE-3): the head runs its own decoder layer on its own KV cache, one
  depth at a time, through ``new_cache``, ``catch_up`` and ``draft_step``; a draft node attends to
  its tree ancestors.
- ``"module-per-depth"`` (MTP): the same calls, but depth d is module d acting at the last accepted
  position, seeing its own cache prefix and itself only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from draftheads.storage import file_sha256, write_atomically, write_text_atomically

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # what a checkpoint's tensors are stored in
RUN_HEAD_DIR = "head"  # where a training run's output directory holds its final head
FORMAT_VERSION = 1
WEIGHTS_HASH_KEY = "weights_sha256"  # config.json: sha256 of model.safetensors, checked on load


class HeadMismatchError(ValueError):
    """A head does not fit the base model it is loaded against; names the mismatched field."""


class HeadFormatError(ValueError):
    """A head directory does not say what is needed (no config.json, a missing field, a format no
    reader knows); names the file and the field."""


# Field metadata key of a head setting that only chooses the initial weights (it does not shape
# the head): a run that continues a saved head (``train.init_head``) need not repeat it.
INIT_ONLY = "init_only"
# Field metadata key of a head setting a continued run may raise above the saved head's: the head
# grows the saved weights into its larger shape (``DraftHead.load_saved``).
GROWABLE = "growable"
# Field metadata key of a head setting that only shapes training (a loss weight, the number of
# unrolled training steps), not the head's weights or drafts: a run that continues a saved head may
# set it otherwise.
TRAINING_ONLY = "training_only"


@dataclass
class HeadConfig:
    """Fields common to every head kind; subclasses add their own (with defaults)."""

    kind: ClassVar[str] = ""


@dataclass(frozen=True)
class BaseModelSpec:
    """What a head must match in its base model. Recorded in the head's config.json."""

    name_or_path: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int

    @classmethod
    def from_config(cls, config, name_or_path: str | None = None) -> BaseModelSpec:
        return cls(
            name_or_path=name_or_path or getattr(config, "_name_or_path", "") or "",
            model_type=config.model_type,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            num_hidden_layers=config.num_hidden_layers,
        )

    def check_fits(self, config, where: str = "head") -> None:
        """Raise HeadMismatchError naming the first field where ``config`` differs from this spec."""
        for name in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers"):
            expected, actual = getattr(self, name), getattr(config, name, None)
            if expected != actual:
                raise HeadMismatchError(
                    f"{where} was built for a base model with {name}={expected!r} "
                    f"({self.name_or_path or 'unnamed base'}), but this base model has {name}={actual!r}"
                )


@dataclass(frozen=True)
class CatchUpStage:
    """One forward of a staged catch-up (``DraftHead.catch_up_stages``): over the head's draft cache
    ``cache_index``, n new positions with their (B, n, h) inputs, (B, n) tokens and positions."""

    cache_index: int
    hidden: torch.Tensor
    token_ids: torch.Tensor
    position_ids: torch.Tensor


class DraftHead(nn.Module):
    """Base class of every draft head. Subclasses register with ``@register_head``."""

    kind: ClassVar[str] = ""
    config_class: ClassVar[type[HeadConfig]] = HeadConfig
    drafting: ClassVar[str] = ""  # "parallel" | "autoregressive" | "module-per-depth"
    # Its draft caches hold key/value entries only, so a batch's rows can be stacked into one
    # draft_step (draftheads.infer.batch_draft); a head keeping other per-sequence state there says no.
    batch_drafting: ClassVar[bool] = True
    # Its catch_up takes an ``attention_mask`` (B, 1, T, past + T), so a batch's rows catch up in
    # one forward (left-padded to the longest: each row's last position is its real last one).
    batch_catch_up: ClassVar[bool] = False
    # Its catch-up is several forwards, each over one of its draft caches (MTP: one per module), and
    # it gives them as ``catch_up_stages``: a batch runs each stage once for all its rows.
    staged_catch_up: ClassVar[bool] = False
    # Its drafting reads no base weight but the token embeddings, and takes features and masks in the
    # base's dtype, casting them to its own: its weights may be in another dtype than the base's
    # (a bf16 drafter beside an fp32 base, ``draftheads.infer.precision``).
    own_dtype_drafting: ClassVar[bool] = False
    # The decoder-layer layout the serving engines build this kind's drafter as, whatever the base
    # (``draftheads.heads.layers.LAYOUT_CONFIGS``); None: the base's own layers, or no layers.
    engine_layout: ClassVar[str | None] = None
    # Whether its training unroll can recompute each pass in the backward pass
    # (``gradient_checkpointing_enable``).
    supports_gradient_checkpointing: ClassVar[bool] = False

    def __init__(self, config: HeadConfig, base_config, base_name: str | None = None):
        super().__init__()
        self.gradient_checkpointing = False
        self.config = config
        self.base_config = base_config  # transformers PretrainedConfig of the base model
        self.base_spec = BaseModelSpec.from_config(base_config, base_name)
        self._frozen: tuple[nn.Module, ...] = ()  # (embed_tokens, lm_head), set by attach()

    def gradient_checkpointing_enable(self) -> None:
        """Recompute the training unroll's passes in the backward pass instead of keeping their
        activations (transformers' name for it); ValueError for a kind that has no such unroll."""
        if not self.supports_gradient_checkpointing:
            raise ValueError(
                f"train.gradient_checkpointing: {self.kind} heads have no unrolled passes to recompute"
            )
        self.gradient_checkpointing = True

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_base(cls, base_model, config: HeadConfig, base_name: str | None = None) -> DraftHead:
        """A fresh (untrained) head for ``base_model``, initialised from its weights where the
        architecture says so (e.g. Medusa vocab projections from lm_head), and attached to it."""
        head = cls(config, base_model.config, base_name)
        head.to(dtype=base_model.dtype, device=base_model.device)
        head.init_from_base(base_model)
        head.attach(base_model)
        return head

    def init_from_base(self, base_model) -> None:
        """Copy initial weights from the base model (default: nothing to copy)."""

    def load_saved(self, saved: DraftHead, token_counts: torch.Tensor | None = None) -> None:
        """Take the weights (and buffers) of ``saved``, a head of the same kind and settings except
        ``GROWABLE`` ones (``train.init_head``); default: as they are. ``token_counts`` (V,), this
        run's supervised-token counts (as ``init_from_data``), is for heads whose growth depends on
        the data (EAGLE-3's draft vocabulary)."""
        self.load_state_dict(saved.state_dict())

    def init_from_data(self, token_counts: torch.Tensor) -> None:
        """Set data-dependent state from (V,) target-token counts over the training split's
        supervised tokens (EAGLE-3 builds its draft vocabulary here; default: nothing)."""

    def attach(self, base_model) -> DraftHead:
        """Check the head fits ``base_model`` and keep references to its frozen parts."""
        self.base_spec.check_fits(base_model.config, where=f"{self.kind} head")
        self._frozen = (base_model.get_input_embeddings(), base_model.get_output_embeddings())
        return self

    @property
    def embed_tokens(self) -> nn.Module:
        if not self._frozen:
            raise RuntimeError(f"{self.kind} head is not attached to a base model; call head.attach(model)")
        return self._frozen[0]

    @property
    def base_lm_head(self) -> nn.Module:
        if not self._frozen:
            raise RuntimeError(f"{self.kind} head is not attached to a base model; call head.attach(model)")
        return self._frozen[1]

    # ---- features -----------------------------------------------------------------------------

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Indices into the base ``hidden_states`` tuple this head reads (default: the last)."""
        return (self.base_spec.num_hidden_layers,)

    @property
    def required_hidden_states(self) -> tuple[int, ...]:
        """Every ``hidden_states`` index training needs: the features plus the last (targets)."""
        return tuple(sorted(set(self.feature_layers) | {self.base_spec.num_hidden_layers}))

    def select_features(self, hidden_states) -> torch.Tensor:
        """(B, T, F) features from ``hidden_states`` (the HF tuple, or a dict index -> tensor as
        feature caches store it); default: the last entry, F = h."""
        return hidden_states[self.feature_layers[-1]]

    # ---- drafting (see module docstring) -------------------------------------------------------

    @property
    def num_draft_steps(self) -> int:
        """Depths this head can draft: Medusa K heads, MTP D modules, EAGLE unbounded (-1)."""
        return -1

    def draft_to_target(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Map ids of the head's output vocabulary to base-vocabulary ids (identity by default)."""
        return token_ids

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Parallel heads: (B, T, F) -> (B, T, K, V) logits; entry k predicts the token k+2 ahead."""
        raise NotImplementedError(f"{self.kind} heads draft autoregressively")

    def new_cache(self):
        """Autoregressive heads: an empty draft KV cache (what ``catch_up``/``draft_step`` use)."""
        raise NotImplementedError(f"{self.kind} heads draft in parallel")

    def draft_caches(self, cache) -> tuple:
        """The ``DynamicCache`` objects inside a cache from ``new_cache()`` (one for EAGLE/EAGLE-3,
        one per module for MTP), e.g. to drop the rows ``draft_step`` wrote before the next
        ``catch_up``: record each ``get_seq_length()`` before drafting and crop back to it after
        (``draftheads.infer.cache.crop_to_lengths``)."""
        return (cache,)

    def catch_up(self, cache, features, next_token_ids, position_ids, attention_mask=None):
        """Autoregressive heads: extend the draft cache over newly accepted positions.

        Args:
            cache: from ``new_cache()``, holding the positions before ``position_ids[:, 0]``.
            features: (B, T, F) base features (``select_features``) at the new positions i.
            next_token_ids: (B, T) the accepted token at position i + 1 for each new position i
                (the last one is the token the base model just produced).
            position_ids: (B, T) absolute positions i.
            attention_mask: (B, 1, T, past + T) additive, for heads with ``batch_catch_up``;
                default: every row sees the whole cache and the new positions causally.
        Returns:
            ``(hidden, logits)`` at the last new position: (B, h) drafter state to feed the first
            draft step, and (B, V_draft) logits for the token after ``next_token_ids[:, -1]``.
        """
        raise NotImplementedError(f"{self.kind} heads draft in parallel")

    def catch_up_stages(self, cache, features, next_token_ids, position_ids):
        """Heads with ``staged_catch_up``: ``catch_up`` as a generator that yields each forward it
        needs as a ``CatchUpStage`` (which draft cache, over which new positions), is sent that
        forward's (B, n, h) output (``run_stage``), and returns the (B, h) state at the last new
        position; ``catch_up_logits`` of it gives the logits ``catch_up`` returns."""
        raise NotImplementedError(f"{self.kind} heads catch up in one forward")

    def run_stage(self, stage, cache, attention_mask) -> torch.Tensor:
        """One ``CatchUpStage`` over ``cache`` (the stage's draft cache, which gains its entries)
        with an additive (B, 1, n, past + n) mask; (B, n, h)."""
        raise NotImplementedError(f"{self.kind} heads catch up in one forward")

    def catch_up_logits(self, state: torch.Tensor) -> torch.Tensor:
        """(B, h) state from ``catch_up_stages`` -> (B, V_draft) logits for the first draft depth."""
        raise NotImplementedError(f"{self.kind} heads catch up in one forward")

    def draft_step(self, cache, depth, hidden, token_ids, position_ids, attention_mask):
        """Autoregressive heads: one draft depth over N tree nodes.

        Args:
            cache: draft cache after ``catch_up`` (+ earlier depths of this tree, for EAGLE).
            depth: 1-based depth of the nodes being expanded (their children are predicted).
            hidden: (B, N, h) drafter hidden state at each node's parent (from catch_up/draft_step).
            token_ids: (B, N) the nodes' tokens (base vocabulary ids).
            position_ids: (B, N) absolute positions for the drafter.
            attention_mask: (B, 1, N, past + N) additive float mask over cache + these nodes.
        Returns:
            ``(hidden, logits)``: (B, N, h) and (B, N, V_draft).
        """
        raise NotImplementedError(f"{self.kind} heads draft in parallel")

    # ---- persistence --------------------------------------------------------------------------

    def engine_layout_problem(self) -> str | None:
        """Why the engines' export formats would refuse this head's draft layers (their layout is
        not ``engine_layout``), said before a training run rather than at export; None if not."""
        layer_config = getattr(self, "layer_config", None)
        if (
            self.engine_layout is None
            or layer_config is None
            or layer_config.model_type == self.engine_layout
        ):
            return None
        return (
            f"head.layer_architecture is unset, so the {self.kind} draft layers are built as the base's "
            f"'{layer_config.model_type}' layers; vLLM, SGLang, speculators and llama.cpp load a {self.kind} "
            f"drafter as '{self.engine_layout}' layers and their export formats will refuse this head "
            f"(only --format draftheads takes it); set head.layer_architecture: {self.engine_layout}"
        )

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """Trainable/owned tensors only (no frozen base parts), contiguous, for safetensors."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}

    def config_dict(self) -> dict[str, Any]:
        """The head's config.json. ``base_config`` leaves out ``_name_or_path``, the directory
        transformers loaded the base from (a local cache path); ``base_model`` names the base."""
        base_config = self.base_config.to_dict()
        base_config.pop("_name_or_path", None)
        return {
            "format": "draftheads",
            "format_version": FORMAT_VERSION,
            "head_kind": self.kind,
            "head_config": dataclasses.asdict(self.config),
            "base_model": dataclasses.asdict(self.base_spec),
            "base_config": base_config,
        }

    def save_pretrained(self, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write ``model.safetensors``, then ``config.json`` (+ ``extra`` keys merged into it) with
        the weights' sha256 in ``weights_sha256``, which ``load_head`` checks; each replaced whole
        (``write_atomically``: a link there is replaced, not written through)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state, metadata = self.head_state_dict(), {"format": "pt"}
        write_atomically(directory / WEIGHTS_NAME, lambda path: save_file(state, str(path), metadata))
        config = self.config_dict()
        if extra:
            config.update(extra)
        config[WEIGHTS_HASH_KEY] = file_sha256(directory / WEIGHTS_NAME)
        write_text_atomically(directory / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=False) + "\n")
        return directory


# ---- registry ---------------------------------------------------------------------------------

HEAD_REGISTRY: dict[str, type[DraftHead]] = {}


def register_head(cls: type[DraftHead]) -> type[DraftHead]:
    """Class decorator: make a head kind loadable by name."""
    if not cls.kind or cls.kind in HEAD_REGISTRY:
        raise ValueError(f"head kind '{cls.kind}' is empty or registered twice")
    HEAD_REGISTRY[cls.kind] = cls
    return cls


def _ensure_registered() -> None:
    # Importing the package registers every built-in head (nothing else runs at import time).
    import draftheads.heads  # noqa: F401


def head_class(kind: str) -> type[DraftHead]:
    _ensure_registered()
    if not isinstance(kind, str) or kind not in HEAD_REGISTRY:  # a list read from JSON is unhashable
        raise ValueError(f"unknown head kind '{kind}'; known kinds: {', '.join(sorted(HEAD_REGISTRY))}")
    return HEAD_REGISTRY[kind]


def head_config_from_dict(data: dict, where: str = "head") -> HeadConfig:
    """Validate a ``head:`` config section (must contain ``kind``) into its dataclass."""
    from draftheads.settings import ConfigError, from_dict

    if not isinstance(data, dict) or "kind" not in data:
        raise ConfigError(f"{where}: needs 'kind' (one of the registered head kinds)")
    data = dict(data)
    kind = data.pop("kind")
    try:
        cls = head_class(kind)
    except ValueError as err:
        raise ConfigError(f"{where}.kind: {err}") from err
    return from_dict(cls.config_class, data, where)


def build_head(base_model, config: HeadConfig, base_name: str | None = None) -> DraftHead:
    """A fresh head of ``config.kind`` on ``base_model``."""
    return head_class(config.kind).from_base(base_model, config, base_name)


def _holds_weights(directory: Path) -> bool:
    return any(p.suffix in WEIGHT_SUFFIXES for p in directory.iterdir() if p.is_file())


def resolve_head_dir(directory: str | Path) -> Path:
    """The head directory ``directory`` names: itself (a head, an engine checkpoint, or a training
    checkpoint ``<run>/checkpoints/step-N``), a shipped head's short name (``draftheads.shipped``),
    or, for a training run's output directory (no weights of its own, the final head under
    ``head/``), its ``head/``. Raises HeadFormatError saying what was expected when it is none of
    them (for a run that has no ``head/`` yet, naming its newest checkpoint)."""
    from draftheads.shipped import resolve_head_dir as resolve_name

    directory = resolve_name(directory)  # an existing path, else a shipped head's directory
    if not directory.is_dir():
        raise HeadFormatError(
            f"{directory} is a file; give the head directory (the one holding {CONFIG_NAME})"
        )
    run_head = directory / RUN_HEAD_DIR
    if (run_head / CONFIG_NAME).is_file() and not _holds_weights(directory):
        return run_head
    from draftheads.heads.checkpoint import is_training_checkpoint, missing_config_hint, newest_checkpoint

    newest = None if _holds_weights(directory) else newest_checkpoint(directory)
    if newest is not None:
        raise HeadFormatError(
            f"{directory} is a training run's output directory without {RUN_HEAD_DIR}/ (the run did not "
            f"finish); its newest checkpoint holds the head: give --heads {newest}"
        )
    if not (directory / CONFIG_NAME).is_file():
        if is_training_checkpoint(directory):
            raise HeadFormatError(missing_config_hint(directory))
        raise HeadFormatError(
            f"no {CONFIG_NAME} in head directory {directory}: expected a head ({CONFIG_NAME} + "
            f"{WEIGHTS_NAME}, as `draftheads train` writes to <output_dir>/{RUN_HEAD_DIR}, or an engine "
            f"checkpoint), a training run's output directory holding one under {RUN_HEAD_DIR}/, or one of "
            "its checkpoints (<output_dir>/checkpoints/step-N)"
        )
    return directory


def json_type_name(value: Any) -> str:
    """What JSON calls the type of a parsed ``value`` ("a list", "a string"), for error messages."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file ``path``; text that is not JSON, or JSON that is not an object,
    raises HeadFormatError naming the file."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HeadFormatError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise HeadFormatError(f"{path}: expected a JSON object, got {json_type_name(data)}")
    return data


def inside_head(directory: Path, path: Path) -> Path:
    """``path``, a file (or folder) of the head in ``directory``, once it is known to lie inside
    it. A symbolic link leading out of the head directory, a broken one, or one to something that
    is neither a file nor a folder raises HeadFormatError naming it: export copies and uploads what
    it reads, so a link to a system file or another user's would publish that file. A path that
    does not exist passes (callers say what is missing); a link within the head is read."""
    if not os.path.lexists(path):
        return path
    target = path.resolve()
    if not target.is_relative_to(directory.resolve()):
        raise HeadFormatError(
            f"{path}: a symbolic link to {target}, outside the head directory {directory}; head files "
            "are read only from inside it (copy the file in instead)"
        )
    if not (target.is_file() or target.is_dir()):
        raise HeadFormatError(f"{path}: not a regular file (a broken link, a device or a pipe)")
    return path


def read_head_config(directory: str | Path) -> tuple[Path, dict[str, Any]]:
    """(path, contents) of the config.json of the head ``directory`` names (``resolve_head_dir``);
    the head's own directory is ``path.parent``. A file that is not a JSON object, or a link out of
    the head (``inside_head``), raises HeadFormatError naming it."""
    directory = resolve_head_dir(directory)
    config_path = inside_head(directory, directory / CONFIG_NAME)
    return config_path, read_json_object(config_path)


def object_field(
    saved: dict[str, Any], key: str, config_path: Path, optional: bool = False
) -> dict[str, Any] | None:
    """``saved[key]``, which must be a JSON object (``optional``: or absent or null, giving None);
    else HeadFormatError naming file, field and value."""
    value = saved.get(key)
    if optional and value is None:
        return None
    if not isinstance(value, dict):
        raise HeadFormatError(
            f"{config_path}: field '{key}' must be a JSON object, got {json_type_name(value)} {value!r:.80}"
        )
    return value


def read_weights(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a damaged file raises HeadFormatError naming it (the
    library's own error names no file)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=str(device))
    except SafetensorError as err:
        raise HeadFormatError(f"{path}: not a readable safetensors file ({err})") from err


def _is_ours(saved: dict[str, Any]) -> bool:
    return saved.get("format") == "draftheads"


def _is_joint(saved: dict[str, Any]) -> bool:
    """A Medusa-2 head, trained with a LoRA adapter on its base (engine formats hold none)."""
    head_config = saved.get("head_config")  # load_head refuses one that is not an object
    return _is_ours(saved) and isinstance(head_config, dict) and bool(head_config.get("joint", False))


def resolve_base_model(head_dir: str | Path, base: str | None = None) -> str:
    """The base model a head drafts for: ``base`` if given, else the one the head's config.json
    records (``base_model.name_or_path``; in an engine-format checkpoint, our metadata block or the
    format's own field, e.g. the speculators verifier). Raises HeadFormatError naming the file and
    the field when neither names one."""
    if base:
        return base
    config_path, saved = read_head_config(head_dir)
    if _is_ours(saved):
        fields: tuple[str, ...] = ("base_model.name_or_path",)
        recorded = object_field(saved, "base_model", config_path) if "base_model" in saved else {}
        name = recorded.get("name_or_path")
    else:
        from draftheads.export.reading import recorded_base_fields, recorded_base_name

        fields, name = recorded_base_fields(saved), recorded_base_name(saved)
    if name:
        return str(name)
    raise HeadFormatError(
        f"{config_path}: records no base model ({' / '.join(fields)} is missing or empty); "
        "pass the base model explicitly (--base, or base=...)"
    )


def _base_config_from(saved: dict[str, Any], config_path: Path):
    """The transformers config of the base model recorded in ``saved["base_config"]``; a missing or
    unknown ``model_type``, or a value the config class refuses, raises HeadFormatError naming the
    file and the field."""
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 configs validate fields
    from transformers import CONFIG_MAPPING, AutoConfig

    base_config = dict(object_field(saved, "base_config", config_path))
    if "model_type" not in base_config:
        raise HeadFormatError(f"{config_path}: missing field 'base_config.model_type'")
    model_type = base_config.pop("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise HeadFormatError(
            f"{config_path}: field 'base_config.model_type': unknown model type {model_type!r} "
            "(not an architecture this transformers version knows)"
        )
    try:
        return AutoConfig.for_model(model_type, **base_config)
    except (TypeError, ValueError, StrictDataclassError) as err:
        raise HeadFormatError(f"{config_path}: field 'base_config': {err}") from err


def _expected_weights_hash(saved: dict[str, Any], config_path: Path) -> str | None:
    """``saved["weights_sha256"]`` (None for a head saved before it was recorded); a value that is
    not 64 hex digits raises HeadFormatError naming the file and the field."""
    value = saved.get(WEIGHTS_HASH_KEY)
    if value is None:
        return None
    if not (isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)):
        raise HeadFormatError(
            f"{config_path}: field '{WEIGHTS_HASH_KEY}' must be a sha256 (64 hex digits), got "
            f"{json_type_name(value)} {value!r:.80}"
        )
    return value


def check_weights_hash(weights_path: Path, expected: str | None, actual: Future[str] | str) -> None:
    """Refuse weights whose sha256 (``actual``, or the future computing it) is not ``expected`` (the
    hash config.json recorded; None: nothing recorded, nothing to check), naming the file."""
    if expected is None:
        return
    digest = actual if isinstance(actual, str) else actual.result()
    if digest != expected:
        raise HeadFormatError(
            f"{weights_path}: sha256 {digest[:12]}... does not match '{WEIGHTS_HASH_KEY}' "
            f"{expected[:12]}... in its {CONFIG_NAME}: the weights changed or were damaged after the "
            "head was saved; copy or export the head again"
        )


def check_state_fits(
    skeleton: nn.Module, state: dict[str, torch.Tensor], weights_path: Path, config_path: Path
) -> None:
    """Refuse (HeadFormatError naming the weights, the config and the tensor) tensors ``state`` that
    are not, name for name and shape for shape, those of ``skeleton``: the head ``config_path``
    describes, built on the meta device so that its sizes cost no memory."""
    expected = skeleton.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise HeadFormatError(f"{weights_path}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise HeadFormatError(
                f"{weights_path}: does not fit the head {config_path} describes (size mismatch for "
                f"{name}: the file holds shape {tuple(tensor.shape)}, the config gives "
                f"{tuple(expected[name].shape)})"
            )


def _read_head_weights(directory: Path, saved: dict[str, Any], map_location) -> dict[str, torch.Tensor]:
    """The tensors of the head in ``directory``: its model.safetensors, or, in a training checkpoint
    (``heads/checkpoint.py``), the head's entries of the engine state. A Medusa-2 checkpoint is
    refused: its adapter sits in the engine state, where decoding cannot merge it from."""
    from draftheads.heads.checkpoint import checkpoint_head_state, is_training_checkpoint

    if (directory / WEIGHTS_NAME).is_file() or not is_training_checkpoint(directory):
        return read_weights(directory / WEIGHTS_NAME, map_location)
    if _is_joint(saved):
        raise HeadFormatError(
            f"{directory}: a Medusa-2 checkpoint keeps its base adapter in DeepSpeed's engine state; "
            "resume the run for zero more steps (train.resume=true, train.max_steps at its step) to "
            f"write the head and its adapter to <output_dir>/{RUN_HEAD_DIR}"
        )
    return checkpoint_head_state(directory, map_location)


def load_head(directory: str | Path, base_model=None, map_location: str | torch.device = "cpu") -> DraftHead:
    """Load a head saved with ``save_pretrained``, from a training checkpoint (``<run>/checkpoints/
    step-N``, ``heads/checkpoint.py``), or from an engine format a registered reader knows
    (``draftheads.export``). If ``base_model`` is given, check it fits and attach to it (a
    mismatch raises HeadMismatchError naming the field); ``base_model`` is never modified.

    A joint (Medusa-2) head drafts for, and must be verified by, its base with the head's adapter
    merged: it attaches only to a model that already carries that merge (from ``load_head_and_base``
    or ``adapter.adapted_base``); any other base raises HeadMismatchError."""
    config_path, saved = read_head_config(directory)
    directory = config_path.parent
    if not _is_ours(saved):
        from draftheads.export.reading import read_engine_head  # registers every engine format

        return read_engine_head(directory, saved, base_model, map_location)
    for key in ("head_kind", "head_config", "base_model", "base_config"):
        if key not in saved:
            raise HeadFormatError(f"{config_path}: missing field '{key}'")
    try:
        cls = head_class(saved["head_kind"])
    except ValueError as err:
        raise HeadFormatError(f"{config_path}: field 'head_kind': {err}") from err
    from draftheads.settings import from_dict

    config = from_dict(cls.config_class, saved["head_config"], f"{config_path}:head_config")
    expected_hash = _expected_weights_hash(saved, config_path)
    weights_path = inside_head(directory, directory / WEIGHTS_NAME)
    base_name = object_field(saved, "base_model", config_path).get("name_or_path")
    # hashlib releases the GIL: the file is hashed while the weights are read and the module built.
    with ThreadPoolExecutor(max_workers=1) as hasher:
        actual_hash = hasher.submit(file_sha256, weights_path) if expected_hash else ""
        base_config = _base_config_from(saved, config_path)
        state = _read_head_weights(directory, saved, map_location)  # as large as the file, no larger
        # The widths in config.json are checked against the tensors before the head is built, so a
        # hand-edited width (10**12) is refused from the shapes, not by an attempt to allocate it.
        with torch.device("meta"):
            skeleton = cls(config, base_config, base_name)
        check_state_fits(skeleton, state, directory / WEIGHTS_NAME, config_path)
        head = cls(config, base_config, base_name)
        check_weights_hash(directory / WEIGHTS_NAME, expected_hash, actual_hash)
    head.load_state_dict(state)
    head.to(map_location)
    if base_model is not None:
        if _is_joint(saved):
            from draftheads.heads.adapter import check_adapted

            head.base_spec.check_fits(base_model.config, where=f"{head.kind} head in {directory}")
            check_adapted(base_model, directory)
        head.to(dtype=base_model.dtype, device=base_model.device)
        head.attach(base_model)
    return head


def load_head_and_base(
    directory: str | Path, base_model, map_location: str | torch.device | None = None, copy_base: bool = True
):
    """The head in ``directory`` attached to the model it drafts for, as ``(head, model)``:
    ``base_model`` itself for a plain head; for a joint (Medusa-2) head, a copy of ``base_model``
    with the head's adapter merged (``adapter.adapted_base``), unless ``base_model`` already is that
    adapted base. ``base_model`` is never modified, unless ``copy_base=False`` hands it over to be
    adapted in place (``adapter.adapted_base``). ``map_location``: default the model's device."""
    model = base_model
    config_path, saved = read_head_config(directory)
    directory = config_path.parent
    if _is_joint(saved):
        from draftheads.heads.adapter import adapted_base, adapter_fingerprint, merged_adapter

        recorded = saved.get("base_model")
        if isinstance(recorded, dict):  # refuse a base that does not fit before copying it
            spec = BaseModelSpec(**{f.name: recorded.get(f.name) for f in dataclasses.fields(BaseModelSpec)})
            spec.check_fits(base_model.config, where=f"{saved.get('head_kind')} head in {directory}")
        if merged_adapter(base_model) != adapter_fingerprint(directory):
            model = adapted_base(base_model, directory, copy_base=copy_base)
    head = load_head(
        directory, base_model=model, map_location=model.device if map_location is None else map_location
    )
    return head, model

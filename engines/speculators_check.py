"""The speculators package's view of our EAGLE-3 and DFlash exports, run by the engine check inside
the speculators virtualenv (it imports nothing from draftheads).

    python engines/speculators_check.py REQUEST.json RESULT.json

REQUEST: {"algorithm": "eagle3", "dflash" or "peagle", "speculators_export": our speculators export,
"release_export": our export of the same head in the layout speculators' converter reads (eagle3,
dflash; null where there is none: then nothing is converted), "verifier": the base model dir,
"work_dir": scratch}. RESULT: {"load": {missing, unexpected, ignored_missing, config_class} or
{error}, "convert" (with a release export): {converted_keys, ours_keys, only_converted, only_ours,
differing, config_differences} or {error}, "speculators_version"}.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path

# speculators' converter from each algorithm's release layout (module, class), imported when used.
CONVERTERS = {
    "eagle3": ("speculators.convert.eagle.eagle3_converter", "Eagle3Converter"),
    "dflash": ("speculators.convert.dflash.converter", "DFlashConverter"),
}
# Config fields the engines read from a speculators config, per algorithm (vLLM: vllm/transformers_utils/
# configs/speculators/algos.py update_eagle3, update_dflash; speculators: DFlash's block_size); the
# converter's output must agree on them. DFlash's target_hidden_size is left out: the converter leaves
# it unset, which vLLM reads as the draft layers' hidden_size, and a differing one shows in fc.weight.
COMPARED_FIELDS = {
    "eagle3": ("speculators_model_type", "draft_vocab_size", "norm_before_residual"),
    "dflash": (
        "speculators_model_type",
        "draft_vocab_size",
        "mask_token_id",
        "aux_hidden_state_layer_ids",
        "block_size",
    ),
}


def engine_error(err: Exception) -> dict:
    return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def read_export(directory: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    config = json.loads((directory / "config.json").read_text())
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return config, tensors


def load_export(directory: str) -> dict:
    """Load our speculators export with speculators' own classes; list the keys the model misses
    (beyond those it declares optional), the checkpoint keys it has no place for, and the tensors
    that did not arrive unchanged."""
    import torch
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(directory)
    _, tensors = read_export(Path(directory))
    state = model.state_dict()
    ignored = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
    missing = set(state) - set(tensors)
    return {
        "model_class": type(model).__name__,
        "config_class": type(model.config).__name__,
        "missing": sorted(missing - ignored),
        "ignored_missing": sorted(missing & ignored),
        "unexpected": sorted(set(tensors) - set(state)),
        "altered": sorted(
            key
            for key in set(state) & set(tensors)
            if not torch.equal(state[key].cpu(), tensors[key].to(state[key].dtype))
        ),
    }


def convert_export(
    algorithm: str, release_dir: str, speculators_dir: str, verifier: str, work_dir: str
) -> dict:
    """speculators' converter applied to our release-layout export, compared with our speculators export."""
    import torch

    module, name = CONVERTERS[algorithm]
    converter = getattr(importlib.import_module(module), name)()
    converted_dir = Path(work_dir) / "converted"
    converter.convert(release_dir, converted_dir, verifier, validate=True)
    converted_config, converted = read_export(converted_dir)
    ours_config, ours = read_export(Path(speculators_dir))
    differing = sorted(
        key
        for key in set(converted) & set(ours)
        if converted[key].shape != ours[key].shape
        or converted[key].dtype != ours[key].dtype
        or not torch.equal(converted[key], ours[key])
    )
    config_differences = {
        name: {"converted": converted_config.get(name), "ours": ours_config.get(name)}
        for name in COMPARED_FIELDS[algorithm]
        if converted_config.get(name) != ours_config.get(name)
    }
    if algorithm == "eagle3":
        from speculators.models.utils import resolve_target_layer_ids

        # The converter leaves the capture layers unset when the source did not name them; both mean
        # what speculators resolves them to (its default (2, L // 2, L - 3) for an unset list).
        layers = {
            side: resolve_target_layer_ids(config.get("eagle_aux_hidden_state_layer_ids"), verifier)
            for side, config in (("converted", converted_config), ("ours", ours_config))
        }
        if layers["converted"] != layers["ours"]:
            config_differences["eagle_aux_hidden_state_layer_ids (resolved)"] = layers
    return {
        "converted_keys": len(converted),
        "ours_keys": len(ours),
        "only_converted": sorted(set(converted) - set(ours)),
        "only_ours": sorted(set(ours) - set(converted)),
        "differing": differing,
        "config_differences": config_differences,
    }


def main(argv: list[str]) -> int:
    request_path, result_path = argv
    with open(request_path) as handle:
        request = json.load(handle)
    from importlib.metadata import version

    result: dict = {"speculators_version": version("speculators")}
    try:
        result["load"] = load_export(request["speculators_export"])
    except Exception as err:  # noqa: BLE001 (the package's own error is the finding)
        result["load"] = engine_error(err)
    if request["release_export"] is not None:  # else no converter reads a layout of ours
        try:
            result["convert"] = convert_export(
                request["algorithm"],
                request["release_export"],
                request["speculators_export"],
                request["verifier"],
                request["work_dir"],
            )
        except Exception as err:  # noqa: BLE001
            result["convert"] = engine_error(err)
    with open(result_path, "w") as handle:
        json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

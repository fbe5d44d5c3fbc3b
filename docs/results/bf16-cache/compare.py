"""Two feature caches of the same rows, one written with the base in fp32 and one in bf16
(``draftheads cache-features --compute-dtype``): how far apart their hidden states and stored
argmax are (docs/training.md, "A feature cache computed in bf16").

    python docs/results/bf16-cache/compare.py runs/features/c1000-float32 runs/features/c1000-bfloat16 [SPLIT]

Prints, per stored layer, the relative error ||bf16 - fp32|| / ||fp32|| over the split's tokens and
the mean cosine similarity per token, and the share of supervised positions whose stored argmax
agrees.
"""

import json
import sys

import torch

from draftheads.data.features import NO_ARGMAX, FeatureCache, read_index


def main(reference: str, other: str, split: str = "validation") -> None:
    ours, theirs = FeatureCache(reference), FeatureCache(other)
    rows = read_index(reference)["identity"]["examples"][split]
    error, norm, cosine, tokens, agree, supervised = {}, {}, {}, 0, 0, 0
    for row in range(rows):
        ids, states = ours.row(split, row)
        other_ids, other_states = theirs.row(split, row)
        assert torch.equal(ids, other_ids), f"row {row} differs between the caches"
        for layer, state in states.items():
            a, b = state.float(), other_states[layer].float()
            error[layer] = error.get(layer, 0.0) + (a - b).pow(2).sum().item()
            norm[layer] = norm.get(layer, 0.0) + a.pow(2).sum().item()
            cosine[layer] = cosine.get(layer, 0.0) + torch.cosine_similarity(a, b, dim=-1).sum().item()
        tokens += len(ids)
        batch = ids[None].long()
        first, second = ours.base_argmax(split, [row], batch)[0], theirs.base_argmax(split, [row], batch)[0]
        marked = first != NO_ARGMAX
        agree += int((first[marked] == second[marked]).sum())
        supervised += int(marked.sum())
    result = {
        "split": split,
        "rows": rows,
        "tokens": tokens,
        "relative_error": {layer: round((error[layer] / norm[layer]) ** 0.5, 5) for layer in sorted(error)},
        "mean_cosine": {layer: round(cosine[layer] / tokens, 6) for layer in sorted(cosine)},
        "argmax_agreement": round(agree / supervised, 5),
        "supervised_positions": supervised,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])

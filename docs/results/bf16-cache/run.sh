#!/bin/bash
# The bf16-computed feature cache against the fp32 one (docs/training.md, "A feature cache computed
# in bf16"): write both, train a fresh one-epoch head on each, each scored at its end on its own
# cache and as decoding sees it (the live fp32 base, MT-bench).
# Then score.sh: the shipped head on each cache, and the bf16-cache head on the fp32 cache.
set -ex
cd "$(dirname "$0")/../../.."  # the repository root
C="--config configs/eagle3-smollm2-corpus-top-layer-cached.yaml data.limit=1000 head.feature_layers=[2,15,27]"
for d in float32 bfloat16; do
  /usr/bin/time -f "cache $d %e s" draftheads cache-features $C data.features=runs/features/c1000-$d --compute-dtype $d
done
for d in float32 bfloat16; do
  draftheads train $C data.features=runs/features/c1000-$d train.output_dir=runs/s39/train-$d train.eval_every=0
done
echo ALLDONE

#!/bin/bash
# After run.sh: the shipped head scored on each cache (no step), and the head trained on the bf16
# cache scored on the fp32 one.
set -ex
cd "$(dirname "$0")/../../.."  # the repository root
C="--config configs/eagle3-smollm2-corpus-top-layer-cached.yaml data.limit=1000 head.feature_layers=[2,15,27] train.epochs=null train.max_steps=0 train.decode_eval_prompts=0"
for d in float32 bfloat16; do
  draftheads train $C data.features=runs/features/c1000-$d train.output_dir=runs/s39/score-$d \
    train.init_head=docs/results/heads/eagle3-corpus-all-cached-cont4
done
draftheads train $C data.features=runs/features/c1000-float32 train.output_dir=runs/s39/score-bf16head-on-fp32 \
    train.init_head=runs/s39/train-bfloat16/head
echo ALLDONE

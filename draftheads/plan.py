"""The memory of a training step per GPU, planned from a run config and the base's config.json.

No weight is read: the base and the head are built on the meta device, which gives their exact
parameter counts, and the rest is arithmetic in the base's shape (hidden size h, intermediate size
I, key/value width kv, L layers, vocabulary V), the micro-batch B x T, the ZeRO stage and the GPU
count N. Terms, in bytes per GPU, b the training dtype's bytes (2 for bf16, 4 for fp32):

- frozen base: its parameters x b (offline runs: only embeddings, final norm and lm_head).
- head weights: P x b (ZeRO-3: / N).
- gradients: P x b (ZeRO-0/1); ZeRO-2/3 keep their partition, P x b / N, and the reduce buckets.
- optimizer: Adam's two fp32 moments, 8 P, and an fp32 master copy, 4 P, unless the weights are
  fp32 and not partitioned (ZeRO-0); / N under ZeRO-1/2/3 (Rajbhandari et al. 2020, "ZeRO").
- base forward: online, the hidden states the head reads (the forward keeps no others) plus one
  layer's transient tensors; offline, the cached states of the batch.
- head activations: what autograd keeps per row of each draft-layer pass (its inputs, norms, q/k/v,
  attention and MLP tensors: about 15 h + 3 kv + 4 I values), times the passes (EAGLE-3's TTT steps);
  with ``train.gradient_checkpointing``, each pass's input state and keys / values (h + 2 kv) and
  one pass over every row recomputed in the backward pass.
- attention (training-time test): the (B, 1, T, T) causal mask in the training dtype, and one query
  chunk's fp32 scores, probabilities and their gradient (``draftheads.heads.ttt_attention``; no
  step keeps its scores).
- loss: EAGLE-3's target table, the base's logits at the draft vocabulary in the training dtype,
  one row per scored token; and one chunk's fp32 logits, log-softmax, targets, product and
  gradient (``draftheads.train.chunked_loss``; no step keeps its logits).
- optimizer step: the gradient partition flattened and cast to fp32 for Adam (and, on a CPU, the
  multi-tensor AdamW's temporaries).

Weights, gradients and optimizer state are held throughout; the activations only until the
backward, the optimizer step's temporaries only after it, so the peak is the held terms plus the
larger of the two. Checked against measured peaks on a CPU at Llama-3.1-8B's widths (docs/gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftheads.heads.ttt_attention import CHUNK_SCORES

GIB = 2**30
MAX_MICRO_BATCH = 1024  # the largest micro-batch a plan tries
DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)
ACTIVATION_VALUES = (15, 3, 4)  # per row of a draft-layer pass: 15 h + 3 kv + 4 I values
# fp32 copies of a chunk's scores or logits alive at once: logits, (log-)softmax, targets, their
# product and the gradient in the backward pass.
CHUNK_COPIES = 5


@dataclass(frozen=True)
class Shapes:
    """What the plan needs of a base and its head (parameter counts exact, from meta modules)."""

    base_parameters: int
    skeleton_parameters: int  # embeddings, final norm, lm_head: what an offline run loads
    head_parameters: int
    hidden: int
    intermediate: int
    kv_width: int
    layers: int
    vocab: int
    draft_vocab: int
    passes: int  # draft-layer passes per training step (EAGLE-3: TTT steps; EAGLE: 1; Medusa: 0)
    attention_steps: int  # training-time-test steps (EAGLE-3, P-EAGLE; 0 for the others)
    attention_heads: int
    scored_steps: int  # vocabulary projections per position (draft steps)
    cached_states: int  # hidden states a feature cache holds per token


HELD, FORWARD, STEP = "held", "forward", "optimizer step"  # when a term's memory is in use


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    note: str
    moment: str = HELD


@dataclass(frozen=True)
class StepPlan:
    terms: tuple[Term, ...]
    micro_batch: int
    tokens: int
    gpus: int
    stage: int

    def at(self, moment: str) -> float:
        return sum(term.bytes for term in self.terms if term.moment == moment)

    @property
    def peak_moment(self) -> str:
        """The moment of the peak: the end of the forward (activations held) or the optimizer step
        (its temporaries; the activations are freed by then)."""
        return FORWARD if self.at(FORWARD) >= self.at(STEP) else STEP

    @property
    def total(self) -> float:
        return self.at(HELD) + max(self.at(FORWARD), self.at(STEP))

    def table(self) -> str:
        lines = [f"{'term':<20} {'GiB':>8}  how", "-" * 64]
        for moment in (HELD, FORWARD, STEP):
            peak = " (the peak)" if moment == self.peak_moment else ""
            lines.append(f"[{moment}]{peak if moment != HELD else ' throughout'}")
            for term in (t for t in self.terms if t.moment == moment):
                lines.append(f"  {term.name:<18} {term.bytes / GIB:>8.2f}  {term.note}")
        lines.append(f"{'peak':<20} {self.total / GIB:>8.2f}  held + {self.peak_moment}")
        return "\n".join(lines)


def count_shapes(run, base_config) -> Shapes:
    """``Shapes`` of ``run``'s head on a base of ``base_config`` (both built on the meta device)."""
    from transformers import AutoModelForCausalLM

    from draftheads.base_skeleton import decoder_layers
    from draftheads.heads import build_head

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(base_config, dtype=torch.bfloat16)
        head = build_head(base, run.head, run.model.base)
    prefix, _ = decoder_layers(base)
    unique = {id(p): (name, p.numel()) for name, p in base.named_parameters()}.values()
    skeleton = sum(count for name, count in unique if not name.startswith(prefix))
    kind = run.head.kind
    ttt = getattr(run.head, "ttt_steps", 1)
    passes = {"medusa": 0, "eagle": 1, "mtp": getattr(run.head, "num_modules", 1)}.get(kind, ttt)
    heads = base_config.num_attention_heads
    head_dim = getattr(base_config, "head_dim", None) or base_config.hidden_size // heads
    return Shapes(
        base_parameters=sum(count for _, count in unique),
        skeleton_parameters=skeleton,
        head_parameters=sum(p.numel() for p in head.parameters()),
        hidden=base_config.hidden_size,
        intermediate=base_config.intermediate_size,
        kv_width=base_config.num_key_value_heads * head_dim,
        layers=base_config.num_hidden_layers,
        vocab=base_config.vocab_size,
        draft_vocab=getattr(run.head, "draft_vocab_size", None) or base_config.vocab_size,
        passes=passes,
        attention_steps=ttt if kind in ("eagle3", "peagle") else 0,
        attention_heads=heads,
        scored_steps=getattr(run.head, "num_heads", None) or max(passes, 1),
        cached_states=len(head.required_hidden_states),
    )


def state_terms(shapes: Shapes, dtype_bytes: int, stage: int, gpus: int, offline: bool, buckets: int):
    """Weights, gradients and optimizer state (``buckets``: the reduce buckets' elements in all)."""
    P = shapes.head_parameters
    base = shapes.skeleton_parameters if offline else shapes.base_parameters
    shard = gpus if stage >= 1 else 1
    master = 0 if (dtype_bytes == 4 and stage == 0) else 4 * P / shard
    if stage >= 2:
        gradients, how = P * dtype_bytes / gpus + buckets * dtype_bytes, "partition + reduce buckets"
    else:
        gradients, how = P * dtype_bytes, "every parameter's"
    return [
        Term("frozen base", base * dtype_bytes, "embeddings, norm, lm_head" if offline else "every layer"),
        Term("head weights", P * dtype_bytes / (gpus if stage == 3 else 1), f"{P / 1e6:.1f} M parameters"),
        Term("gradients", gradients, how),
        Term("optimizer", 8 * P / shard + master, "Adam moments" + (" + fp32 master" if master else "")),
    ]


def activation_terms(
    shapes: Shapes,
    batch: int,
    tokens: int,
    dtype_bytes: int,
    offline: bool,
    fraction: float,
    recompute: bool = False,
):
    """What the forward keeps for the backward, and the attention's and loss's working tensors;
    ``recompute``: the draft-layer passes are recomputed in the backward pass
    (``train.gradient_checkpointing``)."""
    from draftheads.train.chunked_loss import CHUNK_LOGITS

    h, kv, inter = shapes.hidden, shapes.kv_width, shapes.intermediate
    positions = batch * tokens
    if offline:
        base = Term(
            "base forward", positions * shapes.cached_states * h * dtype_bytes, "cached states read", FORWARD
        )
    else:
        kept = shapes.cached_states * h
        transient = 4 * h + 2 * kv + 3 * inter
        base = Term(
            "base forward",
            positions * (kept + transient) * dtype_bytes,
            f"{shapes.cached_states} hidden states + one layer",
            FORWARD,
        )
    a, b, c = ACTIVATION_VALUES
    per_row = (a * h + b * kv + c * inter) * dtype_bytes
    rows = positions * fraction
    passes = max(shapes.passes, 1)
    if recompute:  # each pass keeps its input state and keys / values; one pass runs again at a time
        kept = rows * passes * (h + 2 * kv) * dtype_bytes + positions * per_row
        head = Term(
            "head activations", kept, f"{shapes.passes} passes' inputs + one pass recomputed", FORWARD
        )
    else:
        head = Term(
            "head activations", rows * per_row * passes, f"{shapes.passes} draft-layer passes", FORWARD
        )
    terms = [base, head]
    if shapes.attention_steps:
        scores = min(batch * shapes.attention_heads * tokens * tokens, CHUNK_SCORES)
        attention = batch * tokens * tokens * dtype_bytes + CHUNK_COPIES * scores * 4
        terms.append(Term("attention", attention, "causal mask + one query chunk's fp32 scores", FORWARD))
    table = rows * shapes.draft_vocab * dtype_bytes if shapes.attention_steps else 0
    chunk = CHUNK_COPIES * min(rows * shapes.draft_vocab, CHUNK_LOGITS) * 4
    how = f"target table ({shapes.draft_vocab} ids) + one chunk, fp32" if table else "one chunk, fp32"
    terms.append(Term("loss", table + chunk, how, FORWARD))
    return terms


def optimizer_step_terms(shapes: Shapes, dtype_bytes: int, stage: int, gpus: int, device: str):
    """What DeepSpeed's optimizer step allocates beside the held state: the gradient partition
    flattened and cast to fp32 for Adam, and on a CPU the temporaries of torch's multi-tensor
    AdamW (the square root of the second moment); CUDA runs the fused AdamW, which has none."""
    P = shapes.head_parameters
    shard = gpus if stage >= 1 else 1
    terms = []
    if stage >= 1 or dtype_bytes != 4:
        terms.append(Term("fp32 gradients", 4 * P / shard + P * dtype_bytes / shard, "flattened, cast", STEP))
    if device == "cpu":
        terms.append(Term("Adam temporaries", 4 * P / shard, "multi-tensor AdamW (CPU)", STEP))
    return terms


@dataclass(frozen=True)
class StepSettings:
    """What a plan takes from the run's training settings, as the training loop resolves them."""

    stage: int
    buckets: int  # reduce-bucket elements allocated in all
    dtype_bytes: int
    device: str


def step_settings(run, shapes: Shapes, gpus: int, device: str = "cuda") -> StepSettings:
    """The ZeRO stage, buckets and dtype of ``run`` on ``gpus`` GPUs of ``device``, from training's
    own functions (``draftheads.train.engine``): its precision rule and the DeepSpeed config it
    builds and fits."""
    from draftheads.train.engine import build_deepspeed_config, resolve_precision, with_buckets_fitted

    dtype = resolve_precision(run, torch.device(device))
    config = with_buckets_fitted(build_deepspeed_config(run.train, dtype, gpus), shapes.head_parameters)
    zero = config.get("zero_optimization", {})
    # DeepSpeed allocates each reduce bucket whole, two with overlap_comm.
    bucket = int(zero.get("reduce_bucket_size", DEFAULT_BUCKET))
    buckets = bucket * (2 if zero.get("overlap_comm", False) else 1)
    return StepSettings(int(zero.get("stage", 0)), buckets, dtype.itemsize, device)


def plan_step(
    run,
    shapes: Shapes,
    gpus: int,
    batch: int | None = None,
    tokens: int | None = None,
    device: str = "cuda",
    settings: StepSettings | None = None,
) -> StepPlan:
    """The plan of one training step of ``run`` (its micro-batch and max_length unless given) on
    ``device`` (``cpu`` to check a plan against a CPU run); ``settings``: ``step_settings``'s,
    when the caller plans several steps of one run."""
    settings = settings or step_settings(run, shapes, gpus, device)
    batch = batch or run.train.micro_batch_size
    tokens = tokens or run.data.max_length
    stage, width, offline = settings.stage, settings.dtype_bytes, bool(run.data.features)
    terms = state_terms(shapes, width, stage, gpus, offline, settings.buckets)
    recompute = run.train.gradient_checkpointing
    terms += activation_terms(shapes, batch, tokens, width, offline, run.train.loss_token_fraction, recompute)
    terms += optimizer_step_terms(shapes, width, stage, gpus, settings.device)
    return StepPlan(tuple(terms), batch, tokens, gpus, stage)


def largest_micro_batch(
    run, shapes: Shapes, gpus: int, memory_bytes: float, tokens: int | None = None, device: str = "cuda"
) -> int:
    """The largest micro-batch whose planned step fits ``memory_bytes`` (0: not even one row)."""
    settings = step_settings(run, shapes, gpus, device)
    fits = 0
    for batch in range(1, MAX_MICRO_BATCH + 1):
        if plan_step(run, shapes, gpus, batch=batch, tokens=tokens, settings=settings).total > memory_bytes:
            break
        fits = batch
    return fits


def cache_bytes_per_token(shapes: Shapes, storage_bytes: int = 2) -> int:
    """Feature-cache bytes a token: the cached states (bf16 by default), its id and the base's argmax."""
    return shapes.cached_states * shapes.hidden * storage_bytes + 8

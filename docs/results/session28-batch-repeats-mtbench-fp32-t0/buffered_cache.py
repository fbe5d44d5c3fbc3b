"""Appending in place against concatenating, on 16 MT-bench prompts x 128 tokens in one batch: HF
batched ``generate`` and the adaptive generator (the shipped head, context drafts), each timed with
transformers' ``DynamicLayer.update`` (a ``torch.cat`` per layer and step) and with a buffered update
swapped in (the first version of ``draftheads.infer.cache.BufferedLayer``), alternating, two
rounds; then a cProfile of ``generate`` each way.

It ran once, at commit d4167cb (before ``BufferedLayer`` was in the package: the decoder's cache
was then transformers' ``DynamicLayer``, so the swap applied to both methods). With the package as
it is now, the decoder always appends in place and only ``generate`` switches.

Run from the repository root:
    .venv/bin/python docs/results/session28-batch-repeats-mtbench-fp32-t0/buffered_cache.py
"""

import time, torch, cProfile, pstats, io, sys
from transformers.cache_utils import DynamicLayer
from draftheads.bench import HFMethod, SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator

orig = DynamicLayer.update
def grow_update(self, key_states, value_states, *args, **kwargs):
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)
    n = key_states.shape[-2]
    keys, buf = self.keys, getattr(self, "_kbuf", None)
    length = keys.shape[-2] if keys.dim() == 4 else 0
    fits = (buf is not None and keys.dim() == 4 and keys.data_ptr() == buf.data_ptr() and keys.shape[:2] == buf.shape[:2]
            and keys.stride() == buf.stride() and length + n <= buf.shape[2])
    if not fits:
        cap = max(2 * (length + n), length + n + 256)
        b, h, _, d = key_states.shape
        kb = key_states.new_empty(b, h, cap, d); vb = value_states.new_empty(b, h, cap, d)
        if length:
            kb[:, :, :length] = keys; vb[:, :, :length] = self.values
        self._kbuf, self._vbuf = kb, vb
    self._kbuf[:, :, length:length + n] = key_states
    self._vbuf[:, :, length:length + n] = value_states
    self.keys = self._kbuf[:, :, :length + n]
    self.values = self._vbuf[:, :, :length + n]
    return self.keys, self.values

g = SpeculativeGenerator.from_pretrained("docs/results/heads/eagle3-corpus-all-cached-cont2", dtype="float32")
prompts = build_prompts("mt-bench", g.tokenizer, 16)[:16]
plain = HFMethod("generate", g.model, g.tokenizer)
spec = SpeculativeMethod("speculative", g)
plain.run(prompts[:2], 8, 0.0, 0); spec.run(prompts[:2], 8, 0.0, 0)
ref = None
for rep in range(2):
    for name, patch in (("cat", orig), ("grow", grow_update)):
        DynamicLayer.update = patch
        for m in (plain, spec):
            t = time.perf_counter(); out = m.run(prompts, 128, 0.0, 0); dt = time.perf_counter() - t
            toks = [s.new_tokens for s in out]
            print(name, m.name, round(sum(toks)/dt, 1), "tok/s", flush=True)
for name, patch in (("cat", orig), ("grow", grow_update)):
    DynamicLayer.update = patch
    p = cProfile.Profile(); p.enable(); plain.run(prompts, 128, 0.0, 0); p.disable()
    s = io.StringIO(); pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(6); print(name, s.getvalue()[-1500:])

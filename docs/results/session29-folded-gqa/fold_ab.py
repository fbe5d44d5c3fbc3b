"""Folded grouped-query SDPA against transformers' SDPA, same head, same prompts, alternating."""
import sys, time, torch
from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator
HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont2"
def generator(fold):
    g = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32", context=False, adaptive=False)
    if not fold:
        g.model.set_attn_implementation("sdpa")
    return g
gens = {"folded": generator(True), "sdpa": generator(False)}
print({k: g.model.config._attn_implementation for k, g in gens.items()})
prompts = [p.input_ids[0] for p in build_prompts("mt-bench", gens["sdpa"].tokenizer, 8)]
for batch, tree in ((1, None), (4, "chain-2")):
    for g in gens.values():
        if tree: g.tree = __import__("draftheads.infer.tree", fromlist=["resolve_tree"]).resolve_tree(tree)
        g.generate(prompts[:batch] if batch > 1 else prompts[0], max_new_tokens=8)
    seqs = {}
    for rep in range(2):
        for name, g in gens.items():
            start, tokens = time.perf_counter(), 0
            out = []
            for i in range(0, len(prompts), batch):
                r = g.generate(prompts[i:i + batch] if batch > 1 else prompts[i], max_new_tokens=128)
                rs = r.results if batch > 1 else [r]
                tokens += sum(x.stats.new_tokens for x in rs); out += [x.sequences[0].tolist() for x in rs]
            seqs[name] = out
            print(f"B={batch} tree={tree or 'tuned'} {name} repeat {rep}: {tokens / (time.perf_counter() - start):.2f} tokens/s", flush=True)
    print("identical outputs:", seqs["folded"] == seqs["sdpa"])

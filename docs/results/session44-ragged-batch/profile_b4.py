"""cProfile of one pass of the first 16 MT-bench prompts at most four rows at once (the head's
tuned tree with context drafts, adaptive, fp32 packed), after one untimed pass: the draftheads
functions by cumulative time. Ran on the trial's code (ragged-rows.patch applied, so its
verification forwards are flat where the rows' trees differ; the drafting is the same code).

Run from the repository root: .venv/bin/python <this file>
"""

import cProfile
import io
import pstats

from draftheads.bench import SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator

generator = SpeculativeGenerator.from_pretrained("runs/s40/heads/cont4", dtype="float32")
prompts = build_prompts("mt-bench", generator.tokenizer, 16)
method = SpeculativeMethod("profile", generator)
method.run(prompts, 128, 0.0, 0, batch_size=4)
profile = cProfile.Profile()
profile.enable()
method.run(prompts, 128, 0.0, 0, batch_size=4)
profile.disable()
report = io.StringIO()
pstats.Stats(profile, stream=report).sort_stats("cumulative").print_stats("draftheads", 45)
print(report.getvalue())

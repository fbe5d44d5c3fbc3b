"""Training draft heads on a base model: the loop (``loop.run_training``), the recipes it drives
(``recipe``: frozen base; ``joint``: Medusa-2), batching, schedule, checkpoints and evaluation.
The ``draftheads train`` command is ``draftheads.commands.train``.

Nothing imports ``draftheads.train`` (heads and infer never do); deepspeed and wandb are imported
lazily inside the functions that need them.
"""

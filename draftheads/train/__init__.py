"""Training draft heads on a frozen base model: the loop (``loop.run_training``), batching,
schedule, checkpoints, evaluation and the ``draftheads train`` command.

Nothing imports ``draftheads.train`` (heads and infer never do); deepspeed and wandb are imported
lazily inside the functions that need them.
"""

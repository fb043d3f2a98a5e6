"""Training: the loop (``loop.py``: ``Trainer.train_step`` reads top to bottom), the update
(``update.py``: gradient sync, offload, clip, grouped apply, schedule), the loss (``loss.py``),
held-out evaluation, optimizer and schedule, metrics (tokens/s, TFLOP/s, MFU), loggers (console,
JSONL, W&B, TensorBoard), the banner, preemption, and the Stateful pieces a checkpoint holds
(``state.py``). Writing and reading them on disk is m6.checkpoint's job: this package calls it."""

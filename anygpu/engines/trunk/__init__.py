"""The run around the training step, shared by both engines (docs/architecture.md): when to log, evaluate,
save and stop (`schedule`), the evaluation (`evaluator`), the log records (`log`), the checkpoint's run
state (`state`), start-up (`startup`: checks, resume, banner, run files) and the end of the run (`finish`).
An engine owns only how a step is computed and how its state is written."""

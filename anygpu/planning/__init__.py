"""Before the run: the per-GPU memory plan and the automatic micro-batch."""

"""The training step around the model: optimizer and schedule, metrics and reporting."""

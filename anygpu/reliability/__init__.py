"""Staying alive and correct: preemption, start-up guards, the exit code of a job torchrun stopped on a signal."""

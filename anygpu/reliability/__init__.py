"""Staying alive and correct: preemption, start-up guards."""

"""Checkpoints: the store, the background store, manifests, the resume guard and the final export."""

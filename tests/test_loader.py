"""The step loader: DataLoader items are this rank's micro-batches of GlobalOrder's global batches,
from the resumed step on, whatever the world size, with the step's target-token count."""

import pytest
import torch
from datasets import Dataset

from anygpu.config.batch import plan_batch
from anygpu.data.collate import Collator, count_targets
from anygpu.data.loader import read_step, step_loader
from anygpu.data.order import GlobalOrder

N, G, SEED = 40, 6, 3  # 6 steps per epoch: the runs below cross into epochs 1 and 2
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def rows() -> Dataset:
    g = torch.Generator().manual_seed(0)
    ids, labels = [], []
    for i in range(N):
        x = torch.randint(5, 50, (4 + i % 7,), generator=g)
        ids.append(x.tolist())
        labels.append(x.masked_fill(x < 15, -100).tolist())  # masked targets are not counted
    return Dataset.from_dict({"input_ids": ids, "labels": labels})


@pytest.mark.parametrize("W,m", [(1, 1), (1, 3), (2, 1), (2, 3), (3, 2)])
@pytest.mark.parametrize("start", [0, 5])
def test_items_are_the_global_order_for_any_world_size_and_resume(rows, W, m, start):
    order, collator, end = GlobalOrder(N, G, SEED), Collator(pad_token_id=0), 14
    plan = plan_batch(G, W, per_device_train_batch_size=m)
    items = [list(step_loader(rows, collator, order, plan, r, start, end, CPU, num_workers=0)) for r in range(W)]
    for r in range(W):
        assert [it.step for it in items[r]] == list(range(start, end))  # a resume starts at its step, exactly
    for k in range(start, end):
        per_rank = [items[r][k - start] for r in range(W)]
        assert [i for it in per_rank for mb in it.indices for i in mb] == order.global_batch(k)
        for it in per_rank:
            assert len(it.micro_batches) == plan.gradient_accumulation_steps and all(len(mb) == m for mb in it.indices)
            for idx, batch in zip(it.indices, it.micro_batches):  # the tensors the Collator reads for those rows
                want = collator.read(rows, idx)
                assert batch.keys() == want.keys() and all(torch.equal(batch[key], want[key]) for key in want)
            assert it.num_targets.item() == sum(count_targets(b) for b in it.micro_batches) > 0


def test_a_worker_gives_the_inline_items_and_the_global_rng_stays(rows):
    order, collator, plan = (
        GlobalOrder(N, G, SEED),
        Collator(pad_token_id=0),
        plan_batch(G, 2, per_device_train_batch_size=1),
    )
    rng = torch.get_rng_state()
    got = list(step_loader(rows, collator, order, plan, 1, 2, 9, CPU, num_workers=1))
    assert torch.equal(rng, torch.get_rng_state())  # the loader's worker seed comes from its own generator
    for it in got:
        want = read_step(rows, collator, order, plan, 1, it.step)
        assert it.indices == want.indices and it.num_targets.item() == want.num_targets.item()
        assert all(torch.equal(a[k], b[k]) for a, b in zip(it.micro_batches, want.micro_batches) for k in a)
    assert [it.step for it in got] == list(range(2, 9))

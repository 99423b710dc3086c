"""The HF engine and the FSDP2 engine, given the same arguments, train the same model on the same
data: the same losses for 20 steps on 1 and on 2 processes. And the loss normalisation under
Trainer is the global-batch token mean even when ranks and micro-batches hold different numbers
of target tokens (which the packed corpus above never has)."""
from __future__ import annotations

import json
import textwrap

import pytest
from conftest import assert_close, losses, torchrun
from test_fsdp_engine import fsdp_reference
from test_hf_engine import hf_reference, records

pytestmark = pytest.mark.slow  # starts training processes

@pytest.mark.parametrize("nproc, every", [(1, 3), (2, 1)])
def test_same_losses_as_the_fsdp2_engine(nproc, every, tmp_path_factory):
    """1 process: 4 per device × 2 accumulation steps, logged every 3 steps (a logged loss is the
    logging step's own, not a mean since the last log); 2 processes: 2 × 2 × 2 (accumulation and
    gradient sync both exercised). Same keys in both engines' metrics.jsonl. (The runs: parity_args, in
    the shared launches of test_hf_engine.py and test_fsdp_engine.py.)"""
    hf_dir = hf_reference(tmp_path_factory)[0] / f"parity{nproc}"
    fsdp_dir = fsdp_reference(tmp_path_factory)[0] / f"parity{nproc}"
    hf, fsdp = losses(hf_dir), losses(fsdp_dir)
    assert sorted(hf) == sorted({*range(every, 21, every), 20})  # every `every` steps and the last
    assert hf[20] < hf[every] - 0.5  # it learns
    assert_close(fsdp, hf, rel=1e-4)
    hf_recs, fsdp_recs = records(hf_dir), records(fsdp_dir)
    assert [set(r) for r in hf_recs] == [set(r) for r in fsdp_recs]  # same records, same keys
    for a, b in zip(hf_recs, fsdp_recs):
        for key in ("learning_rate", "grad_norm", "eval_loss"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-12), (key, a, b)


LOSS_MATH = textwrap.dedent('''
    """Trainer's own loss path (num_items_in_batch + average_tokens_across_devices) on W gloo ranks
    with uneven target counts, against the global-batch token mean computed in one process."""
    import json, os, sys
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    W, A, m, T = int(os.environ["WORLD_SIZE"]), 2, 2, 16
    G = W * A * m
    args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, ddp_backend="gloo" if W > 1 else None,
                             report_to="none", per_device_train_batch_size=m, gradient_accumulation_steps=A,
                             average_tokens_across_devices=True)
    rank = args.process_index
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ref = LlamaForCausalLM(cfg)
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (G, T), generator=g)
    labels = ids.clone()
    for i in range(G):  # sequence i: its first 2*i + (i % 3) positions are not targets
        labels[i, : min(T - 2, 2 * i + i % 3)] = -100
    trainer = Trainer(model=model, args=args)
    ddp = trainer.accelerator.prepare(model)
    mine = range(rank * A * m, (rank + 1) * A * m)
    batches = [{"input_ids": ids[list(mine)][j * m:(j + 1) * m], "labels": labels[list(mine)][j * m:(j + 1) * m]}
               for j in range(A)]
    num_items = trainer._get_num_items_in_batch(batches, args.device)
    trainer.current_gradient_accumulation_steps = A
    reported = sum(trainer.training_step(ddp, b, num_items) for b in batches)
    logged = trainer.accelerator.gather(reported.reshape(1)).mean().item()  # what Trainer logs
    # reference: one process, the whole global batch, token-loss sum / target tokens
    out = ref(input_ids=ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 97)
    target = labels[:, 1:].reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum") / (target != -100).sum()
    loss.backward()
    diff = max((p.grad - q.grad).abs().max().item() / q.grad.abs().max().item()
               for p, q in zip(model.parameters(), ref.parameters()))
    counts = [(labels[list(range(r * A * m, (r + 1) * A * m))][:, 1:] != -100).sum().item() for r in range(W)]
    if rank == 0:
        print("RESULT " + json.dumps({"grad_rel_diff": diff, "logged": logged, "reference": loss.item(),
                                      "num_items": float(num_items), "targets": int((target != -100).sum()),
                                      "per_rank": counts}))
''')


@pytest.mark.parametrize("nproc", [1, 2])
def test_trainer_loss_is_the_global_batch_token_mean(nproc, tmp_path):
    script = tmp_path / "loss_math.py"
    script.write_text(LOSS_MATH)
    proc = torchrun(nproc, str(script), [str(tmp_path / "out")])
    res = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert len(set(res["per_rank"])) == nproc  # the ranks really hold different numbers of targets
    assert res["num_items"] == res["targets"]  # the count Trainer divides by covers the whole global batch
    assert res["logged"] == pytest.approx(res["reference"], rel=1e-6)
    assert res["grad_rel_diff"] < 1e-5, res

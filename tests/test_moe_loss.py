"""The MoE router loss is part of the training loss and does not depend on the micro-batch split: over
packed rows of unequal lengths (chat data) each row's real tokens count, not the padding that fills a
micro-batch to its widest row; and it works under a LoRA adapter (in one process; the 1/2/3-rank and
cross-engine runs are in test_sft.py)."""

import pytest
import torch
from transformers import AutoConfig

from anygpu.config.args import ModelArguments
from anygpu.data.collate import Collator
from anygpu.model import lora, modeling, moe

MIXTRAL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=0.1,
    pad_token_id=0,
)
QWEN2_MOE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=0.1,
    pad_token_id=0,
)


def test_router_loss_is_a_global_batch_mean():
    config = AutoConfig.for_model("mixtral", **MIXTRAL)
    model = modeling.build_full_model(config, ModelArguments(), seed=1)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    n = torch.tensor(4.0 * 15)  # target tokens of the whole batch
    with torch.no_grad():
        cross_entropy = model(input_ids=ids, labels=ids, num_items_in_batch=n, **moe.eval_kwargs(model)).loss
        whole = moe.global_batch_loss(
            model, model(input_ids=ids, labels=ids, num_items_in_batch=n), {"input_ids": ids}, 4
        )
        halves = sum(
            moe.global_batch_loss(
                model,
                model(input_ids=ids[i : i + 2], labels=ids[i : i + 2], num_items_in_batch=n),
                {"input_ids": ids[i : i + 2]},
                4,
            )
            for i in (0, 2)
        )
        per_micro_batch = sum(
            model(input_ids=ids[i : i + 2], labels=ids[i : i + 2], num_items_in_batch=n).loss for i in (0, 2)
        )
    assert whole > cross_entropy + 0.05  # coef 0.1 × an aux loss ≥ 1 (its value under perfect balance)
    assert torch.allclose(whole, halves, rtol=1e-6)
    assert not torch.allclose(per_micro_batch, whole, rtol=1e-3)  # what transformers' own loss would sum to


def packed_rows() -> list[dict[str, list[int]]]:
    """Four packed rows of 1-3 samples each, 9 to 40 tokens long, as `pack_samples` writes them."""
    gen = torch.Generator().manual_seed(3)
    rows = []
    for lengths in ([9], [12, 8, 20], [40], [5, 14]):
        ids, labels, pos = [], [], []
        for n in lengths:
            x = torch.randint(3, 128, (n,), generator=gen).tolist()
            ids += x
            labels += [-100] * (n // 2) + x[n // 2 :]  # a prompt, then the completion
            pos += list(range(n))
        rows.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return rows


def step_loss(model, rows, micro_batch: int) -> torch.Tensor:
    """The global-batch loss of `rows` as the engines sum it over micro-batches of `micro_batch` rows."""
    collator = Collator(pad_token_id=0, packed=True)
    batches = [collator(rows[i : i + micro_batch]) for i in range(0, len(rows), micro_batch)]
    n = torch.tensor(float(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)))
    return sum(moe.global_batch_loss(model, model(**b, num_items_in_batch=n), b, len(rows)) for b in batches)


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_router_loss_of_packed_rows_ignores_padding(peft, tmp_path):
    """Unequal rows padded to each micro-batch's widest: micro-batches of 4, 2 and 1 rows give one loss (Qwen2-MoE,
    shared expert); under LoRA with the engines' default targets too."""
    config = AutoConfig.for_model("qwen2_moe", **QWEN2_MOE)
    model = modeling.build_full_model(config, ModelArguments(), seed=1)
    if peft:
        model = lora.wrap(model, ModelArguments(model_name_or_path=str(tmp_path), use_peft=True, lora_r=4))
        lora.init_adapter(model, seed=1)
    rows = packed_rows()
    with torch.no_grad():
        losses = [step_loss(model, rows, m) for m in (4, 2, 1)]
        bare = model(
            **Collator(pad_token_id=0, packed=True)(rows),
            num_items_in_batch=torch.tensor(1.0),
            **moe.eval_kwargs(model),
        )
    assert moe.aux_loss_coef(model) == 0.1 and bare.aux_loss is None  # the router loss is on, and only in training
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(losses[2], losses[0], rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "model_type,config,said",
    [
        ("phimoe", {}, "the router samples its experts in training (sparsemixer), drawn from each rank's generator"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise 0.1 multiplies its inputs by noise"),
        ("mixtral", {}, None),
        ("qwen3_moe", {}, None),
    ],
)
def test_a_router_that_draws_random_numbers_is_said_to_depend_on_the_ranks(model_type, config, said):
    """PhiMoE's router samples (sparsemixer) and Mixtral's jitter multiplies by noise, both from each rank's own
    generator: measured, PhiMoE's 1- and 2-rank curves differ by 4e-6 in the loss. The banner says so."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from anygpu.model import moe

    small = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=4, num_experts=4, num_experts_per_tok=2)  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **small, **config))
    note = moe.random_router_note(model)
    assert note == said if said is None else said in note, note
    if model_type == "mixtral" and said:
        assert "set it to 0 in the config" in note

"""The MoE router loss is part of the training loss and does not depend on the micro-batch split."""
import torch
from transformers import AutoConfig

from anygpu.config.args import ModelArguments
from anygpu.model import modeling, moe


def test_router_loss_is_a_global_batch_mean():
    config = AutoConfig.for_model("mixtral", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                  output_router_logits=True, router_aux_loss_coef=0.1, pad_token_id=0)
    model = modeling.build_full_model(config, ModelArguments(), seed=1)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    n = torch.tensor(4.0 * 15)  # target tokens of the whole batch
    with torch.no_grad():
        cross_entropy = model(input_ids=ids, labels=ids, num_items_in_batch=n, **moe.eval_kwargs(model)).loss
        whole = moe.global_batch_loss(model, model(input_ids=ids, labels=ids, num_items_in_batch=n), 4, 4)
        halves = sum(moe.global_batch_loss(model, model(input_ids=ids[i:i + 2], labels=ids[i:i + 2], num_items_in_batch=n), 2, 4)
                     for i in (0, 2))
        per_micro_batch = sum(model(input_ids=ids[i:i + 2], labels=ids[i:i + 2], num_items_in_batch=n).loss for i in (0, 2))
    assert whole > cross_entropy + 0.05  # coef 0.1 × an aux loss ≥ 1 (its value under perfect balance)
    assert torch.allclose(whole, halves, rtol=1e-6)
    assert not torch.allclose(per_micro_batch, whole, rtol=1e-3)  # what transformers' own loss would sum to

"""--lr_scheduler_type's schedules (`anygpu.train.schedules`, written to spare the native engine transformers'
peft import) against transformers' `get_scheduler`: the same learning rate at every step, every type, with and
without warm-up, warm-up as long as the run, and through a state_dict round trip mid-run."""

from __future__ import annotations

import pytest
import torch
from transformers import get_scheduler

from anygpu.config.args import SCHEDULERS
from anygpu.train import schedules


def lrs(make, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("warmup, total", [(0, 7), (3, 20), (10, 10), (1, 1)])
def test_every_step_is_transformers(name, warmup, total):
    ours = lrs(lambda o: schedules.build(name, o, warmup, total), total + 2)
    theirs = lrs(lambda o: get_scheduler(name, o, num_warmup_steps=warmup, num_training_steps=total), total + 2)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("name", SCHEDULERS)
def test_a_warmup_longer_than_the_run_climbs_as_transformers_climbs(name, tmp_path):
    """--warmup_steps 10 over a 5-step run: the rate climbs by a tenth a step, as Trainer's (it was squeezed into the
    run: a fifth a step, the loss 2.8e-3 off Trainer's after 5 steps)."""
    from anygpu.config.args import parse_args
    from anygpu.train import optim

    train_args = parse_args(["--config_name", "tiny", "--warmup_steps", "10", "--lr_scheduler_type", name,
                             "--output_dir", str(tmp_path)], warn=False)[2]  # fmt: skip
    ours = lrs(lambda o: optim.build_scheduler(o, train_args, 5), 6)
    theirs = lrs(lambda o: get_scheduler(name, o, num_warmup_steps=10, num_training_steps=5), 6)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=0.0)


def test_a_resumed_schedule_continues_where_it_stopped():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    first = schedules.build("cosine", opt, 2, 10)
    for _ in range(4):
        opt.step()
        first.step()
    again = schedules.build("cosine", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 2, 10)
    again.load_state_dict(first.state_dict())
    assert again.get_last_lr() == first.get_last_lr() and again.last_epoch == 4


def test_weight_decay_takes_the_matrices_also_as_zero3_partitions_them():
    """Matrices decay, biases and norm weights do not; a parameter ZeRO-3 has partitioned is an empty 1-D placeholder
    with its shape in `ds_shape` (DeepSpeed's), and it once went to the no-decay group: no weight decay under ZeRO-3."""
    from torch import nn

    from anygpu.train import optim

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    for p in model.parameters():  # as deepspeed.zero.Init leaves them
        p.ds_shape, p.data = p.shape, torch.empty(0)
    decay, no_decay = optim.param_groups(model, 0.1)
    assert [tuple(p.ds_shape) for p in decay["params"]] == [(4, 4)] and decay["weight_decay"] == 0.1
    assert [tuple(p.ds_shape) for p in no_decay["params"]] == [(4,), (4,), (4,)] and no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss", "mamba", "recurrent_gemma", "gemma2", "gpt2"])
def test_weight_decay_takes_the_parameters_trainer_takes(model_type):
    """Trainer's rule (`get_decay_parameter_names`: names without bias/norm, outside nn.LayerNorm), not "every
    matrix": gpt-oss's expert biases are 2-D and its attention sinks 1-D, Mamba's D and A_log 1-D parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer

    from anygpu.train import optim

    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape))
    by_name = dict(model.named_parameters(remove_duplicate=False))
    trainers = {id(by_name[n]) for n in Trainer.get_decay_parameter_names(None, model)}
    decay, no_decay = optim.param_groups(model, 0.1)
    assert {id(p) for p in decay["params"]} == trainers
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_a_warmup_longer_than_an_epoch_based_run_is_warned(tmp_path, capsys):
    """The warning --max_steps gets (the rate never reaches its peak) also where the steps come from
    --num_train_epochs: the default 10 warm-up steps over a 4-step run said nothing."""
    from conftest import TINY

    from anygpu.config.args import parse_args
    from anygpu.data.prepare import prepare
    from anygpu.runtime.distributed import DistInfo

    argv = [*TINY, "--num_train_epochs", "0.01", "--warmup_steps", "10", "--output_dir", str(tmp_path)]
    prep = prepare(*parse_args(argv, warn=False)[:3], DistInfo(0, 0, 1, torch.device("cpu")))
    assert prep.total_steps < 10
    err = capsys.readouterr().err
    assert f"warning: --warmup_steps 10 is more than the run's {prep.total_steps} steps" in err, err[-2000:]

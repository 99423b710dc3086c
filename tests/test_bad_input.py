"""Bad input is refused up front, with the argument, the value and a valid alternative."""

import json

import pytest
from conftest import prompt_completion_file, TINY

from anygpu.config.args import parse_args
from anygpu.engines.fsdp import main


def refuse(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def test_missing_train_file(capsys, tmp_path):
    err = refuse([*TINY, "--train_file", str(tmp_path / "nope.txt"), "--output_dir", str(tmp_path)], capsys)
    assert "--train_file" in err and "nope.txt" in err and ".jsonl" in err


def test_block_size_above_max_positions(capsys, tmp_path):
    err = refuse([*TINY, "--block_size", "4096", "--output_dir", str(tmp_path)], capsys)
    assert "--block_size 4096" in err and "maximum positions (512)" in err and "--block_size 512" in err


def test_unknown_preset(capsys, tmp_path):
    err = refuse(["--config_name", "huge", "--output_dir", str(tmp_path)], capsys)
    assert "--config_name 'huge'" in err and "tiny" in err and "default" in err


def test_unwritable_output_dir(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    err = refuse([*TINY, "--output_dir", str(blocker / "run")], capsys)
    assert f"--output_dir {blocker / 'run'} cannot be written" in err and "writable folder" in err


def test_conflicting_batch_arguments(capsys, tmp_path):
    err = refuse(
        [
            *TINY,
            "--per_device_train_batch_size",
            "2",
            "--gradient_accumulation_steps",
            "3",
            "--output_dir",
            str(tmp_path),
        ],
        capsys,
    )
    assert "--gradient_accumulation_steps 3" in err and "--global_batch_size 8" in err and "set it to 4" in err
    err = refuse([*TINY, "--global_batch_tokens", "512", "--output_dir", str(tmp_path)], capsys)
    assert "--global_batch_size 8 and --global_batch_tokens 512" in err


def test_a_bad_boolean_is_one_sentence(capsys, tmp_path):
    err = refuse([*TINY, "--bf16", "maybe", "--output_dir", str(tmp_path)], capsys)
    assert "--bf16: Truthy value expected: got maybe" in err and ".." not in err


@pytest.mark.parametrize("split", ["train", "validation"])
def test_data_with_no_target_within_the_block_is_refused_by_name(capsys, tmp_path, split):
    """Every prompt longer than --block_size: no sample keeps a target token, so the split is empty. It was an
    IndexError traceback from datasets (and an empty split cached, so a retry failed the same way)."""
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"prompt": "w " * 200, "completion": " end"}) + "\n" for _ in range(20)))
    files = {"train": long, "validation": prompt_completion_file(tmp_path / "ok.jsonl", 40)}
    if split == "validation":
        files = {"train": files["validation"], "validation": long}
    argv = [*TINY, "--train_file", str(files["train"]), "--validation_file", str(files["validation"])]
    with pytest.raises(SystemExit) as e:  # datasets' progress bars come before the line: not refuse()'s first line
        main([*argv, "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert f"error: the {split} data ({files[split].name}) has no sample with a target token within --block_size" in err


def test_unknown_option_and_bad_choice(capsys, tmp_path):
    err = refuse([*TINY, "--learning_rat", "1", "--output_dir", str(tmp_path)], capsys)
    assert "unknown option --learning_rat (did you mean --learning_rate?)" in err
    assert "cosine" in refuse([*TINY, "--lr_scheduler_type", "cosin", "--output_dir", str(tmp_path)], capsys)
    err = refuse([*TINY, "--export_dtype", "bf16", "--output_dir", str(tmp_path)], capsys)
    assert "--export_dtype 'bf16' is unknown: use one of auto, float32, bfloat16, float16." in err
    err = refuse([*TINY, "--save_max_shard_size", "5 gigs", "--output_dir", str(tmp_path)], capsys)
    assert "--save_max_shard_size '5 gigs' is not a size: use digits and a unit, e.g. 5GB or 500MB." in err
    err = refuse([*TINY, "--save_strategy", "epoch", "--output_dir", str(tmp_path)], capsys)
    assert "--save_strategy 'epoch' is unknown: use one of steps, no." in err
    err = refuse([*TINY, "--save_strategy", "no", "--save_steps", "5", "--output_dir", str(tmp_path)], capsys)
    assert "--save_steps 5 with --save_strategy no: no checkpoint is written; leave --save_steps out" in err
    # a run cut at step 2 to continue later, with nothing to continue from (it ended 0, its work gone)
    err = refuse([*TINY, "--save_strategy", "no", "--stop_at_step", "2", "--output_dir", str(tmp_path)], capsys)
    assert "--stop_at_step 2 with --save_strategy no: no checkpoint is written" in err


@pytest.mark.parametrize("name", ["model_name_or_path", "tokenizer_name", "train_file", "dataset_name", "output_dir"])
def test_an_empty_value_is_refused_before_any_work(capsys, tmp_path, name):
    """`--model_name_or_path ""` (an unset shell variable) read as "no model" trained a tokenizer and read the data
    before failing on a folder named ''."""
    argv = [*TINY, "--output_dir", str(tmp_path)] if name != "output_dir" else list(TINY)
    err = refuse([*argv, f"--{name}", ""], capsys)
    assert f"--{name} '' is empty: give a value, or leave --{name} out" in err


def test_world_size_that_cannot_split_the_global_batch(capsys, tmp_path, monkeypatch):
    # what torchrun --nproc-per-node 3 sets; the refusal comes before any process group exists
    monkeypatch.setenv("WORLD_SIZE", "3")
    err = refuse([*TINY, "--output_dir", str(tmp_path)], capsys)
    assert "--global_batch_size 8 cannot be split evenly over 3 devices" in err and "6 or 9" in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_config_file_with_command_line_override(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("config_name: tiny\nlearning_rate: 0.01\nbf16: true\nreport_to: [none]\n")
    m, d, t = parse_args([str(cfg), "--learning_rate", "0.5"])
    assert (m.config_name, t.learning_rate, t.bf16, t.report_to) == (
        "tiny",
        0.5,
        True,
        ["none"],
    )  # read by trackers.resolve
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"block_size": 32, "nonsense": 1}))
    with pytest.raises(ValueError, match="unknown option.*--nonsense"):
        parse_args([str(js)])


def test_config_file_extension_in_any_case_and_its_place(tmp_path):
    """A config file named run.YAML is read as run.yaml is; one given after options is refused with where it goes,
    not as an unknown option."""
    cfg = tmp_path / "run.YAML"
    cfg.write_text("config_name: tiny\nlearning_rate: 0.01\n")
    assert parse_args([str(cfg)])[2].learning_rate == 0.01
    with pytest.raises(ValueError, match=r"run\.YAML.*a config file must be the first argument"):
        parse_args(["--learning_rate", "0.5", str(cfg)])


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--use_peft", "true"], "--use_peft true needs --model_name_or_path"),
        (["--lora_r", "0"], "--lora_r 0 must be at least 1"),
        (["--lora_dropout", "1.5"], "--lora_dropout 1.5 must be in [0, 1)"),
        (["--merge_lora", "true"], "--merge_lora true needs --use_peft true"),
    ],
)
def test_lora_options(capsys, tmp_path, extra, expected):
    err = refuse([*TINY, *extra, "--output_dir", str(tmp_path)], capsys)
    assert expected in err


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--model_name_or_path", "anygpu-test/not-cached"],
            [
                "--model_name_or_path anygpu-test/not-cached",
                "not in the Hugging Face cache",
                "hf download anygpu-test/not-cached",
                "HF_HUB_OFFLINE",
            ],
        ),
        (["--model_name_or_path", "./no/such/model"], ["--model_name_or_path ./no/such/model: no such file or folder"]),
        (["--config_name", "anygpu-test/no-config"], ["--config_name anygpu-test/no-config", "local folder"]),
        (
            ["--tokenizer_name", "./no-tokenizer"],
            ["--tokenizer_name ./no-tokenizer: no such file or folder", "tokenizer folder"],
        ),
        (
            ["--dataset_name", "anygpu-test/no-data"],
            [
                "--dataset_name anygpu-test/no-data",
                "hf download --repo-type dataset anygpu-test/no-data",
                "--train_file",
            ],
        ),
    ],
)
def test_models_and_data_that_are_not_there(capsys, tmp_path, monkeypatch, extra, expected):
    """One line naming the argument, what was looked for and what to do; exit 2, no folder left behind."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    err = refuse([*TINY, *extra, "--output_dir", str(tmp_path / "run")], capsys)
    assert err.count("\n") == 1 and all(e in err for e in expected), err
    assert not (tmp_path / "run").exists()


def test_a_refused_run_leaves_no_empty_output_folder(capsys, tmp_path):
    # refused after the output folder was claimed (the FSDP2 engine has no fp16): the folder it made goes again
    err = refuse([*TINY, "--fp16", "true", "--output_dir", str(tmp_path / "new" / "run")], capsys)
    assert "--fp16" in err
    assert not (tmp_path / "new").exists()


def test_list_options_take_the_comma_form():
    m, _, t = parse_args(
        [
            "--config_name",
            "tiny",
            "--lora_target_modules",
            "q_proj,v_proj",
            "--lora_modules_to_save",
            "lm_head",
            "--report_to",
            "tensorboard,none",
        ]
    )
    assert m.lora_target_modules == ["q_proj", "v_proj"] and m.lora_modules_to_save == ["lm_head"]
    assert t.report_to == ["tensorboard", "none"]


def test_a_lora_target_the_model_lacks_names_its_linear_modules():
    from types import SimpleNamespace

    from anygpu.errors import UsageError
    from anygpu.model import lora, modeling

    margs = parse_args(["--config_name", "tiny"])[0]
    model = modeling.build_meta_model(modeling.resolve_config(margs), margs)
    args = SimpleNamespace(
        use_peft=True,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        lora_modules_to_save=None,
        lora_target_modules=["q_proj", "qkv"],
    )
    with pytest.raises(UsageError) as e:
        lora.wrap(model, args)
    message = str(e.value)
    assert message.startswith("--lora_target_modules qkv: the model has no such module. Its linear modules: ")
    named = message.split("Its linear modules: ")[1].split(" ")[0].split(",")
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj"} <= set(named) and "lm_head" not in named
    args.lora_target_modules = ["q_proj", "v_proj"]
    assert lora.is_peft(lora.wrap(model, args))


def test_warmup_longer_than_the_run_is_warned(capsys):
    parse_args(["--config_name", "tiny", "--max_steps", "5", "--warmup_steps", "10"])
    err = capsys.readouterr().err
    assert "--warmup_steps 10 is more than --max_steps 5" in err and err.count("\n") == 1


def test_a_tokenizer_smaller_than_asked_says_so(capsys, tmp_path):
    from anygpu.data import tokenizer

    tok = tokenizer.load_or_train(
        None, lambda: ["a tiny corpus, a tiny corpus"] * 20, "fp-small", 1000, str(tmp_path), True
    )
    out = capsys.readouterr().out
    assert f"has {len(tok)} tokens, fewer than --vocab_size 1000" in out and out.count("\n") == 1


def test_half_precision_under_deepspeed_without_a_gpu_is_refused_by_name(monkeypatch):
    """Trainer refuses bf16 on a CPU unless use_cpu, which DeepSpeed's CPU accelerator leaves off: a traceback from
    transformers at start-up before; now a line naming the flag and what runs bf16 on a CPU."""
    from anygpu.config.args import HFEngineArguments, parse_args
    from anygpu.engines.hf import engine
    from anygpu.errors import UsageError

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    model_args, _, train_args = parse_args([*TINY, "--bf16", "true"])
    with pytest.raises(UsageError, match=r"--bf16 true with DeepSpeed ZeRO-3 .* on this machine \(no GPU\)"):
        engine.refuse_early(model_args, train_args, HFEngineArguments())
    model_args, _, train_args = parse_args(TINY)
    assert engine.refuse_early(model_args, train_args, HFEngineArguments()).kind == "deepspeed"  # fp32: runs


def test_loader_workers_are_the_native_engines(capsys, tmp_path):
    """--dataloader_num_workers: a count of 0 or more; the HF engine reads inline and refuses a non-zero count."""
    from anygpu.config.args import HFEngineArguments
    from anygpu.engines.hf import engine
    from anygpu.errors import UsageError

    err = refuse([*TINY, "--dataloader_num_workers", "-1", "--output_dir", str(tmp_path)], capsys)
    assert "--dataloader_num_workers -1" in err
    model_args, _, train_args = parse_args([*TINY, "--dataloader_num_workers", "2"])
    assert train_args.dataloader_num_workers == 2
    with pytest.raises(UsageError, match=r"^--dataloader_num_workers 2: the HF engine reads each micro-batch inline"):
        engine.refuse_early(model_args, train_args, HFEngineArguments())


def test_a_tokenizer_larger_than_the_vocabulary_is_named_not_an_option_never_given():
    """A model folder whose own tokenizer outgrows its embeddings (a Qwen2 tokenizer adds <|endoftext|>): the line
    names that tokenizer, not --tokenizer_name, which the run never gave."""
    from transformers import LlamaConfig

    from anygpu.errors import UsageError
    from anygpu.model import modeling
    from tiny_llm import word_tokenizer

    tok = word_tokenizer(12)
    tok.name_or_path = "models/qwen"
    with pytest.raises(UsageError, match=r"^the tokenizer of models/qwen has 12 tokens .* vocabulary is 10: give a"):
        modeling.fit_config_to_tokenizer(LlamaConfig(vocab_size=10), tok, from_scratch=False)


def test_a_dataset_name_that_is_no_data_set_or_lacks_its_config_is_refused_in_one_line(capsys, tmp_path):
    """A local folder laid out as a Hub data set with two configs: an unknown config, or none, is named with the
    ones there are; a file, or a folder without data files, points to what --dataset_name takes (tracebacks
    before)."""
    import pandas as pd

    hub = tmp_path / "hub"
    for config in ("en", "fr"):
        (hub / config).mkdir(parents=True)
        pd.DataFrame({"text": ["the sky is blue"] * 8}).to_parquet(hub / config / "train-00000-of-00001.parquet")
    (hub / "README.md").write_text(
        "---\nconfigs:\n" + "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n"
                                   for c in ("en", "fr")) + "---\n"
    )  # fmt: skip
    (tmp_path / "empty").mkdir()
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": "the sky"}) + "\n")
    base = [*TINY, "--output_dir", str(tmp_path / "run"), "--data_cache_dir", str(tmp_path / "cache")]
    cases = {
        ("--dataset_name", str(hub), "--dataset_config_name", "de"): "--dataset_config_name de with --dataset_name",
        ("--dataset_name", str(hub)): "Config name is missing",
        ("--dataset_name", str(tmp_path / "rows.jsonl")): "is a file: give it with --train_file",
        ("--dataset_name", str(tmp_path / "empty")): "no data set there (EmptyDatasetError",
    }
    for extra, says in cases.items():
        err = refuse([*base, *extra], capsys)
        assert says in err and err.count("\n") == 1, err
    assert "Available: ['en', 'fr']" in refuse(
        [*base, "--dataset_name", str(hub), "--dataset_config_name", "de"], capsys
    )


def test_a_tiny_max_corpus_mb_still_trains_on_a_file_and_validates_on_another():
    """--max_corpus_mb below the first file of the embedded corpus (an IndexError before): one file each."""
    from anygpu.data.sources import stdlib_corpus

    rows = stdlib_corpus(10.0, max_mb=0.000001)
    assert len(rows["train"]) == 1 and len(rows["validation"]) == 1

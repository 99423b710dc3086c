"""--objective grpo's prompt rows in one process, nothing launched: text and conversational prompts tokenised as TRL
does (the chat template with its generation prompt), left truncation counted, the other columns kept for the rewards,
the embedded default's prompts, prepare() end to end (the prompt order and steps), and each refusal naming its
argument."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict

from anygpu.config.args import parse_args
from anygpu.data import prompts
from anygpu.data import tokenizer as tok_lib
from anygpu.data.prepare import check_run, prepare
from anygpu.errors import UsageError
from anygpu.runtime.distributed import DistInfo

WORDS = "the sky is blue green red cat dog runs fast slow why how what colour answer".split()
CHATML = (  # a template of its own with a generation prompt, as shipped tokenizers have (dpo_data's chatml)
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CPU = DistInfo(0, 0, 1, torch.device("cpu"))
FITS = ("--config_name", "tiny", "--max_prompt_length", "64", "--max_completion_length", "64")  # within its 512


@pytest.fixture(scope="module")
def tok():
    return tok_lib.train_bpe(iter(WORDS * 20 + ["system user assistant be brief im_start im_end"]), 400)


def sentence(i: int, n: int = 6) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


def text_rows(n: int) -> list[dict]:
    return [{"prompt": sentence(i), "solution": str(i), "id": i} for i in range(n)]


def chat_rows(n: int) -> list[dict]:
    return [
        {
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": sentence(i)}],
            "solution": str(i),
        }
        for i in range(n)
    ]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def args(*argv: str):
    return parse_args(["--objective", "grpo", "--reward_funcs", "format", *argv])


def test_text_prompts_keep_their_columns_for_the_rewards(tmp_path, tok):
    train = write(tmp_path / "train.jsonl", text_rows(12))
    _, d, _ = args("--train_file", str(train), "--validation_split_percentage", "25")
    raw, is_default = prompts.load_prompts(d)
    rows = prompts.make_prompts(raw, tok, d, max_prompt_length=64)
    assert not is_default and not rows.conversational and len(rows.train) + len(rows.validation) == 12
    assert rows.columns == ["solution", "id"] and rows.truncated == 0
    batch = rows.batch([0, 1])
    for ids, prompt, solution, i in zip(
        batch.prompt_ids, batch.prompts, batch.columns["solution"], batch.columns["id"]
    ):
        assert prompt == sentence(i) and solution == str(i)  # the row's own values, by name
        assert ids == tok(prompt)["input_ids"]  # the tokenizer's own specials, as TRL and the DPO prompts
    prompts_k, columns_k = batch.per_completion(3)  # each row once per completion, consecutively (TRL's order)
    assert prompts_k == [batch.prompts[0]] * 3 + [batch.prompts[1]] * 3 and columns_k["id"][2:4] == batch.columns["id"]
    assert rows.describe()[0].startswith(f"data: {len(rows.train)} train / {len(rows.validation)} eval prompts (text)")
    assert "reward columns: solution, id" in rows.describe()[0]


def test_conversational_prompts_end_with_the_generation_prompt(tmp_path, tok):
    tok = tok_lib.train_bpe(iter(WORDS * 20), 400)
    tok.chat_template = CHATML
    train, val = write(tmp_path / "t.jsonl", chat_rows(6)), write(tmp_path / "v.jsonl", chat_rows(2))
    _, d, _ = args("--train_file", str(train), "--validation_file", str(val))
    rows = prompts.make_prompts(prompts.load_prompts(d)[0], tok, d, max_prompt_length=256)
    assert rows.conversational and len(rows.train) == 6 and len(rows.validation) == 2 and not rows.default_template
    batch = rows.batch([0], "validation")
    assert batch.prompts[0] == chat_rows(2)[0]["prompt"]  # the message list as given: what TRL passes as prompts
    text = tok.decode(batch.prompt_ids[0])
    assert text.startswith("<|im_start|>system\nbe brief") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert batch.prompt_ids[0] == tok.apply_chat_template(batch.prompts[0], add_generation_prompt=True)["input_ids"]
    # a tokenizer without a template gets anygpu's default, and the banner says so
    plain = tok_lib.train_bpe(iter(WORDS * 20), 400)
    rows = prompts.make_prompts(prompts.load_prompts(d)[0], plain, d, max_prompt_length=256)
    assert rows.default_template and any("chat template" in line for line in rows.describe())
    assert plain.decode(rows.batch([0]).prompt_ids[0]).endswith("<|im_start|>assistant\n")


def test_left_truncation_keeps_the_last_tokens_and_is_counted(tok):
    long = " ".join(WORDS * 3)
    raw = DatasetDict(
        train=Dataset.from_dict({"prompt": [long, "the sky", long, "red cat"]}),
        validation=Dataset.from_dict({"prompt": [long]}),
    )
    _, d, _ = args()
    full = tok(long)["input_ids"]
    rows = prompts.make_prompts(raw, tok, d, max_prompt_length=10)
    assert len(full) > 10 and rows.train["prompt_ids"][0] == full[-10:]  # the end: what the completion follows
    assert rows.train["prompt_ids"][1] == tok("the sky")["input_ids"]
    assert rows.stats["train"].truncated == 2 and rows.stats["validation"].truncated == 1 and rows.truncated == 3
    assert "3 truncated to --max_prompt_length 10" in rows.describe()[0]


def test_refusals_name_the_data_and_the_argument(tmp_path, tok):
    msgs = write(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 4)
    with pytest.raises(UsageError, match=r"--train_file .*m.jsonl has a 'messages' column but no 'prompt' column"):
        check_run(*args("--train_file", str(msgs), *FITS), 1)
    txt = tmp_path / "a.txt"
    txt.write_text("some raw text\nmore raw text\n")
    with pytest.raises(
        UsageError, match=r"--train_file .*a.txt \(raw text\) has no 'prompt' column \(its columns: \['text'\]\)"
    ):
        check_run(*args("--train_file", str(txt), *FITS), 1)
    with pytest.raises(UsageError, match="--dataset_mixture with --objective grpo"):
        prompts.check_source(args("--dataset_mixture", json.dumps({"datasets": [{"name": "a", "path": str(txt)}]}))[1])
    with pytest.raises(UsageError, match="--global_batch_tokens 4096 with --objective grpo"):
        check_run(*args("--global_batch_tokens", "4096", "--config_name", "tiny"), 1)
    with pytest.raises(
        UsageError, match=r"--max_prompt_length 512 \+ --max_completion_length 512 = 1024 tokens exceed the model's "
        r"512 positions.*--max_prompt_length 128 --max_completion_length 384"
    ):  # fmt: skip
        check_run(*args("--config_name", "tiny"), 1)
    per_device = ("--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "1")  # G follows: 3
    with pytest.raises(UsageError, match="a global batch of 3 completions is not whole groups of --num_generations 8"):
        check_run(*args(*FITS, *per_device), 1)
    with pytest.raises(UsageError, match="not whole groups of --num_generations 8: give --global_batch_size, e.g. 24"):
        check_run(*args(*FITS, *per_device), 3)  # 3 devices × 3: a value that splits over them in whole groups
    empty = write(tmp_path / "e.jsonl", [{"prompt": "the sky"}, {"prompt": ""}, {"prompt": "a cat"}] * 4)
    _, d, _ = args("--train_file", str(empty))
    with pytest.raises(UsageError, match=r"--train_file .*e.jsonl \(train split\), row \d+ \(\"\"\): an empty prompt"):
        prompts.make_prompts(prompts.load_prompts(d)[0], tok, d, 64)
    mixed = DatasetDict(
        train=Dataset.from_dict({"prompt": ["the sky", "a cat"]}), validation=Dataset.from_list(chat_rows(1))
    )
    with pytest.raises(
        UsageError, match=r"\(validation split\) holds message lists as prompts, the training split strings"
    ):
        prompts.make_prompts(mixed, tok, args()[1], 64)


def test_prompt_only_data_keeps_its_errors_under_the_other_objectives(tmp_path):
    """--objective lm with prompt-only rows (no completion) is refused as before, by the format detection."""
    train = write(tmp_path / "p.jsonl", text_rows(8))
    m, d, t = parse_args(["--train_file", str(train), "--config_name", "tiny", "--output_dir", str(tmp_path / "o")])
    with pytest.raises(UsageError, match=r"--text_column 'text' is not a column of .*'prompt' and 'completion'"):
        check_run(m, d, t, 1)


def test_the_embedded_default_gives_the_same_short_prompts_every_time(tok):
    _, d, _ = args()
    raw = prompts.default_prompts(d)
    assert raw["train"]["prompt"] == prompts.default_prompts(d)["train"]["prompt"]
    assert len(raw["train"]) == prompts.DEFAULT_TRAIN and len(raw["validation"]) == prompts.DEFAULT_EVAL
    assert not set(raw["train"]["prompt"]) & set(raw["validation"]["prompt"])
    assert all(
        p.startswith("def ") and p.endswith("\n") and len(p) <= prompts.DEFAULT_MAX_CHARS
        for p in raw["train"]["prompt"]
    )
    _, d, _ = args("--max_train_samples", "100")
    rows = prompts.make_prompts(raw, tok, d, 64, is_default=True)
    assert len(rows.train) == 100 and rows.columns == [] and "standard-library functions" in rows.describe()[-1]


def test_function_prompts_take_the_signature_and_the_docstring_start():
    source = 'class A:\n    def f(self, x) -> int:\n        """Add one.\n\n        More."""\n        return x + 1\n'
    source += "def g(a,\n      b):\n    pass\ndef h():\n    '''\n    Say hi.\n    '''\n"
    assert list(prompts.function_prompts(source)) == [
        'def f(self, x) -> int:\n    """Add one.\n',
        "def h():\n    '''\n    Say hi.\n",
    ]  # g's signature spans two lines: left out


def test_prepare_under_grpo_gives_the_prompt_order_and_steps(tmp_path):
    train = write(tmp_path / "train.jsonl", text_rows(40))
    common = ["--train_file", str(train), "--config_name", "tiny", "--vocab_size", "300", "--max_prompt_length", "32"]
    common += ["--max_completion_length", "64", "--global_batch_size", "8", "--num_generations", "4"]
    common += ["--output_dir", str(tmp_path / "out"), "--data_cache_dir", str(tmp_path / "cache")]
    prep = prepare(*args(*common, "--num_train_epochs", "2", "--max_eval_samples", "1"), CPU)
    assert prep.collator is None and prep.prompts is not None and prep.from_scratch and not prep.used_default_corpus
    assert len(prep.datasets["train"]) == 38 and len(prep.datasets["validation"]) == 1  # 5% of 40 held out, 1 kept
    assert prep.order.global_batch_size == 2 and prep.order.steps_per_epoch == 19 and prep.total_steps == 38
    assert len(prep.order.global_batch(0)) == 2 and prep.data_lines == prep.prompts.describe()
    assert prep.tokenizer.eos_token_id is not None and prep.tokenizer.pad_token_id is not None
    assert prep.config.vocab_size >= len(prep.tokenizer) and prep.data_fingerprint
    assert set(prep.datasets["train"].column_names) == {"prompt", "solution", "id", "prompt_ids"}
    prep = prepare(*args(*common, "--max_steps", "3", "--max_train_samples", "4"), CPU)
    assert prep.total_steps == 3 and prep.order.num_samples == 4
    with pytest.raises(UsageError, match=r"has 4 prompts, fewer than a step's 8 \(--global_batch_size 32"):
        prepare(*args(*common, "--max_train_samples", "4", "--global_batch_size", "32"), CPU)


def test_a_saved_data_set_gives_prompts_and_its_test_split_validates(tmp_path, tok):
    DatasetDict(train=Dataset.from_list(chat_rows(5)), test=Dataset.from_list(chat_rows(2))).save_to_disk(
        tmp_path / "d"
    )
    _, d, _ = args("--dataset_name", str(tmp_path / "d"))
    raw, _ = prompts.load_prompts(d)
    rows = prompts.make_prompts(raw, tok, d, 64)
    assert rows.conversational and len(rows.train) == 5 and len(rows.validation) == 2 and rows.columns == ["solution"]
    DatasetDict(train=Dataset.from_list(chat_rows(5)).rename_column("prompt", "messages")).save_to_disk(tmp_path / "m")
    with pytest.raises(UsageError, match=r"--dataset_name .*m \(train split\) has a 'messages' column but no 'prompt'"):
        prompts.load_prompts(args("--dataset_name", str(tmp_path / "m"))[1])


NO_SYSTEM = (  # Gemma's way: its template raises on a system turn
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' + m['content'] + "
    "'<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def test_a_template_that_refuses_a_conversation_is_named_in_one_line(tmp_path, tok):
    """A chat template's own refusal (Gemma's: no system turn) ends prompt, SFT and DPO preparation with a UsageError
    that gives the template's reason, the conversation's turns and what to change, not jinja's traceback."""
    from anygpu.data import chat_template, preference

    tok = tok_lib.train_bpe(iter(WORDS * 20), 400)
    tok.chat_template = NO_SYSTEM
    said = (
        r"the tokenizer's chat template refused a conversation of turns \(system, user.*\): System role not supported"
    )
    _, d, _ = args("--train_file", str(write(tmp_path / "t.jsonl", chat_rows(6))))
    with pytest.raises(UsageError, match=said + r".*--tokenizer_name"):
        prompts.make_prompts(prompts.load_prompts(d)[0], tok, d, max_prompt_length=256)
    chat = [*chat_rows(1)[0]["prompt"], {"role": "assistant", "content": "blue"}]
    with pytest.raises(UsageError, match=said):
        chat_template.encode_chat(tok, chat, assistant_only=True)
    pair = {"prompt": chat[:2], "chosen": [chat[2]], "rejected": [{"role": "assistant", "content": "red"}]}
    with pytest.raises(UsageError, match=said):
        preference.tokenize_pair(tok, pair)
    assert chat_template.encode_chat(tok, chat[1:], assistant_only=True)[0]  # without the system turn: taken

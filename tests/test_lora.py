"""LoRA (peft, TRL's option names) on the FSDP2 engine over a pretrained folder: 1 and 2 ranks agree,
a run resumes exactly on another world size, only the adapter has optimizer state, `final/` is a PEFT
adapter that loads over the base, the merged model equals it, and the base folder is never modified.
The folder's tokenizer (special tokens, chat template) is what the run uses and exports."""

import hashlib
import json
from pathlib import Path

import pytest
from conftest import TINY, hf_runs, losses, python, torchrun

SCRIPT = "run_fsdp_standalone.py"
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
ARGS = [a for a in TINY if a not in ("--config_name", "tiny")] + [
    "--max_steps",
    "4",
    "--max_eval_samples",
    "4",
    "--use_peft",
    "true",
    "--lora_r",
    "4",
    "--lora_alpha",
    "8",
    "--lora_dropout",
    "0.1",
    "--lora_target_modules",
    "all-linear",
    "--learning_rate",
    "1e-2",
]


def build_base(folder: Path) -> None:
    """A tiny pretrained folder as save_pretrained writes it: Llama weights + a BPE tokenizer built offline."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # a fixed text (this Python's json package), so the tokenizer and the losses do not move with our own code
    texts = [p.read_text(errors="ignore") for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=1000,
            special_tokens=["<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = TEMPLATE
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("base")
    build_base(base)
    before = digest(base)
    one, two = tmp_path_factory.mktemp("lora-ws1"), tmp_path_factory.mktemp("lora-ws2")
    args = [*ARGS, "--model_name_or_path", str(base)]
    # one rank: plain python (a 1-rank group of its own), no torchrun agent process
    proc = python(SCRIPT, [*args, "--output_dir", str(one), "--merge_lora", "true"])
    torchrun(2, SCRIPT, [*args, "--output_dir", str(two), "--stop_at_step", "2"])
    resumed = python(SCRIPT, [*args, "--output_dir", str(two), "--resume_from_checkpoint", "latest"])
    return {"base": base, "before": before, "one": one, "two": two, "stdout": proc.stdout, "resumed": resumed.stdout}


@pytest.mark.slow
def test_world_sizes_agree_and_resume_is_exact(lora):
    one, two = losses(lora["one"]), losses(lora["two"])
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    assert "was 2 ranks, now 1" in lora["resumed"]
    for s in one:  # steps 1-2: 1 vs 2 ranks; steps 3-4: resumed on 1 rank from the 2-rank checkpoint
        assert abs(one[s] - two[s]) <= 1e-5 * abs(one[s]), (one, two)


@pytest.mark.slow
def test_a_target_the_model_lacks_is_one_line(lora, tmp_path):
    """The engine as a user runs it, with the comma form: one line naming the option and the model's linear modules."""
    proc = python(
        SCRIPT,
        [
            *ARGS,
            "--model_name_or_path",
            str(lora["base"]),
            "--lora_target_modules",
            "q_proj,qkv",
            "--output_dir",
            str(tmp_path / "run"),
        ],
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--lora_target_modules qkv: the model has no such module" in errors[0], proc.stderr
    assert "q_proj" in errors[0].split("Its linear modules: ")[1]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_only_the_adapter_trains(lora):
    """Banner, and the checkpoint measured: optimizer state for adapter tensors only, no base weights."""
    import torch.distributed.checkpoint as dcp

    assert "LoRA:" in lora["stdout"] and "trainable /" in lora["stdout"]
    meta = dcp.FileSystemReader(str(lora["two"] / "checkpoint-2")).read_metadata()
    optim = [k for k in meta.state_dict_metadata if k.startswith("optim.state.")]
    model = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert optim and all(".lora_" in k for k in optim), optim[:5]
    assert model and all(".lora_" in k for k in model), model[:5]


@pytest.mark.slow
def test_adapter_loads_over_the_base_and_merges(lora):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = lora["one"] / "final"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(lora["base"])
    base = AutoModelForCausalLM.from_pretrained(lora["base"]).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(final)("def main():\n    return 0\n")["input_ids"]])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, final).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(lora["one"] / "final-merged").eval()(input_ids=ids).logits
    assert not torch.allclose(plain, adapted)  # the adapter changes the model
    assert torch.allclose(adapted, merged, atol=1e-5)
    assert digest(lora["base"]) == lora["before"]  # the base folder is never modified


@pytest.mark.slow
def test_tokenizer_and_chat_template_carried(lora):
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(lora["base"])
    for folder in (lora["one"] / "final", lora["one"] / "final-merged", lora["one"] / "tokenizer"):
        tok = AutoTokenizer.from_pretrained(folder)
        assert tok.chat_template == TEMPLATE and len(tok) == len(base), folder
        assert (tok.bos_token, tok.eos_token, tok.pad_token) == (base.bos_token, base.eos_token, base.pad_token)


@pytest.mark.slow
def test_hf_engine_trains_the_same_adapter(lora, tmp_path):
    """The HF engine (one process, DDP config) from the same folder, stopped after step 2 (its checkpoint
    only, no export) and resumed: the FSDP2 engine's losses, and a PEFT adapter at the end."""
    args = [*ARGS, "--model_name_or_path", str(lora["base"])]
    stopped, out = tmp_path / "stopped", tmp_path / "resumed"
    # one launch: the run stopped after step 2, then its checkpoint-2 resumed by path into another folder
    hf_runs(
        1,
        [
            [*args, "--output_dir", str(stopped), "--stop_at_step", "2"],
            [*args, "--output_dir", str(out), "--resume_from_checkpoint", str(stopped / "checkpoint-2")],
        ],
    )
    assert [p.name for p in stopped.glob("checkpoint-*")] == ["checkpoint-2"]  # --stop_at_step: one checkpoint,
    assert not (stopped / "final").exists() and sorted(losses(stopped)) == [1, 2]  # no export, its steps only
    hf, fsdp = {**losses(stopped), **losses(out)}, losses(lora["one"])
    assert sorted(hf) == [1, 2, 3, 4]
    for s in hf:
        assert abs(hf[s] - fsdp[s]) <= 1e-4 * abs(fsdp[s]), (hf, fsdp)
    assert (out / "final" / "adapter_model.safetensors").exists()
    assert digest(lora["base"]) == lora["before"]


# families peft has no default for (MoE, multi-head latent attention, fused qkv) and two it has
DEFAULT_TARGETS = {
    "qwen2_moe": ["q_proj", "v_proj"],
    "deepseek_v3": "all-linear",
    "olmoe": ["q_proj", "v_proj"],
    "phi3": ["qkv_proj"],
    "granitemoe": ["q_proj", "v_proj"],
    "starcoder2": ["q_proj", "v_proj"],
    "gpt_oss": ["q_proj", "v_proj"],
    "jetmoe": "all-linear",
    "mixtral": ["q_proj", "v_proj"],
    "gpt2": ["c_attn"],
}


@pytest.mark.parametrize("model_type", DEFAULT_TARGETS)
def test_default_targets_for_every_family(model_type):
    """Without --lora_target_modules every family gets an adapter (peft alone knows ~40 model types): the query
    and value projections where the model has them, else every linear layer; only the adapter trains."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from anygpu.model import lora

    config = AutoConfig.for_model(model_type, num_hidden_layers=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert lora.default_targets(model) == DEFAULT_TARGETS[model_type]
    wrapped = lora.wrap(
        model,
        SimpleNamespace(
            use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=None, lora_modules_to_save=None
        ),
    )
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable), trainable[:4]
    assert "targets " in lora.trainable_line(wrapped)


def test_a_moe_family_without_query_value_names_adapts_its_attention_not_the_experts():
    """DeepSeek-V3 (latent attention: q_a_proj, kv_b_proj...; peft has no default for it) with its MoE layers: the
    default targets are the attention's linear layers, so the default --lora_dropout works and --ep can split the
    frozen experts (peft's all-linear adapted the experts' 3-D weights: no dropout there, refused by --ep)."""
    from types import SimpleNamespace

    from hub_sources import SOURCES

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from anygpu.model import lora
    from anygpu.runtime import expert_parallel
    from anygpu.runtime.mesh import MeshShape

    data = dict(SOURCES["deepseek_v3"][0])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(data.pop("model_type"), **data))
    assert expert_parallel.experts_modules(model)  # it has routed experts
    assert lora.default_targets(model) == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]
    args = SimpleNamespace(
        use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.05, lora_target_modules=None, lora_modules_to_save=None
    )
    wrapped = lora.wrap(model, args)
    assert "; parameters" not in lora.trainable_line(wrapped)  # no expert weight adapted
    expert_parallel.check(wrapped, 2, MeshShape(1, 2))


def test_adapters_off_gives_the_base_and_leaves_what_trains_alone():
    """LoRA's reference (DPO's, GRPO's): the base model's output with the adapter switched off, and every adapter
    weight still trainable inside and after (peft's disable_adapter flips requires_grad, which under FSDP2 changed
    the next backward of a 4-bit base: tests/conformance.py's grpo_qlora)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from anygpu.model.lora import adapters_off

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        plain = base(ids).logits
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        adapted = model(ids).logits
        with adapters_off(model):
            assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
            off = model(ids).logits
        again = model(ids).logits
    assert not torch.allclose(adapted, plain) and torch.equal(off, plain) and torch.equal(again, adapted)


def test_a_tied_head_in_modules_to_save_is_refused_by_the_fsdp_engine_in_one_line():
    """peft trains a copy of a tied lm_head, which the FSDP2 engine's re-tying cannot hold (a KeyError from
    tie_weights before); an untied head, or none named, passes."""
    import tiny_llm

    from anygpu.errors import UsageError
    from anygpu.model import lora

    tied, untied = tiny_llm.llama(64, tie_word_embeddings=True), tiny_llm.llama(64, tie_word_embeddings=False)
    with pytest.raises(UsageError, match=r"^--lora_modules_to_save lm_head: lm_head is tied to the input embeddings"):
        lora.check_untied_saves(tied, ["lm_head"])
    lora.check_untied_saves(untied, ["lm_head"])
    lora.check_untied_saves(tied, None)

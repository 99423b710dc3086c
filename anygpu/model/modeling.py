"""Model config and construction: pretrained, config.json, or a shipped preset.

Parameters are created on the meta device (buffers stay real), so a model is sharded
before any memory is spent on it; `init_parameters` then fills them with the family's own
`_init_weights` scheme, one decoder layer at a time from CPU generators seeded by name
(`anygpu.model.init_weights`), which gives the same weights whatever the sharding, the device, and
the same as the unsharded model the HF engine builds.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from anygpu.config.args import PRESETS_DIR, ModelArguments, preset_names
from anygpu.config.attention import OFFSETS
from anygpu.errors import UsageError
from anygpu.model import hub_weights, init_weights, lora, varlen_attention
from anygpu.runtime import context_parallel, expert_parallel, partitioned
from anygpu.runtime.blocks import decoder_layer_classes, hf_model

logger = logging.getLogger(__name__)


def resolve_config(args: ModelArguments) -> PretrainedConfig:
    """The model's config: from --config_name (preset, file or folder), else the pretrained model's; the
    attention kernel fitted to it (`fit_attention`), the experts implementation set (`set_experts`)."""
    config = _config_of(args)
    fit_attention(config, args)
    set_experts(config, args.experts_implementation)
    return config


def has_experts_implementation(config: PretrainedConfig) -> bool:
    """Whether the family's experts module takes transformers' experts implementations (its MoE families do)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return cls is not None and cls._can_set_experts_implementation()


def set_experts(config: PretrainedConfig, implementation: str | None) -> None:
    """--experts_implementation into the config, which every construction path reads; refused for a model with no
    experts module that takes it."""
    if implementation is None:
        return
    if not has_experts_implementation(config):
        raise UsageError(
            f"--experts_implementation {implementation}: {config.model_type} has no experts module that takes one "
            "(a dense model, or a family without transformers' experts implementations); leave it out."
        )
    config._experts_implementation = implementation


def experts_line(model: nn.Module) -> str | None:
    """The banner's note on how the experts compute, for a family that has the choice."""
    config = hf_model(model).config
    if not has_experts_implementation(config):
        return None
    used = config._experts_implementation or "grouped_mm"
    how = {"grouped_mm": "one grouped GEMM over all experts", "eager": "the family's per-expert loop"}
    return f"experts compute: {used} ({how.get(used, used)}; --experts_implementation)"


def _config_of(args: ModelArguments) -> PretrainedConfig:
    name = args.config_name or (None if args.model_name_or_path else "default")
    if name is None:
        return AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    if (PRESETS_DIR / f"{name}.json").exists():
        path = PRESETS_DIR / f"{name}.json"
    elif Path(name).is_file() or (Path(name) / "config.json").is_file():
        path = Path(name) if Path(name).is_file() else Path(name) / "config.json"
    elif "/" in name and not Path(name).exists():  # a cached hub id
        return AutoConfig.from_pretrained(name, trust_remote_code=args.trust_remote_code)
    else:
        raise UsageError(
            f"--config_name {name!r} is neither a preset ({', '.join(preset_names())}) nor a config.json file or folder."
        )
    data = json.loads(path.read_text())
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise UsageError(f"--config_name {path}: config has no 'model_type' (e.g. \"llama\").")
    return AutoConfig.for_model(model_type, **data)


def fit_attention(config: PretrainedConfig, args: ModelArguments) -> None:
    """--attn_implementation sdpa (the default) for a family that has no sdpa kernel (gpt-oss: its attention
    sinks) becomes eager, as transformers' own default would choose, said once; any other choice stays. Our own
    kernel's name (varlen_attention) is made known to transformers first."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    varlen_attention.register()
    if args.attn_implementation == varlen_attention.NAME:
        varlen_attention.check_family(config)
    if args.attn_implementation != "sdpa" or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return
    if not getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "_supports_sdpa", True):
        logger.warning("%s has no sdpa attention: --attn_implementation eager", config.model_type)
        args.attn_implementation = "eager"


def max_positions(config: PretrainedConfig) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_block_size(block_size: int | None, config: PretrainedConfig) -> int:
    limit = max_positions(config)
    if block_size is None:
        return min(1024, limit or 1024)
    if limit is not None and block_size > limit:
        raise UsageError(
            f"--block_size {block_size} is above the model's maximum positions ({limit}): use --block_size {min(limit, 1024)} "
            f"or less, or a config with a larger max_position_embeddings."
        )
    return block_size


def fit_config_to_tokenizer(config: PretrainedConfig, tokenizer, from_scratch: bool) -> PretrainedConfig:
    """From scratch the vocabulary is the tokenizer's (rounded up to 64 for fast matmuls)."""
    if from_scratch:
        config.vocab_size = -(-len(tokenizer) // 64) * 64
        config.bos_token_id = tokenizer.bos_token_id
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    elif len(tokenizer) > config.vocab_size:
        raise UsageError(
            f"the tokenizer of {tokenizer.name_or_path} has {len(tokenizer)} tokens (added ones included) but the "
            f"model's vocabulary is {config.vocab_size}: give a tokenizer of at most {config.vocab_size} tokens "
            "(--tokenizer_name), or a model whose embeddings cover this one's."
        )
    config.use_cache = False
    return config


def build_meta_model(config: PretrainedConfig, args: ModelArguments) -> nn.Module:
    """The model with parameters on the meta device and real buffers (RoPE tables), in fp32."""
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config,
            attn_implementation=args.attn_implementation,
            trust_remote_code=args.trust_remote_code,
            dtype=torch.float32,
        )
    # from_config ties lm_head to the input embedding (tie_word_embeddings) only outside
    # init_empty_weights; one shared Parameter is what FSDP2, the optimizer and the export expect.
    model.tie_weights()
    return model


def build_full_model(config: PretrainedConfig, args: ModelArguments, seed: int) -> nn.Module:
    """A materialised model on CPU: pretrained weights, or `init_parameters` from scratch (HF engine)."""
    if args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(
            args.model_name_or_path,
            config=config,
            attn_implementation=args.attn_implementation,
            trust_remote_code=args.trust_remote_code,
            dtype=torch.float32,
        )
    buffers = {n: b.clone() for n, b in build_meta_model(config, args).named_buffers()}
    model = build_meta_model(config, args)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each module a new Parameter: tie lm_head to the embedding again
    restore_buffers(model, buffers)
    init_parameters(model, config, seed, args.trust_remote_code)
    return model


def restore_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Put back buffers (RoPE tables) that `to_empty` left uninitialised."""
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in buffers:
                buf.copy_(buffers[name].to(buf.device, buf.dtype))


def init_parameters(model: nn.Module, config: PretrainedConfig, seed: int, trust_remote_code: bool = False) -> None:
    """Fill every parameter (plain or FSDP2-sharded DTensor) with the model family's own seeded initial value."""
    # A copy: from_config records the attention kernel in the config it is given. Eager: every family has it
    # (Gemma 2 and gpt-oss have no sdpa), and the initial values do not depend on the kernel.
    scratch_args = ModelArguments(attn_implementation="eager", trust_remote_code=trust_remote_code)
    scratch = build_meta_model(copy.deepcopy(config), scratch_args)
    init_weights.initialize(lora.base_targets(model), scratch, seed, decoder_layer_classes(scratch))


def load_pretrained_weights(model: nn.Module, path: str) -> None:
    """Fill a (possibly sharded) model from a folder's safetensors as `from_pretrained` would (`hub_weights`)."""
    hub_weights.load(model, path)


def count_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    total = sum(partitioned.numel(p) for p in model.parameters())
    if exclude_embeddings:
        emb = model.get_input_embeddings()
        total -= partitioned.numel(emb.weight)
    return total


PACKED_KEYS = ("input_ids", "labels", "position_ids")


def flattened(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A packed micro-batch's rows [m, T] as one row [1, m·T], row after row (the layout of transformers'
    `DataCollatorWithFlattening`). Every sample's first label is -100, so no row's last token gets the next
    row's first as a target: the targets and their count are the batch's own."""
    return {k: v.reshape(1, -1) for k, v in batch.items()}


def flatten_packed_rows(model: nn.Module) -> None:
    """Under flash attention, every forward gets a packed micro-batch (position ids, no attention mask) as one
    flattened row: transformers runs flash attention's varlen kernel per sample only for a batch of one row
    (`_is_packed_sequence`); given m > 1 rows it would let each sample attend to those before it in its row.
    A hook on the module the engines call (both engines, the evaluation, DataParallel's replicas): the callers
    keep the [m, T] batch for the token count, the MoE router loss and the keyed dropout masks."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        attention = str(getattr(getattr(module, "config", None), "_attn_implementation", ""))
        ids = kwargs.get("input_ids")
        if attention not in OFFSETS or kwargs.get("position_ids") is None or ids is None or ids.shape[0] == 1:
            return None
        if context_parallel.active():
            return None  # split sequences: the Ulysses wrapper flattens the whole rows itself
        if kwargs.get("attention_mask") is not None:
            return None  # padded rows, not packed ones: flash attention's padding path handles them
        rows = {k: kwargs[k] for k in PACKED_KEYS if kwargs.get(k) is not None}
        return args, {**kwargs, **flattened(rows)}

    model.register_forward_pre_hook(hook, with_kwargs=True)


def matmul_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameters each token is multiplied by: every one but the input embedding (a lookup),
    the output projection's even when it is the input embedding's tied weight, and of a mixture of experts' routed
    experts the top_k a token is sent to (`active_share`), not all of them."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    share = active_share(model)
    routed = {id(p) for module in expert_parallel.experts_modules(model) for p in module.parameters()}
    counts = [0.0, 0.0]  # trainable, frozen
    for p in model.parameters():
        if p is not embedding:
            counts[not p.requires_grad] += partitioned.numel(p) * (share if id(p) in routed else 1)
    if head is not None and getattr(head, "weight", None) is embedding:
        counts[not embedding.requires_grad] += partitioned.numel(embedding)
    return round(counts[0]), round(counts[1])


def active_share(model: nn.Module) -> float:
    """The share of a MoE layer's routed experts each token computes with: top_k / experts (1 for a dense model)."""
    experts = expert_parallel.num_experts(model)
    top_k = getattr(hf_model(model).config, "num_experts_per_tok", None)
    return min(1.0, top_k / experts) if experts and top_k else 1.0


def check_loss_kwargs(model: nn.Module) -> None:
    """Refuse a model whose loss cannot take `num_items_in_batch` (the global-batch token count), as Trainer decides it."""
    import inspect

    base = hf_model(model)
    accepts = getattr(base, "accepts_loss_kwargs", None)
    if accepts is None:
        accepts = any(
            p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(base.forward).parameters.values()
        )
    if not accepts:
        raise UsageError(
            f"{type(base).__name__}.forward takes no num_items_in_batch: its loss could not be normalised over the "
            "global batch. Use a transformers causal LM whose forward accepts **kwargs."
        )

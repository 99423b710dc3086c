"""--use_vllm true: GRPO's completions sampled by vLLM, colocated (TRL's `vllm_mode="colocate"`).

Each rank runs its own vLLM engine beside the policy (`distributed_executor_backend="external_launcher"`, tensor
parallel size 1), started once with random weights (`load_format="dummy"`: nothing is read from disk, so a model
trained from scratch works as well as a Hub one) and no tokenizer (token ids in, token ids out). Before each round the
policy's current weights are pushed into it under the checkpoint's names, one tensor at a time (an FSDP2 shard is
all-gathered for that tensor alone, not the whole model at once), a LoRA adapter merged into its base weight on the way.

Sampling stays keyed: each completion is its own request whose vLLM seed is the completion's key
(`generation.sample_keys`: seed, round, prompt, generation index), and vLLM draws a seeded request's tokens from a
generator of its own, so which rank samples a completion, beside which others, does not change its tokens (floating
point aside, as for the policy's own generation). The tokens differ from `--use_vllm false`'s: another sampler draws them.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from anygpu.errors import UsageError
from anygpu.runtime import distributed
from anygpu.runtime.blocks import hf_model
from anygpu.train.generation import Completion, Sampling

# In-process engine: external_launcher runs the engine inside the rank's own process (no engine subprocess).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM's start-up INFO lines (~50 a rank) would bury the run's own; its warnings and errors stay
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# infixes that are not in a checkpoint's names: activation checkpointing's, compile's, a LoRA module to save's
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "modules_to_save.default.")
SEED_BITS = (1 << 63) - 1  # vLLM seeds a torch.Generator: a non-negative int64


def vllm_dtype(bf16: bool, fp16: bool) -> str:
    """The engine's dtype: the policy's compute dtype."""
    return "bfloat16" if bf16 else "float16" if fp16 else "float32"


class VllmGenerator:
    """One colocated vLLM engine per rank; `complete` is GRPOObjective's generator interface."""

    line = "sampled by vLLM (one engine a GPU, colocated), the policy's weights pushed once a round"  # the banner's

    def __init__(self, llm, sampling: Sampling, dtype: torch.dtype) -> None:
        self.llm, self.sampling, self.dtype = llm, sampling, dtype
        self.pushed: int | None = None  # the optimizer step whose weights the engine holds

    @classmethod
    def start(
        cls, model: nn.Module, sampling: Sampling, max_model_len: int, memory: float, dtype: str
    ) -> VllmGenerator:
        """vLLM's engine for `model`'s architecture on this rank (collective: every rank starts one)."""
        from vllm import LLM, SamplingParams

        quiet_tokenizer_warmup()
        config = hf_model(model).config
        architecture = architecture_of(hf_model(model))
        check_architecture(architecture)
        distributed = torch.distributed.is_initialized()
        if distributed:
            launcher_env()
        with tempfile.TemporaryDirectory(prefix="anygpu-vllm-") as folder:
            saved = config.__class__.from_dict(config.to_dict())
            saved.architectures = [architecture]
            saved.save_pretrained(folder)  # the shapes alone: weights come from the policy, tokens as ids
            llm = None
            try:
                with own_decoder_class(config):
                    llm = LLM(**engine_args(folder, dtype, max_model_len, memory, distributed))
                keep_the_process_group(llm)
                # one token drawn now: what vLLM cannot run (a kernel for these shapes) fails before training
                llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1), use_tqdm=False)
            except (RuntimeError, ValueError, NotImplementedError) as e:  # vLLM's word for what it cannot run
                if llm is not None:
                    end_groups()
                said = (str(e).strip().splitlines() or [repr(e)])[-1]
                raise UsageError(
                    f"--use_vllm true: vLLM could not start an engine for {architecture} ({type(e).__name__}: "
                    f"{said}); leave --use_vllm out to generate with the policy itself."
                ) from e
        return cls(llm, sampling, getattr(torch, dtype))

    def complete(
        self, model: nn.Module, prompts: list[list[int]], keys: torch.Tensor, version: int, batch_size: int = 0
    ) -> list[Completion]:
        """One completion per prompt, from the weights after optimizer step `version` (pushed first where the
        engine holds older ones); vLLM schedules its own batches (`batch_size` unused). Collective when it pushes:
        every rank calls it, with prompts or without."""
        if self.pushed != version:
            self.push(model)
            self.pushed = version
        if not prompts:
            return []
        from vllm import SamplingParams

        s = self.sampling
        params = [
            SamplingParams(
                n=1,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                max_tokens=s.max_new_tokens,
                stop_token_ids=list(s.eos_token_ids),
                seed=int(key) & SEED_BITS,
                detokenize=False,
                logprobs=0,  # the drawn token's own, for --vllm_importance_sampling_correction
            )
            for key in keys.tolist()
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [completion(o.outputs[0], s) for o in outs]

    @torch.no_grad()
    def push(self, model: nn.Module) -> None:
        """The policy's current weights into the engine, in place, layer by layer (vLLM's reload: its kernels'
        own layouts redone after). Collective on a sharded model."""
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        rebuild_cpu_experts(runner.get_model())
        try:
            runner.reload_weights(weights_iterator=policy_weights(model, self.dtype), is_checkpoint_format=True)
        except (KeyError, ValueError, AssertionError) as e:
            raise UsageError(
                f"--use_vllm true: vLLM's {type(runner.get_model()).__name__} did not take the policy's weights "
                f"({type(e).__name__}: {e}); leave --use_vllm out to generate with the policy itself."
            ) from e
        redo_tied(runner.get_model())
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        end_groups()


def end_groups() -> None:
    """vLLM's process groups ended (before the run's own: they are its subgroups)."""
    from vllm.distributed import parallel_state

    distributed.keep_groups()
    parallel_state.destroy_model_parallel()
    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
        parallel_state._WORLD = None


def redo_tied(engine_model: nn.Module) -> None:
    """vLLM's reload redoes each layer's own processing once per tensor (on a CPU: a packed copy of each linear
    weight), so a head tied to the embedding would keep the copy packed from its first weights (vLLM's
    reload notes this limit): each module sharing its weight has its processing redone."""
    sharing: dict[int, list[nn.Module]] = {}
    for module in engine_model.modules():
        weight, method = getattr(module, "weight", None), getattr(module, "quant_method", None)
        if isinstance(weight, torch.Tensor) and hasattr(method, "process_weights_after_loading"):
            sharing.setdefault(id(weight), []).append(module)
    for modules in sharing.values():
        for module in modules if len(modules) > 1 else ():
            module.quant_method.process_weights_after_loading(module)


def rebuild_cpu_experts(engine_model: nn.Module) -> None:
    """vLLM's CPU MoE kernel pads and prepacks the experts' weights when it is built, and a reload keeps the built
    kernel and skips that step: the new weights would land unpacked in the packed storage (a shape error where the
    padding differs, wrong log-probs where it does not). On a CPU each MoE layer's kernel is built again on reload."""
    if torch.cuda.is_available():
        return  # GPU kernels redo their weight layout on every reload
    for module in engine_model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None


def quiet_tokenizer_warmup() -> None:
    """vLLM's chat-template warm-up asks for the tokenizer this engine is started without and logs the failure with
    its traceback: dropped (a filter on that logger: vLLM's own logging set-up resets its level at engine start)."""
    logger = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _NoTokenizerWarmup) for f in logger.filters):
        logger.addFilter(_NoTokenizerWarmup())


class _NoTokenizerWarmup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Chat template warmup failed")


@contextmanager
def own_decoder_class(config) -> Iterator[None]:
    """The engine's transformers classes its own while it is built. vLLM runs the families it has no code of its own
    for (Olmo2, Phi, GPT-NeoX, ... in 0.32) through its Transformers backend, which rewrites the decoder class it
    builds in place (its compile wrapper added to `__bases__`, `__init__` and `__call__` replaced): the policy, an
    instance of that same class in this process, would no longer run. The engine builds a subclass instead."""
    from transformers import AutoModel

    mapping, key = AutoModel._model_mapping, type(config)
    if key not in mapping:
        yield
        return
    base = mapping[key]
    own = type(base.__name__, (base,), {"__module__": base.__module__, "__qualname__": base.__qualname__})
    before = mapping._extra_content.get(key)  # transformers keeps registered classes there, ahead of its own
    mapping.register(key, own, exist_ok=True)
    try:
        yield
    finally:
        if before is None:
            mapping._extra_content.pop(key, None)
        else:
            mapping._extra_content[key] = before


def launcher_env() -> None:
    """What vLLM's external launcher reads of a torchrun rank, set where the run's process group came another way
    (one process with a group of its own)."""
    local = torch.cuda.current_device() if torch.cuda.is_available() else 0
    os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
    os.environ.setdefault("LOCAL_RANK", str(local))
    os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size()))


def engine_args(folder: str, dtype: str, max_model_len: int, memory: float, distributed: bool) -> dict:
    """vLLM's `LLM` arguments for a colocated engine that takes its weights from the policy."""
    return dict(
        model=folder,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype=dtype,
        max_model_len=max_model_len,
        gpu_memory_utilization=memory,
        tensor_parallel_size=1,
        distributed_executor_backend="external_launcher" if distributed else None,
        seed=0,  # every draw is seeded by its request (the completion's key)
        logprobs_mode="processed_logprobs",  # after the temperature and top-k/top-p, as the policy's (TRL's)
        generation_config="vllm",  # no sampling defaults from a generation_config.json
        max_num_batched_tokens=max(4096, max_model_len),
        # vLLM's CPU runner rewinds a seeded request's generator after a partial prefill, which a CPU
        # generator cannot do ("CPU Generator does not use offset"): there, prompts are prefilled whole
        enable_chunked_prefill=torch.cuda.is_available(),
    )


def completion(out, sampling: Sampling) -> Completion:
    """vLLM's output as the policy's generation gives it (the EOS it stopped on kept, truncated when it did not),
    with vLLM's log-prob of each drawn token (NaN where it gave none)."""
    ids = list(out.token_ids)
    logps = [lp[t].logprob if lp and t in lp else math.nan for lp, t in zip(out.logprobs or [], ids)]
    logps = logps if len(logps) == len(ids) else [math.nan] * len(ids)
    ended = bool(ids) and ids[-1] in sampling.eos_token_ids
    return Completion(ids, truncated=not ended and len(ids) >= sampling.max_new_tokens, logps=logps)


def keep_the_process_group(llm) -> None:
    """vLLM tears down on garbage collection (`EngineCore.shutdown`), and that teardown ends the default process
    group, the run's own, which the engine ends itself after its last collective: disarmed, `close` ends vLLM's groups."""
    finalizer = getattr(llm.llm_engine.engine_core, "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()


def architecture_of(model: nn.Module) -> str:
    """The transformers class a model is (FSDP2 makes each sharded module an instance of a subclass of its own)."""
    return next(c for c in type(model).__mro__ if c.__module__.startswith("transformers.")).__name__


def check_architecture(architecture: str) -> None:
    """Refuse a model class vLLM has no implementation of, before its engine starts."""
    from vllm import ModelRegistry

    if architecture not in ModelRegistry.get_supported_archs():
        raise UsageError(
            f"--use_vllm true: vLLM has no implementation of {architecture}; leave --use_vllm out to generate with "
            "the policy itself (batched, with a KV cache)."
        )


def policy_weights(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor) for each of the policy's weights in the checkpoint's layout, which vLLM's loaders
    read (transformers' reverse conversion, as the export's `hub_layout`: a MoE's fused experts split again), one
    decoder layer at a time. Collective on a sharded model: every rank walks the same order."""
    from anygpu.checkpoint.export import hub_layout, layer_of

    hf, group, layer = hf_model(model), {}, None
    for name, tensor in _weights(model, dtype):
        if group and layer_of(name) != layer:
            yield from hub_layout(hf, group).items()
            group = {}
        group[name], layer = tensor, layer_of(name)
    yield from hub_layout(hf, group).items()


def _weights(model: nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under their names in the model, one at a time, in `dtype` (the engine's: a shard is cast
    before its all-gather, half the bytes of fp32 master weights in bf16); a LoRA layer's base weight merged with its
    adapter (W + scale · B A, in fp32)."""
    from peft.tuners.lora import LoraLayer

    hf = hf_model(model)
    adapted = {name: m for name, m in hf.named_modules() if isinstance(m, LoraLayer)}
    seen: set[int] = set()  # a tied head is the embedding's tensor: pushed once
    for name, module in hf.named_modules():
        if any(name.startswith(f"{a}.") for a in adapted) or "original_module" in name.split("."):
            continue  # a LoRA layer's own parts (merged below); a module to save's frozen copy
        if name in adapted:
            yield from _merged(name, module, dtype)
            continue
        for pname, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield clean(f"{name}.{pname}" if name else pname), full(param, dtype)


def _merged(name: str, layer, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA layer as one plain layer: its base weight plus each active adapter's B A, scaled (peft's merge, on the
    whole tensors). A MoE's experts adapted by parameter (peft's `ParamWrapper`, one per adapted 3-D weight, nested)
    give each adapted weight with its own delta."""
    from peft.tuners.lora import ParamWrapper

    deltas: dict[str, torch.Tensor] = {}
    if not isinstance(layer, ParamWrapper):  # a linear layer's (or an embedding's) adapter: its weight's delta
        deltas["weight"] = sum(_deltas(layer), torch.zeros(()))
        layer = layer.get_base_layer()
    while isinstance(layer, ParamWrapper):
        for delta in _deltas(layer):
            deltas[layer.parameter_name] = deltas.get(layer.parameter_name, 0) + delta
        layer = layer.base_layer  # the next wrapper in, or the experts module
    for pname, param in layer.named_parameters():
        if pname in deltas:
            yield clean(f"{name}.{pname}"), (full(param).float() + deltas[pname]).to(dtype or param.dtype)
        else:
            yield clean(f"{name}.{pname}"), full(param, dtype)


def _deltas(layer) -> Iterator[torch.Tensor]:
    """Each active adapter's scaled B A for `layer`, in fp32, in its weight's shape."""
    from peft.tuners.lora import ParamWrapper

    for adapter in layer.active_adapters:
        if adapter in getattr(layer, "lora_embedding_A", {}):  # an embedding's: A rank x vocabulary, B dim x rank
            a, b = full(layer.lora_embedding_A[adapter]).float(), full(layer.lora_embedding_B[adapter]).float()
            yield (b @ a).T * layer.scaling[adapter]
            continue
        if adapter not in layer.lora_A:
            continue
        a, b = full(layer.lora_A[adapter].weight).float(), full(layer.lora_B[adapter].weight).float()
        experts = getattr(layer, "num_experts", 1) if isinstance(layer, ParamWrapper) else 1
        if experts > 1:  # peft's ParamWrapper.get_delta_weight: A experts x rank x in, B out x rank x experts
            a, b = a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts)
            delta = torch.einsum("ore,eri->eoi" if layer._did_swap_in_out_features else "ore,eri->eio", b, a)
        else:
            delta = b @ a
            delta = delta.T if getattr(layer, "fan_in_fan_out", False) else delta
        yield delta * layer.scaling[adapter]


def full(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor of a parameter, in `dtype` where given: an FSDP2 shard cast, then all-gathered (a
    collective), a plain one as it is."""
    data = param.detach()
    if dtype is not None and data.is_floating_point():
        data = data.to(dtype)
    return data.full_tensor() if hasattr(data, "full_tensor") else data


def clean(name: str) -> str:
    """A parameter's checkpoint name: wrappers' infixes removed."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name

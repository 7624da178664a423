"""Stream the policy's full weights to an inference engine, bucket by bucket, and check them after.

Under DeepSpeed ZeRO-3 every rank holds a shard of each parameter. ``gathered_named_weights`` walks the model in
buckets of about ``bucket_bytes``, gathers each bucket's shards with ONE ``deepspeed.zero.GatheredParameters``
(one collective round per bucket instead of one per parameter), and yields ``(hf_name, tensor)`` on the main
process while the bucket is gathered. Names are those of the plain Hugging Face model: wrapper prefixes
(``module.``, ``_orig_mod.``) and PEFT's (``base_model.model.``, ``.base_layer``) are removed, LoRA adapters are
merged into their base weights out of place (the trainer's parameters are never written), ``lora_`` tensors are
not sent, and a tied input/output embedding is sent once, under the input embedding's name.

No trainer state lives here: the trainer decides who consumes the stream (the engine, on the main process).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from verifiers_rl.core.modeling import strip_wrappers, unwrap

PEFT_PREFIX = "base_model.model."
# The fixed text whose tokens make the post-sync probe (any text works; this one tokenizes into many pieces).
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. What is 17 * 3? Let me think: 17 * 3 = 51, so the answer is 51."
)


@dataclass
class GatherStats:
    """Counters of one pass over the stream (filled on every rank; ``tensors`` only on the main process)."""

    buckets: int = 0  # gather rounds; under ZeRO-3 one collective all-gather each
    gathered_bytes: int = 0  # full (unsharded) size of the parameters gathered
    tensors: int = 0  # (name, tensor) pairs yielded


@dataclass
class _Source:
    """One unit of bucketing: parameters gathered together, and what they become once gathered."""

    params: list[torch.nn.Parameter]
    emit: Callable[[], list[tuple[str, torch.Tensor]]]  # runs while ``params`` are gathered, on the main process
    nbytes: int


def hf_name(name: str) -> str:
    """The plain model's name of a parameter: no wrapper prefixes, no PEFT prefix or ``.base_layer``."""
    name = strip_wrappers(name).removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter, also when ZeRO-3 left only a shard (or nothing) on this rank."""
    return int(getattr(param, "ds_numel", param.numel()))


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Group consecutive items into buckets of at most ``bucket_bytes`` (an item larger than that is alone).

    ``bucket_bytes <= 0`` puts every item in its own bucket. Returns lists of item indices, in order.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    total = 0
    for index, size in enumerate(sizes):
        if current and (bucket_bytes <= 0 or total + size > bucket_bytes):
            buckets.append(current)
            current, total = [], 0
        current.append(index)
        total += size
    if current:
        buckets.append(current)
    return buckets


def _nbytes(params: list[torch.nn.Parameter]) -> int:
    return sum(full_numel(p) * p.element_size() for p in params)


def _canonical_names(model: torch.nn.Module) -> dict[int, str]:
    """id(param) -> the name it is sent under; a tied embedding gets the input embedding's name."""
    embed_name = None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is not None:
        for module_name, module in model.named_modules():
            if module is embed:
                embed_name = f"{module_name}.weight"
                break
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in names or name == embed_name:
            names[id(param)] = name
    return names


def _check_peft(model: torch.nn.Module) -> None:
    """Refuse what cannot be merged into plain weights; runs on every rank before any gather (so all raise)."""
    for adapter, config in getattr(model, "peft_config", {}).items():
        peft_type = str(getattr(config, "peft_type", ""))
        if not peft_type.endswith("LORA"):
            raise NotImplementedError(
                f"Weight sync merges LoRA adapters only; adapter {adapter!r} is {peft_type}, which has no merged "
                "plain-model weights to send to the engine."
            )


def _lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    if not hasattr(model, "peft_config"):
        return []
    from peft.tuners.lora import LoraLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def merged_lora_weights(layer) -> dict[str, torch.Tensor]:
    """The base layer's parameters with the active adapters merged in, computed out of place.

    The arithmetic is PEFT's own merge (``base += delta`` per active adapter, variants such as DoRA through their
    ``merge_safe``), so the result equals ``merge_and_unload`` bit for bit while the layer stays untouched: under
    ZeRO-3 an in-place merge of gathered parameters is refused (or lost), and merge-then-unmerge would not restore
    the trainer's weights exactly.
    """
    base = layer.get_base_layer()
    merged = {name: p.detach() for name, p in base.named_parameters()}
    if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
        return merged  # adapters off, or already merged into the base weights by the user
    variants = getattr(layer, "lora_variant", {})
    weight, copied = merged["weight"], False
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A and adapter not in getattr(layer, "lora_embedding_A", {}):
            continue
        if not copied:
            weight, copied = weight.clone(), True  # from here on the copy is ours to add to
        if adapter in variants:
            weight = variants[adapter].merge_safe(layer, adapter, weight)
        else:
            weight += layer.get_delta_weight(adapter).to(weight.dtype)
        if getattr(layer, "lora_bias", {}).get(adapter, False):
            if merged.get("bias") is None:
                raise RuntimeError(f"LoRA adapter {adapter!r} has lora_bias=True but its base layer has no bias.")
            merged["bias"] = merged["bias"] + layer.lora_B[adapter].bias * layer.scaling[adapter]
    merged["weight"] = weight
    return merged


def _active_adapter(model) -> str | None:
    active = getattr(model, "active_adapter", None)
    return active if isinstance(active, str) else None


def _plain_name(name: str, active_adapter: str | None) -> str | None:
    """Name to send a non-LoRA parameter under, or None to skip it (PEFT bookkeeping copies)."""
    if "lora_" in name or ".original_module." in name:
        return None  # adapter tensors are merged elsewhere; original_module is shadowed by modules_to_save
    marker = ".modules_to_save."
    if marker in name:
        head, rest = name.split(marker, 1)
        adapter, tail = rest.split(".", 1)
        if adapter != active_adapter:
            return None
        name = f"{head}.{tail}"
    return hf_name(name)


def weight_sources(model: torch.nn.Module) -> list[_Source]:
    """The model's parameters as units of gathering, in ``named_parameters`` order (identical on every rank)."""
    model = unwrap(model)
    _check_peft(model)
    lora_of: dict[int, tuple[str, torch.nn.Module]] = {}
    for layer_name, layer in _lora_layers(model):
        for param in layer.parameters():
            lora_of[id(param)] = (layer_name, layer)
    names = _canonical_names(model)
    active = _active_adapter(model)
    sources: list[_Source] = []
    seen: set[int] = set()
    for _, param in model.named_parameters():
        if id(param) in seen:
            continue
        if id(param) in lora_of:
            layer_name, layer = lora_of[id(param)]
            params = list(layer.parameters())
            seen.update(id(p) for p in params)
            prefix = hf_name(layer_name)

            def emit(layer=layer, prefix=prefix) -> list[tuple[str, torch.Tensor]]:
                return [(f"{prefix}.{name}", tensor) for name, tensor in merged_lora_weights(layer).items()]

            sources.append(_Source(params, emit, _nbytes(params)))
            continue
        seen.add(id(param))
        name = _plain_name(names[id(param)], active)
        if name is None:
            continue
        sources.append(_Source([param], lambda name=name, param=param: [(name, param.detach())], _nbytes([param])))
    return sources


def gathered(params: list[torch.nn.Parameter], zero3: bool, modifier_rank: int | None = None):
    """Under ZeRO-3, ``params`` whole inside the block (every rank enters it); ``modifier_rank``: the rank whose
    changes are broadcast back when it ends (None: read-only, nothing is sent back)."""
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def gathered_named_weights(
    model: torch.nn.Module,
    bucket_bytes: int,
    *,
    is_main: bool,
    zero3: bool,
    stats: GatherStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the policy's full weights as ``(hf_name, tensor)`` on the main process, bucket by bucket.

    Every rank must iterate this generator to its end, in lockstep: under ZeRO-3 each bucket is one collective
    gather (the other ranks yield nothing but take part). Never stop early: a bucket left half-way on one rank
    hangs the others; drain what a consumer leaves. ``bucket_bytes <= 0`` gathers one parameter (one LoRA layer)
    at a time.

    A yielded tensor is a view of the gathered parameter, valid only until the next item is requested (the bucket
    is released then): consumers copy or send it at once and keep no reference. An error while merging is raised
    after the last bucket, so the other ranks are never left waiting in a gather.
    """
    sources = weight_sources(model)
    failure: BaseException | None = None
    for bucket in plan_buckets([s.nbytes for s in sources], bucket_bytes):
        params = [p for index in bucket for p in sources[index].params]
        with gathered(params, zero3):
            if stats is not None:
                stats.buckets += 1
                stats.gathered_bytes += _nbytes(params)
            if not is_main or failure is not None:
                continue
            for index in bucket:
                try:
                    pairs = sources[index].emit()
                except Exception as exc:  # noqa: BLE001 - re-raised after the last gather
                    failure = exc
                    break
                for pair in pairs:
                    if stats is not None:
                        stats.tensors += 1
                    yield pair
    if failure is not None:
        raise failure


# --- the post-sync probe ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeResult:
    """Engine vs trainer log-probs of the probe tokens: largest gap, where (token position t >= 1), mean gap."""

    max_gap: float
    worst_position: int
    mean_gap: float
    tokens: int


def probe_token_ids(tokenizer, num_tokens: int, vocab_size: int | None = None) -> list[int]:
    """``num_tokens`` ids of the fixed probe text (repeated if short); identical on every rank."""
    ids: list[int] = []
    if tokenizer is not None:
        ids = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
    if vocab_size is not None:
        ids = [i for i in ids if 0 <= i < vocab_size]
    if not ids:
        ids = list(range(1, 1 + num_tokens))  # no usable tokenizer: any in-vocabulary ids do
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def compare_logprobs(trainer_logps: list[float], engine_logps: list[float]) -> ProbeResult:
    """Gap between two log-prob lists of the same tokens (index i is token position i + 1)."""
    if len(trainer_logps) != len(engine_logps):
        raise ValueError(
            f"The engine returned {len(engine_logps)} probe log-probs for {len(trainer_logps)} positions."
        )
    # A NaN gap (a broken engine) must count as the worst, not compare False against everything.
    gaps = [abs(a - b) if abs(a - b) == abs(a - b) else math.inf for a, b in zip(trainer_logps, engine_logps)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return ProbeResult(float(gaps[worst]), worst + 1, float(sum(gaps) / len(gaps)), len(gaps))


class WeightSyncError(RuntimeError):
    """Loading the policy into the inference engine (or probing it afterwards) failed; raised on every rank."""


class WeightSyncWarning(UserWarning):
    """The engine's log-probs differ from the trainer's after a weight load: it samples with stale weights."""


def probe_warning(result: ProbeResult, version: int, tolerance: float) -> str:
    """The loud message for a failed probe: the gap, where, and what it usually means."""
    return (
        f"Weight sync probe FAILED after loading policy version {version}: the engine's log-probs of the probe differ "
        f"from the trainer's by up to {result.max_gap:.4g} nats at token position {result.worst_position} of "
        f"{result.tokens + 1} (mean gap {result.mean_gap:.3g}, tolerance {tolerance:.3g}). The engine is sampling "
        "from weights other than the policy's, so rollouts are off-policy in a way the importance weights do not "
        "see. This usually means stale layers: a tied output layer (lm_head) that was not re-tied to the reloaded "
        "input embedding, or a tensor the engine skipped or misnamed."
    )

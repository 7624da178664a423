"""LoRA from the command line: TRL's ``ModelConfig`` flags (``--use_peft``, ``--lora_r``, ...), checked, and the
``peft.LoraConfig`` they give, the ``peft_config`` that ``RLTrainer`` takes from Python.

TRL's quantization flags (``--load_in_4bit``, ...) are not flags here: RLTrainer loads no quantized model by id
(the command refuses them by name: ``cli/train.TRL_SCRIPT_FLAGS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Annotated

from verifiers_rl.core.choices import AT_LEAST_ONE, POSITIVE, Range, field_ranges

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output layer
TASK_TYPE = "CAUSAL_LM"  # the only one a policy that generates is


@dataclass
class LoraArguments:
    """The LoRA flags of ``verifiers-rl train``: TRL's ``ModelConfig`` names and defaults."""

    use_peft: bool = field(default=False, metadata={
        "help": "Train LoRA adapters (peft) instead of the whole model; the --lora_* flags shape them. The KL "
                "reference is the model without adapters, the engine gets the merged weights, and --output_dir and "
                "checkpoints hold the adapters (resume with the same --lora_* flags). With a --model folder of "
                "adapters: those adapters train on, over their base model."})
    lora_r: Annotated[int, AT_LEAST_ONE] = field(default=16, metadata={"help": "LoRA rank r. Needs --use_peft."})
    lora_alpha: Annotated[int, POSITIVE] = field(default=32, metadata={
        "help": "LoRA alpha: the adapters' update is scaled by alpha / r (alpha / sqrt(r) with --use_rslora). Needs "
                "--use_peft."})
    lora_dropout: Annotated[float, Range(0, high=1, strict_high=True)] = field(default=0.05, metadata={
        "help": "Dropout on the adapters' input while training (the engine samples without it, and the KL reference "
                "is computed without it). Above 0 a step's update depends on how its batch is split (processes, "
                "micro-batches), as any dropout's; 0 keeps every layout's update equal. Needs --use_peft."})
    lora_target_modules: list[str] | None = field(default=None, metadata={
        "help": "Modules that get adapters, by name (q_proj v_proj: every module whose name ends in one of them), or "
                "all-linear (every linear layer but the output layer); each name must match a module of the model. "
                "Default: peft's for the model type (Llama: q_proj v_proj). Needs --use_peft."})
    lora_target_parameters: list[str] | None = field(default=None, metadata={
        "help": "Parameters that get adapters, by name (mlp.down_proj.weight: every parameter whose name ends in "
                "one of them): weights held by no linear module of their own (a mixture of experts' stacked "
                "experts), beside --lora_target_modules (whose default still applies, as in TRL); each must match a "
                "parameter of the model, and --lora_dropout must be 0. Needs --use_peft."})
    lora_modules_to_save: list[str] | None = field(default=None, metadata={
        "help": "Modules trained whole beside the adapters (and saved with them), by name as --lora_target_modules; "
                "each must match a module of the model. Needs --use_peft."})
    lora_task_type: str = field(default=TASK_TYPE, metadata={
        "help": "peft's task type: CAUSAL_LM, the only one here (the policy generates). Needs --use_peft."})
    use_rslora: bool = field(default=False, metadata={
        "help": "Rank-stabilized LoRA: scale by lora_alpha / sqrt(r) instead of lora_alpha / r. Needs --use_peft."})
    use_dora: bool = field(default=False, metadata={
        "help": "DoRA: adapt each weight's magnitude and direction apart (the engine gets the merged weights). Needs "
                "--use_peft."})


LORA_FLAGS = tuple(f.name for f in fields(LoraArguments))


def check_lora_flags(lora: LoraArguments, given: set[str], disable_dropout: bool = False) -> None:
    """Refuse a value out of its range, a --lora_* flag (``given``: the flags set) without --use_peft (it would shape
    no adapters), and --lora_dropout beside --disable_dropout (which zeroes it). (Not in ``__post_init__``: the
    command parses again with other defaults to tell what was given.)"""
    _check_values(lora)
    if disable_dropout and lora.use_peft and "lora_dropout" in given and lora.lora_dropout > 0:
        raise ValueError(f"--lora_dropout {lora.lora_dropout} is not used with --disable_dropout: TRL's "
                         "disable_dropout sets every dropout of the model to 0, the adapters' too. Leave one out.")
    unread = [name for name in LORA_FLAGS if name in given and name != "use_peft"]
    if unread and not lora.use_peft:
        flags = ", ".join(_flag_text(name, getattr(lora, name)) for name in unread)
        raise ValueError(f"{flags}: {'they act' if len(unread) > 1 else 'it acts'} only with --use_peft (LoRA); "
                         "add --use_peft, or leave it out to train the whole model.")


def _check_values(lora: LoraArguments) -> None:
    for name, allowed in field_ranges(LoraArguments).items():
        allowed.check(f"--{name}", getattr(lora, name))
    if lora.lora_task_type != TASK_TYPE:
        raise ValueError(f"--lora_task_type {lora.lora_task_type} is not trained here: the policy generates, so its "
                         f"adapters are {TASK_TYPE}'s (the default). Leave --lora_task_type out.")
    for name in ("lora_target_modules", "lora_target_parameters", "lora_modules_to_save"):
        if getattr(lora, name) == []:
            raise ValueError(f"--{name} needs at least one module name.")
    if lora.lora_target_parameters and lora.lora_dropout > 0:
        raise ValueError("--lora_target_parameters needs --lora_dropout 0: peft's adapters of parameters take no "
                         f"dropout (--lora_dropout is {lora.lora_dropout}, TRL's default 0.05 unless given).")
    targets = lora.lora_target_modules or []
    if ALL_LINEAR in targets and len(targets) > 1:
        raise ValueError(f"--lora_target_modules {' '.join(targets)}: {ALL_LINEAR} stands alone (it already names "
                         "every linear layer).")


def _flag_text(name: str, value) -> str:
    """How the flag reads on the command line: a switch alone, a list as its words."""
    if isinstance(value, bool):
        return f"--{name}" if value else f"--{name} false"
    return f"--{name} {' '.join(value) if isinstance(value, list) else value}"


# The flags that build adapters, each with its key in ``training.run_state.adapter_signature``.
SIGNATURE_FLAGS = {"lora_r": "r", "lora_alpha": "lora_alpha", "lora_target_modules": "target_modules",
                   "lora_target_parameters": "target_parameters", "lora_modules_to_save": "modules_to_save",
                   "use_rslora": "use_rslora", "use_dora": "use_dora"}


def command_flags(signature: dict) -> str:
    """The flags of this command that build adapters of ``signature`` (peft's LoraConfig keys, as
    ``training.run_state.adapter_signature`` gives them)."""
    values = {"use_peft": True, **{flag: signature[key] for flag, key in SIGNATURE_FLAGS.items()}}
    return " ".join(_flag_text(name, value) for name, value in values.items() if value)


# The flags that shape adapters: a folder of adapters trained on has its own. The task type is in no signature (the
# only one trained here is the default), but shapes them too.
SHAPE_FLAGS = (*SIGNATURE_FLAGS, "lora_task_type")


def check_continued_flags(lora: LoraArguments, given: set[str], folder: str, signature: dict) -> None:
    """With --use_peft a --model folder of adapters (``signature``: ``run_state.adapter_signature`` of its config) is
    trained on as it is: a flag that shapes adapters (``given``: the flags set) is refused."""
    shaped = [name for name in SHAPE_FLAGS if name in given]
    if shaped:
        flags = ", ".join(_flag_text(name, getattr(lora, name)) for name in shaped)
        raise ValueError(f"{flags}: --model {folder} holds LoRA adapters ({command_flags(signature)}), which "
                         "--use_peft trains on as they are. Leave the flag out, or train new adapters from their "
                         "base model.")


def peft_config_of(lora: LoraArguments, model: str, load_kwargs: dict | None = None):
    """The ``peft.LoraConfig`` the flags ask for (None without --use_peft), as TRL's ``get_peft_config`` builds it;
    a module name that matches no module of ``model`` (a folder or Hub id, read with ``load_kwargs``: the trainer's
    ``inference.factory.model_load_kwargs``) is a ValueError naming its flag."""
    if not lora.use_peft:
        return None
    from peft import LoraConfig

    targets = lora.lora_target_modules
    check_module_names(_skeleton(model, load_kwargs or {}), lora)
    return LoraConfig(task_type=TASK_TYPE, r=lora.lora_r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                      target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets, bias="none",
                      use_rslora=lora.use_rslora, use_dora=lora.use_dora, modules_to_save=lora.lora_modules_to_save,
                      target_parameters=lora.lora_target_parameters)


def _skeleton(model: str, load_kwargs: dict):
    """``model``'s modules without its weights (on the meta device): their names and types cost no load. The
    revision, code (trust_remote_code) and so on are those the trainer loads."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from verifiers_rl.compat import without_zero3_init
    from verifiers_rl.core.models import WEIGHTS_ONLY

    config_kwargs = {key: value for key, value in load_kwargs.items() if key not in WEIGHTS_ONLY}
    config = AutoConfig.from_pretrained(model, **config_kwargs)
    # From the trainer under ZeRO-3, transformers would partition (and initialise) it: no data on the meta device.
    with torch.device("meta"), without_zero3_init():
        return AutoModelForCausalLM.from_config(config, trust_remote_code=load_kwargs.get("trust_remote_code", False))



def check_module_names(skeleton, lora: LoraArguments) -> None:
    """Each name of --lora_target_modules and --lora_modules_to_save matches a module of ``skeleton`` as peft matches
    a list (the whole name, or its end after a dot); a target must be a layer LoRA adapts. Unset targets: peft's
    default for the model type must exist."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS

    modules = dict(skeleton.named_modules())
    adaptable = {name for name, module in modules.items() if _adaptable(module)}
    layers = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in adaptable}))
    unset = lora.lora_target_modules is None and lora.lora_target_parameters is None
    if unset and skeleton.config.model_type not in DEFAULT_TARGETS:
        raise ValueError(f"--use_peft: peft has no default adapter modules for model type "
                         f"{skeleton.config.model_type!r}; name them with --lora_target_modules (its layers: "
                         f"{layers}).")
    head = skeleton.get_output_embeddings()
    for name in lora.lora_target_modules or ():
        if name != ALL_LINEAR and any(modules[key] is head for key in
                                      _check_name("lora_target_modules", name, modules, adaptable, layers)):
            raise ValueError(f"--lora_target_modules {name}: the output layer, whose log-probs the trainer computes "
                             "from its weight directly, so an adapter there would never train (TRL refuses it too). "
                             "Leave it out.")
    for name in lora.lora_modules_to_save or ():
        _check_name("lora_modules_to_save", name, modules, set(modules), layers)
    parameters = dict(skeleton.named_parameters(remove_duplicate=False))
    for name in lora.lora_target_parameters or ():
        matched = [key for key in parameters if key == name or key.endswith(f".{name}")]
        if not matched:
            raise ValueError(f"--lora_target_parameters {name}: no parameter of the model is named so (e.g. "
                             f"{next(iter(parameters))}).")
        _check_name("lora_target_parameters", matched[0].rsplit(".", 1)[0], modules, set(modules), layers)


def _check_name(flag: str, name: str, modules: dict, allowed: set[str], layers: str) -> list[str]:
    """The modules ``name`` matches (at least one, each in ``allowed``)."""
    matched = [key for key in modules if key == name or key.endswith(f".{name}")]
    if not matched:
        raise ValueError(f"--{flag} {name}: no module of the model is named so (its layers LoRA adapts: {layers}).")
    wrong = next((key for key in matched if key not in allowed), None)
    if wrong is not None:
        raise ValueError(f"--{flag} {name}: {wrong} is a {type(modules[wrong]).__name__}, which LoRA does not "
                         f"adapt; name its layers (those LoRA adapts: {layers}).")
    return matched


def check_peft_model(model, given=None) -> None:
    """Refuse adapters of ``model`` (a peft-wrapped model, however its ``peft_config`` was given) that the engine cannot
    sample from: peft's ``trainable_token_indices`` (its token adapters have no merged weight here), an adapter on the
    output layer, and on a model whose input and output embeddings share their weight (tie_word_embeddings) an adapter
    or a ``modules_to_save`` copy that trains one of the pair apart. ``given``: the ``peft_config`` as the user gave
    it, whose names a refusal quotes (peft rewrites a tied pair's names into the model's own)."""
    if not getattr(model, "peft_config", None):
        return
    from peft.utils.other import ModulesToSaveWrapper, TrainableTokensWrapper

    modules = {module: name for name, module in model.get_base_model().named_modules()}  # the model's own names
    tokens = [name for module, name in modules.items() if isinstance(module, TrainableTokensWrapper)]
    if tokens:
        raise ValueError(f"peft_config trainable_token_indices ({', '.join(tokens)}): the weight sync cannot merge "
                         "its token adapters into the engine's embedding. Leave it out, or train the embedding whole "
                         "(modules_to_save).")
    pair = (model.get_input_embeddings(), model.get_output_embeddings())
    if _is_adapter(pair[1]):
        raise ValueError(_head_refusal(given or next(iter(model.peft_config.values())),
                                       [modules[module] for module in pair]))
    if pair[1] is None or _original(pair[0]).weight is not _original(pair[1]).weight:
        return  # untied: each trains apart as the engine holds it
    names = [modules[module] for module in pair]
    for module, name in zip(pair, names):
        apart = isinstance(module, ModulesToSaveWrapper) and pair[0].weight is not pair[1].weight
        if _is_adapter(module) or apart:
            setting = "modules_to_save" if apart else _adapter_setting(module)
            given = name.rsplit(".", 1)[-1] + (f".{module.parameter_name}" if setting == "target_parameters" else "")
            raise ValueError(_tied_refusal(setting, given, names))


def check_peft_config(model, peft_config, load_kwargs: dict | None = None) -> None:
    """``check_peft_model`` on ``model`` (a folder, Hub id or loaded model; ``load_kwargs`` as ``peft_config_of``'s)
    wrapped by ``peft_config`` on the meta device: before TRL wraps it, whose own refusal of an adapter on the output
    layer names lm_head where ensure_weight_tying put it there from the input embedding the user named."""
    import copy

    import torch
    from peft import get_peft_model

    from verifiers_rl.compat import without_zero3_init

    if isinstance(model, str):
        skeleton = _skeleton(model, load_kwargs or {})
    else:
        with torch.device("meta"), without_zero3_init():  # as _skeleton: no partitioned init of meta weights
            skeleton = type(model)(copy.deepcopy(model.config))
    config = copy.deepcopy(peft_config)  # peft adds tied names to the config it wraps with
    if hasattr(config, "init_lora_weights"):
        config.init_lora_weights = True  # PiSSA, OLoRA, CorDA... need real weights; the modules wrapped are the same
    check_peft_model(get_peft_model(skeleton, config), peft_config)


def check_base_reference(config, beta: float, sync_ref_model: bool, copied: bool = False) -> None:
    """Refuse what of ``config`` (a ``LoraConfig``) changes the base layers under a KL term against the model with
    adapters disabled: trained biases (peft trains them in the base layers: the reference moves with the policy) and
    initializations that move part of the base weights into the adapters (the reference is the residual).
    (--sync_ref_model's copy of the trainable parameters holds them; ``copied``: TRL's copy of a PeftModel's given
    adapters, the reference, holds what the initialization moved; the command's adapters do neither.)"""
    if beta == 0.0 or sync_ref_model:
        return
    bias = getattr(config, "bias", "none")
    if bias != "none":
        raise ValueError(f"peft_config bias={bias!r} with beta {beta}: peft trains those biases in the base model "
                         "itself, which is also the KL reference (the model with its adapters disabled), so the "
                         "reference would move with the policy. Use bias='none', or beta=0.")
    init = getattr(config, "init_lora_weights", True)
    if not copied and isinstance(init, str) and init.startswith(BASE_CHANGING_INITS):
        raise ValueError(f"peft_config init_lora_weights={init!r} with beta {beta}: it moves part of each base "
                         "weight into the adapters, so the KL reference (the model with its adapters disabled) is "
                         "the residual, not the model you started from. Use another init_lora_weights, or beta=0.")


BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")  # peft's initializations that rewrite the base weights


def _head_refusal(config, pair: list[str]) -> str:
    """The refusal of an adapter on the output layer (``pair``: the input and output embeddings' names), naming the
    ``target_modules`` entries of ``config`` that put it there."""
    from peft.tuners.tuners_utils import check_target_module_exists

    given = [name for name in pair if check_target_module_exists(config, name)] or pair[1:]
    short = [name.rsplit(".", 1)[-1] for name in given]
    tying = (f" (ensure_weight_tying gives the tied {pair[1]} the adapter of {pair[0]})"
             if getattr(config, "ensure_weight_tying", False) else "")
    whole = f"modules_to_save=['{short[0]}']" + (" with ensure_weight_tying=True" if tying else "")
    return (f"--lora_target_modules {' '.join(short)} (peft_config's target_modules): an adapter on the output layer "
            f"{pair[1]}{tying}, whose log-probs the trainer computes from its weight directly, so the adapter would "
            f"never train (TRL refuses it too). Leave {' and '.join(short)} out of target_modules, or train the "
            f"embedding whole ({whole}).")


def _original(module):
    """The model's own module under a peft wrapper (an adapter layer's base layer, a ``modules_to_save`` original)."""
    if _is_adapter(module):
        return module.get_base_layer()
    return getattr(module, "original_module", module)


def _is_adapter(module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer)


def _adapter_setting(module) -> str:
    from peft.tuners.lora import ParamWrapper

    return "target_parameters" if isinstance(module, ParamWrapper) else "target_modules"


def _tied_refusal(setting: str, name: str, tied: list[str]) -> str:
    """The refusal of ``setting`` (a ``LoraConfig`` key) naming ``name``, one of the ``tied`` embeddings."""
    fix = (" (from Python, LoraConfig(ensure_weight_tying=True) trains the pair as one)"
           if setting == "modules_to_save" else "")
    return (f"--lora_{setting} {name} (peft_config's {setting}): the model ties {' and '.join(tied)} "
            "(tie_word_embeddings); training one apart unties them, while the engine samples from their one shared "
            f"matrix (rollouts off-policy, the weight sync probe fails). Leave it out{fix}, or train a model whose "
            "embeddings are untied.")


def _adaptable(module) -> bool:
    """Whether LoRA can put an adapter on ``module`` (peft's layer types)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d,
                               torch.nn.Conv3d, torch.nn.MultiheadAttention, Conv1D))

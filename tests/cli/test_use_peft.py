"""LoRA from the command (TRL's flags: --use_peft, --lora_r, ...): the flags build the peft_config RLTrainer takes
from Python; only the adapters train, checkpoints and the output folder hold them, and a resumed command ends with
the uninterrupted run's adapters (tests/training/test_peft.py checks the same through Python)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from verifiers_rl.cli.train import build_parser, build_trainer, main

from tests.cli.test_train_errors import refusal
from tests.helpers.launches import with_flags

LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj",
        "--lora_modules_to_save", "norm"]


def command(tiny_model_dir, output_dir, *flags, lora=tuple(LORA)) -> list[str]:
    # lora_dropout stays at TRL's 0.05: a resume must restore its random state too.
    return with_flags(["--model", tiny_model_dir, "--output_dir", str(output_dir), "--max_steps", "3",
                       "--rollouts_per_step", "4", "--num_generations", "2", "--print_samples_every", "0",
                       "--learning_rate", "5e-2", "--save_strategy", "steps", "--save_steps", "1", *lora], list(flags))


def train(argv: list[str]):
    """The command's trainer for ``argv``, trained (``main`` without the final save), and its parameters before."""
    parser = build_parser()
    script_args, config = parser.parse_args_and_config(args=argv)
    trainer, live, _ = build_trainer(parser, argv, script_args, config)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    try:
        trainer.train()
    finally:
        live["engine"].close()
    return trainer, before


def test_use_peft_trains_only_the_adapters_and_a_resumed_command_ends_with_them(tiny_model_dir, tmp_path, capsys):
    trainer, before = train(command(tiny_model_dir, tmp_path / "full"))
    after = dict(trainer.model.named_parameters())
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    # The base weights bitwise as loaded; lora_A, lora_B and the --lora_modules_to_save copy of the norm moved.
    assert moved and all("lora_" in name or "modules_to_save" in name for name in moved), sorted(moved)
    assert {"lora_A", "lora_B", "modules_to_save"} <= {part for name in moved for part in name.split(".")}
    saved = json.loads((tmp_path / "full" / "checkpoint-1" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], sorted(saved["target_modules"]), saved["modules_to_save"]) == (
        4, 8, ["q_proj", "v_proj"], ["norm"])
    adapters = load_file(tmp_path / "full" / "checkpoint-1" / "adapter_model.safetensors")
    assert adapters and all("lora_" in name or name.endswith("norm.weight") for name in adapters), sorted(adapters)

    resumed = tmp_path / "resumed"
    argv = command(tiny_model_dir, resumed, "--resume_from_checkpoint", str(tmp_path / "full" / "checkpoint-1"))
    assert main(argv) == 0
    final = load_file(resumed / "adapter_model.safetensors")  # the output folder: the adapters, not the model
    expected = get_peft_model_state_dict(trainer.model)
    assert sorted(final) == sorted(expected)
    assert all(torch.equal(final[name], expected[name]) for name in expected)

    # Resumed without its flags: the line says which flags rebuild its adapters (it named only RLTrainer's peft_config).
    plain = command(tiny_model_dir, tmp_path / "plain", "--resume_from_checkpoint",
                    str(tmp_path / "full" / "checkpoint-1"), lora=())
    capsys.readouterr()
    assert main(plain) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("verifiers-rl train: error: Cannot resume from ") and last.endswith(
        "on the command: --use_peft --lora_r 4 --lora_alpha 8 --lora_target_modules q_proj v_proj "
        "--lora_modules_to_save norm), or start a new run."), last


def test_a_model_with_its_own_code_is_read_with_trust_remote_code(tiny_model_dir, tmp_path, capsys):
    """The adapters' module names are checked on the model the trainer loads: with --trust_remote_code, its own
    code (the check read the config without it and failed on every such model). Its type is none peft knows, so
    peft has no default modules for it: refused naming --lora_target_modules."""
    folder = tmp_path / "custom"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "configuration_x.py").write_text("from transformers import LlamaConfig\n\n\n"
                                               "class XConfig(LlamaConfig):\n    model_type = 'xllama'\n")
    (folder / "modeling_x.py").write_text("from transformers import LlamaForCausalLM\n\n"
                                          "from .configuration_x import XConfig\n\n\n"
                                          "class XForCausalLM(LlamaForCausalLM):\n    config_class = XConfig\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="xllama", auto_map={"AutoConfig": "configuration_x.XConfig",
                                                 "AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    argv = ["--model", str(folder), "--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--use_peft",
            "--trust_remote_code"]
    assert refusal(argv, capsys) == ("--use_peft: peft has no default adapter modules for model type 'xllama'; name "
                                     "them with --lora_target_modules (its layers: down_proj, embed_tokens, gate_proj, "
                                     "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj).")


def test_lora_target_parameters_trains_adapters_of_parameters_the_engine_gets_merged(tiny_model_dir, tmp_path):
    # TRL's --lora_target_parameters (peft's target_parameters: experts' stacked weights; here a dense one).
    argv = command(tiny_model_dir, tmp_path / "params", "--max_steps", "2",
                   "--weight_sync_probe_every", "1",
                   lora=["--use_peft", "--lora_dropout", "0", "--lora_target_parameters", "mlp.down_proj.weight"])
    trainer, before = train(argv)
    after = dict(trainer.model.named_parameters())
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and all("lora_" in name for name in moved), sorted(moved)
    # Beside peft's default modules (q_proj v_proj: --lora_target_modules unset), as TRL's flag gives them.
    assert {name.split(".")[-4] for name in moved} == {"down_proj", "q_proj", "v_proj"}, sorted(moved)
    # The second sync holds the trained adapters: the engine samples base + merged (it would differ otherwise).
    gaps = [entry["weight_sync_probe_gap"] for entry in trainer.state.log_history if "weight_sync_probe_gap" in entry]
    assert len(gaps) == 2 and max(gaps) < 1e-5, gaps


def test_use_peft_on_a_folder_of_adapters_trains_them_on_their_own_base(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """--model <a run's adapters> --use_peft trained new adapters over the old ones merged into a folder of this
    machine's cache, which the new adapter_config.json named as base_model_name_or_path: they loaded nowhere else.
    The folder's adapters now train on over their own base model (the KL reference: them as given, as TRL)."""
    monkeypatch.setenv("VERIFIERS_RL_CACHE", str(tmp_path / "cache"))  # the merged folder the engine loads
    first = tmp_path / "first"
    assert main(command(tiny_model_dir, first, "--max_steps", "1")) == 0
    argv = command(str(first), tmp_path / "second", "--max_steps", "2", "--beta", "0.1",
                   "--logging_steps", "1", lora=["--use_peft", "--lora_dropout", "0"])  # theirs is 0.05
    trainer, before = train(argv)
    given = load_file(first / "adapter_model.safetensors")
    start = {name.replace(".modules_to_save", "").replace(".default", ""): p  # as peft saves them
             for name, p in before.items() if ".default." in name}
    assert sorted(start) == sorted(given) and all(torch.equal(start[name], given[name]) for name in given)
    kl = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    assert kl[0] == 0.0 and kl[1] > 0.0, kl  # step 1: the policy is its reference
    trainer.save_model(str(tmp_path / "second"))
    saved = json.loads((tmp_path / "second" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == tiny_model_dir
    # Their shape is theirs: a flag that would shape others is refused naming theirs.
    assert refusal([*argv, "--lora_r", "8"], capsys) == (
        f"--lora_r 8: --model {first} holds LoRA adapters (--use_peft --lora_r 4 --lora_alpha 8 --lora_target_modules "
        "q_proj v_proj --lora_modules_to_save norm), which --use_peft trains on as they are. Leave the flag out, or "
        "train new adapters from their base model.")


def test_a_resume_of_adapters_trained_on_takes_the_kl_reference_from_the_checkpoint(tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    """Adapters trained on (--model <adapters> --use_peft, --beta > 0) have TRL's frozen copy of them as the KL
    reference. The checkpoint keeps it (ref/: peft saves every adapter, as large as the adapters) and the resume
    loads it from there, not from --model's adapters: a folder trained again since (here another of the same shape)
    still resumes to the uninterrupted run's adapters."""
    monkeypatch.setenv("VERIFIERS_RL_CACHE", str(tmp_path / "cache"))
    first, other = tmp_path / "first", tmp_path / "other"
    assert main(command(tiny_model_dir, first, "--max_steps", "1")) == 0
    assert main(command(tiny_model_dir, other, "--max_steps", "1", "--seed", "5")) == 0  # same shape, other values
    on = ["--beta", "0.5", "--use_peft", "--lora_dropout", "0"]
    assert main(command(str(first), tmp_path / "full", "--max_steps", "2", lora=on)) == 0
    checkpoint = tmp_path / "full" / "checkpoint-1"
    assert load_file(checkpoint / "ref" / "adapter_model.safetensors").keys() == load_file(
        first / "adapter_model.safetensors").keys()
    resumed = ["--max_steps", "2", "--resume_from_checkpoint", str(checkpoint)]
    assert main(command(str(other), tmp_path / "resumed", *resumed, lora=on)) == 0
    final, expected = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("resumed", "full"))
    assert sorted(final) == sorted(expected)
    assert all(torch.equal(final[name], expected[name]) for name in expected)


def test_each_flag_that_rebuilds_a_folders_adapters_is_refused_beside_them():
    """The flags the refusal names to rebuild a folder's adapters (command_flags) and the flags it refuses beside such
    a folder (SHAPE_FLAGS) were two lists written out apart; the second is the first and --lora_task_type (in no
    adapter signature). Each flag of the first, given beside a folder of adapters, is refused by name."""
    from verifiers_rl.config.lora import SHAPE_FLAGS, LoraArguments, check_continued_flags, command_flags
    from verifiers_rl.training.run_state import adapter_signature

    signature = adapter_signature({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                   "target_parameters": ["mlp.experts.gate_up_proj"], "modules_to_save": ["norm"],
                                   "bias": "none", "use_dora": True, "use_rslora": True})
    named = [word[2:] for word in command_flags(signature).split() if word.startswith("--")]
    assert named[0] == "use_peft" and set(named[1:]) == set(SHAPE_FLAGS) - {"lora_task_type"}
    for flag in [*named[1:], "lora_task_type"]:
        with pytest.raises(ValueError, match=f"^--{flag} .*: --model adapters holds LoRA adapters"):
            check_continued_flags(LoraArguments(use_peft=True), {flag}, "adapters", signature)

"""LoRA training through RLTrainer: only the adapters move, the KL reference is the adapter-free base model, the
engine receives the merged weights, and forwarding each group's prompt once (shared-prefix rows) gives the same
adapters as one row per sequence."""

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from verifiers_rl.config import RLConfig
from verifiers_rl.inference import EmbeddedEngine
from verifiers_rl.rollouts import write_rollouts
from verifiers_rl.synthetic import random_rollouts
from verifiers_rl.trainer import RLTrainer


def train_lora(work, tiny_model_dir, share_prompt_training):
    args = RLConfig(output_dir=str(work / f"out_{share_prompt_training}"), use_cpu=True, report_to="none",
                    save_strategy="no", max_steps=2, rollouts_path=str(work / "r.jsonl"), rollouts_per_step=8,
                    max_seq_len=64, learning_rate=5e-2, beta=0.1, logging_steps=1, gradient_checkpointing=False,
                    disable_tqdm=True, share_prompt_training=share_prompt_training)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                        peft_config=lora)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer, before


@pytest.fixture(scope="module")
def lora_work(tmp_path_factory):
    work = tmp_path_factory.mktemp("lora")
    write_rollouts(work / "r.jsonl", random_rollouts(4, 4, vocab_size=390, seed=11, shared_turn_fraction=0.5))
    return work


@pytest.fixture(scope="module")
def lora_run(lora_work, tiny_model_dir):
    return train_lora(lora_work, tiny_model_dir, "on")


def test_only_the_adapters_train_and_the_kl_reference_is_the_base_model(lora_run):
    trainer, before = lora_run
    after = dict(trainer.model.named_parameters())
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and all("lora_" in name for name in moved), sorted(moved)[:5]
    assert any("lora_A" in name for name in moved) and any("lora_B" in name for name in moved)
    kl = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    # Step 1: lora_B starts at zero, so the policy IS the base model and the KL is exactly 0; step 2 has moved.
    assert kl[0] == 0.0 and kl[1] > 0.0, kl


def test_the_engine_gets_the_merged_weights(lora_run, tiny_model_dir):
    trainer, before = lora_run
    engine = EmbeddedEngine(tiny_model_dir)
    trainer.engine = engine
    trainer.state.global_step = 2
    trainer.sync_weights()
    # The post-sync probe compares the engine's log-probs with the trainer's (adapters applied): equal means the
    # engine holds base + B A * alpha / r.
    assert trainer._metrics["train"]["weight_sync_probe_gap"][-1] < 1e-5
    assert engine.policy_version == 2
    name = "model.layers.0.self_attn.q_proj.weight"
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())[name]
    assert not torch.equal(dict(engine.model.named_parameters())[name], base)  # the adapters are merged in
    # ... and out of place: the trained model still holds the untouched base weight beside its adapters.
    peft_name = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert torch.equal(dict(trainer.model.named_parameters())[peft_name], before[peft_name])
    assert torch.equal(before[peft_name], base)


def test_shared_prompts_give_the_unshared_adapters(lora_run, lora_work, tiny_model_dir):
    """Two LoRA steps with KL (the reference forward runs with the adapters disabled) over shared-prefix rows equal
    the same steps with one row per sequence: adapters, losses and KL."""
    shared, _ = lora_run
    plain, _ = train_lora(lora_work, tiny_model_dir, "off")
    forwarded = {name: [e["tokens_forwarded"] for e in t.state.log_history if "tokens_forwarded" in e]
                 for name, t in (("shared", shared), ("plain", plain))}
    assert all(s < p for s, p in zip(forwarded["shared"], forwarded["plain"], strict=True)), forwarded
    plain_params = dict(plain.model.named_parameters())
    for name, param in shared.model.named_parameters():
        if "lora_" in name:
            param, reference = param.detach(), plain_params[name].detach()
            assert float((param - reference).abs().max() / reference.abs().max()) < 2e-5, name  # fp32 layouts; Adam magnifies rounding in near-zero gradient entries
    for key in ("loss", "kl"):
        got = [e[key] for e in shared.state.log_history if key in e]
        want = [e[key] for e in plain.state.log_history if key in e]
        assert len(got) == len(want) == 2
        for g, w in zip(got, want):
            assert abs(g - w) <= 1e-5 * max(abs(w), 1e-3), (key, got, want)

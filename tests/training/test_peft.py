"""LoRA training through RLTrainer: only the adapters move, the KL reference is the adapter-free base model, the
engine receives the merged weights, and forwarding each group's prompt once (shared-prefix rows) gives the same
adapters as one row per sequence."""

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.inference import EmbeddedEngine
from verifiers_rl.core.rollout import write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts
from verifiers_rl.training.trainer import RLTrainer


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


def test_sync_ref_model_mixes_the_adapters_and_resumes_exactly(lora_work, tiny_model_dir, tmp_path):
    """--sync_ref_model under LoRA (TRL refuses it): the reference is the base model with a copy of the adapters,
    copy = alpha * adapters + (1 - alpha) * copy after every ref_model_sync_steps-th step; the KL is taken against
    it; a checkpoint keeps the copy, so a resumed run ends with the uninterrupted run's adapters."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    class Adapters(TrainerCallback):  # the policy's adapters after each optimizer step
        def __init__(self):
            self.after = {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.after[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def trainer(name, steps, sync=True, **extra):
        args = RLConfig(output_dir=str(tmp_path / name), use_cpu=True, report_to="none", max_steps=steps,
                        rollouts_path=str(lora_work / "r.jsonl"), rollouts_per_step=4, max_seq_len=64,
                        learning_rate=5e-2, beta=0.5, logging_steps=1, gradient_checkpointing=False, disable_tqdm=True,
                        save_strategy="steps", save_steps=1, **extra,  # the mix's knobs only with sync_ref_model
                        **(dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5) if sync else {}))
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        seen = Adapters()
        made = RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                         peft_config=lora, callbacks=[seen])
        made.seen = seen
        return made

    full = trainer("full", 3)
    initial = {n: p.detach().clone() for n, p in full.model.named_parameters() if p.requires_grad}
    full.train()
    expected = dict(initial)
    for step in (1, 2, 3):
        expected = {n: 0.5 * full.seen.after[step][n] + 0.5 * expected[n] for n in initial}
        if step == 1:
            saved = load_file(tmp_path / "full" / "checkpoint-1" / "reference_model.safetensors")
            assert all(torch.allclose(saved[n.replace(".", "__")], expected[n], atol=1e-7) for n in initial)
    copies = dict(full.adapter_reference.named_buffers())
    assert all(torch.allclose(copies[n.replace(".", "__")], expected[n], atol=1e-7) for n in initial)

    plain = trainer("plain", 2, sync=False)
    plain.train()
    kl = {name: [e["kl"] for e in t.state.log_history if "kl" in e] for name, t in (("sync", full), ("plain", plain))}
    assert kl["sync"][0] == kl["plain"][0] == 0.0  # step 1: the reference is the base model either way
    assert abs(kl["sync"][1] - kl["plain"][1]) > 1e-6, kl  # step 2: against the mixed adapters, not the base

    resumed = trainer("resumed", 3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    final = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert all(torch.equal(final[n], full.seen.after[3][n]) for n in initial)


@pytest.mark.parametrize("resumed_with", ["no peft_config", "another rank"])
def test_a_lora_checkpoint_resumed_without_its_adapters_is_refused_naming_peft_config(lora_work, tiny_model_dir,
                                                                                      tmp_path, resumed_with):
    """HF failed opaquely here ("Can't find a checkpoint index", or a size mismatch per tensor)."""
    from verifiers_rl.training.run_state import CheckpointError

    def trainer(name, lora):
        args = RLConfig(output_dir=str(tmp_path / name), use_cpu=True, report_to="none", max_steps=2,
                        rollouts_path=str(lora_work / "r.jsonl"), rollouts_per_step=8, max_seq_len=64,
                        gradient_checkpointing=False, disable_tqdm=True, save_strategy="steps", save_steps=1)
        return RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                         peft_config=lora)

    trainer("saved", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)).train()
    other = None if resumed_with == "no peft_config" else LoraConfig(r=8, target_modules=["v_proj", "q_proj"])
    expected = "this run trains the whole model" if other is None else "'r': 4, .* this run's peft_config .*'r': 8"
    with pytest.raises(CheckpointError, match=rf"^Cannot resume from .*checkpoint-1: .*{expected}"):
        trainer("resumed", other).train(resume_from_checkpoint=str(tmp_path / "saved" / "checkpoint-1"))


def test_a_folder_of_adapters_as_model_trains_from_the_merged_weights_with_them_as_kl_reference(
        lora_work, tiny_model_dir, tmp_path, monkeypatch):
    """--model on a peft_config run's output (adapters only) starts from its base model with the adapters merged,
    as the engine and `verifiers-rl eval` load it, and the KL reference (which TRL reloads from the policy's path)
    is that model too, not the bare base model. transformers failed on the folder: no model_type in config.json."""
    import copy

    from peft import get_peft_model

    from verifiers_rl.core.models import resolve_model

    monkeypatch.setenv("VERIFIERS_RL_CACHE", str(tmp_path / "cache"))  # the merged folder is written there
    lora = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapters = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    adapters.save_pretrained(tmp_path / "adapters")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "adapters")
    merged = dict(copy.deepcopy(adapters).merge_and_unload().named_parameters())
    model = resolve_model(str(tmp_path / "adapters"))
    assert resolve_model(str(tmp_path / "adapters")) == model  # merged once
    args = RLConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no",
                    max_steps=2, rollouts_path=str(lora_work / "r.jsonl"), rollouts_per_step=8, max_seq_len=64,
                    learning_rate=5e-2, beta=0.5, logging_steps=1, gradient_checkpointing=False, disable_tqdm=True)
    trainer = RLTrainer(model, args, processing_class=AutoTokenizer.from_pretrained(model))
    start = dict(trainer.model.named_parameters())
    assert all(torch.equal(start[name], merged[name]) for name in merged)
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    query = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(start[query], base[query])
    trainer.train()
    kl = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    assert kl[0] == 0.0 and kl[1] > 0.0, kl  # step 1: the policy is its reference (against the base: kl > 0)


def test_adapters_on_an_untied_input_embedding_reach_the_engine(lora_work, tmp_path):
    """LoRA on embed_tokens (peft's lora.Embedding has no num_embeddings): the post-sync probe raised an
    AttributeError out of the first weight sync; the engine gets the merged embedding like the linear layers'."""
    from verifiers_rl.core.models import build_tiny_model

    untied = str(build_tiny_model(tmp_path / "untied", tie_word_embeddings=False))
    args = RLConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no", max_steps=1,
                    rollouts_path=str(lora_work / "r.jsonl"), rollouts_per_step=8, max_seq_len=64,
                    learning_rate=5e-2, gradient_checkpointing=False, disable_tqdm=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], lora_dropout=0.0)
    trainer = RLTrainer(untied, args, processing_class=AutoTokenizer.from_pretrained(untied), peft_config=lora)
    trainer.train()
    trainer.engine = EmbeddedEngine(untied)
    trainer.state.global_step = 1
    trainer.sync_weights()
    assert trainer._metrics["train"]["weight_sync_probe_gap"][-1] < 1e-5
    name = "model.embed_tokens.weight"
    base = dict(AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32).named_parameters())[name]
    assert not torch.equal(dict(trainer.engine.model.named_parameters())[name], base)  # the embedding's adapters


def replay_args(lora_work, output_dir):
    return RLConfig(output_dir=str(output_dir), use_cpu=True, report_to="none", save_strategy="no", max_steps=1,
                    rollouts_path=str(lora_work / "r.jsonl"), rollouts_per_step=8, max_seq_len=64,
                    gradient_checkpointing=False, disable_tqdm=True)


@pytest.mark.parametrize("given", ["peft_config", "PeftModel"])
@pytest.mark.parametrize("lora, message", ids=["target_modules", "modules_to_save lm_head", "modules_to_save embed"],
                         argvalues=[
    (dict(target_modules=["q_proj", "embed_tokens"]), r"--lora_target_modules embed_tokens \(peft_config's "
                                                      r"target_modules\): the model ties model.embed_tokens and "
                                                      r"lm_head \(tie_word_embeddings\)"),
    (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), r"--lora_modules_to_save lm_head \(peft_config's "
                                                                  r"modules_to_save\): the model ties"),
    (dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"]), r"--lora_modules_to_save embed_tokens "),
])
def test_adapters_that_untie_tied_embeddings_are_refused_from_python(lora_work, tiny_model_dir, tmp_path, lora,
                                                                     message, given):
    """The tiny model ties lm_head to embed_tokens: adapters on one of them (or a modules_to_save copy of one) trained
    the pair apart while the engine samples from their one matrix, and the weight sync probe failed every step (gaps
    of 3-67 nats) as training went on off-policy. The command refused it; RLTrainer(peft_config=...) did not."""
    from peft import get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **lora)
    model = tiny_model_dir if given == "peft_config" else get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), config)
    with pytest.raises(ValueError, match=f"^{message}"):
        RLTrainer(model, replay_args(lora_work, tmp_path),
                  processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                  peft_config=config if given == "peft_config" else None)


def test_a_tied_pair_trained_as_one_is_accepted(lora_work, tiny_model_dir, tmp_path):
    """peft's ensure_weight_tying keeps the modules_to_save copies of the tied pair one matrix: as the engine holds
    it, so the trained policy is what the engine samples (the post-sync probe)."""
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"], modules_to_save=["lm_head"],
                        ensure_weight_tying=True)
    args = replay_args(lora_work, tmp_path)
    args.learning_rate = 5e-2
    trainer = RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                        peft_config=config)
    trainer.train()
    trainer.engine = EmbeddedEngine(tiny_model_dir)
    trainer.sync_weights()
    assert trainer._metrics["train"]["weight_sync_probe_gap"][-1] < 1e-5
    name = "model.embed_tokens.weight"
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).named_parameters())[name]
    assert not torch.equal(dict(trainer.engine.model.named_parameters())[name], base)  # the trained pair reached it


@pytest.mark.parametrize("given", ["peft_config", "PeftModel"])
def test_a_tied_adapter_on_the_output_layer_is_refused_naming_the_module_given(lora_work, tiny_model_dir, tmp_path,
                                                                              given):
    """ensure_weight_tying with embed_tokens in target_modules: peft gives the tied lm_head the same adapter, and TRL
    refused it telling the user to remove 'lm_head' from target_modules, a name they never gave."""
    from peft import get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], ensure_weight_tying=True)
    model = tiny_model_dir if given == "peft_config" else get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), config)
    with pytest.raises(ValueError, match=r"^--lora_target_modules embed_tokens \(peft_config's target_modules\): an "
                                         r"adapter on the output layer lm_head \(ensure_weight_tying .*Leave "
                                         r"embed_tokens out of target_modules, or train the embedding whole "
                                         r"\(modules_to_save=\['embed_tokens'\] with ensure_weight_tying=True\)\.$"):
        RLTrainer(model, replay_args(lora_work, tmp_path),
                  processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                  peft_config=config if given == "peft_config" else None)


@pytest.mark.parametrize("tied", [True, False])
def test_trainable_token_indices_are_refused_naming_them(lora_work, tiny_model_dir, tmp_path, tied):
    """peft's trainable_token_indices (a few rows of the embedding trained): the first step failed with an
    AttributeError in the output layer (tied) or the first weight sync with an unknown weight
    model.embed_tokens.token_adapter.weight (untied)."""
    from verifiers_rl.core.models import build_tiny_model

    model = tiny_model_dir if tied else str(build_tiny_model(tmp_path / "untied", tie_word_embeddings=False))
    config = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [5, 6]})
    wrapped = "model.embed_tokens, lm_head" if tied else "model.embed_tokens"  # peft ties the output layer's too
    with pytest.raises(ValueError, match=rf"^peft_config trainable_token_indices \({wrapped}\): the weight sync "
                                         "cannot merge"):
        RLTrainer(model, replay_args(lora_work, tmp_path), processing_class=AutoTokenizer.from_pretrained(model),
                  peft_config=config)


def test_a_peft_model_given_with_trained_adapters_is_its_own_kl_reference(lora_work, tiny_model_dir, tmp_path):
    """TRL: a PeftModel passed with trained adapters (beta != 0) gets a frozen copy of them ("ref") as its KL
    reference, so the first step's KL is 0. Ours took the base model with adapters disabled: KL > 0 from step 1,
    pulling the adapters back towards nothing."""
    from peft import get_peft_model

    trained = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), trained)
    args = replay_args(lora_work, tmp_path)
    args.max_steps, args.beta, args.learning_rate, args.logging_steps = 2, 0.5, 5e-2, 1
    trainer = RLTrainer(model, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
    trainer.train()
    kl = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    assert kl[0] == 0.0 and kl[1] > 0.0, kl  # against the base model step 1's KL is > 0


@pytest.mark.parametrize("init", ["pissa", "olora", "corda"])
def test_the_check_before_trl_wraps_whatever_the_adapters_initialization(tiny_model_dir, init):
    """check_peft_config wraps the model's weightless skeleton: an initialization computed from the weights (PiSSA's
    and OLoRA's decompositions, CorDA's preprocessing) failed there, refusing a peft_config TRL takes."""
    from verifiers_rl.config.lora import check_peft_config

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=init)
    check_peft_config(tiny_model_dir, config)
    assert config.init_lora_weights == init  # the caller's config as given


@pytest.mark.parametrize("setting, message", [
    (dict(bias="lora_only"), r"bias='lora_only' with beta 0.1: peft trains those biases in the base model itself"),
    (dict(bias="all"), r"bias='all' with beta 0.1: peft trains those biases in the base model itself"),
    (dict(init_lora_weights="pissa"), r"init_lora_weights='pissa' with beta 0.1: it moves part of each base weight"),
    (dict(init_lora_weights="olora"), r"init_lora_weights='olora' with beta 0.1: it moves part of each base weight"),
])
def test_adapters_that_change_the_base_model_under_a_kl_term_are_refused(lora_work, tiny_model_dir, tmp_path,
                                                                           setting, message):
    """The KL reference under LoRA is the model with adapters disabled. peft's bias='lora_only' / 'all' trains the
    biases in the base layers (on a model with attention biases the reference moved with the policy: its q_proj/v_proj
    biases changed after 2 steps); PiSSA / OLoRA move part of each base weight into the adapters (the reference was
    the residual: KL 1.2e-3 at step 1 where it is 0). Both were silent."""
    args = replay_args(lora_work, tmp_path)
    args.beta = 0.1
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **setting)
    with pytest.raises(ValueError, match=rf"^peft_config {message}.* or beta=0\.$"):
        RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                  peft_config=config)


def test_a_peft_model_given_with_pissa_adapters_keeps_them_as_its_reference(lora_work, tiny_model_dir, tmp_path):
    """Given as a PeftModel, PiSSA's adapters have TRL's frozen copy as the reference (residual + copy = the start
    model): accepted, the first step's KL 0, where a peft_config's PiSSA is refused beside beta."""
    from peft import get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="pissa")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config)
    args = replay_args(lora_work, tmp_path)
    args.beta, args.logging_steps = 0.1, 1
    trainer = RLTrainer(model, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
    trainer.train()
    assert [entry["kl"] for entry in trainer.state.log_history if "kl" in entry] == [0.0]


def reference_logprobs_of(lora_work, tiny_model_dir, tmp_path, lora_dropout):
    """The KL reference log-probs of step 1 (as a custom loss receives them) for trained adapters given as a
    PeftModel with ``lora_dropout``: the same adapters whatever the dropout (seeded)."""
    from peft import get_peft_model

    torch.manual_seed(0)
    trained = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                         lora_dropout=lora_dropout)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), trained)
    args = replay_args(lora_work, tmp_path / str(lora_dropout))
    args.beta = 0.5
    seen = []

    def loss_fn(inputs):
        seen.append(inputs.ref_logps.detach().clone())
        return inputs.aggregate(-inputs.logps * inputs.advantages)

    RLTrainer(model, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir), loss_fn=loss_fn).train()
    return seen


def test_the_kl_reference_of_adapters_given_trained_is_computed_without_dropout(lora_work, tiny_model_dir, tmp_path):
    """TRL's frozen copy of adapters given trained is the policy's own forward: in train mode its lora_dropout
    made the reference log-probs noisy (KL 2.8e-5 at step 1 at the default 0.05), unlike TRL's separate reference
    model, which runs in eval mode."""
    noisy, plain = (reference_logprobs_of(lora_work, tiny_model_dir, tmp_path, p) for p in (0.5, 0.0))
    assert len(noisy) == len(plain) > 0
    assert all(torch.equal(a, b) for a, b in zip(noisy, plain))


def test_a_folder_of_adapters_given_by_path_from_python_trains_as_from_the_command(lora_work, tiny_model_dir,
                                                                                   tmp_path, monkeypatch):
    """RLTrainer("<a folder of adapters>") failed inside TRL (the folder's config.json has no model_type), which the
    command reads as their merged weights: so does RLTrainer now; beside a peft_config it is refused, saying how to
    train those adapters on or new ones over them."""
    from peft import get_peft_model

    monkeypatch.setenv("VERIFIERS_RL_CACHE", str(tmp_path / "cache"))  # the merged folder is written there
    lora = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj"], init_lora_weights=False)
    adapters = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    adapters.save_pretrained(tmp_path / "adapters")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "adapters")
    merged = dict(adapters.merge_and_unload().named_parameters())
    folder = str(tmp_path / "adapters")
    trainer = RLTrainer(folder, replay_args(lora_work, tmp_path / "out"))
    start = dict(trainer.model.named_parameters())
    assert sorted(start) == sorted(merged) and all(torch.equal(start[name], merged[name]) for name in merged)
    with pytest.raises(ValueError, match=r"^peft_config beside model='.*adapters', a folder of LoRA adapters: to "
                                         r"train those adapters on, pass PeftModel.from_pretrained"):
        RLTrainer(folder, replay_args(lora_work, tmp_path / "out"), peft_config=LoraConfig(r=4))

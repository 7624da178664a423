"""Weight sync: bucketed streaming of the full weights, LoRA merged, tied embeddings once, the embedded
engine's streaming load, the post-sync log-prob probe, and errors that reach every rank.

Single-process tests run in-process. The multi-process checks (ZeRO-3, 2 processes) share ONE launch of
``tests/distributed/weight_sync_run.py``.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.inference import EmbeddedEngine
from verifiers_rl.core.models import build_tiny_model
from verifiers_rl.core.rollout import write_rollouts
from verifiers_rl.rollouts.synthetic import random_rollouts
from verifiers_rl.training.trainer import RLTrainer
from verifiers_rl.training.weight_stream import (
    GatherStats,
    WeightSyncError,
    WeightSyncWarning,
    compare_logprobs,
    gathered_named_weights,
    hf_name,
    plan_buckets,
    probe_token_ids,
)

ROOT = Path(__file__).resolve().parents[2]
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-untied"), tie_word_embeddings=False, seed=1))


def load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def stream(model, bucket_bytes, stats=None):
    return [(name, t.clone()) for name, t in gathered_named_weights(model, bucket_bytes, is_main=True, zero3=False,
                                                                     stats=stats)]


def perturb(model, seed, scale=0.5):
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * scale)


# --- pure parts ---------------------------------------------------------------------------------------------------


def test_plan_buckets():
    assert plan_buckets([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert plan_buckets([4, 10, 4, 1], 8) == [[0], [1], [2, 3]]  # an item larger than the bucket goes alone
    assert plan_buckets([4, 4, 4], 0) == [[0], [1], [2]]  # 0: one at a time
    assert plan_buckets([4, 4, 4], 1 << 30) == [[0, 1, 2]]
    assert plan_buckets([], 8) == []


def test_names_and_probe_helpers(tiny_model_dir):
    assert hf_name("module._orig_mod.model.norm.weight") == "model.norm.weight"
    assert hf_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = probe_token_ids(tokenizer, 32, vocab_size=len(tokenizer))
    assert len(ids) == 32 and ids == probe_token_ids(tokenizer, 32, vocab_size=len(tokenizer))
    result = compare_logprobs([-1.0, -2.0, -3.0], [-1.0, -2.5, float("nan")])
    assert result.worst_position == 3 and result.max_gap == float("inf")  # NaN counts as the worst gap
    assert compare_logprobs([-1.0, -2.0], [-1.0, -2.25]).worst_position == 2
    with pytest.raises(ValueError, match="2 probe log-probs for 3"):
        compare_logprobs([-1.0] * 3, [-1.0] * 2)


# --- the stream, single process -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_stream_is_the_full_state_dict_for_every_bucket_size(tiny_model_dir, untied_model_dir, tied):
    model = load(tiny_model_dir if tied else untied_model_dir)
    expected = dict(model.named_parameters())
    # A tied output layer is the input embedding: named_parameters lists it once, under the embedding's name.
    assert ("lm_head.weight" in expected) == (not tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    for bucket_bytes in (0, 4096, 65536, 1 << 30):
        stats = GatherStats()
        pairs = stream(model, bucket_bytes, stats)
        assert [name for name, _ in pairs] == list(expected)
        assert all(torch.equal(tensor, expected[name]) for name, tensor in pairs)
        assert stats.tensors == len(expected)
        assert stats.gathered_bytes == sum(p.numel() * 4 for p in expected.values())
        if bucket_bytes == 0:
            assert stats.buckets == len(expected)
        if bucket_bytes == 1 << 30:
            assert stats.buckets == 1


def test_tied_embedding_is_sent_once_under_the_input_embedding_name():
    class HeadFirst(torch.nn.Module):
        """A tied model whose output layer is registered before its input embedding."""

        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.embed = torch.nn.Embedding(10, 4)
            self.head.weight = self.embed.weight

        def get_input_embeddings(self):
            return self.embed

    model = HeadFirst()
    assert [name for name, _ in model.named_parameters()] == ["head.weight"]  # what named_parameters calls it
    assert [name for name, _ in stream(model, 0)] == ["embed.weight"]  # what the engine expects


def test_lora_is_merged_like_merge_and_unload_and_the_model_is_left_untouched(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(load(tiny_model_dir), LoraConfig(**LORA))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)  # B starts at zero: make the merge do something
    before = {name: p.detach().clone() for name, p in peft_model.named_parameters()}
    checkpoint = dict(load(tiny_model_dir).named_parameters())
    reference = copy.deepcopy(peft_model).merge_and_unload()
    expected = dict(reference.named_parameters())
    for bucket_bytes in (0, 65536):
        stats = GatherStats()
        pairs = stream(peft_model, bucket_bytes, stats)
        assert [name for name, _ in pairs] == list(expected)  # plain names, no lora_, tied embedding once
        assert all(torch.equal(tensor, expected[name]) for name, tensor in pairs), "merged weights differ"
        changed = [name for name, tensor in pairs if not torch.equal(tensor, checkpoint[name])]
        assert changed and all("q_proj" in name or "v_proj" in name for name in changed)
    # The trainer's model is unmerged and bit-for-bit what it was.
    assert not any(getattr(m, "merged", False) for m in peft_model.modules())
    assert all(torch.equal(p, before[name]) for name, p in peft_model.named_parameters())


def test_lora_modules_to_save_send_the_trained_copy(tiny_model_dir):
    # modules_to_save: PEFT trains a copy of the module (the original stays beside it); the engine must get the
    # active adapter's copy under the plain name, as merge_and_unload does, and never the stale original.
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(load(tiny_model_dir), LoraConfig(**LORA, modules_to_save=["norm"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".modules_to_save." in name:
                param.add_(0.5)  # the trained copy now differs from the original
    names = [name for name, _ in peft_model.named_parameters()]
    assert any(".original_module." in n for n in names) and any(".modules_to_save.default." in n for n in names)
    expected = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())
    pairs = stream(peft_model, 0)
    assert [name for name, _ in pairs] == list(expected)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in pairs)
    checkpoint = dict(load(tiny_model_dir).named_parameters())
    sent = dict(pairs)
    assert torch.equal(sent["model.norm.weight"], checkpoint["model.norm.weight"] + 0.5)


def test_16bit_probe_tolerance_covers_bf16_rounding_but_not_an_unloaded_tensor(smollm2_model_dir):
    # The default tolerance when either side runs in bf16/fp16 must pass bf16 rounding on a real model (else every
    # sync warns) and still flag a tensor the engine failed to load (left at zeros).
    from verifiers_rl.core.modeling import sequence_logprobs
    from verifiers_rl.core.modeling import PROBE_TOLERANCE_16BIT, default_probe_tolerance

    ids = probe_token_ids(AutoTokenizer.from_pretrained(smollm2_model_dir), 32)
    fp32 = AutoModelForCausalLM.from_pretrained(smollm2_model_dir, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(smollm2_model_dir, dtype=torch.bfloat16).eval()
    exact = sequence_logprobs(fp32, ids, "cpu").tolist()
    rounded = sequence_logprobs(bf16, ids, "cpu").float().tolist()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = sequence_logprobs(fp32, ids, "cpu").float().tolist()
    tolerance = default_probe_tolerance("torch.float32", "torch.bfloat16")
    assert tolerance == PROBE_TOLERANCE_16BIT and default_probe_tolerance("torch.float32", None) < 1e-2
    rounding = [compare_logprobs(a, b).max_gap for a, b in ((exact, rounded), (exact, autocast), (rounded, autocast))]
    assert max(rounding) > 0.05, "bf16 must round visibly for this check to mean anything"
    assert 2 * max(rounding) < tolerance, rounding
    for layer in (0, 15, 29):
        for projection in ("mlp.down_proj", "self_attn.o_proj"):
            weight = fp32.get_parameter(f"model.layers.{layer}.{projection}.weight")
            saved = weight.detach().clone()
            with torch.no_grad():
                weight.zero_()
            gap = compare_logprobs(exact, sequence_logprobs(fp32, ids, "cpu").tolist()).max_gap
            with torch.no_grad():
                weight.copy_(saved)
            assert gap > tolerance, (layer, projection, gap)


def test_non_lora_adapters_are_refused_before_anything_is_gathered(tiny_model_dir):
    from peft import IA3Config, get_peft_model

    model = get_peft_model(load(tiny_model_dir), IA3Config(target_modules=["k_proj", "down_proj"],
                                                            feedforward_modules=["down_proj"]))
    with pytest.raises(NotImplementedError, match="merges LoRA adapters only"):
        next(gathered_named_weights(model, 0, is_main=True, zero3=False))


# --- the embedded engine ------------------------------------------------------------------------------------------


def test_engine_load_consumes_a_stream_atomically(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir)
    trainer = load(tiny_model_dir)
    perturb(trainer, seed=1)
    ids = probe_token_ids(engine.tokenizer, 16)
    original = engine.prompt_logprobs(ids)

    def failing_stream():
        # Valid tensors, then the producer dies (a gather failing, a broken bucket): nothing may change.
        names = list(dict(trainer.named_parameters()).items())
        yield from names[:5]
        raise RuntimeError("producer died")

    with pytest.raises(RuntimeError, match="producer died"):
        engine.load_weights(failing_stream(), version=3)
    with pytest.raises(KeyError, match="model.no_such.weight"):
        engine.load_weights(iter([*list(trainer.named_parameters())[:3], ("model.no_such.weight", torch.zeros(1))]), 3)
    assert engine.policy_version == 0 and engine.prompt_logprobs(ids) == original

    # A stream whose tensors are overwritten after each item (as a released bucket is): the engine copied them.
    def reused_buffers():
        for name, param in trainer.named_parameters():
            buffer = param.detach().clone()
            yield name, buffer
            buffer.fill_(float("nan"))

    engine.load_weights(reused_buffers(), version=4)
    assert engine.policy_version == 4
    engine_params = dict(engine.model.named_parameters())
    assert all(torch.equal(engine_params[name], p) for name, p in trainer.named_parameters())


def test_engine_prompt_logprobs_are_the_models(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir)
    model = load(tiny_model_dir)
    ids = probe_token_ids(engine.tokenizer, 24)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor(engine.prompt_logprobs(ids))
    assert got.shape == (23,)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        engine.prompt_logprobs(ids[:1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.prompt_logprobs([1, engine.vocab_size])


# --- the trainer's sync, single process ---------------------------------------------------------------------------


class SkippingEngine(EmbeddedEngine):
    """A real engine with a real bug: its load drops one tensor (as a loader that mis-maps a name would)."""

    skip = "model.layers.1.mlp.down_proj.weight"

    def load_weights(self, named_tensors, version):
        super().load_weights(((n, t) for n, t in named_tensors if n != self.skip), version)


class EarlyReturnEngine(EmbeddedEngine):
    """Reads only the first tensors and returns: the trainer must drain the rest and call it a failure."""

    def load_weights(self, named_tensors, version):
        super().load_weights([next(iter(named_tensors))], version)


class NoProbeEngine:
    """An engine without prompt_logprobs: the probe is skipped."""

    policy_version = 0

    def load_weights(self, named_tensors, version):
        for _ in named_tensors:
            pass
        self.policy_version = version


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("weight-sync")
    write_rollouts(work / "rollouts.jsonl", random_rollouts(2, 4, vocab_size=390, seed=1))
    args = RLConfig(output_dir=str(work / "out"), use_cpu=True, report_to="none", save_strategy="no", max_steps=1,
                    rollouts_path=str(work / "rollouts.jsonl"), rollouts_per_step=8, max_seq_len=64,
                    gradient_checkpointing=False, disable_tqdm=True, weight_sync_bucket_mb=0.02,
                    weight_sync_probe_every=1)  # these tests look at the probe of each sync
    trainer = RLTrainer(tiny_model_dir, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
    perturb(trainer.model, seed=5, scale=0.2)  # the trainer's policy moved away from the checkpoint
    return trainer


def test_sync_loads_the_trainers_weights_and_the_probe_passes(trainer, tiny_model_dir, recwarn):
    trainer.engine = EmbeddedEngine(tiny_model_dir)
    trainer.state.global_step = 3
    trainer._metrics["train"].clear()
    trainer.sync_weights()
    engine_params = dict(trainer.engine.model.named_parameters())
    assert trainer.engine.policy_version == 3
    assert all(torch.equal(engine_params[name], p) for name, p in trainer.model.named_parameters())
    gaps = trainer._metrics["train"]["weight_sync_probe_gap"]
    assert len(gaps) == 1 and gaps[0] < 1e-5
    assert not [w for w in recwarn if issubclass(w.category, WeightSyncWarning)]
    assert trainer._metrics["train"]["weight_sync_s"]


def test_the_probe_runs_at_the_first_sync_and_every_nth(trainer, tiny_model_dir, monkeypatch):
    trainer.engine = EmbeddedEngine(tiny_model_dir)
    monkeypatch.setattr(trainer.args, "weight_sync_probe_every", 3)
    monkeypatch.setattr(trainer.weight_sync, "syncs", 0)
    probed = []
    monkeypatch.setattr(trainer.engine, "prompt_logprobs",
                        lambda ids, original=trainer.engine.prompt_logprobs: probed.append(1) or original(ids))
    for step in range(1, 8):
        trainer.state.global_step = step
        trainer._metrics["train"].clear()
        trainer.sync_weights()
        assert trainer.engine.policy_version == step  # every sync loads the weights
        assert ("weight_sync_probe_gap" in trainer._metrics["train"]) == (step in (1, 4, 7)), step
    assert len(probed) == 3


def test_a_bf16_engine_gets_the_16bit_tolerance_under_a_float32_trainer(trainer, tiny_model_dir, recwarn):
    # A float32 trainer syncing into a bf16 engine (a GPU server's usual dtype) must not warn about rounding.
    trainer.engine = EmbeddedEngine(tiny_model_dir, dtype=torch.bfloat16)
    assert not trainer.args.bf16 and trainer.engine.dtype == "torch.bfloat16"
    trainer.state.global_step = 4
    trainer._metrics["train"].clear()
    trainer.sync_weights()
    gap = trainer._metrics["train"]["weight_sync_probe_gap"][-1]
    assert 1e-3 < gap < 0.5, gap  # above the float32 tolerance: only the engine's dtype lets it pass
    assert not [w for w in recwarn if issubclass(w.category, WeightSyncWarning)]


def test_probe_warns_loudly_when_the_engine_skipped_a_layer(trainer, tiny_model_dir, caplog):
    trainer.engine = SkippingEngine(tiny_model_dir)
    trainer._metrics["train"].clear()
    with caplog.at_level(logging.WARNING, logger="verifiers_rl.training.weight_sync"):
        with pytest.warns(WeightSyncWarning) as caught:
            trainer.sync_weights()
    message = str(caught[0].message)
    gap = trainer._metrics["train"]["weight_sync_probe_gap"][0]
    assert gap > trainer.weight_sync.probe_tolerance()
    assert "probe FAILED" in message and f"{gap:.4g} nats" in message and "token position" in message
    assert "tied output layer (lm_head)" in message
    assert message in caplog.text  # logged as well as warned


def test_probe_runs_under_the_batch_lock_so_k1_generation_overlaps_training(trainer, tiny_model_dir):
    # If the lock were released between the load and the probe, the generator would start the next batch at once
    # and the probe would queue behind that whole generate: every step would become generate-then-train.
    from verifiers_rl.envs import load_environment
    from verifiers_rl.rollouts.generator import AsyncGenerator

    class RecordingEngine(EmbeddedEngine):
        lock_held_at_probe: list[bool] = []

        def prompt_logprobs(self, token_ids):
            self.lock_held_at_probe.append(trainer.generator.hold_weights().locked())
            return super().prompt_logprobs(token_ids)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = RecordingEngine(tiny_model_dir, tokenizer)
    environment = load_environment("reverse_text", tokenizer=tokenizer, num_examples=8, max_new_tokens=4)
    trainer.engine = engine
    # The weight sync reads the generator it was built with (the trainer's fixture is a replay run).
    trainer.generator = trainer.weight_sync.generator = AsyncGenerator(
        environment, engine, rollouts_per_step=8, num_generations=4, max_off_policy_steps=1, timeout_s=60)
    try:
        assert len(trainer.generator.batch(0).rollouts) == 8
        for step in (1, 2):
            trainer.state.global_step = step
            trainer.sync_weights()
        assert engine.lock_held_at_probe == [True, True] and engine.policy_version == 2
        assert not trainer.generator.hold_weights().locked()  # released afterwards: generation goes on
        assert len(trainer.generator.batch(1).rollouts) == 8
    finally:
        trainer.generator.close()
        trainer.generator = trainer.weight_sync.generator = None


def test_engine_failures_are_clear_errors(trainer, tiny_model_dir, caplog):
    trainer.engine = EarlyReturnEngine(tiny_model_dir)
    with pytest.raises(WeightSyncError, match=r"returned with \d+ of \d+ tensors unread"):
        trainer.sync_weights()

    class Broken(NoProbeEngine):
        def load_weights(self, named_tensors, version):
            next(iter(named_tensors))
            raise ConnectionError("server went away")

    trainer.engine = Broken()
    with pytest.raises(WeightSyncError, match="version .* failed: ConnectionError: server went away"):
        trainer.sync_weights()


def test_engines_without_prompt_logprobs_skip_the_probe(tiny_model_dir, trainer, caplog):
    trainer.engine = NoProbeEngine()
    trainer.weight_sync.probe_checked, trainer.weight_sync.probe_ids = False, None  # a fresh trainer would decide at its first sync
    trainer._metrics["train"].clear()
    with caplog.at_level(logging.INFO, logger="verifiers_rl.training.weight_sync"):
        trainer.sync_weights()
    assert "no prompt_logprobs: no post-sync probe" in caplog.text
    assert "weight_sync_probe_gap" not in trainer._metrics["train"]
    

# --- ZeRO-3, two processes: one launch ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, tiny_model_dir):
    from tests.helpers.launches import accelerate, launch

    work = tmp_path_factory.mktemp("weight-sync-zero3")
    write_rollouts(work / "rollouts.jsonl", random_rollouts(2, 4, vocab_size=390, seed=1, fully_masked_fraction=0.0))
    log = work / "run.log"
    start = time.monotonic()
    result = launch(accelerate("zero3_cpu.yaml"), [str(ROOT / "tests" / "distributed" / "weight_sync_run.py"),
                    "--model", tiny_model_dir, "--rollouts", str(work / "rollouts.jsonl"), "--out", str(work / "out")],
                    log)
    assert result.returncode == 0, f"weight sync launch failed:\n{log.read_text()[-6000:]}"
    assert time.monotonic() - start < 300
    out = work / "out"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return out, ranks


@pytest.mark.distributed
def test_zero3_bucketed_gather_is_exactly_the_full_model(zero3_run, tiny_model_dir):
    out, ranks = zero3_run
    assert all(r["num_processes"] == 2 and r["sharded_at_load"] for r in ranks)
    # Freshly loaded and sharded, the gathered stream is the checkpoint, bit for bit.
    checkpoint = dict(load(tiny_model_dir).named_parameters())
    initial = torch.load(out / "initial.pt")
    assert list(initial) == list(checkpoint)
    assert all(torch.equal(initial[name], checkpoint[name]) for name in checkpoint)
    # After a step: every bucket size yields the same tensors as one all-at-once gather.
    reference = {name.removeprefix("module."): t for name, t in torch.load(out / "reference.pt").items()}
    streams = torch.load(out / "buckets.pt")
    for bucket_bytes, state in streams.items():
        assert list(state) == list(reference), bucket_bytes
        assert all(torch.equal(state[name], reference[name]) for name in reference), bucket_bytes
    assert any(not torch.equal(reference[name], checkpoint[name]) for name in checkpoint)  # the step moved them
    counts = {int(size): record["buckets"] for size, record in ranks[0]["buckets"].items()}
    assert counts[0] == len(reference) and counts[1 << 30] == 1 and counts[0] > counts[4096] > counts[65536] > 1
    # Every rank took part in every gather; only the main process received tensors.
    assert ranks[0]["buckets"] == {k: {**v, "tensors": len(reference)} for k, v in ranks[1]["buckets"].items()}


@pytest.mark.distributed
def test_zero3_sync_engine_equals_trainer_and_probe_passes(zero3_run):
    _, ranks = zero3_run
    assert ranks[0]["engine_version"] == 1 and ranks[0]["engine_equals_trainer"]
    # The probe's forward ran on both ranks (collective) and every rank logged the same gap.
    assert ranks[0]["probe_gaps"] == ranks[1]["probe_gaps"] and ranks[0]["probe_gaps"][0] < 1e-5


@pytest.mark.distributed
def test_zero3_engine_failure_stops_every_rank_promptly(zero3_run):
    _, ranks = zero3_run
    main, other = ranks[0]["failure"], ranks[1]["failure"]
    assert main["type"] == "WeightSyncError" and other["type"] == "MainProcessError"
    for failure in (main, other):
        assert "ConnectionError: vLLM server at http://127.0.0.1:8000 went away" in failure["message"]
        assert failure["seconds"] < 30
    assert other["message"].startswith("The main process failed: WeightSyncError: Loading policy version 1")
    # The ranks stayed in lockstep: the next sync worked everywhere.
    assert ranks[0]["recovered"] and ranks[1]["recovered"]


@pytest.mark.distributed
def test_zero3_lora_stream_is_merge_and_unload(zero3_run, tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    out, ranks = zero3_run
    assert ranks[0]["lora_unchanged"] and ranks[0]["lora_engine_equals_merged"]
    raw = {name.removeprefix("module."): t for name, t in torch.load(out / "lora_raw.pt").items()}
    assert any("lora_B" in name and t.abs().max() > 0 for name, t in raw.items())  # the step trained the adapters
    peft_model = get_peft_model(load(tiny_model_dir), LoraConfig(**LORA))
    result = peft_model.load_state_dict(raw, strict=False)
    # The tied output layer is the embedding (named_parameters lists it once).
    assert not result.unexpected_keys and result.missing_keys == ["base_model.model.lm_head.weight"]
    expected = dict(peft_model.merge_and_unload().named_parameters())
    for bucket_bytes, state in torch.load(out / "lora_merged.pt").items():
        assert list(state) == list(expected), bucket_bytes
        assert all(torch.equal(state[name], expected[name]) for name in expected), bucket_bytes
    assert ranks[0]["lora_buckets"]["0"] > ranks[0]["lora_buckets"]["65536"]
    assert ranks[0]["lora_probe_gaps"] == ranks[1]["lora_probe_gaps"] and ranks[0]["lora_probe_gaps"][0] < 1e-5

"""Same numbers as TRL: TRL's own GRPOTrainer generates and scores one batch; RLTrainer trains on the same prompts,
completions and rewards (as rollouts), and the loss and every parameter's gradient agree, for each loss type and
each knob both define (fp32 forwards of the same weights, through two log-prob kernels: hence a tolerance).

Names that differ (README "Coming from TRL"): TRL's dapo is our token_mean (bnpo too, on one micro-batch); dr_grpo's
constant is TRL's max_completion_length and our --dr_grpo_horizon (set equal here). To make the knobs that act
through ratios bite, the batch's proximal ("old"), sampler and reference log-probs are set to the same perturbed
values on both sides (TRL reads them from its inputs; ours from the micro-batch). TRL computes its vLLM importance
ratio inside generation only when it drives a vLLM server (not available to TRL here), so that ratio is computed
by the test with TRL's formula (grpo_trainer.py, `_generate_and_score_completions`), marked below.
"""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from verifiers_rl import RLConfig, RLTrainer
from verifiers_rl.core.rollout import Rollout, write_rollouts

COMPLETION_TOKENS = 8
# Prompts of one token length: TRL left-pads shorter prompts and forwards them without position ids (positions
# then count the padding), while we train each sequence at its true positions.
PROMPTS = ["Name a prime above ten.", "Name a prime above two."]
GENERATIONS = 4


def vowels(completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in text)) + 0.1 * len(text) for text in completions]


def _common(tmp_path, name):
    return dict(output_dir=str(tmp_path / name), use_cpu=True, report_to="none", save_strategy="no",
                per_device_train_batch_size=len(PROMPTS) * GENERATIONS, num_generations=GENERATIONS,
                max_completion_length=COMPLETION_TOKENS, gradient_checkpointing=False, disable_tqdm=True, seed=0,
                bf16=False)  # TRL 1.16 defaults to bf16 even on a CPU; ours computes in fp32 there


def _trl_batch(trainer: GRPOTrainer) -> dict:
    rows = [{"prompt": prompt} for prompt in PROMPTS for _ in range(GENERATIONS)]
    torch.manual_seed(0)
    return trainer._generate_and_score_completions(rows)


def _perturbed(batch: dict, seed: int) -> dict[str, torch.Tensor]:
    """Proximal, sampler and reference log-probs near the policy's, each different, on the completion positions."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        shape = batch["completion_ids"].shape
        base = -torch.rand(shape, generator=gen) - 1.0
        return {name: base + scale * torch.randn(shape, generator=gen)
                for name, scale in (("old", 0.3), ("sampler", 0.3), ("ref", 0.5))}


def _policy_logps(trainer: GRPOTrainer, batch: dict) -> torch.Tensor:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, batch["completion_ids"].size(1))
    return logps


def _trl_is_ratio(old, sampler, mask, mode, clip_min, clip_max):
    """TRL 1.16's vLLM importance-sampling ratio (grpo_trainer.py, _generate_and_score_completions), transcribed."""
    diff = (old - sampler) * mask
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else 0.0
    high = clip_max if clip_max is not None else float("inf")
    return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)


def _rollouts(batch: dict, tokenizer, sampler: torch.Tensor) -> list[Rollout]:
    texts = tokenizer.batch_decode(batch["completion_ids"], skip_special_tokens=True)
    rewards = vowels(texts)
    out = []
    for i in range(batch["completion_ids"].shape[0]):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        keep = batch["completion_mask"][i].bool()
        completion = batch["completion_ids"][i][keep].tolist()
        out.append(Rollout(prompt_ids=prompt, completion_ids=completion, completion_mask=[1] * len(completion),
                           reward=rewards[i], group_id=i // GENERATIONS,
                           completion_logprobs=sampler[i][keep].tolist(),
                           # TRL's truncation: the completion does not end in EOS (or padding)
                           truncated=completion[-1] not in (tokenizer.eos_token_id, tokenizer.pad_token_id)))
    return out


def _scatter(mb, per_sequence: torch.Tensor, prompt_lengths: list[int]) -> torch.Tensor:
    """A [B, T_completion] tensor laid out as the micro-batch's [R, T] (completion token j of sequence i sits at
    position prompt_length_i + j)."""
    out = torch.zeros(mb.input_ids.shape)
    for r in range(mb.input_ids.shape[0]):
        for t in range(mb.input_ids.shape[1]):
            local = int(mb.seq_index[r, t])
            if local < 0:
                continue
            i = mb.batch_positions[local]
            j = int(mb.position_ids[r, t]) - prompt_lengths[i]
            if 0 <= j < per_sequence.shape[1]:
                out[r, t] = per_sequence[i, j]
    return out


# What both log under TRL's names for one batch and one loss (TRL: generation, then compute_loss).
SHARED_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/clipped_ratio",
                  *(f"completions/{stat}_{kind}length" for stat in ("mean", "min", "max") for kind in ("", "terminated_")),
                  "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                  "clip_ratio/high_max")


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


# (TRL's config, ours where it differs); every case sets the same loss on both sides.
CASES = {
    "grpo": dict(loss_type="grpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo"),
    "bnpo": dict(loss_type="bnpo"),
    "delta": dict(loss_type="grpo", delta=1.2),
    "epsilon_high+sequence_level": dict(loss_type="dapo", epsilon_high=0.28, importance_sampling_level="sequence"),
    "kl_bias_corrected": dict(loss_type="grpo", beta=0.1),  # use_bias_correction_kl=True is TRL's default
    "kl_plain": dict(loss_type="dr_grpo", beta=0.1, use_bias_correction_kl=False),
    "off_policy_mask": dict(loss_type="grpo", off_policy_mask_threshold=0.05),
    "is_token_truncate": dict(loss_type="dapo", vllm_importance_sampling_mode="token_truncate",
                              vllm_importance_sampling_clip_max=1.5),
    "is_sequence_mask": dict(loss_type="grpo", vllm_importance_sampling_mode="sequence_mask",
                             vllm_importance_sampling_clip_min=0.2, vllm_importance_sampling_clip_max=5.0),
    "entropy_coef": dict(loss_type="dapo", entropy_coef=0.05),
    "top_entropy_quantile": dict(loss_type="grpo", top_entropy_quantile=0.4),
    "entropy_quantile_and_coef": dict(loss_type="dr_grpo", top_entropy_quantile=0.6, entropy_coef=0.1, beta=0.05),
    "everything": dict(loss_type="grpo", delta=1.3, beta=0.05, off_policy_mask_threshold=0.1,
                       vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=2.0),
}


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_trls(tiny_model_dir, tiny_model, tmp_path, case):
    knobs = CASES[case]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    uses_is = any(name.startswith("vllm_importance") for name in knobs)
    trl = GRPOTrainer(model=copy.deepcopy(tiny_model), reward_funcs=[vowels], processing_class=tokenizer,
                      args=GRPOConfig(**_common(tmp_path, "trl"), **knobs),
                      train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    batch = _trl_batch(trl)
    assert bool(batch["prompt_mask"].all()), "prompts of one length (no left padding)"
    logps = _perturbed(batch, seed=len(case))
    mask = batch["completion_mask"].float()
    prompt_lengths = batch["prompt_mask"].sum(1).tolist()
    batch["old_per_token_logps"] = logps["old"]
    batch["sampling_per_token_logps"] = logps["sampler"]
    if trl.beta:
        batch["ref_per_token_logps"] = logps["ref"]
    if uses_is:
        trl.use_vllm = True  # only _compute_loss reads it from here on: apply the ratio computed below
        batch["importance_sampling_ratio"] = _trl_is_ratio(
            logps["old"], logps["sampler"], mask, trl.vllm_importance_sampling_mode,
            trl.vllm_importance_sampling_clip_min, trl.vllm_importance_sampling_clip_max)
    trl.model.train()
    trl.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which this one step does not run
    trl_loss = trl.compute_loss(trl.model, batch)
    trl_loss.backward()
    trl_grads = _grads(trl.model)

    rollouts = _rollouts(batch, tokenizer, logps["sampler"])
    write_rollouts(tmp_path / "batch.jsonl", rollouts)
    ours_knobs = {k: v for k, v in knobs.items()}
    if not uses_is:
        ours_knobs["importance_correction"] = "none"  # TRL corrects sampler log-probs only when it drives vLLM
    if knobs["loss_type"] == "dr_grpo":
        ours_knobs["dr_grpo_horizon"] = COMPLETION_TOKENS  # the other losses refuse it (nothing to divide by)
    ours = RLTrainer(model=copy.deepcopy(tiny_model), processing_class=tokenizer,
                     args=RLConfig(**_common(tmp_path, "ours"), rollouts_path=str(tmp_path / "batch.jsonl"),
                                   max_steps=1, micro_batching="padded",
                                   share_prompt_training="off", **ours_knobs))

    def inject(rank_batch):
        for mb in rank_batch.micro_batches:
            mb.proximal_logps = _scatter(mb, logps["old"], prompt_lengths)
            if ours.beta:
                mb.ref_logps = _scatter(mb, logps["ref"], prompt_lengths)

    rank_batch = ours.steps.next(inject)
    advantages = {mb.batch_positions[int(mb.seq_index[r, 0])]: float(mb.advantages[r][mb.loss_mask[r] > 0][0])
                  for mb in rank_batch.micro_batches for r in range(mb.input_ids.shape[0])}
    torch.testing.assert_close(torch.tensor([advantages[i] for i in range(len(rollouts))]), batch["advantages"],
                               rtol=1e-5, atol=1e-5)  # our advantages from the same rewards equal TRL's
    for mb in rank_batch.micro_batches:  # the same sequences, in the same order
        for r in range(mb.input_ids.shape[0]):
            i = mb.batch_positions[int(mb.seq_index[r, 0])]
            n = prompt_lengths[i] + len(rollouts[i].completion_ids)
            assert mb.input_ids[r, :n].tolist() == rollouts[i].prompt_ids + rollouts[i].completion_ids
    if ours.entropy.masks:  # what training_step does before the first backward
        ours.entropy.prepare(rank_batch, lambda mb: ours.step_loss.logprobs(ours.model, mb).entropy)
    ours.model.train()
    our_loss = sum(ours.compute_loss(ours.model, mb) for mb in rank_batch.micro_batches)
    our_loss.backward()
    our_grads = _grads(ours.model)

    ours.metrics.end_step(rank_batch)
    logged = {name: ours._metrics["train"][name][-1] for name in SHARED_METRICS}
    trl_logged = {**trl._metrics["eval"], **trl._metrics["train"]}  # TRL generated in eval mode (model.training off)
    assert logged == pytest.approx({name: trl_logged[name][-1] for name in SHARED_METRICS}, abs=1e-6)
    assert logged["clip_ratio/region_mean"] > 0, "the perturbed log-probs clip some tokens"
    assert abs(float(trl_loss)) > 1e-4, "the case has a loss to compare"
    torch.testing.assert_close(our_loss.detach(), trl_loss.detach(), rtol=1e-5, atol=1e-7)
    assert our_grads.keys() == trl_grads.keys()
    errors = {name: float((our_grads[name] - grad).abs().max()) / (float(grad.abs().max()) + 1e-8)
              for name, grad in trl_grads.items()}
    assert max(errors.values()) < 1e-4, (case, errors)


def shorter_for_ten(prompts, completions, **kwargs):
    """A second objective, on one task only (None elsewhere: TRL's multi-task convention)."""
    return [None if prompt.endswith("two.") else -0.3 * len(text) for prompt, text in zip(prompts, completions)]


def test_normalize_then_sum_advantages_equal_trls(tiny_model_dir, tiny_model, tmp_path):
    from verifiers_rl.training.batching import compute_advantages, normalize_then_sum_advantages

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    weights = [1.0, 0.5]
    trl = GRPOTrainer(model=copy.deepcopy(tiny_model), reward_funcs=[vowels, shorter_for_ten],
                      processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                      args=GRPOConfig(**_common(tmp_path, "trl"), reward_weights=weights,
                                      multi_objective_aggregation="normalize_then_sum"))
    batch = _trl_batch(trl)
    texts = tokenizer.batch_decode(batch["completion_ids"], skip_special_tokens=True)
    prompts = [prompt for prompt in PROMPTS for _ in range(GENERATIONS)]
    columns = [vowels(texts), shorter_for_ten(prompts, texts)]
    values = [[float("nan") if f[i] is None else f[i] for f in columns] for i in range(len(texts))]
    groups = [i // GENERATIONS for i in range(len(texts))]
    ours = torch.tensor(normalize_then_sum_advantages(values, weights, groups), dtype=torch.float64)
    torch.testing.assert_close(ours, batch["advantages"].double(), rtol=1e-5, atol=1e-5)
    summed = [sum(w * v for w, v in zip(weights, row) if v == v) for row in values]
    assert (torch.tensor(compute_advantages(summed, groups)) - ours).abs().max() > 0.05, "the two modes differ here"

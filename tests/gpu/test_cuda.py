"""On a CUDA GPU (skipped without one; ``scripts/gpu_checks.sh`` runs them on a GPU machine after
``scripts/gpu_bringup.sh``):

- the policy's log-probs and gradients through padded, packed and shared-prefix micro-batches, computed on the GPU
  with its attention kernels (sdpa, eager; flash-attention 2 where installed) in fp32 and under bf16 autocast, against
  the fp64 single-sequence reference on the CPU;
- a whole training step (``tests/distributed/equivalence_run.py``, one SGD step per configuration): on the GPU in
  fp32 against the same step on the CPU; ZeRO-3 on one GPU against one plain GPU process; bf16 within a bf16
  tolerance of fp32;
- live training from the toy environment with the embedded engine generating on the GPU, in one process and under
  ZeRO-3: the reward rises, and at k = 0 the engine's log-probs equal the trainer's after every weight load;
- the engine's sampler drawing its noise on the GPU, and its decode step captured and replayed as a CUDA graph
  (``graph_decode``) against transformers' forward and against the engine without graphs.

Tolerances: fp32 on the GPU against fp32/fp64 on the CPU differs only by summation order (cuBLAS, the attention
kernels), 1e-4 relative here (the CPU suite holds ranks and micro-batches to 1e-5 against each other); bf16 keeps 8
bits of mantissa (unit roundoff 2^-8 = 3.9e-3), so a bf16 log-prob may move by ~1e-2 and a step's update by a few
percent: 2e-2 on log-probs, 5e-2 relative (L2) on the gradient and the update.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.launches import LAUNCH_TIMEOUT_S, MIN_REWARD_GAIN, ROOT, launch_env, load_run as load, runner_inputs
from tests.helpers.logprobs import shared_prefix_rollouts, single_sequence_logprobs

from verifiers_rl.training.batching import BatchingConfig, plan_batch  # noqa: E402
from verifiers_rl.core.engine import free_port  # noqa: E402
from verifiers_rl.training.forward import micro_batch_logprobs  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_checks.sh)")]

FP32_TOLERANCE = 1e-4
BF16_LOGPROB_TOLERANCE = 2e-2
BF16_RELATIVE_L2 = 5e-2
# One SGD step each: padded and packed rows, sequence-level IS, a KL term with its reference model, TRL's knobs over
# two iterations, shared prompts (padded, packed, auto), the reference synced towards the policy every step.
NAMES = ["grpo_token_padded1", "grpo_token_packed64", "dr_grpo_sequence_packed96", "grpo_kl_mask_padded4",
         "trl_knobs_two_iterations_packed64", "grpo_shared_padded4", "dr_grpo_two_iterations_shared_packed64",
         "token_mean_shared_auto_packed256", "sync_ref_kl_three_steps"]
MODES = {  # micro-batching -> BatchingConfig keywords (max_seq_len 40; rollouts of tests/training/test_logprobs.py)
    "padded": dict(mode="padded", rows_per_micro_batch=4),
    "packed": dict(mode="packed", max_tokens_per_microbatch=90),
    "padded_shared": dict(mode="padded", rows_per_micro_batch=4, share_prompt_training="on"),
    "packed_shared": dict(mode="packed", max_tokens_per_microbatch=110, share_prompt_training="on"),
}


def relative_l2(got: dict, want: dict) -> float:
    diff = sum(float((got[k].double().cpu() - want[k].double().cpu()).pow(2).sum()) for k in want)
    return (diff / sum(float(v.double().cpu().pow(2).sum()) for v in want.values())) ** 0.5


def worst_relative(got: dict, want: dict) -> float:
    return max(float((got[k].cpu() - v.cpu()).abs().max() / v.cpu().abs().max()) for k, v in want.items())


# ---------------------------------------------------------------------------------------------------------------
# The policy's forward and backward on the GPU against the fp64 reference


def policy_pass(model, rollouts, batching: dict, device, autocast: bool):
    """Per-sequence log-probs (by rollout position) and the parameter gradients of sum(logps * (1 + advantage))."""
    (rank_batch,) = plan_batch(rollouts, BatchingConfig(max_seq_len=40, **batching))
    model.zero_grad(set_to_none=True)
    found = {}
    for mb in rank_batch.micro_batches:
        mb = mb.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = micro_batch_logprobs(model, mb, temperature=0.8, chunk_size=16)
        (out.logps * mb.loss_mask * (1.0 + mb.advantages)).sum().backward()
        for local, position in enumerate(mb.batch_positions):
            where = mb.seq_index == local
            found[position] = (out.logps[where].detach().double().cpu(), mb.loss_mask[where].cpu(),
                               mb.input_ids[where].cpu())
    return found, {name: p.grad.detach().double().cpu() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def fp64_reference(tiny_model_dir):
    """fp64 on the CPU through plain padded rows (which the CPU suite ties to single sequences at 1e-10), with
    Llama's RMSNorm kept in fp64; plus the single-sequence log-probs of every rollout."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def rms_norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    rollouts = shared_prefix_rollouts(system_prompt_len=6)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LlamaRMSNorm, "forward", rms_norm)
        found, grads = policy_pass(model, rollouts, MODES["padded"], torch.device("cpu"), autocast=False)
        singles = {position: single_sequence_logprobs(model, ids.tolist(), 0.8)
                   for position, (_, _, ids) in found.items()}
    assert max(float(g.abs().max()) for g in grads.values()) > 1e-3  # gradients not trivially 0
    return rollouts, singles, grads


def attention_implementations():
    from transformers.utils import is_flash_attn_2_available

    flash = pytest.param("flash_attention_2", marks=pytest.mark.skipif(
        not is_flash_attn_2_available(), reason="flash-attn is not installed on this machine"))
    return ["sdpa", "eager", flash]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", attention_implementations())
@pytest.mark.parametrize("mode", list(MODES))
def test_micro_batches_on_the_gpu_match_the_fp64_reference(fp64_reference, tiny_model_dir, mode, attention, precision):
    if attention == "flash_attention_2" and "shared" in mode:
        pytest.skip("shared-prefix rows need a dense mask, which the varlen kernel refuses by name (tested on CPU)")
    rollouts, singles, reference_grads = fp64_reference
    device = torch.device("cuda")
    # flash-attention takes only 16-bit inputs: its fp32 case runs under autocast too, held to the bf16 tolerance.
    bf16 = precision == "bf16" or attention == "flash_attention_2"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation=attention).to(device).eval()
    found, grads = policy_pass(model, rollouts, MODES[mode], device, autocast=bf16)
    assert sorted(found) == list(range(len(rollouts)))
    worst = 0.0
    for position, (logps, mask, _) in found.items():
        trained = mask[1:] > 0
        if trained.any():
            worst = max(worst, float((logps[1:][trained] - singles[position][trained]).abs().max()))
        assert torch.all(logps[mask == 0] == 0)
    error = relative_l2(grads, reference_grads)
    print(f"[gpu] {mode} {attention} {precision}: log-prob max abs error {worst:.2e}, gradient relative L2 {error:.2e}")
    assert worst < (BF16_LOGPROB_TOLERANCE if bf16 else FP32_TOLERANCE)
    assert error < (BF16_RELATIVE_L2 if bf16 else FP32_TOLERANCE)


# ---------------------------------------------------------------------------------------------------------------
# Whole steps and live training: real launches, run side by side


def _start(args: list[str], log: Path, env_extra: dict) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, env=launch_env(env_extra, threads=2), stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def _zero3_one_gpu() -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/zero3.yaml",
            "--num_processes", "1", "--main_process_port", str(free_port())]


@pytest.fixture(scope="session")
def gpu_runs(tmp_path_factory, tiny_model_dir):
    """One launch each, all at once: the step runner on the CPU (the reference), on the GPU in fp32 and in bf16,
    and under ZeRO-3 on one GPU; the live runner on the GPU in one process and under ZeRO-3."""
    work = tmp_path_factory.mktemp("gpu")
    common = runner_inputs(work, tiny_model_dir) + ["--only", *NAMES]
    step, live = str(ROOT / "tests/distributed/equivalence_run.py"), str(ROOT / "tests/live/live_run.py")
    on_gpu = {"DS_ACCELERATOR": "cuda"}  # tests/conftest.py sets cpu for the CPU suite
    launches = {
        "cpu": ([sys.executable, step, *common, "--out", str(work / "cpu")],
                {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}),
        "cuda": ([sys.executable, step, *common, "--device", "cuda", "--out", str(work / "cuda")], on_gpu),
        "cuda_bf16": ([sys.executable, step, *common, "--device", "cuda", "--bf16", "--out", str(work / "cuda_bf16")],
                      on_gpu),
        "zero3": ([*_zero3_one_gpu(), step, *common, "--device", "cuda", "--out", str(work / "zero3")], on_gpu),
        "live": ([sys.executable, live, "--model", tiny_model_dir, "--device", "cuda", "--out", str(work / "live")],
                 on_gpu),
        "live_zero3": ([*_zero3_one_gpu(), live, "--model", tiny_model_dir, "--device", "cuda", "--k", "0",
                        "--out", str(work / "live_zero3")], on_gpu),
    }
    started = {name: _start(args, work / f"{name}.log", env) for name, (args, env) in launches.items()}
    failed = []
    for name, process in started.items():
        try:
            process.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
        if process.returncode != 0:
            failed.append(f"{name} (exit {process.returncode}):\n{(work / f'{name}.log').read_text()[-4000:]}")
    return work, failed


def _finished(gpu_runs, *names: str) -> Path:
    work, failed = gpu_runs
    broken = [text for text in failed if text.split(" ", 1)[0] in names]
    assert not broken, "\n\n".join(broken)
    return work


@pytest.mark.parametrize("name", NAMES)
def test_a_gpu_step_equals_the_cpu_step(gpu_runs, initial_parameters, name):
    work = _finished(gpu_runs, "cpu", "cuda")
    (want, want_record), (got, record) = load(work / "cpu", name), load(work / "cuda", name)
    assert record["optimizer_steps"] == want_record["optimizer_steps"]
    worst = worst_relative(got, want)
    update = worst_relative(initial_parameters, want)
    print(f"[gpu] {name}: GPU vs CPU fp32 max relative parameter difference {worst:.2e} (update {update:.2e})")
    assert worst < FP32_TOLERANCE
    assert update > 10 * FP32_TOLERANCE  # the step moved the parameters well past the tolerance
    for got_loss, want_loss in zip(record["losses"], want_record["losses"], strict=True):
        assert abs(got_loss - want_loss) <= FP32_TOLERANCE * max(abs(want_loss), 1e-3)
    for key, values in want_record["metrics"].items():
        for got_value, want_value in zip(record["metrics"][key], values, strict=True):
            assert abs(got_value - want_value) <= FP32_TOLERANCE * max(abs(want_value), 1e-3), key


@pytest.mark.parametrize("name", NAMES)
def test_zero3_on_one_gpu_equals_one_gpu_process(gpu_runs, name):
    work = _finished(gpu_runs, "cuda", "zero3")
    (want, want_record), (got, record) = load(work / "cuda", name), load(work / "zero3", name)
    assert record["model_class"] == "DeepSpeedEngine" and want_record["model_class"] != "DeepSpeedEngine"
    assert record["optimizer_steps"] == want_record["optimizer_steps"]
    worst = worst_relative(got, want)
    print(f"[gpu] {name}: ZeRO-3 vs plain, one GPU: max relative parameter difference {worst:.2e}")
    assert worst < 1e-5
    for got_loss, want_loss in zip(record["losses"], want_record["losses"], strict=True):
        assert abs(got_loss - want_loss) <= 1e-5 * max(abs(want_loss), 1e-3)


@pytest.mark.parametrize("name", NAMES)
def test_a_bf16_step_is_within_bf16_tolerance_of_fp32(gpu_runs, initial_parameters, name):
    work = _finished(gpu_runs, "cpu", "cuda_bf16")
    (want, want_record), (got, record) = load(work / "cpu", name), load(work / "cuda_bf16", name)
    want_update = {k: want[k] - initial_parameters[k] for k in want}
    error = relative_l2({k: got[k].cpu() - initial_parameters[k] for k in want}, want_update)
    print(f"[gpu] {name}: bf16 update relative L2 error {error:.2e}")
    assert error < BF16_RELATIVE_L2
    for got_loss, want_loss in zip(record["losses"], want_record["losses"], strict=True):
        assert abs(got_loss - want_loss) <= BF16_RELATIVE_L2 * max(abs(want_loss), 1e-2)


@pytest.mark.parametrize("run,k", [("live", 0), ("live", 1), ("live_zero3", 0)])
def test_live_training_on_the_gpu(gpu_runs, run, k):
    """The engine generates on the GPU; the reward rises; at k = 0 the sampler's log-probs equal the trainer's right
    after every weight load (IS ratios 1 to fp32 rounding on the GPU's kernels), at k = 1 they move away."""
    work = _finished(gpu_runs, run)
    record = json.loads((work / run / f"k{k}.json").read_text())
    rewards = record["reward"]
    gain = sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5
    drift = max(abs(ratio - 1) for ratio in record["is_ratio"][1:])
    print(f"[gpu] {run} k={k}: reward {rewards[0]:.3f} -> {rewards[-1]:.3f}, max |IS ratio - 1| {drift:.2e}")
    assert gain > MIN_REWARD_GAIN, f"reward went {rewards[:5]} -> {rewards[-5:]}"
    assert max(record["staleness_max"]) == k and all(errors == 0 for errors in record["reward_errors"])
    if k == 0:
        assert drift < 10 * FP32_TOLERANCE
    else:
        assert drift > 1e-3


def test_the_engine_draws_its_noise_on_the_gpu_and_samples_the_softmax():
    """The sampler's Gumbel noise is drawn on the logits' device (a CPU draw of [rows, vocab] and its copy cost more
    than a GPU decode step); the draws follow softmax(l) and a seed repeats its tokens."""
    from verifiers_rl.inference.embedded.engine import RowSampler

    rows, device = 4000, torch.device("cuda")
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5], device=device).repeat(rows, 1)
    context = torch.zeros(rows, 1, dtype=torch.long, device=device)
    sampler = RowSampler([1.0] * rows, [None] * rows, 0, 1.0, device=device)
    tokens, logps = sampler.draw(context, logits, list(range(rows)))
    expected = torch.softmax(logits[0], -1)
    frequencies = torch.bincount(tokens, minlength=5).double() / rows
    assert (frequencies - expected.double()).abs().max() < 0.03  # 4 standard deviations at 4000 draws
    torch.testing.assert_close(logps, torch.log(expected)[tokens])
    seeded = [RowSampler([1.0] * 64, list(range(64)), 0, 1.0, device=device) for _ in range(2)]
    assert all(g.device.type == "cuda" for g in seeded[0].generators)
    first, second = (s.draw(context[:64], logits[:64], list(range(64)))[0] for s in seeded)
    assert torch.equal(first, second) and len(set(first.tolist())) > 1


@pytest.mark.parametrize("build", ["gqa_model", "qwen2_model"])
def test_captured_decode_steps_equal_transformers_forward_on_the_gpu(build):
    """graph_decode on the GPU: the first step eager, the second captured, the rest replayed; logits equal
    transformers' forward (fp32) with rows leaving the batch twice."""
    import tests.inference.test_llama_decode as lean
    from verifiers_rl.inference.kernels.graph_decode import GraphDecoder, supports

    model = getattr(lean, build)().cuda()
    assert supports(model)
    decoders = []

    def make(cache, capacity):
        decoders.append(GraphDecoder(model, cache, capacity))
        return decoders[-1]

    lean.assert_steps_equal_forward(model, make, tolerance=FP32_TOLERANCE)
    assert decoders[0].graph is not None


def test_the_engine_on_the_gpu_samples_through_captured_steps(tiny_model_dir, monkeypatch):
    """With and without CUDA graphs the engine draws the same seeded tokens (fp32), log-probs within 1e-4."""
    from tests.helpers.engines import load, prompts_of, sample_seeded
    from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
    from verifiers_rl.inference.kernels.graph_decode import GraphDecoder

    replays = []
    step = GraphDecoder.step

    def counted(self, *args):
        replays.append(self.graph is not None)
        return step(self, *args)

    monkeypatch.setattr(GraphDecoder, "step", counted)
    prompts = prompts_of(load(tiny_model_dir)[1])
    samples = {}
    for graphs in (True, False):
        engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(max_new_tokens=16), cuda_graphs=graphs,
                                generate_in_loop_thread=True)  # captures only where it decodes on this thread
        engine.model.to("cuda")
        try:
            samples[graphs] = sample_seeded(engine, prompts, list(range(len(prompts))))
        finally:
            engine.close()
    assert sum(replays) > len(prompts)  # steps replayed from a graph, with graphs on only
    for captured, plain in zip(samples[True], samples[False], strict=True):
        assert captured.token_ids == plain.token_ids
        torch.testing.assert_close(torch.tensor(captured.logprobs), torch.tensor(plain.logprobs), rtol=0, atol=1e-4)


def test_the_continuous_engine_serves_two_loops_and_an_in_flight_load_on_the_gpu(tiny_model_dir):
    """``continuous_rows`` on the GPU (its decode loop's own thread, each row's noise from a CUDA generator):
    requests from two event loops on two threads draw the seeded tokens the batch-by-batch engine draws alone
    (fp32, log-probs within 1e-4), and a weight load from this thread lands between two steps of rows in flight."""
    import asyncio

    from tests.helpers.continuous import alone, in_thread, joined, perturbed_weights, requests_of, seeded, wait_until
    from verifiers_rl.inference import SamplingConfig
    from verifiers_rl.inference.factory import make_engine

    sampling = SamplingConfig(max_new_tokens=64)
    engine = make_engine(tiny_model_dir, None, sampling, continuous_rows=3)
    reference = make_engine(tiny_model_dir, None, sampling)
    assert engine.model.get_input_embeddings().weight.device.type == "cuda"
    requests = requests_of(500)
    try:
        loops = [in_thread(lambda part=part, delay=delay: asyncio.gather(
            *(seeded(engine, *request, delay=delay * i) for i, request in enumerate(part))))
            for part, delay in ((requests[0::2], 0.01), (requests[1::2], 0.013))]
        got = [None] * len(requests)
        got[0::2], got[1::2] = joined(*loops[0]), joined(*loops[1])
        for (prompt, max_new_tokens, temperature, seed), (sample, recorded) in zip(requests, got):
            want = alone(reference, prompt, max_new_tokens, temperature, seed)
            assert sample.token_ids == want.token_ids and recorded == [0] * len(sample.token_ids)
            torch.testing.assert_close(torch.tensor(sample.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-4)
        assert engine.health()["continuous"]["admissions"] >= 1
        engine.eos_token_ids[:] = [-1]  # rows decode to their length: in flight at the load
        long = [(prompt, 48, temperature, seed) for prompt, _, temperature, seed in requests[:3]]
        wave = in_thread(lambda: asyncio.gather(*(seeded(engine, *request) for request in long)))
        wait_until(lambda: engine.health()["continuous"]["steps"] >= 10)
        engine.load_weights([(name, tensor.cuda()) for name, tensor in perturbed_weights(engine)], version=1)
        for sample, recorded in joined(*wave):
            assert recorded == sample.versions == sorted(sample.versions) and 0 < sample.versions.index(1) < 40
    finally:
        engine.close()
        reference.close()

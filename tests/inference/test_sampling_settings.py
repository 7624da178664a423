"""TRL's min_p, repetition_penalty and generation_kwargs act: RLConfig carries them into the engine build_engine makes
(embedded; the vLLM client's request payload), generation_kwargs override the fields of the same name (the trainer's
log-prob temperature too) and any key both engines cannot honour is refused by name; eval.py takes the same flags."""

from __future__ import annotations

import pytest

from verifiers_rl.cli import eval as eval_cli
from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig, VLLMEngine
from verifiers_rl.inference.factory import build_engine, sampling_settings

KNOBS = dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.1, repetition_penalty=1.2)


def config(**kwargs) -> RLConfig:
    return RLConfig(output_dir="/tmp/unused", report_to="none", max_completion_length=12, **kwargs)


def test_config_knobs_reach_the_embedded_engine_built_by_build_engine(tiny_model_dir):
    engine = build_engine(config(**KNOBS), tiny_model_dir, None)
    try:
        assert isinstance(engine, EmbeddedEngine)
        assert engine.sampling == SamplingConfig(max_new_tokens=12, **KNOBS)
        assert engine.dtype == "torch.float32"
    finally:
        engine.close()


def test_the_embedded_engine_samples_in_the_training_precision(tiny_model_dir):
    engine = build_engine(config(use_cpu=True, bf16=True), tiny_model_dir, None)  # a GPU's default, asked on CPU
    try:
        assert engine.dtype == "torch.bfloat16"
    finally:
        engine.close()


def test_config_knobs_reach_the_vllm_request_payload():
    # The engine as build_engine makes it for a server (make_engine's other arguments); no server is asked here
    # (tests/vllm_backend/test_vllm_sampling.py builds one through build_engine against a real server).
    sampling = sampling_settings(config(**KNOBS))
    engine = VLLMEngine("http://127.0.0.1:9", sampling=sampling, check=False)
    payload = engine._sampling_payload(0.8, seed=3)
    engine.close()
    assert {k: payload[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")} == {
        **KNOBS, "seed": 3}
    # The defaults: TRL's min_p=None is off (0), as before these knobs existed.
    defaults = sampling_settings(config())
    assert (defaults.min_p, defaults.repetition_penalty, defaults.top_k) == (0.0, 1.0, 0)


def test_generation_kwargs_override_the_fields_including_the_trainers_temperature(tiny_model_dir):
    overridden = config(temperature=1.0, top_p=1.0, generation_kwargs=KNOBS)
    # The trainer computes its log-probs at args.temperature (StepLoss.logprobs): the engine's temperature.
    assert {name: getattr(overridden, name) for name in KNOBS} == KNOBS
    engine = build_engine(overridden, tiny_model_dir, None)
    try:
        assert engine.sampling.temperature == overridden.temperature == 0.8
        assert engine.sampling == SamplingConfig(max_new_tokens=12, **KNOBS)
    finally:
        engine.close()


def test_the_command_line_takes_the_knobs_and_generation_kwargs_as_json():
    from verifiers_rl.cli.train import build_parser

    argv = ["--output_dir", "/tmp/unused", "--min_p", "0.1", "--repetition_penalty", "1.2", "--temperature", "1.0",
            "--generation_kwargs", '{"temperature": 0.5, "top_k": 3}']
    _, parsed = build_parser().parse_args_and_config(args=argv)
    assert (parsed.min_p, parsed.repetition_penalty, parsed.temperature, parsed.top_k) == (0.1, 1.2, 0.5, 3)


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 0.5}, r"generation_kwargs\['presence_penalty'\] is refused: not implemented in the embedded"),
    ({"frequency_penalty": 0.5}, r"generation_kwargs\['frequency_penalty'\] is refused: not implemented in the"),
    ({"max_new_tokens": 64}, r"generation_kwargs\['max_new_tokens'\] is refused: .*--max_completion_length"),
    ({"max_tokens": 64}, r"generation_kwargs\['max_tokens'\] is refused: .*--max_completion_length"),
    ({"typical_p": 0.9}, r"generation_kwargs\['typical_p'\] is refused: not implemented in both engines"),
    ({"top_k": 2.5}, r"generation_kwargs\['top_k'\] must be an int"),
    ({"temperature": "hot"}, r"generation_kwargs\['temperature'\] must be a number"),
    ({"min_p": 1.5}, r"^min_p must be in \[0, 1\)"),
    ({"temperature": 0.0}, r"^temperature must be > 0"),
])
def test_generation_kwargs_both_engines_cannot_honour_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(generation_kwargs=kwargs)


@pytest.mark.parametrize("knob, value", [("min_p", 1.0), ("min_p", -0.5), ("repetition_penalty", 0.0),
                                         ("top_p", 0.0), ("top_k", -1)])
def test_knobs_out_of_range_are_refused_when_the_config_is_built(knob, value):
    with pytest.raises(ValueError, match=rf"^{knob} must be"):
        config(**{knob: value})


def test_eval_takes_the_same_sampling_flags(capsys):
    args = eval_cli.parse_args(["--temperature", "0.8", "--top_p", "0.9", "--top_k", "20", "--min_p", "0.1",
                                "--repetition_penalty", "1.2"])
    assert args.sampling == SamplingConfig(**KNOBS)  # what main() gives make_engine
    with pytest.raises(SystemExit):
        eval_cli.parse_args(["--min_p", "1.5"])
    assert "error: --min_p must be in [0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # greedy takes the most likely token: a filter would change nothing
        eval_cli.parse_args(["--temperature", "0", "--top_k", "3", "--min_p", "0.1"])
    assert "error: --top_k 3, --min_p 0.1 filters what is sampled; --temperature 0 is greedy" in capsys.readouterr().err

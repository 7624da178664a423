"""``verifiers-rl eval --vllm_server_url``: evaluation through a real vLLM server (CPU) gives the rollouts
the embedded engine gives (greedy, so both must pick HF's argmax; tests/vllm_backend/test_vllm_engine.py checks the
server's log-probs against HF's)."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from verifiers_rl.cli import eval as eval_cli
from verifiers_rl.envs import load_environment
from verifiers_rl.rollouts.evaluation import EvalSettings, evaluate
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig

ENV_ARGS = {"num_examples": 16, "num_eval_examples": 3, "max_new_tokens": 8}


def test_eval_through_a_server_equals_the_embedded_engine(untied, tmp_path, capsys):
    output = tmp_path / "results.jsonl"
    argv = ["--model", untied.model_dir, "--vllm_server_url", untied.url, "--env", "reverse_text", "--env_args",
            json.dumps(ENV_ARGS), "--temperature", "0", "--output", str(output)]
    assert eval_cli.main(argv) == 0
    assert "pass@1" in capsys.readouterr().out
    served = sorted((r["row"], r["sample"], r["completion_ids"], r["reward"]) for r in map(json.loads, output.open()))

    tokenizer = AutoTokenizer.from_pretrained(untied.model_dir)
    environment = load_environment("reverse_text", tokenizer=tokenizer, **ENV_ARGS)
    engine = EmbeddedEngine(untied.model_dir, tokenizer, SamplingConfig(temperature=0.0))
    local = evaluate(environment, engine, EvalSettings(temperature=0.0, seed=42))
    expected = sorted((s.row.index, s.sample, s.rollout.completion_ids, s.rollout.reward) for s in local.samples)
    assert len(served) == 3 and served == expected

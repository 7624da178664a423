"""Several environments in one run (envs/mixture.py): entries checked by name, draws by weight under the seed (a
chi-square over many draws), the same draws from any starting position (resume), each entry's rows in its own
seeded order, rollouts stamped with their entry's name."""

from __future__ import annotations

import asyncio
import json

import pytest

from verifiers_rl.core.rollout import Rollout
from verifiers_rl.envs import load_environment
from verifiers_rl.envs.mixture import MixtureEnv, MixtureError, load_mixture, parse_entries
from verifiers_rl.envs.prepare import prepare_environment
from verifiers_rl.rollouts.generator import AsyncGenerator

from .scripted import ScriptedSampler

ENTRIES = [
    {"env": "reverse_text", "weight": 1, "env_args": {"num_examples": 7, "max_new_tokens": 8}},
    {"env": "arithmetic", "weight": 2.5, "env_args": {"num_examples": 5}},
    {"env": "reverse_text", "name": "reverse_long", "weight": 0.5,
     "env_args": {"num_examples": 3, "seed": 9, "max_seq_len": 512}},
]


def mixture(tokenizer, entries=ENTRIES, prepare=lambda env, entry: None) -> MixtureEnv:
    load = lambda entry: load_environment(entry.env, tokenizer=tokenizer, **entry.env_args)  # noqa: E731
    return load_mixture(parse_entries(json.dumps(entries)), load, prepare)


def test_a_single_environment_is_not_a_mixture():
    assert parse_entries("reverse_text") is None
    assert parse_entries("reasoning_gym:leg_counting=2,basic_arithmetic") is None
    # One entry's JSON object is neither: said so, not "cannot import module '{"env"'".
    with pytest.raises(MixtureError, match=r"^--env \{\"env\": \"arithmetic\"\}: one JSON object\. A mixture is a "
                                           r"JSON list of entries \('\[\{\"env\": \"arithmetic\"\}\]'\)"):
        parse_entries('{"env": "arithmetic"}')


@pytest.mark.parametrize("entries, message", [
    ([], "non-empty list"),
    ({"env": "reverse_text"}, "non-empty list"),
    (["reverse_text"], "entry 0 is a str"),
    ([{"env": "reverse_text", "max_new_tokens": 8}], "unknown key(s) 'max_new_tokens'"),
    ([{"weight": 1}], "entry 0 needs \"env\""),
    ([{"env": "reverse_text"}, {"env": "arithmetic", "weight": 0}], "entry 1 (arithmetic): \"weight\" must be a number > 0"),
    ([{"env": "reverse_text", "weight": -1}], "\"weight\" must be a number > 0, got -1"),
    ([{"env": "reverse_text", "weight": "2"}], "\"weight\" must be a number > 0, got '2'"),
    ([{"env": "reverse_text", "weight": True}], "\"weight\" must be a number > 0"),
    ([{"env": "reverse_text", "weight": float("nan")}], "\"weight\" must be a number > 0"),
    ([{"env": "reverse_text", "env_args": [1]}], "\"env_args\" must be a mapping"),
    ([{"env": "reverse_text"}, {"env": "reverse_text"}], "two entries are named 'reverse_text'"),
])
def test_bad_entries_are_refused_by_name(entries, message):
    with pytest.raises(MixtureError) as error:
        parse_entries(entries)
    assert message in str(error.value) and str(error.value).startswith("--env")


def test_a_mixture_from_json_text_and_a_bad_json_list():
    (entry,) = parse_entries('[{"env": "tests/v1/envs/reverse_v1.py", "weight": 2}]')
    assert (entry.name, entry.weight, entry.env_args) == ("reverse_v1", 2.0, {})
    with pytest.raises(MixtureError, match="--env is not a valid JSON list"):
        parse_entries('[{"env": }]')


def test_a_mixture_from_a_yaml_file_of_entries_or_a_training_config(tmp_path, caplog):
    import yaml

    listed, config = tmp_path / "mix.yaml", tmp_path / "run.yml"
    listed.write_text(yaml.safe_dump(ENTRIES))
    config.write_text(yaml.safe_dump({"env": ENTRIES[:2], "max_steps": 3}))  # a training --config: its env: list
    assert [e.name for e in parse_entries(str(listed))] == ["reverse_text", "arithmetic", "reverse_long"]
    assert [(e.name, e.weight) for e in parse_entries(str(config), "--eval_env")] == [("reverse_text", 1.0),
                                                                                     ("arithmetic", 2.5)]
    assert f"--eval_env {config}: only its env: list is read; its other keys (max_steps) are not" in caplog.text
    for content, message in [({"max_steps": 3}, "is a mapping without env:"), ("reverse_text", "holds a list"),
                             ("[a: b", "is not valid YAML")]:
        (tmp_path / "bad.yaml").write_text(content if isinstance(content, str) and "[" in content
                                           else yaml.safe_dump(content))
        with pytest.raises(MixtureError, match=f"--env {tmp_path / 'bad.yaml'}.*{message}"):
            parse_entries(str(tmp_path / "bad.yaml"))
    with pytest.raises(MixtureError, match="cannot read the file"):
        parse_entries(str(tmp_path / "missing.yaml"))


def test_verifiers_rl_eval_refuses_env_args_or_a_bad_entry_of_a_mixture(capsys):
    from verifiers_rl.cli import eval as eval_cli

    mixture = json.dumps(ENTRIES[:2])
    assert [e.name for e in eval_cli.parse_args(["--env", mixture]).entries] == ["reverse_text", "arithmetic"]
    assert eval_cli.parse_args(["--env", "arithmetic"]).entries is None
    assert "the entries' weight steer training's draws" in capsys.readouterr().out  # ENTRIES[1] weighs 2.5
    eval_cli.parse_args(["--env", json.dumps([{"env": "arithmetic"}, {"env": "reverse_text"}])])
    assert "not used here" not in capsys.readouterr().out  # plain entries: nothing to say
    steered = json.dumps([{"env": "arithmetic", "weight": 2}, {"env": "reverse_text",
                                                                 "curriculum": {"easy_above": 0.9}}])
    eval_cli.parse_args(["--env", steered])
    assert "the entries' curriculum and weight steer training's draws" in capsys.readouterr().out
    for argv, message in [(["--env", mixture, "--env_args", '{"seed": 1}'], "--env_args acts on one environment"),
                          (["--env", '[{"env": "arithmetic", "weight": 0}]'], "--env entry 0 (arithmetic): \"weight\"")]:
        with pytest.raises(SystemExit):
            eval_cli.parse_args(argv)
        assert message in capsys.readouterr().err


def test_mixture_of_takes_environment_objects_beside_named_ones(tokenizer):
    from verifiers_rl import mixture_of

    built = load_environment("arithmetic", tokenizer=tokenizer, num_examples=5)
    env = mixture_of([{"env": built, "weight": 3}, ENTRIES[0]], tokenizer, holdout=2, seed=4)
    assert [(e.name, e.weight) for e in env.entries] == [("arithmetic", 3.0), ("reverse_text", 1.0)]
    assert env.entries[0].environment is built and len(env.eval_selection(None)) == 4  # 2 held out of each
    assert env._verifiers_rl_holdout == (2, 4)  # what --eval_holdout 2 with seed 4 checks
    for entries, kwargs, message in [
        ([{"env": built, "env_args": {"num_examples": 3}}], {}, r"mixture_of entry 0 \(arithmetic\): \"env_args\" are"),
        ([{"env": built}, {"env": built}], {}, "two entries are named 'arithmetic'"),
        ([{"env": 3}], {}, "the environment's name or path, or an Environment object, got 3"),
        ([ENTRIES[0]], {"tokenizer": None}, "mixture_of entry 'reverse_text': .*pass mixture_of\\(..., tokenizer=...\\)"),
    ]:
        with pytest.raises(MixtureError, match=message):
            mixture_of(entries, **kwargs)


def test_holding_rows_out_of_a_built_mixture_holds_them_out_of_each_entry(tokenizer):
    # What evaluation's refusal of an unheld --eval_holdout says to run: hold_out(environment, N, seed). On a mixture
    # it once moved rows of the mixture's own list, and the entries' draws then indexed past it or into another entry.
    from verifiers_rl import mixture_of
    from verifiers_rl.envs.splits import hold_out

    env = mixture(tokenizer)
    hold_out(env, 2, seed=4)
    assert len(env.dataset) == 7 + 5 + 3 - 3 * 2 and env._verifiers_rl_holdout == (2, 4)
    positions = list(range(300))
    rows = env.draw_rows(positions, seed=5)
    assert [env.dataset[r].entry for r in rows] == [env.entry_at(p, 5) for p in positions]
    held = {repr(row.prompt) for row in env.eval_dataset}
    assert len(held) == 3 * 2 and not held & {repr(env.dataset[r].prompt) for r in rows}
    built = mixture_of(ENTRIES, tokenizer, holdout=2, seed=4)  # the same split as holding out at load
    assert [row.prompt for row in built.eval_dataset] == [row.prompt for row in env.eval_dataset]
    hold_out(env, 2, seed=4)  # the same again: nothing changes
    with pytest.raises(MixtureError, match="entry 'reverse_long': --eval_holdout 3: reverse_text has 3 training"):
        hold_out(mixture(tokenizer), 3, seed=4)


def test_an_entry_short_of_held_out_rows_is_told_its_own_loaders_argument(tokenizer):
    # reasoning-gym sizes its split with eval_size: the built-ins' num_eval_examples would be refused by its loader.
    gym = {"env": "reasoning_gym:leg_counting", "env_args": {"size": 20, "eval_size": 0}}
    with pytest.raises(MixtureError, match=r"'reasoning_gym:leg_counting' has no held-out.*\{\"eval_size\": N\}"):
        mixture(tokenizer, [ENTRIES[0], gym]).eval_selection(None)
    gym["env_args"]["eval_size"] = 3
    with pytest.raises(MixtureError, match=r"-n 5 is larger .* \(reasoning-gym takes env_args \{\"eval_size\": N\}\)"):
        mixture(tokenizer, [ENTRIES[0], gym]).eval_selection(5, "-n")
    builtin = {**ENTRIES[0], "env_args": {"num_examples": 7, "num_eval_examples": 7}}
    with pytest.raises(MixtureError, match=r"'reverse_text' \(7 rows\).*built-ins take env_args \{\"num_eval_examples"):
        mixture(tokenizer, [builtin, gym]).eval_selection(8)


def test_an_entry_that_fails_to_load_or_to_fit_is_named(tokenizer):
    with pytest.raises(MixtureError, match=r"--env entry 'no_such_env': ValueError: Unknown environment"):
        mixture(tokenizer, [ENTRIES[0], {"env": "no_such_env"}])
    with pytest.raises(MixtureError, match=r"--env entry 'arithmetic': .*takes no argument 'bogus'"):
        mixture(tokenizer, [ENTRIES[0], {"env": "arithmetic", "env_args": {"bogus": 1}}])
    with pytest.raises(MixtureError, match=r"--env entry 'arithmetic': ValueError: arithmetic: no row .* fits"):
        mixture(tokenizer, [ENTRIES[0], {"env": "arithmetic", "env_args": {"max_seq_len": 4}}])
    # The length contract, per entry: a given --max_completion_length that an entry's own limit contradicts.
    prepare = lambda env, entry: prepare_environment(  # noqa: E731
        env, lengths={"max_seq_len": 512, "max_completion_length": 8}, given={"max_completion_length"})
    with pytest.raises(MixtureError, match=r"--env entry 'arithmetic': LengthContractError: "
                                           r"--max_completion_length=8 disagrees"):
        mixture(tokenizer, ENTRIES, prepare)


def test_rows_limits_and_name(tokenizer):
    env = mixture(tokenizer)
    assert len(env.dataset) == 7 + 5 + 3 and [row.index for row in env.dataset] == list(range(15))
    assert [row.entry for row in env.dataset] == [0] * 7 + [1] * 5 + [2] * 3
    assert env.dataset[8].source is env.entries[1].environment.dataset[1]
    limits = [(e.environment.max_seq_len, e.environment.max_new_tokens) for e in env.entries]
    assert (env.max_seq_len, env.max_new_tokens) == (max(s for s, _ in limits), max(n for _, n in limits))
    assert env.name == "mixture[reverse_text=1,arithmetic=2.5,reverse_long=0.5]"


def chi_square(counts: list[int], weights: list[float]) -> float:
    total = sum(counts)
    expected = [total * w / sum(weights) for w in weights]
    return sum((c - e) ** 2 / e for c, e in zip(counts, expected))


def test_draws_follow_the_weights(tokenizer):
    env = mixture(tokenizer)
    positions = list(range(12000))
    rows = env.draw_rows(positions, seed=5)
    counts = [sum(env.dataset[r].entry == e for r in rows) for e in range(3)]
    # 2 degrees of freedom: P(chi2 > 13.8) = 0.001. The same counts against other weights are far off.
    assert chi_square(counts, [1, 2.5, 0.5]) < 13.8, counts
    assert chi_square(counts, [1, 1, 1]) > 100 and chi_square(counts, [2.5, 1, 0.5]) > 100
    # Each entry's rows come in its own order: every epoch of an entry is a permutation of its rows.
    for entry, size, start in ((0, 7, 0), (1, 5, 7), (2, 3, 12)):
        own = [r - start for r in rows if env.dataset[r].entry == entry]
        epochs = [own[i:i + size] for i in range(0, len(own) - size + 1, size)]
        assert all(sorted(epoch) == list(range(size)) for epoch in epochs)
        assert len({tuple(epoch) for epoch in epochs}) > 1  # shuffled again each epoch


def test_draws_are_a_function_of_the_seed_and_position(tokenizer):
    whole = mixture(tokenizer).draw_rows(list(range(400)), seed=5)
    resumed = mixture(tokenizer)  # a resumed run starts drawing at its position, with nothing drawn before
    assert resumed.draw_rows(list(range(300, 400)), seed=5) == whole[300:]
    assert resumed.draw_rows(list(range(0, 300)), seed=5) == whole[:300]
    assert mixture(tokenizer).draw_rows(list(range(400)), seed=6) != whole
    in_order = mixture(tokenizer).draw_rows(list(range(15)), seed=5, shuffle=False)
    assert [r for r in in_order if r < 7] == list(range(7))[: sum(r < 7 for r in in_order)]


def test_the_generator_takes_the_mixture_draws(tokenizer):
    env = mixture(tokenizer)
    generator = AsyncGenerator(env, None, rollouts_per_step=8, num_generations=2, seed=5)
    expected = env.draw_rows(list(range(8, 12)), seed=5)
    assert generator._rows_of(2) == list(zip(range(8, 12), expected))
    refill = env.draw_refill(3, 1, 4000, seed=5)
    counts = [sum(env.dataset[r].entry == e for r in refill) for e in range(3)]
    assert chi_square(counts, [1, 2.5, 0.5]) < 13.8, counts


def test_a_group_comes_from_its_entry_and_carries_its_name(tokenizer):
    env = mixture(tokenizer)
    row = env.dataset[2]  # reverse_text's third row
    sampler = ScriptedSampler([tokenizer.encode("abc") for _ in range(3)])
    group = asyncio.run(env.rollout_group(sampler, row, "g", 3, seed=1))
    assert [r.env for r in group] == ["reverse_text"] * 3
    source = env.entries[0].environment
    assert source.max_new_tokens == 8 < env.max_new_tokens
    assert group[0].prompt_ids == source.prompt_ids(row.source.prompt) and group[0].prompt == row.source.prompt
    assert sampler.calls[0][1] == source.max_new_tokens  # the entry's own limit, not the mixture's largest
    line = group[0].to_json()
    assert json.loads(line)["env"] == "reverse_text" and Rollout.from_record(json.loads(line)).env == "reverse_text"
    old = {k: v for k, v in json.loads(line).items() if k != "env"}  # a file written before the field
    assert Rollout.from_record(old).env is None and "env" not in Rollout.from_record(old).to_json()


def classic_env_group(**kwargs):
    """verifiers' own classic EnvGroup of two single-turn environments, as a user would write it."""
    import verifiers as vf

    from . import vf_envs

    rubric = vf.Rubric(funcs=[vf_envs.says_five])
    envs = [vf.SingleTurnEnv(dataset=vf_envs.dataset(4, seed=s), rubric=rubric, system_prompt="Be brief.",
                             sampling_args={"max_tokens": 8}) for s in (0, 5)]
    return vf.EnvGroup(envs=envs, env_names=["words", "more_words"])


def test_verifiers_classic_env_group_runs_unchanged_through_the_adapter(tokenizer):
    from verifiers_rl.envs.adapters.verifiers_env import VerifiersEnv

    env = load_environment("tests.envs.test_mixture:classic_env_group", tokenizer=tokenizer)
    assert isinstance(env, VerifiersEnv) and len(env.dataset) == 8
    completions = [tokenizer.encode("5") + [tokenizer.eos_token_id], tokenizer.encode("no") + [tokenizer.eos_token_id]]
    rollouts = asyncio.run(env.rollout_group(ScriptedSampler(completions), env.dataset[5], "g", 2, seed=1))
    assert [r.reward for r in rollouts] == [1.0, 0.0]  # the group's own rubric scored each reply
    assert rollouts[0].prompt[-1]["content"] == env.dataset[5].prompt[-1]["content"]

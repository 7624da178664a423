"""The progress output's pure parts: the per-step line and the choice of sample completions."""

import math

from verifiers_rl.training.progress import (
    SampleLine,
    StepProgressCallback,
    format_eval_line,
    format_samples,
    format_step_line,
    format_summary,
    sample_lines,
    show_bar,
)
from verifiers_rl.core.rollout import Rollout


def test_step_line_shows_present_metrics_in_order_and_skips_absent_ones():
    logs = {"reward": 0.2314, "reward_std": 0.1, "loss": 0.01234, "staleness_max": 1.0, "step_time": 5.44,
            "generation_time": 3.06, "wait_time": 0.0, "train_time": 4.5, "weight_sync_time": 0.92,
            "between_steps_time": 0.02, "entropy": 3.2}
    line = format_step_line(12, 60, logs)
    assert line == ("step 12/60 | reward 0.231 ± 0.100 | loss 0.0123 | staleness 1 | gen 3.1s | wait 0.0s"
                    " | train 4.5s | sync 0.9s | step 5.4s")
    # A checkpoint or an evaluation after the previous step shows as its own part of the step.
    logs["between_steps_time"] = 2.0
    assert " | sync 0.9s | log/save/eval 2.0s | step 5.4s" in format_step_line(12, 60, logs)
    # Continuous generation's stale drops show when there were some.
    logs["groups_stale_dropped"] = 0.0
    assert "stale_dropped" not in format_step_line(12, 60, logs)
    logs["groups_stale_dropped"] = 2.0
    assert " | staleness 1 | stale_dropped 2 | gen 3.1s" in format_step_line(12, 60, logs)
    # Groups dropped on errors, labelled apart from --filter_groups' groups_dropped (a metric of its own).
    logs["groups_dropped_on_error"] = 3.0
    assert " | dropped_on_error 3 | stale_dropped 2 |" in format_step_line(12, 60, logs)
    # Replay without sampler log-probs: no is_ratio, no generation timing.
    assert format_step_line(1, 2, {"reward": 1.0}) == "step 1/2 | reward 1.000"


def _rollout(group, reward, reply):
    return Rollout([1, 2], [3], [1], reward, group, prompt=[{"role": "user", "content": f"q{group}"}],
                   completion=[{"role": "assistant", "content": reply}])


def test_samples_take_one_rollout_per_prompt_and_show_reward_prompt_and_reply():
    rollouts = [_rollout("a", 0.5, "x"), _rollout("a", 0.9, "y"), _rollout("b", 0.25, "z" * 300), _rollout("c", 0, "w")]
    picked = sample_lines(rollouts, 2)
    assert picked == [SampleLine("qa", "x", 0.5), SampleLine("qb", "z" * 300, 0.25)]
    text = format_samples(7, picked, width=40).splitlines()
    assert text[0] == "--- sample completions at step 7 ---"
    assert text[1] == "  [0.50] 'qa' -> 'x'"
    assert text[2].startswith("  [0.25] 'qb' -> 'zzz") and text[2].endswith("...") and len(text[2]) < 80
    # Plain-text prompts and completions (no chat) print as they are.
    plain = Rollout([1], [2], [1], 1.0, 0, prompt="say hi", completion="hi")
    assert sample_lines([plain], 3) == [SampleLine("say hi", "hi", 1.0)]


def test_summary_compares_the_first_and_last_logged_rewards():
    assert format_summary(60, 611.6, [0.1, 0.0, 0.2, 0.3, 0.5, 0.4]) == (
        "done: 60 steps in 612 s; mean reward 0.100 (first 3 logged steps) -> 0.400 (last 3)"
    )
    assert format_summary(1, 2.0, [0.5]) == "done: 1 steps in 2 s"
    assert format_summary(4, 9.6, [0.5], max_steps=12) == "stopped at step 4 of 12 in 10 s"
    assert format_summary(12, 9.6, [0.5], max_steps=12) == "done: 12 steps in 10 s"


def test_eval_line_shows_reward_pass_rates_and_size():
    logs = {"eval_reward": 0.3124, "eval_reward_std": 0.1, "eval_pass@1": 0.1, "eval_pass@4": 0.25,
            "eval_num_prompts": 100.0, "eval_samples_per_prompt": 4.0, "eval_runtime": 12.34, "epoch": 1.0}
    assert format_eval_line(20, logs) == (
        "eval at step 20 | reward 0.312 ± 0.100 | pass@1 0.100 | pass@4 0.250 | 100 prompts x 4 | 12.3s"
    )
    # One sample has no spread: evaluation's reward_std is NaN (TRL's nanstd); it was printed "± nan", and a None
    # "± 0.000", where the step line leaves it out.
    for std in (math.nan, None):
        one = {"eval_reward": 0.5, "eval_reward_std": std, "eval_pass@1": 0.0, "eval_num_prompts": 1.0,
               "eval_samples_per_prompt": 1.0}
        assert format_eval_line(1, one) == "eval at step 1 | reward 0.500 | pass@1 0.000 | 1 prompts x 1"


class _Stream:
    def __init__(self, tty):
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_bar_only_on_a_terminal():
    """A tqdm bar redraws itself with carriage returns: in a log file (stderr redirected) it would garble the step
    lines, so there is none."""
    assert show_bar(False, _Stream(True)) and not show_bar(True, _Stream(True))
    assert not show_bar(False, _Stream(False)) and not show_bar(False, object())
    callback = StepProgressCallback(lambda: [], show_bar=show_bar(False, _Stream(False)))
    state = type("State", (), {"is_world_process_zero": True, "max_steps": 3, "global_step": 0})()
    callback.on_train_begin(None, state, None)
    assert callback.bar is None


def test_the_summary_is_written_when_the_last_steps_metrics_come_with_it(capsys):
    # --logging_strategy no: HF logs the run's end (train_runtime) together with the last step's metrics.
    callback = StepProgressCallback(lambda: [], show_bar=False)
    state = type("State", (), {"is_world_process_zero": True, "max_steps": 2, "global_step": 2})()
    args = type("Args", (), {"print_samples_every": 0})()
    callback.on_log(args, state, None, logs={"reward": 0.5, "reward_std": 0.1, "train_runtime": 3.0})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("step 2/2 | reward 0.500") and lines[1] == "done: 2 steps in 3 s", lines

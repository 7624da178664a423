"""The benchmarks' own arithmetic: each script in ``benchmarks/`` is loaded from its file (they are scripts, not a
package) and its pure functions, or its smallest real measurement, checked against what its table claims."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (its ``main()`` is not run), importing the scripts beside it
    (``timing.py``, ...) as it does when run, from its own folder."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_logprob_memory_counts_the_weight_gradient_in_the_peak_increase():
    """The V x H weight gradient is allocated in every forward + backward, so the peak RSS increase over the inputs
    is at least its size; a baseline peak raised by a temporary copy of the weight made the gradient fit in freed
    memory (a chunked row showed less than the gradient alone, a negative 'excluding weight grad'). The child starts
    from a large parent here (a test worker is one): its peak so far is the parent's, which ru_maxrss alone read as
    the baseline (an increase of 0)."""
    bench = load_benchmark("logprob_memory")
    ballast = bytearray(512 * 2**20)
    ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # resident, as a busy worker's memory is
    row = bench.run_child(16, 16, bench.VOCAB, bench.HIDDEN, check=False, repeats=1)
    del ballast
    assert row["increase_kib"] * 1024 >= row["weight_grad_bytes"], row


def test_continuous_batching_quick_keeps_the_sizes_given():
    """--quick only fills in the sizes not given: it overwrote --requests, --max_rows, --median_tokens and --repeats
    (``--quick --requests 4`` ran 16 requests)."""
    bench = load_benchmark("continuous_batching")
    args = bench.parse_args(["--quick", "--requests", "4", "--max_rows", "2", "--median_tokens", "3", "--repeats", "2"])
    assert (args.requests, args.max_rows, args.median_tokens, args.repeats, args.model) == (4, 2, 3, 2, "tiny")
    quick, full = bench.parse_args(["--quick"]), bench.parse_args([])
    assert (quick.requests, quick.max_rows, quick.median_tokens, quick.repeats) == (16, 4, 8, 1)
    assert (full.requests, full.max_rows, full.median_tokens, full.repeats, full.model) == (64, 16, 32, 3, "smollm2")


def test_vs_trl_quick_keeps_the_steps_and_threads_given():
    """--quick only fills in what is not given: it overwrote --steps, --warmup and --threads (``--quick --steps 2``
    timed 4 steps)."""
    bench = load_benchmark("vs_trl")
    given = bench.workload_args(bench.parse_args(["--quick", "--steps", "2", "--warmup", "0", "--threads", "1", "2"]),
                                "tiny")
    assert (given.steps, given.warmup, given.threads, given.hidden) == (2, 0, [1, 2], 256)
    quick = bench.workload_args(bench.parse_args(["--quick"]), "tiny")
    assert (quick.steps, quick.warmup, quick.threads) == (4, 1, [1])
    full = bench.workload_args(bench.parse_args([]), "tiny")
    assert (full.steps, full.warmup, full.threads) == (8, 2, [1, 2])


def test_async_generation_quick_keeps_the_sizes_given_and_refuses_no_timed_step(capsys):
    """--quick overwrote --steps, --warmup, --phase_batches and --threads (``--quick --steps 2`` timed 4 steps), and
    ``--steps 0`` trained every run, then failed with a ZeroDivisionError traceback: the flags given stand, and a size
    below its bound is refused by name before the model is built."""
    bench = load_benchmark("async_generation")
    given = bench.parse_args(["--quick", "--steps", "2", "--warmup", "0", "--phase_batches", "5", "--threads", "2"])
    assert (given.steps, given.warmup, given.phase_batches, given.threads) == (2, 0, 5, [2])
    quick, full = bench.parse_args(["--quick"]), bench.parse_args([])
    assert (quick.steps, quick.warmup, quick.phase_batches, quick.threads) == (4, 1, 2, [1])
    assert (full.steps, full.warmup, full.phase_batches, full.threads) == (8, 2, 3, [1, 2])
    for argv, message in ((["--steps", "0"], "--steps must be >= 1 (got 0)"),
                          (["--rollouts", "30"], "--rollouts (30) must be a multiple of --num_generations (8)")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert message in capsys.readouterr().err


def test_vs_trl_shapes_only_the_tiny_model(capsys):
    """``--model tiny`` on a SmolLM2 workload (the default ones) built a model of hidden None, a TypeError traceback;
    ``--hidden 64`` beside a SmolLM2 workload was dropped without a word. The first takes the tiny workload's shape,
    the second is refused by name."""
    bench = load_benchmark("vs_trl")
    tiny = bench.workload_args(bench.parse_args(["--model", "tiny"]), "equal16")
    assert (tiny.model, tiny.hidden, tiny.layers, tiny.max_completion_length) == ("tiny", 256, 4, 16)
    shaped = bench.workload_args(bench.parse_args(["--model", "tiny", "--hidden", "64"]), "equal16")
    assert (shaped.hidden, shaped.layers) == (64, 4)
    with pytest.raises(SystemExit):
        bench.parse_args(["--workloads", "tiny", "equal16", "--layers", "2"])
    assert "--hidden/--layers shape the tiny model only: the equal16 workload runs SmolLM2" in capsys.readouterr().err


def test_long_tail_refuses_k_where_only_trl_runs(capsys):
    """``--sides trl --k 3`` ran TRL's side (which generates on its policy, never ahead) and printed 'k = 3' in the
    header: --k acts on our sides only, so beside trl alone it is refused, as the other side-bound flags are."""
    bench = load_benchmark("long_tail")
    assert (bench.parse_args(["--sides", "trl"]).k, bench.parse_args(["--k", "3"]).k) == (1, 3)
    with pytest.raises(SystemExit):
        bench.parse_args(["--sides", "trl", "--k", "3"])
    assert "--k does not act here" in capsys.readouterr().err


def test_long_tail_takes_k_0_when_no_side_generates_ahead(capsys):
    """``--sides batch --k 0`` was refused as 'continuous generation needs k >= 1', though the batch side trains k = 0
    (batch-at-a-time, on-policy): k 0 is taken when no side generates ahead, and refused naming the side that does."""
    bench = load_benchmark("long_tail")
    assert bench.parse_args(["--sides", "batch", "--k", "0"]).k == 0
    assert bench.parse_args(["--sides", "batch", "trl", "--k", "0"]).k == 0
    for sides, side, bound in ((["batch", "groups"], "groups", 1), (["continuous"], "continuous", 1),
                               (["batch"], None, 0)):
        with pytest.raises(SystemExit):
            bench.parse_args(["--sides", *sides, "--k", "-1" if side is None else "0"])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"--k must be >= {bound} (got {-1 if side is None else 0})" in error
        assert side is None or f"the {side} side generates while the trainer trains" in error


def test_long_tail_header_names_the_settings_of_the_sides_that_run():
    """The header said 'k = 1, continuous: groups_in_flight 8, continuous_batching_rows 8' beside ``--sides batch trl``
    too, settings of a side that never ran: it names those of the sides run, and none beside TRL's alone."""
    bench = load_benchmark("long_tail")
    default = bench.our_settings(bench.parse_args(["--quick"]))
    assert default.endswith("k = 1, continuous: groups_in_flight 8, continuous_batching_rows 8")
    batch = bench.our_settings(bench.parse_args(["--quick", "--sides", "batch", "trl", "--k", "0"]))
    assert batch.endswith("k = 0") and "groups_in_flight" not in batch and "continuous" not in batch
    groups = bench.our_settings(bench.parse_args(["--quick", "--sides", "groups"]))
    assert groups.endswith("k = 1, groups: groups_in_flight 8")
    assert bench.our_settings(bench.parse_args(["--quick", "--sides", "trl"])) == "TRL's side alone"


@pytest.mark.parametrize("name, argv", [("long_tail", []), ("gpu_vs_trl", ["--shape", "tiny", "--device", "cpu"])])
def test_a_json_file_that_cannot_be_written_is_refused_before_the_run(name, argv, tmp_path, capsys):
    """--json is written once the numbers are in: a folder, or a file in a missing folder, failed with a traceback
    after the whole run (long_tail.py) or after the first trainer on the GPU (gpu_vs_trl.py)."""
    bench = load_benchmark(name)
    assert bench.parse_args(argv + ["--json", str(tmp_path / "out.json")]).json == str(tmp_path / "out.json")
    for path in (tmp_path, tmp_path / "missing" / "out.json"):
        with pytest.raises(SystemExit):
            bench.parse_args(argv + ["--json", str(path)])
        assert f"--json {path}: a folder, or in a folder that does not exist" in capsys.readouterr().err
    if Path("/proc/self").is_dir():  # Linux's /proc, where nothing can be created: the write failed after the run
        with pytest.raises(SystemExit):
            bench.parse_args(argv + ["--json", "/proc/out.json"])
        assert "--json /proc/out.json: cannot create or write the file (" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["continuous_batching", "long_tail"])
def test_a_model_that_is_no_folder_and_no_hub_id_is_one_line(name, tmp_path, capsys):
    """``--model /no/such/folder`` loaded the script, then failed in resolve_model with a FileNotFoundError
    traceback; it is refused in one line naming --model."""
    bench = load_benchmark(name)
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(["--model", str(tmp_path / "none")])
    assert refused.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--model '{tmp_path / 'none'}': no such folder, and it is not a Hugging Face Hub id" in error


def test_soak_refuses_a_run_no_longer_than_its_warmup_before_running(capsys):
    """``--steps 5`` (warm-up 10) ran its 5 steps and then failed in the report with an IndexError traceback; it is
    refused at once, naming both flags, and a short run with a shorter warm-up is accepted."""
    bench = load_benchmark("soak")
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(["--mode", "live", "--steps", "5"])
    assert refused.value.code == 2
    assert "--steps (5) must be >= --warmup (10) + 2 x 1" in capsys.readouterr().err
    assert (bench.parse_args(["--steps", "5", "--warmup", "1"]).steps, bench.parse_args([]).steps) == (5, None)


def test_soak_states_its_memory_target_in_the_unit_it_measures(capsys):
    """The verdict measures RSS in MiB (bytes / 2**20) against 50; the docstring (the --help text) said 50 MB."""
    bench = load_benchmark("soak")
    rows = [bench.Row(step, 500.0 + step / 10, 9, 9, 0, 0.05) for step in range(1, 21)]
    assert bench.report("live", rows, warmup=1)
    verdict = next(line for line in capsys.readouterr().out.splitlines() if "RSS growth" in line)
    assert "+1.8 MiB (target < 50)" in verdict
    assert "grows < 50 MiB" in " ".join(bench.__doc__.split())


def test_soak_names_the_steps_its_first_window_timed(capsys):
    """The first window is the tenth of the run after --warmup: with a warm-up of 16 of 20 steps it is steps 17-18,
    and the last tenth steps 19-20 (a window cut at the run's end once named a step the run never had)."""
    bench = load_benchmark("soak")
    rows = [bench.Row(step, 500.0, 9, 9, 0, 0.05) for step in range(1, 21)]
    bench.report("live", rows, warmup=16)
    verdict = next(line for line in capsys.readouterr().out.splitlines() if "median step time" in line)
    assert "(steps 17-18)" in verdict and "(last 2)" in verdict, verdict


LIVE_DEFAULT = "the live run's default --steps (300)"


@pytest.mark.parametrize("argv, given", [(["--steps", "20", "--warmup", "17"], "--steps (20)"),
                                         (["--mode", "live", "--warmup", "250"], LIVE_DEFAULT),
                                         (["--warmup", "900"], LIVE_DEFAULT)])
def test_soak_refuses_a_warmup_that_makes_its_two_windows_overlap(argv, given, capsys):
    """With --warmup covering most of the run the first window (the tenth after the warm-up) and the last tenth
    overlapped (steps 18-19 against 19-20 at 17 of 20): the verdict compared steps with themselves and could not see
    a slowdown. Refused before the run, for each mode's steps, naming --steps and --warmup."""
    bench = load_benchmark("soak")
    assert bench.parse_args(["--steps", "20", "--warmup", "16"]).warmup == 16
    assert bench.parse_args(["--mode", "replay", "--warmup", "250"]).warmup == 250  # 1,000 steps hold it
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(argv)
    assert refused.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{given} must be >= --warmup" in error and "would overlap" in error
    assert error.endswith("raise --steps or lower --warmup")
    rows = [bench.Row(step, 500.0, 9, 9, 0, 0.05) for step in range(1, 21)]
    with pytest.raises(ValueError, match="would overlap in 20 steps"):
        bench.report("live", rows, warmup=17)


def test_gpu_vs_trl_without_a_gpu_says_so_in_one_line(capsys):
    """Without CUDA the default fell back to the 0.5B model on the CPU (hours, no GPU number): it is refused naming
    the CPU check's flags, which stay accepted."""
    import torch

    bench = load_benchmark("gpu_vs_trl")
    assert bench.parse_args(["--shape", "tiny", "--device", "cpu"]).device == "cpu"
    if torch.cuda.is_available():
        assert bench.parse_args([]).device == "cuda"
        return
    with pytest.raises(SystemExit) as refused:
        bench.parse_args([])
    assert refused.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no CUDA GPU here" in error and "--shape tiny --device cpu" in error


def test_gpu_vs_trl_refuses_the_full_shape_on_the_cpu(capsys):
    """``--device cpu`` alone kept the default 0.5B shape: the hours on the CPU the default no longer falls into, by
    flag; the help says cpu only checks the script, with --shape tiny."""
    bench = load_benchmark("gpu_vs_trl")
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(["--device", "cpu"])
    assert refused.value.code == 2
    assert "--device cpu checks the script with --shape tiny; --shape 0.5b on the CPU" in capsys.readouterr().err


def test_gpu_vs_trl_refuses_a_peak_tflops_not_above_zero(capsys):
    """``--peak_tflops 0`` ran the first trainer, then failed dividing the MFU by zero (a negative one printed a
    negative MFU): refused at parse time, by name and value."""
    bench = load_benchmark("gpu_vs_trl")
    tiny = ["--shape", "tiny", "--device", "cpu"]
    assert bench.parse_args(tiny + ["--peak_tflops", "1.5"]).peak_tflops == 1.5
    for value in ("0", "-989", "nan"):
        with pytest.raises(SystemExit) as refused:
            bench.parse_args(tiny + ["--peak_tflops", value])
        assert refused.value.code == 2
        assert f"--peak_tflops must be > 0 (got {float(value)})" in capsys.readouterr().err.strip().splitlines()[-1]


def test_vllm_weight_transfer_quick_keeps_the_repeats_given(capsys):
    """--quick overwrote --repeats (``--quick --repeats 1`` timed 3 loads per mode), and ``--repeats 0`` started the
    server, then failed on an empty median: a given --repeats keeps its value, below 1 is refused before any server."""
    bench = load_benchmark("vllm_weight_transfer")
    assert [bench.parse_args(argv).repeats for argv in (["--quick", "--repeats", "1"], ["--quick"], [])] == [1, 3, 5]
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "0"])
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_vllm_servers_refuses_fewer_than_two_steps_before_starting_servers(capsys):
    """The medians leave step 1 (the warm-up) out: ``--steps 1`` started both configurations' servers and trained,
    then failed on an empty median; it is refused at once."""
    bench = load_benchmark("vllm_servers")
    assert bench.parse_args(["--steps", "2"]).steps == 2
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "1"])
    assert "--steps must be >= 2 (got 1)" in capsys.readouterr().err


def test_prefix_sharing_refuses_layers_beside_the_real_model(capsys):
    """``--model smollm2 --layers 4`` ran the real model's layers, the flag ignored; it is refused by name, and
    ``--repeats 0`` (silently the default before) too."""
    bench = load_benchmark("prefix_sharing")
    assert (bench.parse_args([]).layers, bench.parse_args(["--layers", "4"]).layers) == (2, 4)
    for argv, message in ((["--model", "smollm2", "--layers", "4"], "--layers shapes the smollm2-shaped model only"),
                          (["--repeats", "0"], "--repeats must be >= 1")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert message in capsys.readouterr().err


def test_v1_episodes_refuses_sizes_below_one_before_starting_the_worker(capsys):
    """``--repeats 0`` ran the warm-up batch through both v1 harnesses, then failed on an empty median (a traceback
    after minutes); every size below 1 is refused at once, by name."""
    bench = load_benchmark("v1_episodes")
    assert bench.parse_args(["--groups", "1", "--group_size", "1", "--repeats", "1"]).repeats == 1
    for flag in ("--repeats", "--groups", "--group_size", "--max_new_tokens"):
        with pytest.raises(SystemExit):
            bench.parse_args([flag, "0"])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert flag in error and "must be >= 1" in error


def test_packing_refuses_repeats_below_one(capsys):
    """``--repeats 0`` silently timed the default number of repetitions, a negative one built the model and then
    failed on an empty median: both are refused by name."""
    bench = load_benchmark("packing")
    assert bench.parse_args(["--repeats", "1"]).repeats == 1
    for value in ("0", "-1"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--repeats", value])
        assert "--repeats must be >= 1" in capsys.readouterr().err


def test_logprob_memory_refuses_sizes_below_one(capsys):
    """``--repeats 0`` and ``--tokens 0`` silently ran the defaults: refused by name."""
    bench = load_benchmark("logprob_memory")
    assert bench.parse_args(["--tokens", "16", "--repeats", "1"]).tokens == 16
    for flag in ("--tokens", "--repeats", "--vocab"):
        with pytest.raises(SystemExit):
            bench.parse_args([flag, "0"])
        assert f"{flag} must be >= 1 (got 0)" in capsys.readouterr().err


# One refusal per script of timing.at_least, the size check they share: the flag, the bound and the value given.
SIZE_REFUSALS = [
    ("continuous_batching", ["--threads", "0"], "--threads must be >= 1 (got 0)"),
    ("logprob_memory", ["--hidden", "-1"], "--hidden must be >= 1 (got -1)"),
    ("long_tail", ["--continuous_rows", "0"], "--continuous_rows must be >= 1 (got 0): 0 is batch-at-a-time"),
    ("packing", ["--repeats", "-2"], "--repeats must be >= 1 (got -2)"),
    ("prefix_sharing", ["--rows", "0"], "--rows must be >= 1 (got 0)"),
    ("v1_episodes", ["--group_size", "0"], "--group_size must be >= 1 (got 0)"),
    ("vllm_weight_transfer", ["--quick", "--repeats", "0"], "--repeats must be >= 1 (got 0)"),
    ("vllm_servers", ["--steps", "1"], "--steps must be >= 2 (got 1): step 1 includes the warm-up"),
    ("soak", ["--warmup", "-1"], "--warmup must be >= 0 (got -1)"),
    ("vs_trl", ["--threads", "1", "0"], "--threads must be >= 1 (got 0)"),
    ("vs_trl", ["--learning_rate", "-1"], "--learning_rate must be >= 0 (got -1.0)"),
    ("embedded_decode", ["--batches", "0"], "--batches must be >= 1 (got 0)"),
    ("weight_sync", ["--quick", "--repetitions", "0"], "--repetitions must be >= 1 (got 0)"),
    ("gpu_vs_trl", ["--shape", "tiny", "--device", "cpu", "--num_generations", "1"],
     "--num_generations must be >= 2 (got 1)"),
    ("gpu_vs_trl", ["--shape", "tiny", "--device", "cpu", "--budget_s", "nan"], "--budget_s must be >= 0 (got nan)"),
]


@pytest.mark.parametrize("name, argv, message", SIZE_REFUSALS, ids=[case[0] for case in SIZE_REFUSALS])
def test_each_script_refuses_a_size_below_its_bound_by_name_and_value(name, argv, message, capsys):
    """Each script had its own one-line check, naming every size flag at once whichever was wrong (long_tail.py's
    let ``--continuous_rows 0`` through, continuous_batching.py never checked ``--threads``), or none at all (vs_trl,
    embedded_decode, weight_sync and gpu_vs_trl ran, then failed on an empty median or in a trainer's config);
    timing.at_least names the flag given and its value, in one error line."""
    bench = load_benchmark(name)
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(argv)
    assert refused.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


# One repeat per script of a flag that lists runs: the flag, its values and the repeat.
REPEATS = [
    ("long_tail", ["--sides", "batch", "trl", "batch"], "--sides batch trl batch: batch given more than once"),
    ("long_tail", ["--workloads", "single", "single"], "--workloads single single: single given more than once"),
    ("gpu_vs_trl", ["--shape", "tiny", "--device", "cpu", "--trainers", "trl", "trl"], "--trainers trl trl: trl"),
    ("vs_trl", ["--threads", "2", "2"], "--threads 2 2: 2 given more than once"),
    ("async_generation", ["--variants", "k1", "k1"], "--variants k1 k1: k1 given more than once"),
    ("continuous_batching", ["--workloads", "uniform", "uniform"], "--workloads uniform uniform: uniform given"),
    ("embedded_decode", ["--max_new_tokens", "16", "16"], "--max_new_tokens 16 16: 16 given more than once"),
]


@pytest.mark.parametrize("name, argv, message", REPEATS, ids=[f"{case[0]}-{case[1][-1]}" for case in REPEATS])
def test_a_value_given_twice_to_a_flag_that_lists_runs_is_refused(name, argv, message, capsys):
    """``--sides batch batch`` ran the batch side twice, the second run replacing the first in the table (long_tail),
    ``--trainers trl trl`` printed TRL's row twice (gpu_vs_trl): each value is a run of its own, so a repeat is refused
    by name before any model is built; the same values once each are taken."""
    bench = load_benchmark(name)
    assert getattr(bench.parse_args(argv[:-1]), message.split()[0][2:]) is not None
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(argv)
    assert refused.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error and "each value runs once" in error, error


# Run in a fresh interpreter: what matters is OMP_WAIT_POLICY at the moment torch (and its OpenMP) first loads; the
# script is run up to that moment only (torch's import takes seconds).
POLICY_AT_TORCH_IMPORT = """
import os, sys
sys.path.insert(0, {tests!r})


class Watch:  # a real import hook, not a mock: it prints the policy when torch is first looked up, and stops there
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print(os.environ.get("OMP_WAIT_POLICY"), flush=True)
            os._exit(0)


sys.meta_path.insert(0, Watch())
from test_benchmarks import load_benchmark

load_benchmark("continuous_batching")
"""


def test_continuous_batching_sets_omp_wait_policy_passive_before_torch_loads():
    """long_tail.py set OMP_WAIT_POLICY=PASSIVE before torch loaded; continuous_batching.py, measuring the same engine,
    ran under OpenMP's default (spinning idle threads). Now both call timing.passive_openmp, which keeps a policy the
    environment names."""
    code = POLICY_AT_TORCH_IMPORT.format(tests=str(Path(__file__).parent))
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    for given, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        run_env = env if given is None else {**env, "OMP_WAIT_POLICY": given}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=120)
        assert (out.returncode, out.stdout.strip()) == (0, expected), out.stderr[-2000:]


# Run in a fresh interpreter: the test process has torch and transformers loaded already.
LOADED_BY_LOGPROB_MEMORY = """
import sys
sys.path.insert(0, {benchmarks!r})
import logprob_memory, timing
print(sorted({{"torch", "transformers"}} & set(sys.modules)), hasattr(timing, "StepRecorder"))
"""


def test_step_recorder_is_steps_py_and_timing_py_loads_no_torch():
    """timing.py built StepRecorder through a module-level __getattr__ so that logprob_memory.py's parent, which only
    starts children, loaded no torch: StepRecorder is steps.py's (imported by the scripts that time a trainer), and
    timing.py, with logprob_memory.py over it, still loads neither transformers nor torch."""
    from transformers import TrainerCallback

    code = LOADED_BY_LOGPROB_MEMORY.format(benchmarks=str(BENCHMARKS))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout.split()) == (0, ["[]", "False"]), out.stderr[-2000:]
    assert issubclass(load_benchmark("steps").StepRecorder, TrainerCallback)


def test_prefix_sharing_fit_flags_a_negative_cost_instead_of_printing_it_as_measured():
    """Under load the least-squares fit of wall time on tokens and attention cells can give a cell (or a token) a
    negative cost; the line printed b / a, a negative 'attention cell costs' in token units, as a measurement."""
    bench = load_benchmark("prefix_sharing")
    shapes = [(1000, 2e6), (2000, 1e6), (1500, 5e6), (3000, 4e6)]
    clean = [dict(tokens=t, cells=c, seconds=1e-4 * t + 2e-8 * c) for t, c in shapes]
    line = bench.fit_line(clean, 3e-4)
    assert "an attention cell costs 2.00e-04 tokens measured; auto models 3.00e-04" in line
    assert "UNRELIABLE" not in line
    noisy = [dict(tokens=t, cells=c, seconds=1e-4 * t - 2e-8 * c) for t, c in shapes]  # faster with more cells, all > 0
    line = bench.fit_line(noisy, 3e-4)
    assert "x tokens - 2.000e-08 x cells -> UNRELIABLE: a cost at or below 0 per cell" in line
    assert "attention cell costs" not in line


def test_packing_fraction_of_shared_rows_stays_within_the_computed_tokens():
    """With prompts shared (``--workload uniform``) a group's prompt is forwarded once, so real / computed read
    131.6%: the column is the share of computed tokens that are not padding, at most 1, and 1 when packed."""
    from verifiers_rl.training.batching import BatchingConfig, plan_batch

    bench = load_benchmark("packing")
    rollouts = bench.uniform_rollouts(400)
    fractions = {}
    for mode, budget in (("padded", {"rows_per_micro_batch": 32}), ("packed", {"max_tokens_per_microbatch": 684})):
        config = BatchingConfig(world_size=1, max_seq_len=171, overlong="truncate", mode=mode,
                                share_prompt_training="auto", **budget)
        (rank_batch,) = plan_batch(rollouts, config)
        assert rank_batch.stats.real_tokens > rank_batch.stats.computed_tokens  # the prompts forwarded once
        fractions[mode] = bench.forwarded_real_fraction(rank_batch.stats)
    assert 0.9 < fractions["padded"] < 1 and fractions["packed"] == 1

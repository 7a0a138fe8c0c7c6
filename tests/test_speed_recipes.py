"""recipes/mixed_precision.py and recipes/compiled_model.py: correctness of what they measure.

Their speed targets are measured by benchmarks/run.py, never asserted here.
"""

import json
import math
import re
import signal
import statistics

import pytest
import torch
from conftest import ROOT, assert_same_weights, load_recipe, load_weights, read_metrics, read_scalars, run_subprocess

MP_SMALL = ["--samples", 256, "--batch-size", 64, "--width", 32, "--depth", 2]
CM_SMALL = ["--samples", 512, "--batch-size", 128, "--width", 16, "--depth", 2]


def parse_table(stdout: str) -> dict[str, list[str]]:
    """Markdown table rows of stdout, keyed by their first cell."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in stdout.splitlines()
            if line.startswith("| ") and not line.startswith("|---")]
    return {row[0]: row[1:] for row in rows}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_mixed_precision_trains_in_each_precision(run_inprocess, tmp_path, precision):
    run_dir = tmp_path / precision
    result = run_inprocess("mixed_precision", *MP_SMALL, "--epochs", 2, "--precision", precision,
                           "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    metrics = read_metrics(run_dir)
    assert metrics["steps"] == 8 and math.isfinite(metrics["train_loss"])
    assert {"train/loss", "val/loss", "val/acc", "perf/samples_per_s"} <= read_scalars(run_dir).keys()
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (state["scaler"] is not None) == (precision == "fp16")
    losses = [v for _, v in read_scalars(run_dir)["train/loss"]]
    assert losses[-1] < losses[0]


def test_bf16_autocast_changes_the_numbers_but_not_the_training(run_inprocess, tmp_path):
    """The same seed and steps in fp32 and bf16: bf16's matmuls round differently, so the losses differ from
    step 1 on (a recipe that ignored --precision would match exactly), yet follow the same curve."""
    losses = {}
    for precision in ("fp32", "bf16"):
        result = run_inprocess("mixed_precision", *MP_SMALL, "--epochs", 1, "--precision", precision,
                               "--run-dir", tmp_path / precision)
        assert result.code == 0, result.stderr
        losses[precision] = [v for _, v in read_scalars(tmp_path / precision)["train/loss"]]
    assert len(losses["fp32"]) == len(losses["bf16"]) == 4
    assert all(a != b for a, b in zip(losses["fp32"], losses["bf16"], strict=True))
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.05)


def test_fp16_resume_restores_the_scaler(run_inprocess, tmp_path):
    common = [*MP_SMALL, "--epochs", 2, "--precision", "fp16"]
    assert run_inprocess("mixed_precision", *common, "--run-dir", tmp_path / "full").code == 0
    assert run_inprocess("mixed_precision", *common, "--max-steps", 3, "--run-dir", tmp_path / "cut").code == 0
    cut = torch.load(tmp_path / "cut" / "checkpoints" / "last.pt", weights_only=True)
    assert cut["scaler"]["scale"] == 65536.0 and cut["scaler"]["_growth_tracker"] == 3
    # without --precision (whose default is fp32): the run goes on in the precision it started with
    resumed = run_inprocess("mixed_precision", *common[:-2], "--resume", "auto", "--run-dir", tmp_path / "cut")
    assert resumed.code == 0, resumed.stderr
    assert "| precision fp16 (as its checkpoint ran) |" in resumed.stdout
    assert_same_weights(load_weights(tmp_path / "full" / "checkpoints" / "last.pt"),
                        load_weights(tmp_path / "cut" / "checkpoints" / "last.pt"))
    full = torch.load(tmp_path / "full" / "checkpoints" / "last.pt", weights_only=True)["scaler"]
    resumed = torch.load(tmp_path / "cut" / "checkpoints" / "last.pt", weights_only=True)["scaler"]
    assert full == resumed  # scale and growth tracker continued, not restarted


def test_mixed_precision_compare_table(run_inprocess, tmp_path):
    result = run_inprocess("mixed_precision", "--compare", *MP_SMALL, "--epochs", 1, "--max-slowdown", 1e6,
                           "--run-dir", tmp_path / "cmp")
    assert result.code == 0, result.stderr
    table = parse_table(result.stdout)
    assert {"fp32", "bf16", "fp16"} <= table.keys()
    assert "| speed-up over fp32 | last epoch's mean train loss | val loss |" in result.stdout  # was "final loss"
    summary = json.loads((tmp_path / "cmp" / "metrics.json").read_text())
    rows = summary["compare"]
    assert summary["repeats"] == 3 and "median (min-max) of 3 interleaved rounds" in result.stdout
    for precision in ("fp32", "bf16", "fp16"):
        ms, throughput, speedup, final_loss = table[precision][:4]
        row = rows[precision]
        # one clock for all: samples/s is the batch over the very seconds per step the table shows
        assert float(ms.split()[0]) == pytest.approx(statistics.median(row["ms_per_step"]), abs=0.01)
        assert float(throughput.replace(",", "")) == pytest.approx(statistics.median(row["samples_per_s"]), abs=1)
        assert [b / s for b, s in zip([64] * 3, [m / 1000 for m in row["ms_per_step"]], strict=True)] == \
            pytest.approx(row["samples_per_s"])
        assert float(speedup.split()[0]) == pytest.approx(statistics.median(row["speedup"]), abs=0.01)
        assert float(final_loss) == pytest.approx(row["train_loss"], abs=1e-4)
        assert float(table[precision][4]) == pytest.approx(row["val_loss"], abs=1e-4)  # every step's, skipped too
        assert math.isfinite(row["max_loss_diff"])
        reason = json.loads((tmp_path / "cmp" / precision / "config.json").read_text())["precision_reason"]
        assert reason == "one of --compare's"  # bf16 and fp16 were "the default"
    assert rows["fp32"]["max_loss_diff"] == 0 and rows["fp32"]["speedup"] == [1.0, 1.0, 1.0]
    assert 0 < rows["bf16"]["max_loss_diff"] < 0.1  # bf16 really ran, and tracks fp32 closely
    for precision in ("fp32", "bf16", "fp16"):
        assert (tmp_path / "cmp" / precision / "checkpoints" / "last.pt").is_file()
    assert_a_second_compare_is_refused_without_a_hint_to_resume(run_inprocess, "mixed_precision", tmp_path / "cmp")


def test_a_precision_that_diverges_or_fails_at_full_size_is_a_row_of_the_compare(run_inprocess, tmp_path,
                                                                                   monkeypatch):
    """fp16 diverging ended the whole --compare (no table, no metrics.json, the folder then refused); bf16 failing
    at full size only (out of memory, say) while a tiny model ran was a ZeroDivisionError."""
    mixed = load_recipe("mixed_precision")
    timed, train = mixed.seconds_per_step, mixed.train

    def bf16_too_big(device, precision, width, *args, **kwargs):
        return (math.inf, "out of memory") if precision == "bf16" and width > 8 else \
            timed(device, precision, width, *args, **kwargs)

    def fp16_diverges(**options):
        if options["precision"] == "fp16":
            raise mixed.cli.RecipeError("training diverged: the validation loss is nan at step 8; no checkpoint yet. "
                                        "Try a lower --lr")
        return train(**options)

    monkeypatch.setattr(mixed, "seconds_per_step", bf16_too_big)
    monkeypatch.setattr(mixed, "train", fp16_diverges)
    result = run_inprocess("mixed_precision", "--compare", *MP_SMALL, "--epochs", 1, "--max-slowdown", 1e6,
                           "--run-dir", tmp_path / "cmp")
    assert result.code == 0, result.stderr
    table = parse_table(result.stdout)
    assert table["bf16"][3] == "unsupported here: it fails at this --width and --batch-size (out of memory?)"
    assert table["fp16"][3] == "training diverged: the validation loss is nan at step 8"
    rows = json.loads((tmp_path / "cmp" / "metrics.json").read_text())["compare"]
    assert rows["fp16"]["note"] == table["fp16"][3] and "train_loss" in rows["fp32"]


def test_a_precision_that_alone_fails_to_compile_is_a_row_of_the_compare(run_inprocess, tmp_path, monkeypatch):
    """A compiler that is missing fails fp32 first, and ends the command in one line; a precision whose code alone
    fails to compile (fp16's vector code on an older compiler, say) is a row of the table, not the end of it."""
    mixed = load_recipe("mixed_precision")
    step = mixed.amp_step

    def fp16_fails(model, optimizer, scaler, batch, device, precision):
        if precision == "fp16":
            failed = RuntimeError("backend='inductor' raised: CppCompileError: C++ compile error")
            failed.inner_exception = type("CppCompileError", (RuntimeError,), {})("C++ compile error")
            raise failed
        return step(model, optimizer, scaler, batch, device, precision)

    monkeypatch.setattr(mixed, "amp_step", fp16_fails)
    result = run_inprocess("mixed_precision", "--compare", *MP_SMALL, "--epochs", 1, "--max-slowdown", 1e6,
                           "--run-dir", tmp_path / "cmp")
    assert result.code == 0, result.stderr
    assert parse_table(result.stdout)["fp16"][3] == "unsupported here: backend='inductor' raised: CppCompileError: " \
                                                    "C++ compile error"


def test_a_compare_whose_every_precision_diverged_keeps_its_table(run_inprocess, tmp_path, monkeypatch):
    """No precision saved a checkpoint, so the folder its done: line named, metrics.json and all, was removed."""
    mixed = load_recipe("mixed_precision")

    def diverges(**options):
        raise mixed.cli.RecipeError("training diverged: the loss is nan at step 2; no checkpoint yet. Try a lower --lr")

    monkeypatch.setattr(mixed, "train", diverges)
    result = run_inprocess("mixed_precision", "--compare", *MP_SMALL, "--epochs", 1, "--max-slowdown", 1e6,
                           "--run-dir", tmp_path / "cmp")
    assert result.code == 0 and result.stdout.endswith(f"run_dir={tmp_path / 'cmp'}\n"), result.stderr
    rows = json.loads((tmp_path / "cmp" / "metrics.json").read_text())["compare"]
    assert {row["note"] for row in rows.values()} == {"training diverged: the loss is nan at step 2"}


def assert_a_second_compare_is_refused_without_a_hint_to_resume(run_inprocess, recipe: str, run_dir) -> None:
    """--compare refuses --resume, so its refusal of a folder holding checkpoints must not suggest one."""
    summary = (run_dir / "metrics.json").read_bytes()
    again = run_inprocess(recipe, "--compare", "--run-dir", run_dir)
    assert again.code == 1
    assert again.stderr == f"error: {run_dir} already holds checkpoints; this command starts afresh: choose another " \
                           "--run-dir\n"
    for resume in ([], ["--resume", "auto"]):  # a single run there was told to --resume auto, then refused
        single = run_inprocess(recipe, *resume, "--run-dir", run_dir)
        assert single.code == 1 and "--cv" not in single.stderr and single.stderr.startswith(
            f"error: {run_dir} holds runs in sub-folders ("), single.stderr
        assert single.stderr.endswith("start afresh beside: choose another --run-dir, or to continue it, give the "
                                      "options it was started with\n")
    assert (run_dir / "metrics.json").read_bytes() == summary


@pytest.mark.parametrize(("recipe", "step_function", "timing", "small"), [
    ("mixed_precision", "amp_step", "seconds_per_step", MP_SMALL),
    ("compiled_model", "train_step", "measure_speed", CM_SMALL)])
def test_ctrl_c_in_a_compare_says_to_run_it_again_not_to_resume(run_inprocess, tmp_path, monkeypatch, recipe,
                                                                step_function, timing, small):
    """--compare refuses --resume, so a Ctrl-C in one of its runs must not print a command that resumes."""
    module, steps = load_recipe(recipe), []
    step = getattr(module, step_function)

    def step_then_ctrl_c(*args, **kwargs):
        steps.append(1)
        if len(steps) == 2:
            signal.raise_signal(signal.SIGINT)  # as a Ctrl-C during the second step
        return step(*args, **kwargs)

    monkeypatch.setattr(module, step_function, step_then_ctrl_c)
    monkeypatch.setattr(module, timing, lambda *args, **kwargs: (0.01, ""))  # no timing: the runs are the point
    result = run_inprocess(recipe, "--compare", *small, "--epochs", 1, "--run-dir", tmp_path / "cmp")
    assert result.code == 130, result.stderr
    assert result.stdout.splitlines()[-1] == ("interrupted at step 2; this command always starts afresh: run it "
                                              "again with another --run-dir")
    assert "--resume" not in result.stdout
    first = "fp32" if recipe == "mixed_precision" else "eager"
    saved = torch.load(tmp_path / "cmp" / first / "checkpoints" / "last.pt", weights_only=True)
    assert saved["step"] == 2  # the step it stopped at was saved all the same
    config = json.loads((tmp_path / "cmp" / first / "config.json").read_text())
    assert not [key for key in config if key.startswith("compare")]  # its --config-file replays it as one run


@pytest.mark.parametrize("recipe", ["mixed_precision", "compiled_model"])
@pytest.mark.parametrize("compare", [["--compare"], []])
def test_a_batch_larger_than_the_training_set_is_a_usage_error_before_timing(run_inprocess, tmp_path, monkeypatch,
                                                                             recipe, compare):
    """--compare used to time the models first (a minute, compiling), then fail in the first training run; both
    modes then said it as a runtime error (exit 1), though the two options alone decide it."""
    module = load_recipe(recipe)
    monkeypatch.setattr(module, "measure_speed", lambda *args, **kwargs: pytest.fail("timed before the check"))
    monkeypatch.setattr(module, "train", lambda **options: pytest.fail("trained before the check"))
    result = run_inprocess(recipe, *compare, "--batch-size", 64, "--samples", 32, "--run-dir", tmp_path / "cmp")
    assert result.code == 2
    message = "Invalid value for --batch-size: is larger than --samples (32): every step takes a full batch"
    assert message in result.stderr
    assert not (tmp_path / "cmp").exists()


def test_a_step_time_is_the_median_of_the_timed_steps_also_of_an_even_count(monkeypatch):
    """Of an even count of steps, the median is the mean of the middle two, not the upper one."""
    clock = iter([0, 1, 10, 12, 20, 24, 30, 31, 40, 46])  # a warm-up step of 1 s, then steps of 2, 4, 1 and 6 s
    mixed, compiled = load_recipe("mixed_precision"), load_recipe("compiled_model")
    monkeypatch.setattr(mixed, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(clock))}))
    monkeypatch.setattr(mixed, "amp_step", lambda *args, **kwargs: None)
    assert mixed.seconds_per_step(torch.device("cpu"), "bf16", 8, 1, 4, steps=2) == (3.0, "")
    assert compiled.timing([5.0, 1.0, 2.0, 4.0, 1.0, 6.0], warmup=2)["step_ms"] == 3000.0  # median of 2 4 1 6


def test_every_precision_is_timed_by_a_median_that_leaves_out_a_slowed_step(monkeypatch):
    """bf16 and fp16 take fewer steps (emulated, they are slow), but at least 3: a median of 2 is their mean, which
    a step the machine slowed moves by half of its delay."""
    mixed, timed = load_recipe("mixed_precision"), []
    monkeypatch.setattr(mixed, "seconds_per_step", lambda device, precision, width, depth, batch, steps, compile: (
        timed.append((precision, steps)) or (1.0, "")))
    seconds = mixed.measure_speed(torch.device("cpu"), 8, 1, 4, repeats=2, steps=5)
    assert timed == [("fp32", 5), ("bf16", 3), ("fp16", 3), ("fp16", 3), ("bf16", 3), ("fp32", 5)]  # alternating
    assert seconds == {"fp32": [1.0, 1.0], "bf16": [1.0, 1.0], "fp16": [1.0, 1.0]}


def test_eager_and_compiled_blocks_alternate_which_runs_first(monkeypatch):
    """Eager always ran first in a round: a load that builds within a round slowed the compiled block alone."""
    compiled, order = load_recipe("compiled_model"), []
    monkeypatch.setattr(compiled.torch, "compile", lambda model, **options: model)  # the order is under test
    real_step = compiled.train_step
    monkeypatch.setattr(compiled, "train_step", lambda model, *args, **kwargs: order.append(
        "compiled" if model is compiled_model[0] else "eager") or real_step(model, *args, **kwargs))
    compiled_model = []
    real_deepcopy = compiled.copy.deepcopy
    monkeypatch.setattr(compiled.copy, "deepcopy", lambda model: compiled_model.append(real_deepcopy(model)) or
                        compiled_model[0])
    speed = compiled.measure_speed(torch.device("cpu"), 8, 1, 4, repeats=3, block=2)
    assert order == ["eager", "compiled"] + ["eager"] * 2 + ["compiled"] * 4 + ["eager"] * 4 + ["compiled"] * 2
    assert {name: len(times) for name, times in speed["seconds"].items()} == {"eager": 3, "compiled": 3}


def test_a_compiled_run_too_short_for_a_steady_step_reports_no_step_time_or_compile_time():
    """Three steps or fewer are all warm-up: a median of them would count the compiling step as a step."""
    compiled = load_recipe("compiled_model")
    assert compiled.timing([5.0, 1.0, 2.0], warmup=3) == {"first_step_s": 5.0}
    assert compiled.timing([], warmup=3) == {}
    assert compiled.timing([5.0, 1.0, 2.0, 1.5], warmup=3) == {"step_ms": 1500.0, "first_step_s": 5.0,
                                                                "compile_s": 3.5}
    # an eager run compiles nothing: its slow first step is no compile time
    assert compiled.timing([5.0, 1.0, 2.0, 1.5], compiled=False) == {"step_ms": 1500.0, "first_step_s": 5.0}


def test_compare_times_the_precisions_interleaved_and_warns_of_a_busy_machine(run_inprocess, tmp_path, monkeypatch):
    # the timings are fixed here: what is tested is what --compare does with them, not this CPU's speed
    calls = []
    timings = {"fp32": iter([0.010, 0.011, 0.020]), "bf16": iter([0.005, 0.005, 0.006]), "fp16": iter([0.5] * 3)}

    def fake(device, precision, *args, **kwargs):
        calls.append(precision)
        return (next(timings[precision]), "") if args[-1] != 1 else (0.0, "")

    monkeypatch.setattr(load_recipe("mixed_precision"), "seconds_per_step", fake)
    result = run_inprocess("mixed_precision", "--compare", *MP_SMALL, "--epochs", 1, "--max-slowdown", 4,
                           "--run-dir", tmp_path / "cmp")
    assert result.code == 0, result.stderr
    assert calls[:9] == ["fp32", "bf16", "fp16", "fp16", "bf16", "fp32", "fp32", "bf16", "fp16"]  # A B C C B A A B C
    rows = json.loads((tmp_path / "cmp" / "metrics.json").read_text())["compare"]
    assert rows["bf16"]["speedup"] == pytest.approx([2.0, 2.2, 20 / 6])  # per round: fp32's seconds over its own
    assert rows["fp16"]["note"] == "45x slower than fp32 here: not trained"  # the median round: 0.5 s vs 0.011 s
    assert "warning: fp32 varied by over 25% between rounds: the machine is busy" in result.stdout


def compare_with(probes: dict, max_slowdown: float, run_inprocess, tmp_path, monkeypatch):
    """mixed_precision --compare given fixed (seconds per step, error) for each precision: its output, its rows."""
    monkeypatch.setattr(load_recipe("mixed_precision"), "seconds_per_step",
                        lambda device, precision, *sizes, **kwargs: probes[precision])
    result = run_inprocess("mixed_precision", "--compare", *MP_SMALL, "--epochs", 1, "--max-slowdown", max_slowdown,
                           "--run-dir", tmp_path / "cmp")
    assert result.code == 0, result.stderr
    return result, json.loads((tmp_path / "cmp" / "metrics.json").read_text())["compare"]


def test_a_slowdown_under_10x_keeps_its_tenth(run_inprocess, tmp_path, monkeypatch):
    """--max-slowdown 1.2 and bf16 1.3x slower: the note said "1x slower", as if it were not."""
    probes = {"fp32": (0.010, ""), "bf16": (0.013, ""), "fp16": (0.010, "")}
    _, rows = compare_with(probes, 1.2, run_inprocess, tmp_path, monkeypatch)
    assert rows["bf16"]["note"] == "1.3x slower than fp32 here: not trained"


def test_compare_says_when_a_precision_is_too_slow_or_unsupported(run_inprocess, tmp_path, monkeypatch):
    probes = {"fp32": (0.01, ""), "bf16": (0.5, ""), "fp16": (float("inf"), "no fp16 kernel for Linear")}
    result, rows = compare_with(probes, 4, run_inprocess, tmp_path, monkeypatch)
    assert rows["bf16"]["note"] == "50x slower than fp32 here: not trained"
    assert rows["fp16"]["note"] == "unsupported here: no fp16 kernel for Linear"
    # its infinite times are null: Infinity, Python's, is no JSON (jq and strict parsers refuse the file)
    assert rows["fp16"]["ms_per_step"] == [None] * 3
    assert "Infinity" not in (tmp_path / "cmp" / "metrics.json").read_text()
    for precision in ("bf16", "fp16"):
        assert rows[precision]["note"] in result.stdout
        assert not (tmp_path / "cmp" / precision).exists()
    assert (tmp_path / "cmp" / "fp32" / "checkpoints" / "last.pt").is_file()


def test_compiled_model_matches_eager_and_its_checkpoint_loads_into_a_plain_model(run_inprocess, tmp_path,
                                                                                  monkeypatch):
    recipe, cached = load_recipe("compiled_model"), {}
    train = recipe.train

    def spied_train(**options):  # what Dynamo already holds of the model's code when each run starts
        cached[options["compile"]] = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(recipe.GatedMLP.forward))
        return train(**options)

    monkeypatch.setattr(recipe, "train", spied_train)
    result = run_inprocess("compiled_model", "--compare", *CM_SMALL, "--epochs", 2, "--run-dir", tmp_path / "cmp")
    assert result.code == 0, result.stderr
    summary = json.loads((tmp_path / "cmp" / "metrics.json").read_text())
    # the compiled run compiles afresh (its first step is its compile), not from the timing's compiled graph
    assert cached == {False: 0, True: 0}
    # the printed and saved difference is the two training runs', not the timing models'
    assert summary["loss_diff"] == abs(summary["eager"]["train_loss"] - summary["compiled"]["train_loss"]) < 1e-4
    assert f"loss_diff={summary['loss_diff']:.2e}" in result.stdout and "timed_loss_diff" in summary
    assert summary["eager"]["steps"] == summary["compiled"]["steps"] == 8
    # speed: interleaved blocks (5 of 10 steps) in one process, compile time apart and only for the compiled side
    eager, compiled = summary["seconds"]["eager"], summary["seconds"]["compiled"]
    assert len(eager) == len(compiled) == summary["repeats"] == 5 and summary["block"] == 10
    assert summary["speedup"] == pytest.approx(statistics.median(e / c for e, c in zip(eager, compiled, strict=True)))
    assert summary["compile_s"] > 0
    # the first evaluation compiles again (no_grad): timed apart, since the first step's time leaves it out
    assert summary["eager"]["first_eval_s"] > 0 and summary["compiled"]["first_eval_s"] > 0
    assert re.search(r"first step [\d.]+ s, first evaluation [\d.]+ s, then [\d.]+ ms per step", result.stdout)
    table = parse_table(result.stdout)
    assert float(table["compiled"][2].split()[0]) == pytest.approx(summary["speedup"], abs=0.01)
    assert table["eager"][3] == "-" and table["compiled"][3].endswith(" s")
    assert float(table["eager"][1].replace(",", "")) == pytest.approx(128 / statistics.median(eager), rel=1e-3)
    assert "median (min-max) of 5 interleaved blocks of 10 steps" in result.stdout

    assert_a_second_compare_is_refused_without_a_hint_to_resume(run_inprocess, "compiled_model", tmp_path / "cmp")

    state = torch.load(tmp_path / "cmp" / "compiled" / "checkpoints" / "last.pt", weights_only=True)
    assert not any(key.startswith("_orig_mod.") for key in state["model"])
    plain = load_recipe("compiled_model").GatedMLP(16, 2)
    plain.load_state_dict(state["model"])  # strict: every key matches an uncompiled model
    x = torch.randn(4, 32)
    eager_state = torch.load(tmp_path / "cmp" / "eager" / "checkpoints" / "last.pt", weights_only=True)
    eager = load_recipe("compiled_model").GatedMLP(16, 2)
    eager.load_state_dict(eager_state["model"])
    torch.testing.assert_close(plain(x), eager(x), rtol=1e-4, atol=1e-5)


def test_traps_count_recompilations_and_graph_breaks(run_inprocess):
    result = run_inprocess("compiled_model", "--traps", "--backend", "eager")
    assert result.code == 0, result.stderr
    table = parse_table(result.stdout)
    graphs = {dynamic: int(table[dynamic][0]) for dynamic in ("False", "None", "True")}
    assert graphs == {"False": 5, "None": 3, "True": 2}  # five batch sizes: 5; 1 + 1 recompile + size 1; 1 + size 1
    # over 10 steps: the traced probe's growing list recompiled every step (one forward traced in 2 graphs and 1
    # break showed none of it), until Dynamo gave up after 8 recompiles; fenced: 2 graphs compiled once, 1 break
    assert (int(table["traced"][0]), int(table["traced"][1])) == (10, 9)
    assert (int(table["fenced"][0]), int(table["fenced"][1])) == (2, 1)
    assert "CUDA" not in result.stderr  # the C++ toolchain's warning of a CUDA it will not use


def test_traps_and_compare_together_are_a_usage_error(run_inprocess):
    result = run_inprocess("compiled_model", "--traps", "--compare")
    assert result.code == 2 and "Invalid value for --traps: --traps and --compare are two commands" in result.stderr


def test_a_backend_that_cannot_compile_here_is_one_line(run_inprocess, tmp_path):
    """tvm is registered, but its package is not installed: a traceback at the first step, under --traps too."""
    tiny = ["--width", 8, "--depth", 1, "--batch-size", 8, "--samples", 64]
    for args in (["--compile", "--max-steps", 1, *tiny, "--run-dir", tmp_path / "run"], ["--traps"]):
        result = run_inprocess("compiled_model", *args, "--backend", "tvm")
        assert result.code == 1 and result.stderr.startswith("error: torch.compile cannot compile the model here: "
                                                             "ImportError: Please install apache-tvm"), result.stderr
        assert result.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()  # a fresh run that saved nothing leaves no folder


def test_unknown_backend_is_a_usage_error(run_inprocess):
    result = run_inprocess("compiled_model", "--backend", "turbo")
    assert result.code == 2
    assert re.search(r"'turbo' is not one of .*inductor", result.stderr) and "TESTING_ONLY" not in result.stderr
    # Dynamo's debugging backends (a minifier's, say) are registered too, but fail with a TypeError on a model
    for debug in ("dynamo_minifier_backend", "aot_eager_decomp_partition_with_mode", "eager_debug"):
        result = run_inprocess("compiled_model", "--compile", "--backend", debug)
        listed = re.search(r"is not one of (.*)", " ".join(result.stderr.split()))[1]
        assert result.code == 2 and {"inductor", "eager", "aot_eager", "cudagraphs"} <= set(listed.split(", "))
        assert "minifier" not in listed and "debug" not in listed and "TESTING" not in listed
    # --mode is Inductor's own: another backend would ignore it (with only a Dynamo warning)
    result = run_inprocess("compiled_model", "--compile", "--backend", "aot_eager", "--mode", "max-autotune")
    assert result.code == 2
    assert "Invalid value for --mode: max-autotune is Inductor's: it needs --backend inductor" in result.stderr


def test_a_resume_may_change_where_and_how_fast_it_runs_and_ends_with_the_same_weights(run_inprocess, tmp_path):
    """--num-workers, --checkpoint-every and --log-every only say how the run goes: a resume may
    change them (they are in MAY_CHANGE) and still ends with the weights of the run that never stopped."""
    common = [*MP_SMALL, "--epochs", 2]
    assert run_inprocess("mixed_precision", *common, "--run-dir", tmp_path / "full").code == 0
    assert run_inprocess("mixed_precision", *common, "--max-steps", 3, "--run-dir", tmp_path / "cut").code == 0
    resumed = run_inprocess("mixed_precision", *common, "--num-workers", 2, "--checkpoint-every", 2, "--log-every",
                            1, "--resume", "auto", "--run-dir", tmp_path / "cut")
    assert resumed.code == 0, resumed.stderr
    assert "resumed at step 3" in resumed.stdout
    assert_same_weights(load_weights(tmp_path / "full" / "checkpoints" / "last.pt"),
                        load_weights(tmp_path / "cut" / "checkpoints" / "last.pt"))


def test_a_compiled_run_on_a_cpu_prints_no_cuda_warning(tmp_path):
    """torch.compile's C++ toolchain looks for CUDA and warns when it finds none: noise on a CPU-only machine."""
    from conftest import run_subprocess

    result = run_subprocess(["recipes/compiled_model.py", "--epochs", 1, "--max-steps", 2, "--samples", 256,
                             "--batch-size", 128, "--width", 8, "--depth", 1, "--compile", "--device", "cpu",
                             "--run-dir", tmp_path])
    assert result.code == 0, result.stderr
    assert "CUDA" not in result.stdout + result.stderr


def test_compiled_compare_warns_when_the_blocks_disagree(run_inprocess, tmp_path, monkeypatch):
    """The timings are fixed here: what is tested is what --compare does with them, not this CPU's speed."""
    recipe = load_recipe("compiled_model")
    fixed = {"seconds": {"eager": [0.010, 0.010, 0.011, 0.010, 0.010], "compiled": [0.005, 0.009, 0.005, 0.005, 0.005]},
             "compile_s": 2.0, "timed_loss_diff": 0.0}
    monkeypatch.setattr(recipe, "measure_speed", lambda *args, **kwargs: fixed)
    result = run_inprocess("compiled_model", "--compare", *CM_SMALL, "--epochs", 1, "--run-dir", tmp_path / "cmp")
    assert result.code == 0, result.stderr
    table = parse_table(result.stdout)
    assert table["compiled"][2] == "2.00 (1.11-2.20)x"  # median (min-max) of the blocks' eager / compiled
    assert table["compiled"][3] == "2.0 s"
    assert "warning: compiled varied by over 25% between blocks: the machine is busy" in result.stdout
    assert "eager varied" not in result.stdout  # 10 to 11 ms: within 25%


@pytest.mark.parametrize(("args", "message"), [
    (["--mode", "max-autotune"], "Invalid value for --mode: sets how torch.compile compiles: add --compile (or "
                                 "--compare)"),
    (["--fullgraph"], "Invalid value for --fullgraph: sets how torch.compile compiles"),
    (["--no-dynamic"], "Invalid value for --dynamic: sets how torch.compile compiles"),
    (["--mode=max-autotune"], "Invalid value for --mode: sets how torch.compile compiles"),
    (["--backend", "eager"], "Invalid value for --backend: sets how torch.compile compiles"),
    (["--compile", "--mode", "reduce-overhead", "--device", "cpu"], "Invalid value for --mode: captures CUDA graphs, "
                                                                    "which a cpu has not: use default or max-autotune"),
    (["--compile", "--backend", "cudagraphs", "--device", "cpu"], "Invalid value for --backend: captures CUDA "
                                                                  "graphs, which a cpu has not: use inductor"),
    (["--compare", "--no-compile"], "Invalid value for --compile: --compare trains both eager and compiled: leave it"),
    (["--compare", "--compile"], "Invalid value for --compile: --compare trains both eager and compiled: leave it"),
    (["--traps", "--device", "cpu"], "Invalid value for --traps: counts compilations on the CPU, with --backend and "
                                     "--seed only: not --device"),
    (["--traps", "--resume", "x.pt", "--epochs", 2], "with --backend and --seed only: not --epochs, --resume")])
def test_compile_options_that_would_be_ignored_are_usage_errors(run_inprocess, tmp_path, args, message):
    """Without --compile the compile options do nothing; --traps uses none but two; reduce-overhead's CUDA graphs
    make a CPU step ~100x slower: each was accepted and silently ignored (or slow), now refused."""
    traps = "--traps" in args  # which runs nothing, so needs no sizes or folder
    result = run_inprocess("compiled_model", *args, *([] if traps else [*CM_SMALL, "--run-dir", tmp_path / "run"]))
    assert result.code == 2 and message in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--compare", "--precision", "fp16"], "Invalid value for --precision: --compare trains in each of fp32, bf16 "
                                           "and fp16: leave it out"),
    (["--max-slowdown", 2], "Invalid value for --max-slowdown: skips slow precisions in --compare: add --compare")])
def test_precision_options_that_would_be_ignored_are_usage_errors(run_inprocess, tmp_path, args, message):
    """--compare trained all three whatever --precision said; --max-slowdown alone was a plain fp32 run."""
    result = run_inprocess("mixed_precision", *args, *MP_SMALL, "--max-steps", 1, "--run-dir", tmp_path / "run")
    assert result.code == 2 and message in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "run").exists()


def test_a_resume_of_a_compares_run_may_keep_its_max_slowdown(run_inprocess, tmp_path):
    """Each precision's run of a --compare records --max-slowdown; going on from one may give it as it was."""
    first = run_inprocess("mixed_precision", *MP_SMALL, "--epochs", 2, "--max-steps", 2, "--run-dir", tmp_path / "r")
    assert first.code == 0, first.stderr
    result = run_inprocess("mixed_precision", *MP_SMALL, "--epochs", 2, "--max-slowdown", 2, "--resume", "auto",
                           "--run-dir", tmp_path / "r")
    assert result.code == 0 and read_metrics(tmp_path / "r")["steps"] == 8, result.stderr


def test_an_eager_run_resumes_compiled_and_reports_no_compile_time(run_inprocess, tmp_path):
    """How a run compiles is how fast it runs, not what it trains: a resume may change it, to the same weights."""
    common = [*CM_SMALL, "--epochs", 2]
    assert run_inprocess("compiled_model", *common, "--run-dir", tmp_path / "full").code == 0
    assert "compile_s" not in read_metrics(tmp_path / "full")  # nothing was compiled
    assert run_inprocess("compiled_model", *common, "--max-steps", 3, "--run-dir", tmp_path / "cut").code == 0
    resumed = run_inprocess("compiled_model", *common, "--compile", "--backend", "eager", "--dynamic", "--resume",
                            "auto", "--run-dir", tmp_path / "cut")
    assert resumed.code == 0 and "resumed at step 3" in resumed.stdout, resumed.stderr
    assert_same_weights(load_weights(tmp_path / "full" / "checkpoints" / "last.pt"),
                        load_weights(tmp_path / "cut" / "checkpoints" / "last.pt"))


def test_compare_times_both_models_in_the_precision_asked_for(run_inprocess, tmp_path, monkeypatch):
    """--compare --precision bf16 timed its speed table in fp32 (only its training runs were bf16)."""
    recipe, precisions = load_recipe("compiled_model"), []
    step = recipe.train_step
    monkeypatch.setattr(recipe, "train_step", lambda *args, **kwargs: precisions.append(kwargs.get("precision")) or
                        step(*args, **kwargs))
    result = run_inprocess("compiled_model", "--compare", *CM_SMALL, "--epochs", 1, "--backend", "eager",
                           "--precision", "bf16", "--run-dir", tmp_path / "cmp")
    assert result.code == 0, result.stderr
    assert len(precisions) > 100 and set(precisions) == {"bf16"}  # 2 x (1 + 5 x 10) timed steps, 2 x 4 trained
    assert read_metrics(tmp_path / "cmp")["precision"] == "bf16" and "speed in bf16: median" in result.stdout


@pytest.mark.parametrize(("recipe", "args"), [("mixed_precision", MP_SMALL), ("compiled_model", CM_SMALL),
                                              ("mixed_precision", [*MP_SMALL, "--compare"])])
def test_compile_without_a_cpp_compiler_is_one_line(recipe, args, tmp_path):
    """Inductor writes C++ on a CPU: where no compiler is installed, --compile ended in a traceback; --compare's
    table called every precision, fp32 too, "unsupported here ... (out of memory?)", and exited 0."""
    result = run_subprocess([ROOT / "recipes" / f"{recipe}.py", "--compile", *args, "--max-steps", 1, "--run-dir",
                             tmp_path / "run"], env={"CXX": "/no/such/g++", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert result.code == 1 and result.stderr == "error: torch.compile cannot compile the model here: " \
        "InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx: (None, '/no/such/g++')\n"
    assert not (tmp_path / "run").exists()  # a fresh run that saved nothing leaves no folder


def test_a_compiler_that_is_not_executable_is_one_line(tmp_path):
    """A PermissionError (CXX names a file without execute permission) is an OSError, which the recipes said in one
    line only by its exact class name: it was a traceback."""
    compiler = tmp_path / "g++"
    compiler.write_text("not a program")
    compiler.chmod(0o644)
    result = run_subprocess([ROOT / "recipes" / "mixed_precision.py", "--compile", *MP_SMALL, "--max-steps", 1,
                             "--run-dir", tmp_path / "run"], env={"CXX": str(compiler),
                                                                  "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert result.code == 1 and result.stderr == "error: torch.compile cannot compile the model here: " \
        f"PermissionError: [Errno 13] Permission denied: '{compiler}'\n", result.stderr
    assert not (tmp_path / "run").exists()


def test_compare_times_the_models_compiled_where_it_trains_them_compiled(run_inprocess, tmp_path, monkeypatch):
    """mixed_precision --compare --compile trained compiled models but timed eager ones."""
    mixed, steps = load_recipe("mixed_precision"), []
    monkeypatch.setattr(mixed, "amp_step", lambda model, *args: steps.append(type(model).__name__))
    for compile in (True, False):
        mixed.seconds_per_step(torch.device("cpu"), "fp32", 8, 1, 4, steps=1, compile=compile)
    assert steps == ["OptimizedModule"] * 2 + ["MLP"] * 2
    timed, trained = [], []
    monkeypatch.setattr(mixed, "seconds_per_step", lambda *args, compile, **kwargs: timed.append(compile) or (1.0, ""))
    monkeypatch.setattr(mixed, "train", lambda **options: trained.append(options["compile"]) or
                        {"train_loss": 1.0, "val_loss": 1.0, "val_acc": 0.5, "losses": [1.0]})
    result = run_inprocess("mixed_precision", "--compare", "--compile", *MP_SMALL, "--run-dir", tmp_path / "cmp")
    assert result.code == 0, result.stderr
    assert timed == [True] * 9 and trained == [True] * 3 and "fresh compiled models" in result.stdout

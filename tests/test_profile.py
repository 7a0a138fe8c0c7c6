"""--profile N: a trace in the run directory, a table of where a step's time goes, and training left as it is."""

import json
import re
from types import SimpleNamespace

import pytest
from conftest import RECIPES, assert_same_weights, load_weights, run_subprocess, smoke_args

from common.profile import phases

ARGS = ["--epochs", 1, "--samples", 1024, "--batch-size", 64, "--width", 32, "--depth", 2, "--num-workers", 0]


def test_profiled_steps_give_a_trace_and_a_table_and_train_as_always(run_inprocess, tmp_path):
    plain = run_inprocess("mixed_precision", *ARGS, "--run-dir", tmp_path / "plain")
    profiled = run_inprocess("mixed_precision", *ARGS, "--profile", 4, "--run-dir", tmp_path / "profiled")
    assert plain.code == 0 and profiled.code == 0, profiled.stderr
    assert "USDT" not in profiled.stderr and "gpuGetDeviceCount" not in profiled.stderr  # libkineto kept quiet

    lines = profiled.stdout.splitlines()
    start = lines.index(f"profile of 4 steps (trace in {tmp_path / 'profiled'}): milliseconds per step, median")
    assert lines[start + 1].split() == ["data", "forward", "backward", "optimizer", "rest", "total"]
    data, forward, backward, optimizer, rest, total = map(float, lines[start + 2].split())
    assert min(data, forward, backward, optimizer) > 0 and rest >= 0  # each phase found in the events
    assert abs(total - (data + forward + backward + optimizer + rest)) < 0.03  # (each rounded to 0.01)
    assert lines[start + 3] == "top operators by self time:"
    operators = [re.match(r"\s+(\S+)", line)[1] for line in lines[start + 4 : start + 12]]
    assert {"aten::mm", "aten::addmm"} & set(operators)  # an MLP's time is in its matrix products

    traces = list((tmp_path / "profiled").glob("*.pt.trace.json"))
    assert len(traces) == 1  # where TensorBoard's profiler plugin looks; Perfetto opens it too
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in events) == 4

    assert_same_weights(load_weights(tmp_path / "plain" / "checkpoints" / "last.pt"),
                        load_weights(tmp_path / "profiled" / "checkpoints" / "last.pt"))


@pytest.mark.parametrize("max_steps", [2, 5])  # in the warm-up; after it, with 2 of the 4 steps profiled
def test_a_run_too_short_to_profile_says_so(run_inprocess, tmp_path, max_steps):
    """A profile cut short by the run's end held, in its open step, the evaluation and the end of the run, printed
    as a training step: none is kept."""
    result = run_inprocess("mixed_precision", *ARGS, "--max-steps", max_steps, "--profile", 4, "--run-dir", tmp_path)
    assert result.code == 0, result.stderr
    assert "profile: the run ended before 4 steps could be profiled after the warm-up" in result.stderr
    assert result.stdout.splitlines()[-1].startswith("done: ")  # still the last line of stdout
    assert "profile of" not in result.stdout and not (tmp_path / "profile.json").exists()
    assert not list(tmp_path.glob("*.pt.trace.json"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_profiles_its_steps(recipe, run_inprocess, request, tmp_path):
    more = [] if recipe in ("tabular_mlp", "tiny_transformer") else ["--max-steps", 6]  # 3 warm-up steps, then 2
    more += ["--samples", 1024] if recipe in ("mixed_precision", "compiled_model") else []  # 4 steps were too few
    more += ["--steps", 6] if recipe == "tiny_transformer" else []
    result = run_inprocess(recipe, *smoke_args(recipe, request), *more, "--profile", 2, "--run-dir", tmp_path)
    assert result.code == 0, result.stderr
    profile = json.loads((tmp_path / "profile.json").read_text())  # what scripts/doctor.py reads
    assert profile["steps"] == 2 and set(profile["ms_per_step"]) == {"data", "forward", "backward", "optimizer", "rest"}
    assert profile["ms_per_step"]["forward"] > 0 and profile["operators"]
    assert len(list(tmp_path.glob("*.pt.trace.json"))) == 1


def test_a_trace_the_disk_has_no_room_for_is_said_and_leaves_no_partial_file(tmp_path):
    """The profiler's C++ writer fails silently and leaves its .tmp file (it said "trace in" all the same); a file-size
    limit stands for the full disk. The run itself goes on: a trace is no reason to lose it."""
    run_dir = tmp_path / "run"
    result = run_subprocess(["recipes/mixed_precision.py", "--samples", 4096, "--width", 1, "--depth", 1, "--epochs", 1,
                             "--batch-size", 128, "--device", "cpu", "--profile", 2, "--run-dir", run_dir],
                            max_file_bytes=64 * 1024)  # the checkpoints of this model are half that
    assert result.code == 0, result.stderr
    assert f"profile of 2 steps (the trace could not be written in {run_dir}): milliseconds" in result.stdout
    assert not list(run_dir.glob("*.pt.trace.json*")) and (run_dir / "profile.json").is_file()


def test_on_a_gpu_operators_are_ranked_by_their_kernels_time(tmp_path, capsys):
    """On CUDA an operator's CPU time is its launch (or a wait on a full queue): the table ranked launches."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from common.profile import StepProfiler

    def event(name, cpu_us, gpu_us, *children):
        return SimpleNamespace(name=name, key=name, self_cpu_time_total=cpu_us, self_device_time_total=gpu_us,
                               cpu_children=list(children), time_range=SimpleNamespace(start=0, end=1000))

    # an evaluation that fell in the step: its operators are none of the training's (they topped the table)
    evaluation = event("evaluate", 1.0, 0.0, event("aten::gelu", 9000.0, 9000.0))
    step = SimpleNamespace(name="ProfilerStep#3", cpu_parent=None, time_range=SimpleNamespace(start=0, end=4000),
                           cpu_children=[event("aten::launch_heavy", 3000.0, 10.0),
                                         event("aten::linear", 5.0, 0.0, event("aten::mm", 20.0, 2000.0)), evaluation])
    trace = SimpleNamespace(events=lambda: [step],
                            export_chrome_trace=lambda path, **kwargs: Path(path).write_text("{}"))
    profiler = StepProfiler(tmp_path, None, torch.device("cpu"))
    profiler.profiler, profiler.on_gpu = trace, True  # as if profiling a CUDA run (none here)
    profiler.report(trace)
    out = capsys.readouterr().out
    assert "top operators by self GPU time:" in out and out.index("aten::mm") < out.index("aten::launch_heavy")
    assert "(the CPU's time: the GPU runs behind it)" in out
    assert json.loads((tmp_path / "profile.json").read_text())["operators"] == {"aten::mm": 2.0,
                                                                                "aten::launch_heavy": 0.01,
                                                                                "aten::linear": 0.0}


def step_of(*events: tuple[str, float, float], end: float):
    """A ProfilerStep event as phases() reads it: its direct children, each (name, start ms, end ms)."""
    span = lambda start, stop: SimpleNamespace(start=start * 1000, end=stop * 1000)  # noqa: E731 (microseconds)
    return SimpleNamespace(time_range=span(0, end),
                           cpu_children=[SimpleNamespace(name=n, time_range=span(a, b)) for n, a, b in events])


def test_a_step_of_several_micro_batches_counts_their_forward_passes_as_forward():
    """The operators between two backward passes (the next micro-batch's forward) were counted as backward:
    --grad-accum 4 doubled the backward and shrank the forward."""
    step = step_of(("enumerate(DataLoader)#next", 0, 1), ("aten::mm", 1, 3), ("autograd::engine::run", 3, 6),
                   ("aten::mm", 6, 8), ("autograd::engine::run", 8, 11), ("aten::norm", 11, 12),  # clipping
                   ("Optimizer.step#AdamW.step", 12, 14), ("aten::add", 14, 14.5), end=15)
    assert phases(step) == {"data": 1, "forward": 4.5, "backward": 7, "optimizer": 2, "rest": 0.5}
    zero_grad_first = step_of(("Optimizer.zero_grad#AdamW.zero_grad", 0, 1), ("aten::mm", 1, 2),
                              ("autograd::engine::run", 2, 4), ("aten::norm", 4, 5),
                              ("Optimizer.step#AdamW.step", 5, 6), end=6)
    assert phases(zero_grad_first) == {"data": 0, "forward": 1, "backward": 3, "optimizer": 2, "rest": 0}


def test_an_evaluation_or_a_save_in_a_profiled_step_is_left_out_of_it():
    """An epoch's evaluation and checkpoint fall in the next profiled step: its batches were counted as data, its
    matrix products as forward, the save as rest, in a table of training steps."""
    step = step_of(("evaluate", 0, 10), ("checkpoint", 10, 12), ("enumerate(DataLoader)#next", 12, 13),
                   ("aten::mm", 13, 14), ("autograd::engine::run", 14, 16), ("Optimizer.step#SGD.step", 16, 17), end=18)
    assert phases(step) == {"data": 1, "forward": 1, "backward": 2, "optimizer": 1, "rest": 1}


def test_what_follows_an_evaluation_is_marked_as_such_for_a_profiled_step():
    """tiny_transformer's text sample and mnist_onecycle's grid of misclassified digits follow an evaluation,
    which falls in the next profiled step: a 600-token sample made its forward 6 s a step, its gelu the top
    operator. Marked "evaluate", they are left out as the evaluation is."""
    import torch
    from conftest import load_recipe

    tt, mnist = load_recipe("tiny_transformer"), load_recipe("mnist_onecycle")
    gpt = tt.GPT(tt.GPTConfig(vocab_size=50, block_size=8, n_layer=1, n_head=2, n_embd=16))
    cnn, digits = mnist.DigitNet(8), torch.utils.data.TensorDataset(torch.randn(8, 1, 28, 28), torch.zeros(8).long())
    with torch.profiler.profile() as trace:
        tt.sample_text(gpt, "".join(chr(65 + i) for i in range(50)), "AB", 3, 1.0, None, 0, torch.device("cpu"))
        mnist.misclassified_grid(cnn, digits, torch.device("cpu"))
    outermost = [e.name for e in trace.events() if e.cpu_parent is None]
    assert outermost == ["evaluate", "evaluate"]


def test_a_sharded_save_is_marked_as_a_checkpoint_for_a_profiled_step():
    """FSDP's checkpoints (DCP folders) fell in a profiled step unmarked, counted as its time."""
    import torch

    from common.sharded import ShardedCheckpointer

    with torch.profiler.profile() as trace:
        ShardedCheckpointer.save(SimpleNamespace(last_step=5), 5)  # this step is saved already: nothing written
    assert [e.name for e in trace.events() if e.cpu_parent is None] == ["checkpoint"]


def test_on_cuda_the_backward_pass_on_autograds_own_thread_counts_as_backward(tmp_path):
    """CUDA's autograd runs backward functions on a thread of its own: they are no step's children, and the step
    read as forward, a gap ("rest") and an optimizer; its operators' table had no backward operator."""
    from pathlib import Path

    import torch
    from torch.autograd import DeviceType

    from common.profile import StepProfiler, training_events

    span = lambda start, stop: SimpleNamespace(start=start * 1000, end=stop * 1000)  # noqa: E731 (microseconds)

    def event(name, start, stop, thread=1, children=(), device="CPU"):
        return SimpleNamespace(name=name, key=name, time_range=span(start, stop), thread=thread, is_async=False,
                               cpu_children=list(children), cpu_parent=None, device_type=getattr(DeviceType, device),
                               self_cpu_time_total=(stop - start) * 1000, self_device_time_total=0.0)

    step = SimpleNamespace(thread=1, time_range=span(0, 12), cpu_children=[
        event("enumerate(DataLoader)#next", 0, 1), event("aten::mm", 1, 3), event("aten::norm", 8, 9),  # clipping
        event("Optimizer.step#AdamW.step", 9, 10), event("evaluate", 10, 12)])
    roots = [event("autograd::engine::evaluate_function: MmBackward0", 3, 5, thread=2,
                   children=[event("aten::mm", 3, 5, thread=2)]),
             event("autograd::engine::evaluate_function: AddBackward0", 5, 8, thread=2),
             event("autograd::engine::evaluate_function: MmBackward0", 10.5, 11, thread=2),  # the evaluation's
             event("aten::copy_", 20, 21, thread=2)]  # after the step
    assert phases(step, roots) == {"data": 1, "forward": 2, "backward": 6, "optimizer": 1, "rest": 0}
    # as report() finds them among the trace's events: a kernel (outermost, on the GPU) is no CPU thread's
    kernel = event("ampere_sgemm", 3, 5, thread=0, device="CUDA")
    step.name, step.cpu_parent, step.is_async = "ProfilerStep#4", None, False
    trace = SimpleNamespace(events=lambda: [step, *roots, kernel],
                            export_chrome_trace=lambda path, **kwargs: Path(path).write_text("{}"))
    profiler = StepProfiler(tmp_path, None, torch.device("cpu"))
    profiler.profiler = trace
    profiler.report(trace)
    assert profiler.table == {"data": [1], "forward": [2], "backward": [6], "optimizer": [1], "rest": [0]}
    operators = json.loads((tmp_path / "profile.json").read_text())["operators"]
    assert "ampere_sgemm" not in operators and operators["autograd::engine::evaluate_function: AddBackward0"] == 3
    names = sorted(e.name for e in training_events(step, roots))
    assert names == sorted(["enumerate(DataLoader)#next", "aten::mm", "aten::norm", "Optimizer.step#AdamW.step",
                            "autograd::engine::evaluate_function: MmBackward0", "aten::mm",
                            "autograd::engine::evaluate_function: AddBackward0"])

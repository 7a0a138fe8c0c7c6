"""Every recipe follows docs/conventions.md: the same common options, the same run-directory contents."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import RECIPES, ROOT, load_recipe, read_metrics, read_scalars, smoke_args

from common import runlog
from common.runtime import native_bf16

COMMON = ["--max-steps", "--batch-size", "--lr", "--seed", "--device", "--precision", "--compile", "--num-workers",
          "--run-dir", "--resume", "--config", "--checkpoint-every", "--log-every", "--profile"]
READS_A_DATA_SET = {"mnist_onecycle", "ddp_mlp", "tabular_mlp"}  # the others make their data or take a file


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_lists_every_common_option(recipe, run_inprocess):
    result = run_inprocess(recipe, "--help")
    assert result.code == 0
    assert "--epochs" in result.stdout or "--steps" in result.stdout
    for option in COMMON:
        assert f"{option} " in result.stdout or f"{option}," in result.stdout, option
    assert ("--data-dir " in result.stdout) == (recipe in READS_A_DATA_SET)  # no option that does nothing


@pytest.mark.parametrize("recipe", RECIPES)
def test_config_and_metrics_hold_what_the_conventions_promise(recipe, run_inprocess, request, tmp_path):
    result = run_inprocess(recipe, *smoke_args(recipe, request), "--run-dir", tmp_path)
    assert result.code == 0, result.stderr
    config = json.loads((tmp_path / "config.json").read_text())
    assert {"seed", "device", "precision", "run_dir", "torch_version", "device_used", "world_size"} <= config.keys()
    assert config["device_used"] == "cpu" and config["world_size"] == 1 and config["run_dir"] == str(tmp_path)
    metrics = read_metrics(tmp_path)
    assert {"recipe", "steps", "train_loss", "val_loss", "wall_s"} <= metrics.keys()
    assert "samples_per_s" in metrics or "tokens_per_s" in metrics
    # the best score is named for what it is: an accuracy (higher is better), or a loss (lower is better)
    best = "best_val_acc" if recipe in ("mnist_onecycle", "ddp_mlp", "tabular_mlp") else "best_val_loss"
    assert best in metrics and not {"best_score", "best_val_acc", "best_val_loss"} - {best} & metrics.keys()
    assert metrics[best] == (max if best == "best_val_acc" else min)(metrics[best], metrics[best[5:]])
    assert result.stdout.strip().splitlines()[-1].startswith("done: ")
    assert (tmp_path / "checkpoints" / "last.pt").is_file()
    assert (tmp_path / "checkpoints" / "best.pt").is_file()  # every recipe has a validation metric


def test_the_conventions_list_exactly_the_common_options():
    text = (ROOT / "docs" / "conventions.md").read_text()
    table = text.split("## Options every recipe has", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(--[a-z-]+)", table))
    assert listed == set(COMMON) | {"--epochs", "--steps", "--data-dir", "--csv", "--target", "--text", "--max-lr"}


def test_no_file_names_a_document_that_is_not_in_the_project():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    cited = set()
    for name in files:
        if name.endswith((".py", ".md", ".sh", ".toml", ".txt")) and (ROOT / name).is_file():
            cited |= {(name, m) for m in re.findall(r"\b([\w./-]+\.md)\b", (ROOT / name).read_text())}
    documents = {f.rsplit("/", 1)[-1] for f in files if f.endswith(".md")}
    written = {"table.md"}  # what benchmarks/gpu_check.sh writes, not a document of the project
    missing = [(name, doc) for name, doc in cited if doc.rsplit("/", 1)[-1] not in documents | written]
    assert not missing  # e.g. a contract that only exists outside the repository


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_mentions_only_options_the_recipe_has(recipe, run_inprocess):
    """e.g. no "--epochs" in a step-based recipe's help, and metavars that read as words, not Python types."""
    from conftest import recipe_options

    options = recipe_options(recipe)
    text = run_inprocess(recipe, "--help").stdout
    mentioned = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))
    assert mentioned - options - {"--help"} == set(), text
    assert "<list[" not in text and "Path]" not in text


# measured, or where the run was: they differ between any two runs
NOT_REPLAYED = {"wall_s", "samples_per_s", "tokens_per_s", "mfu", "step_ms", "first_step_s", "first_eval_s",
                "compile_s", "memory"}


@pytest.mark.parametrize("recipe", ["mnist_onecycle", "tabular_mlp", "tiny_transformer"])
def test_a_run_replayed_from_its_config_trains_to_the_same_numbers(recipe, run_inprocess, request, tmp_path):
    first = run_inprocess(recipe, *smoke_args(recipe, request), "--seed", 3, "--run-dir", tmp_path / "first")
    assert first.code == 0, first.stderr
    replay = run_inprocess(recipe, "--config", tmp_path / "first" / "config.json", "--run-dir", tmp_path / "replay")
    assert replay.code == 0, replay.stderr
    a, b = ({k: v for k, v in read_metrics(tmp_path / d).items() if k not in NOT_REPLAYED} for d in ("first", "replay"))
    assert a == b and a["steps"] > 0
    config = json.loads((tmp_path / "replay" / "config.json").read_text())
    assert config["seed"] == 3 and config["run_dir"] == str(tmp_path / "replay")  # its own run directory
    # options given on the command line win over the file's
    more = run_inprocess(recipe, "--config", tmp_path / "first" / "config.json", "--seed", 4, "--max-steps", 1,
                         "--run-dir", tmp_path / "other")
    assert more.code == 0 and json.loads((tmp_path / "other" / "config.json").read_text())["seed"] == 4


def test_a_run_of_another_version_of_the_recipe_is_refused_as_such_and_left_as_it_was(run_inprocess, request,
                                                                                     tmp_path):
    """A checkpoint of an older version (or of a copy before an option was added or removed) was refused as started
    with "--width None there, 64 here": no value of --width could match it."""
    args = [*smoke_args("mixed_precision", request), "--run-dir", tmp_path / "run"]
    assert run_inprocess("mixed_precision", *args).code == 0
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    state = torch.load(last, weights_only=True)
    width = state["config"].pop("width")
    torch.save(state | {"config": state["config"] | {"memory": True}}, last)  # an option since removed
    before = last.read_bytes()
    result = run_inprocess("mixed_precision", *args, "--max-steps", 4, "--resume", "auto")
    assert (result.code, result.stderr) == (1, f"error: checkpoint {last} was started by another version of this "
                                            f"recipe (it records no --width ({width} here); it has memory True, which "
                                            "this version lacks): use that version, or start afresh in another "
                                            "--run-dir\n")
    assert last.read_bytes() == before


def test_a_config_of_another_recipe_or_no_config_is_a_usage_error(run_inprocess, request, tmp_path):
    first = run_inprocess("mixed_precision", *smoke_args("mixed_precision", request), "--run-dir", tmp_path / "a")
    assert first.code == 0
    other = run_inprocess("tabular_mlp", "--config", tmp_path / "a" / "config.json")
    assert other.code == 2 and "'--config'" in other.stderr and "another recipe's, or this one's before an edit or " \
        "update? (remove them from it to replay the rest)" in other.stderr
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")  # JSON, but not an object of settings
    not_settings = "is not a run's config.json (a JSON object of settings)"
    for name, text in [("bad.json", not_settings), ("list.json", not_settings), ("none.json", "cannot read")]:
        result = run_inprocess("mixed_precision", "--config", tmp_path / name)
        assert result.code == 2 and "'--config'" in result.stderr and text in result.stderr


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_takes_auto_precision_and_says_what_it_chose(recipe, run_inprocess, request, tmp_path):
    result = run_inprocess(recipe, *smoke_args(recipe, request), "--precision", "auto", "--run-dir", tmp_path)
    assert result.code == 0, result.stderr
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["precision"] == "auto"  # as given: a --config replay chooses again
    assert config["precision_used"] == ("bf16" if native_bf16(torch.device(config["device_used"])) else "fp32")
    assert config["precision_reason"].startswith("auto: ")
    assert f"precision {config['precision_used']} ({config['precision_reason']})" in result.stdout


@pytest.mark.parametrize("recipe", RECIPES)
def test_more_workers_than_4_per_core_is_a_usage_error(recipe, run_inprocess, tmp_path):
    """--num-workers 100000 forked processes until the machine ran out of them."""
    if "--num-workers" not in run_inprocess(recipe, "--help").stdout:
        pytest.skip(f"{recipe} has no --num-workers")
    limit = 4 * os.cpu_count()
    result = run_inprocess(recipe, "--num-workers", limit + 1, "--run-dir", tmp_path / "run")
    assert result.code == 2, result.stderr
    assert f"Invalid value for '--num-workers': Input should be less than or equal to {limit}" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("recipe", "option"), [("mixed_precision", "--depth"), ("compiled_model", "--depth"),
                                                ("tabular_mlp", "--depth"), ("tiny_transformer", "--n-layer")])
def test_a_model_deeper_than_1000_layers_is_a_usage_error(recipe, option, run_inprocess, tmp_path):
    """--depth 10**30 built layers one by one until the kernel killed the process for its memory (no line at all)."""
    result = run_inprocess(recipe, option, 1001, "--run-dir", tmp_path / "run")
    assert result.code == 2, result.stderr
    assert f"Invalid value for '{option}': Input should be less than or equal to 1000" in result.stderr
    assert not (tmp_path / "run").exists()


PATH_OPTIONS = {"mnist_onecycle": ["--finetune"], "tabular_mlp": ["--csv", "--predict", "--output"],
                "tiny_transformer": ["--text", "--init-from"]}


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_empty_path_option_is_a_usage_error_not_the_current_folder(recipe, run_inprocess, tmp_path, monkeypatch):
    """`--run-dir "$RUN"` with RUN unset: writing checkpoints into wherever the command ran is refused; so is
    `--csv "$TABLE"`, which read the current folder as the table (exit 1, "is a directory")."""
    monkeypatch.chdir(tmp_path)
    for option in ("--run-dir", "--data-dir", "--resume", *PATH_OPTIONS.get(recipe, [])):
        if option == "--data-dir" and option not in run_inprocess(recipe, "--help").stdout:
            continue
        result = run_inprocess(recipe, option, "")
        assert result.code == 2 and f"Invalid value for '{option}': is empty; give a path" in result.stderr
        if option not in ("--run-dir", "--data-dir"):  # a file's name in another encoding is read (and recorded
            continue  # escaped, tests/test_transformer.py), or refused in the recipe's words (tests/test_tabular.py)
        # a name in another encoding (Latin-1's \xff), which reaches Python as a lone surrogate: TensorBoard's
        # writer failed on it with a traceback
        result = run_inprocess(recipe, option, os.fsdecode(b"run-\xff"))
        assert result.code == 2 and f"Invalid value for '{option}': 'run-\\udcff' is not a UTF-8 name " \
            "(the run's records need one): rename it" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_every_recipe_steps_its_learning_rate_schedule_in_its_own_loop():
    """The schedule is the lesson (OneCycleLR after every batch): a reader who copies the loop, or writes their own
    step, must see the call. train_step does not take a scheduler to step out of sight."""
    import inspect

    from common.loop import train_step

    assert "scheduler" not in inspect.signature(train_step).parameters
    for recipe in RECIPES:
        source = (ROOT / "recipes" / f"{recipe}.py").read_text()
        assert "scheduler = " in source and "scheduler.step()" in source, recipe



# Two evaluations, the first in the middle of a --log-every window of 3 steps
MID_WINDOW_EVALUATIONS = {
    "mnist_onecycle": ["--data-dir", "{mnist_dir}", "--epochs", "2", "--batch-size", "64"],
    "tabular_mlp": ["--csv", "{table_csv}", "--target", "label", "--epochs", "2", "--batch-size", "32"],
    "tiny_transformer": ["--text", "{corpus_txt}", "--steps", "10", "--eval-every", "5", "--n-layer", "1",
                         "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
                         "--eval-batches", "1", "--sample-tokens", "2", "--peak-flops", "1e11"],
    "mixed_precision": ["--epochs", "2", "--samples", "256", "--batch-size", "32", "--width", "16", "--depth", "2"],
    "compiled_model": ["--epochs", "2", "--samples", "512", "--batch-size", "64", "--width", "16", "--depth", "2"],
    "ddp_mlp": ["--data-dir", "{mnist_dir}", "--epochs", "2", "--batch-size", "64", "--hidden", "32"],
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_evaluation_time_is_not_counted_as_training_time(recipe, run_inprocess, request, tmp_path, monkeypatch):
    """Each evaluation takes a million seconds on the run log's clock: the throughput a run reports is its training
    steps' alone only if the steps left in a window are timed before evaluating."""
    clock = {"offset": 0.0}
    clock_time = SimpleNamespace(perf_counter=lambda: time.perf_counter() + clock["offset"], time=time.time)
    monkeypatch.setattr(runlog, "time", clock_time)
    module, evaluated = load_recipe(recipe), []

    def slow_evaluate(*args, **kwargs):
        clock["offset"] += 1e6
        evaluated.append(1)
        return real_evaluate(*args, **kwargs)

    real_evaluate = module.evaluate
    monkeypatch.setattr(module, "evaluate", slow_evaluate)
    args = [str(request.getfixturevalue(a[1:-1])) if a.startswith("{") else a for a in MID_WINDOW_EVALUATIONS[recipe]]
    result = run_inprocess(recipe, *args, "--log-every", 3, "--run-dir", tmp_path)
    assert result.code == 0, result.stderr
    scalars, metrics = read_scalars(tmp_path), read_metrics(tmp_path)
    first = min(step for step, _ in scalars["val/loss"])
    assert len(scalars["val/loss"]) == 2 and first % 3 and len(evaluated) >= 2  # mid-window, and timed as slow
    unit = "tokens" if recipe == "tiny_transformer" else "samples"
    # a window holding an evaluation would be under 0.01 items a second; these models train 50 or more (a loaded CPU)
    assert metrics[f"{unit}_per_s"] > 1 and all(value > 1 for _, value in scalars[f"perf/{unit}_per_s"])


@pytest.mark.parametrize("script", ["doctor", "eject", "export", "find_lr", "plot_runs"])
def test_a_tool_without_its_docstring_still_answers_help(script, monkeypatch, capsys):
    """python -OO (PYTHONOPTIMIZE=2) drops docstrings, which the tools' --help read their description from: every
    call, --help too, was an AttributeError traceback."""
    spec = importlib.util.spec_from_file_location(f"tool_{script}", ROOT / "scripts" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "__doc__", None)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


def test_a_config_holding_no_path_where_a_path_goes_is_a_usage_error(run_inprocess, tmp_path):
    """A hand-edited config.json's {"text": 5} ended in a TypeError traceback (exit 1), not a usage error."""
    for recipe, key, value, option in [("tiny_transformer", "text", 5, "--text"), ("tabular_mlp", "csv_path", ["a"],
                                       "--csv"), ("tabular_mlp", "data_dir", {"a": 1}, "--data-dir")]:
        (tmp_path / "config.json").write_text(json.dumps({key: value}))
        result = run_inprocess(recipe, "--config", tmp_path / "config.json", "--run-dir", tmp_path / "run")
        assert result.code == 2 and f"Invalid value for '{option}': is {value!r}: give a path" in result.stderr, \
            result.stderr
        assert not (tmp_path / "run").exists()

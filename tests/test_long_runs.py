"""Long runs: an EMA of the weights (mnist_onecycle), the best k checkpoints and early stopping (tabular_mlp)."""

import pytest
import torch
from conftest import assert_same_weights, read_metrics, read_scalars
from torch import nn

from common.ema import EMA

MNIST = ["--epochs", 3, "--batch-size", 32, "--width", 4]


def test_ema_is_evaluated_beside_the_weights_and_chooses_best(run_inprocess, mnist_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = run_inprocess("mnist_onecycle", *MNIST, "--data-dir", mnist_dir, "--ema", 0.9, "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    metrics = read_metrics(run_dir)
    assert {"val_acc", "ema_val_acc", "ema_val_loss"} <= metrics.keys()
    assert metrics["ema_val_loss"] != metrics["val_loss"]  # another model: the average of the weights
    scalars = read_scalars(run_dir)
    assert [step for step, _ in scalars["ema_val/acc"]] == [14, 28, 42]
    best_step = max(scalars["ema_val/acc"], key=lambda s: (s[1], -s[0]))[0]  # the EMA's score chose it
    assert metrics["best_step"] == best_step
    assert metrics["best_ema_val_acc"] == pytest.approx(max(v for _, v in scalars["ema_val/acc"]))  # (float32 there)

    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    averaged = last["ema"]["module"]
    assert last["ema"]["updates"] == 42  # updated after every optimizer step
    assert averaged.keys() == last["model"].keys()  # batch norm's running statistics averaged too
    assert not torch.equal(averaged["head.weight"], last["model"]["head.weight"])
    if best["step"] == 42:  # best.pt holds the averaged weights that scored
        assert_same_weights(best["model"], averaged)


def test_the_average_warms_up_so_a_short_run_does_not_keep_its_untrained_start():
    """A fixed decay of 0.99 would still hold 0.99^40 = 67% of the initial weights after 40 steps."""
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)  # the untrained start
    ema = EMA(model, decay=0.99)
    with torch.no_grad():
        model.weight.fill_(1.0)  # what training reached
    ema.update()
    assert ema.module.weight.item() == pytest.approx(1 - 2 / 11)  # decay (1 + 1) / (10 + 1) at the first update
    for _ in range(39):
        ema.update()
    assert ema.module.weight.item() > 0.9  # less than a tenth of the start left after 40 updates
    assert ema.module.weight.item() < 1.0 and not ema.module.weight.requires_grad


def test_batch_norms_running_statistics_are_averaged_and_its_counter_copied():
    """The average's batch norm must follow the model's running statistics (the keys alone were checked: an EMA
    of the parameters only, its statistics left at their start, passed)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2)), model[0].bias.zero_()  # the batch reaches the norm as it is
    ema = EMA(model, decay=0.99)
    model(torch.tensor([[1.0, 3.0], [3.0, 5.0]]))  # a training batch: running mean 0.1 x (2, 4), from 0
    ema.update()
    norm = ema.module[1]
    assert norm.running_mean.tolist() == pytest.approx([(1 - 2 / 11) * 0.2, (1 - 2 / 11) * 0.4])
    assert norm.running_var.tolist() == pytest.approx([2 / 11 + (1 - 2 / 11) * 1.1] * 2)  # 0.9 + 0.1 x 2
    assert norm.num_batches_tracked.item() == 1  # an integer buffer: copied, not averaged


def test_a_resumed_ema_continues_exactly(run_inprocess, mnist_dir, tmp_path):
    common = [*MNIST, "--data-dir", mnist_dir, "--ema", 0.9]
    assert run_inprocess("mnist_onecycle", *common, "--run-dir", tmp_path / "full").code == 0
    assert run_inprocess("mnist_onecycle", *common, "--max-steps", 17, "--run-dir", tmp_path / "cut").code == 0
    resumed = run_inprocess("mnist_onecycle", *common, "--resume", "auto", "--run-dir", tmp_path / "cut")
    assert resumed.code == 0 and "resumed at step 17" in resumed.stdout
    full = torch.load(tmp_path / "full" / "checkpoints" / "last.pt", weights_only=True)
    cut = torch.load(tmp_path / "cut" / "checkpoints" / "last.pt", weights_only=True)
    assert_same_weights(full["ema"]["module"], cut["ema"]["module"])  # the average...
    assert full["ema"]["updates"] == cut["ema"]["updates"] == 42  # ...and how many steps it holds
    assert_same_weights(full["model"], cut["model"])


def test_keep_best_of_a_score_lower_is_better_keeps_the_lowest():
    """No test ran --keep-best on a regression: an order always descending kept the worst RMSEs."""
    from common.best import BestCheckpoints, BestScore, Kept

    best = BestScore("val_rmse", higher_is_better=False)
    kept = BestCheckpoints(2, best)
    decisions = [kept.update(rmse, step) for rmse, step in [(1.5, 7), (1.2, 14), (1.3, 21), (1.4, 28), (1.1, 35)]]
    assert decisions == [(True, []), (True, []), (True, [7]), (False, [28]), (True, [21])]
    assert kept.kept == [Kept(1.1, 35), Kept(1.2, 14)]
    assert [best.improved(rmse, step) for rmse, step in [(1.5, 7), (1.2, 14), (1.3, 21)]] == [True, True, False]
    assert best.metrics() == {"best_val_rmse": 1.2, "best_step": 14}


def test_keep_best_keeps_the_k_best_and_survives_a_resume(run_inprocess, table_csv, tmp_path, monkeypatch):
    from conftest import load_recipe

    # the accuracy each of six evaluations "measures" (7 steps per epoch: 240 training rows at batch 32)
    scores = iter([0.5, 0.9, 0.7, 0.8, 0.6, 0.95])
    monkeypatch.setattr(load_recipe("tabular_mlp"), "evaluate",
                        lambda *args, **kwargs: {"loss": 1.0, "acc": next(scores, 0.1)})
    run_dir = tmp_path / "run"
    common = ["--csv", table_csv, "--target", "label", "--epochs", 6, "--batch-size", 32, "--keep-best", 3,
              "--run-dir", run_dir, "--resume", "auto"]
    assert run_inprocess("tabular_mlp", *common, "--max-steps", 21).code == 0  # 3 epochs of 7 steps
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("best-step*.pt"))
    assert kept == ["best-step14.pt", "best-step21.pt", "best-step7.pt"]  # 0.5, 0.9, 0.7: all three fit
    assert run_inprocess("tabular_mlp", *common).code == 0  # resumed: 0.8, 0.6, 0.95
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("best-step*.pt"))
    assert kept == ["best-step14.pt", "best-step28.pt", "best-step42.pt"]  # 0.9, 0.8, 0.95
    assert torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)["step"] == 42
    assert torch.load(run_dir / "checkpoints" / "best-step28.pt", weights_only=True)["step"] == 28
    assert read_metrics(run_dir)["best_step"] == 42


@pytest.mark.parametrize(("before", "after", "first_scores", "expected"), [
    (3, 1, [0.5, 0.9, 0.7], set()), (1, 3, [0.5, 0.9, 0.7], {28, 35, 42}), (1, 3, [0.5, 0.7, 0.9], {21, 28, 42})])
def test_keep_best_changed_on_a_resume_keeps_files_and_kept_steps_alike(before, after, first_scores, expected,
                                                                          run_inprocess, table_csv, tmp_path,
                                                                          monkeypatch):
    """Lowered, the files of the steps it drops go; raised, it counts only the evaluations that have a file, and the
    resumed step's when it is the best (its weights are the restored ones: the resume writes its file, as after a
    kill between its last.pt and its files)."""
    from conftest import load_recipe

    scores = iter([*first_scores, 0.8, 0.6, 0.95])
    monkeypatch.setattr(load_recipe("tabular_mlp"), "evaluate",
                        lambda *args, **kwargs: {"loss": 1.0, "acc": next(scores, 0.1)})
    run_dir = tmp_path / "run"
    common = ["--csv", table_csv, "--target", "label", "--epochs", 6, "--batch-size", 32, "--run-dir", run_dir,
              "--resume", "auto"]
    assert run_inprocess("tabular_mlp", *common, "--keep-best", before, "--max-steps", 21).code == 0
    assert run_inprocess("tabular_mlp", *common, "--keep-best", after).code == 0  # 0.8, 0.6, 0.95
    files = {int(p.stem.removeprefix("best-step")) for p in (run_dir / "checkpoints").glob("best-step*.pt")}
    kept = {step for _, step in torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["kept"]["kept"]}
    assert files == expected and kept == ({42} if after == 1 else files)


def patience_run(table_csv, run_dir) -> list:
    """Seven steps an epoch, six epochs, and --patience 3: with scores that stop improving after step 14, the run stops
    early at step 35."""
    return ["--csv", table_csv, "--target", "label", "--epochs", 6, "--batch-size", 32, "--patience", 3, "--run-dir",
            run_dir, "--resume", "auto"]


def test_patience_stops_after_n_evaluations_without_a_better_score(run_inprocess, table_csv, tmp_path, monkeypatch):
    from conftest import load_recipe

    scores = iter([0.5, 0.9, 0.7, 0.8, 0.85, 0.99])
    monkeypatch.setattr(load_recipe("tabular_mlp"), "evaluate",
                        lambda *args, **kwargs: {"loss": 1.0, "acc": next(scores, 0.1)})
    run_dir = tmp_path / "run"
    args = patience_run(table_csv, run_dir)
    result = run_inprocess("tabular_mlp", *args)
    assert result.code == 0, result.stderr
    assert "stopping early: no better score in 3 evaluations (the best: step 14)" in result.stdout
    metrics = read_metrics(run_dir)
    assert (metrics["steps"], metrics["stopped_early"], metrics["best_step"]) == (35, True, 14)
    again = run_inprocess("tabular_mlp", *args)  # the same command once more: it has finished
    assert again.code == 0 and "already finished: step 35" in again.stdout
    assert "(stopped early: its score no longer improved)" in again.stdout and "--max-steps" not in again.stdout
    shorter = run_inprocess("tabular_mlp", *args, "--max-steps", 20)  # the reason is the record's, not the steps'
    assert shorter.code == 0 and "(stopped early: its score no longer improved)" in shorter.stdout, shorter.stdout


def test_a_run_going_on_from_another_folders_early_stop_has_patience_of_its_own(run_inprocess, table_csv, tmp_path,
                                                                                monkeypatch):
    """--resume OTHER/checkpoints/last.pt in a new --run-dir starts its own best score, kept steps and patience: it
    trains on, rather than ending at once with no best.pt of its own (and, with Adult's test file, no folder)."""
    from conftest import load_recipe

    scores = iter([0.5, 0.9, 0.7, 0.8, 0.85, 0.6])
    monkeypatch.setattr(load_recipe("tabular_mlp"), "evaluate",
                        lambda *args, **kwargs: {"loss": 1.0, "acc": next(scores, 0.1)})
    first = tmp_path / "first"
    assert run_inprocess("tabular_mlp", *patience_run(table_csv, first)).code == 0
    assert read_metrics(first)["stopped_early"] is True
    args = patience_run(table_csv, tmp_path / "second")
    args[args.index("auto")] = first / "checkpoints" / "last.pt"
    result = run_inprocess("tabular_mlp", *args)
    assert result.code == 0, result.stderr
    metrics = read_metrics(tmp_path / "second")
    assert (metrics["steps"], metrics["stopped_early"], metrics["best_step"], metrics["best_val_acc"]) == \
        (42, False, 42, 0.6)
    assert (tmp_path / "second" / "checkpoints" / "best.pt").is_file()


def test_an_early_stop_holds_through_a_stop_signal_and_a_kill_after_its_checkpoint(run_inprocess, table_csv, tmp_path,
                                                                                  monkeypatch):
    """SIGTERM during the evaluation that stops the run early: it stops there (it trained on, before), exit 143, and
    its resume finishes without training; killed after that evaluation's checkpoint but before metrics.json:
    relaunched, it trains nothing more."""
    import os
    import signal

    from conftest import load_recipe

    scores = iter([0.5, 0.9, 0.7, 0.8, 0.85])  # no better score after step 14: the 5th evaluation (step 35) stops

    def evaluate(*args, **kwargs):
        score = next(scores, 0.1)
        if score == 0.85:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's stop, while that evaluation runs
        return {"loss": 1.0, "acc": score}

    monkeypatch.setattr(load_recipe("tabular_mlp"), "evaluate", evaluate)
    run_dir = tmp_path / "run"
    args = patience_run(table_csv, run_dir)
    result = run_inprocess("tabular_mlp", *args)
    assert result.code == 143, result.stderr
    assert "stopping early: no better score in 3 evaluations (the best: step 14)" in result.stdout
    assert "interrupted at step 35; checkpoint saved. Resume with:" in result.stdout
    assert not (run_dir / "metrics.json").exists()
    trained = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    resumed = run_inprocess("tabular_mlp", *args)  # (--resume auto)
    assert resumed.code == 0, resumed.stderr
    assert (read_metrics(run_dir)["steps"], read_metrics(run_dir)["stopped_early"]) == (35, True)
    assert_same_weights(torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"], trained)

    (run_dir / "metrics.json").unlink()  # as if killed between the early stop's checkpoint and the end of the run
    again = run_inprocess("tabular_mlp", *args)
    assert again.code == 0, again.stderr
    metrics = read_metrics(run_dir)
    assert (metrics["steps"], metrics["stopped_early"], metrics["best_step"]) == (35, True, 14)
    assert_same_weights(torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"], trained)


@pytest.mark.parametrize(("recipe", "option", "value", "text"), [
    ("mnist_onecycle", "--ema", "1.0", "must be between 0 and 1"),
    ("mnist_onecycle", "--ema", "0", "must be between 0 and 1"),
    ("tabular_mlp", "--keep-best", "0", "greater than or equal to 1"),
    ("tabular_mlp", "--patience", "0", "greater than or equal to 1")])
def test_bad_values_are_usage_errors_naming_the_option(run_inprocess, recipe, tmp_path, option, value, text):
    result = run_inprocess(recipe, option, value, "--run-dir", tmp_path)
    assert result.code == 2 and f"'{option}'" in result.stderr and text in result.stderr
    assert not any(tmp_path.iterdir())

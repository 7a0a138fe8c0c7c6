"""recipes/tabular_mlp.py: numeric embeddings (piecewise-linear, periodic) and K-fold cross-validation."""

import csv
import json
import math
import shutil

import numpy as np
import onnxruntime
import pyarrow as pa
import pyarrow.csv
import pytest
import torch
from conftest import assert_same_weights, load_recipe, load_weights, read_metrics, write_table

from scripts import export

RECIPE = "tabular_mlp"
tabular = load_recipe(RECIPE)
COMMON = ["--target", "label", "--batch-size", 32]


def test_piecewise_linear_encoding_of_known_bins():
    encode = tabular.PiecewiseLinear([[0.0, 1.0, 3.0], [-1.0, 1.0]])  # 2 bins; 1 bin (and a padding bin)
    x = torch.tensor([[-2.0, -3.0], [0.5, 0.0], [2.0, 1.0], [5.0, 5.0]])
    expected = [[[-2.0, 0.0], [-1.0, 0.0]],  # below the first edge: the first bin is open below
                [[0.5, 0.0], [0.5, 0.0]],
                [[1.0, 0.5], [1.0, 0.0]],
                [[1.0, 2.0], [3.0, 0.0]]]  # above the last edge: the last real bin is open above; padding is 0
    torch.testing.assert_close(encode(x), torch.tensor(expected))


def test_bins_are_distinct_quantiles_of_the_rows_they_are_fitted_on():
    header = ["x", "y"]
    rows = [[str(v), "ab"[i % 2]] for i, v in enumerate(range(101))]  # x = 0..100: mean 50, std 29.15
    spec = tabular.fit_features(pa.table({h: [r[i] for r in rows] for i, h in enumerate(header)}), "y", "auto",
                                bins=4)
    mean, std = spec["numeric"]["x"]
    assert mean == 50.0
    assert spec["bins"]["x"] == pytest.approx([(q - mean) / std for q in (0, 25, 50, 75, 100)])  # the rows' own
    few = tabular.fit_features(pa.table({"flag": ["0", "1"] * 10, "y": ["a", "b"] * 10}), "y", "auto", bins=8)
    assert len(few["bins"]["flag"]) == 2  # two distinct values: one bin, not eight empty ones


def test_a_column_whose_values_repeat_starts_with_frequencies_spread_up_to_the_high_sigma():
    rows = 40
    table = pa.table({"years": [str(20 + i % 4) for i in range(rows)],  # 4 values: 10 rows each
                      "weight": [f"{0.37 * i:.2f}" for i in range(rows)],  # a value per row
                      "y": ["ab"[i % 2] for i in range(rows)]})
    spec = tabular.fit_features(table, "y", "auto")
    assert spec["rows_per_value"] == {"years": 10.0, "weight": 1.0}  # counted on the rows it is fitted on
    constant = table.append_column("flag", pa.array(["1"] * rows))
    assert tabular.fit_features(constant, "y", "auto")["rows_per_value"]["flag"] == 1.0  # nothing to tell apart
    assert tabular.fit_features(table.slice(0, 20), "y", "auto")["rows_per_value"]["years"] == 5.0
    spreads = tabular.frequency_spreads(spec)
    k = tabular.PERIODIC_FREQUENCIES
    assert spreads.shape == (2, k)
    torch.testing.assert_close(spreads[0], torch.logspace(math.log10(0.5), 2, k))  # years: 0.5 ... 100
    assert spreads[0, -1].item() == pytest.approx(tabular.PERIODIC_SIGMA_REPEATED)
    assert torch.equal(spreads[1], torch.full((k,), tabular.PERIODIC_SIGMA))  # weight: smooth
    old = {k_: v for k_, v in spec.items() if k_ != "rows_per_value"}  # a checkpoint from before the rule
    assert torch.equal(tabular.frequency_spreads(old), torch.full((2, k), tabular.PERIODIC_SIGMA))
    torch.manual_seed(0)
    frequencies = tabular.numeric_embedding("periodic", spec, 4)[0].frequencies
    assert frequencies[0].abs().max() > 10 > 2 > frequencies[1].abs().max()  # drawn with those sigmas


def test_a_column_missing_in_every_training_row_trains_and_predicts(run_inprocess, tmp_path):
    rng = np.random.default_rng(0)
    lines = ["x,empty,y"] + [f"{v:.3f},,{'ab'[int(v > 0)]}" for v in rng.normal(size=120)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--csv", tmp_path / "t.csv", "--target", "y", "--epochs", 2, "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    spec = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)["features"]
    assert spec["categorical"]["empty"] == ["<unseen>", "<missing>"]
    (tmp_path / "new.csv").write_text("x,empty\n0.5,\n-0.5,hello\n")
    result = run_inprocess(RECIPE, "--predict", tmp_path / "new.csv", "--resume", run_dir / "checkpoints" / "best.pt")
    assert result.code == 0, result.stderr
    assert_predicted(tmp_path / "new.predictions.csv", ["x", "empty"], rows=2)


def assert_predicted(path, columns, rows):
    """A prediction per input row, after the row's own cells: a class of the training target, and its probability."""
    predicted = pa.csv.read_csv(path)
    assert predicted.column_names == [*columns, "prediction", "probability"] and predicted.num_rows == rows
    assert set(predicted["prediction"].to_pylist()) <= {"a", "b"}
    assert all(0.5 <= p <= 1 for p in predicted["probability"].to_pylist())  # the likelier of two classes


def test_an_all_missing_parquet_column_trains_and_predicts(run_inprocess, tmp_path):
    import pyarrow.parquet as pq

    x = np.random.default_rng(1).normal(size=100)
    table = pa.table({"x": x, "nothing": pa.array([None] * 100, pa.float64()), "y": ["ab"[int(v > 0)] for v in x]})
    pq.write_table(table, tmp_path / "t.parquet")
    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--csv", tmp_path / "t.parquet", "--target", "y", "--epochs", 2,
                           "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    assert torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)["features"]["categorical"]["nothing"] \
        == ["<unseen>", "<missing>"]
    pq.write_table(table.drop(["y"]).slice(0, 5), tmp_path / "new.parquet")
    result = run_inprocess(RECIPE, "--predict", tmp_path / "new.parquet", "--resume",
                           run_dir / "checkpoints" / "best.pt")
    assert result.code == 0, result.stderr
    assert_predicted(tmp_path / "new.predictions.csv", ["x", "nothing"], rows=5)


@pytest.mark.parametrize("embedding", ["ple", "periodic"])
def test_an_embedded_run_carries_its_bins_resumes_exactly_and_exports(run_inprocess, table_csv, tmp_path, embedding):
    args = ["--csv", table_csv, *COMMON, "--epochs", 3, "--num-embedding", embedding]
    assert run_inprocess(RECIPE, *args, "--run-dir", tmp_path / "full").code == 0
    assert run_inprocess(RECIPE, *args, "--max-steps", 10, "--run-dir", tmp_path / "cut").code == 0
    assert run_inprocess(RECIPE, *args, "--resume", "auto", "--run-dir", tmp_path / "cut").code == 0
    best = tmp_path / "full" / "checkpoints" / "best.pt"
    assert_same_weights(load_weights(tmp_path / "full" / "checkpoints" / "last.pt"),
                        load_weights(tmp_path / "cut" / "checkpoints" / "last.pt"))
    state = torch.load(best, weights_only=True)
    assert state["config"]["num_embedding"] == embedding
    if embedding == "ple":  # the bins travel twice: as statistics (features) and as the encoding's buffers
        spec = state["features"]
        assert set(spec["bins"]) == set(spec["numeric"]) == {"age", "income"}
        order = torch.randperm(240 + 60, generator=torch.Generator().manual_seed(0)).numpy()  # the recipe's split
        ages = np.array(tabular.read_table(table_csv)["age"].to_pylist(), dtype=float)[order[60:]]  # training rows
        standardised = (ages - ages.mean()) / ages.std()
        expected = np.unique(np.quantile(standardised, np.linspace(0, 1, tabular.PLE_BINS + 1), method="nearest"))
        assert spec["bins"]["age"] == pytest.approx(expected.tolist())
        assert state["model"]["numeric.0.left"][0, : len(spec["bins"]["age"]) - 1].tolist() == pytest.approx(
            spec["bins"]["age"][:-1])
    else:
        assert state["model"]["numeric.0.frequencies"].shape == (2, tabular.PERIODIC_FREQUENCIES)

    # --predict and the exported ONNX model give the checkpoint's own predictions
    new = write_table(tmp_path / "new.csv", n=40, seed=5, target=False)
    assert run_inprocess(RECIPE, "--predict", new, "--resume", best).code == 0
    with open(tmp_path / "new.predictions.csv", newline="") as f:
        predicted = [row["prediction"] for row in csv.DictReader(f)]
    assert export.main([str(best), str(tmp_path / "exported")]) == 0
    numeric, categorical, _ = tabular.encode(state["features"], tabular.read_table(new), with_target=False)
    session = onnxruntime.InferenceSession(str(tmp_path / "exported" / "model.onnx"))
    onnx_logits = session.run(None, {"numeric": numeric, "categorical": categorical.astype(np.int64)})[0]
    model = tabular.model_from_checkpoint(state, best).eval()
    with torch.no_grad():
        eager = model(torch.from_numpy(numeric), torch.from_numpy(categorical)).numpy()
    np.testing.assert_allclose(onnx_logits, eager, atol=1e-4)
    assert [state["features"]["classes"][i] for i in eager.argmax(1)] == predicted


def fold_spec(run_dir, k: int) -> dict:
    return torch.load(run_dir / f"fold-{k}" / "checkpoints" / "best.pt", weights_only=True)["features"]


def test_cross_validation_folds_are_stratified_and_fitted_on_their_own_training_rows(run_inprocess, table_csv,
                                                                                     tmp_path):
    run_dir = tmp_path / "cv"
    result = run_inprocess(RECIPE, "--csv", table_csv, *COMMON, "--epochs", 2, "--cv", 3, "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    metrics = read_metrics(run_dir)
    assert metrics["cv"] == 3 and metrics["metric"] == "val_acc" and len(metrics["folds"]) == 3
    assert metrics["mean_val_acc"] == pytest.approx(np.mean(metrics["folds"]))
    assert metrics["std_val_acc"] == pytest.approx(np.std(metrics["folds"], ddof=1))
    assert [read_metrics(run_dir / f"fold-{k}")["val_acc"] for k in range(3)] == metrics["folds"]
    assert result.done_line.startswith(f"done: val_acc={metrics['mean_val_acc']:.4f}±")

    table = tabular.read_table(table_csv)
    folds = tabular.fold_of_each_row(table, "label", "classification", 3, seed=0)
    labels = np.array(table["label"].to_pylist())
    for k in range(3):  # each class split evenly over the folds (stratified), and each fold's own statistics
        for label in ("yes", "no"):
            assert abs((labels[folds == k] == label).sum() - (labels == label).sum() / 3) <= 1
        ages = np.array(table["age"].to_pylist(), dtype=float)[folds != k]
        assert fold_spec(run_dir, k)["numeric"]["age"][0] == pytest.approx(ages.mean())
    assert len({fold_spec(run_dir, k)["numeric"]["age"][0] for k in range(3)}) == 3


def test_a_resumed_cross_validation_skips_the_finished_folds(run_inprocess, table_csv, tmp_path):
    args = ["--csv", table_csv, *COMMON, "--epochs", 2, "--cv", 3]
    assert run_inprocess(RECIPE, *args, "--run-dir", tmp_path / "whole").code == 0
    # every fold cut short at step 5 (--max-steps), then fold 2 as if it had never started
    assert run_inprocess(RECIPE, *args, "--run-dir", tmp_path / "cut", "--max-steps", 5).code == 0
    assert read_metrics(tmp_path / "cut" / "fold-1")["steps"] == 5
    shutil.rmtree(tmp_path / "cut" / "fold-2")
    whole = read_metrics(tmp_path / "whole")
    result = run_inprocess(RECIPE, *args, "--run-dir", tmp_path / "cut", "--resume", "auto")
    assert result.code == 0, result.stderr
    assert read_metrics(tmp_path / "cut")["folds"] == whole["folds"]
    for k in range(3):
        assert_same_weights(load_weights(tmp_path / "whole" / f"fold-{k}" / "checkpoints" / "last.pt"),
                            load_weights(tmp_path / "cut" / f"fold-{k}" / "checkpoints" / "last.pt"))
    again = run_inprocess(RECIPE, *args, "--run-dir", tmp_path / "cut", "--resume", "auto")
    assert again.code == 0 and again.stdout.count("already finished") == 3
    assert read_metrics(tmp_path / "cut")["folds"] == whole["folds"]
    # the same command without --cv would train one run beside the folds and replace their summary: refused
    summary = (tmp_path / "cut" / "metrics.json").read_bytes()
    single = run_inprocess(RECIPE, *args[:-2], "--run-dir", tmp_path / "cut", "--resume", "auto")
    assert single.code == 1 and "holds runs in sub-folders" in single.stderr
    assert single.stderr.endswith("to continue it, give the options it was started with\n"), single.stderr
    assert (tmp_path / "cut" / "metrics.json").read_bytes() == summary
    assert not (tmp_path / "cut" / "checkpoints").exists()


@pytest.mark.parametrize(("extra", "code", "message"), [
    (["--cv", "1"], 2, "--cv"),
    (["--cv", "0"], 2, "--cv"),
    (["--cv", "2", "--resume", "x.pt"], 2, "--cv resumes every fold with --resume auto"),
    (["--cv", "200"], 1, "too few for 200 folds"),
    (["--cv", "2", "--val-frac", "0.3"], 2, "for --val-frac: is for one split; --cv validates on each fold in turn"),
    (["--val-frac=0.2", "--cv", "2"], 2, "for --val-frac: is for one split"),  # at its default too: it does nothing
])
def test_a_bad_number_of_folds_is_refused(run_inprocess, table_csv, tmp_path, extra, code, message):
    result = run_inprocess(RECIPE, "--csv", table_csv, *COMMON, "--epochs", 1, *extra, "--run-dir", tmp_path / "r")
    assert result.code == code and message in result.stderr, result.stderr
    assert not (tmp_path / "r").exists()  # nothing left behind


def test_regression_cross_validation_reports_rmse_in_the_target_units(run_inprocess, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 10, size=150)
    lines = ["x,y"] + [f"{a:.3f},{100 + 30 * math.sin(a):.3f}" for a in x]
    (tmp_path / "r.csv").write_text("\n".join(lines) + "\n")
    result = run_inprocess(RECIPE, "--csv", tmp_path / "r.csv", "--target", "y", "--epochs", 30, "--cv", 3,
                           "--num-embedding", "periodic", "--run-dir", tmp_path / "cv")
    assert result.code == 0, result.stderr
    metrics = json.loads((tmp_path / "cv" / "metrics.json").read_text())
    assert metrics["metric"] == "val_rmse" and len(metrics["folds"]) == 3
    assert metrics["mean_val_rmse"] < 0.5 * 30 / math.sqrt(2)  # well below predicting the mean (std of y: 21)


def test_every_fold_learns_the_task_of_the_whole_column(run_inprocess, tmp_path):
    """--task auto is the whole column's: 21 integer values are a regression, though each fold's training rows hold
    18 of them (a class code, by themselves). Both folds were classifications of 18 classes, scored by val_acc; folds
    of different tasks would have failed the summary with a traceback."""
    rows = [f"{i % 7}.5,{i % 20}" for i in range(59)] + ["3.5,20"]
    (tmp_path / "t.csv").write_text("x,y\n" + "\n".join(rows) + "\n")
    result = run_inprocess(RECIPE, "--csv", tmp_path / "t.csv", "--target", "y", "--epochs", 1, "--cv", 2,
                           "--run-dir", tmp_path / "cv")
    assert result.code == 0, result.stderr
    assert json.loads((tmp_path / "cv" / "metrics.json").read_text())["metric"] == "val_rmse"
    for fold in (0, 1):
        assert json.loads((tmp_path / "cv" / f"fold-{fold}" / "config.json").read_text())["task"] == "auto"
        assert "val_rmse" in read_metrics(tmp_path / "cv" / f"fold-{fold}")


def test_a_fold_whose_training_rows_hold_one_class_is_named(run_inprocess, tmp_path):
    (tmp_path / "t.csv").write_text("x,y\n" + "".join(f"{i},a\n" for i in range(9)) + "4,b\n")
    result = run_inprocess(RECIPE, "--csv", tmp_path / "t.csv", "--target", "y", "--epochs", 1, "--cv", 2,
                           "--run-dir", tmp_path / "cv")
    assert result.code == 1
    assert result.stderr == ("error: target column 'y' holds 1 distinct value(s) besides missing ones in fold 1's "
                             "training rows (--cv 2): there is nothing to learn\n")


def test_the_default_length_and_batch_follow_the_size_of_the_table(run_inprocess, table_csv, tmp_path):
    assert (tabular.default_batch_size(24_000), tabular.default_epochs(24_000 // 256, "adamw")) == (256, 10)  # Adult
    assert (tabular.default_batch_size(142), tabular.default_epochs(142 // 16, "adamw")) == (16, 100)  # wine: 800 steps
    # lbfgs takes the whole table each step, up to 20 passes: 800 of them took 6.7 minutes on wine and 12 GB of saves
    assert tabular.default_epochs(1, "lbfgs") == 100
    result = run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    metrics = read_metrics(tmp_path / "run")
    assert metrics["steps"] == 54 * 15  # 240 rows: batch 16, 15 steps an epoch, 54 epochs for 800 steps
    assert metrics["val_acc"] > 0.9  # periodic embeddings (the default) learn the toy label in that length
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["epochs"] is None and config["num_embedding"] == "auto"  # as given; resolved from the table:
    assert config["num_embedding_used"] == "periodic"  # a classification embeds at any size
    again = run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--run-dir", tmp_path / "run",
                          "--resume", "auto")
    assert again.code == 0 and again.stdout.startswith(f"already finished: step {54 * 15} of {54 * 15}")


def test_auto_embedding_leaves_a_small_regression_as_numbers_and_the_model_follows_its_checkpoint(
        run_inprocess, tmp_path):
    assert tabular.auto_embedding("classification", 100) == tabular.auto_embedding("regression", 10_000) == "periodic"
    assert tabular.auto_embedding("regression", 9_999) == "none"
    rng = np.random.default_rng(0)
    lines = ["x,z,y"] + [f"{a:.3f},{b:.3f},{2 * a - b:.3f}" for a, b in rng.normal(size=(200, 2))]
    (tmp_path / "r.csv").write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--csv", tmp_path / "r.csv", "--target", "y", "--epochs", 2, "--max-steps", 20,
                           "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    assert "2 numeric (none)" in result.stdout  # the header says what auto chose
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert best["config"]["num_embedding"] == "auto" and best["config"]["num_embedding_used"] == "none"
    assert not any(name.startswith("numeric.") for name in best["model"])  # no embedding's weights
    # a resume keeps the run's choice, and --predict builds the model the checkpoint holds
    again = run_inprocess(RECIPE, "--csv", tmp_path / "r.csv", "--target", "y", "--epochs", 2, "--run-dir", run_dir,
                          "--resume", "auto")
    assert again.code == 0, again.stderr
    (tmp_path / "new.csv").write_text("x,z\n1.0,0.5\n")
    result = run_inprocess(RECIPE, "--predict", tmp_path / "new.csv", "--resume", run_dir / "checkpoints" / "best.pt",
                           "--output", tmp_path / "p.csv")
    assert result.code == 0, result.stderr
    rows = list(csv.DictReader((tmp_path / "p.csv").open()))
    assert len(rows) == 1 and math.isfinite(float(rows[0]["prediction"]))


def test_a_constant_column_under_ple_leaves_checkpoints_that_load(run_inprocess, table_csv, tmp_path):
    """A constant column gets one bin of two edges: they were numpy scalars, which weights_only loading refuses, so
    the run could neither be resumed nor predict."""
    lines = table_csv.read_text().splitlines()
    constant = tmp_path / "constant.csv"
    constant.write_text("\n".join([lines[0] + ",flag", *(line + ",1" for line in lines[1:])]) + "\n")
    args = ["--csv", constant, *COMMON, "--epochs", 2, "--num-embedding", "ple", "--run-dir", tmp_path / "run"]
    assert run_inprocess(RECIPE, *args, "--max-steps", 5).code == 0
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["features"]["bins"]["flag"] == [0.0, 1.0]
    resumed = run_inprocess(RECIPE, *args, "--resume", "auto")
    assert resumed.code == 0 and "resumed at step 5" in resumed.stdout, resumed.stderr


def test_folds_stratify_a_class_however_its_cells_spell_it():
    # 8 ones and 4 zeros, each spelled two ways: every fold of 3 holds its share of both classes, within a row
    cells = ["1", "1", "0", "1.0", " 1.0", "0.0"] * 2
    folds = tabular.fold_of_each_row(pa.table({"label": cells}), "label", "classification", 3, seed=0)
    ones = np.array([float(c) == 1 for c in cells])
    for k in range(3):
        assert abs(ones[folds == k].sum() - 8 / 3) <= 1 and abs((~ones[folds == k]).sum() - 4 / 3) <= 1


def test_a_signal_between_two_folds_stops_the_next_one_resumably(run_inprocess, table_csv, tmp_path, monkeypatch):
    """A SIGTERM after fold 0's loop (its test set, metrics, fold 1's set-up) was said to be heard, then fold 1
    made a new stop request of its own and trained to the end: the job was killed after the scheduler's grace.
    Fold 0's loop is over and saved: the command exits at once, and its resume does fold 1."""
    import signal

    loads, load_tables = [], tabular.load_tables

    def signalled_in_fold_1(*args):
        loads.append(1)
        if len(loads) == 2:
            signal.raise_signal(signal.SIGTERM)
        return load_tables(*args)

    monkeypatch.setattr(tabular, "load_tables", signalled_in_fold_1)
    args = ["--csv", table_csv, *COMMON, "--epochs", 2, "--cv", 2, "--run-dir", tmp_path / "cv"]
    result = run_inprocess(RECIPE, *args)
    assert result.code == 143 and "checkpoint saved. Resume with:" in result.stdout, result.stdout
    assert result.stdout.strip().splitlines()[-1].endswith(f"--resume auto --run-dir {tmp_path / 'cv'}")
    assert not (tmp_path / "cv" / "fold-1" / "checkpoints" / "last.pt").exists()  # fold 1 trained no step
    assert [(tmp_path / "cv" / f"fold-{k}" / "metrics.json").exists() for k in (0, 1)] == [True, False]
    monkeypatch.setattr(tabular, "load_tables", load_tables)
    resumed = run_inprocess(RECIPE, *args, "--resume", "auto")
    assert resumed.code == 0 and len(read_metrics(tmp_path / "cv")["folds"]) == 2, resumed.stderr

"""recipes/tabular_mlp.py: the hand-written Linear, preprocessing, training, resume and prediction."""

import csv
import gzip
import hashlib
import json
import math
import re
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch
from conftest import assert_same_weights, load_recipe, load_weights, read_metrics, read_scalars, write_table
from torch import nn

from common.data import built_batch, make_loader

RECIPE = "tabular_mlp"
tabular = load_recipe(RECIPE)
# Numbers as they are, and light dropout: these tests train a few steps, and the toy label's sharp threshold (age >
# 45) is learnt in fewer steps so than with the defaults (periodic embeddings, dropout 0.5: they get there in their
# default length)
RAW = ["--num-embedding", "none", "--dropout", "0.1"]


def test_linear_matches_nn_linear_given_the_same_weights():
    ours, theirs = tabular.Linear(7, 5), nn.Linear(7, 5)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 3, 7)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=1e-6)
    assert ours.weight.shape == (5, 7)


def test_linear_initialises_like_nn_linear():
    torch.manual_seed(3)
    ours = tabular.Linear(20, 10)
    torch.manual_seed(3)
    theirs = nn.Linear(20, 10)
    assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)


def test_linear_without_bias_registers_nothing_named_bias():
    layer = tabular.Linear(3, 2, bias=False)
    assert layer.bias is None
    assert [name for name, _ in layer.named_parameters()] == ["weight"]
    assert list(layer.state_dict()) == ["weight"]
    torch.testing.assert_close(layer(torch.eye(3)), layer.weight.T)


def text_table(header: list[str], rows: list[list[str]]) -> pa.Table:
    return pa.table([pa.array(column, pa.string()) for column in zip(*rows, strict=True)], names=header)


def test_preprocessing_uses_training_statistics_and_handles_missing_and_unseen():
    header = ["x", "colour", "y"]
    train = text_table(header, [["1", "red", "a"], ["3", "blue", "b"], ["?", "", "a"]])
    spec = tabular.fit_features(train, "y", "auto")
    assert spec["task"] == "classification" and spec["classes"] == ["a", "b"]
    assert spec["numeric"] == {"x": (2.0, 1.0)}
    assert spec["categorical"]["colour"] == ["<unseen>", "<missing>", "blue", "red"]
    numeric, categorical, target = tabular.encode(spec, text_table(header, [["5", "green", "b"], ["NA", "?", "a"]]))
    assert numeric.tolist() == [[3.0], [0.0]]  # (5 - 2) / 1; missing -> the mean
    assert categorical.tolist() == [[0], [1]]  # unseen -> 0, missing -> 1
    assert target.tolist() == [1, 0]


SPELLINGS = ["", " ", "?", "NA", "n/a", "N/A", "NaN", "nan", "NAN", "-nan", "null", "NULL", "None", "none"]


def test_every_spelling_of_missing_and_every_non_finite_number_is_missing():
    header = ["x", "colour", "y"]
    odd = [*SPELLINGS, "inf", "-inf", "Infinity"]  # non-finite numbers: missing too, in a numeric column
    rows = [["2", "red", "a"], ["4", "blue", "b"]] + [[v, v if v in SPELLINGS else "", "ab"[i % 2]]
                                                      for i, v in enumerate(odd)]
    spec = tabular.fit_features(text_table(header, rows), "y", "auto")
    assert spec["numeric"] == {"x": (3.0, 1.0)}  # from 2 and 4 alone
    assert spec["categorical"]["colour"] == ["<unseen>", "<missing>", "blue", "red"]
    new = [[v, v, "a"] for v in [*odd, "7", "seven"]]  # "seven": not a number, in a numeric column
    numeric, categorical, _ = tabular.encode(spec, text_table(header, new))
    assert numeric[:, 0].tolist() == [0.0] * len(odd) + [4.0, 0.0]
    assert categorical[:, 0].tolist() == [1] * len(SPELLINGS) + [0, 0, 0, 0, 0]  # "inf" text: an unseen colour


def test_a_batch_is_one_indexing_operation(table_csv):
    table = tabular.read_table(table_csv)
    dataset = tabular.TabularDataset(*tabular.encode(tabular.fit_features(table, "label", "auto"), table))
    numeric, categorical, target = dataset.__getitems__([5, 2, 9])
    rows = [dataset[i] for i in (5, 2, 9)]
    assert torch.equal(numeric, torch.stack([r[0] for r in rows])) and numeric.shape == (3, 2)
    assert torch.equal(categorical, torch.stack([r[1] for r in rows])) and categorical.dtype == torch.int32
    assert target.tolist() == [r[2].item() for r in rows]
    batch = next(iter(make_loader(dataset, 4, train=False, collate_fn=built_batch)))
    assert [t.shape[0] for t in batch] == [4, 4, 4]
    assert torch.equal(batch[1], dataset.categorical[:4])


def test_a_numeric_column_with_a_few_stray_cells_stays_numeric(capsys):
    """One typo ("12 kg", "1,200") in 300 numbers made the column a category of its 299 distinct values, silently;
    a new row's stray cell was already read as missing. Over 1% of words: a column of words, as before."""
    x = [f"{i * 1.5}" for i in range(300)]
    x[7], x[100] = "12 kg", "1,200"
    m = [str(i) if i % 20 else "many" for i in range(300)]  # 5% words
    colour = ["red", "green", "blue"] * 100  # words alone: no warning
    table = text_table(["x", "m", "colour", "y"], [list(r) for r in zip(x, m, colour, "abc" * 100, strict=True)])
    spec = tabular.fit_features(table, "y", "auto")
    assert list(spec["numeric"]) == ["x"] and list(spec["categorical"]) == ["m", "colour"]
    present = np.array([i * 1.5 for i in range(300) if i not in (7, 100)])
    assert spec["numeric"]["x"] == pytest.approx((present.mean(), present.std()))
    said = capsys.readouterr().err
    assert "warning: column 'x': 2 of 300 values are not numbers (such as '12 kg'), read as missing" in said
    # more, but still a minority: the category that column becomes is said too (it was silent)
    assert said.count("\n") == 2 and "warning: column 'm': 15 of 300 values are not numbers (such as 'many'), too " \
        "many to read as missing: it is read as a category of its every value; clean them to read numbers\n" in said
    numeric = tabular.encode(spec, table)[0]
    assert numeric[[7, 100], 0].tolist() == [0.0, 0.0]  # missing: the training mean
    assert numeric[8, 0] == pytest.approx((12.0 - present.mean()) / present.std())


@pytest.mark.parametrize("cell", ["{:,.2f}", "{:.2f}%", "${:.2f}", "decimal comma", "Swiss", "Indian", "accounting",
                                  "EUR", "phone"])
def test_numbers_as_a_spreadsheet_shows_them_are_said_to_be_read_as_a_category(cell, capsys):
    """A spreadsheet's 1,234.56, 0,126, 12%, $3, 1'234.56, 1,23,456.78 or (1,234.56) in every cell: numbers to a
    person, words to a program. The column became a category of its every value without a word."""
    rng = np.random.default_rng(0)
    values = rng.normal(1000, 100, 300) * (200 if cell == "Indian" else 1)  # (lakhs: 2,00,000.00)
    spell = {"decimal comma": lambda v: f"{v:.3f}".replace(".", ","), "Swiss": lambda v: f"{v:,.2f}".replace(",", "'"),
             "Indian": lambda v: re.sub(r"(\d)(?=(\d\d)*\d\d\d\.)", r"\1,", f"{v:.2f}"),
             "accounting": lambda v: f"({v:,.2f})" if v < 1000 else f"{v:,.2f}", "EUR": lambda v: f"{v:.2f} EUR",
             "phone": lambda v: f"+420 {int(v):03d} {int(v * 7) % 1000:03d}"}.get(cell, cell.format)
    x = [spell(v) for v in values]
    table = text_table(["x", "y"], [[a, b] for a, b in zip(x, "ab" * 150, strict=True)])
    spec = tabular.fit_features(table, "y", "auto")
    assert list(spec["categorical"]) == ["x"]
    said = capsys.readouterr().err
    if cell in ("EUR", "phone"):  # a unit word, groups without a decimal comma (a phone number): nothing said
        assert said == ""
    else:
        assert said == f"warning: column 'x' holds what look like numbers as a spreadsheet shows them (such as " \
            f"{x[0]!r}): read as a category of its every value; if they are numbers, write them plain (1234.5: a " \
            "decimal point, no thousands separator, percent or currency sign)\n"


def test_a_target_or_new_rows_of_numbers_as_a_spreadsheet_shows_them_are_said(run_inprocess, tmp_path):
    """A target of decimal commas was read as 154 classes, silently; --task regression said only "holds text". New
    rows whose numbers have thousands separators were read as missing, silently, and predicted otherwise."""
    rng = np.random.default_rng(0)
    rows = [(f"{a:.3f}", f"{b:.2f}") for a, b in zip(rng.normal(0, 1, 200), rng.normal(1000, 100, 200), strict=True)]
    (tmp_path / "comma.csv").write_text("x,price\n" + "".join(f'{a},"{b.replace(".", ",")}"\n' for a, b in rows))
    common = ["--csv", tmp_path / "comma.csv", "--target", "price", "--max-steps", 1]
    auto = run_inprocess(RECIPE, *common, "--run-dir", tmp_path / "auto")
    assert auto.code == 0 and "warning: target column 'price' holds what look like numbers as a spreadsheet shows " \
        f"them (such as '{rows[0][1].replace('.', ',')}'), so it is read as " in auto.stderr, auto.stderr
    assert "classes; to predict numbers, write them plain (1234.5: a decimal point" in auto.stderr
    regression = run_inprocess(RECIPE, *common, "--task", "regression", "--run-dir", tmp_path / "regression")
    assert regression.code == 1 and regression.stderr.startswith("error: --task regression needs a numeric target, "
                                                                 "but 'price' holds text (numbers as a spreadsheet ")
    (tmp_path / "plain.csv").write_text("x,price\n" + "".join(f"{a},{b}\n" for a, b in rows))
    assert run_inprocess(RECIPE, "--csv", tmp_path / "plain.csv", "--target", "x", "--max-steps", 1, "--run-dir",
                         tmp_path / "plain").code == 0
    new = tmp_path / "new.csv"
    new.write_text("price\n" + "".join(f'"{float(b):,.2f}"\n' for _, b in rows[:20]))
    thousands = sum(float(b) >= 1000 for _, b in rows[:20])
    predicted = run_inprocess(RECIPE, "--predict", new, "--resume", tmp_path / "plain" / "checkpoints" / "last.pt")
    assert predicted.code == 0 and predicted.stderr == f"warning: column 'price': {thousands} of 20 values are not " \
        f"numbers (such as '{next(f'{float(b):,.2f}' for _, b in rows if float(b) >= 1000)}'), read as missing: the " \
        "training mean; write them plain (1234.5: a decimal point, no thousands separator, percent or currency sign)\n"


def test_a_spreadsheet_s_empty_trailing_columns_are_left_out_with_a_note(run_inprocess, tmp_path):
    """Columns without a name or a value (a spreadsheet's, at the end of each row) were "the header names a column
    twice (a, b, label, , )", or one of them a feature of nothing but empty cells; a first column without a name but
    with values (pandas' row index) is still left out as such, with its own note."""
    rows = "".join(f"{i},{i % 7},{'xy'[i % 2]},,\n" for i in range(100))
    (tmp_path / "t.csv").write_text("a,b,label,,\n" + rows)
    result = run_inprocess(RECIPE, "--csv", tmp_path / "t.csv", "--target", "label", "--max-steps", 1, "--run-dir",
                           tmp_path / "run")
    assert result.code == 0 and result.stderr == "note: 2 column(s) without a name or a value left out\n"
    assert "| 2 numeric (" in result.stdout
    (tmp_path / "i.csv").write_text(",a,b,label,\n" + "".join(f"{i},{row}" for i, row in enumerate(rows.splitlines(
        keepends=True))).replace(",,\n", ",\n"))
    indexed = run_inprocess(RECIPE, "--csv", tmp_path / "i.csv", "--target", "label", "--max-steps", 1, "--run-dir",
                            tmp_path / "indexed")
    assert indexed.code == 0 and indexed.stderr == "note: 1 column(s) without a name or a value left out\nnote: the " \
        "first column, '', left out: a row index, as pandas writes it without a name\n", indexed.stderr
    assert "| 2 numeric (" in indexed.stdout


def test_task_auto_detection():
    rows = [[str(i), str(i % 3)] for i in range(30)]
    assert tabular.fit_features(text_table(["x", "y"], rows), "y", "auto")["task"] == "classification"
    rows = [[str(i), f"{i * 0.37:.2f}"] for i in range(30)]
    assert tabular.fit_features(text_table(["x", "y"], rows), "y", "auto")["task"] == "regression"


def test_a_numeric_class_is_one_class_however_it_is_spelled():
    """"1", "1.0" and "1e0" (a file pandas wrote with a missing label, say) were three classes of a 0/1 target."""
    rows = [[str(i), ["0", "1", "1.0", "1e0", "0.0", ""][i % 6]] for i in range(60)]
    spec = tabular.fit_features(text_table(["x", "y"], rows), "y", "auto")
    assert spec["classes"] == ["0", "1"]
    target = tabular.encode(spec, text_table(["x", "y"], rows))[2]
    assert target.tolist() == [[0, 1, 1, 1, 0, -1][i % 6] for i in range(60)]  # -1: missing
    older_run = {**spec, "classes": ["0.0", "1.0"]}  # as runs before the one spelling recorded them: resumable
    assert tabular.encode(older_run, text_table(["x", "y"], rows))[2].tolist() == target.tolist()
    with pytest.raises(tabular.cli.RecipeError, match=r"classes \['0', '1', '1.0'\] name one class twice"):
        tabular.encode({**spec, "classes": ["0", "1", "1.0"]}, text_table(["x", "y"], rows))  # such a run's model
    with pytest.raises(tabular.cli.RecipeError, match="holds 1 distinct value"):
        tabular.target_task(text_table(["y"], [["2.0"], ["2"]])["y"], "y", "auto")
    assert tabular.class_names(pa.array([0.5, 2.0, None]))[1].to_pylist() == ["0.5", "2", None]  # Parquet floats


def test_classes_keep_their_spelling_and_long_integer_codes_stay_apart():
    """Codes "007" and "012" came back as predictions "7" and "12"; two 17-digit codes (past float64's 2**53)
    were read as one number each, so predictions named codes that were never in the file."""
    codes = ["007", "012", "007", "7.0"]  # "7.0" is the class "007" spells most often
    spec = tabular.fit_features(text_table(["x", "y"], [[str(i), codes[i % 4]] for i in range(40)]), "y",
                                "classification")
    assert spec["classes"] == ["012", "007"]  # in the order of their one spelling: "12" < "7", as before
    assert tabular.encode(spec, text_table(["x", "y"], [["1", "7"], ["2", "12"], ["3", "007"]]))[2].tolist() == [
        1, 0, 1]
    long = ["10000000000000001", "10000000000000003"]
    spec = tabular.fit_features(text_table(["x", "y"], [[str(i), long[i % 2]] for i in range(40)]), "y",
                                "classification")
    assert spec["classes"] == long
    assert tabular.class_names(pa.array(["+5", " 5", "5.0", "5e0", "-0"]))[1].to_pylist() == ["5", "5", "5", "5", "0"]


@pytest.mark.parametrize("num_embedding", ["none", "periodic"])
def test_parameter_groups_exempt_biases_norms_and_embeddings(num_embedding):
    """The periodic embedding's per-feature layer has a bias that is a matrix (one bias per feature): still a bias."""
    rows = [[str(i * 0.5), str(i % 7), "abc"[i % 3], str(i % 2)] for i in range(60)]
    spec = tabular.fit_features(text_table(["x", "z", "c", "y"], rows), "y", "auto")
    model = tabular.build_model(spec, 8, 2, 0.0, num_embedding)
    decay, no_decay = tabular.parameter_groups(model, 0.1)
    decayed = {id(p) for p in decay["params"]}
    for name, p in model.named_parameters():
        is_matrix = name.endswith("weight") and "embeddings" not in name and p.ndim >= 2
        assert (id(p) in decayed) == is_matrix, name
    assert len(decayed) == (4 if num_embedding == "periodic" else 3)  # numeric.1.weight; body 0 and 4; head
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1


def test_smoke_and_run_directory(run_inprocess, table_csv, tmp_path):
    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", *RAW, "--epochs", 3, "--batch-size", 32,
                           "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    assert result.done_line.startswith("done: ") and "val_acc=" in result.done_line
    metrics = read_metrics(run_dir)
    assert {"recipe", "steps", "train_loss", "val_loss", "val_acc", "samples_per_s", "wall_s"} <= metrics.keys()
    assert metrics["steps"] == 3 * (240 // 32)
    assert metrics["val_acc"] > 0.7  # the label is learnable from age and colour
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    matrices = [k for k, v in state["model"].items() if v.dim() >= 2 and "embedding" not in k]
    groups = state["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]  # no decay on biases, norms and embeddings
    assert len(groups[0]["params"]) == len(matrices) and len(groups[1]["params"]) == len(state["model"]) - len(matrices)
    scalars = read_scalars(run_dir)
    assert {"train/loss", "train/lr", "val/loss", "val/acc", "perf/samples_per_s"} <= scalars.keys()
    assert all(math.isfinite(v) for _, v in scalars["train/loss"])
    state = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert state["features"]["categorical"]["colour"][2:] == ["black", "blue", "green", "red"]
    assert set(state["features"]["numeric"]) == {"age", "income"}


def test_a_replay_with_another_optimizer_takes_that_optimizers_default_lr(run_inprocess, table_csv, tmp_path):
    """--lr left out is the optimizer's default: config.json records it as lr_used, so a --config replay with
    another --optimizer took the first optimizer's rate (adamw's 3e-3 for sgd) and trained another run."""
    common = ["--csv", table_csv, "--target", "label", "--max-steps", 2, "--batch-size", 32]
    assert run_inprocess(RECIPE, *common, "--run-dir", tmp_path / "adamw").code == 0
    replay = run_inprocess(RECIPE, "--config", tmp_path / "adamw" / "config.json", "--optimizer", "sgd",
                           "--run-dir", tmp_path / "sgd")
    assert replay.code == 0, replay.stderr
    rates = [g["lr"] for g in torch.load(tmp_path / "sgd" / "checkpoints" / "last.pt",
                                         weights_only=True)["optimizer"]["param_groups"]]
    assert rates == [0.05, 0.05]
    config = json.loads((tmp_path / "sgd" / "config.json").read_text())
    assert (config["lr"], config["lr_used"]) == (None, 0.05)
    given = run_inprocess(RECIPE, "--config", tmp_path / "adamw" / "config.json", "--lr", 0.02, "--run-dir",
                          tmp_path / "given")
    assert given.code == 0 and json.loads((tmp_path / "given" / "config.json").read_text())["lr_used"] == 0.02


def test_a_resume_compares_the_rate_used_also_with_a_run_that_recorded_it_as_lr(run_inprocess, table_csv, tmp_path):
    """Runs before lr_used recorded a default --lr resolved, as "lr": 0.003; compared with "lr": null, their resume
    was refused for a --lr nobody gave. What must match is the rate."""
    common = ["--csv", table_csv, "--target", "label", "--epochs", 2, "--batch-size", 32, "--run-dir", tmp_path / "r",
              "--resume", "auto"]
    assert run_inprocess(RECIPE, *common, "--max-steps", 3).code == 0
    last = tmp_path / "r" / "checkpoints" / "last.pt"
    state = torch.load(last, weights_only=True)
    del state["config"]["lr_used"]
    state["config"]["lr"] = 3e-3  # as the older recipe wrote it
    torch.save(state, last)
    other = run_inprocess(RECIPE, *common, "--lr", 0.01)
    assert (other.code, other.stderr) == (1, f"error: checkpoint {last} was started with other options (--lr 0.003 "
                                             "there, 0.01 here): resume with the options it was started with, or "
                                             "start afresh in another --run-dir\n")
    resumed = run_inprocess(RECIPE, *common)
    assert resumed.code == 0, resumed.stderr
    assert read_metrics(tmp_path / "r")["steps"] == 14


@pytest.mark.parametrize(("epochs", "expected"), [
    (4, [0.01] * 8 + [0.001] * 4 + [0.0001] * 4),  # drops at epochs 2 and 3, 4 steps per epoch
    (2, [0.01] * 4 + [0.001] * 4),  # 50% and 75% of 2 epochs are both epoch 1: one drop, not two at once
    (1, [0.01] * 4),  # and of 1 epoch, epoch 0: no drop before the first step
])
def test_per_epoch_schedule_steps_once_per_epoch(run_inprocess, table_csv, tmp_path, epochs, expected):
    result = run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--epochs", epochs, "--batch-size", 60,
                           "--lr", 0.01, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    lrs = [round(lr, 8) for _, lr in read_scalars(tmp_path / "run")["train/lr"]]
    assert lrs == expected


def test_a_csv_saved_with_a_byte_order_mark_keeps_its_first_column_name(run_inprocess, table_csv, tmp_path):
    bom_csv = tmp_path / "excel.csv"
    bom_csv.write_bytes(b"\xef\xbb\xbf" + table_csv.read_bytes())  # as Excel saves "CSV UTF-8"
    result = run_inprocess(RECIPE, "--csv", bom_csv, "--target", "label", "--epochs", 1, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert set(state["features"]["numeric"]) == {"age", "income"}


def test_a_bf16_regression_is_scored_in_fp32_and_a_classification_in_its_precision(run_inprocess, tmp_path,
                                                                                     monkeypatch):
    """bf16 rounded a regression's outputs (3 significant digits): its val_rmse, best.pt and --cv scores were up to
    twice the error --predict (fp32) makes with the same weights."""
    evaluated, evaluate = [], tabular.evaluate

    def spied(*args, precision, accuracy, **kwargs):
        evaluated.append((precision, accuracy))
        return evaluate(*args, precision=precision, accuracy=accuracy, **kwargs)

    monkeypatch.setattr(tabular, "evaluate", spied)
    path = tmp_path / "reg.csv"
    path.write_text("x,y\n" + "".join(f"{i % 10},{(i % 10) * 1000 + 5000}\n" for i in range(200)))
    for target, task in (("y", "regression"), ("x", "classification")):
        evaluated.clear()
        result = run_inprocess(RECIPE, "--csv", path, "--target", target, "--task", task, "--epochs", 1,
                               "--precision", "bf16", "--run-dir", tmp_path / task)
        assert result.code == 0, result.stderr
        assert evaluated and set(evaluated) == {("fp32", False) if task == "regression" else ("bf16", True)}


def test_regression_reports_rmse(run_inprocess, tmp_path):
    path = tmp_path / "reg.csv"
    rows = ["x,z,colour,y"] + [f"{i % 10},{i % 7},{'ab'[i % 2]},{(i % 10) * 2.5 + (i % 2) + 0.1:.2f}"
                               for i in range(200)]
    path.write_text("\n".join(rows) + "\n")
    result = run_inprocess(RECIPE, "--csv", path, "--target", "y", "--epochs", 3, "--batch-size", 32,
                           "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    metrics = read_metrics(tmp_path / "run")
    assert "val_acc" not in metrics and metrics["val_rmse"] < 8.0  # y spans 0..23.6 (std about 7.2)


def test_max_grad_norm_zero_is_off_as_in_the_transformer(run_inprocess, table_csv, tmp_path):
    """--max-grad-norm took "> 0 (inf: no clipping)" here and "0: off" in tiny_transformer: one option, two rules."""
    common = ["--csv", table_csv, "--target", "label", "--epochs", 1, "--batch-size", 32, "--lr", 0.05]
    for norm in (0, "inf", 1e-3):
        assert run_inprocess(RECIPE, *common, "--max-grad-norm", norm, "--run-dir", tmp_path / str(norm)).code == 0
    weights = {norm: load_weights(tmp_path / str(norm) / "checkpoints" / "last.pt") for norm in ("0", "inf", "0.001")}
    assert_same_weights(weights["0"], weights["inf"])
    assert any(not torch.equal(a, b) for a, b in zip(weights["0"].values(), weights["0.001"].values(), strict=True))
    refused = run_inprocess(RECIPE, *common, "--max-grad-norm", -1, "--run-dir", tmp_path / "neg")
    assert refused.code == 2 and "--max-grad-norm" in refused.stderr and not (tmp_path / "neg").exists()


def test_resumed_run_ends_with_the_same_weights(run_inprocess, table_csv, tmp_path):
    common = ["--csv", table_csv, "--target", "label", "--epochs", 3, "--batch-size", 32]
    assert run_inprocess(RECIPE, *common, "--run-dir", tmp_path / "full").code == 0
    assert run_inprocess(RECIPE, *common, "--max-steps", 10, "--run-dir", tmp_path / "cut").code == 0
    assert run_inprocess(RECIPE, *common, "--resume", "auto", "--run-dir", tmp_path / "cut").code == 0
    assert_same_weights(load_weights(tmp_path / "full" / "checkpoints" / "last.pt"),
                        load_weights(tmp_path / "cut" / "checkpoints" / "last.pt"))
    assert read_metrics(tmp_path / "cut")["train_loss"] == read_metrics(tmp_path / "full")["train_loss"]


def test_predict_writes_one_prediction_per_row_with_unseen_categories(run_inprocess, table_csv, tmp_path):
    run_dir = tmp_path / "run"
    assert run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", *RAW, "--epochs", 2, "--run-dir", run_dir,
                         "--batch-size", 32).code == 0
    new = write_table(tmp_path / "new.csv", n=25, seed=9, target=False)
    new.write_text(new.read_text().replace("red", "purple"))  # a colour never seen in training
    result = run_inprocess(RECIPE, "--predict", new, "--resume", run_dir / "checkpoints" / "best.pt")
    assert result.code == 0, result.stderr
    with open(tmp_path / "new.predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 25
    assert {row["prediction"] for row in rows} <= {"yes", "no"}
    assert all(0.5 <= float(row["probability"]) <= 1 for row in rows)
    assert "purple" in {row["colour"] for row in rows}
    # named .parquet, the output is Parquet (it was CSV whatever the name), with the same predictions
    assert run_inprocess(RECIPE, "--predict", new, "--resume", run_dir / "checkpoints" / "best.pt", "--output",
                         tmp_path / "new.parquet").code == 0
    assert pq.read_table(tmp_path / "new.parquet").column("prediction").to_pylist() == [r["prediction"] for r in rows]
    # --output naming the table itself would replace the user's rows: refused, the table as it was
    before = new.read_bytes()
    same = run_inprocess(RECIPE, "--predict", new, "--resume", run_dir / "checkpoints" / "best.pt", "--output",
                         tmp_path / "." / "new.csv")
    assert same.code == 2 and "--output" in same.stderr and "is the table to predict" in same.stderr
    assert new.read_bytes() == before
    # a write that fails is one line, and leaves no temporary file (the output is written whole, then renamed)
    (tmp_path / "taken").mkdir()
    failed = run_inprocess(RECIPE, "--predict", new, "--resume", run_dir / "checkpoints" / "best.pt", "--output",
                           tmp_path / "taken")
    assert failed.code == 1 and failed.stderr == f"error: --output {tmp_path / 'taken'} is a directory; give the " \
        "path of the file to write\n"
    assert not list(tmp_path.glob(".*.tmp")) and not list((tmp_path / "taken").iterdir())

    # on new rows whose labels we know (hidden from --predict), the predictions are the trained model's
    with open(write_table(tmp_path / "labelled.csv", n=200, seed=9), newline="") as f:
        labelled = list(csv.DictReader(f))
    hidden = tmp_path / "hidden.csv"
    with open(hidden, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[k for k in labelled[0] if k != "label"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(labelled)
    assert run_inprocess(RECIPE, "--predict", hidden, "--resume", run_dir / "checkpoints" / "best.pt").code == 0
    with open(tmp_path / "hidden.predictions.csv", newline="") as f:
        predictions = [row["prediction"] for row in csv.DictReader(f)]
    accuracy = sum(p == row["label"] for p, row in zip(predictions, labelled, strict=True)) / len(labelled)
    assert accuracy > 0.7  # an untrained model is right about half the time


def test_adult_files_with_their_quirks(tmp_path, monkeypatch):
    adult = tmp_path / "adult"
    adult.mkdir()
    line = ("39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, "
            "2174, 0, 40, {}, {}")
    (adult / "adult.data").write_text("\n".join(line.format("?", "<=50K") for _ in range(4)) + "\n\n")
    (adult / "adult.test").write_text("|1x3 Cross validator\n" + line.format("Cuba", ">50K.") + "\n")
    files = {name: (hashlib.md5((adult / name).read_bytes()).hexdigest(), rows)
             for name, rows in [("adult.data", 4), ("adult.test", 1)]}
    monkeypatch.setattr(tabular, "ADULT_FILES", files)
    train, test = tabular.load_adult(tmp_path)
    assert train.column_names[-1] == "income" and train.num_rows == 4 and test.num_rows == 1
    first = train.slice(0, 1).to_pylist()[0]
    assert first["workclass"] == "State-gov" and first["native-country"] == "?" and first["income"] == "<=50K"
    assert test.to_pylist()[0]["native-country"] == "Cuba" and test.to_pylist()[0]["income"] == ">50K"  # no dot


def test_adult_offline_suggests_csv(run_inprocess, tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    result = run_inprocess(RECIPE, "--data-dir", tmp_path / "data", "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr.count("\n") == 1
    assert f"place the file at {tmp_path / 'data' / 'adult' / 'adult.data'} (both adult.data and adult.test go in " \
        "that folder)" in result.stderr  # a user who placed adult.data alone met a second error for adult.test
    assert "--csv FILE --target COLUMN" in result.stderr
    assert not (tmp_path / "data").exists()  # the folder made for the download is gone with it


def test_a_data_folder_that_is_a_file_is_said_so(run_inprocess, tmp_path):
    """It said "error: File exists: .../adult (the checkpoints written are intact)"."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "adult").write_text("")
    result = run_inprocess(RECIPE, "--data-dir", tmp_path / "data", "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr.startswith(
        f"error: cannot download to {tmp_path / 'data' / 'adult'}: {tmp_path / 'data' / 'adult'} is a file, not a "
        "folder"), result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.csv", None, "bad.csv: no such file"),
        ("bad.csv", "", "is empty"),
        ("bad.csv", "a,b,label\n", "has a header but no data rows"),
        ("bad.csv", "a,b,c\n1,2,3\n4,5,6\n", "target column 'label' is not in the table (columns: a, b, c)"),
        ("bad.csv", "a,b,label\n1,2,x\n1,2\n", "is not a readable table file: CSV parse error: Expected 3 columns"),
        # a row's terminal escape, quoted in the error, reached the terminal (it can set the title, or worse)
        ("bad.csv", "a,label\n1,x\n2,y,\x1b]0;title\x07\n", "Expected 2 columns, got 3: 2,y,\\x1b]0;title\\x07"),
        ("bad.csv", "a\x1b[2J,b\x9b2J,c\n1,2,3\n", "(columns: a\\x1b[2J, b\\x9b2J, c)"),  # a header's too
        ("bad.csv", "a,a,label\n1,2,x\n", "the header names a column twice"),
        ("bad.csv", b"a,label\ncaf\xe9,x\n", "is not UTF-8 text"),
        ("bad.csv.gz", "a,label\n1,x\n", "is not a readable table file"),  # not gzip inside
        ("bad.parquet", "a,label\n1,x\n", "is not a readable table file"),
        ("bad.xlsx", "a,label\n1,x\n", "not a table file by its name; give a .csv, .tsv"),
        ("a-folder.csv", "dir", "a-folder.csv is a directory, not a table file"),
        ("tabs.csv", "a\tb\tlabel\n1\t2\tx\n", "(columns: a b label): is it tab-separated? name a "
                                                "tab-separated file .tsv"),
        ("semicolons.csv", "a;b;label\n1;2;x\n", "is it semicolon-separated? only .tsv files are read with another "
                                                  "delimiter than ','"),
        # with decimal commas as well (a spreadsheet's where the comma is the decimal mark): the parse fails first
        ("european.csv", "a;b;label\n0,5;1,25;x\n", "CSV parse error: Expected 1 columns, got 3: 0,5;1,25;x (is it "
         "semicolon-separated, as spreadsheets whose decimal mark is the comma save it? only .tsv files are read with "
         "another delimiter than ',')"),
        ("tabbed.csv", "name\tb\tlabel\nSmith, J\t2\tx\n", "Expected 1 columns, got 2: Smith, J 2 x (is it "
         "tab-separated? name a tab-separated file .tsv)"),
        ("excel.csv", "sep=,\na,b,label\n1,2,x\n", "excel.csv: its first line, 'sep=,', names Excel's delimiter: "
         "delete it"),  # was "CSV parse error: Expected 2 columns, got 3"
        ("only-label.csv", "label\nx\ny\nx\ny\n", "only-label.csv has no feature columns besides the target "
                                                    "'label': add the columns to predict it from"),
        ("lists.parquet", pa.table({"a": [1.0, 2.0] * 20, "tags": [[1, 2], []] * 20, "label": ["x", "y"] * 20}),
         "lists.parquet: column 'tags' (list<element: int64>) holds lists or records, not one number or word per cell"),
        # were tracebacks: bytes that are no text, and a target that is an ID (it said "diverged ... lower --lr")
        ("bytes.parquet", pa.table({"a": pa.array([b"caf\xe9", b"x"] * 20, pa.binary()), "label": ["x", "y"] * 20}),
         "bytes.parquet: column 'a' holds bytes that are not UTF-8 text"),
        # were tracebacks: a header in Latin-1, and UTF-16 (read as one garbled column it said "not readable")
        ("latin1.csv", b"caf\xe9,label\n" + b"".join(b"%d,%s\n" % (i, b"xy"[i % 2:][:1]) for i in range(40)),
         "latin1.csv is not UTF-8 text; re-save it as UTF-8"),
        ("utf16.csv", "a,label\n1,x\n2,y\n".encode("utf-16"), "utf16.csv is UTF-16 text; re-save it as UTF-8"),
        ("utf16.csv.gz", gzip.compress("a,label\n1,x\n2,y\n".encode("utf-16")),
         "utf16.csv.gz is UTF-16 text; re-save it as UTF-8"),  # was "not a readable table file: CSV parse error"
        # a download cut short in its first bytes: EOFError, which click took for Ctrl-D (exit 130, no message)
        ("cut.csv.gz", gzip.compress(b"a,label\n" + b"1,x\n2,y\n" * 500)[:12],
         "cut.csv.gz is not a readable table file: Compressed file ended before the end-of-stream marker"),
        ("uuids.parquet", pa.table({"a": pa.array([bytes([i, 255] * 8) for i in range(40)], pa.binary(16)),
                                    "label": ["x", "y"] * 20}),
         "uuids.parquet: column 'a' holds bytes that are not UTF-8 text"),
        ("prediction.csv", "prediction,label\n" + "".join(f"{i},{'xy'[i % 2]}\n" for i in range(40)),
         "feature column 'prediction' is named like a column that --predict adds, so no table could be predicted "
         "on: rename it"),
        ("ids.csv", "a,label\n" + "".join(f"{i % 7},id{i}\n" for i in range(100)),
         "no validation row's 'label' is a class seen in training (80 classes): an ID column? choose another --target"),
    ],
)
def test_bad_csv_is_a_one_line_error(run_inprocess, tmp_path, name, content, message):
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, pa.Table):
        pq.write_table(content, path)
    elif content is not None:
        path.write_text(content)
    result = run_inprocess(RECIPE, "--csv", path, "--target", "label", "--run-dir", tmp_path / "run")
    assert result.code == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert message in result.stderr


def test_a_table_named_in_another_encoding_is_one_line(table_csv, tmp_path):
    """A separate process: its stderr writes the name's byte escaped, as a terminal's would (pytest's is strict)."""
    import os

    from conftest import run_subprocess

    path = tmp_path / os.fsdecode(b"caf\xe9.csv")  # Latin-1's e acute: a lone surrogate, which pyarrow refused
    path.write_bytes(table_csv.read_bytes())
    result = run_subprocess(["recipes/tabular_mlp.py", "--csv", path, "--target", "label", "--max-steps", 1,
                             "--run-dir", tmp_path / "r"])
    assert (result.code, result.stderr) == (1, f"error: {tmp_path}/caf\\udce9.csv: its name is not UTF-8, which "
                                               "pyarrow needs; rename the file\n")
    assert not (tmp_path / "r").exists()


def test_unknown_task_is_a_usage_error(run_inprocess, table_csv, tmp_path):
    result = run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--task", "clustering")
    assert result.code == 2
    assert "--task" in result.stderr and "'classification'" in result.stderr


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw", "lbfgs"])
def test_each_optimizer_lowers_the_loss(run_inprocess, table_csv, tmp_path, optimizer):
    batch = [] if optimizer == "lbfgs" else ["--batch-size", 32]
    result = run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--optimizer", optimizer,
                           "--epochs", 4, "--dropout", 0.1, *batch, "--run-dir", tmp_path)
    assert result.code == 0, result.stderr
    losses = [loss for _, loss in read_scalars(tmp_path)["train/loss"]]
    assert len(losses) == (4 if optimizer == "lbfgs" else 4 * (240 // 32))  # LBFGS: one full batch per epoch
    assert losses[-1] < 0.8 * losses[0]


def test_lbfgs_under_auto_precision_says_why_it_runs_in_fp32(run_inprocess, table_csv, tmp_path, monkeypatch):
    """On a CPU with native bf16, auto gave lbfgs fp32 and the header called that "as given"."""
    import common.runtime as runtime

    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx512_bf16"})
    result = run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--optimizer", "lbfgs", "--precision",
                           "auto", "--max-steps", 1, "--run-dir", tmp_path)
    assert result.code == 0 and "| precision fp32 (auto: lbfgs needs fp32) |" in result.stdout, result.stdout
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["precision"], config["precision_used"], config["precision_reason"]) == (
        "auto", "fp32", "auto: lbfgs needs fp32")


@pytest.mark.parametrize(("extra", "message"), [
    (["--batch-size", "32"], "lbfgs trains on the whole table at once"),
    (["--precision", "bf16"], "lbfgs needs fp32"),
    (["--weight-decay", "100"], "Invalid value for --weight-decay: lbfgs minimises the loss as it is, with no decay; "
     "leave it out"),  # both were ignored, and recorded in config.json as if applied
    (["--max-grad-norm", "1e-6"], "Invalid value for --max-grad-norm: lbfgs takes its step from its line search, "
     "unclipped; leave it out"),
])
def test_lbfgs_is_refused_where_it_does_not_fit(run_inprocess, table_csv, extra, message):
    result = run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--optimizer", "lbfgs", *extra)
    assert result.code == 2 and message in result.stderr


@pytest.mark.parametrize(("extra", "message"), [
    (["--csv", "{table}"], "Invalid value for --target: --csv needs --target COLUMN"),
    (["--csv", "{table}", "--target", ""], "Invalid value for --target: is empty: give a column name"),  # "needs"
    (["--target", " "], "Invalid value for --target: is empty: give a column name"),  # was Adult's "income"
])
def test_a_missing_or_empty_target_is_a_usage_error_saying_which(extra, message, run_inprocess, table_csv, tmp_path):
    result = run_inprocess(RECIPE, *[str(table_csv) if arg == "{table}" else arg for arg in extra],
                           "--run-dir", tmp_path / "run")
    assert result.code == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("missing", ["config", "features"])
def test_predict_with_a_checkpoint_lacking_its_config_or_features_is_a_one_line_error(missing, run_inprocess,
                                                                                      table_csv, tmp_path):
    path = tmp_path / "t.pt"
    checkpoint = {"recipe": RECIPE, "model": {}, "step": 0, "config": {}, "features": {}}
    torch.save({key: value for key, value in checkpoint.items() if key != missing}, path)
    result = run_inprocess(RECIPE, "--predict", table_csv, "--resume", path)
    assert (result.code, result.stderr) == (1, f"error: checkpoint {path} lacks '{missing}' in its options or "
                                               "features: another version of this recipe wrote it\n")


def test_predict_output_names_types_and_failures(run_inprocess, table_csv, tmp_path, monkeypatch):
    run_dir, new = tmp_path / "run", write_table(tmp_path / "new.csv", n=20, seed=9, target=False)
    assert run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--epochs", 1, "--run-dir", run_dir).code == 0
    best = run_dir / "checkpoints" / "best.pt"
    # a name that is no table file: refused (it was written as CSV whatever it was called)
    for name in ("out.xlsx", "out.json", "out.parquet.gz"):
        result = run_inprocess(RECIPE, "--predict", new, "--resume", best, "--output", tmp_path / name)
        assert result.code == 2 and "Invalid value for --output" in result.stderr and \
            ".csv, .tsv, .csv.gz, .tsv.gz or .parquet file" in result.stderr
        assert not (tmp_path / name).exists()
    # CSV to Parquet: every cell as the file spells it (a guessed type would drop "007"'s zeros), and the predictions
    assert run_inprocess(RECIPE, "--predict", new, "--resume", best, "--output", tmp_path / "o.parquet").code == 0
    written = pq.read_table(tmp_path / "o.parquet")
    with open(new, newline="") as f:
        rows = list(csv.DictReader(f))
    assert written.column_names == [*rows[0], "prediction", "probability"]
    assert all(written[name].cast(pa.string()).to_pylist() == [row[name] for row in rows] for name in rows[0])
    # a write that fails: one line naming the output, not its temporary file; nothing left behind
    result = run_inprocess(RECIPE, "--predict", new, "--resume", best, "--output", new / "x.csv")
    assert (result.code, result.stderr) == (1, f"error: cannot write {new / 'x.csv'}: Not a directory\n")

    def interrupted(*args, **kwargs):  # SIGTERM (SystemExit 143) in the middle of the write
        raise SystemExit(143)

    monkeypatch.setattr(tabular.pacsv, "write_csv", interrupted)
    result = run_inprocess(RECIPE, "--predict", new, "--resume", best, "--output", tmp_path / "late.csv")
    assert result.code == 143 and not list(tmp_path.glob(".late.csv*")) and not (tmp_path / "late.csv").exists()


def test_a_regression_model_predicts_a_table_that_has_a_probability_column(run_inprocess, tmp_path):
    """Only a classifier's output adds "probability": a regression model refused such a table."""
    rows = "".join(f"{i},{i % 3},{2 * i + 1}\n" for i in range(60))
    (tmp_path / "t.csv").write_text("x,probability,y\n" + rows)
    assert run_inprocess(RECIPE, "--csv", tmp_path / "t.csv", "--target", "y", "--epochs", 1, "--run-dir",
                         tmp_path / "run").code == 0
    result = run_inprocess(RECIPE, "--predict", tmp_path / "t.csv", "--resume", tmp_path / "run" / "checkpoints" /
                           "best.pt", "--output", tmp_path / "p.csv")
    assert result.code == 0, result.stderr
    with open(tmp_path / "p.csv", newline="") as f:
        assert list(next(csv.reader(f))) == ["x", "probability", "y", "prediction"]


def test_predict_keeps_a_users_file_named_as_the_old_temporary_file(run_inprocess, table_csv, tmp_path):
    """The predictions were written to .OUT.tmp, then renamed: a user's file of that name was replaced, then gone."""
    run_dir = tmp_path / "run"
    assert run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--epochs", 1, "--run-dir", run_dir).code == 0
    new, notes = write_table(tmp_path / "new.csv", n=5, seed=9, target=False), tmp_path / ".new.predictions.csv.tmp"
    notes.write_text("my notes")
    result = run_inprocess(RECIPE, "--predict", new, "--resume", run_dir / "checkpoints" / "last.pt")
    assert result.code == 0, result.stderr
    assert len((tmp_path / "new.predictions.csv").read_text().splitlines()) == 6  # the header and 5 rows
    assert notes.read_text() == "my notes" and sorted(tmp_path.glob(".*")) == [notes]  # nor a temporary file left
    long_name = tmp_path / ("数" * 80 + ".csv")  # 244 bytes, a valid name: the temporary one must fit too
    result = run_inprocess(RECIPE, "--predict", new, "--resume", run_dir / "checkpoints" / "last.pt", "--output",
                           long_name)
    assert result.code == 0 and len(long_name.read_text().splitlines()) == 6, result.stderr


def test_predict_on_a_directory_is_a_one_line_error(run_inprocess, table_csv, tmp_path):
    run_dir = tmp_path / "run"
    assert run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--epochs", 1, "--run-dir", run_dir).code == 0
    result = run_inprocess(RECIPE, "--predict", tmp_path, "--resume", run_dir / "checkpoints" / "last.pt")
    assert result.code == 1 and result.stderr == f"error: {tmp_path} is a directory, not a table file\n"
    result = run_inprocess(RECIPE, "--predict", ".", "--resume", run_dir / "checkpoints" / "last.pt")
    assert result.code == 1 and result.stderr == "error: . is a directory, not a table file\n"  # (an empty one: exit 2)
    new = write_table(tmp_path / "new.csv", n=5, seed=9, target=False)
    for output in (".", tmp_path):  # before predicting: not once the predictions are made
        result = run_inprocess(RECIPE, "--predict", new, "--resume", run_dir / "checkpoints" / "last.pt", "--output",
                               output)
        assert result.code == 1 and result.stderr == f"error: --output {Path(output)} is a directory; give the path " \
            "of the file to write\n"


def test_predict_never_replaces_an_existing_file_without_overwrite(run_inprocess, table_csv, tmp_path):
    run_dir = tmp_path / "run"
    assert run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--max-steps", 1, "--run-dir",
                         run_dir).code == 0
    checkpoint = run_dir / "checkpoints" / "last.pt"
    new = write_table(tmp_path / "new.csv", n=5, seed=9, target=False)
    kept = tmp_path / "train.csv"  # a user's file: a training table
    kept.write_bytes(table_csv.read_bytes())
    (tmp_path / "new.predictions.csv").write_text("my notes\n")  # the default --output, there already
    files = {path: path.read_bytes() for path in (checkpoint, kept, tmp_path / "new.predictions.csv")}
    for output in (kept, tmp_path / "new.predictions.csv"):
        refused = run_inprocess(RECIPE, "--predict", new, "--resume", checkpoint,
                                *(["--output", output] if output == kept else []))
        assert refused.code == 1
        assert refused.stderr == f"error: {output} exists; choose another --output, or add --overwrite to replace it\n"
    # the checkpoint predicting is never the output, --overwrite or not
    for extra in ([], ["--overwrite"]):
        itself = run_inprocess(RECIPE, "--predict", new, "--resume", checkpoint, "--output",
                               run_dir / "checkpoints" / ".." / "checkpoints" / "last.pt", *extra)
        assert itself.code == 2 and "--output" in itself.stderr and "is the checkpoint to predict with" in itself.stderr
    assert {path: path.read_bytes() for path in files} == files
    assert not list(tmp_path.glob(".*.tmp"))
    # --overwrite: the file replaced by the predictions
    replaced = run_inprocess(RECIPE, "--predict", new, "--resume", checkpoint, "--output", kept, "--overwrite")
    assert replaced.code == 0, replaced.stderr
    with open(kept, newline="") as f:
        assert len(list(csv.DictReader(f))) == 5
    # training options do nothing to a prediction (the checkpoint holds the model, its columns and target)
    ignored = run_inprocess(RECIPE, "--predict", new, "--resume", checkpoint, "--csv", table_csv, "--target", "label",
                            "--compile", "--run-dir", tmp_path / "x")
    assert ignored.code == 2 and ignored.stderr.endswith(
        "Invalid value for --predict: predicts with the checkpoint's model, columns and options, on --device: not "
        "--csv, --target, --compile, --run-dir\n")
    assert not (tmp_path / "x").exists()
    # options of --predict alone are refused in training
    for extra in (["--output", tmp_path / "x.csv"], ["--overwrite"]):
        result = run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", *extra, "--max-steps", 1,
                               "--run-dir", tmp_path / "x")
        assert result.code == 2 and f"Invalid value for {extra[0]}: is for --predict" in result.stderr
        assert not (tmp_path / "x").exists()


def test_predict_on_a_table_without_the_models_columns_is_a_one_line_error(run_inprocess, table_csv, tmp_path):
    run_dir = tmp_path / "run"
    assert run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--max-steps", 1, "--run-dir",
                         run_dir).code == 0
    other = tmp_path / "other.csv"
    other.write_text("age,label\n30,yes\n")
    result = run_inprocess(RECIPE, "--predict", other, "--resume", run_dir / "checkpoints" / "last.pt")
    assert result.code == 1
    assert result.stderr == "error: the table lacks column(s) the model was trained on: income, colour, city\n"
    assert not (tmp_path / "other.predictions.csv").exists()
    for header, row, message in [  # a column the output would add twice; a numeric column of words (two swapped)
        ("age,income,colour,city,prediction", "30,1.5,red,paris,x",
         "already has a column 'prediction', which the output adds; rename it"),
        ("income,age,colour,city", "30,red,1.5,paris", "column 'age' holds no numbers, but it did in training"),
    ]:
        other.write_text(f"{header}\n{row}\n{row}\n")
        result = run_inprocess(RECIPE, "--predict", other, "--resume", run_dir / "checkpoints" / "last.pt")
        assert result.code == 1 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
        assert not (tmp_path / "other.predictions.csv").exists()
    # one row with a typo in a numeric column is that row's missing value, as among many rows (it was the error
    # above: a row predicted alone failed where the same row among others was predicted)
    other.write_text("age,income,colour,city\n45 yrs,1.5,red,paris\n")
    result = run_inprocess(RECIPE, "--predict", other, "--resume", run_dir / "checkpoints" / "last.pt")
    assert result.code == 0 and "predictions=1" in result.done_line, result.stderr
    alone = (tmp_path / "other.predictions.csv").read_text().splitlines()[1]
    other.write_text("age,income,colour,city\n45 yrs,1.5,red,paris\n,1.5,red,paris\n")  # its age missing outright
    assert run_inprocess(RECIPE, "--predict", other, "--resume", run_dir / "checkpoints" / "last.pt",
                         "--overwrite").code == 0
    assert (tmp_path / "other.predictions.csv").read_text().splitlines()[1:] == [alone, alone.replace("45 yrs", "")]


def test_a_parquet_id_past_2_to_the_53_trains(run_inprocess, tmp_path):
    """An int64 column of big IDs: a float64 cannot hold them exactly, which was a traceback (ArrowInvalid)."""
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"id": pa.array([2**62 + i for i in range(60)], pa.int64()), "x": [0.0, 1.0] * 30,
                             "label": ["a", "b"] * 30}), path)
    result = run_inprocess(RECIPE, "--csv", path, "--target", "label", "--max-steps", 1, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    features = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["features"]
    assert features["numeric"]["id"][0] == 2.0**62 and "x" in features["numeric"]  # kept, rounded as a float64 is


def write_as(csv_path, path):
    """The table of ``csv_path`` saved as ``path``'s type; Parquet with typed columns, as pandas or Spark write it."""
    if path.suffix == ".parquet":
        pq.write_table(pacsv.read_csv(csv_path), path)  # age int64, income float64 with nulls, text as strings
    else:
        with open(csv_path, newline="") as f:
            rows = list(csv.reader(f))
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "wt", newline="") as f:
            csv.writer(f, delimiter="\t" if ".tsv" in path.name else ",").writerows(rows)
    return path


@pytest.mark.parametrize("name", ["table.csv.gz", "table.tsv", "table.tsv.gz", "table.parquet"])
def test_every_file_type_trains_and_predicts_alike(run_inprocess, table_csv, tmp_path, name):
    path = write_as(table_csv, tmp_path / name)
    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--csv", path, "--target", "label", *RAW, "--epochs", 2, "--batch-size", 32,
                           "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    features = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["features"]
    reference = tabular.fit_features(tabular.read_table(table_csv).take(
        torch.randperm(300, generator=torch.Generator().manual_seed(0)).numpy()[60:]), "label", "auto")
    assert features == reference  # the same columns, statistics and vocabularies as from the CSV
    assert read_metrics(run_dir)["val_acc"] > 0.7

    new = write_table(tmp_path / "new.csv", n=40, seed=9, target=False)
    new.write_text(new.read_text().replace("red", "purple"))  # a colour never seen in training
    new = write_as(new, tmp_path / f"new{name.removeprefix('table')}")
    output = tmp_path / "out.csv"
    result = run_inprocess(RECIPE, "--predict", new, "--resume", run_dir / "checkpoints" / "last.pt",
                           "--output", output)
    assert result.code == 0, result.stderr
    with open(output, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 40 and list(rows[0]) == ["age", "income", "colour", "city", "prediction", "probability"]
    assert {row["prediction"] for row in rows} == {"yes", "no"} and "purple" in {row["colour"] for row in rows}
    assert all(0.5 <= float(row["probability"]) <= 1 for row in rows)
    # --output of the same type is written as that type (a .csv.gz was plain CSV, a .tsv comma-separated)
    same_type = tmp_path / f"out{name.removeprefix('table')}"
    assert run_inprocess(RECIPE, "--predict", new, "--resume", run_dir / "checkpoints" / "last.pt",
                         "--output", same_type).code == 0
    if name.endswith(".parquet"):
        written = [{k: str(v) for k, v in row.items()} for row in pq.read_table(same_type).to_pylist()]
        assert [row["prediction"] for row in written] == [row["prediction"] for row in rows]
    else:
        with (gzip.open if name.endswith(".gz") else open)(same_type, "rt", newline="") as f:
            written = list(csv.DictReader(f, delimiter="\t" if ".tsv" in name else ","))
        assert written == rows


def test_an_upper_case_gz_name_is_read_as_gzip(table_csv, tmp_path):
    """pyarrow tells gzip by the name's ending, case and all: TABLE.CSV.GZ was read as raw bytes ("Expected 1
    columns, got 3: ... binary")."""
    path = tmp_path / "TABLE.CSV.GZ"
    path.write_bytes(gzip.compress(table_csv.read_bytes()))
    assert tabular.read_table(path).equals(tabular.read_table(table_csv))


@pytest.mark.parametrize("embedding", ["none", "periodic"])
def test_a_huge_finite_number_is_clipped_not_a_nan(embedding, run_inprocess, table_csv, tmp_path):
    """1e39 overflowed float32 after standardising: a NaN validation loss called a divergence ("try a lower --lr"),
    and predictions of probability nan; with no embedding 1e20 did too."""
    with open(table_csv, newline="") as f:
        rows = list(csv.reader(f))
    validation_row = int(torch.randperm(300, generator=torch.Generator().manual_seed(0))[0])  # the split's first
    rows[1 + validation_row][1] = "1e39"
    path = tmp_path / "outlier.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--csv", path, "--target", "label", "--num-embedding", embedding, "--epochs", 2,
                           "--batch-size", 32, "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    assert "warning: column 'income': 1 value(s) over 10,000 standard deviations from its training mean, taken as " \
           "10,000" in result.stderr
    assert math.isfinite(read_metrics(run_dir)["val_loss"])
    new = tmp_path / "new.csv"
    new.write_text("age,income,colour,city\n30,50,red,Oslo\n1e39,3e38,red,Oslo\n1e20,-1e20,blue,Lima\n")
    result = run_inprocess(RECIPE, "--predict", new, "--resume", run_dir / "checkpoints" / "last.pt")
    assert result.code == 0, result.stderr
    with open(tmp_path / "new.predictions.csv", newline="") as f:
        assert all(0.5 <= float(row["probability"]) <= 1 for row in csv.DictReader(f))  # were nan


def test_a_pandas_csv_with_nan_and_inf_cells_trains_and_predicts_finite_values(run_inprocess, tmp_path):
    with open(write_table(tmp_path / "t.csv", n=300), newline="") as f:
        rows = list(csv.DictReader(f))
    spellings = ["NaN", "NAN", "nan", "-nan", "inf", "-inf", "null", "None"]
    for i, row in enumerate(rows):
        if i % 5 == 0:  # as pandas writes a missing float (na_rep="NaN"), and other tools other spellings
            row["income"] = spellings[i % len(spellings)]
        if i % 7 == 0:
            row["city"] = spellings[i % len(spellings)].upper()
    path = tmp_path / "nan.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--csv", path, "--target", "label", *RAW, "--epochs", 3, "--batch-size", 32,
                           "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    assert read_metrics(run_dir)["val_acc"] > 0.7
    features = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)["features"]
    assert all(math.isfinite(x) for x in features["numeric"]["income"])
    assert "<missing>" in features["categorical"]["city"] and "NAN" not in features["categorical"]["city"]

    result = run_inprocess(RECIPE, "--predict", path, "--resume", run_dir / "checkpoints" / "best.pt")
    assert result.code == 0, result.stderr
    with open(tmp_path / "nan.predictions.csv", newline="") as f:
        predicted = list(csv.DictReader(f))
    assert len(predicted) == 300 and all(math.isfinite(float(row["probability"])) for row in predicted)
    assert {row["prediction"] for row in predicted} == {"yes", "no"}


def test_lbfgs_line_search_sees_one_objective_despite_dropout():
    torch.manual_seed(0)
    model = tabular.TabularMLP(3, [5], 2, hidden=32, depth=2, dropout=0.5)
    optimizer = tabular.make_optimizer("lbfgs", model, 1.0, 0.0)
    losses, step = [], optimizer.step

    def evaluating_thrice(closure):
        losses.extend(closure().item() for _ in range(3))  # the same weights: the same loss, each time
        return step(closure)

    optimizer.step = evaluating_thrice
    batch = (torch.randn(64, 3), torch.randint(0, 5, (64, 1)), torch.randint(0, 2, (64,)))
    tabular.lbfgs_step(model, optimizer, nn.CrossEntropyLoss(), [batch], device=torch.device("cpu"))
    assert losses[0] == losses[1] == losses[2]
    model.eval()
    assert nn.CrossEntropyLoss()(model(*batch[:2]), batch[2]).item() != losses[0]  # dropout was on in training


def fake_adult(folder, rows: int, seed: int) -> list[str]:
    """Lines in adult.data's form: ", " between fields, the label depending on age and hours."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(rows):
        age, hours = int(rng.integers(18, 80)), int(rng.integers(10, 70))
        label = ">50K" if age + hours > 90 else "<=50K"
        lines.append(f"{age}, Private, {int(rng.integers(10**4, 10**6))}, Bachelors, 13, Married-civ-spouse, "
                     f"Sales, Husband, White, {['Male', 'Female'][int(rng.integers(2))]}, 0, 0, {hours}, "
                     f"United-States, {label}")
    return lines


def test_adults_test_file_is_scored_with_the_weights_best_pt_holds(run_inprocess, tmp_path, monkeypatch):
    """The figure a run reports for the test set is the deployed model's (best.pt), not the last step's."""
    (tmp_path / "adult").mkdir()
    (tmp_path / "adult" / "adult.data").write_text("\n".join(fake_adult(tmp_path, 200, 0)) + "\n")
    (tmp_path / "adult" / "adult.test").write_text("|1x3 Cross validator\n" + "\n".join(
        line + "." for line in fake_adult(tmp_path, 100, 1)) + "\n")
    monkeypatch.setattr(tabular, "ADULT_FILES", {name: (hashlib.md5((tmp_path / "adult" / name).read_bytes())
                                                        .hexdigest(), rows)
                                                 for name, rows in [("adult.data", 200), ("adult.test", 100)]})
    real, scripted = tabular.evaluate, [0.9, 0.5, 0.4]  # validation accuracy of the 3 epochs: the first is the best
    monkeypatch.setattr(tabular, "evaluate", lambda *a, **k: {"loss": 1.0, "acc": scripted.pop(0)} if scripted else
                        real(*a, **k))  # then the real one, for the test set
    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--data-dir", tmp_path, "--epochs", 3, "--batch-size", 16, "--dropout", 0.1,
                           "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    metrics = read_metrics(run_dir)
    assert metrics["best_step"] == 10 and metrics["steps"] == 30  # 160 training rows at batch 16
    _, test_table = tabular.load_adult(tmp_path)
    scores = {}
    for name in ("best.pt", "last.pt"):
        state = torch.load(run_dir / "checkpoints" / name, weights_only=True)
        model = tabular.model_from_checkpoint(state, run_dir / "checkpoints" / name).eval()
        numeric, categorical, target = tabular.encode(state["features"], test_table)
        with torch.no_grad():
            logits = model(torch.from_numpy(numeric), torch.from_numpy(categorical))
        scores[name] = (logits.argmax(1).numpy() == target).mean()
    assert metrics["test_acc"] == pytest.approx(scores["best.pt"]) and scores["best.pt"] != scores["last.pt"]
    assert not torch.equal(load_weights(run_dir / "checkpoints" / "best.pt")["head.weight"],
                           load_weights(run_dir / "checkpoints" / "last.pt")["head.weight"])


def test_a_resume_names_its_csv_by_any_path_to_the_same_file(run_inprocess, tmp_path, monkeypatch):
    """--csv table.csv and its absolute path, as the first line prints it, are one file: the resume was refused as
    "started with other options (--csv table.csv there, /tmp/.../table.csv here)". Another file is refused still,
    even one of the same rows (a checksum covers the training rows alone: other validation rows would pass it)."""
    table = write_table(tmp_path / "table.csv", n=300, seed=0)
    args = ["--target", "label", *RAW, "--epochs", 1, "--batch-size", 32, "--run-dir", tmp_path / "run"]
    monkeypatch.chdir(tmp_path)
    assert run_inprocess(RECIPE, "--csv", "table.csv", *args, "--max-steps", 3).code == 0
    (tmp_path / "copy").mkdir()
    shutil.copy(table, tmp_path / "copy" / "table.csv")
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    before = last.read_bytes()
    monkeypatch.chdir(tmp_path / "copy")  # the same name typed in another folder is another file
    other = run_inprocess(RECIPE, "--csv", "table.csv", *args, "--resume", "auto")
    assert (other.code, other.stderr) == (1, f"error: checkpoint {last} was started with other options (--csv {table} "
                                          f"there, {tmp_path / 'copy' / 'table.csv'} here): resume with the options it "
                                          "was started with, or start afresh in another --run-dir\n")
    assert last.read_bytes() == before
    resumed = run_inprocess(RECIPE, "--csv", table, *args, "--resume", "auto")
    assert resumed.code == 0 and "resumed at step 3" in resumed.stdout, resumed.stderr
    assert read_metrics(tmp_path / "run")["steps"] == 7
    assert json.loads((tmp_path / "run" / "config.json").read_text())["csv_path"] == str(table)  # as it ran last


def test_a_resume_on_other_rows_of_the_same_count_is_refused(run_inprocess, tmp_path):
    """As many rows, so as many steps an epoch: only the checksum of the training data tells them apart."""
    table = write_table(tmp_path / "t.csv", n=300, seed=0)
    args = ["--csv", table, "--target", "label", *RAW, "--epochs", 2, "--batch-size", 32, "--run-dir", tmp_path / "run",
            "--resume", "auto"]
    assert run_inprocess(RECIPE, *args, "--max-steps", 3).code == 0
    original = table.read_bytes()
    write_table(table, n=300, seed=1)  # other rows in the same file
    other = run_inprocess(RECIPE, *args)
    assert other.code == 1 and len(other.stderr.strip().splitlines()) == 1
    assert other.stderr.startswith("error: checkpoint ") and "was trained on other data" in other.stderr
    table.write_bytes(original)  # the rows it started with: it goes on
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    good = last.read_bytes()
    state = torch.load(last, weights_only=True)
    torch.save(state | {"features": list(state["features"])}, last)  # damaged: was an AttributeError traceback
    damaged = run_inprocess(RECIPE, *args)
    assert damaged.code == 1 and damaged.stderr == f"error: checkpoint {last} is damaged: its features name no " \
        "columns as this recipe does\n"
    torch.save({key: value for key, value in state.items() if key != "features"}, last)  # was a KeyError traceback
    damaged = run_inprocess(RECIPE, *args)
    assert damaged.code == 1 and damaged.stderr == f"error: checkpoint {last} lacks 'features' in its options or " \
        "features: another version of this recipe wrote it\n"
    last.write_bytes(good)
    assert run_inprocess(RECIPE, *args).code == 0
    assert read_metrics(tmp_path / "run")["steps"] == 2 * 7  # 240 training rows: 7 full batches of 32 an epoch


@pytest.mark.parametrize(("edit", "message"), [
    (lambda state: [state["config"].pop(key) for key in ("lr", "lr_used")], "(--lr None there, "),  # a KeyError
    (lambda state: state.update(steps_per_epoch=0), "is damaged: its config is not a dict, or its step or epoch "
     "length not a count"),  # a KeyError without the entry; with 0: "already finished: step 3 of 0"
    (lambda state: state.update(steps_per_epoch=""), "is damaged: its config is not a dict, or its step or epoch "
     "length not a count"),
    (lambda state: state["best"].update(score="n/a"), "lacks part of the training state, or holds it in another "
     "form (ValueError: could not convert string to float: 'n/a')"),  # a TypeError at the first evaluation
])
def test_a_resume_from_a_checkpoint_of_other_settings_or_parts_is_one_line(edit, message, run_inprocess, table_csv,
                                                                          tmp_path):
    """Without --epochs: the default is worked out from the checkpoint's epoch length, before anything is checked.
    Each was a traceback."""
    args = ["--csv", table_csv, "--target", "label", *RAW, "--batch-size", 32, "--run-dir", tmp_path / "run",
            "--resume", "auto"]
    assert run_inprocess(RECIPE, *args, "--max-steps", 3).code == 0
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    state = torch.load(last, weights_only=True)
    edit(state)
    torch.save(state, last)
    saved = last.read_bytes()
    result = run_inprocess(RECIPE, *args)
    assert result.code == 1 and result.stderr.startswith("error: ") and f"{last} " in result.stderr, result.stderr
    assert message in result.stderr
    assert result.stderr.count("\n") == 1 and last.read_bytes() == saved


def test_predict_from_a_checkpoint_whose_model_cannot_be_rebuilt_is_one_line(run_inprocess, table_csv, tmp_path):
    run_dir = tmp_path / "run"
    assert run_inprocess(RECIPE, "--csv", table_csv, "--target", "label", "--max-steps", 1,
                         "--run-dir", run_dir).code == 0
    path = tmp_path / "edited.pt"
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    torch.save(state | {"config": state["config"] | {"hidden": torch.tensor(256)}}, path)  # was a TypeError traceback
    result = run_inprocess(RECIPE, "--predict", table_csv, "--resume", path, "--output", tmp_path / "out.csv")
    assert (result.code, result.stderr) == (1, f"error: checkpoint {path} is damaged: its model cannot be rebuilt "
                                               "(iteration over a 0-d tensor)\n")
    assert not (tmp_path / "out.csv").exists()


def test_a_header_over_a_megabyte_is_read(tmp_path):
    """pyarrow reads 1 MB blocks by default, and a row must fit in one: this table was called empty."""
    names = [f"feature_{i}_{'x' * 500}" for i in range(2200)]  # a 1.1 MB header
    path = tmp_path / "wide.csv"
    path.write_text(",".join([*names, "y"]) + "\n" + "\n".join(",".join(["1"] * 2200 + [str(i % 2)]) for i in range(4)))
    table = tabular.read_table(path)
    assert table.column_names == [*names, "y"] and table["y"].to_pylist() == ["0", "1", "0", "1"]


def test_new_rows_spell_classes_by_the_training_rows_rule():
    """Classes "01" and "10" were fitted as numbers; rows holding also a rare word were read as text, so every "01"
    row was a class unseen in training and silently dropped. And text classes "01" and "1" stay two classes in rows
    that happen to hold only numbers."""
    rows = [[str(i), ["01", "10"][i % 2]] for i in range(20)]
    spec = tabular.fit_features(text_table(["x", "y"], rows), "y", "classification")
    assert spec["classes"] == ["01", "10"]
    new = [["1", label] for label in ["01", "10", "x", "", "1", "10.0"]]
    assert tabular.encode(spec, text_table(["x", "y"], new))[2].tolist() == [0, 1, tabular.UNSEEN_CLASS,
                                                                            tabular.MISSING_CLASS, 0, 1]
    rows = [[str(i), ["01", "1", "a"][i % 3]] for i in range(30)]
    spec = tabular.fit_features(text_table(["x", "y"], rows), "y", "classification")
    assert spec["classes"] == ["01", "1", "a"]
    assert tabular.encode(spec, text_table(["x", "y"], [["1", "1"], ["2", "01"]]))[2].tolist() == [1, 0]


def test_val_acc_counts_rows_of_a_class_unseen_in_training_as_wrong(run_inprocess, tmp_path):
    """It left them out: 0.97 printed where the model was right on 57% of the validation rows."""
    n, seed, val_frac = 300, 0, 0.5
    labels = [f"rare{i}" if i % 10 < 3 else "ab"[i % 100 < 50] for i in range(n)]  # 30% of rows: a label of their own
    path = tmp_path / "rare.csv"
    path.write_text("x,label\n" + "".join(f"{i % 100},{label}\n" for i, label in enumerate(labels)))
    result = run_inprocess(RECIPE, "--csv", path, "--target", "label", "--val-frac", val_frac, "--seed", seed,
                           "--epochs", 20, "--run-dir", tmp_path / "run", *RAW)
    assert result.code == 0, result.stderr
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    n_val = round(val_frac * n)
    seen = {labels[i] for i in order[n_val:]}
    unseen = sum(labels[i] not in seen for i in order[:n_val])
    assert unseen > 30 and f"{unseen} validation rows hold a class unseen in training: val_acc counts them as " \
                           "wrong" in result.stdout
    val_acc = read_metrics(tmp_path / "run")["val_acc"]
    assert val_acc <= (n_val - unseen) / n_val  # those rows cannot be right
    assert abs(val_acc * n_val - round(val_acc * n_val)) < 1e-6  # a count of right rows over all n_val


def test_a_regression_target_past_1e154_trains_to_finite_metrics_and_predictions(run_inprocess, tmp_path):
    """Its standard deviation overflowed (the squares of such numbers are past float64's range): inf metrics, and
    Infinity in metrics.json. A feature of such numbers was standardised by inf to all zeros."""
    rows = "".join(f"{i % 10}e200,{i % 7},{(i % 10) * 3 + 1}e200\n" for i in range(200))
    (tmp_path / "big.csv").write_text("x,z,y\n" + rows)
    result = run_inprocess(RECIPE, "--csv", tmp_path / "big.csv", "--target", "y", "--task", "regression",
                           "--epochs", 5, "--run-dir", tmp_path / "run", *RAW)
    assert result.code == 0, result.stderr
    assert "Infinity" not in (tmp_path / "run" / "metrics.json").read_text()
    assert 0 < read_metrics(tmp_path / "run")["val_rmse"] < 5e200  # y spans 1e200 .. 28e200 (std about 8.6e200)
    spec = torch.load(tmp_path / "run" / "checkpoints" / "best.pt", weights_only=True)["features"]
    assert tabular.mean_and_std(np.array([1.7e308, 1.7e308, 1.6e308])) == pytest.approx((1.6667e308, 4.714e306),
                                                                                          rel=1e-4)  # 2**1023 on
    x = torch.randperm(200, generator=torch.Generator().manual_seed(0)).numpy()[40:] % 10  # the training rows'
    assert (spec["target_mean"], spec["target_std"]) == pytest.approx(((3 * x + 1).mean() * 1e200,
                                                                        (3 * x + 1).std() * 1e200), rel=1e-12)
    assert spec["numeric"]["x"] == pytest.approx((x.mean() * 1e200, x.std() * 1e200), rel=1e-12)


@pytest.mark.parametrize("embedding", ["none", "ple"])
def test_numbers_whose_difference_from_the_mean_is_past_float64_are_standardised(embedding, run_inprocess, tmp_path):
    """Each finite, but value - mean overflowed where they had opposite signs: a regression's loss was inf at the
    first step ("training diverged ... try a lower --lr"), a feature's values were clipped to 10,000 standard
    deviations (they are 1.4 from the mean), and --num-embedding ple's bins were NaN."""
    big = [(1 if i % 3 else -1) * (1.4 + i / 1000) * 1e308 for i in range(60)]  # mean 0.47e308, std 1.33e308
    (tmp_path / "big.csv").write_text("f,c,y\n" + "".join(f"{v!r},{'ab'[i % 3 == 0]},{v!r}\n"
                                                          for i, v in enumerate(big)))
    for target, task in (("c", "classification"), ("y", "regression")):
        run_dir = tmp_path / f"run_{target}"
        result = run_inprocess(RECIPE, "--csv", tmp_path / "big.csv", "--target", target, "--max-steps", 2,
                               "--num-embedding", embedding, "--run-dir", run_dir)
        assert result.code == 0, result.stderr
        assert "standard deviations" not in result.stderr and "overflow" not in result.stderr, result.stderr
        spec = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["features"]
        assert spec["task"] == task and all(np.isfinite(spec["bins"].get("f", [0])))
    numeric, _, target = tabular.encode(spec, pa.table({"f": [-1.5e308, 1.5e308], "c": ["a", "b"],
                                                            "y": [-1.5e308, 1.5e308]}))
    mean, std = spec["numeric"]["f"]
    assert numeric[:, 0] == pytest.approx([(-1.5e308 / std) - mean / std, 1.5e308 / std - mean / std], rel=1e-6)
    assert target == pytest.approx([-1.5e308 / std - mean / std, 1.5e308 / std - mean / std], rel=1e-6)


def test_adults_test_rows_of_a_class_unseen_in_training_count_as_wrong(run_inprocess, tmp_path, monkeypatch):
    """--target sex, and a test file with a value the training rows lack: the loss was handed a -2 target (an
    IndexError traceback). The test rows of such a class count as wrong, as in val_acc."""
    (tmp_path / "adult").mkdir()
    (tmp_path / "adult" / "adult.data").write_text("\n".join(fake_adult(tmp_path, 200, 0)) + "\n")
    test_lines = [line.replace(", Male,", ", Other,").replace(", Female,", ", Other,") if i % 10 == 0 else line
                  for i, line in enumerate(fake_adult(tmp_path, 100, 1))]
    (tmp_path / "adult" / "adult.test").write_text("|1x3 Cross validator\n" + "\n".join(test_lines) + "\n")
    monkeypatch.setattr(tabular, "ADULT_FILES", {name: (hashlib.md5((tmp_path / "adult" / name).read_bytes())
                                                        .hexdigest(), rows)
                                                 for name, rows in [("adult.data", 200), ("adult.test", 100)]})
    result = run_inprocess(RECIPE, "--data-dir", tmp_path, "--target", "sex", "--max-steps", 5, "--run-dir",
                           tmp_path / "run")
    assert result.code == 0, result.stderr
    state = torch.load(tmp_path / "run" / "checkpoints" / "best.pt", weights_only=True)
    model = tabular.model_from_checkpoint(state, tmp_path / "run" / "checkpoints" / "best.pt").eval()
    numeric, categorical, target = tabular.encode(state["features"], tabular.load_adult(tmp_path)[1])
    assert (target == tabular.UNSEEN_CLASS).sum() == 10
    with torch.no_grad():
        right = model(torch.from_numpy(numeric), torch.from_numpy(categorical)).argmax(1).numpy() == target
    assert read_metrics(tmp_path / "run")["test_acc"] == pytest.approx(right.mean())  # over all 100 rows


def test_a_regression_target_at_minus_two_is_a_number_not_an_unseen_class():
    """A standardised regression target of exactly -2.0 (two standard deviations below the mean) was taken for
    UNSEEN_CLASS and overwritten with -1."""
    target = np.array([-2.0, 0.5, -1.0], dtype=np.float32)
    assert not tabular.unseen_as_missing(target, classification=False).any()
    assert target.tolist() == [-2.0, 0.5, -1.0]
    classes = np.array([0, tabular.UNSEEN_CLASS, tabular.MISSING_CLASS, 1])
    assert tabular.unseen_as_missing(classes, classification=True).tolist() == [False, True, False, False]
    assert classes.tolist() == [0, tabular.MISSING_CLASS, tabular.MISSING_CLASS, 1]


@pytest.mark.parametrize("index_name", ["", "Unnamed: 0"])
def test_a_row_index_as_pandas_writes_it_is_left_out(run_inprocess, tmp_path, index_name):
    """df.to_csv() writes the row index as a first column without a name (read back and saved again: "Unnamed: 0").
    In a file sorted by label the row number predicts the label, and new rows' do not: it was trained on. Only
    the first column is pandas' index: a later one without a name (an empty header cell) stays a feature."""
    rows = [[str(i), f"{(i % 7) * 0.5}", "ab"[i % 2], "a" if i < 30 else "b"] for i in range(60)]
    path = tmp_path / "sorted.csv"
    path.write_text("\n".join(",".join(row) for row in [[index_name, "x", "Unnamed: 2", "label"], *rows]) + "\n")
    result = run_inprocess(RECIPE, "--csv", path, "--target", "label", "--max-steps", 1, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    assert f"note: the first column, {index_name!r}, left out: a row index, as pandas writes it" in result.stderr
    features = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["features"]
    assert list(features["numeric"]) == ["x"] and list(features["categorical"]) == ["Unnamed: 2"]


def test_a_first_column_without_a_name_that_is_the_target_is_trained_on(run_inprocess, tmp_path):
    (tmp_path / "t.csv").write_text("Unnamed: 0,x\n" + "".join(f"{'ab'[i % 2]},{i % 2}\n" for i in range(40)))
    result = run_inprocess(RECIPE, "--csv", tmp_path / "t.csv", "--target", "Unnamed: 0", "--max-steps", 1,
                           "--run-dir", tmp_path / "run")
    assert result.code == 0 and "note:" not in result.stderr, result.stderr


def test_parquet_extension_and_dictionary_columns_train_or_are_one_line(tmp_path):
    """Column types that were tracebacks: string views, UUIDs and JSON (extension types), dictionary-encoded bytes,
    and a dictionary of 128 words with int8 indices (a missing cell's index, 128, does not fit an int8)."""
    import uuid

    def table_of(column):
        path = tmp_path / "t.parquet"
        pq.write_table(pa.table({"c": column, "label": ["a", "b"] * (len(column) // 2)}), path)
        return tabular.read_table(path)

    views = table_of(pa.array(["cat", "dog", "cat", None], pa.string_view()))  # a traceback where rows were taken
    assert views["c"].type == pa.string() and views.take([1, 0])["c"].to_pylist() == ["dog", "cat"]
    words = pa.DictionaryArray.from_arrays(pa.array([*range(128), None, 0], pa.int8()),
                                           pa.array([f"w{i}" for i in range(128)]))
    spec = tabular.fit_features(table_of(words), "label", "classification")
    assert len(spec["categorical"]["c"]) == 2 + 128
    texts = pa.array(["cat", "dog", "cat", None]).cast(pa.binary()).dictionary_encode()
    assert tabular.fit_features(table_of(texts), "label", "auto")["categorical"]["c"] == ["<unseen>", "<missing>",
                                                                                          "cat", "dog"]
    documents = pa.array(['{"a": 1}', '{"b": 2}'], pa.json_())
    assert tabular.fit_features(table_of(documents), "label", "auto")["categorical"]["c"][2:] == ['{"a": 1}',
                                                                                                  '{"b": 2}']
    for column in (pa.array([uuid.UUID(int=i).bytes for i in (255, 256)], pa.uuid()),
                   pa.array([b"\xff\xfe", b"ok"]).dictionary_encode()):
        with pytest.raises(tabular.cli.RecipeError, match="column 'c' holds bytes that are not UTF-8 text"):
            table_of(column)


def test_a_column_spelled_otherwise_than_in_training_is_warned_of(tmp_path, capsys):
    """Parquet's booleans read as "true"/"false", pandas' CSV spells them "True"/"False": every new row's value
    was silently unseen, and the predictions near chance."""
    pq.write_table(pa.table({"member": [True, False] * 20, "label": ["a", "b"] * 20}), tmp_path / "train.parquet")
    spec = tabular.fit_features(tabular.read_table(tmp_path / "train.parquet"), "label", "classification")
    (tmp_path / "new.csv").write_text("member,label\n?,a\n" + "True,a\nFalse,b\n" * 20)  # a missing one first
    capsys.readouterr()
    categorical = tabular.encode(spec, tabular.read_table(tmp_path / "new.csv"), with_target=False)[1]
    assert (categorical[1:] == 0).all() and categorical[0] == 1
    assert capsys.readouterr().err == ("warning: column 'member': 40 of 41 values never seen in training (such as "
                                       "'True'; training's: 'false', 'true'), read as unseen\n")
    tabular.encode(spec, tabular.read_table(tmp_path / "train.parquet"), with_target=False)
    assert capsys.readouterr().err == ""
    # one row to predict, the commonest case: said too (it was said only from 10 unseen values on)
    (tmp_path / "one.csv").write_text("member\nFalse\n")
    tabular.encode(spec, tabular.read_table(tmp_path / "one.csv"), with_target=False)
    assert capsys.readouterr().err == ("warning: column 'member': 1 of 1 values never seen in training (such as "
                                       "'False'; training's: 'false', 'true'), read as unseen\n")
    (tmp_path / "new_word.csv").write_text("member\nmaybe\n")  # a value new in any spelling: one row says nothing
    tabular.encode(spec, tabular.read_table(tmp_path / "new_word.csv"), with_target=False)
    assert capsys.readouterr().err == ""


def test_a_row_index_pandas_stored_in_a_parquet_file_is_left_out_with_a_note(run_inprocess, tmp_path, monkeypatch):
    """pandas' to_parquet() keeps a made index (after a sort and a filter) as __index_level_0__: in a file sorted by
    label it predicted the label (validation accuracy 1 instead of 0.69), and a new file without it was refused."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 2))
    label = np.where(x[:, 0] + 0.5 * rng.normal(size=200) > 0, "yes", "no")
    order = np.argsort(label, kind="stable")  # sorted by label: the row number says the label
    table = pa.table({"x0": x[order, 0], "x1": x[order, 1], "label": label[order],
                      "__index_level_0__": np.arange(200)})
    pq.write_table(table, tmp_path / "t.parquet")
    result = run_inprocess(RECIPE, "--csv", tmp_path / "t.parquet", "--target", "label", "--max-steps", 5,
                           "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    assert "note: column(s) __index_level_0__ left out: a row index pandas stored in the Parquet file\n" in \
        result.stderr
    assert "2 numeric" in result.stdout
    (tmp_path / "new.csv").write_text("x0,x1\n0.5,0.1\n")  # a new row, without the index column
    result = run_inprocess(RECIPE, "--predict", tmp_path / "new.csv", "--resume", tmp_path / "run" / "checkpoints" /
                           "best.pt", "--output", tmp_path / "p.csv")
    assert result.code == 0, result.stderr
    assert (tmp_path / "p.csv").read_text().splitlines()[0] == '"x0","x1","prediction","probability"'
    # a run trained on the index before it was left out (as load_tables kept it then) resumes with it
    load_tables = tabular.load_tables
    monkeypatch.setattr(tabular, "load_tables", lambda *args: load_tables(*args[:4], ["__index_level_0__"]))
    args = ["--csv", tmp_path / "t.parquet", "--target", "label", "--run-dir", tmp_path / "old"]
    assert run_inprocess(RECIPE, *args, "--max-steps", 2).code == 0
    assert "__index_level_0__" in torch.load(tmp_path / "old" / "checkpoints" / "last.pt", weights_only=True)[
        "features"]["numeric"]
    monkeypatch.setattr(tabular, "load_tables", load_tables)
    result = run_inprocess(RECIPE, *args, "--max-steps", 4, "--resume", "auto")
    assert result.code == 0 and "resumed at step 2" in result.stdout, result.stderr


def test_rows_whose_class_reads_as_missing_are_counted_in_a_note(run_inprocess, tmp_path):
    """A class spelled "None" (no damage) is a missing value: a third of the rows were left out without a word."""
    rows = [f"{i % 7},{['Minor', 'Major', 'None'][i % 3]}" for i in range(300)]
    (tmp_path / "t.csv").write_text("x,damage\n" + "\n".join(rows) + "\n")
    result = run_inprocess(RECIPE, "--csv", tmp_path / "t.csv", "--target", "damage", "--max-steps", 1, "--run-dir",
                           tmp_path / "run")
    assert result.code == 0 and "2 classes" in result.stdout, result.stderr
    assert "note: 100 of 300 rows have no 'damage' (empty, or a word such as NA, null or None) and are left out of " \
           "training and validation\n" in result.stderr
    assert "160 train / 40 val rows" in result.stdout  # of the 200 with a class: 240 / 60 counted the others


def test_rows_without_a_class_are_in_no_batch_and_no_split(run_inprocess, tmp_path):
    """Their loss was skipped, but they were still batched: a batch of them alone logged a loss of 0.0, which the
    run's mean took in, and a validation split of them alone was said to hold only classes unseen in training.
    --val-frac is now a share of the rows with a class."""
    rows = [f"{i % 7},{['a', 'b'][i // 10 % 2] if i % 10 == 0 else ''}" for i in range(400)]  # 40 of 400 with a class
    (tmp_path / "t.csv").write_text("x,y\n" + "\n".join(rows) + "\n")
    common = ["--csv", tmp_path / "t.csv", "--target", "y", "--batch-size", 8]
    result = run_inprocess(RECIPE, *common, "--epochs", 2, "--log-every", 1, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    assert "32 train / 8 val rows" in result.stdout  # 400 rows, 40 with a class: 20% of those for validation
    losses = [loss for _, loss in read_scalars(tmp_path / "run")["train/loss"]]
    assert len(losses) == 2 * 4 and min(losses) > 0  # 4 batches of 8 an epoch; none without a loss
    assert "note: 360 of 400 rows have no 'y'" in result.stderr
    few = run_inprocess(RECIPE, *common, "--val-frac", 0.01, "--max-steps", 1, "--run-dir", tmp_path / "few")
    assert few.code == 0 and "39 train / 1 val rows" in few.stdout, few.stderr  # was: "no validation row's 'y' is a
    # class seen in training", where the 4 validation rows had no class at all


def test_cross_validation_embeds_the_numbers_alike_in_every_fold(run_inprocess, tmp_path):
    """--num-embedding auto depends on the training rows (a regression: periodic from 10,000): 19,999 rows in two
    folds train on 9,999 and 10,000, and the folds were two different models averaged as one score."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=19_999)
    pq.write_table(pa.table({"x": x, "y": 2 * x}), tmp_path / "t.parquet")
    result = run_inprocess(RECIPE, "--csv", tmp_path / "t.parquet", "--target", "y", "--cv", 2, "--max-steps", 1,
                           "--hidden", 4, "--depth", 1, "--run-dir", tmp_path / "cv")
    assert result.code == 0, result.stderr
    used = [json.loads((tmp_path / "cv" / f"fold-{k}" / "config.json").read_text())["num_embedding_used"]
            for k in range(2)]
    assert used == ["none", "none"]


def test_a_regression_target_with_missing_values_says_how_many_and_where(run_inprocess, tmp_path):
    (tmp_path / "t.csv").write_text("x,y\n" + "".join(f"{i},{i * 2}\n" for i in range(40)) + "3,\n4,n/a\n")
    result = run_inprocess(RECIPE, "--csv", tmp_path / "t.csv", "--target", "y", "--task", "regression",
                           "--max-steps", 1, "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr == ("error: target column 'y' has 2 missing or non-numeric value(s) (the "
                                                  "first in data row 41); fill them in, or remove those rows\n")


@pytest.mark.parametrize("task", ["auto", "regression"])
def test_a_numeric_target_with_a_stray_word_is_a_regression_that_names_its_row(task, run_inprocess, tmp_path):
    """auto read it as text: 150 classes, every validation row one unseen in training, exit 0; --task regression
    said "holds text", naming no row."""
    rows = [f"{i},{100 + 2.5 * i:.2f}\n" for i in range(150)]
    rows[17] = "17,unknown\n"  # 1 cell in 150: a typo, not a column of words
    (tmp_path / "t.csv").write_text("x,price\n" + "".join(rows))
    result = run_inprocess(RECIPE, "--csv", tmp_path / "t.csv", "--target", "price", "--task", task,
                           "--max-steps", 1, "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr == ("error: target column 'price' has 1 missing or non-numeric value(s) "
                                                  "(the first in data row 18); fill them in, or remove those rows\n")
    # missing cells are not stray words (3 blanks and the word: 4 in 150, which were read as classes); and the
    # training rows alone, with both words of 200 (1% of all rows, 1.25% of theirs), no longer "hold text"
    for n, words, blanks, first, count in ((150, [17], [30, 60, 90], 18, 4), (200, [41, 58], [], 42, 2)):
        cells = [f"{100 + 2.5 * i:.2f}" for i in range(n)]
        for i in words:
            cells[i] = "unknown"
        for i in blanks:
            cells[i] = ""
        (tmp_path / "t.csv").write_text("x,price\n" + "".join(f"{i},{cell}\n" for i, cell in enumerate(cells)))
        result = run_inprocess(RECIPE, "--csv", tmp_path / "t.csv", "--target", "price", "--task", task,
                               "--max-steps", 1, "--run-dir", tmp_path / f"run{n}")
        assert result.code == 1 and result.stderr == (f"error: target column 'price' has {count} missing or "
                                                      f"non-numeric value(s) (the first in data row {first}); fill "
                                                      "them in, or remove those rows\n"), result.stderr
    if task == "auto":  # a column of words with some numbers among them stays a column of classes
        (tmp_path / "w.csv").write_text("x,label\n" + "".join(f"{i},{'yes' if i % 3 else i}\n" for i in range(60)))
        result = run_inprocess(RECIPE, "--csv", tmp_path / "w.csv", "--target", "label", "--max-steps", 1,
                               "--run-dir", tmp_path / "words")
        state = torch.load(tmp_path / "words" / "checkpoints" / "last.pt", weights_only=True)
        assert result.code == 0 and state["features"]["task"] == "classification", result.stderr
        assert "warning" not in result.stderr  # 40 of 60 are words: a column of words


def test_a_numeric_target_with_more_than_a_few_stray_words_is_read_as_classes_with_a_warning(run_inprocess, tmp_path):
    """Prices with 5% "unknown": 154 classes, every validation row unseen in training, without a word of why."""
    cells = [f"{100 + 2.5 * i:.2f}" if i % 20 else "unknown" for i in range(200)]  # 10 of 200
    (tmp_path / "t.csv").write_text("x,price\n" + "".join(f"{i},{cell}\n" for i, cell in enumerate(cells)))
    common = ["--csv", tmp_path / "t.csv", "--target", "price", "--max-steps", 1]
    result = run_inprocess(RECIPE, *common, "--run-dir", tmp_path / "auto")
    assert result.code == 0 and " classes\n" in result.stdout, result.stderr  # (the training split's count)
    assert "warning: target column 'price': 10 of 200 values are not numbers (such as 'unknown'), so it is read as " \
           "191 classes; to predict numbers, fill in or remove those rows and give --task regression\n" in result.stderr
    # and 16 prices (15.5 the highest), which a few more words made 16 classes, as quietly
    (tmp_path / "few.csv").write_text("x,price\n" + "".join(f"{i},{'unknown' if i % 20 == 0 else 1.5 + i % 15}\n"
                                                            for i in range(200)))
    few = run_inprocess(RECIPE, "--csv", tmp_path / "few.csv", "--target", "price", "--max-steps", 1, "--run-dir",
                        tmp_path / "few")
    assert few.code == 0 and "so it is read as 16 classes; to predict numbers" in few.stderr, few.stderr
    regression = run_inprocess(RECIPE, *common, "--task", "regression", "--run-dir", tmp_path / "regression")
    assert regression.code == 1 and regression.stderr == ("error: target column 'price' has 10 missing or non-numeric "
                                                          "value(s) (the first in data row 1); fill them in, or remove "
                                                          "those rows\n")


def test_drop_leaves_a_column_out_of_the_features(run_inprocess, tmp_path):
    """An ID in a table sorted by label predicts the label in validation and nothing on new rows: --drop leaves
    it out. A name the table lacks, or the target, is a usage error that leaves no run directory."""
    rows = [f"{i},{(i % 7) * 0.5},{'a' if i < 30 else 'b'}" for i in range(60)]
    (tmp_path / "t.csv").write_text("id,x,label\n" + "\n".join(rows) + "\n")
    for drop, message in (("nope", "no column 'nope' in the table (columns: id, x, label)"),
                          ("label", "'label' is the target")):
        result = run_inprocess(RECIPE, "--csv", tmp_path / "t.csv", "--target", "label", "--drop", drop, "--run-dir",
                               tmp_path / "bad")
        assert result.code == 2 and "--drop" in result.stderr and message in result.stderr, result.stderr
        assert not (tmp_path / "bad").exists()
    result = run_inprocess(RECIPE, "--csv", tmp_path / "t.csv", "--target", "label", "--drop", "id", "--drop", "id",
                           "--max-steps", 1, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    features = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["features"]
    assert list(features["numeric"]) == ["x"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["drop"] == ["id"]


def test_drop_leaves_out_a_parquet_column_that_could_not_be_read_as_a_feature(run_inprocess, tmp_path):
    """A column of lists (or of bytes that are no text) stops a run: --drop lets it train on the rest."""
    pq.write_table(pa.table({"tags": [[1, 2], [3]] * 20, "x": [0.0, 1.0] * 20, "label": ["a", "b"] * 20}),
                   tmp_path / "t.parquet")
    args = ["--csv", tmp_path / "t.parquet", "--target", "label", "--max-steps", 1]
    result = run_inprocess(RECIPE, *args, "--run-dir", tmp_path / "no")
    assert result.code == 1 and "holds lists or records" in result.stderr and "leave it out (--drop)" in result.stderr
    result = run_inprocess(RECIPE, *args, "--drop", "tags", "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    # new rows shaped like the training rows: the dropped column is no feature, and rides along to the output (it
    # was refused as unreadable, and --drop is no option of --predict)
    best = tmp_path / "run" / "checkpoints" / "best.pt"
    result = run_inprocess(RECIPE, "--predict", tmp_path / "t.parquet", "--resume", best, "--output",
                           tmp_path / "out.parquet")
    assert result.code == 0, result.stderr
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column("tags").to_pylist() == [[1, 2], [3]] * 20 and out.num_rows == 40
    assert set(out.column("prediction").to_pylist()) <= {"a", "b"}
    # a column new to the model, of any type, rides along as well (a column of lists, bytes that are no text)
    pq.write_table(pa.table({"blob": [b"\xff\xfe"] * 40, "x": [0.0, 1.0] * 20, "tags": [[1]] * 40}),
                   tmp_path / "new.parquet")
    result = run_inprocess(RECIPE, "--predict", tmp_path / "new.parquet", "--resume", best, "--output",
                           tmp_path / "new_out.parquet")
    assert result.code == 0, result.stderr
    assert pq.read_table(tmp_path / "new_out.parquet").column("blob").to_pylist() == [b"\xff\xfe"] * 40
    # and columns CSV can hold once read as what they are stored as: JSON, Arrow's string views
    pq.write_table(pa.table({"js": pa.array(['{"a": 1}'] * 2, pa.json_()), "x": [0.0, 1.0],
                             "note": pa.array(["hi", "yo"], pa.string_view())}), tmp_path / "kinds.parquet")
    result = run_inprocess(RECIPE, "--predict", tmp_path / "kinds.parquet", "--resume", best, "--output",
                           tmp_path / "kinds.csv")
    assert result.code == 0, result.stderr
    assert (tmp_path / "kinds.csv").read_text().splitlines()[1].startswith('"{""a"": 1}",0,"hi",')
    # a model's own column is still checked: lists where it was trained on numbers
    pq.write_table(pa.table({"x": [[1.0]] * 4}), tmp_path / "lists.parquet")
    result = run_inprocess(RECIPE, "--predict", tmp_path / "lists.parquet", "--resume", best)
    assert result.code == 1 and result.stderr.endswith(
        "column 'x' (list<element: double>) holds lists or records, not one number or word per cell; the model reads "
        "it as one number or word per cell\n")
    # CSV has no cell for a list: one line, and nothing written
    result = run_inprocess(RECIPE, "--predict", tmp_path / "t.parquet", "--resume", best)
    assert result.code == 1 and result.stderr.startswith(f"error: cannot write {tmp_path / 't.predictions.csv'}: ")
    assert result.stderr.endswith("; name it .parquet\n") and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "t.predictions.csv").exists() and not list(tmp_path.glob(".*.tmp"))

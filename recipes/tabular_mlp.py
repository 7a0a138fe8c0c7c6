"""An MLP for any CSV table: standardised numeric columns, one embedding per categorical column.

What it teaches: turning a raw table into tensors with statistics of the training split only (so nothing
leaks from validation); missing and unseen values; a map-style Dataset; an MLP built from a hand-written
``Linear`` that does exactly what ``nn.Linear`` does; AdamW with parameter groups (no weight decay on biases,
norms and embeddings), gradient clipping, and a MultiStepLR schedule stepped once per epoch; the four
optimizers (``--optimizer sgd|adam|adamw|lbfgs``; LBFGS full-batch with its closure); a checkpoint that
carries its preprocessing, so it can predict on new rows.

    python recipes/tabular_mlp.py                                   # UCI Adult census income
    python recipes/tabular_mlp.py --csv my.csv --target price       # any CSV with a header row
    python recipes/tabular_mlp.py --predict new.csv --resume runs/tabular_mlp/.../checkpoints/best.pt

A good result: about 85% validation accuracy on Adult after 10 epochs, in well under a minute on a CPU.
"""

import csv
import math
import sys
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/NAME.py` from a clone

import numpy as np
import torch
import typer
from torch import nn
from torch.utils.data import Dataset

from common import cli
from common.checkpoint import load_checkpoint, load_model_state
from common.data import download, make_loader
from common.loop import StepStats, evaluate, to_device, train_step
from common.runtime import make_grad_scaler, resolve_device, seed_everything
from common.tracking import Run

RECIPE = "tabular_mlp"
MISSING = {"", "?", "NA", "N/A", "NaN", "nan"}
DEFAULT_LR = {"sgd": 0.05, "adam": 3e-3, "adamw": 3e-3, "lbfgs": 1.0}

# ----------------------------------------------------------------------------------------------------
# Data: the UCI Adult files, or any CSV

ADULT_URL = "https://archive.ics.uci.edu/ml/machine-learning-databases/adult/"
ADULT_FILES = {  # name: (md5, rows)
    "adult.data": ("5d7c39d7b8804f071cdd1f2a7c460872", 32561),
    "adult.test": ("35238206dfdf7f1fe215bbb874adecdc", 16281),
}
ADULT_COLUMNS = [
    "age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
    "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week", "native-country", "income",
]


def read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a CSV file, with every problem a user can cause reported as a RecipeError."""
    if not path.is_file():
        raise cli.RecipeError(f"--csv {path}: {'is a directory' if path.is_dir() else 'no such file'}")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: Excel starts its CSVs with a BOM
            rows = [row for row in csv.reader(f) if row]
    except UnicodeDecodeError as err:
        raise cli.RecipeError(f"{path} is not UTF-8 text (byte {err.start}); re-save it as UTF-8") from None
    except csv.Error as err:
        raise cli.RecipeError(f"{path} is not a readable CSV file: {err}") from None
    if not rows:
        raise cli.RecipeError(f"{path} is empty; it needs a header row and at least one data row")
    header, rows = [name.strip() for name in rows[0]], rows[1:]
    if not rows:
        raise cli.RecipeError(f"{path} has a header but no data rows")
    ragged = next((i for i, row in enumerate(rows) if len(row) != len(header)), None)
    if ragged is not None:
        raise cli.RecipeError(f"{path}: row {ragged + 2} has {len(rows[ragged])} fields, the header has {len(header)}")
    return header, rows


def load_adult(data_dir: Path) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """UCI Adult: download (or reuse) adult.data and adult.test and repair their quirks."""
    tables = {}
    for name, (md5, expected_rows) in ADULT_FILES.items():
        try:
            path = download(ADULT_URL + name, data_dir / "adult" / name, md5)
        except cli.RecipeError as err:
            raise cli.RecipeError(f"{err}; or train on your own table with --csv FILE --target COLUMN") from None
        lines = path.read_text(encoding="utf-8").splitlines()
        if name == "adult.test":
            lines = lines[1:]  # its first line is "|1x3 Cross validator", not data
        # no header, ", " separators, and test labels end with a dot (">50K.")
        rows = [[field.strip().rstrip(".") for field in line.split(",")] for line in lines if line.strip()]
        if len(rows) != expected_rows or any(len(row) != len(ADULT_COLUMNS) for row in rows):
            raise cli.RecipeError(f"{path} is not the published {name} (rows or columns differ); delete it")
        tables[name] = rows
    return ADULT_COLUMNS, tables["adult.data"], tables["adult.test"]


def as_float(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def fit_features(header: list[str], rows: list[list[str]], target: str, task: str) -> dict:
    """Learn the preprocessing from the training rows: which columns are numeric (every present value
    parses as a number) with their mean and std, the vocabulary of every other column, and the target's
    classes (classification) or mean and std (regression). A plain dict, so it fits in a checkpoint."""
    columns = {name: [row[i].strip() for row in rows] for i, name in enumerate(header)}
    labels = [v for v in columns.pop(target) if v not in MISSING]
    if len(set(labels)) < 2:
        raise cli.RecipeError(f"target column {target!r} holds {len(set(labels))} distinct value(s) besides missing "
                          "ones: there is nothing to learn")
    numeric_labels = [as_float(v) for v in labels]
    if task == "auto":
        # a non-numeric target, or a handful of integer values (a label code), is a class
        few_integers = len(set(labels)) <= 20 and all(x is not None and x.is_integer() for x in numeric_labels)
        task = "classification" if None in numeric_labels or few_integers else "regression"
    spec = {"target": target, "task": task, "numeric": {}, "categorical": {}}
    if task == "classification":
        spec["classes"] = sorted(set(labels))
    elif None in numeric_labels:
        raise cli.RecipeError(f"--task regression needs a numeric target, but {target!r} holds text")
    else:
        spec["target_mean"], spec["target_std"] = float(np.mean(numeric_labels)), float(np.std(numeric_labels) or 1)
    for name, values in columns.items():
        present = [v for v in values if v not in MISSING]
        numbers = [as_float(v) for v in present]
        if present and None not in numbers:
            spec["numeric"][name] = (float(np.mean(numbers)), float(np.std(numbers) or 1.0))
        else:  # index 0: a value never seen in training; index 1: missing
            spec["categorical"][name] = ["<unseen>", "<missing>", *sorted(set(present))]
    return spec


def encode(spec: dict, header: list[str], rows: list[list[str]], *, with_target: bool = True):
    """Rows -> (numeric float32 (N, n_num), categorical int64 (N, n_cat), target) arrays."""
    index = {name: i for i, name in enumerate(header)}
    needed = [*spec["numeric"], *spec["categorical"], *([spec["target"]] if with_target else [])]
    absent = [name for name in needed if name not in index]
    if absent:
        raise cli.RecipeError(f"the table lacks column(s) the model was trained on: {', '.join(absent)}")
    numeric = np.zeros((len(rows), len(spec["numeric"])), dtype=np.float32)
    for j, (name, (mean, std)) in enumerate(spec["numeric"].items()):
        values = [row[index[name]].strip() for row in rows]
        # a missing number becomes the training mean (0 after standardising)
        numeric[:, j] = [((x - mean) / std) if (x := as_float(v)) is not None else 0.0 for v in values]
    categorical = np.zeros((len(rows), len(spec["categorical"])), dtype=np.int64)
    for j, (name, vocabulary) in enumerate(spec["categorical"].items()):
        lookup = {value: k for k, value in enumerate(vocabulary)}
        for i, row in enumerate(rows):
            value = row[index[name]].strip()
            categorical[i, j] = 1 if value in MISSING else lookup.get(value, 0)
    if not with_target:
        return numeric, categorical, None
    raw = [row[index[spec["target"]]].strip() for row in rows]
    if spec["task"] == "classification":
        lookup = {label: k for k, label in enumerate(spec["classes"])}
        target = np.array([lookup.get(v, -1) for v in raw], dtype=np.int64)  # -1: a class unseen in training
    else:
        values = [as_float(v) for v in raw]
        if None in values:
            raise cli.RecipeError(f"target column {spec['target']!r} has missing or non-numeric values")
        target = ((np.array(values) - spec["target_mean"]) / spec["target_std"]).astype(np.float32)
    return numeric, categorical, target


class TabularDataset(Dataset):
    """The map-style Dataset: ``__len__`` and ``__getitem__`` over tensors built once."""

    def __init__(self, numeric: np.ndarray, categorical: np.ndarray, target: np.ndarray):
        self.numeric = torch.from_numpy(numeric)
        self.categorical = torch.from_numpy(categorical)
        self.target = torch.from_numpy(target)

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.numeric[idx], self.categorical[idx], self.target[idx]


# ----------------------------------------------------------------------------------------------------
# Model


class Linear(nn.Module):
    """``nn.Linear`` written out: y = x W^T + b, with the same parameters, shapes and initialisation."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()  # first: it sets up the registries that parameter assignment below relies on
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # (out, in), PyTorch's convention
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
        else:
            # Reserves the name: no parameter, nothing in state_dict, yet `self.bias` reads as None.
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's init: Kaiming-uniform with a=sqrt(5) gives U(-1/sqrt(fan_in), 1/sqrt(fan_in)) weights
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # forward, never __call__: __call__ runs the hooks
        out = x @ self.weight.T
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def embedding_dim(cardinality: int) -> int:
    return min(16, (cardinality + 1) // 2)  # a common rule of thumb: small vocabularies need few dimensions


class TabularMLP(nn.Module):
    """Numeric features and one embedding per categorical column, concatenated, then
    [Linear -> LayerNorm -> ReLU -> Dropout] x depth, then a linear head."""

    def __init__(self, n_numeric: int, cardinalities: list[int], out_features: int,
                 hidden: int = 256, depth: int = 3, dropout: float = 0.1):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(n, embedding_dim(n)) for n in cardinalities)
        with torch.no_grad():  # <unseen> never occurs in training (nor <missing>, if nothing was missing):
            for embedding in self.embeddings:  # zeros, a neutral input, instead of an untrained random vector
                embedding.weight[:2] = 0
        width = n_numeric + sum(embedding_dim(n) for n in cardinalities)
        layers = []
        for _ in range(depth):
            layers += [Linear(width, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = Linear(width, out_features)

    def forward(self, numeric: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        embedded = [embedding(categorical[:, i]) for i, embedding in enumerate(self.embeddings)]
        out = self.head(self.body(torch.cat([numeric, *embedded], dim=1)))
        return out.squeeze(-1) if out.shape[-1] == 1 else out  # regression: (B,)


def build_model(spec: dict, hidden: int, depth: int, dropout: float) -> TabularMLP:
    out_features = len(spec["classes"]) if spec["task"] == "classification" else 1
    cardinalities = [len(vocabulary) for vocabulary in spec["categorical"].values()]
    return TabularMLP(len(spec["numeric"]), cardinalities, out_features, hidden, depth, dropout)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay only weight matrices: shrinking biases, norm gains or embeddings towards zero only hurts."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay = [p for p in model.parameters() if p.ndim >= 2 and id(p) not in embeddings]
    no_decay = [p for p in model.parameters() if p.ndim < 2 or id(p) in embeddings]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    groups = parameter_groups(model, weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)
    if name == "adam":  # Adam's L2 penalty is scaled by the adaptive rates; AdamW's decoupled decay is not
        return torch.optim.Adam(groups, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    # LBFGS estimates curvature from the full gradient: one parameter group, whole data set per step
    return torch.optim.LBFGS(model.parameters(), lr=lr, max_iter=20, history_size=10, line_search_fn="strong_wolfe")


def lbfgs_step(model, optimizer, loss_fn, micro_batches, *, device, **_) -> StepStats:
    """``train_step`` for LBFGS, which evaluates the loss several times per step (its line search), so it
    takes a closure; one full batch, in fp32 (the line search compares losses too closely for autocast)."""
    *inputs, target = to_device(micro_batches[0], device)

    def closure():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        return loss

    return StepStats(optimizer.step(closure).detach())


# ----------------------------------------------------------------------------------------------------
# Prediction


@torch.no_grad()
def predict(checkpoint_path: Path, csv_path: Path, output: Path, device: torch.device) -> int:
    """Write ``output``: the rows of ``csv_path`` with the model's prediction appended to each."""
    checkpoint = load_checkpoint(checkpoint_path, RECIPE)
    spec, config = checkpoint["features"], checkpoint["config"]
    model = build_model(spec, config["hidden"], config["depth"], config["dropout"]).to(device).eval()
    load_model_state(model, checkpoint["model"], checkpoint_path)
    header, rows = read_csv(csv_path)
    numeric, categorical, _ = encode(spec, header, rows, with_target=False)
    out = model(torch.from_numpy(numeric).to(device), torch.from_numpy(categorical).to(device)).float().cpu()
    if spec["task"] == "classification":
        probabilities = out.softmax(-1)
        confidence, index = probabilities.max(-1)
        columns = ["prediction", "probability"]
        values = [[spec["classes"][k], f"{p:.4f}"] for k, p in zip(index.tolist(), confidence.tolist(), strict=True)]
    else:
        columns = ["prediction"]
        values = [[f"{x * spec['target_std'] + spec['target_mean']:.6g}"] for x in out.tolist()]
    try:
        with open(output, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow([*header, *columns])
            writer.writerows([*row, *extra] for row, extra in zip(rows, values, strict=True))
    except OSError as err:
        raise cli.RecipeError(f"cannot write {output}: {err.strerror}") from None
    return len(rows)


# ----------------------------------------------------------------------------------------------------
# Training


def main(
    csv_path: Annotated[Path | None, typer.Option("--csv", help="Train on this CSV (with a header row).")] = None,
    target: Annotated[str | None, typer.Option(help="Column to predict [default: income, for Adult].")] = None,
    task: Annotated[
        Literal["auto", "classification", "regression"],
        typer.Option(help="auto: classification for a text target or a few integer values, else regression."),
    ] = "auto",
    val_frac: Annotated[float, typer.Option(min=0.01, max=0.9, help="Share of rows held out for validation.")] = 0.2,
    epochs: cli.Epochs = 10,
    max_steps: cli.MaxSteps = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Rows per step [default: 256; lbfgs: all].")] = None,
    lr: Annotated[float | None, typer.Option(
        callback=cli.positive_float, help="Learning rate [default: 3e-3; sgd 0.05; lbfgs 1].")] = None,
    optimizer_name: Annotated[
        Literal["adamw", "adam", "sgd", "lbfgs"],
        typer.Option("--optimizer", help="lbfgs trains full-batch: for small tables only."),
    ] = "adamw",
    weight_decay: Annotated[
        float, typer.Option(min=0.0, help="Weight decay on weight matrices (decoupled in adamw, L2 in adam/sgd).")
    ] = 0.01,
    max_grad_norm: Annotated[float, typer.Option(callback=cli.positive_float, help="Gradient clipping norm.")] = 1.0,
    hidden: Annotated[int, typer.Option(min=1, help="Width of the hidden layers.")] = 256,
    depth: Annotated[int, typer.Option(min=1, help="Number of hidden layers.")] = 3,
    dropout: Annotated[float, typer.Option(min=0.0, max=0.9, help="Dropout after each hidden layer.")] = 0.1,
    predict_csv: Annotated[
        Path | None, typer.Option("--predict", help="Only predict: rows of this CSV, with the model from --resume.")
    ] = None,
    output: Annotated[Path | None, typer.Option(help="Predictions file [default: PREDICT.predictions.csv].")] = None,
    seed: cli.Seed = 0,
    device: cli.Device = "auto",
    precision: cli.Precision = "fp32",
    compile: cli.Compile = False,
    num_workers: cli.NumWorkers = 0,
    data_dir: cli.DataDir = Path("data"),
    run_dir: cli.RunDir = None,
    resume: cli.Resume = None,
    checkpoint_every: cli.CheckpointEvery = None,
    progress: cli.Progress = None,
):
    """Train an MLP on a CSV table (default: UCI Adult census income), or predict with a trained one."""
    if predict_csv is not None:
        if resume is None or resume == "auto":
            raise typer.BadParameter("give the checkpoint to predict with, e.g. --resume .../best.pt",
                                     param_hint="--resume")
        output = output or predict_csv.with_suffix(".predictions.csv")
        n = predict(Path(resume), predict_csv, output, resolve_device(device))
        print(f"done: predictions={n} output={output}")
        return
    if optimizer_name == "lbfgs":
        if precision != "fp32":
            raise typer.BadParameter("lbfgs needs fp32: its line search compares losses too closely for autocast",
                                     param_hint="--precision")
        if batch_size is not None:
            raise typer.BadParameter("lbfgs trains on the whole table at once; leave --batch-size out",
                                     param_hint="--batch-size")
    lr = lr or DEFAULT_LR[optimizer_name]
    run = Run(RECIPE, locals(), may_change={"predict_csv", "output"})
    seed_everything(seed)
    device = resolve_device(device)

    # Data: rows -> preprocessing fitted on the training split -> tensors
    if csv_path is not None:
        if target is None:
            raise typer.BadParameter("--csv needs --target COLUMN", param_hint="--target")
        header, rows = read_csv(csv_path)
        test_rows = None
    else:
        header, rows, test_rows = load_adult(data_dir)
        target = target or "income"
    if target not in header:
        raise cli.RecipeError(f"target column {target!r} is not in the table (columns: {', '.join(header)})")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(val_frac * len(rows)))
    if len(rows) - n_val < 2:
        raise cli.RecipeError(f"{len(rows)} rows are too few to split off {val_frac:.0%} for validation")
    train_rows, val_rows = [rows[i] for i in order[n_val:]], [rows[i] for i in order[:n_val]]
    spec = run.checkpoint["features"] if run.resuming else fit_features(header, train_rows, target, task)
    classification = spec["task"] == "classification"
    train_set = TabularDataset(*encode(spec, header, train_rows))
    val_set = TabularDataset(*encode(spec, header, val_rows))
    batch_size = len(train_set) if optimizer_name == "lbfgs" else batch_size or min(256, len(train_set))
    run.config |= {"target": target, "batch_size": batch_size}  # as resolved
    train_loader = make_loader(train_set, batch_size, train=True, seed=seed, num_workers=num_workers, device=device)
    val_loader = make_loader(val_set, 1024, train=False, num_workers=num_workers, device=device)

    model = build_model(spec, hidden, depth, dropout).to(device)
    if compile:
        model = torch.compile(model)
    optimizer = make_optimizer(optimizer_name, model, lr, weight_decay)
    # Per-epoch schedule: drop the learning rate 10x at 50% and again at 75% of the epochs. With few epochs the
    # two coincide (MultiStepLR would then apply both drops at once) or fall on epoch 0 (a drop before training).
    milestones = sorted({m for m in (epochs // 2, epochs * 3 // 4) if m > 0})
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=0.1)
    scaler = make_grad_scaler(device, precision)
    # a -1 target (a class unseen in training) is skipped, not trained on
    loss_fn = nn.CrossEntropyLoss(ignore_index=-1) if classification else nn.MSELoss()
    step_fn = lbfgs_step if optimizer_name == "lbfgs" else train_step
    run.start(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, loader=train_loader,
              epochs=epochs, extra={"features": spec})
    kind = f"{len(spec['classes'])} classes" if classification else "regression"
    run.print(f"{len(train_set)} train / {len(val_set)} val rows | {len(spec['numeric'])} numeric + "
              f"{len(spec['categorical'])} categorical columns | {kind}")

    def validate(loader) -> dict[str, float]:
        metrics = evaluate(model, loader, loss_fn, device=device, precision=precision, accuracy=classification)
        if not classification:  # RMSE in the target's own units
            metrics["rmse"] = math.sqrt(metrics["loss"]) * spec["target_std"]
        return metrics

    for epoch in run.epochs():
        train_loader.sampler.set_epoch(epoch)
        for batch in run.batches(train_loader):
            current_lr = scheduler.get_last_lr()[0]
            stats = step_fn(model, optimizer, loss_fn, [batch], device=device, precision=precision, scaler=scaler,
                            max_grad_norm=max_grad_norm)
            run.log_train(stats, lr=current_lr, items=len(batch[-1]))
            if run.step % run.steps_per_epoch == 0:
                scheduler.step()  # a per-epoch schedule: once, after the epoch's last optimizer step
        val = validate(val_loader)
        run.log_eval(val, score=val["acc"] if classification else -val["rmse"])

    test = {}
    if test_rows is not None:  # Adult's official test file, scored once at the end
        test = validate(make_loader(TabularDataset(*encode(spec, header, test_rows)), 1024, train=False))
    run.finish({f"test_{k}": v for k, v in test.items()})


if __name__ == "__main__":
    cli.run_recipe(main)

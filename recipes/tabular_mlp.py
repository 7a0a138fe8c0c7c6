"""An MLP for any table (CSV, TSV, Parquet): numeric columns embedded, one embedding per categorical column.

What it teaches: turning a raw table into tensors column by column, never cell by cell (millions of rows in
seconds), with statistics of the training split only (so nothing leaks from validation); missing and unseen
values; numeric features as vectors (periodic or piecewise-linear embeddings: what lets an MLP compete with
gradient-boosted trees); a map-style Dataset whose ``__getitems__`` builds a batch in one indexing; an MLP built
from a hand-written ``Linear`` that does exactly what ``nn.Linear`` does; AdamW with parameter groups (no weight
decay on biases, norms and embeddings), gradient clipping, and a MultiStepLR schedule stepped once per epoch; the
four optimizers (``--optimizer sgd|adam|adamw|lbfgs``; LBFGS full-batch with its closure); K-fold
cross-validation for small tables; a checkpoint that carries its preprocessing, so it can predict on new rows.

    python recipes/tabular_mlp.py                                   # UCI Adult census income
    python recipes/tabular_mlp.py --csv my.csv --target price       # also .tsv, .csv.gz, .parquet
    python recipes/tabular_mlp.py --csv small.csv --target y --cv 5 # five folds, each validated on its own
    python recipes/tabular_mlp.py --predict new.csv --resume runs/tabular_mlp/.../checkpoints/best.pt

A good result: about 86% validation accuracy on Adult after 10 epochs, in under half a minute on a CPU.
"""

import codecs
import contextlib
import gzip
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python recipes/NAME.py` from a clone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import torch
import typer
from torch import nn
from torch.utils.data import Dataset

from common import cli
from common.best import BestCheckpoints, BestScore, EarlyStopping
from common.checkpoint import Checkpointer, check_same_run, load_checkpoint, load_model_state, resume_checkpoint
from common.data import built_batch, checksum, download, make_loader, same_file
from common.loop import StepStats, batches_left, epochs_left, evaluate, to_device, train_step
from common.profile import StepProfiler
from common.rundir import already_finished, open_run_dir, write_json
from common.runlog import RunLog, log_interval
from common.runtime import resolve_device, resolve_precision, seed_everything
from common.stop import StopRequest

RECIPE = "tabular_mlp"
# A missing value, however spelled: compared stripped and lower-cased. In a numeric column inf and -inf count too.
MISSING = pa.array(["", "?", "na", "n/a", "#n/a", "<na>", "nan", "-nan", "+nan", "null", "none"])
NUMBER = r"^[+-]?((\d+\.?\d*|\.\d+)(e[+-]?\d+)?|inf(inity)?)$"  # for values of a numeric column in new rows
# A number as a spreadsheet shows it to people: 1,234.5 (1,23,456.7 in India, 1'234.5 in Switzerland), 1.234,5 or
# 1 234,5, a decimal comma, a percent or currency sign, an accountant's (12.5). Read as words (1,234 is no number to a
# program, nor to a person whose decimal mark is the comma): said, not guessed. Groups of dots or spaces without a
# decimal comma (1 234, 10.126.150) stay words unsaid: phone numbers, IDs, addresses
FOR_PEOPLE = re.compile(r"\(?[+-]?[$€£¥]?\s?[+-]?(\d{1,3}(,\d{2,3})*,\d{3}(\.\d+)?|\d{1,3}(['’]\d{3})+(\.\d+)?|"
                        r"\d{1,3}([.\s'’]\d{3})+,\d+|\d+,\d+|\d+(\.\d+)?)\s?[%$€£¥]?\)?")
WRITE_PLAIN = "write them plain (1234.5: a decimal point, no thousands separator, percent or currency sign)"
MISSING_CLASS, UNSEEN_CLASS = -1, -2  # encode's target for a row without a class, or with one unseen in training
# --num-embedding: quantile bins per column (ple), frequencies per column and their initial spread (periodic), and
# the numbers each numeric column becomes
PLE_BINS, PERIODIC_FREQUENCIES, PERIODIC_SIGMA, EMBEDDING_WIDTH = 32, 32, 0.5, 8
# periodic, a column whose values repeat (this many training rows per distinct value, or more): spreads up to this
REPEATED_FROM, PERIODIC_SIGMA_REPEATED = 10, 100.0
STRAY_WORDS = 0.01  # a column whose present values are numbers but for this share or less is numeric (mostly_numbers)
MIN_STEPS = 800  # the default length on a small table (default_epochs)
LBFGS_STEPS = 100  # --optimizer lbfgs's default length (default_epochs): each step up to 25 passes over the table
EMBED_REGRESSION_FROM = 10_000  # --num-embedding auto: training rows from which a regression embeds (auto_embedding)
# A standardised number is kept within this many standard deviations: no training value is further (at most
# sqrt(rows - 1) of them), and a model's first layer stays far from float32's overflow at 3.4e38
FAR = 10_000
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


def read_table(path: Path, drop: list[str] | None = None, checked: list[str] | None = None) -> pa.Table:
    """A .csv, .tsv (either also .gz) or .parquet file, read column-wise by pyarrow's multi-threaded reader, without
    the ``drop`` columns (left out before their types are checked: a Parquet column of lists may be dropped), and
    with the types of the ``checked`` columns alone checked, if given (new rows: the model's; the others ride along).

    CSV cells are read as dictionary-encoded text: per column, the distinct strings once and an int32 index
    per cell. Nothing is guessed at read time (what is a number is decided from the training split), and
    every later string operation runs once per distinct value instead of once per cell."""
    if path.is_dir():
        raise cli.RecipeError(f"{path} is a directory, not a table file")
    if not path.is_file():
        raise cli.RecipeError(f"{path}: no such file")
    name = path.name.lower()
    delimiter = {".csv": ",", ".tsv": "\t"}.get(Path(name.removesuffix(".gz")).suffix)  # pyarrow gunzips .gz
    if delimiter is None and not name.endswith(".parquet"):
        raise cli.RecipeError(f"{path}: not a table file by its name; give a .csv, .tsv, .csv.gz, .tsv.gz or .parquet")
    first_line = b""
    try:
        # UTF-16 would read as one garbled column: its byte order mark (inside the gzip stream) says what it is
        with (gzip.open if name.endswith(".gz") else open)(path, "rb") as f:
            if (first_line := f.readline(1 << 16))[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
                raise cli.RecipeError(f"{path} is UTF-16 text; re-save it as UTF-8")
        if delimiter is None:
            table = pq.read_table(path)
        else:
            parse = pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True)  # quoted cells may span lines
            blocks = pacsv.ReadOptions(block_size=16 << 20)  # a row must fit in one: a header of 10k columns, say
            # pyarrow tells gzip by the name's ending, case and all (X.CSV.GZ was read as raw bytes): said here
            source = (lambda: pa.CompressedInputStream(pa.OSFile(str(path)), "gzip")) if name.endswith(".gz") else \
                (lambda: path)
            header = pacsv.open_csv(source(), blocks, parse).schema.names  # reads the first block only
            text = pacsv.ConvertOptions(column_types=dict.fromkeys(header, pa.dictionary(pa.int32(), pa.string())))
            # one dictionary per column instead of one per block read: combining the chunks is then cheap
            table = pacsv.read_csv(source(), blocks, parse, text)
            table = table.unify_dictionaries().combine_chunks()
    except (pa.ArrowException, OSError, UnicodeError, EOFError) as err:  # EOFError: a .gz cut short
        if isinstance(err, UnicodeEncodeError):  # a name in another encoding: lone surrogates, which pyarrow refuses
            raise cli.RecipeError(f"{path}: its name is not UTF-8, which pyarrow needs; rename the file") from None
        if "Empty CSV file" in str(err):
            raise cli.RecipeError(f"{path} is empty; it needs a header row and at least one data row") from None
        # a cell (pyarrow's message), or a header (decoded by Python), in Latin-1, say
        if "invalid UTF8" in str(err) or isinstance(err, UnicodeDecodeError):
            raise cli.RecipeError(f"{path} is not UTF-8 text; re-save it as UTF-8") from None
        first = first_line.decode("utf-8", "replace").strip()
        if first.lower().startswith("sep=") and delimiter:  # Excel's first line naming the delimiter
            raise cli.RecipeError(f"{path}: its first line, {first!r}, names Excel's delimiter: delete it") from None
        hint = next((hint for sep, hint in ((";", " (is it semicolon-separated, as spreadsheets whose decimal mark is "
                     "the comma save it? only .tsv files are read with another delimiter than ',')"),
                     ("\t", " (is it tab-separated? name a tab-separated file .tsv)"))
                     if delimiter == "," and sep in first and "," not in first), "")
        raise cli.RecipeError(f"{path} is not a readable table file: {err}{hint}") from None
    table = table.rename_columns([str(column).strip() for column in table.column_names])
    if unnamed := [i for i, name in enumerate(table.column_names) if name == "" and delimiter and  # a spreadsheet's
                   not any(pc.utf8_trim_whitespace(table[i].combine_chunks().dictionary).to_pylist())]:  # empty ones
        print(f"note: {len(unnamed)} column(s) without a name or a value left out", file=sys.stderr)
        for i in reversed(unnamed):  # (by position: a first column without a name but with values stays)
            table = table.remove_column(i)
    if len(set(table.column_names)) < table.num_columns:
        raise cli.RecipeError(f"{path}: the header names a column twice ({', '.join(table.column_names)})")
    if table.num_rows == 0:
        raise cli.RecipeError(f"{path} has a header but no data rows")
    table = without(table, drop)
    remedy = "leave it out (--drop)" if checked is None else "the model reads it as one number or word per cell"
    nested = [f"{field.name!r} ({field.type})" for field in table.schema
              if pa.types.is_nested(field.type) and (checked is None or field.name in checked)]
    if nested:  # Parquet: lists, structs and maps are no single value per cell
        raise cli.RecipeError(f"{path}: column {', '.join(nested)} holds lists or records, not one number or word per "
                              f"cell; {remedy}")
    for i, column in enumerate(table.column_names):
        if isinstance(table[i].type, pa.BaseExtensionType):  # Parquet: a UUID, JSON: read as what it is stored as
            table = table.set_column(i, column, pa.chunked_array([c.storage for c in table[i].chunks],
                                                                 table[i].type.storage_type))
        dictionary = pa.types.is_dictionary(table[i].type)
        values = table[i].type.value_type if dictionary else table[i].type
        if pa.types.is_string_view(values):  # Parquet: Arrow's newer string layout, which some kernels lack
            table = table.set_column(i, column, table[i].cast(pa.dictionary(table[i].type.index_type, pa.string())
                                                              if dictionary else pa.string()))
        if checked is not None and column not in checked:
            continue
        if any(is_bytes(values) for is_bytes in (pa.types.is_binary, pa.types.is_large_binary,  # words only
                                                 pa.types.is_fixed_size_binary, pa.types.is_binary_view)):  # in UTF-8
            try:
                table = table.set_column(i, column, table[i].cast(pa.dictionary(table[i].type.index_type, pa.string())
                                                                  if dictionary else pa.string()))
            except pa.ArrowInvalid:
                raise cli.RecipeError(f"{path}: column {column!r} holds bytes that are not UTF-8 text (an ID?); "
                                      f"{remedy}") from None
    return table


def without(table: pa.Table, drop: list[str] | None) -> pa.Table:
    """``table`` without the ``--drop`` columns, each of which it must have."""
    for name in drop or []:
        if name not in table.column_names:
            raise typer.BadParameter(f"no column {name!r} in the table (columns: {', '.join(table.column_names)})",
                                     param_hint="--drop")
        table = table.drop_columns([name])
    return table


def load_adult(data_dir: Path) -> tuple[pa.Table, pa.Table]:
    """UCI Adult: download (or reuse) adult.data and adult.test and repair their quirks."""
    tables = {}
    for name, (md5, expected_rows) in ADULT_FILES.items():
        try:
            path = download(ADULT_URL + name, data_dir / "adult" / name, md5)
        except cli.RecipeError as err:
            raise cli.RecipeError(f"{err} (both {' and '.join(ADULT_FILES)} go in that folder); or train on your own "
                                  "table with --csv FILE --target COLUMN") from None
        lines = path.read_text(encoding="utf-8").splitlines()
        if name == "adult.test":
            lines = lines[1:]  # its first line is "|1x3 Cross validator", not data
        # no header, ", " separators, and test labels end with a dot (">50K.")
        rows = [[field.strip().rstrip(".") for field in line.split(",")] for line in lines if line.strip()]
        if len(rows) != expected_rows or any(len(row) != len(ADULT_COLUMNS) for row in rows):
            raise cli.RecipeError(f"{path} is not the published {name} (rows or columns differ); delete it")
        tables[name] = pa.table([pa.array(column).dictionary_encode() for column in zip(*rows, strict=True)],
                                names=ADULT_COLUMNS)
    return tables["adult.data"], tables["adult.test"]


def distinct(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, pa.Array]:
    """The column as (for each cell, the index of its value; the values that occur, stripped, and null
    for missing ones, however spelled). The per-cell work is then integer indexing."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not pa.types.is_dictionary(column.type):  # Parquet: any type
        column = pc.dictionary_encode(column)
    indices = column.indices.cast(pa.int64()) if column.indices.type.bit_width < 32 else column.indices  # int8: 127
    indices = indices.fill_null(len(column.dictionary)).to_numpy()  # a null cell: one past the end
    words = pc.utf8_trim_whitespace(column.dictionary.cast(pa.string()))
    words = pa.concat_arrays([pc.if_else(pc.is_in(pc.utf8_lower(words), value_set=MISSING), None, words),
                              pa.nulls(1, pa.string())])
    # after a split the dictionary still holds the other split's values: keep only those that occur here
    occurs = np.bincount(indices, minlength=len(words)) > 0
    return (np.cumsum(occurs) - 1)[indices], words.filter(occurs)


def numbers(column: pa.ChunkedArray | pa.Array, strict: bool) -> np.ndarray | None:
    """The column as float64, NaN where missing or not finite (inf is no more a value than "NaN" is). A
    cell that is not a number: None if ``strict`` (the column is not numeric), else NaN (a missing value)."""
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):  # Parquet: numbers already
        values = column.cast(pa.float64(), safe=False).to_numpy()  # null -> NaN; an int64 ID past 2**53: rounded
    else:
        indices, words = distinct(column)
        try:
            per_word = pc.cast(words, pa.float64())
        except pa.ArrowInvalid:
            if strict:
                return None
            per_word = pc.cast(pc.if_else(pc.match_substring_regex(words, NUMBER, ignore_case=True), words, None),
                               pa.float64())
        values = per_word.to_numpy(zero_copy_only=False)[indices]
    return np.where(np.isfinite(values), values, np.nan)


def class_names(column: pa.ChunkedArray | pa.Array, as_numbers: bool | None = None) -> tuple[np.ndarray, pa.Array]:
    """``distinct`` for a class column, with numbers spelled one way: "1", "1.0" and "1e0" are one class, "1";
    integers exactly, however long (two 17-digit codes stay two classes). ``as_numbers``: whether to, by default
    if every value is a number. A run whose classes are numbers passes True for new rows: their numbers are
    spelled as training spelled them, and a word among them (a class unseen in training) stays a word."""
    indices, words = distinct(column)
    if as_numbers is None:
        as_numbers = numbers(words, strict=True) is not None
    if as_numbers:
        values = numbers(words, strict=False).tolist()  # NaN: missing, not finite, or a word
        is_number = pc.fill_null(pc.match_substring_regex(words, NUMBER, ignore_case=True), False).to_pylist()
        names = [w if not number else None if math.isnan(v) else str(int(w)) if re.fullmatch(r"[+-]?\d+", w) else
                 str(int(v)) if v == int(v) else repr(v)
                 for w, v, number in zip(words.to_pylist(), values, is_number, strict=True)]
        words = pa.array(names, pa.string())
    return indices, words


def class_spellings(column: pa.ChunkedArray) -> list[str]:
    """The classes of a target column in ``class_names``' order, each spelled as most of its rows spell it: a
    prediction reads "007" where the file does, not the number 7."""
    indices, words = distinct(column)
    counts = np.bincount(indices, minlength=len(words)).tolist()
    spelling = {}
    for _, word, name in sorted(zip(counts, words.to_pylist(), class_names(column)[1].to_pylist(), strict=True),
                                    key=lambda t: (-t[0], t[1] or "")):
        spelling.setdefault(name, word)  # the most rows first
    return [spelling[name] for name in sorted(spelling.keys() - {None})]


def target_task(column: pa.ChunkedArray, name: str, task: str, rows: str = "") -> str:
    """``--task``, with ``auto`` resolved from the target column's values: text, or a handful of integer values (a
    label code), is a class. Numbers but for a stray 1% ("unknown", a typo) are a regression target, whose error then
    names the rows. A property of the column, not a statistic: no split is needed. ``rows``: which rows ``column``
    holds, for the message."""
    labels = class_names(column)[1].drop_null().unique()
    if len(labels) < 2:
        raise cli.RecipeError(f"target column {name!r} holds {len(labels)} distinct value(s) besides missing "
                              f"ones{rows}: there is nothing to learn")
    values, for_people = numbers(column, strict=True), None
    if values is None:  # numbers but for a stray few ("unknown", a typo): a regression, which then names their rows
        stray, present, strays = stray_words(column)  # (decided already, a regression takes any column with a number)
        example, for_people = strays[0] if strays else None, written_for_people(strays)
        loose = numbers(column, strict=False)  # the words missing
        values = loose if stray <= STRAY_WORDS * present or (task == "regression" and stray < present) else None
        known = loose[~np.isnan(loose)]  # mostly numbers, which auto would read as a regression but for the words:
        if values is None and task == "auto" and for_people:  # 1,234.5 or 0,5 or 12%: as a spreadsheet formats them
            print(f"warning: target column {name!r} holds what look like numbers as a spreadsheet shows them (such "
                  f"as {example!r}), so it is read as {len(labels):,} classes; to predict numbers, {WRITE_PLAIN}",
                  file=sys.stderr)
        elif values is None and task == "auto" and stray < present / 2 and not few_integers(known, len(set(known))):
            print(f"warning: target column {name!r}: {stray:,} of {present:,} values are not numbers (such as "
                  f"{example!r}), so it is read as {len(labels):,} classes; to predict numbers, fill in or remove "
                  "those rows and give --task regression", file=sys.stderr)
    if task == "regression" and values is None:
        raise cli.RecipeError(f"--task regression needs a numeric target, but {name!r} holds text" + (
            f" (numbers as a spreadsheet shows them, such as {for_people!r}: {WRITE_PLAIN})" if for_people else ""))
    if task == "auto":
        task = "classification" if values is None or few_integers(values[~np.isnan(values)], len(labels)) \
            else "regression"
    return task


def few_integers(values: np.ndarray, distinct: int) -> bool:
    """Whether numbers, ``distinct`` values in all, are a handful (20 or fewer) of integers: a label code."""
    return distinct <= 20 and bool(np.all(values == np.round(values)))


def mean_and_std(values: np.ndarray) -> tuple[float, float]:
    """Their mean and standard deviation (1 for a constant), taken in units of a power of two near the largest: the
    squares of numbers past 1e154 overflow float64, and dividing by a power of two rounds nothing."""
    scale = 2.0 ** (np.frexp(np.abs(values).max())[1] - 1)  # -1: 2**1024 is no float64; values / scale < 2
    return float((values / scale).mean() * scale), float((values / scale).std() * scale) or 1.0


def standardised(values: np.ndarray, mean: float, std: float) -> np.ndarray:
    """(values - mean) / std, taken as values / std - mean / std: a value and a mean of opposite signs can be each
    finite and yet their difference past float64's 1.8e308."""
    return values / std - mean / std


def mostly_numbers(column: pa.ChunkedArray, name: str) -> np.ndarray | None:
    """A column of numbers but for a few stray cells (at most STRAY_WORDS of its present ones: "1,200", "12 kg", a
    typo) as numbers, those cells missing, with a warning; None for a column of words (with a warning if the words
    are a minority). Without this, one stray cell would make the column a category of its every value, as a new
    row's stray cell is already read as missing."""
    stray, present, strays = stray_words(column)
    if not stray:
        return None
    example = strays[0]
    if stray > STRAY_WORDS * present:
        if written_for_people(strays):  # 1,234.5 or 0,5 or 12%: numbers, as a spreadsheet formats them
            print(f"warning: column {name!r} holds what look like numbers as a spreadsheet shows them (such as "
                  f"{example!r}): read as a category of its every value; if they are numbers, {WRITE_PLAIN}",
                  file=sys.stderr)
        elif stray < present / 2:  # numbers still, with a placeholder ("-") in more cells than a typo would be
            print(f"warning: column {name!r}: {stray:,} of {present:,} values are not numbers (such as {example!r}), "
                  "too many to read as missing: it is read as a category of its every value; clean them to read "
                  "numbers", file=sys.stderr)
        return None
    print(f"warning: column {name!r}: {stray:,} of {present:,} values are not numbers (such as {example!r}), "
          "read as missing", file=sys.stderr)
    return numbers(column, strict=False)


def stray_words(column: pa.ChunkedArray) -> tuple[int, int, list[str]]:
    """How many cells hold a word that is no number, of how many present ones, and such words (the first 1000)."""
    indices, words = distinct(column)
    stray_word = pc.invert(pc.fill_null(pc.match_substring_regex(words, NUMBER, ignore_case=True), True))
    stray = int(stray_word.to_numpy(zero_copy_only=False)[indices].sum())
    present = int(pc.is_valid(words).to_numpy(zero_copy_only=False)[indices].sum())
    return stray, present, words.filter(stray_word)[:1000].to_pylist()


def written_for_people(words: list[str]) -> str | None:
    """The first of ``words`` if each is a number as a spreadsheet shows it (``FOR_PEOPLE``), else None."""
    return words[0] if words and all(FOR_PEOPLE.fullmatch(word) for word in words) else None


def fit_features(table: pa.Table, target: str, task: str, bins: int = 0, rows: str = "") -> dict:
    """Learn the preprocessing from the training rows: which columns are numeric (every present value is a number,
    or all but a stray few) with their mean and std, how many rows share a value on average (and, with ``bins``,
    the quantile bin edges of the standardised values), the vocabulary of every other column, and the target's
    classes (classification) or mean and std (regression). A plain dict, so it fits in a checkpoint."""
    task = target_task(table[target], target, task, rows)
    spec = {"target": target, "task": task, "numeric": {}, "categorical": {}, "bins": {}, "rows_per_value": {}}
    if task == "classification":
        spec["classes"] = class_spellings(table[target])
    else:
        values = numbers(table[target], strict=False)  # a stray word: missing here, and encode's error
        spec["target_mean"], spec["target_std"] = mean_and_std(values[~np.isnan(values)])
    for name in table.column_names:
        values = None if name == target else numbers(table[name], strict=True)
        if values is None and name != target:
            values = mostly_numbers(table[name], name)
        if values is not None and not np.isnan(values).all():
            present = values[~np.isnan(values)]
            spec["numeric"][name] = mean, std = mean_and_std(present)
            n_values = len(np.unique(present))  # a constant column counts as continuous: nothing to tell apart
            spec["rows_per_value"][name] = len(present) / n_values if n_values > 1 else 1.0
            if bins:  # distinct quantiles, each a value of the column: a 0/1 flag gets one bin, not many
                quantiles = np.quantile(standardised(present, mean, std), np.linspace(0, 1, bins + 1), method="nearest")
                edges = np.unique(quantiles)
                # plain floats (tolist()): a numpy scalar in a checkpoint is code that safe loading refuses
                spec["bins"][name] = edges.tolist() if len(edges) > 1 else [float(edges[0]), float(edges[0]) + 1]
        elif name != target:  # index 0: a value never seen in training; index 1: missing
            vocabulary = sorted(set(distinct(table[name])[1].drop_null().to_pylist()))
            spec["categorical"][name] = ["<unseen>", "<missing>", *vocabulary]
    return spec


def encode(spec: dict, table: pa.Table, *, with_target: bool = True):
    """Table -> (numeric float32 (N, n_num), categorical int32 (N, n_cat), target) arrays, column by column. A class
    target is the class's index, MISSING_CLASS for a row without one, UNSEEN_CLASS for one unseen in training."""
    needed = [*spec["numeric"], *spec["categorical"], *([spec["target"]] if with_target else [])]
    absent = [name for name in needed if name not in table.column_names]
    if absent:
        raise cli.RecipeError(f"the table lacks column(s) the model was trained on: {', '.join(absent)}")
    numeric = np.zeros((table.num_rows, len(spec["numeric"])), dtype=np.float32)
    for j, (name, (mean, std)) in enumerate(spec["numeric"].items()):
        values = standardised(numbers(table[name], strict=False), mean, std)
        if np.isnan(values).all() and numbers(table[name], strict=True) is None:  # words, and not one number
            indices, words = distinct(table[name])
            if pc.is_valid(words).to_numpy(zero_copy_only=False)[indices].sum() > 1:  # (one cell's word: a typo)
                raise cli.RecipeError(f"column {name!r} holds no numbers, but it did in training: another table's "
                                      "column?")
        if (far := np.abs(values) > FAR).any():  # (NaN is never far) 1e39 was inf in float32, then a NaN loss
            print(f"warning: column {name!r}: {far.sum():,} value(s) over {FAR:,.0f} standard deviations from its "
                  f"training mean, taken as {FAR:,.0f}", file=sys.stderr)
        numeric[:, j] = np.where(np.isnan(values), 0.0, values.clip(-FAR, FAR))  # a missing number: the training mean
    categorical = np.zeros((table.num_rows, len(spec["categorical"])), dtype=np.int32)
    for j, (name, vocabulary) in enumerate(spec["categorical"].items()):
        indices, words = distinct(table[name])
        known = pa.array(vocabulary[2:], pa.string())  # typed: a column missing in every training row has none
        codes = pc.fill_null(pc.add(pc.index_in(words, value_set=known), 2), 0)  # unseen: 0
        categorical[:, j] = pc.if_else(pc.is_null(words), 1, codes).to_numpy()[indices]  # missing: 1
        unseen = int((categorical[:, j] == 0).sum())
        new = words.filter(pc.and_(pc.equal(codes, 0), pc.is_valid(words)))  # the values unseen (not missing)
        respelled = new.filter(pc.is_in(pc.utf8_lower(new), value_set=pc.utf8_lower(known)))  # "True" for "true"
        if len(respelled) or unseen >= 10 and unseen > table.num_rows // 2 and len(vocabulary) > 2:
            example = (respelled if len(respelled) else new)[0].as_py()
            seen = ", ".join(map(repr, vocabulary[2:5])) + (", ..." if len(vocabulary) > 5 else "")
            print(f"warning: column {name!r}: {unseen:,} of {table.num_rows:,} values never seen in training (such "
                  f"as {example!r}; training's: {seen}), read as unseen", file=sys.stderr)
    if not with_target:
        return numeric, categorical, None
    if spec["task"] == "classification":
        # the classes' spelling rule is the training rows': a rare word in these rows must not turn "01" into text
        classes = class_names(pa.array(spec["classes"]))  # one spelling, for runs that recorded "1.0" too
        if len(classes[1].unique()) < len(spec["classes"]):  # "1" and "1.0" were two classes: no mapping is right
            raise cli.RecipeError(f"this run's classes {spec['classes']} name one class twice; train a new run")
        as_numbers = numbers(pa.array(spec["classes"]), strict=True) is not None
        indices, words = class_names(table[spec["target"]], as_numbers)
        codes = pc.fill_null(pc.index_in(words, value_set=classes[1].take(classes[0])), UNSEEN_CLASS)
        target = pc.if_else(pc.is_null(words), MISSING_CLASS, codes).to_numpy()[indices]
        return numeric, categorical, target.astype(np.int64)
    values = numbers(table[spec["target"]], strict=False)
    if (missing := np.isnan(values)).any():  # a regression loss has no row to leave out, as a class one has
        raise cli.RecipeError(f"target column {spec['target']!r} has {missing.sum():,} missing or non-numeric "
                              f"value(s) (the first in data row {missing.argmax() + 1}); fill them in, or remove "
                              "those rows")
    return numeric, categorical, standardised(values, spec["target_mean"], spec["target_std"]).astype(np.float32)


def unseen_as_missing(target: np.ndarray, classification: bool) -> np.ndarray:
    """Mark the rows of a class unseen in training MISSING_CLASS, in place: no loss can be taken on them, so the loss
    and evaluate() leave them out. Which rows they were (none for a regression, whose targets are numbers)."""
    unseen = target == UNSEEN_CLASS if classification else np.zeros(len(target), dtype=bool)
    target[unseen] = MISSING_CLASS
    return unseen


class TabularDataset(Dataset):
    """The map-style Dataset: ``__len__`` and ``__getitem__`` over tensors built once, and ``__getitems__``,
    which the DataLoader calls (when present) with a whole batch of indices: one indexing operation per
    tensor instead of a Python call per row and a collate that stacks them."""

    def __init__(self, numeric: np.ndarray, categorical: np.ndarray, target: np.ndarray):
        self.numeric = torch.from_numpy(numeric)
        self.categorical = torch.from_numpy(categorical)
        self.target = torch.from_numpy(target)

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, idx: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.numeric[idx], self.categorical[idx], self.target[idx]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self[torch.as_tensor(indices)]


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


# Numeric features, embedded (Gorishniy, Rubachev and Babenko, "On Embeddings for Numerical Features in Tabular
# Deep Learning", NeurIPS 2022). A plain MLP fed raw numbers must bend a few ReLUs into every threshold a tree finds
# at once ("capital gain above 7,000"); giving it each number as a vector of features that already vary with it
# in many ways (which quantile bin, or sines of many frequencies) closes much of the gap to gradient boosting.


class PiecewiseLinear(nn.Module):
    """``ple``: a number as T values, one per quantile bin of the training split: 1 for a bin below it, 0 for one
    above it, its position within its own bin in between (x = 0.3 in a bin [0, 1) gives 0.3). The first bin is
    open below and the last above, so values beyond the training range still tell how far out they are."""

    def __init__(self, edges: list[list[float]]):
        super().__init__()
        bins = max(len(e) for e in edges) - 1  # a feature with fewer distinct quantiles gets padding bins: all 0
        left, width = torch.zeros(len(edges), bins), torch.ones(len(edges), bins)
        below, above, real = torch.zeros(len(edges), bins), torch.zeros(len(edges), bins), torch.zeros(len(edges), bins)
        for f, e in enumerate(edges):
            e, n = torch.tensor(e), len(e) - 1
            left[f, :n], width[f, :n] = e[:-1], e[1:] - e[:-1]
            below[f, 0], above[f, n - 1], real[f, :n] = 1, 1, 1
        # buffers: statistics, not parameters; they travel in the state_dict (and so in checkpoints and exports)
        for name, value in (("left", left), ("width", width), ("below", below), ("above", above), ("real", real)):
            self.register_buffer(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, F) -> (B, F, T)
        position = (x.unsqueeze(-1) - self.left) / self.width
        open_ends = self.below * position.clamp(max=0) + self.above * (position - 1).clamp(min=0)
        return (position.clamp(0, 1) + open_ends) * self.real


class Periodic(nn.Module):
    """``periodic``: a number as cos and sin of 2*pi*f*x for K trained frequencies f per feature, drawn from
    N(0, sigma^2) at first, a sigma for each (``sigmas``, (F, K)); sigma sets how finely the embedding can vary
    with x at the start."""

    def __init__(self, sigmas: torch.Tensor):
        super().__init__()
        self.frequencies = nn.Parameter(sigmas * torch.randn(sigmas.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, F) -> (B, F, 2K)
        angle = 2 * math.pi * self.frequencies * x.unsqueeze(-1)
        return torch.cat([torch.cos(angle), torch.sin(angle)], dim=-1)


class PerFeatureLinear(nn.Module):
    """A separate ``Linear`` for each feature, all in one batched matmul: (B, F, I) -> (B, F, O)."""

    def __init__(self, n_features: int, in_features: int, out_features: int):
        super().__init__()
        bound = 1 / math.sqrt(in_features)  # nn.Linear's initialisation, per feature
        self.weight = nn.Parameter(torch.empty(n_features, in_features, out_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n_features, out_features).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bfi,fio->bfo", x, self.weight) + self.bias


def frequency_spreads(spec: dict) -> torch.Tensor:
    """Periodic's initial sigmas, (F, K). A column whose values repeat (age in years, a capital gain that is mostly
    0) is half a category, which trees split between neighbouring values: its sigmas spread log-spaced up to
    PERIODIC_SIGMA_REPEATED, so the embedding can tell neighbours apart and still follow the trend. A continuous
    column (a value per row or two) keeps smooth ones, where high frequencies only memorise rows. Measured with
    benchmarks/tabular_sweep.py on tuning seeds: Adult 0.8605 -> 0.8691 (from 2,400 of its rows 0.8367 -> 0.8477;
    boosting 0.8675), wine as it was (every column spread: 0.9803 -> 0.9438). The paper tuned sigma 96 on Adult."""
    smooth = torch.full((PERIODIC_FREQUENCIES,), PERIODIC_SIGMA)
    spread = torch.logspace(math.log10(PERIODIC_SIGMA), math.log10(PERIODIC_SIGMA_REPEATED), PERIODIC_FREQUENCIES)
    repeats = spec.get("rows_per_value", {})  # checkpoints from before it have none: their weights load anyway
    return torch.stack([spread if repeats.get(name, 0) >= REPEATED_FROM else smooth for name in spec["numeric"]])


def numeric_embedding(kind: str, spec: dict, dim: int) -> nn.Module | None:
    """The embedding of the numeric features: encoding -> per-feature Linear -> ReLU, ``dim`` numbers each."""
    n = len(spec["numeric"])
    if kind == "none" or n == 0:
        return None
    encoding = (PiecewiseLinear([spec["bins"][name] for name in spec["numeric"]]) if kind == "ple" else
                Periodic(frequency_spreads(spec)))
    width = encoding.left.shape[1] if kind == "ple" else 2 * encoding.frequencies.shape[1]
    return nn.Sequential(encoding, PerFeatureLinear(n, width, dim), nn.ReLU(), nn.Flatten(1))


class TabularMLP(nn.Module):
    """Numeric features (embedded, or as they are) and one embedding per categorical column, concatenated, then
    [Linear -> LayerNorm -> ReLU -> Dropout] x depth, then a linear head."""

    def __init__(self, n_numeric: int, cardinalities: list[int], out_features: int,
                 hidden: int = 256, depth: int = 3, dropout: float = 0.5, numeric: nn.Module | None = None,
                 numeric_width: int | None = None):
        super().__init__()
        self.numeric = numeric if numeric is not None else nn.Identity()
        self.embeddings = nn.ModuleList(nn.Embedding(n, embedding_dim(n)) for n in cardinalities)
        with torch.no_grad():  # <unseen> never occurs in training (nor <missing>, if nothing was missing):
            for embedding in self.embeddings:  # zeros, a neutral input, instead of an untrained random vector
                embedding.weight[:2] = 0
        width = (numeric_width or n_numeric) + sum(embedding_dim(n) for n in cardinalities)
        layers = []
        for _ in range(depth):
            layers += [Linear(width, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = Linear(width, out_features)

    def forward(self, numeric: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        embedded = [embedding(categorical[:, i]) for i, embedding in enumerate(self.embeddings)]
        out = self.head(self.body(torch.cat([self.numeric(numeric), *embedded], dim=1)))
        return out.squeeze(-1) if out.shape[-1] == 1 else out  # regression: (B,)


def build_model(spec: dict, hidden: int, depth: int, dropout: float, num_embedding: str = "none") -> TabularMLP:
    out_features = len(spec["classes"]) if spec["task"] == "classification" else 1
    cardinalities = [len(vocabulary) for vocabulary in spec["categorical"].values()]
    numeric = numeric_embedding(num_embedding, spec, EMBEDDING_WIDTH)
    width = EMBEDDING_WIDTH * len(spec["numeric"]) if numeric is not None else None
    return TabularMLP(len(spec["numeric"]), cardinalities, out_features, hidden, depth, dropout, numeric, width)


def model_from_checkpoint(checkpoint: dict, source: Path) -> TabularMLP:
    """The model a checkpoint describes, with its weights: for --predict and scripts/export.py."""
    try:
        config, spec = checkpoint["config"], saved_features(checkpoint, source)
        embedding = config.get("num_embedding_used", config["num_embedding"])  # what --num-embedding auto chose
        model = build_model(spec, config["hidden"], config["depth"], config["dropout"], embedding)
    except KeyError as err:
        raise cli.RecipeError(f"checkpoint {source} lacks {err} in its options or features: another version of "
                              "this recipe wrote it") from None
    except (TypeError, ValueError, RuntimeError) as err:  # a width that is no count, say
        raise cli.RecipeError(f"checkpoint {source} is damaged: its model cannot be rebuilt ({err})") from None
    load_model_state(model, checkpoint["model"], source)
    return model


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay only weight matrices: shrinking biases, norm gains, embeddings or frequencies towards zero only hurts."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding | Periodic) for p in m.parameters()}
    # by name as well as shape: a per-feature layer's bias is a matrix too (one bias vector per feature)
    matrices = {id(p) for name, p in model.named_parameters() if p.ndim >= 2 and not name.endswith("bias")}
    decay = [p for p in model.parameters() if id(p) in matrices - embeddings]
    no_decay = [p for p in model.parameters() if id(p) not in matrices - embeddings]
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
    takes a closure; one full batch, in fp32. The line search compares those evaluations, so they must be of
    one function: every one draws the same dropout masks."""
    *inputs, target = to_device(micro_batches[0], device)
    seed = int(torch.randint(2**62, ()))  # one draw per step: the global RNG moves on as with other optimizers

    def closure():
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(*inputs), target)
            loss.backward()
        return loss

    return StepStats(optimizer.step(closure).detach())


# ----------------------------------------------------------------------------------------------------
# Prediction


def output_columns(task: str) -> tuple[str, ...]:
    """The columns ``predict`` appends to each row."""
    return ("prediction", "probability") if task == "classification" else ("prediction",)


def saved_features(checkpoint: dict, source: Path) -> dict:
    """The preprocessing a checkpoint holds (``fit_features``'), its columns where this recipe puts them."""
    if "features" not in checkpoint:  # (a training resume reads it before any try that would say so)
        raise cli.RecipeError(f"checkpoint {source} lacks 'features' in its options or features: another version of "
                              "this recipe wrote it")
    spec = checkpoint["features"]
    if not (isinstance(spec, dict) and all(isinstance(spec.get(part), dict) for part in ("numeric", "categorical"))
            and spec.get("task") in ("classification", "regression")):
        raise cli.RecipeError(f"checkpoint {source} is damaged: its features name no columns as this recipe does")
    return spec


@torch.no_grad()
def predict(checkpoint_path: Path, table_path: Path, output: Path, device: torch.device) -> int:
    """Write ``output`` (CSV, or Parquet if so named): the rows of ``table_path`` with the model's prediction appended
    to each."""
    checkpoint = load_checkpoint(checkpoint_path, RECIPE)
    model = model_from_checkpoint(checkpoint, checkpoint_path).to(device).eval()
    spec = saved_features(checkpoint, checkpoint_path)
    # the model's columns are read as features; any other (an ID of bytes, a column of lists) is kept as it is
    table = read_table(table_path, checked=[*spec["numeric"], *spec["categorical"]])
    if taken := [name for name in output_columns(spec["task"]) if name in table.column_names]:
        raise cli.RecipeError(f"{table_path} already has a column {taken[0]!r}, which the output adds; rename it")
    numeric, categorical = (torch.from_numpy(a) for a in encode(spec, table, with_target=False)[:2])
    for name in spec["numeric"]:  # a word in a numeric column is read as missing, as in training: say so here too
        if not pa.types.is_integer(table[name].type) and not pa.types.is_floating(table[name].type):
            stray, present, strays = stray_words(table[name])
            if stray:
                print(f"warning: column {name!r}: {stray:,} of {present:,} values are not numbers (such as "
                      f"{strays[0]!r}), read as missing: the training mean"
                      + (f"; {WRITE_PLAIN}" if written_for_people(strays) else ""), file=sys.stderr)
    # in slices: the activations of a million rows at once would not fit in memory
    out = torch.cat([model(x.to(device), c.to(device)).float().cpu()
                     for x, c in zip(numeric.split(65536), categorical.split(65536), strict=True)])
    if spec["task"] == "classification":
        confidence, index = out.softmax(-1).max(-1)
        table = table.append_column("prediction", pa.array(spec["classes"]).take(index.numpy()))
        table = table.append_column("probability", pc.round(pa.array(confidence.numpy()), 4))
    else:
        table = table.append_column("prediction", pa.array(out.double().numpy() * spec["target_std"]
                                                           + spec["target_mean"]))
    # Whole or not at all: an earlier file survives a failure. The temporary file has a name of its own, made new
    # ("x"), so that a user's file named .OUT.tmp is neither written over nor removed.
    tmp = output.with_name(f".{output.name[:40]}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
    try:
        with open(tmp, "xb") as f:  # as read: .parquet, .tsv (tabs), else CSV; .gz compressed
            name = output.name.lower()
            if name.endswith(".parquet"):  # a CSV's cells as text, as spelled: a type guessed here could drop a
                pq.write_table(table, f)       # code's leading zeros or round a long ID
            else:
                with pa.CompressedOutputStream(f, "gzip") if name.endswith(".gz") else pa.PythonFile(f, "w") as out:
                    delimiter = "\t" if name.removesuffix(".gz").endswith(".tsv") else ","
                    pacsv.write_csv(table, out, pacsv.WriteOptions(delimiter=delimiter))
        tmp.replace(output)
    except BaseException as err:  # a failed write, or Ctrl-C or SIGTERM in the middle of one: no partial file left
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise cli.RecipeError(f"cannot write {output}: {err.strerror or err}") from None
        if isinstance(err, pa.ArrowException):  # a column of lists, kept from the input: CSV has no such cell
            raise cli.RecipeError(f"cannot write {output}: {err}; name it .parquet") from None
        raise
    return table.num_rows


# ----------------------------------------------------------------------------------------------------
# Training


def default_batch_size(rows: int) -> int:
    """256 rows per step, or a 16th of a small table's training rows (at least 16): a table of a few hundred rows
    still takes 16 steps an epoch (at 256 it would take one)."""
    return min(256, max(16, rows // 16))


def default_epochs(steps_per_epoch: int, optimizer_name: str) -> int:
    """10 epochs, or more on a small table: enough for MIN_STEPS optimizer steps (on 150 rows, 120 of them training
    rows, 10 epochs are 70 steps of 16: too few to train). Chosen on Adult, wine and diabetes
    (benchmarks/tabular_sweep.py). LBFGS, one full-batch step an epoch: LBFGS_STEPS. Its best validation score came
    at step 7 on wine, at steps 50, 57, 48 of 200 on diabetes (seeds 0-2); MIN_STEPS of them took 6.7 minutes on wine
    and wrote 12 GB of checkpoints."""
    return LBFGS_STEPS if optimizer_name == "lbfgs" else max(10, math.ceil(MIN_STEPS / steps_per_epoch))


def auto_embedding(task: str, train_rows: int) -> str:
    """--num-embedding auto: periodic, except for a regression on fewer than EMBED_REGRESSION_FROM training rows.
    Measured with benchmarks/tabular_sweep.py (tuning seeds, dropout 0.5): periodic embeddings lift classification
    at every size tried (Adult's income from 2,400 and 6,400 rows: +0.4 and +0.5 points over the numbers as they
    are; 24,000 rows: +0.9 at dropout 0.1; wine even) but overfit a small regression (diabetes, 354 rows: RMSE
    65.6 against 57.4; Adult's age from 2,400 rows: 10.46 against 10.09); from 6,400 rows even (9.80 and 9.81),
    from Adult's 24,000 rows they help there too (9.84 against 9.89)."""
    return "periodic" if task == "classification" or train_rows >= EMBED_REGRESSION_FROM else "none"


def load_tables(csv_path: Path | None, target: str, data_dir: Path, drop: list[str] | None,
                trained_on: list[str]) -> tuple[pa.Table, pa.Table | None]:
    """The table to train on (``--csv``, else Adult's training file) and a test table (Adult's), checked to hold
    ``target``, without the ``--drop`` columns and a row index, unless a resumed run's model reads it (``trained_on``:
    its columns; a run from before the index was left out)."""
    if target in (drop or []):
        raise typer.BadParameter(f"{target!r} is the target", param_hint="--drop")
    table, test_table = (read_table(csv_path, drop), None) if csv_path is not None else load_adult(data_dir)
    table = without(table, drop) if csv_path is None else table  # an ID, a leak: a column that is no feature
    if target not in table.column_names:
        header = table.column_names
        hint = next((f": is it {name}-separated? name a tab-separated file .tsv" if sep == "\t" else
                     f": is it {name}-separated? only .tsv files are read with another delimiter than ','"
                     for sep, name in (("\t", "tab"), (";", "semicolon")) if len(header) == 1 and sep in header[0]), "")
        raise cli.RecipeError(f"target column {target!r} is not in the table (columns: {', '.join(header)}){hint}")
    if table.column_names[0] in ("", "Unnamed: 0") and target != table.column_names[0]:
        # pandas' to_csv() writes the row index as a first column without a name ("Unnamed: 0" once read back and
        # saved again): row numbers are no feature (in a file sorted by label they predict it; new rows' do not)
        print(f"note: the first column, {table.column_names[0]!r}, left out: a row index, as pandas writes it "
              "without a name", file=sys.stderr)
        table = table.drop_columns([table.column_names[0]])
    if index := [name for name in table.column_names if re.fullmatch(r"__index_level_\d+__", name)
                 and name != target and name not in trained_on]:
        # pandas' to_parquet() stores a row index it made (after a filter or a sort) as a column: no feature either
        print(f"note: column(s) {', '.join(index)} left out: a row index pandas stored in the Parquet file",
              file=sys.stderr)
        table = table.drop_columns(index)
    if table.num_columns == 1:  # an MLP of no inputs: nothing to learn the target from
        raise cli.RecipeError(f"{csv_path} has no feature columns besides the target {target!r}: add the columns "
                              "to predict it from")
    return table, test_table


def fold_of_each_row(table: pa.Table, target: str, task: str, folds: int, seed: int) -> np.ndarray:
    """``--cv``: a fold number per row, stratified for classification: each class's rows, in a seeded random
    order, are dealt to the folds in turn, so every fold holds each class in the table's proportions."""
    order = torch.randperm(table.num_rows, generator=torch.Generator().manual_seed(seed)).numpy()
    if task == "classification":
        indices, words = class_names(table[target])  # "1", " 1" and "1.0": one class, as training reads them
        labels = pc.dictionary_encode(words.take(pa.array(indices))).indices.fill_null(-1).to_numpy()
        order = order[np.argsort(labels[order], kind="stable")]
    fold = np.empty(table.num_rows, dtype=np.int64)
    fold[order] = np.arange(table.num_rows) % folds
    return fold


def main(
    csv_path: Annotated[
        Path | None, typer.Option("--csv", parser=cli.given_path, metavar="<path>",
                                  help="Train on this table: .csv or .tsv with a header row (also .gz), .parquet.")
    ] = None,
    target: Annotated[str | None, typer.Option(help="Column to predict [default: income, for Adult].")] = None,
    task: Annotated[
        Literal["auto", "classification", "regression"],
        typer.Option(help="auto: classification for a text target or a few integer values, else regression."),
    ] = "auto",
    drop: Annotated[list[str] | None, typer.Option(metavar="<column>", help="A column that is no feature (an ID, a "
                                                                             "leak); repeat it for more.")] = None,
    val_frac: Annotated[float, typer.Option(min=0.01, max=0.9, help="Share of rows held out for validation.")] = 0.2,
    cv: Annotated[int | None, typer.Option(min=2, help="K-fold cross-validation (stratified for classes): K runs, "
                                                        "each validated on its own fold, in RUN_DIR/fold-0...")] = None,
    epochs: Annotated[int | None, typer.Option(min=1, help="Passes over the training rows [default: 10; on a small "
                                                          f"table enough for {MIN_STEPS} steps; lbfgs {LBFGS_STEPS}]."
                                               )] = None,
    max_steps: cli.MaxSteps = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Rows per step [default: 256; on a small table a "
                                                              "16th of its training rows, at least 16; lbfgs: all].")
                          ] = None,
    lr: Annotated[float | None, typer.Option(
        callback=cli.positive_float, help="Learning rate [default: 3e-3; sgd 0.05; lbfgs 1].")] = None,
    optimizer_name: Annotated[
        Literal["adamw", "adam", "sgd", "lbfgs"],
        typer.Option("--optimizer", help="lbfgs trains full-batch: for small tables only."),
    ] = "adamw",
    weight_decay: Annotated[
        float, typer.Option(callback=cli.finite_non_negative,
                            help="Weight decay on weight matrices (decoupled in adamw, L2 in adam/sgd).")
    ] = 0.01,
    max_grad_norm: Annotated[float, typer.Option(min=0.0, help="Gradient clipping norm (0: off).")] = 1.0,
    num_embedding: Annotated[
        Literal["auto", "none", "ple", "periodic"],
        typer.Option(help="Numeric columns as they are, or embedded: piecewise-linear on quantile bins, periodic; "
                          "auto: periodic, but none for a regression on under 10,000 training rows."),
    ] = "auto",
    hidden: Annotated[int, typer.Option(min=1, help="Width of the hidden layers.")] = 256,
    depth: Annotated[int, typer.Option(min=1, max=1000, help="Number of hidden layers.")] = 3,
    # 0.5: on Adult as good as 0.1 (0.8605 and 0.8613, tuning seeds), on smaller tables far better (Adult's income
    # from 2,400 rows: 0.8520 against 0.8350; diabetes: RMSE 57.4 against 64.3)
    dropout: Annotated[float, typer.Option(min=0.0, max=0.9, help="Dropout after each hidden layer.")] = 0.5,
    predict_csv: Annotated[
        Path | None, typer.Option("--predict", parser=cli.given_path, metavar="<path>",
                                  help="Only predict: rows of this table (as --csv), with the model from --resume; "
                                       "written as --output says.")
    ] = None,
    output: Annotated[Path | None, typer.Option(parser=cli.given_path, metavar="<path>",
                                                help="Predictions file: .csv, .tsv (either gzipped if named .gz) or "
                                                     ".parquet [default: PREDICT's last suffix replaced: new.csv -> "
                                                     "new.predictions.csv].")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="With --predict: replace the --output file if it "
                                                                "exists.")] = False,
    seed: cli.Seed = 0,
    device: cli.Device = "auto",
    precision: cli.Precision = "fp32",
    compile: cli.Compile = False,
    num_workers: cli.NumWorkers = 0,
    data_dir: cli.DataDir = Path("data"),
    run_dir: cli.RunDir = None,
    resume: cli.Resume = None,
    config_file: cli.ConfigFile = None,
    checkpoint_every: cli.CheckpointEvery = None,
    log_every: cli.LogEvery = None,
    profile: cli.Profile = None,
    keep_best: cli.KeepBest = 1,
    patience: cli.Patience = None,
):
    """Train an MLP on a CSV table (default: UCI Adult census income), or predict with a trained one."""
    if predict_csv is not None:
        if unused := [name for name in locals() if name not in ("predict_csv", "output", "overwrite", "resume",
                                                                 "device") and cli.option_given(name)]:
            raise typer.BadParameter("predicts with the checkpoint's model, columns and options, on --device: not "
                                     f"{', '.join(map(cli.option_name, unused))}", param_hint="--predict")
        if resume is None or resume == "auto":
            raise typer.BadParameter("give the checkpoint to predict with, e.g. --resume .../best.pt",
                                     param_hint="--resume")
        if not predict_csv.name:  # '' and '.' (a folder otherwise: reading it says so)
            raise cli.RecipeError(f"{predict_csv} is a directory, not a table file")
        output = output or predict_csv.with_suffix(".predictions.csv")
        if output.is_dir() or not output.name:
            raise cli.RecipeError(f"--output {output} is a directory; give the path of the file to write")
        if output.resolve() == predict_csv.resolve():
            raise typer.BadParameter("is the table to predict, whose rows it would replace: choose another file",
                                     param_hint="--output")
        if output.resolve() == Path(resume).resolve():
            raise typer.BadParameter("is the checkpoint to predict with, which it would replace: choose another file",
                                     param_hint="--output")
        if not output.name.lower().endswith((".csv", ".tsv", ".csv.gz", ".tsv.gz", ".parquet")):
            raise typer.BadParameter(f"{output}: name a .csv, .tsv, .csv.gz, .tsv.gz or .parquet file",
                                     param_hint="--output")
        if output.exists() and not overwrite:
            raise cli.RecipeError(f"{output} exists; choose another --output, or add --overwrite to replace it")
        n = predict(Path(resume), predict_csv, output, resolve_device(device))
        print(f"done: predictions={n} output={output}")
        return
    if output is not None or overwrite:
        raise typer.BadParameter("is for --predict; training writes into its run directory",
                                 param_hint="--output" if output is not None else "--overwrite")
    if optimizer_name == "lbfgs":
        if precision in ("bf16", "fp16"):
            raise typer.BadParameter("lbfgs needs fp32: its line search compares losses too closely for autocast",
                                     param_hint="--precision")
        if batch_size is not None:
            raise typer.BadParameter("lbfgs trains on the whole table at once; leave --batch-size out",
                                     param_hint="--batch-size")
        if cli.option_given("weight_decay"):  # it was ignored, and recorded as if applied
            raise typer.BadParameter("lbfgs minimises the loss as it is, with no decay; leave it out",
                                     param_hint="--weight-decay")
        if cli.option_given("max_grad_norm"):
            raise typer.BadParameter("lbfgs takes its step from its line search, unclipped; leave it out",
                                     param_hint="--max-grad-norm")
    if cv is not None and resume not in (None, "auto"):
        raise typer.BadParameter("--cv resumes every fold with --resume auto", param_hint="--resume")
    if cv is not None and cli.option_given("val_frac"):  # it would do nothing
        raise typer.BadParameter("is for one split; --cv validates on each fold in turn", param_hint="--val-frac")
    if target is not None and not target.strip():  # an unset shell variable, say: it read as "income" (Adult's)
        raise typer.BadParameter("is empty: give a column name", param_hint="--target")
    target = target or (None if csv_path else "income")  # Adult's
    if csv_path is not None and target is None:
        raise typer.BadParameter("--csv needs --target COLUMN", param_hint="--target")
    drop = list(dict.fromkeys(drop)) if drop else None  # each once, as a resume compares it
    options = {k: v for k, v in locals().items() if k not in ("predict_csv", "output", "overwrite")}
    if cv is None:
        train(**options, fold=None)
        return
    # K-fold cross-validation: K runs in RUN_DIR/fold-0 ... fold-(K-1), each its own resumable run; a relaunch
    # with --resume auto skips the folds that have finished and resumes the one that was cut short.
    parent = open_run_dir(RECIPE, run_dir, resume, holds_runs=True)
    scores = [train(**options | {"run_dir": parent.path / f"fold-{k}"}, fold=k) for k in range(cv)]
    name = "val_acc" if "val_acc" in scores[0] else "val_rmse"
    values = np.array([score[name] for score in scores])
    summary = {"recipe": RECIPE, "cv": cv, "metric": name, "folds": values.tolist(), f"mean_{name}": values.mean(),
               f"std_{name}": values.std(ddof=1)}
    write_json(parent.path / "metrics.json", summary)
    print(f"cross-validation: {name} per fold {' '.join(f'{v:.4f}' for v in values)}")
    print(f"done: {name}={values.mean():.4f}±{values.std(ddof=1):.4f} folds={cv} run_dir={parent.path}")


def train(csv_path: Path | None, target: str, task: str, drop: list[str] | None, val_frac: float, cv: int | None,
          fold: int | None, epochs: int | None, max_steps: int | None, batch_size: int | None, lr: float | None,
          optimizer_name: str, weight_decay: float, max_grad_norm: float, num_embedding: str, hidden: int, depth: int,
          dropout: float, seed: int, device: str, precision: str, compile: bool, num_workers: int, data_dir: Path,
          run_dir: Path | None, resume: str | None, config_file: Path | None, checkpoint_every: int | None,
          log_every: int | None, profile: int | None, keep_best: int, patience: int | None) -> dict:
    """One training run: on a seeded split of --val-frac, or with ``fold`` (of ``cv``) held out. Its metrics."""
    config = cli.as_config(locals())  # every option as resolved: config.json, and what a resume must match
    config["csv_path"] = same_file(csv_path)  # the file, absolute: a resume from another folder compares that one
    # --lr left out is the optimizer's own: recorded apart, so a replay with another --optimizer takes that one's
    lr = config["lr_used"] = lr or DEFAULT_LR[optimizer_name]
    run = open_run_dir(RECIPE, run_dir, resume)  # never over another run's checkpoints; one run at a time in it
    checkpoint = resume_checkpoint(run, RECIPE, config, may_change={"keep_best", "patience", "lr", "csv_path"})
    if checkpoint:  # the rate, given or default, must match ("lr" alone: older runs recorded a default --lr resolved)
        saved = checkpoint["config"]  # (one without an lr is refused as another rate); and the table, as the file it
        check_same_run({"config": {"lr": saved.get("lr_used", saved.get("lr")),  # is: its absolute path, say, goes on
                                   "csv_path": same_file(saved.get("csv_path"))}},
                       run.resume_from, {"lr": lr, "csv_path": config["csv_path"]})
    if already_finished(run, checkpoint, max_steps=max_steps,  # (one of no epoch length: refused at its restore)
                        epochs=epochs or checkpoint and default_epochs(checkpoint.get("steps_per_epoch") or 1,
                                                                       optimizer_name)):
        return json.loads((run.path / "metrics.json").read_text())
    seed_everything(seed)
    device = resolve_device(device)
    chosen = resolve_precision(precision, device, checkpoint)  # --precision auto: bf16 where native
    if optimizer_name == "lbfgs" and chosen.precision_used != "fp32":  # auto's bf16 (bf16 or fp16 given: refused)
        chosen = chosen._replace(precision_used="fp32", precision_reason="auto: lbfgs needs fp32")
    config |= chosen._asdict()  # the option as given, the precision it runs in, and why
    precision = chosen.precision_used

    # Data: a table -> preprocessing fitted on the training split -> tensors
    resumed = saved_features(checkpoint, run.resume_from) if checkpoint else None  # the preprocessing it fitted
    table, test_table = load_tables(csv_path, target, data_dir, drop,
                                    [*resumed["numeric"], *resumed["categorical"]] if resumed else [])
    task = target_task(table[target], target, task)  # the whole column's: every fold learns the same task
    if clash := [name for name in output_columns(task) if name in table.column_names and name != target]:
        raise cli.RecipeError(f"feature column {clash[0]!r} is named like a column that --predict adds, so no table "
                              "could be predicted on: rename it")
    if task == "classification":  # a row without a class is in no split: its loss would be skipped, not its batch
        indices, words = class_names(table[target])
        labelled = pc.is_valid(words).to_numpy(zero_copy_only=False)[indices]
        if no_class := int((~labelled).sum()):  # "None" may be a class to you: the note says how it was read
            print(f"note: {no_class:,} of {table.num_rows:,} rows have no {target!r} (empty, or a word such as NA, "
                  "null or None) and are left out of training and validation", file=sys.stderr)
            table = table.filter(labelled)
    if fold is None:
        order = torch.randperm(table.num_rows, generator=torch.Generator().manual_seed(seed)).numpy()
        n_val = max(1, round(val_frac * table.num_rows))
        if table.num_rows - n_val < 2:
            raise cli.RecipeError(f"{table.num_rows} rows are too few to split off {val_frac:.0%} for validation")
        train_rows, val_rows = order[n_val:], order[:n_val]
    else:
        if table.num_rows < 2 * cv:
            raise cli.RecipeError(f"{table.num_rows} rows are too few for {cv} folds (--cv)")
        folds = fold_of_each_row(table, target, task, cv, seed)
        train_rows, val_rows = np.flatnonzero(folds != fold), np.flatnonzero(folds == fold)
    spec = resumed or fit_features(
        table.take(train_rows), target, task, bins=PLE_BINS if num_embedding == "ple" else 0,
        rows=f" in fold {fold}'s training rows (--cv {cv})" if cv else " in the training split (--val-frac)")
    classification = spec["task"] == "classification"
    if num_embedding == "auto":  # periodic, or none for a small regression (a resume has the same task and rows);
        # --cv: the same for every fold, whose training rows may differ by one across the threshold
        num_embedding = auto_embedding(spec["task"], len(train_rows) if fold is None else len(table) * (cv - 1) // cv)
    config["num_embedding_used"] = num_embedding
    arrays = encode(spec, table)  # every row at once, then split: the statistics are the training split's
    if classification and (arrays[2].take(val_rows) < 0).all():  # every class unseen in training: no score to take
        raise cli.RecipeError(f"no validation row's {target!r} is a class seen in training ({len(spec['classes'])} "
                              "classes): an ID column? choose another --target")
    unseen = int(unseen_as_missing(arrays[2], classification).take(val_rows).sum())  # wrong in val_acc, below
    train_set = TabularDataset(*(a.take(train_rows, axis=0) for a in arrays))  # take: 4x faster than a[rows]
    val_set = TabularDataset(*(a.take(val_rows, axis=0) for a in arrays))
    del table, arrays  # the text columns are no longer needed
    # lbfgs: the whole training split in one batch; otherwise --batch-size (or all rows of a table of fewer)
    full_batch = len(train_set) if optimizer_name == "lbfgs" else min(batch_size or default_batch_size(len(train_set)),
                                                                      len(train_set))
    train_loader = make_loader(train_set, full_batch, train=True, seed=seed, num_workers=num_workers, device=device,
                               collate_fn=built_batch)
    val_loader = make_loader(val_set, 1024, train=False, num_workers=num_workers, device=device, collate_fn=built_batch)

    model = build_model(spec, hidden, depth, dropout, num_embedding).to(device)
    if compile:
        model = torch.compile(model)
    optimizer = make_optimizer(optimizer_name, model, lr, weight_decay)
    # Per-epoch schedule: drop the learning rate 10x at 50% and again at 75% of the epochs. With few epochs the
    # two coincide (MultiStepLR would then apply both drops at once) or fall on epoch 0 (a drop before training).
    epochs = epochs or default_epochs(len(train_loader), optimizer_name)
    milestones = sorted({m for m in (epochs // 2, epochs * 3 // 4) if m > 0})
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=0.1)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    # a -1 target (a class unseen in training) is skipped, not trained on
    loss_fn = nn.CrossEntropyLoss(ignore_index=-1) if classification else nn.MSELoss()
    step_fn = lbfgs_step if optimizer_name == "lbfgs" else train_step

    steps_per_epoch = len(train_loader)
    total_steps = min(epochs * steps_per_epoch, max_steps or math.inf)
    log = RunLog(run, RECIPE, total_steps=total_steps, every=log_interval(steps_per_epoch, log_every),
                 steps_per_epoch=steps_per_epoch)
    best = BestScore("val_acc") if classification else BestScore("val_rmse", higher_is_better=False)
    kept, early_stop = BestCheckpoints(keep_best, best), EarlyStopping(patience or math.inf)  # --keep-best, --patience
    checkpoints = Checkpointer(run, RECIPE, config, model=model, optimizer=optimizer, scheduler=scheduler,
                               scaler=scaler, loader_generator=train_loader.generator, steps_per_epoch=steps_per_epoch,
                               parts={"log": log, "best": best, "kept": kept, "patience": early_stop},
                               data={"features": spec},  # and a resume on other rows is refused:
                               data_id=checksum(train_set.numeric, train_set.categorical, train_set.target))
    step = checkpoints.restore(checkpoint) if checkpoint else 0
    log.start(step, config, device)
    if checkpoint and best.step == step:  # a kill may have come between this step's last.pt and best.pt
        checkpoints.save(step, "best.pt")
    if checkpoint and keep_best > 1 and any(k.step == step for k in kept.kept):  # best-stepN.pt too, kept
        checkpoints.save(step, f"best-step{step}.pt")
    if keep_best > 1:  # resumed with a larger --keep-best: a smaller one's evaluations have no file (except this one's)
        kept.kept = [k for k in kept.kept if (run.path / "checkpoints" / f"best-step{k.step}.pt").is_file()]
    kind = f"{len(spec['classes'])} classes" if classification else "regression"
    source = csv_path.resolve() if csv_path else (data_dir / "adult").resolve()
    log.print(f"{len(train_set)} train / {len(val_set)} val rows{f' (fold {fold} of {cv})' if cv else ''} of "
              f"{source} | {len(spec['numeric'])} numeric ({num_embedding}) + {len(spec['categorical'])} categorical "
              f"columns | {kind}")
    if unseen:
        log.print(f"{unseen} validation rows hold a class unseen in training: val_acc counts them as wrong")
    stop = StopRequest()  # Ctrl-C and SIGTERM: save and exit at the end of the step
    profiler = StepProfiler(run.path, profile, device)  # --profile N
    resume_dir = run.path.parent if cv else run.path  # a cross-validation resumes as a whole

    def validate(weights: nn.Module, loader=val_loader, unseen=unseen) -> dict[str, float]:
        # a regression in fp32, as --predict runs it: bf16's 8-bit mantissa rounds the outputs, and so the RMSE
        metrics = evaluate(weights, loader, loss_fn, device=device, precision=precision if classification else "fp32",
                           accuracy=classification)
        if not classification:  # RMSE in the target's own units, from the loss: the MSE (another loss, its own pass)
            metrics["rmse"] = math.sqrt(metrics["loss"]) * spec["target_std"]
        elif unseen:  # evaluate left out the rows of a class unseen in training: they count as wrong
            counted = int((loader.dataset.target >= 0).sum())
            metrics["acc"] = metrics["acc"] * counted / (counted + unseen)
        return metrics

    stopped_early = early_stop.stopped and step < total_steps  # killed after its early stop's checkpoint: done
    for epoch in () if stopped_early else epochs_left(step, steps_per_epoch, total_steps, log.evaluated_at):
        train_loader.sampler.set_epoch(epoch)
        for batch in batches_left(train_loader, step, total_steps):
            current_lr = scheduler.get_last_lr()[0]
            stats = step_fn(model, optimizer, loss_fn, [batch], device=device, precision=precision, scaler=scaler,
                            max_grad_norm=max_grad_norm)
            step += 1
            log.train(step, stats, lr=current_lr, items=len(batch[-1]))
            profiler.step()
            if step % steps_per_epoch == 0:
                scheduler.step()  # a per-epoch schedule: once, after the epoch's last optimizer step
            # mid-epoch checkpoints (an epoch's last step, and the run's, are saved after the evaluation)
            elif step < total_steps and (stop.requested or checkpoint_every and step % checkpoint_every == 0):
                checkpoints.save(step)
                if stop.requested:
                    stop.exit(step, resume_dir)
        log.flush()  # the training steps' time ends here: evaluating is not training
        val = validate(model)
        log.eval(step, val=val)
        score = val["acc"] if classification else val["rmse"]
        improved = best.improved(score, step)
        keep, dropped = kept.update(score, step)
        for old in dropped:  # (also those of a larger --keep-best that this resume lowered)
            (run.path / "checkpoints" / f"best-step{old}.pt").unlink(missing_ok=True)
        stopped_early = early_stop.exhausted(improved) and step < total_steps
        checkpoints.save(step)  # first: if the step is the best, last.pt says so (and a resume here writes best.pt)
        if improved:
            checkpoints.save(step, "best.pt")
        if keep_best > 1 and keep:  # --keep-best K: the K best as best-stepN.pt too
            checkpoints.save(step, f"best-step{step}.pt")
        if stopped_early:  # before a stop request: the run is over, and metrics.json is to say so
            log.print(f"stopping early: no better score in {patience} evaluations (the best: step {best.step})")
            break
        if stop.requested:
            stop.exit(step, resume_dir)
    stop.loop_ended(step, resume_dir)  # from here a signal exits at once: the run's last step is saved

    # The test set, once, with the weights that best.pt holds: the model a user deploys is the one scored.
    test = {}
    if test_table is not None:  # Adult's official test file
        best_path = run.path / "checkpoints" / "best.pt"
        load_model_state(model, load_checkpoint(best_path, RECIPE)["model"], best_path)
        *features, labels = encode(spec, test_table)
        unseen_in_test = int(unseen_as_missing(labels, classification).sum())  # --target hours, say: a rare value
        test_loader = make_loader(TabularDataset(*features, labels), 1024, train=False, collate_fn=built_batch)
        test = validate(model, test_loader, unseen=unseen_in_test)
    test = {f"test_{k}": v for k, v in test.items()}
    return log.finish(step, best.metrics() | {"stopped_early": stopped_early} | test)


if __name__ == "__main__":
    cli.run_recipe(main)

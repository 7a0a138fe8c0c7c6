"""scripts/export.py: every recipe's checkpoint -> model.pt2, model.onnx and model.json that agree with it."""

import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import onnxruntime
import pytest
import torch
from conftest import RECIPES, ROOT, load_recipe, run_subprocess, smoke_args

from common.checkpoint import load_model_state
from scripts import export

MNIST_LIKE = {"mnist_onecycle", "ddp_mlp"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, request) -> dict[str, Path]:
    """recipe -> a checkpoint of its few-second smoke run (trained once for the module)."""
    from common.cli import run_recipe

    paths = {}
    for recipe in RECIPES:
        run_dir = tmp_path_factory.mktemp(f"trained_{recipe}")
        try:
            run_recipe(load_recipe(recipe).main, [*smoke_args(recipe, request), "--run-dir", str(run_dir)])
        except SystemExit as exit_:
            assert exit_.code in (0, None)
        paths[recipe] = run_dir / "checkpoints" / "last.pt"
    return paths


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """recipe -> the folder scripts/export.py wrote for its checkpoint."""
    root = tmp_path_factory.mktemp("exported")
    for recipe, checkpoint in checkpoints.items():
        assert export.main([str(checkpoint), str(root / recipe)]) == 0, recipe
    return {recipe: root / recipe for recipe in checkpoints}


def eager_model(recipe: str, checkpoint: Path) -> torch.nn.Module:
    """The checkpoint's model rebuilt here, independently of the script."""
    state = torch.load(checkpoint, weights_only=True)
    module, config = load_recipe(recipe), state["config"]
    model = {
        "mnist_onecycle": lambda: module.DigitNet(config["width"]),
        "ddp_mlp": lambda: module.MLP(config["hidden"]),
        "tabular_mlp": lambda: module.build_model(state["features"], config["hidden"], config["depth"],
                                                  config["dropout"], config["num_embedding_used"]),
        "tiny_transformer": lambda: module.GPT(module.GPTConfig(**state["model_config"])),
        "mixed_precision": lambda: module.MLP(width=config["width"], depth=config["depth"]),
        "compiled_model": lambda: module.GatedMLP(config["width"], config["depth"]),
    }[recipe]()
    load_model_state(model, state["model"], checkpoint)
    return model.eval()


def inputs(recipe: str, info: dict, batch: int = 7) -> dict[str, torch.Tensor]:
    """A batch of another size than the script's (3 and 5), shaped as model.json says."""
    g = torch.Generator().manual_seed(123)
    if recipe == "tiny_transformer":  # and a sequence length of its own: that dimension is dynamic too
        return {"idx": torch.randint(info["vocab_size"], (batch, info["block_size"] - 3), generator=g)}
    if recipe == "tabular_mlp":
        sizes = torch.tensor([len(v) for v in info["preprocessing"]["features"]["categorical"].values()])
        return {"numeric": torch.randn(batch, info["input"]["numeric"]["shape"][1], generator=g),
                "categorical": (torch.rand(batch, len(sizes), generator=g) * sizes).long()}
    (name, spec), = info["input"].items()
    return {name: torch.randn(batch, *spec["shape"][1:], generator=g)}


@pytest.mark.parametrize("recipe", RECIPES)
def test_eager_exported_program_and_onnxruntime_agree(recipe, checkpoints, exported):
    out = exported[recipe]
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.onnx", "model.pt2"]
    info = json.loads((out / "model.json").read_text())
    assert info["recipe"] == recipe
    assert info["check"]["batch"] == 5 and max(info["check"]["max_abs_diff"].values()) <= 1e-4

    batch = inputs(recipe, info)
    with torch.no_grad():
        expected = eager_model(recipe, checkpoints[recipe])(*batch.values())
        program = torch.export.load(out / "model.pt2").module()(*batch.values())
    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(batch)
    (onnx_out,) = session.run(None, {name: t.numpy() for name, t in batch.items()})
    assert program.shape == expected.shape == onnx_out.shape and expected.shape[0] == 7
    torch.testing.assert_close(program, expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.from_numpy(onnx_out), expected, rtol=0, atol=1e-4)


def test_the_exported_program_takes_a_batch_past_65536_rows(checkpoints, exported):
    """Its batch dimension had a maximum of 65,536 that nothing documented; a table's rows come in any number."""
    info = json.loads((exported["tabular_mlp"] / "model.json").read_text())
    batch = inputs("tabular_mlp", info, batch=70_000)
    with torch.no_grad():
        expected = eager_model("tabular_mlp", checkpoints["tabular_mlp"])(*batch.values())
        program = torch.export.load(exported["tabular_mlp"] / "model.pt2").module()(*batch.values())
    assert program.shape[0] == 70_000
    torch.testing.assert_close(program, expected, rtol=0, atol=1e-4)


def test_a_character_level_einsum_transformer_exports_with_its_vocabulary(run_inprocess, request, tmp_path):
    """The einsum attention is exported as the same math in SDPA, and checked against the einsum model."""
    args = [*smoke_args("tiny_transformer", request), "--vocab", "chars", "--attention", "einsum"]
    assert run_inprocess("tiny_transformer", *args, "--run-dir", tmp_path / "run").code == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    assert export.main([str(checkpoint), str(tmp_path / "out")]) == 0
    info = json.loads((tmp_path / "out" / "model.json").read_text())
    state = torch.load(checkpoint, weights_only=True)
    assert info["vocab"] == state["vocab"] and info["vocab_size"] == len(state["vocab"]) < 256
    assert info["model_config"]["attention"] == "einsum" and info["exported_attention"] == "sdpa"
    batch = inputs("tiny_transformer", info)
    with torch.no_grad():
        expected = eager_model("tiny_transformer", checkpoint)(*batch.values())
        program = torch.export.load(tmp_path / "out" / "model.pt2").module()(*batch.values())
    torch.testing.assert_close(program, expected, rtol=0, atol=1e-4)


def test_model_json_says_how_to_prepare_the_inputs(checkpoints, exported):
    for recipe in MNIST_LIKE:
        info = json.loads((exported[recipe] / "model.json").read_text())
        assert info["input"]["images"]["shape"] == ["batch", 1, 28, 28]
        assert info["preprocessing"]["mean"] == 0.1307 and info["preprocessing"]["std"] == 0.3081
        assert info["classes"] == list(range(10))

    info = json.loads((exported["tabular_mlp"] / "model.json").read_text())
    state = torch.load(checkpoints["tabular_mlp"], weights_only=True)
    features = json.loads(json.dumps(state["features"]))  # tuples -> lists, as JSON holds them
    assert info["preprocessing"]["features"] == features
    assert info["input"]["numeric"] == {"shape": ["batch", 2], "dtype": "float32", "columns": ["age", "income"]}
    assert info["input"]["categorical"] == {"shape": ["batch", 2], "dtype": "int64", "columns": ["colour", "city"]}
    assert info["classes"] == ["no", "yes"]

    info = json.loads((exported["tiny_transformer"] / "model.json").read_text())
    assert info["vocab"] is None and info["vocab_size"] == 256  # byte-level: tokens are the bytes 0-255
    assert info["block_size"] == 16 and info["model_config"]["n_layer"] == 2


def test_model_json_followed_to_the_letter_encodes_raw_cells_as_the_recipe_does(exported):
    """model.json said nothing of stripping a cell, of inf or a word in a numeric column, or of the clip: a table
    written with ", " separators (Adult's) encoded every category as unseen, with other predictions."""

    import pyarrow as pa

    info = json.loads((exported["tabular_mlp"] / "model.json").read_text())
    rules, spec = info["preprocessing"], info["preprocessing"]["features"]
    far = float(re.search(r"clipped to \+-(\d+)", rules["numeric"])[1])
    missing = set(rules["missing_values"])
    assert "'missing_values' once lower-cased" in rules["categorical"]  # as by_the_letter compares them, below
    word = spec["categorical"]["colour"][2]
    cells = {"age": [" 31 ", "inf", "twelve", "1e30", "N/A"], "income": ["5", "-1e30", " 7", "?", ""],
             "colour": [f"  {word} ", word, "never seen", " NA ", "?"], "city": ["x", "", word, "nan", " ? "]}

    def by_the_letter(column: str, cell: str) -> float:
        cell = cell.strip()
        if column in spec["numeric"]:
            mean, std = spec["numeric"][column]
            try:
                value = float(cell)
            except ValueError:
                return 0.0
            return 0.0 if not math.isfinite(value) else min(max((value - mean) / std, -far), far)
        vocabulary = spec["categorical"][column]
        return 1 if cell.lower() in missing else vocabulary.index(cell) if cell in vocabulary[2:] else 0

    tabular = load_recipe("tabular_mlp")
    numeric, categorical, _ = tabular.encode(spec, pa.table(cells), with_target=False)
    for j, column in enumerate(info["input"]["numeric"]["columns"]):
        assert numeric[:, j].tolist() == pytest.approx([by_the_letter(column, c) for c in cells[column]]), column
    for j, column in enumerate(info["input"]["categorical"]["columns"]):
        assert categorical[:, j].tolist() == [by_the_letter(column, c) for c in cells[column]], column


BARE = """
import importlib.util, json, sys, torch
assert not any(p.endswith(("recipes", "common")) or p == {root!r} for p in sys.path), sys.path
assert importlib.util.find_spec("common") is None  # the project's core cannot even be found here
batches, paths = torch.load("inputs.pt"), json.load(open("paths.json"))
outputs = {{recipe: torch.export.load(path).module()(*batches[recipe]) for recipe, path in paths.items()}}
torch.save(outputs, "outputs.pt")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("common", "scripts") or "recipe" in m)))
"""


def test_model_pt2_runs_in_a_process_with_only_torch(checkpoints, exported, tmp_path):
    """python -I (no site-packages paths from the environment, no script folder) from a folder of its own:
    neither common/ nor any recipe can be imported there, and none is needed."""
    batches = {recipe: list(inputs(recipe, json.loads((out / "model.json").read_text()), batch=2).values())
               for recipe, out in exported.items()}
    torch.save(batches, tmp_path / "inputs.pt")
    (tmp_path / "paths.json").write_text(json.dumps({r: str(out / "model.pt2") for r, out in exported.items()}))
    proc = subprocess.run([sys.executable, "-I", "-c", BARE.format(root=str(ROOT))], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []  # nothing of this project was imported
    outputs = torch.load(tmp_path / "outputs.pt")
    for recipe, batch in batches.items():
        with torch.no_grad():
            expected = eager_model(recipe, checkpoints[recipe])(*batch)
        torch.testing.assert_close(outputs[recipe], expected, rtol=0, atol=1e-4)


def test_an_export_into_a_mount_point_under_a_read_only_folder_is_written(checkpoints, tmp_path):
    """A container's volume (-v ./exported:/exported): the temporary folder beside OUT_DIR was on another file
    system, so no rename could put it in place ("Invalid cross-device link"), and a read-only folder above refused
    it at once. A name near the 255-byte limit failed too: the temporary folder's name was 14 bytes longer."""
    parent = tmp_path / "root"
    out = parent / ("o" * 250)
    parent.mkdir()
    mounted = []
    try:
        for folder in (parent, out):
            folder.mkdir(exist_ok=True)
            if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)],
                                                   capture_output=True).returncode != 0:
                pytest.skip("no tmpfs can be mounted here")
            mounted.insert(0, folder)
        out.mkdir(exist_ok=True)
        assert export.main([str(checkpoints["ddp_mlp"]), str(out)]) == 0
        subprocess.run(["mount", "-o", "remount,ro", str(parent)], check=True)
        assert export.main([str(checkpoints["compiled_model"]), str(out), "--overwrite"]) == 0
        assert json.loads((out / "model.json").read_text())["recipe"] == "compiled_model"
        assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.onnx", "model.pt2"]  # nothing else
        # a bind mount of the same file system (docker -v /data/out:/work/exported): the same device number, yet
        # no rename crosses into it
        bound, source = tmp_path / "work" / "exported", tmp_path / "data-out"
        bound.mkdir(parents=True)
        source.mkdir()
        subprocess.run(["mount", "--bind", str(source), str(bound)], check=True)
        mounted.insert(0, bound)
        assert export.main([str(checkpoints["ddp_mlp"]), str(bound)]) == 0
        assert sorted(p.name for p in source.iterdir()) == ["model.json", "model.onnx", "model.pt2"]
        assert sorted(p.name for p in bound.parent.iterdir()) == ["exported"]  # no temporary folder left beside
    finally:
        for folder in mounted:
            subprocess.run(["umount", str(folder)], check=True)


def test_overwrite_replaces_an_earlier_export(checkpoints, tmp_path, capsys):
    out = tmp_path / "out"
    assert export.main([str(checkpoints["ddp_mlp"]), str(out)]) == 0
    assert export.main([str(checkpoints["compiled_model"]), str(out)]) == 1
    assert "already holds an export; choose a new folder or add --overwrite" in capsys.readouterr().err
    assert json.loads((out / "model.json").read_text())["recipe"] == "ddp_mlp"
    assert export.main([str(checkpoints["compiled_model"]), str(out), "--overwrite"]) == 0
    assert json.loads((out / "model.json").read_text())["recipe"] == "compiled_model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left
    assert "done: exported" in capsys.readouterr().out


def test_model_json_says_whether_the_weights_are_an_average_and_a_path_through_dotdot_is_written(checkpoints,
                                                                                                tmp_path, monkeypatch):
    """best.pt of an --ema run holds the moving average, last.pt the trained weights: model.json tells them apart.
    OUT_DIR "new/../out" (new not there yet) is the folder "out", as mkdir -p makes it."""
    state = torch.load(checkpoints["ddp_mlp"], weights_only=True)
    torch.save(state | {"averaged": True}, tmp_path / "best.pt")
    monkeypatch.chdir(tmp_path)
    assert export.main([str(checkpoints["ddp_mlp"]), "new/../out", "--format", "safetensors"]) == 0
    assert export.main(["best.pt", "averaged", "--format", "safetensors"]) == 0
    assert json.loads((tmp_path / "out" / "model.json").read_text())["averaged"] is False
    assert json.loads((tmp_path / "averaged" / "model.json").read_text())["averaged"] is True


@pytest.mark.parametrize(("failure", "said"), [
    # transformers' version check: an ImportError that names no module
    (ImportError("tokenizers>=0.22.0,<=0.23.0 is required for a normal functioning of this module"),
     "tokenizers>=0.22.0,<=0.23.0 is required for a normal functioning of this module"),
    (ImportError(), "a library failed to import"),
])
def test_a_library_that_fails_its_own_import_is_named_in_one_line(checkpoints, tmp_path, capsys, monkeypatch,
                                                                  failure, said):
    def broken(*args, **kwargs):
        raise failure

    monkeypatch.setattr(export, "export_safetensors", broken)
    assert export.main([str(checkpoints["ddp_mlp"]), str(tmp_path / "out"), "--format", "safetensors"]) == 1
    assert capsys.readouterr().err == f"error: {said}: pip install -r requirements.txt\n"


@pytest.mark.parametrize("format", ["graph", "safetensors"])
@pytest.mark.parametrize(("recipe", "kind"), [("ddp_mlp", ".bias"), ("mnist_onecycle", ".running_var")])
def test_weights_holding_nan_are_refused_in_every_format(checkpoints, tmp_path, capsys, format, recipe, kind):
    """safetensors wrote them and said "max difference 0.00e+00": max() passed a NaN by unless it came first. Batch
    norm's statistics count too: the exported model computes with them."""
    state = torch.load(checkpoints[recipe], weights_only=True)
    last = [key for key in state["model"] if key.endswith(kind)][-1]
    state["model"][last][0] = float("nan")
    torch.save(state, tmp_path / "edited.pt")
    assert export.main([str(tmp_path / "edited.pt"), str(tmp_path / "out"), "--format", format]) == 1
    assert capsys.readouterr().err == (f"error: {tmp_path / 'edited.pt'} is damaged: its model's {last} holds NaN or "
                                       "inf; nothing was exported\n")
    assert not (tmp_path / "out").exists()


def test_overwrite_through_a_link_replaces_the_folder_it_names_and_keeps_the_link(checkpoints, tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    assert export.main([str(checkpoints["ddp_mlp"]), str(real)]) == 0
    link.symlink_to(real)
    assert export.main([str(checkpoints["compiled_model"]), str(link), "--overwrite"]) == 0
    assert link.is_symlink() and json.loads((real / "model.json").read_text())["recipe"] == "compiled_model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no temporary folder or link left


@pytest.mark.parametrize(("format", "largest"), [("graph", "model.pt2"), ("safetensors", "model.safetensors")])
def test_a_full_disk_is_one_line_and_the_earlier_export_stays(checkpoints, tmp_path, format, largest):
    """The disk fills (here: a file-size limit) while the model is written: torch.export.save writing to the file
    itself aborted the process in C++ (exit 134, a stack dump); safetensors' own writer said "exporting the model
    failed: Error while serializing: I/O error"; now one line, and the earlier export is whole."""
    out = tmp_path / "out"
    assert export.main([str(checkpoints["mixed_precision"]), str(out), "--format", format]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = run_subprocess(["scripts/export.py", checkpoints["mixed_precision"], out, "--overwrite", "--format",
                             format], max_file_bytes=len(before[largest]) // 2)
    assert result.code == 1 and result.stderr == f"error: cannot write {out}: File too large\n", result.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_never_replaces_a_folder_that_is_not_an_export(checkpoints, tmp_path, capsys):
    """--overwrite pointed at a run directory (or at the checkpoint's own folder) must not delete it."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(checkpoints["ddp_mlp"].parents[1], run)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    for out in (run, run / "checkpoints"):
        capsys.readouterr()
        assert export.main([str(run / "checkpoints" / "best.pt"), str(out), "--overwrite"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: OUT_DIR {out} holds ") and err.endswith(
            ", which no export writes: --overwrite replaces an earlier export only; choose a new folder\n"), err
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary folder left
    # a project's own files named like an export's (model.*, *.json) but not one of them
    for name in ("model.py", "settings.json", "model.pth"):
        project = tmp_path / "project"
        project.mkdir()
        (project / "model.json").write_text("{}")  # as an earlier export would leave it
        (project / name).write_text("mine")
        capsys.readouterr()
        assert export.main([str(run / "checkpoints" / "best.pt"), str(project), "--overwrite"]) == 1
        assert f"holds {project / name}, which no export writes" in capsys.readouterr().err
        assert (project / name).read_text() == "mine"
        shutil.rmtree(project)


def test_an_export_into_the_current_folder_writes_its_files_there(checkpoints, tmp_path, monkeypatch):
    """`cd out && export.py CHECKPOINT .`: the files move into the folder, which cannot be renamed (over)."""
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path / "out")
    assert export.main([str(checkpoints["ddp_mlp"]), ".", "--format", "safetensors"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left beside it
    # and over an earlier export there (graph, then safetensors): "." is not renamed, its files are replaced
    assert export.main([str(checkpoints["compiled_model"]), ".", "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.json", "model.onnx", "model.pt2"]
    assert export.main([str(checkpoints["ddp_mlp"]), ".", "--format", "safetensors", "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.json", "model.safetensors"]
    assert json.loads((tmp_path / "out" / "model.json").read_text())["recipe"] == "ddp_mlp"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

def test_files_moved_into_the_current_folder_replace_only_an_earlier_export(tmp_path, monkeypatch):
    """move_files ("."): a file that appeared there during the export stays, and a failed move leaves the earlier
    export as it was (files moved one by one had mixed the two)."""
    def folder(name: str, files: dict) -> Path:
        (tmp_path / name).mkdir()
        for file, text in files.items():
            (tmp_path / name / file).write_text(text)
        return tmp_path / name

    def contents(path: Path) -> dict:
        return {p.name: p.read_text() for p in sorted(path.iterdir())}

    earlier = {"model.json": "old", "model.pt2": "old", "model.onnx": "old", "notes.txt": "mine"}
    out = folder("out", earlier)
    export.move_files(folder("new.tmp", {"model.json": "new", "model.safetensors": "new"}), out)
    assert contents(out) == {"model.json": "new", "model.safetensors": "new", "notes.txt": "mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    out, new = folder("out2", earlier), folder("new2.tmp", {"model.json": "new", "model.safetensors": "new"})
    replace = export.os.replace

    def fail_on_safetensors(src, dst):
        if Path(dst).name == "model.safetensors" and Path(dst).parent == out:
            raise OSError(28, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(export.os, "replace", fail_on_safetensors)
    with pytest.raises(OSError):
        export.move_files(new, out)
    assert contents(out) == earlier and contents(new) == {"model.json": "new", "model.safetensors": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new2.tmp", "out", "out2"]


def test_an_export_that_cannot_replace_its_folder_is_one_line_and_keeps_the_earlier_one(checkpoints, tmp_path,
                                                                                       capsys, monkeypatch):
    out = tmp_path / "out"
    assert export.main([str(checkpoints["ddp_mlp"]), str(out)]) == 0
    earlier = (out / "model.json").read_bytes()
    replace = export.os.replace

    def busy(src, dst):  # as renaming "." or a mount point fails
        if Path(src).name.endswith(".tmp"):
            raise OSError(16, "Device or resource busy")
        replace(src, dst)

    monkeypatch.setattr(export.os, "replace", busy)
    capsys.readouterr()
    assert export.main([str(checkpoints["compiled_model"]), str(out), "--overwrite"]) == 1
    assert capsys.readouterr().err == f"error: cannot replace {out}: Device or resource busy; choose a new folder\n"
    assert (out / "model.json").read_bytes() == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def bad_case(case: str, checkpoints: dict, tmp_path: Path) -> tuple[list, str]:
    """Arguments for ``case`` (OUT_DIR is tmp_path/out unless the case is about it) and the error's text."""
    good, bad = checkpoints["ddp_mlp"], tmp_path / "bad.pt"
    out = tmp_path / "out"
    if case == "missing checkpoint":
        return [tmp_path / "nope.pt", out], "nope.pt does not exist"
    if case == "random bytes":
        bad.write_bytes(random.Random(0).randbytes(3000))
        return [bad, out], "corrupt, truncated, or not a PyTorch checkpoint"
    if case == "truncated checkpoint":
        bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
        return [bad, out], "corrupt, truncated, or not a PyTorch checkpoint"
    if case == "another program's checkpoint":
        torch.save({"state_dict": torch.nn.Linear(2, 2).state_dict(), "epoch": 3}, bad)
        return [bad, out], "is not a checkpoint of a recipe of this project"
    if case == "a bare state_dict":
        torch.save(torch.nn.Linear(2, 2).state_dict(), bad)
        return [bad, out], "is not a checkpoint of a recipe of this project"
    if case == "pickle payload":
        state = torch.load(good, weights_only=True)
        state["extra"] = Payload(tmp_path / "payload-ran")
        torch.save(state, bad)
        return [bad, out], "refuses to run"
    if case == "weights of another shape":
        state = torch.load(good, weights_only=True)
        state["config"]["hidden"] *= 2  # the options promise a wider model than the weights hold
        torch.save(state, bad)
        return [bad, out], "does not fit this model (wrong shape: net.1.bias"
    if case == "extras missing":
        state = torch.load(good, weights_only=True)
        del state["config"]["hidden"]
        torch.save(state, bad)
        return [bad, out], "lacks what rebuilding its ddp_mlp model needs ('hidden')"
    if case == "a tabular config that is no dict":  # was a traceback (AttributeError: no attribute 'get')
        state = torch.load(checkpoints["tabular_mlp"], weights_only=True)
        torch.save(state | {"config": None}, bad)
        return [bad, out], "lacks what rebuilding its tabular_mlp model needs"
    if case == "a step that is a tensor":  # was a traceback (TypeError) from writing model.json
        torch.save(torch.load(good, weights_only=True) | {"step": torch.tensor(3)}, bad)
        return [bad, out], "is damaged: what model.json would say of it is no JSON (Object of type Tensor"
    if case == "a negative width":
        state = torch.load(good, weights_only=True)
        state["config"]["hidden"] = -3
        torch.save(state, bad)
        return [bad, out], "is damaged: its ddp_mlp model cannot be rebuilt (Trying to create tensor with negative"
    if case == "weights that are not a dict":
        state = torch.load(good, weights_only=True)
        state["model"] = [1]
        torch.save(state, bad)
        return [bad, out], "is damaged: its weights are a list, not a dict"
    if case in ("a weight that is no tensor", "a recipe named in a list"):  # were tracebacks (AttributeError,
        state = torch.load(good, weights_only=True)                         # TypeError: unhashable type)
        if case == "a weight that is no tensor":
            state["model"]["net.1.bias"] = 5
        else:
            state["recipe"] = ["ddp_mlp"]
        torch.save(state, bad)
        return [bad, out], ("does not fit this model (wrong shape: net.1.bias" if case == "a weight that is no tensor"
                            else "is not a checkpoint of a recipe of this project")
    if case == "out dir is a file":
        out.write_text("a file")
        return [good, out], "is a file, not a folder"
    if case == "out dir under a file":
        (tmp_path / "a-file").write_text("a file")
        return [good, tmp_path / "a-file" / "sub" / "out"], "a-file is a file, not a folder"
    if case == "a damaged tokenizer":  # graph and safetensors exports copied it as tokenizer.json, unread
        state = torch.load(checkpoints["tiny_transformer"], weights_only=True)
        torch.save(state | {"tokenizer": '{"version": "1.0", "model": {"type": '}, bad)
        return [bad, out], "the checkpoint's tokenizer is damaged (not a tokenizers JSON)"
    if case == "a one-token block":  # was an AssertionError from torch.export's Dim(min=1, max=1)
        state = torch.load(checkpoints["tiny_transformer"], weights_only=True)
        state["model_config"]["block_size"] = 1
        state["model"]["wpe.weight"] = state["model"]["wpe.weight"][:1]
        torch.save(state, bad)
        return [bad, out], "make no model (whole numbers, n_head dividing n_embd, block_size >= 2)"
    if case.startswith("tabular columns in a list") or case == "tabular features in a list":  # were a traceback,
        state = torch.load(checkpoints["tabular_mlp"], weights_only=True)                    # or no means exported
        if case == "tabular features in a list":
            state["features"] = list(state["features"])
        else:
            part = "numeric" if case.endswith("numeric") else "categorical"
            state["features"][part] = list(state["features"][part])
        torch.save(state, bad)
        return [bad, out], "is damaged: its features name no columns as this recipe does"
    if case == "out dir a link to itself, --overwrite":  # was RuntimeError: Symlink loop (Path.resolve)
        out.symlink_to(out)
        return [good, out, "--overwrite"], "cannot replace"
    if case == "checkpoint is a folder":
        (tmp_path / "folder.pt").mkdir()
        return [tmp_path / "folder.pt", out], "is not a file"
    raise AssertionError(case)


BAD_CASES = ["missing checkpoint", "random bytes", "truncated checkpoint", "another program's checkpoint",
             "a bare state_dict", "pickle payload", "weights of another shape", "extras missing",
             "a tabular config that is no dict", "a step that is a tensor",
             "a negative width", "weights that are not a dict", "a weight that is no tensor",
             "a recipe named in a list", "out dir is a file", "out dir under a file", "checkpoint is a folder",
             "a damaged tokenizer", "a one-token block", "tabular columns in a list",
             "tabular columns in a list, numeric", "tabular features in a list",
             "out dir a link to itself, --overwrite"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_one_line_and_writes_nothing(case, checkpoints, tmp_path, capsys):
    args, text = bad_case(case, checkpoints, tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert export.main([str(a) for a in args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and text in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no OUT_DIR, no temporary folder
    assert not (tmp_path / "payload-ran").exists()


def test_an_export_that_disagrees_fails_and_leaves_nothing(checkpoints, tmp_path, capsys, monkeypatch):
    """A model whose traced graph computes something else than its eager forward: the check must catch it."""

    class Diverging(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, images):
            return self.inner(images) + (1.0 if torch.compiler.is_exporting() else 0.0)

    build = export.BUILDERS["ddp_mlp"]

    def diverging(state, path, recipe):
        exportable = build(state, path, recipe)
        exportable.model = Diverging(exportable.model)
        return exportable

    monkeypatch.setitem(export.BUILDERS, "ddp_mlp", diverging)
    # OUT_DIR in folders that do not exist yet: they are made, and removed again when the export fails
    assert export.main([str(checkpoints["ddp_mlp"]), str(tmp_path / "new" / "deeper" / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "disagrees with the checkpoint's: largest difference 1" in err, err
    assert list(tmp_path.iterdir()) == []
    # a nan from one runtime beside an exact other: max() passed it by, and model.json held a bare NaN
    monkeypatch.setattr(export, "export", lambda exportable, folder: {"torch.export": 0.0, "onnxruntime": math.nan})
    assert export.main([str(checkpoints["mixed_precision"]), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "largest difference nan (torch.export 0, onnxruntime nan)" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("args", "text"), [([], "the following arguments are required"),
                                            (["only.pt"], "the following arguments are required: out_dir"),
                                            (["a.pt", "out", "--level", "9"], "unrecognized arguments"),
                                            (["a.pt", " "], "argument out_dir: is empty; give a path"),  # not '.'
                                            (["", "out"], "argument checkpoint: is empty; give a path")])
def test_usage_errors_exit_2(args, text, capsys):
    with pytest.raises(SystemExit) as exit_:
        export.main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and text in err, err


def test_the_readme_deploy_section_runs_as_written(checkpoints, tmp_path):
    """Every command and Python block of docs/deploy.md's Deploy section, in order, in a folder of its own; the
    placeholders get real files: the checkpoint, a folder of digit images and a photo. The Python blocks run
    with -I from that folder: only torch (or onnxruntime) is needed."""
    from torchvision.io import write_jpeg, write_png

    section = (ROOT / "docs" / "deploy.md").read_text().split("## Deploy\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(bash|python)\n(.*?)```", section, flags=re.S)
    assert [kind for kind, _ in blocks] == ["bash", "python", "python", "bash"]
    digit = torch.zeros(1, 28, 28, dtype=torch.uint8)
    digit[:, 6:22, 12:16] = 255  # a "1"
    (tmp_path / "my_digits").mkdir()
    write_png(digit, str(tmp_path / "my_digits" / "one.png"))
    write_jpeg(255 - digit, str(tmp_path / "photo.jpg"))
    placeholder = "runs/mnist_onecycle/RUN/checkpoints/best.pt"
    outputs = []
    for kind, code in blocks:
        if kind == "python":
            commands = [[sys.executable, "-I", "-c", code]]
        else:
            commands = [[sys.executable, str(ROOT / words[1]), *words[2:]]  # scripts/, recipes/ of this clone
                        for words in (shlex.split(line) for line in code.strip().splitlines())]
        for command in commands:
            command = [str(checkpoints["mnist_onecycle"]) if word == placeholder else word for word in command]
            proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
            outputs.append(proc.stdout)
    assert (tmp_path / "exported" / "mnist" / "model.pt2").is_file()
    assert "mnist_onecycle, the model of recipes/mnist_onecycle.py: eager vs torch.export max difference" in \
        outputs[0]  # the script's report
    assert outputs[0].strip().splitlines()[-1].startswith("done: exported")
    # each Python block prints four predicted classes: tensor([d, d, d, d]) from torch, [d d d d] from numpy
    for printed in outputs[1:3]:
        classes = [int(d) for d in re.findall(r"\d+", printed)]
        assert len(classes) == 4 and all(0 <= d <= 9 for d in classes), printed
    predictions = outputs[-1].strip().splitlines()
    assert [line.split()[0] for line in predictions[:-1]] == ["my_digits/one.png", "photo.jpg"]
    assert predictions[-1] == "done: predictions=2"
    # the photo is the same digit, dark on light: once inverted it is read as the same class
    assert predictions[0].split()[1] == predictions[1].split()[1]


def test_ctrl_c_is_exit_130_in_one_line_and_leaves_no_temporary_folder(checkpoints, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):  # Ctrl-C while the ONNX model is checked, say
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "export", interrupted)
    assert export.main([str(checkpoints["ddp_mlp"]), str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == f"error: interrupted; {tmp_path / 'out'} left as it was\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("moment", ["old aside", "new in place", "old removed"])
def test_ctrl_c_while_overwrite_puts_the_export_in_place_leaves_it_whole(checkpoints, tmp_path, capsys, monkeypatch,
                                                                           moment):
    """Ctrl-C as the earlier export moved aside left OUT_DIR missing (the earlier export in a hidden folder); just
    after the new one moved in, or while the earlier one was removed, it said "left as it was" of a replaced one
    (and could leave half of the earlier one behind). Those steps now finish first: the new export, whole."""
    import signal

    out = tmp_path / "out"
    assert export.main([str(checkpoints["ddp_mlp"]), str(out)]) == 0
    replace, rmtree = export.os.replace, export.shutil.rmtree

    def ctrl_c_then(step, *args, **kwargs):  # a real SIGINT, as the terminal sends it: Python acts on it at once
        os.kill(os.getpid(), signal.SIGINT)
        return step(*args, **kwargs)

    if moment == "old removed":
        monkeypatch.setattr(export.shutil, "rmtree", lambda path, **kw: ctrl_c_then(rmtree, path, **kw))
    else:
        renamed = ".old" if moment == "old aside" else ".tmp"
        monkeypatch.setattr(export.os, "replace", lambda src, dst: ctrl_c_then(replace, src, dst)
                            if Path(src if renamed == ".tmp" else dst).name.endswith(renamed) else replace(src, dst))
    # Python's own Ctrl-C handler, as in a terminal (a background job, as CI may run the tests, ignores SIGINT)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert export.main([str(checkpoints["compiled_model"]), str(out), "--overwrite"]) == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again afterwards
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("done: exported")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.onnx", "model.pt2"]
    assert json.loads((out / "model.json").read_text())["recipe"] == "compiled_model"


def test_an_export_off_the_main_thread_is_written(checkpoints, tmp_path):
    """Holding off Ctrl-C (signal.signal, the main thread's alone) made it a ValueError after the whole export."""
    import threading

    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(export.export_checkpoint(checkpoints["ddp_mlp"],
                                                                                     tmp_path / "out")))
    thread.start()
    thread.join()
    assert outcome and outcome[0]["recipe"] == "ddp_mlp"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.json", "model.onnx", "model.pt2"]


def test_a_folder_of_other_files_is_refused_without_suggesting_overwrite(checkpoints, tmp_path, capsys):
    """It said "add --overwrite", which then refused the folder for holding files no export writes."""
    (tmp_path / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        assert export.main([str(checkpoints["ddp_mlp"]), str(tmp_path), *extra]) == 1
        assert capsys.readouterr().err == (f"error: OUT_DIR {tmp_path} holds {tmp_path / 'notes.txt'}, which no export "
                                           "writes: --overwrite replaces an earlier export only; choose a new folder\n")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_sigterm_is_exit_143_in_one_line_and_leaves_no_temporary_folder(checkpoints, tmp_path):
    """SIGTERM (a scheduler's, timeout's) ended the export with no word and left .out.XXXX.tmp/ for good."""
    import signal
    import time

    # the script itself, run as `python scripts/export.py` runs it (its __main__ block sets the SIGTERM handler),
    # held inside its temporary folder until the signal comes: torch.export, which it calls, waits (a real export
    # could finish before the signal on a fast or a busy machine)
    held = tmp_path / "held"
    code = ("import runpy, sys, time, torch.export; "
            "torch.export.export = lambda *a, **k: (open(held, 'w').close(), time.sleep(120)); "
            "held, sys.argv = sys.argv[3], ['scripts/export.py', *sys.argv[1:3]]; "
            "runpy.run_path('scripts/export.py', run_name='__main__')")
    command = [sys.executable, "-c", code, str(checkpoints["ddp_mlp"]), str(tmp_path / "out"), str(held)]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not held.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob(".out.*")), "the export had no temporary folder when the signal came"
    held.unlink()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (143, f"error: terminated; {tmp_path / 'out'} left as it was\n"), err
    assert list(tmp_path.iterdir()) == []


def test_the_folder_of_a_killed_export_is_removed_by_the_next_one(checkpoints, tmp_path):
    """SIGKILL (the OOM killer's) leaves the temporary folder, which no later export removed: a GPT-2's is hundreds
    of MB, hidden. It is named for its process, so the next export to that folder removes it once that is gone."""
    import signal
    import time

    held = tmp_path / "held"  # the export held inside its temporary folder, as in the SIGTERM test above
    code = ("import sys, time; from scripts import export; "
            "export.export = lambda *a, **k: (open(sys.argv[3], 'w').close(), time.sleep(120)); "
            "sys.exit(export.main(sys.argv[1:3]))")
    (tmp_path / "exports").mkdir()
    out = tmp_path / "exports" / "out"
    proc = subprocess.Popen([sys.executable, "-c", code, str(checkpoints["ddp_mlp"]), str(out), str(held)], cwd=ROOT)
    deadline = time.monotonic() + 120
    while not held.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    abandoned = list(out.parent.glob(".out.*.tmp"))
    assert [p.name.split(".")[2] for p in abandoned] == [str(proc.pid)]
    running = out.parent / f".out.{os.getpid()}.abcdefgh.tmp"  # an export still under way: this process's
    running.mkdir()
    assert export.main([str(checkpoints["ddp_mlp"]), str(out)]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([running.name, "out"])


def test_a_full_disk_at_model_json_is_one_line_and_leaves_nothing(checkpoints, tmp_path, capsys, monkeypatch):
    """model.json was written outside the export's OSError handling: a traceback (its folder was removed)."""
    import errno

    write_text = Path.write_text

    def full(path, *args, **kwargs):
        if path.name == "model.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    for format in ("graph", "safetensors"):
        assert export.main([str(checkpoints["ddp_mlp"]), str(tmp_path / "out"), "--format", format]) == 1
        assert capsys.readouterr().err == f"error: cannot write {tmp_path / 'out'}: No space left on device\n"
        assert list(tmp_path.iterdir()) == []


def test_a_changed_copy_s_checkpoint_is_exported_as_its_model_with_recipe(checkpoints, tmp_path, capsys):
    """The model was rebuilt from recipes/NAME.py whatever script trained the checkpoint: a copy whose GELUs were
    made Tanh (same weights' shapes) was exported with GELUs, and the agreement check compared that with itself."""
    copy = tmp_path / "my_mlp.py"
    text = (ROOT / "recipes" / "mixed_precision.py").read_text()
    assert text.count("nn.GELU()") == 1
    copy.write_text(text.replace("nn.GELU()", "nn.Tanh()"))
    checkpoint, x = checkpoints["mixed_precision"], torch.randn(4, 784, generator=torch.Generator().manual_seed(0))
    assert export.main([str(checkpoint), str(tmp_path / "out"), "--recipe", str(copy)]) == 0
    assert f"mixed_precision, the model of {copy}: eager vs" in capsys.readouterr().out
    exported = torch.export.load(tmp_path / "out" / "model.pt2").module()
    state = torch.load(checkpoint, weights_only=True)
    mine = export.load_recipe("mixed_precision", copy).MLP(width=state["config"]["width"],
                                                           depth=state["config"]["depth"])
    load_model_state(mine, state["model"], checkpoint)
    with torch.no_grad():
        torch.testing.assert_close(exported(x), mine.eval()(x), atol=1e-5, rtol=0)
        assert (exported(x) - eager_model("mixed_precision", checkpoint)(x)).abs().max() > 1e-2  # not the GELUs'
    (tmp_path / "notes.txt").write_text("")
    for script, message in [(ROOT / "recipes" / "ddp_mlp.py", "ddp_mlp.py is no copy of mixed_precision, the recipe "
                                                               "that trained the checkpoint (its RECIPE is 'ddp_mlp')"),
                            (tmp_path / "missing.py", "missing.py: no recipe"),
                            (tmp_path / "notes.txt", "notes.txt: give the path of the Python script that trained")]:
        assert export.main([str(checkpoint), str(tmp_path / "again"), "--recipe", str(script)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: --recipe ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "again").exists()


def test_an_ejected_copy_whose_model_the_checkpoint_does_not_fit_is_a_one_line_error(checkpoints, tmp_path, capsys):
    """An ejected copy raises its own RecipeError (eject copies the class): export let it through as a traceback."""
    copy = tmp_path / "my_tabular.py"
    assert run_subprocess(["scripts/eject.py", "tabular_mlp", copy]).code == 0
    text = copy.read_text()
    assert text.count("self.head = Linear(width, out_features)") == 1
    copy.write_text(text.replace("self.head = Linear(width, out_features)", "self.head = Linear(width, 7)"))
    checkpoint = checkpoints["tabular_mlp"]
    assert export.main([str(checkpoint), str(tmp_path / "out"), "--recipe", str(copy)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: checkpoint {checkpoint} does not fit this model (wrong shape: head.bias, head.weight)\n"
    assert not (tmp_path / "out").exists()

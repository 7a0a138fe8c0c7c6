"""scripts/eject.py: every recipe, ejected into one self-contained script, trains exactly like the recipe."""

import ast
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from conftest import RECIPES, ROOT, assert_same_weights, load_weights, read_metrics, run_subprocess, smoke_args

BOTH_RUNS = ["--seed", "1", "--device", "cpu"]
# measured, so they differ between any two runs
TIMING_KEYS = {"wall_s", "samples_per_s", "tokens_per_s", "mfu", "step_ms", "first_step_s", "first_eval_s",
               "compile_s"}


@pytest.fixture(scope="module")
def ejected(tmp_path_factory):
    """Recipe name -> its script ejected through the command line, alone in a folder outside the repository."""
    scripts = {}

    def eject(name: str) -> Path:
        if name not in scripts:
            script = tmp_path_factory.mktemp(f"ejected_{name}") / "train.py"
            assert not script.resolve().is_relative_to(ROOT)
            result = run_subprocess(["scripts/eject.py", name, script])
            assert result.code == 0, result.stderr
            scripts[name] = script
        return scripts[name]

    return eject


def top_level_names(tree: ast.Module) -> set[str]:
    """Functions, classes and constants defined at module level (imports left out: ruff checks those)."""
    names = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    targets = [t for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
    targets += [node.target for node in tree.body if isinstance(node, ast.AnnAssign)]
    return names | {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


@pytest.mark.parametrize("name", RECIPES)
def test_ejected_recipe_trains_exactly_like_the_recipe(name, ejected, request, tmp_path):
    args = [*smoke_args(name, request), *BOTH_RUNS]
    script = ejected(name)
    # Outside the repository and with an empty PYTHONPATH, the script cannot reach common/ even if it tried.
    no_repo = {"PYTHONPATH": ""}
    probe = run_subprocess([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('common'))"],
                           cwd=script.parent, env=no_repo)
    assert probe.stdout.strip() == "None", probe.stdout + probe.stderr
    for label, command, cwd in [("recipe", ROOT / "recipes" / f"{name}.py", ROOT), ("ejected", script, script.parent)]:
        result = run_subprocess([command, *args, "--run-dir", tmp_path / label], cwd=cwd, env=no_repo)
        assert result.code == 0, f"{label}: {result.stderr}"

    recipe, ejected_run = ({k: v for k, v in read_metrics(tmp_path / label).items() if k not in TIMING_KEYS}
                           for label in ("recipe", "ejected"))
    for metrics in (recipe, ejected_run):  # the process's peak memory is measured too, not computed
        metrics.get("memory", {}).pop("peak_rss_bytes", None)
    assert ejected_run == recipe
    assert_same_weights(load_weights(tmp_path / "recipe" / "checkpoints" / "last.pt"),
                        load_weights(tmp_path / "ejected" / "checkpoints" / "last.pt"))


@pytest.mark.parametrize("name", RECIPES)
def test_ejected_script_is_self_contained_and_holds_nothing_unused(name, ejected):
    text = ejected(name).read_text()
    tree = ast.parse(text)
    imported = [node.module if isinstance(node, ast.ImportFrom) else alias.name
                for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names]
    assert not [module for module in imported if module.split(".")[0] == "common"]
    assert "sys.path" not in text  # the recipe's bootstrap is gone

    recipe_text = (ROOT / "recipes" / f"{name}.py").read_text()
    for module in sorted(set(re.findall(r"^from common\.(\w+) import", recipe_text, flags=re.M))):
        assert f"# ---- from common/{module}.py ----\n" in text
    copied = top_level_names(tree) - top_level_names(ast.parse(recipe_text))
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    assert copied and not copied - read, f"copied from common/ but never used: {sorted(copied - read)}"


@pytest.mark.parametrize("name", RECIPES)
def test_ejected_script_names_no_option_only_another_recipe_has(name, ejected):
    """A copy's comments, docstrings and messages speak of its own options (e.g. no --cv or --ema where it has none)."""
    from conftest import recipe_options

    others = set().union(*(recipe_options(other) for other in RECIPES if other != name)) - recipe_options(name)
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", ejected(name).read_text()))
    assert not named & others, sorted(named & others)


@pytest.mark.parametrize("name", RECIPES)
def test_the_lesson_comes_first_and_the_core_after_it(name, ejected):
    text = ejected(name).read_text()
    headings = re.findall(r"^# ---- from (\S+) ----$", text, flags=re.M)
    assert headings[0] == f"recipes/{name}.py" and len(headings) > 1
    assert all(heading.startswith("common/") for heading in headings[1:])
    recipe_text = (ROOT / "recipes" / f"{name}.py").read_text()
    first_def = re.search(r"^(def|class) (\w+)", recipe_text, flags=re.M).group(2)  # the recipe's first definition
    core_start = text.index("# ---- from common/")
    assert re.search(rf"^(def|class) {first_def}\b", text[:core_start], flags=re.M)
    assert text.rstrip().endswith("run_recipe(main)") and text.count('if __name__ == "__main__":') == 1
    assert text.index('if __name__ == "__main__":') > text.rindex("# ---- from common/")


@pytest.mark.parametrize("name", RECIPES)
def test_the_readme_gives_the_ejected_length(name, ejected):
    """The README's table of lengths is the recipe's and what eject writes today (within 2%: a line's edit needs no
    README edit)."""
    rows = {row[0]: row[1:] for row in re.findall(r"^\| (\w+) \| ([\d,]+) \| ([\d,]+) \|$",
                                                  (ROOT / "README.md").read_text(), flags=re.M)}
    for stated, path in zip(rows[name], [ROOT / "recipes" / f"{name}.py", ejected(name)], strict=True):
        stated, actual = int(stated.replace(",", "")), len(path.read_text().splitlines())
        assert abs(actual - stated) <= 0.02 * stated, f"README says {stated} lines for {path.name}, it has {actual}"


@pytest.mark.parametrize("name", RECIPES)
def test_ejecting_twice_gives_the_same_bytes(name, ejected, tmp_path):
    again = tmp_path / "train.py"
    result = run_subprocess(["scripts/eject.py", name, again], env={"PYTHONHASHSEED": "12345"})  # other set orders
    assert result.code == 0, result.stderr
    assert again.read_bytes() == ejected(name).read_bytes()


@pytest.mark.parametrize("name", RECIPES)
def test_ejected_script_passes_ruff(name, ejected):
    if importlib.util.find_spec("ruff"):
        ruff = [sys.executable, "-m", "ruff"]
    elif shutil.which("ruff"):
        ruff = [shutil.which("ruff")]
    else:
        pytest.skip("ruff is not installed here (CI installs it)")
    # The repository's rules; its per-file E402 exception for recipes/ does not reach a file outside it.
    result = run_subprocess([*ruff, "check", "--no-cache", "--config", ROOT / "pyproject.toml", ejected(name)])
    assert result.code == 0, result.stdout + result.stderr


CLASHING_RECIPE = '''"""A recipe that defines a function of its own under the name of a core function it needs."""

from common.loop import evaluate


def to_device(batch):  # common.loop.evaluate calls common.loop.to_device
    return batch, evaluate
'''


CORE_BASE_RECIPE = '''"""A recipe whose class is built on a core class: defined above the core, it could not be."""

from common.data import ResumableSampler


class MySampler(ResumableSampler):
    pass


if __name__ == "__main__":
    MySampler(range(3))
'''

CALLED_AT_IMPORT_RECIPE = '''"""A recipe that calls its own function where it defines a constant, at import."""

from common.data import MNIST_FILES


def files():
    return list(MNIST_FILES)


FILES = files()

if __name__ == "__main__":
    print(FILES)
'''

BUILT_AT_IMPORT_RECIPE = '''"""A recipe that builds an object of its own class at import: its __init__ runs then."""

from common.data import MNIST_MEAN


class Probe:
    def __init__(self):
        self.mean = MNIST_MEAN


PROBE = Probe()

if __name__ == "__main__":
    print(PROBE.mean)
'''

LATER_RECIPE = '''"""Core names read only in lambdas and functions that run after the core is defined: accepted."""

import functools

from common.data import MNIST_FILES, MNIST_MEAN

LOOKUPS = {"files": lambda: MNIST_FILES}
SQUARES = [MNIST_MEAN * MNIST_MEAN for MNIST_MEAN in range(3)]  # a comprehension's own variable


def announced(fn):  # a decorator runs at import; the wrapper it returns runs later
    @functools.wraps(fn)
    def wrapper(*args):
        print(len(MNIST_FILES))
        return fn(*args)

    return wrapper


@announced
def main(mean=lambda: MNIST_MEAN):
    print(len(LOOKUPS["files"]()), mean(), SQUARES[-1])


if "__main__" == __name__:
    main()
'''

NOT_A_GUARD_RECIPE = '''"""A recipe whose last block runs when it is imported, not when it is run."""


def main():
    pass


if __name__ != "__main__":
    main()
'''

NO_GUARD_RECIPE = '''"""A recipe that runs its command without the `if __name__ == "__main__":` block."""

from common import cli


def main():
    pass


cli.run_recipe(main)
'''


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ([], 2, "the following arguments are required"),
        (["mnist_onecycle"], 2, "the following arguments are required: output"),
        (["no_such_recipe", "{tmp}/out.py"], 2, "no recipe 'no_such_recipe'; give one of"),
        (["{tmp}/missing.py", "{tmp}/out.py"], 2, "no recipe"),
        (["mnist_onecycle", "{tmp}/no_folder/out.py"], 1, "no_folder does not exist"),
        (["mnist_onecycle", "{tmp}/clash.py/out.py"], 1, "clash.py is a file"),
        (["{tmp}/clash.py", "{tmp}/out.py"], 1, "needs 'to_device' from common/loop.py"),
        (["{tmp}/core_base.py", "{tmp}/out.py"], 1, "fails when it is imported, at core_base.py:6 (NameError: name "
                                                   "'ResumableSampler' is not defined); the recipe comes first"),
        (["{tmp}/no_guard.py", "{tmp}/out.py"], 1, 'end the recipe with its `if __name__ == "__main__":` block'),
        (["{tmp}/not_a_guard.py", "{tmp}/out.py"], 1, 'end the recipe with its `if __name__ == "__main__":` block'),
        (["{tmp}/called.py", "{tmp}/out.py"], 1, "at called.py:7 (NameError: name 'MNIST_FILES' is not defined); "
                                                "the recipe comes first"),
        (["{tmp}/built.py", "{tmp}/out.py"], 1, "at built.py:8 (NameError: name 'MNIST_MEAN' is not defined)"),
        (["{tmp}/waits.py", "{tmp}/out.py"], 1, "at waits.py:3 (EOFError: EOF when reading a line)"),
        (["mnist_onecycle", "{tmp}"], 1, "is a folder; give the path of the script to write"),
        (["mnist_onecycle", ""], 2, "argument output: is empty; give a path"),  # was ". is a folder", named by no one
        (["", "{tmp}/out.py"], 2, "argument recipe: is empty; give a path"),
        # was a file named new_folder: Path drops the slash
        (["mnist_onecycle", "{tmp}/new_folder/"], 1, "new_folder names a folder (it ends in a slash); give the path"),
        (["{tmp}/latin.py", "{tmp}/out.py"], 1, "latin.py is not a Python file in UTF-8"),  # was a traceback
        (["{tmp}/nested.py", "{tmp}/out.py"], 1, "nested.py:5: import the core at the top of the file, not inside"),
        (["mnist_onecycle", "{tmp}/typer.py"], 1, "typer.py would hide the typer module from the script"),
        (["mnist_onecycle", "{tmp}/random.py"], 1, "random.py would hide the random module from the script"),
        (["mnist_onecycle", "{tmp}/torch.py"], 1, "torch.py would hide the torch module from the script"),
    ],
)
def test_bad_input_is_a_one_line_error(args, code, message, tmp_path):
    (tmp_path / "clash.py").write_text(CLASHING_RECIPE + '\n\nif __name__ == "__main__":\n    to_device(None)\n')
    (tmp_path / "core_base.py").write_text(CORE_BASE_RECIPE)
    (tmp_path / "no_guard.py").write_text(NO_GUARD_RECIPE)
    (tmp_path / "not_a_guard.py").write_text(NOT_A_GUARD_RECIPE)
    (tmp_path / "called.py").write_text(CALLED_AT_IMPORT_RECIPE)
    (tmp_path / "built.py").write_text(BUILT_AT_IMPORT_RECIPE)
    (tmp_path / "waits.py").write_text('"""Asks at import."""\n\nANSWER = input("data folder? ")\n\n'
                                       'if __name__ == "__main__":\n    print(ANSWER)\n')
    (tmp_path / "nested.py").write_text('"""Imports the core in a function."""\n\n\ndef main():\n'
                                        '    from common.data import MNIST_MEAN\n    print(MNIST_MEAN)\n\n\n'
                                        'if __name__ == "__main__":\n    main()\n')
    (tmp_path / "latin.py").write_bytes(b'"""A caf\xe9 in Latin-1."""\n\nif __name__ == "__main__":\n    pass\n')
    result = run_subprocess(["scripts/eject.py", *(arg.format(tmp=tmp_path) for arg in args)])
    assert result.code == code, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    written = ("out", "typer", "random", "torch")
    assert not [path for path in tmp_path.glob("*") if path.suffix != ".py" or path.stem in written]
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_copy_is_never_written_over_the_core_or_another_recipe():
    core, other, tool = ROOT / "common" / "ejected_here.py", ROOT / "recipes" / "tabular_mlp.py", ROOT / "README.md"
    itself, new_recipe = ROOT / "scripts" / "eject.py", ROOT / "recipes" / "my_train.py"
    before = other.read_bytes(), tool.read_bytes(), itself.read_bytes()
    try:
        for output, what in [(core, "the core the recipes import"), (other, "another recipe"),
                             (tool, "not a copy eject wrote"),  # README.md was replaced
                             (itself, "not a copy eject wrote"),  # it holds the copies' header text: it was replaced
                             (new_recipe, "the recipes' folder")]:  # it was written, then taken for a recipe
            result = run_subprocess(["scripts/eject.py", "mnist_onecycle", output, "--overwrite"])
            assert result.code == 1 and result.stderr == f"error: {output} is part of this repository ({what}); " \
                "write the script somewhere else\n", result.stderr
        for package in ("scripts", "recipes"):  # scripts.py was written; then find_lr and doctor failed to import
            output = ROOT / f"{package}.py"
            result = run_subprocess(["scripts/eject.py", "mnist_onecycle", output])
            assert result.code == 1 and result.stderr == f"error: {output} would hide this repository's {package}/ " \
                "from its tools' imports; write the script somewhere else\n", result.stderr
            assert not output.exists()
        assert not core.exists() and not new_recipe.exists()
        assert (other.read_bytes(), tool.read_bytes(), itself.read_bytes()) == before
    finally:  # a failure leaves the repository as it was
        for path in (core, new_recipe, ROOT / "scripts.py", ROOT / "recipes.py"):
            path.unlink(missing_ok=True)
        other.write_bytes(before[0])
        tool.write_bytes(before[1])
        itself.write_bytes(before[2])


def test_an_earlier_copy_in_the_repository_is_replaced_with_overwrite():
    copy = ROOT / "ejected_copy_of_a_test.py"
    try:
        assert run_subprocess(["scripts/eject.py", "ddp_mlp", copy]).code == 0
        copy.write_text(copy.read_text() + "# an edit of the user's\n")
        result = run_subprocess(["scripts/eject.py", "ddp_mlp", copy, "--overwrite"])
        assert result.code == 0, result.stderr
        assert "an edit of the user's" not in copy.read_text()
    finally:
        copy.unlink(missing_ok=True)


def test_a_write_error_names_the_output_not_the_draft_beside_it(tmp_path):
    (tmp_path / "link.py").symlink_to(tmp_path / "gone" / "train.py")  # its folder does not exist
    result = run_subprocess(["scripts/eject.py", "ddp_mlp", tmp_path / "link.py"])
    assert result.code == 1 and result.stderr == f"error: cannot write {tmp_path / 'link.py'}: No such file or " \
        "directory\n", result.stderr  # was ".../gone/.train.py.k2xq9.tmp: No such file or directory"


def test_core_names_read_only_after_import_are_accepted(tmp_path):
    (tmp_path / "later.py").write_text(LATER_RECIPE)
    result = run_subprocess(["scripts/eject.py", tmp_path / "later.py", tmp_path / "out.py"])
    assert result.code == 0, result.stderr
    run = run_subprocess([sys.executable, tmp_path / "out.py"], cwd=tmp_path, env={"PYTHONPATH": ""})
    assert run.code == 0 and run.stdout.split() == ["4", "4", "0.1307", "4"], run.stdout + run.stderr


SHADOWING_RECIPE = '''"""A recipe that defines its own ``Path``, a name the core imports from pathlib."""

import pathlib

from common.rundir import last_file


def Path(text):  # noqa: N802
    return text.upper()


if __name__ == "__main__":
    print(Path("mine"), last_file(pathlib.Path("no_such_folder")))
'''


def test_a_core_import_named_like_a_recipe_definition_is_aliased_where_the_core_uses_it(tmp_path):
    (tmp_path / "shadow.py").write_text(SHADOWING_RECIPE)
    result = run_subprocess(["scripts/eject.py", tmp_path / "shadow.py", tmp_path / "out.py"])
    assert result.code == 0, result.stderr
    copy = (tmp_path / "out.py").read_text()
    assert "from pathlib import Path as PathlibPath\n" in copy
    assert "def last_file(run_dir: PathlibPath) -> PathlibPath | None:" in copy and "def Path(text):" in copy
    run = run_subprocess([sys.executable, tmp_path / "out.py"], cwd=tmp_path, env={"PYTHONPATH": ""})
    assert run.code == 0 and run.stdout.split() == ["MINE", "None"], run.stdout + run.stderr


def test_a_recipe_line_never_edits_the_core_line_of_the_same_number(tmp_path):
    """Cutting `cli.` out of the recipe's `cli.option_name` is an edit of the recipe's line only: the core's line of
    the same number and column (`nn.utils.clip_grad_norm_(`, whose `cli` sits there) is copied as written."""
    core_line = (ROOT / "common" / "loop.py").read_text().splitlines().index(
        "        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)") + 1
    head = ('"""Reads cli.option_name where the core reads clip_grad_norm_."""\n\nfrom common import cli\n'
            "from common.loop import train_step\n\n\ndef main():\n    print(train_step.__name__,\n")
    padding = "\n" * (core_line - 1 - head.count("\n"))  # blank lines inside the call's parentheses
    call = " " * len("        grad_norm = nn.utils.") + 'cli.option_name("max_grad_norm"))\n'
    (tmp_path / "aligned.py").write_text(head + padding + call + '\n\nif __name__ == "__main__":\n    main()\n')
    assert (tmp_path / "aligned.py").read_text().splitlines()[core_line - 1].index("cli.") == 29
    result = run_subprocess(["scripts/eject.py", tmp_path / "aligned.py", tmp_path / "out.py"])
    assert result.code == 0, result.stderr
    assert "        grad_norm = nn.utils.clip_grad_norm_(model.parameters()" in (tmp_path / "out.py").read_text()
    run = run_subprocess([sys.executable, tmp_path / "out.py"], cwd=tmp_path, env={"PYTHONPATH": ""})
    assert run.code == 0 and run.stdout.split() == ["train_step", "max", "grad", "norm"], run.stdout + run.stderr


def test_a_script_that_fails_at_import_leaves_an_existing_output_as_it_was(tmp_path):
    (tmp_path / "core_base.py").write_text(CORE_BASE_RECIPE)
    (tmp_path / "out.py").write_text("# my edited copy\n")
    result = run_subprocess(["scripts/eject.py", tmp_path / "core_base.py", tmp_path / "out.py", "--overwrite"])
    assert result.code == 1 and "fails when it is imported, at core_base.py:6 " in result.stderr, result.stderr
    assert (tmp_path / "out.py").read_text() == "# my edited copy\n" and not list(tmp_path.glob(".*.tmp"))


def test_an_output_behind_a_link_is_written_where_the_link_points_and_keeps_its_mode(tmp_path):
    (tmp_path / "real.py").write_text("# an older copy\n")
    (tmp_path / "real.py").chmod(0o755)
    (tmp_path / "link.py").symlink_to("real.py")
    result = run_subprocess(["scripts/eject.py", "mixed_precision", tmp_path / "link.py", "--overwrite"])
    assert result.code == 0, result.stderr
    assert (tmp_path / "link.py").is_symlink() and "def amp_step(" in (tmp_path / "real.py").read_text()
    assert (tmp_path / "real.py").stat().st_mode & 0o777 == 0o755


def test_an_output_named_like_one_of_this_repositorys_scripts_is_written(tmp_path):
    """scripts/ is first on eject's own sys.path, not on the copy's: export.py hides no module of the copy's."""
    result = run_subprocess(["scripts/eject.py", "mixed_precision", tmp_path / "export.py"])
    assert result.code == 0 and (tmp_path / "export.py").is_file(), result.stderr
    # nor does test.py, though the standard library has a `test` (CPython's own suite, which nothing imports)
    result = run_subprocess(["scripts/eject.py", "mixed_precision", tmp_path / "test.py"])
    assert result.code == 0 and (tmp_path / "test.py").read_text() == (tmp_path / "export.py").read_text().replace(
        "export.py", "test.py"), result.stderr


def test_an_existing_output_is_replaced_only_with_overwrite(tmp_path):
    """As export.py refuses a non-empty OUT_DIR: an existing copy may hold the user's edits."""
    (tmp_path / "train.py").write_text("# my edited copy\n")
    refused = run_subprocess(["scripts/eject.py", "mixed_precision", tmp_path / "train.py"])
    assert refused.code == 1 and refused.stderr.strip() == (f"error: {tmp_path / 'train.py'} exists; choose another "
                                                            "name, or add --overwrite to replace it")
    assert (tmp_path / "train.py").read_text() == "# my edited copy\n"
    replaced = run_subprocess(["scripts/eject.py", "mixed_precision", tmp_path / "train.py", "--overwrite"])
    assert replaced.code == 0 and "def amp_step(" in (tmp_path / "train.py").read_text()


MODULE_READ_RECIPE = '''"""A recipe that reads a core module as a value: a copy has no module to read."""

from common import cli

if __name__ == "__main__":
    print(getattr(cli, "RecipeError"))
'''

TWO_STATEMENT_CORE = {"mutated": '''"""A core module whose table is filled in by a second statement."""

EXTRA = {}
EXTRA["a"] = 1
''', "rebound": '''"""A core module that binds a name twice."""

LIMIT = 1
LIMIT = LIMIT + 1
'''}


def test_a_core_module_read_as_a_value_is_refused(tmp_path):
    """It was cut as `cli.` is: `getattr(cli, "X")` became `getattr( "X")`, written with exit 0, failing at run time."""
    (tmp_path / "reads_module.py").write_text(MODULE_READ_RECIPE)
    result = run_subprocess(["scripts/eject.py", tmp_path / "reads_module.py", tmp_path / "out.py"])
    assert result.code == 1 and result.stderr == "error: reads_module.py:6: cli is read as a " \
        "module, which a copy does not have; read its names as cli.NAME\n", result.stderr
    assert not (tmp_path / "out.py").exists()


@pytest.mark.parametrize("kind", ["mutated", "rebound"])
def test_a_core_name_bound_by_two_statements_is_refused(kind, tmp_path):
    """One statement is copied per name: the copy held EXTRA = {} (the repository's has "a"), or failed to import."""
    module, name = ROOT / "common" / f"two_statements_{kind}.py", "EXTRA" if kind == "mutated" else "LIMIT"
    (tmp_path / "recipe.py").write_text(f'''"""Reads a name of a core module bound twice."""

from common.two_statements_{kind} import {name}

if __name__ == "__main__":
    print({name})
''')
    try:
        module.write_text(TWO_STATEMENT_CORE[kind])
        result = run_subprocess(["scripts/eject.py", tmp_path / "recipe.py", tmp_path / "out.py"])
    finally:
        module.unlink(missing_ok=True)
    expected = {"mutated": "4: a top-level statement that binds no name is not copied; do this inside a definition",
                "rebound": "4: LIMIT is bound again at the top level, and eject copies one statement per name; bind "
                           "it once"}[kind]
    assert result.code == 1 and result.stderr == f"error: common/two_statements_{kind}.py:{expected}\n", \
        result.stderr
    assert not (tmp_path / "out.py").exists()


LOCAL_HIDES_CORE_RECIPE = '''"""A recipe whose local is named like the core function it reads through its module."""

from common import cli


def main():
    option_name = cli.option_name("max_grad_norm")
    print(option_name)


if __name__ == "__main__":
    main()
'''

OWN_PRINT_RECIPE = '''"""A recipe that prints on rank 0 alone through a print() of its own."""

import builtins
import os

from common import cli


def print(*args, **kwargs):
    if os.environ.get("RANK", "0") == "0":
        builtins.print("[rank 0]", *args, **kwargs)


def main():
    raise cli.RecipeError("the data folder is empty")


if __name__ == "__main__":
    cli.run_recipe(main)
'''


RICH_PRINT_RECIPE = '''"""A recipe that prints through rich."""

from rich import print

from common import cli


def main():
    print("[bold]training[/bold]")
    raise cli.RecipeError("the data folder [data/] is empty")


if __name__ == "__main__":
    cli.run_recipe(main)
'''


@pytest.mark.parametrize(("recipe", "message"), [
    (RICH_PRINT_RECIPE, "error: recipe.py defines print, which the core code it uses reads as Python's builtin; "
                        "rename it in the recipe\n"),
    (LOCAL_HIDES_CORE_RECIPE, "error: recipe.py:7: cli.option_name is option_name in a copy, where the local "
                              "'option_name' of this function would hide it; rename the local\n"),
    (OWN_PRINT_RECIPE, "error: recipe.py defines print, which the core code it uses reads as Python's builtin; "
                       "rename it in the recipe\n")])
def test_a_recipe_name_that_would_change_the_meaning_of_core_code_is_refused(recipe, message, tmp_path):
    """Written with exit 0, the first copy failed at run time (UnboundLocalError: `option_name = option_name(...)`),
    and the second sent the core's `error: ...` through the recipe's print(): nothing on rank 1, "[rank 0]" on 0."""
    (tmp_path / "recipe.py").write_text(recipe)
    result = run_subprocess(["scripts/eject.py", tmp_path / "recipe.py", tmp_path / "out.py"])
    assert (result.code, result.stderr) == (1, message)
    assert not (tmp_path / "out.py").exists()


def test_an_output_that_is_no_regular_file_and_an_earlier_copy_as_the_recipe_are_refused(tmp_path, monkeypatch):
    """--overwrite made a character device a 93 KB script (/dev/null itself, as root); a pipe hung eject. A copy in
    the current folder named like a recipe was ejected again (two headers, doubled sections)."""
    os.mkfifo(tmp_path / "pipe.py")
    result = run_subprocess(["scripts/eject.py", "mixed_precision", tmp_path / "pipe.py", "--overwrite"], timeout=60)
    assert (result.code, result.stderr) == (1, f"error: {tmp_path / 'pipe.py'} is not a regular file; give the path "
                                               "of the script to write\n")
    assert run_subprocess(["scripts/eject.py", "mixed_precision", tmp_path / "mixed_precision.py"]).code == 0
    copy = (tmp_path / "mixed_precision.py").read_text()
    assert copy.count("# Generated by scripts/eject.py from recipes/mixed_precision.py and") == 1
    assert "    python mixed_precision.py --compare" in copy  # the docstring's usage names the copy, not recipes/...
    for name in ("mixed_precision.py", "./mixed_precision.py"):  # a file of the current folder, as given
        result = run_subprocess([sys.executable, ROOT / "scripts" / "eject.py", name, "again.py"], cwd=tmp_path)
        assert (result.code, result.stderr) == (1, f"error: {name.removeprefix('./')} is a copy eject wrote, not a "
                                                   "recipe; eject the recipe it came from\n")
    assert not (tmp_path / "again.py").exists()


@pytest.mark.parametrize(("stop", "code"), [("SIGTERM", 143), ("SIGHUP", 129), ("SIGHUP under nohup", 0)])
def test_sigterm_and_sighup_leave_no_draft_beside_the_output(stop, code, tmp_path):
    """Only Ctrl-C removed the hidden draft: SIGTERM (timeout, a scheduler) or SIGHUP (a closed terminal) left
    .train.py.XXXX.tmp for good. Under nohup (SIGHUP ignored) eject goes on and writes the copy."""
    import signal
    import subprocess
    import time

    ignore = stop.endswith("nohup")
    hangup = signal.SIG_IGN if ignore else signal.SIG_DFL  # (not whatever this process inherited: CI's nohup)
    process = subprocess.Popen([sys.executable, ROOT / "scripts" / "eject.py", "mixed_precision", "train.py"],
                               cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup))
    deadline = time.monotonic() + 120  # the draft is written before the copy's imports are checked (seconds)
    while not list(tmp_path.glob(".train.py.*.tmp")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(getattr(signal, stop.split()[0]))
    _, err = process.communicate(timeout=120)
    assert process.returncode == code, err
    if code:
        assert err == "error: terminated; train.py left as it was\n" and list(tmp_path.iterdir()) == []
    else:
        assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_the_copy_s_docstring_names_the_copy_where_it_named_the_recipe_and_nowhere_else(tmp_path):
    """The recipe's name was replaced inside longer names too: "pretrain.py" became "premy_run.py"."""
    (tmp_path / "train.py").write_text('''"""Fine-tune after pretrain.py has run:

    python pretrain.py && python train.py --lr 0.1
"""

from common import cli


def main():
    raise cli.RecipeError("nothing to train")


if __name__ == "__main__":
    cli.run_recipe(main)
''')
    assert run_subprocess(["scripts/eject.py", tmp_path / "train.py", tmp_path / "my_run.py"]).code == 0
    assert (tmp_path / "my_run.py").read_text().startswith('''"""Fine-tune after pretrain.py has run:

    python pretrain.py && python my_run.py --lr 0.1
"""''')
    # a name with a backslash: escaped in the docstring, not read as a regex (a traceback: bad escape \\x)
    assert run_subprocess(["scripts/eject.py", tmp_path / "train.py", tmp_path / "my\\x.py"]).code == 0
    assert "python my\\\\x.py --lr 0.1" in (tmp_path / "my\\x.py").read_text()


def test_the_recipes_own_imports_stay_and_a_path_of_its_own_is_named(tmp_path):
    """An import read nowhere may be there for what importing it does (torchvision registers its ops in torch.ops):
    the copy kept only the imports it read, and failed where the recipe ran. A sys.path line of the user's own (not
    the clone's bootstrap) cannot stay above the merged imports: the copy says so rather than drop it silently."""
    (tmp_path / "libs").mkdir()
    (tmp_path / "libs" / "mylib.py").write_text("GREETING = 'hello from mylib'\n")
    (tmp_path / "boxes.py").write_text('''"""Keep the best of overlapping boxes."""

import importlib
import sys
from pathlib import Path

import torch
import torchvision  # noqa: F401  (importing it registers torch.ops.torchvision.nms)

sys.path.insert(0, str(Path(__file__).resolve().parent / "libs"))

from common.cli import RecipeError  # noqa: E402


def main() -> None:
    boxes, scores = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]), torch.tensor([1.0, 0.5])
    if not len(boxes):
        raise RecipeError("no boxes")
    print(torch.ops.torchvision.nms(boxes, scores, 0.5).tolist(), importlib.import_module("mylib").GREETING)


if __name__ == "__main__":
    main()
''')
    result = run_subprocess(["scripts/eject.py", tmp_path / "boxes.py", tmp_path / "out.py"])
    assert result.code == 0, result.stderr
    assert result.stderr == ("warning: boxes.py:10: the copy leaves out sys.path.insert(0, str(Path(__file__).resolve()"
                             ".parent / 'libs')) (eject writes its own imports); add it back above them if the copy "
                             "needs it\n")
    assert "\nimport torchvision\n" in (tmp_path / "out.py").read_text()
    libs = {"PYTHONPATH": str(tmp_path / "libs")}  # as the user puts it back, or installs it
    run = run_subprocess([sys.executable, tmp_path / "out.py"], cwd=tmp_path, env=libs)
    assert run.code == 0 and run.stdout == "[0] hello from mylib\n", run.stdout + run.stderr


def test_an_import_of_the_recipes_read_nowhere_still_gives_the_core_its_own_name(tmp_path):
    """Kept in the copy, the recipe's unread `from numpy import random` took the place of the core's `import random`:
    seed_everything seeded numpy's generator, and the copy drew other numbers each run."""
    (tmp_path / "seeded.py").write_text('''"""A user's recipe."""

import sys

from numpy import random  # noqa: F401  (numpy's, for a later augmentation)

from common.cli import run_recipe
from common.runtime import seed_everything


def main(seed: int = 0) -> None:
    seed_everything(seed)
    print(sys.modules["random"].random())


if __name__ == "__main__":
    run_recipe(main)
''')
    assert run_subprocess(["scripts/eject.py", tmp_path / "seeded.py", tmp_path / "out.py"]).code == 0
    assert "import random as random_random\n" in (tmp_path / "out.py").read_text()
    runs = [run_subprocess([sys.executable, tmp_path / script, "--seed", 3], cwd=tmp_path, env=env) for script, env in
            [("seeded.py", {"PYTHONPATH": str(ROOT)}), ("out.py", {"PYTHONPATH": ""}), ("out.py", {"PYTHONPATH": ""})]]
    assert [run.code for run in runs] == [0, 0, 0], [run.stderr for run in runs]
    assert runs[0].stdout == runs[1].stdout == runs[2].stdout


def test_a_path_an_ascii_terminal_cannot_show_is_printed_escaped(tmp_path):
    """With an ASCII-only stdout (PYTHONIOENCODING=ascii, or the C locale without UTF-8 mode) the tools wrote their
    file, then failed printing its name with a UnicodeEncodeError traceback, exit 1: a rerun then needed --overwrite."""
    target = tmp_path / "ü" / "train.py"
    target.parent.mkdir()
    result = run_subprocess(["scripts/eject.py", "mixed_precision", target], env={"PYTHONIOENCODING": "ascii"})
    assert result.code == 0 and result.stdout.startswith(f"wrote {tmp_path}/\\xfc/train.py: "), result.stderr


def test_the_draft_of_a_killed_eject_is_removed_by_the_next_one(tmp_path):
    """A kill -9 (the OOM killer's) runs no clean-up: its hidden draft stayed beside the output for good. The next
    eject to the same output removes it (named for its process, which is gone), but never a running process's draft
    nor a file of the user's."""
    import signal
    import subprocess
    import time

    process = subprocess.Popen([sys.executable, ROOT / "scripts" / "eject.py", "mixed_precision", "train.py"],
                               cwd=tmp_path, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120  # the draft is written before the copy's imports are checked (seconds)
    while not list(tmp_path.glob(".train.py.*.tmp")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    killed = [p.name for p in tmp_path.iterdir()]
    assert len(killed) == 1 and killed[0].startswith(f".train.py.{process.pid}.") and killed[0].endswith(".tmp")
    running = tmp_path / f".train.py.{os.getpid()}.{'ab' * 6}.tmp"  # a draft a live process is writing now
    mine = tmp_path / ".train.py.notes.tmp"
    running.write_text("draft"), mine.write_text("notes")
    result = run_subprocess([sys.executable, ROOT / "scripts" / "eject.py", "mixed_precision", "train.py"],
                            cwd=tmp_path)
    assert result.code == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([running.name, mine.name, "train.py"])

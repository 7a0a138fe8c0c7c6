"""The README only says true things: its commands run, and the files it names exist."""

import re
import shlex
import shutil

from conftest import ROOT, run_subprocess

README = (ROOT / "README.md").read_text()
CODE_BLOCKS = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
COMMANDS = [line.strip() for block in CODE_BLOCKS for line in block.splitlines() if line.strip()]


def test_readme_shows_the_two_newcomer_commands():
    assert "pip install -r requirements.txt" in COMMANDS
    assert "python recipes/mnist_onecycle.py --epochs 3" in COMMANDS
    assert "python -m pytest -q" in COMMANDS


def test_readme_recipe_commands_run(mnist_dir, tmp_path):
    """Each `python recipes/...` command of the README runs as written, cut to a few steps on small data."""
    recipe_commands = [c for c in COMMANDS if c.startswith("python recipes/")]
    assert recipe_commands
    # the README's example table: a numeric target called price
    my_csv = tmp_path / "my.csv"
    my_csv.write_text("rooms,area,town,price\n" + "".join(f"{i % 5 + 1},{40 + i},{'ab'[i % 2]},{100 + 3 * i}\n"
                                                          for i in range(60)))
    for i, command in enumerate(recipe_commands):
        args = [str(my_csv) if arg == "my.csv" else arg for arg in shlex.split(command)[1:]]
        extra = ["--max-steps", "2", "--data-dir", str(mnist_dir), "--run-dir", str(tmp_path / f"run{i}")]
        result = run_subprocess([*args, *extra])
        assert result.code == 0, f"{command}\n{result.stderr}"
        assert result.done_line.startswith("done: ")


def test_readme_tools_exist():
    assert shutil.which("tensorboard") or (ROOT / ".venv" / "bin" / "tensorboard").exists()
    for path in re.findall(r"`((?:recipes|common|scripts|data)/[\w./-]+\.(?:py|md|sh))`", README):
        if "coming" not in README.split(path, 1)[1].split("\n", 1)[0]:
            assert (ROOT / path).exists(), path

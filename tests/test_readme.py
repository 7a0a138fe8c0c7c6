"""The README and the docs/ pages say only true things: their commands run, and the files they name exist."""

import json
import re
import shlex
import shutil
import sys

import pytest
import torch
from conftest import ROOT, run_subprocess, run_torchrun, smoke_args, write_tiny_gpt2

README = (ROOT / "README.md").read_text()
PAGES = {path.name: path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
CODE_BLOCKS = [block for text in PAGES.values() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]
BLOCK_COMMANDS = [line.strip() for block in CODE_BLOCKS for line in block.splitlines() if line.strip()]
TABLE_COMMANDS = re.findall(r"\| `((?:python|torchrun) [^`]*recipes/[^`]+)` \|", README)
# Every command that trains a recipe on one machine; the two-machine commands are run by tests/test_ddp.py,
# the Deploy section's prediction (it needs a checkpoint and images) by tests/test_export.py, the GPT-2 fine-tune
# (it needs a gpt2 folder) below, with a stand-in for it.
RECIPE_COMMANDS = sorted({c for c in BLOCK_COMMANDS + TABLE_COMMANDS
                          if re.match(r"(python|torchrun) .*recipes/\w+\.py", c) and "--nnodes" not in c
                          and "--predict" not in c and "--init-from" not in c})


def test_readme_shows_the_two_newcomer_commands():
    commands = [line.strip() for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S)
                for line in block.splitlines()]
    assert "pip install -r requirements.txt" in commands
    assert "python recipes/mnist_onecycle.py --epochs 3" in commands
    assert any(c.startswith("python -m pytest -q") for c in commands)
    assert "tensorboard --logdir runs" in BLOCK_COMMANDS


def test_the_readme_is_read_in_five_minutes_and_links_the_rest():
    words = len(re.sub(r"```.*?```", "", README, flags=re.S).split())  # prose, not the commands
    assert words <= 1600, f"README: {words} words"
    for page in ("docs/guide.md", "docs/reliability.md", "docs/scaling.md", "docs/deploy.md", "docs/benchmarks.md",
                 "docs/conventions.md"):
        assert f"({page})" in README, page


def test_every_recipe_has_a_row_with_a_command():
    for path in sorted((ROOT / "recipes").glob("*.py")):
        assert any(f"recipes/{path.name}" in command for command in TABLE_COMMANDS), path.name


@pytest.mark.parametrize("command", RECIPE_COMMANDS)
def test_readme_recipe_command_runs(command, request, tmp_path):
    """Run the command as written, cut to a few steps on small data by appending the recipe's smoke options
    (later options win). A placeholder file name such as my.csv gets a real file of that shape."""
    words = shlex.split(command)
    recipe = re.search(r"recipes/(\w+)\.py", command)[1]
    my_csv = tmp_path / "my.csv"  # the README's example table: a numeric target called price
    my_csv.write_text("rooms,area,town,price\n" + "".join(f"{i % 5 + 1},{40 + i},{'ab'[i % 2]},{100 + 3 * i}\n"
                                                          for i in range(60)))
    words = [str(my_csv) if word == "my.csv" else word for word in words]
    extra = [*smoke_args(recipe, request), "--run-dir", str(tmp_path / "run")]
    if "--csv" in words:  # keep the README's own table and target
        extra = strip_options(extra, {"--csv", "--target"})
    if words[0] == "torchrun":
        result = run_torchrun([*words[1:], *extra])
    else:
        result = run_subprocess([sys.executable, *words[1:], *extra])
    assert result.code == 0, f"{command}\n{result.stderr[-3000:]}"
    assert result.stdout.strip().splitlines()[-1].startswith("done: ")


def strip_options(args: list[str], names: set[str]) -> list[str]:
    """``args`` without the given options and their values."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        else:
            kept.append(arg)
    return kept


@pytest.mark.parametrize("page", sorted(PAGES))
def test_readme_tools_and_files_exist(page):
    assert shutil.which("tensorboard") or (ROOT / ".venv" / "bin" / "tensorboard").exists()
    for path in re.findall(r"`((?:recipes|common|scripts|benchmarks|data|tests|docs)/[\w./-]+\.(?:py|md|sh))`",
                           PAGES[page]):
        assert (ROOT / path).exists(), path


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_link_to_a_file_of_the_project_resolves_from_its_page(page):
    """[text](path) and ![figure](path) are relative to the page's own folder (README.md's or docs/)."""
    folder = ROOT if page == "README.md" else ROOT / "docs"
    for target in re.findall(r"\]\(([^)#]+)\)", PAGES[page]):
        if not target.startswith(("http://", "https://")):
            assert (folder / target).exists(), f"{page}: {target}"


def indented_commands(section: str) -> list[str]:
    """The shell commands of a section's indented blocks, continuation lines (ending in \\) joined."""
    commands, current = [], []
    for line in section.splitlines():
        if line.startswith("    ") and (current or re.match(r"\s+(python|torchrun) ", line)):
            current.append(line.strip().removesuffix("\\").strip())
            if not line.rstrip().endswith("\\"):
                commands.append(" ".join(current))
                current = []
    return commands


SCALING = PAGES["scaling.md"].split("## Scaling the transformer\n", 1)[1].split("\n## ", 1)[0]
SCALING_COMMANDS = [c for c in indented_commands(SCALING) if "--nnodes" not in c]  # two nodes: test_scaling.py


def test_the_scaling_section_shows_one_process_ddp_and_fsdp():
    assert [re.search(r"--parallel (\w+)", c)[1] if "--parallel" in c else "none" for c in SCALING_COMMANDS] == [
        "none", "ddp", "fsdp"]


@pytest.mark.parametrize("command", SCALING_COMMANDS)
def test_readme_scaling_command_trains_as_it_says(command, request, tmp_path):
    """Each single-machine command of "Scaling the transformer", its own options kept (the smoke options only
    make the model and the run small): the run's config holds every option the command gives, and it ran on as
    many processes as the command starts."""
    words = shlex.split(command)
    own = words[next(i for i, w in enumerate(words) if w.endswith(".py")) + 1 :]
    extra = strip_options([*smoke_args("tiny_transformer", request), "--run-dir", str(tmp_path / "run")],
                          {w for w in own if w.startswith("--")})
    if words[0] == "torchrun":
        result = run_torchrun([*words[1:], *extra])
    else:
        result = run_subprocess([sys.executable, *words[1:], *extra])
    assert result.code == 0, f"{command}\n{result.stderr[-3000:]}"
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    for i, word in enumerate(own):
        if word.startswith("--"):
            value = own[i + 1] if i + 1 < len(own) and not own[i + 1].startswith("--") else True
            key = word[2:].replace("-", "_")
            assert str(config[key]) == str(value) if value is not True else config[key] is True, (word, config[key])
    processes = int(re.search(r"--nproc_per_node=(\d+)", command)[1]) if words[0] == "torchrun" else 1
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["world_size"] == processes


def section(title: str) -> str:
    text = next(text for text in PAGES.values() if f"## {title}\n" in text)
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_gpt2_sections_run_as_written_with_a_tiny_stand_in_for_gpt2(tmp_path):
    """"Fine-tune GPT-2 on your own text", then "Use your model with transformers", in order, in a folder of their
    own: the download is replaced by a tiny random GPT-2 folder written there (no network), input.txt is a small
    text, the training run is cut to a few steps (appended options win), and RUN is the run it made. The Python
    block runs with -I from that folder: only transformers is needed."""
    fine_tune = re.findall(r"```(bash|python)\n(.*?)```", section("Fine-tune GPT-2 on your own text"), flags=re.S)
    use = re.findall(r"```(bash|python)\n(.*?)```", section("Use your model with transformers"), flags=re.S)
    assert [kind for kind, _ in fine_tune] == ["bash"] and [kind for kind, _ in use] == ["python"]
    download, train, export = fine_tune[0][1].strip().splitlines()
    assert shlex.split(download) == ["hf", "download", "gpt2", "--local-dir", "gpt2"]
    text = "Once upon a time there was a model that learned to write Python.\n    def forward(self, x):\n" * 60
    write_tiny_gpt2(tmp_path / "gpt2", text, n_positions=64)
    (tmp_path / "input.txt").write_text(text, encoding="utf-8")

    words = shlex.split(train)
    assert words[:2] == ["python", "recipes/tiny_transformer.py"] and words[2:4] == ["--init-from", "gpt2"]
    short = ["--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--batch-size", "2", "--sample-tokens", "10",
             "--peak-flops", "1e11", "--run-dir", "runs/tiny_transformer/RUN"]
    result = run_subprocess([sys.executable, str(ROOT / words[1]), *words[2:], *short], cwd=tmp_path)
    assert result.code == 0, f"{train}\n{result.stderr[-3000:]}"
    assert "val_bits_per_token=" in result.stdout.strip().splitlines()[-1]

    words = shlex.split(export)
    assert words[:2] == ["python", "scripts/export.py"] and "--format" in words
    result = run_subprocess([sys.executable, str(ROOT / words[1]), *words[2:]], cwd=tmp_path)
    assert result.code == 0, f"{export}\n{result.stderr[-3000:]}"
    assert result.stdout.strip().splitlines()[-1].startswith("done: exported")

    result = run_subprocess([sys.executable, "-I", "-c", use[0][1]], cwd=tmp_path)
    assert result.code == 0, result.stderr[-3000:]
    assert result.stdout.startswith("Once upon a time") and len(result.stdout) > len("Once upon a time")


def test_the_own_images_snippet_reads_an_image_folder(tmp_path):
    """docs/guide.md's "Your own images" block, run as written in a folder holding my_images/ of two classes."""
    from PIL import Image, ImageDraw
    from torchvision.io import write_png

    code = re.findall(r"```python\n(.*?)```", section("Your own images"), flags=re.S)[0]
    for name, n in (("cat", 3), ("dog", 2)):
        (tmp_path / "my_images" / name).mkdir(parents=True)
        for i in range(n):
            write_png(torch.randint(0, 255, (3, 40, 30), dtype=torch.uint8), str(tmp_path / "my_images" / name /
                                                                                 f"{i}.png"))
    # a black stroke on a see-through canvas, as paint programs save one, and the same stroke on white: it was black
    drawn = Image.new("RGBA", (40, 40), (0, 0, 0, 0))
    ImageDraw.Draw(drawn).line([(20, 5), (20, 35)], fill=(0, 0, 0, 255), width=6)
    drawn.save(tmp_path / "my_images" / "cat" / "0.png")
    Image.alpha_composite(Image.new("RGBA", (40, 40), "white"), drawn).convert("L").save(tmp_path / "my_images" /
                                                                                          "cat" / "1.png")
    result = run_subprocess([sys.executable, "-c", code + "print(torch.equal(images[0], images[1]))"], cwd=tmp_path)
    assert result.code == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "torch.Size([5, 1, 28, 28]) [3, 2] ['cat', 'dog']\nTrue"

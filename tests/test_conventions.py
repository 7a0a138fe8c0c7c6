"""Every recipe follows CONVENTIONS.md: the same common options, the same run-directory contents."""

import json

import pytest
from conftest import RECIPES, read_metrics, smoke_args

COMMON = ["--max-steps", "--batch-size", "--lr", "--seed", "--device", "--precision", "--compile", "--num-workers",
          "--data-dir", "--run-dir", "--resume", "--checkpoint-every", "--progress"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_lists_every_common_option(recipe, run_inprocess):
    result = run_inprocess(recipe, "--help")
    assert result.code == 0
    assert "--epochs" in result.stdout or "--steps" in result.stdout
    for option in COMMON:
        assert f"{option} " in result.stdout or f"{option}," in result.stdout, option


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
    assert result.stdout.strip().splitlines()[-1].startswith("done: ")
    assert (tmp_path / "checkpoints" / "last.pt").is_file()
    assert (tmp_path / "checkpoints" / "best.pt").is_file()  # every recipe has a validation metric

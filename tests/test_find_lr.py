"""scripts/find_lr.py: the learning-rate range test."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from conftest import run_subprocess

from scripts import find_lr

# Full-batch gradient descent on mean((Xw - y)^2), X (256, 10) standard normal: the Hessian 2 X^T X / 256 has
# eigenvalues 1.37 to 2.84 at this seed, so any rate below 2 / 2.84 = 0.70 converges and 2 / (1.37 + 2.84) = 0.47
# converges fastest; far below 0.05 it barely moves in a few steps.
LEAST_SQUARES = '''
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter


def main(lr: float = 0.1, epochs: int = 1, max_steps: int = 100, log_every: int = 10, run_dir: Path = Path("r")):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 10, generator=g)
    y = x @ torch.randn(10, 1, generator=g)
    w = torch.zeros(10, 1, requires_grad=True)
    optimizer = torch.optim.SGD([w], lr=lr)
    writer = SummaryWriter(str(run_dir))
    for step in range(1, min(epochs, max_steps) + 1):
        loss = ((x @ w - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        writer.add_scalar("train/loss", loss.item(), step)
    writer.close()
'''


def left_in(folder) -> list[str]:
    """What is in ``folder``, less the compiler cache torch makes in the temporary folder (set to it here)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("torchinductor_"))


def test_the_suggestion_on_a_problem_whose_good_rates_are_known(tmp_path, capsys, monkeypatch):
    (tmp_path / "least_squares.py").write_text(textwrap.dedent(LEAST_SQUARES))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its run folder: the last assert sees it (left_in)
    monkeypatch.chdir(tmp_path)
    assert find_lr.main([str(tmp_path / "least_squares.py"), "--plot", str(tmp_path / "lr.png")]) == 0
    out = capsys.readouterr().out
    rate = float(re.search(r"suggested: --lr ([\d.e-]+)", out)[1])
    assert 0.05 <= rate <= 0.70, out  # converges, and well within the stable range
    assert (tmp_path / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"--lr {rate:g}" in out.splitlines()[-1]
    assert left_in(tmp_path) == ["least_squares.py", "lr.png"]  # no run left behind


def test_the_pieces_of_the_range_test():
    rates = find_lr.ramp(1e-4, 1.0, 5)
    assert rates == pytest.approx([1e-4, 1e-3, 1e-2, 1e-1, 1.0])
    assert find_lr.smoothed([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])  # bias-corrected: no pull to 0
    assert find_lr.until_divergence([4.0, 3.0, 2.0, 7.9, 8.1, 1.0]) == 4  # 8.1 > 4 x 2.0
    assert find_lr.until_divergence([1.0, math.nan]) == 1
    falling = [10.0] * 10 + [10.0, 9.0, 7.0, 4.0, 3.5, 3.4, 3.4]
    assert find_lr.steepest(falling) == 12  # (4 - 9) / 2 around index 12 is the steepest fall
    assert find_lr.steepest([1.0] * 20) is None  # flat: nothing to suggest
    diverging = falling + [6.0, 14.0, 14.0, 4.0, 13.0]  # past the lowest point a dip falls faster than anything
    assert find_lr.steepest(diverging) == 12  # before it: the suggestion stays below where the loss turns up
    # a loss below 0 (a negative log-likelihood): each step below its lowest read as 4x it, so as diverging
    assert find_lr.until_divergence([-1.0, -1.1, -1.2, -1.3]) == 4
    assert find_lr.until_divergence([-1.0, -2.0, -1.5, 4.1]) == 3  # 4.1 > -2.0 + 3 x 2.0
    # the loss itself bottoming out at index 13: its average, lagging, falls fastest after it (the loss diverges
    # there); the suggestion is taken before it
    assert find_lr.trend_bottom([10.0] * 12 + [5.0, 2.0, 1.0, 3.0, 60.0, 90.0, 99.0]) == 13  # medians 5, 3, 3, 3
    assert find_lr.trend_bottom([10.0] * 12 + [1.0] + [10.0] * 5 + [2.0] * 6) == 18  # one lucky batch is no bottom
    lagging = [10.0] * 12 + [9.5, 9.0, 8.0, 6.0, 5.9, 5.8]
    assert find_lr.steepest(lagging) == 14 and find_lr.steepest(lagging, 13) == 13  # at most the bottom
    assert find_lr.steepest(lagging, 12) == 12 and find_lr.steepest(lagging, 9) is None  # before it settled


TWO_GROUPS = LEAST_SQUARES.replace(
    "optimizer = torch.optim.SGD([w], lr=lr)",
    "head = torch.zeros(1, requires_grad=True)\n"
    "    optimizer = torch.optim.SGD([{'params': [w], 'lr': lr * 0.1}, {'params': [head]}], lr=lr)\n"
    "    seen = []").replace(
    "        optimizer.step()",
    "        optimizer.step()\n"
    "        seen.append([group['lr'] for group in optimizer.param_groups])\n"
    "        Path('seen.json').write_text(__import__('json').dumps(seen))")


def test_groups_at_their_own_rates_keep_their_ratio_along_the_ramp(tmp_path, capsys, monkeypatch):
    """A fine-tuned backbone trains at a tenth of the head's rate: the ramp sets the head's, and the backbone's
    follows at a tenth (both at the head's rate, the suggestion measured another training than it prints)."""
    (tmp_path / "two_groups.py").write_text(TWO_GROUPS)
    monkeypatch.chdir(tmp_path)
    assert find_lr.main([str(tmp_path / "two_groups.py"), "--from", "1e-3", "--to", "1", "--ramp-steps", "20",
                         "--plot", str(tmp_path / "lr.png")]) == 0
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert len(seen) == 20 and seen[0] == pytest.approx([1e-4, 1e-3]) and seen[-1] == pytest.approx([0.1, 1.0])


def test_a_real_recipe_gets_its_own_option_and_the_user_runs_are_untouched(tmp_path, capsys, monkeypatch, mnist_dir):
    monkeypatch.chdir(tmp_path)
    args = ["mixed_precision", "--samples", "1024", "--width", "32", "--batch-size", "64", "--device", "cpu",
            "--ramp-steps", "60", "--plot", str(tmp_path / "mp.png")]
    assert find_lr.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"suggested: --lr [\d.e-]+", out)
    assert "--ramp-steps" not in out.splitlines()[-1] and "--samples 1024" in out.splitlines()[-1]
    assert not (tmp_path / "runs").exists()
    # mnist_onecycle's rate is its OneCycle peak, --max-lr (it takes --lr too, so a hard-coded --lr would still run)
    args = ["mnist_onecycle", "--data-dir", str(mnist_dir), "--width", "4", "--batch-size", "32", "--device", "cpu",
            "--ramp-steps", "20", "--plot", str(tmp_path / "mnist.png")]
    assert find_lr.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"suggested: --max-lr [\d.e-]+", out) and " --max-lr " in out.splitlines()[-1], out


RECIPES = ", ".join(sorted(p.stem for p in (find_lr.ROOT / "recipes").glob("*.py")))


@pytest.mark.parametrize(("args", "code", "message"), [
    (["mixed_precision", "--run-dir", "x"], 2, "--run-dir: the range test runs the recipe in a run directory"),
    (["mixed_precision", "--ramp-steps", "5"], 2, "argument --ramp-steps: from 20 to 100,000 steps, got 5"),
    (["mixed_precision", "--ramp-steps", "1000000000"], 2, "from 20 to 100,000 steps, got 1000000000"),
    (["mixed_precision", "--from", "1", "--to", "0.1"], 2, "need 0 < --from < --to"),
    # a ratio past float64: every rate after the first was inf, and called a divergence
    (["mixed_precision", "--from", "1e-300", "--to", "1e300"], 2, "arguments --from and --to: need 0 < --from < --to "
     "<= 1e30, --to less than 1e300 times --from, got 1e-300 and 1e+300"),
    (["mixed_precision", "--from", "1e38", "--to", "1e39"], 2, "times --from, got 1e+38 and 1e+39"),
    (["mixed_precision", "--from", "5e-324", "--to", "1"], 2, "--to less than 1e300 times --from, got 5e-324 and 1.0"),
    # a missing file whose name holds "diverged" is that error, not a divergence
    (["tabular_mlp", "--csv", "{tmp}/not_diverged.csv", "--target", "label"], 1,
     "error: {tmp}/not_diverged.csv: no such file\n"),
    (["mixed_precision", "--plot", ".png"], 2, "argument --plot: give a file name that ends in .png, such as "
     "lr_find.png, not '.png'"),  # was ".png must end in .png"
    (["no_such_recipe"], 2, f"error: argument RECIPE: no recipe 'no_such_recipe'; give one of {RECIPES}, or the "
     "path of a recipe file\n"),
    # options that make a recipe do something other than train: no steps to measure (was "did not fall over 0 steps")
    (["tabular_mlp", "--csv", "{table_csv}", "--target", "label", "--cv", "3"], 2,
     "error: --cv: the range test measures a training run, and --cv makes the recipe do something else\n"),
    (["compiled_model", "--traps", "--samples", "512"], 2,
     "error: --traps: the range test measures a training run, and --traps makes the recipe do something else\n"),
    (["tiny_transformer", "--sample-only"], 2, "error: --sample-only: the range test measures a training run, and "
     "--sample-only makes the recipe do something else\n"),
    (["mixed_precision", "--width", "0"], 2, "error: the recipe refused its options"),  # its usage error: 2
    # find_lr's own --epochs (or --steps, --warmup-steps) came after these, and took the recipe's last word: a bad
    # value passed, and the printed command failed; a value left out took find_lr's as its own
    (["mixed_precision", "--epochs", "0"], 2, "error: the recipe refused its options: Invalid value for '--epochs': "),
    (["tiny_transformer", "--warmup-steps", "-3"], 2, "error: the recipe refused its options: Invalid value for "
     "'--warmup-steps': "),
    (["mixed_precision", "--samples"], 2, "error: the recipe refused its options: Option '--samples' requires an "
     "argument.\n"),
    # LBFGS's line search sets its step: a ramp of 100 steps ran for minutes, then "the loss did not fall"
    (["tabular_mlp", "--csv", "{table_csv}", "--target", "label", "--optimizer=lbfgs"], 2, "error: --optimizer "
     "lbfgs: LBFGS finds its step length by line search, so the loss shows no slope over a range of rates; the "
     "range test is for sgd, adam and adamw\n"),
    (["tabular_mlp", "--csv", "{table_csv}", "--target", "label", "--config", "{tmp}/lbfgs.json"], 2,  # replayed
     "error: --optimizer lbfgs: LBFGS finds its step length by line search"),
    # --patience would end the ramp early
    (["tabular_mlp", "--csv", "{table_csv}", "--target", "label", "--patience", "1"], 2,
     "error: --patience: the range test runs the recipe in a run directory of its own, for its own steps\n"),
    # options the ramp would ignore: it sets the rate, and throws its run directory away
    (["mixed_precision", "--lr", "0.5"], 2, "error: --lr: the range test sweeps the learning rate itself, from --from "
     "to --to\n"),
    (["mnist_onecycle", "--max-lr=0.5"], 2, "error: --max-lr: the range test sweeps the learning rate itself"),
    (["ddp_mlp", "--profile", "1"], 2, "error: --profile: the range test runs the recipe in a run directory of its "
     "own"),
    (["ddp_mlp", "--checkpoint-every=1"], 2, "error: --checkpoint-every: the range test runs the recipe in a run "
     "directory of its own"),
    # a Python file that is not a recipe is refused without being run
    (["{tmp}/other.py"], 2, "error: argument RECIPE: {tmp}/other.py is not a recipe: it defines no main()\n"),
    (["{tmp}/broken.py"], 2, "error: argument RECIPE: cannot read {tmp}/broken.py as Python: "),
])
def test_mistakes_are_one_line(args, code, message, table_csv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    (tmp_path / "broken.py").write_text("def main(:\n")
    (tmp_path / "lbfgs.json").write_text('{"optimizer_name": "lbfgs"}')  # a config.json of an LBFGS run, in part
    try:
        result = find_lr.main([a.replace("{table_csv}", str(table_csv)).replace("{tmp}", str(tmp_path))
                               for a in args])
    except SystemExit as exit_:
        result = exit_.code
    err = capsys.readouterr().err
    assert result == code and message.replace("{tmp}", str(tmp_path)) in err, err
    assert "Traceback" not in err and not (tmp_path / "ran").exists()


def test_an_ejected_copy_is_measured_like_the_recipe(tmp_path, capsys, monkeypatch):
    """The copy runs with its own core (its own option checks and errors), not the clone's."""
    from conftest import run_subprocess

    monkeypatch.chdir(tmp_path)
    assert run_subprocess(["scripts/eject.py", "mixed_precision", tmp_path / "mine.py"]).code == 0
    args = ["--samples", "1024", "--width", "32", "--batch-size", "64", "--device", "cpu", "--ramp-steps", "60"]
    assert find_lr.main([str(tmp_path / "mine.py"), *args, "--plot", str(tmp_path / "mine.png")]) == 0
    copy = capsys.readouterr().out
    assert find_lr.main(["mixed_precision", *args, "--plot", str(tmp_path / "recipe.png")]) == 0
    recipe = capsys.readouterr().out
    assert re.search(r"suggested: --lr [\d.e-]+", copy)
    assert copy.splitlines()[-2] == recipe.splitlines()[-2]  # the same suggestion: the same training


def test_a_warm_up_longer_than_the_ramp_is_left_out_of_it(tmp_path, capsys, monkeypatch):
    """The ramp sets every rate itself: a training command's --warmup-steps 500 must not refuse a 20-step ramp."""
    monkeypatch.chdir(tmp_path)
    options = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
               "--eval-batches", "1", "--sample-tokens", "4", "--peak-flops", "1e11", "--warmup-steps", "500"]
    assert find_lr.main(["tiny_transformer", *options, "--ramp-steps", "20", "--to", "1",
                         "--plot", str(tmp_path / "tt.png")]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "20 steps from 1.0e-07 to 1.0e+00 (ran every step" in out
    assert "--warmup-steps 500 --lr " in out.splitlines()[-1]  # the command suggested keeps the user's warm-up


def test_ctrl_c_during_the_ramp_is_exit_130_in_one_line(tmp_path, capsys, monkeypatch):
    from common import cli

    def interrupted(main, argv=None):  # the recipe saved and stopped, as on Ctrl-C
        raise SystemExit(130)

    monkeypatch.setattr(cli, "run_recipe", interrupted)
    assert find_lr.main(["mixed_precision", "--plot", str(tmp_path / "x.png")]) == 130
    assert capsys.readouterr().err == "error: interrupted; nothing written\n" and not (tmp_path / "x.png").exists()


def test_a_loss_that_diverges_before_the_smoothing_settles_says_so(tmp_path, capsys, monkeypatch):
    """From 0.3 the ramp passes 0.70, where gradient descent diverges here, within a few steps: too few points for a
    slope, and the advice is a lower start, not a wider range (which was the message, and made it worse)."""
    (tmp_path / "least_squares.py").write_text(textwrap.dedent(LEAST_SQUARES))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its run folder: the last assert sees it (left_in)
    monkeypatch.chdir(tmp_path)
    args = [str(tmp_path / "least_squares.py"), "--from", "0.3", "--to", "1e6", "--ramp-steps", "20",
            "--plot", str(tmp_path / "lr.png")]
    assert find_lr.main(args) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: the loss diverged after \d steps, at [\d.e+]+: too few to find its slope; start lower "
                        r"\(--from\) or give more --ramp-steps\n", err), err
    assert left_in(tmp_path) == ["least_squares.py"]  # no plot, no run left behind


@pytest.mark.parametrize(("ramp", "said"), [
    (["--ramp-steps", "20", "--to", "100"], None),  # suggested 1.3, where any rate above 0.70 diverges
    (["--ramp-steps", "20", "--from", "1e-2", "--to", "100"],
     r"error: the loss bottomed out at step 10 of 14, at 0\.78\d*, too soon: its average takes 10 steps to settle, "
     r"too few below that rate to find its slope; start lower \(--from\) or give more --ramp-steps\n"),
    (["--nan"], r"error: the loss is not finite at the first step, before any update \(nan\): check the data and "
                r"the model\n"),  # it said the loss diverged after 0 steps, and to start lower than 1e-07
])
def test_a_short_ramp_suggests_no_rate_that_diverges(ramp, said, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = textwrap.dedent(LEAST_SQUARES)
    if ramp == ["--nan"]:
        recipe, ramp = recipe.replace('loss.item(), step)', 'float("nan"), step)'), []
    (tmp_path / "least_squares.py").write_text(recipe)
    code = find_lr.main([str(tmp_path / "least_squares.py"), *ramp, "--plot", str(tmp_path / "lr.png")])
    out, err = capsys.readouterr()
    if said is None:
        assert code == 0, err
        rate = float(re.search(r"suggested: --lr ([\d.e-]+)", out)[1])
        assert 0.05 < rate < 0.70  # it learns, and converges (see LEAST_SQUARES)
    else:
        assert code == 1 and re.fullmatch(said, err), err


def test_a_loss_that_fell_hard_and_bottomed_out_early_is_told_to_start_lower(tmp_path, capsys, monkeypatch):
    """Its average, settled after the fall, and the fall's large step-to-step changes (read as noise) said it
    never fell, and the advice was a wider range."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "least_squares.py").write_text(textwrap.dedent(LEAST_SQUARES))
    losses = [10.0, 8.0, 5.0, 3.0, 2.0, 1.5, 1.4, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 30.0, 45.0, 60.0]
    monkeypatch.setattr(find_lr, "range_test", lambda recipe, options, rates, work: (
        rates[: len(losses)], losses, "diverged"))
    assert find_lr.main([str(tmp_path / "least_squares.py"), "--plot", str(tmp_path / "lr.png")]) == 1
    assert capsys.readouterr().err.startswith("error: the loss bottomed out at step 6 of ")


def test_a_loss_below_zero_gets_the_suggestion_its_shape_gets(tmp_path, capsys, monkeypatch):
    """The same loss less 100 was said to diverge after 1 step: each fall read as a rise past 4x its lowest."""
    monkeypatch.chdir(tmp_path)
    rates = []
    for name, shift in [("plain.py", ""), ("shifted.py", " - 100")]:
        (tmp_path / name).write_text(textwrap.dedent(LEAST_SQUARES).replace("loss.item(), step)",
                                                                          f"loss.item(){shift}, step)"))
        assert find_lr.main([str(tmp_path / name), "--plot", str(tmp_path / f"{name}.png")]) == 0
        rates.append(re.search(r"suggested: --lr ([\d.e-]+)", capsys.readouterr().out)[1])
    assert rates[0] == rates[1]


def test_a_recipe_counting_steps_from_0_ran_every_step_and_one_without_lr_is_refused(tmp_path, capsys,
                                                                                     monkeypatch):
    """Steps logged from 0 ran all 100 steps, which the largest step (99) took for an early stop; a recipe whose
    rate option is not --lr was told to take --lr, which it refused."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "from0.py").write_text(textwrap.dedent(LEAST_SQUARES).replace("loss.item(), step)",
                                                                            "loss.item(), step - 1)"))
    assert find_lr.main([str(tmp_path / "from0.py"), "--plot", str(tmp_path / "a.png")]) == 0, capsys.readouterr()
    assert re.search(r"suggested: --lr [\d.e-]+", capsys.readouterr().out)
    (tmp_path / "rate.py").write_text(textwrap.dedent(LEAST_SQUARES).replace("lr: float", "rate: float").replace(
        "lr=lr", "lr=rate"))
    assert find_lr.main([str(tmp_path / "rate.py"), "--plot", str(tmp_path / "b.png")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'rate.py'} has no --lr or --max-lr option to suggest a " \
                                      "rate for\n"
    assert not (tmp_path / "b.png").exists()


def test_a_recipe_that_stops_early_or_logs_no_loss_is_one_line(tmp_path, capsys, monkeypatch):
    """Early stopping (a replayed --patience, say) ended the ramp at step 30 of 100: the rates past it were never
    tried, and the suggestion from the first 30 was reported as from a whole ramp. A recipe that logs no
    train/loss was said to have diverged after 0 steps."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its run folder: the last assert sees it (left_in)
    monkeypatch.chdir(tmp_path)
    short = LEAST_SQUARES.replace("min(epochs, max_steps)", "min(epochs, max_steps, 30)")
    (tmp_path / "short.py").write_text(textwrap.dedent(short))
    (tmp_path / "silent.py").write_text(textwrap.dedent(LEAST_SQUARES).replace(
        'writer.add_scalar("train/loss", loss.item(), step)', "pass"))
    assert find_lr.main([str(tmp_path / "short.py"), "--plot", str(tmp_path / "s.png")]) == 1
    assert capsys.readouterr().err == "error: the recipe stopped after 30 of the 100 steps, at 2.2e-05: leave " \
                                      "out what ends it early (--patience, a --config that sets it)\n"
    assert find_lr.main([str(tmp_path / "silent.py"), "--plot", str(tmp_path / "s.png")]) == 1
    assert capsys.readouterr().err == "error: the recipe logged no train/loss to TensorBoard in run/: the range " \
                                      "test reads each step's loss there\n"
    assert left_in(tmp_path) == ["short.py", "silent.py"]


def test_options_a_config_replays_are_refused_as_if_given(table_csv, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"recipe": "tabular_mlp", "patience": 1, "lr": 0.01, "log_every": 5}))
    with pytest.raises(SystemExit) as exit_:
        find_lr.main(["tabular_mlp", "--csv", str(table_csv), "--target", "label", "--config", str(config)])
    assert exit_.value.code == 2 and capsys.readouterr().err.endswith(
        "error: --config sets --patience, which the range test cannot take: replay a copy of the file without it\n")
    # what the range test sets itself (the rate, the log interval) may be in the file: a run's config.json is
    assert find_lr.replayed(find_lr.load_recipe("tabular_mlp"), ["--config", str(config)]) == ["--lr", "--log-every",
                                                                                                 "--patience"]
    assert find_lr.replayed(find_lr.load_recipe("tabular_mlp"), ["--config", str(config), "--patience", "3"]) == [
        "--lr", "--log-every"]  # given: the command line wins


def test_an_existing_plot_that_is_no_figure_is_kept_and_found_before_the_test(tmp_path, capsys, monkeypatch):
    from common import cli

    monkeypatch.setattr(cli, "run_recipe", lambda main, argv=None: pytest.fail("the range test ran"))
    (tmp_path / "lr_find.png").write_text("my notes")
    assert find_lr.main(["mixed_precision", "--plot", str(tmp_path / "lr_find.png")]) == 1
    assert capsys.readouterr().err == f"error: cannot write --plot {tmp_path / 'lr_find.png'}: it exists and is no " \
                                      "figure of ours (a PNG that matplotlib wrote): choose another name\n"
    assert (tmp_path / "lr_find.png").read_text() == "my notes"
    # a folder no file can be made in: found before the range test too (it ran, then failed, the suggestion lost)
    assert find_lr.main(["mixed_precision", "--plot", "/proc/lr_find.png"]) == 1
    assert capsys.readouterr().err.startswith("error: cannot write --plot /proc/lr_find.png: no file can be made in "
                                              "/proc (")


def test_a_plot_that_fails_to_be_written_keeps_the_suggestion(tmp_path, capsys, monkeypatch):
    """A full disk as the PNG is written, after the range test: the suggestion is printed all the same, then the
    error (it was the error alone, the whole test's result lost)."""
    (tmp_path / "least_squares.py").write_text(textwrap.dedent(LEAST_SQUARES))

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(find_lr, "plot", full_disk)
    assert find_lr.main([str(tmp_path / "least_squares.py"), "--plot", str(tmp_path / "lr.png")]) == 1
    out, err = capsys.readouterr()
    assert "; no plot" in out and re.search(r"suggested: --lr [\d.e-]+", out) and "--lr" in out.splitlines()[-1]
    assert err == f"error: cannot write --plot {tmp_path / 'lr.png'}: No space left on device\n"


def test_the_printed_command_runs_from_the_folder_the_user_is_in(tmp_path, capsys, monkeypatch):
    """It said python recipes/NAME.py wherever it ran: from another folder there is no recipes/ to run."""
    (tmp_path / "least_squares.py").write_text(textwrap.dedent(LEAST_SQUARES))
    monkeypatch.chdir(tmp_path)
    assert find_lr.typed(find_lr.ROOT / "recipes" / "mixed_precision.py") == \
        str(find_lr.ROOT / "recipes" / "mixed_precision.py")
    assert find_lr.typed(tmp_path / "least_squares.py") == "least_squares.py"
    monkeypatch.chdir(find_lr.ROOT)
    assert find_lr.typed(find_lr.ROOT / "recipes" / "mixed_precision.py") == "recipes/mixed_precision.py"


def test_sigterm_is_one_line_and_leaves_no_temporary_folder(tmp_path):
    """The range test's run directory is a temporary folder: a SIGTERM (a scheduler's) must not leave it behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    args = [sys.executable, "scripts/find_lr.py", "mixed_precision", "--samples", "1024", "--width", "16",
            "--batch-size", "64", "--device", "cpu", "--ramp-steps", "100000", "--plot", tmp_path / "x.png"]
    proc = subprocess.Popen(list(map(str, args)), cwd=find_lr.ROOT, env={**os.environ, "TMPDIR": str(tmp)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp.glob("find_lr.*/run/events.out.tfevents.*")) and time.monotonic() < deadline:
        time.sleep(0.2)  # until the recipe trains
    if not list(tmp.glob("find_lr.*/run/events.out.tfevents.*")):
        proc.kill()
        pytest.fail("the run never started: the signal would test nothing")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (130, "error: interrupted; nothing written\n")
    assert list(tmp.glob("find_lr.*")) == [] and not (tmp_path / "x.png").exists()


def test_a_failed_write_of_the_plot_leaves_the_earlier_one_as_it_was(tmp_path):
    """The disk fills (here: a file-size limit) while the PNG is written: the earlier plot stays whole."""
    out = tmp_path / "lr.png"
    draw = ("import sys; from pathlib import Path; sys.path.insert(0, '.'); from scripts import find_lr; "
            f"find_lr.plot([1e-3, 1e-2, 1e-1], [2.0, 1.0, 3.0], [2.0, 1.5, 2.0], 1e-2, '--lr', Path({str(out)!r}))")
    assert run_subprocess([sys.executable, "-c", draw]).code == 0
    before = out.read_bytes()
    result = run_subprocess([sys.executable, "-c", draw], max_file_bytes=len(before) // 2)
    assert result.code == 1 and "OSError: [Errno 27] File too large" in result.stderr, result.stderr
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["lr.png"]


def test_steps_the_gradscaler_skips_take_no_rate_and_are_no_early_stop(tmp_path, capsys, monkeypatch):
    """fp16: a step the GradScaler skips calls no optimizer.step() and logs no loss. The ramp counted calls but paired
    losses with rates by step number, so every loss after a skip was plotted at a rate its step never applied, and
    a skipped last step was reported as early stopping ("stopped after 19 of the 20 steps")."""
    monkeypatch.chdir(tmp_path)
    skipping = textwrap.dedent(LEAST_SQUARES).replace("        optimizer.step()\n", """\
        writer.add_scalar("train/lr", lr, step)  # every step, as the recipes log it
        if step % 5 == 0:  # the GradScaler found inf in the gradients: no update, no loss logged
            continue
        optimizer.step()
        applied.append((optimizer.param_groups[0]["lr"], loss.item()))
""").replace("    writer.close()\n", "    writer.close()\n    Path('applied.json').write_text(json.dumps(applied))\n")
    (tmp_path / "skipping.py").write_text("import json\napplied = []\n" + skipping)
    drawn = []
    monkeypatch.setattr(find_lr, "plot", lambda rates, losses, *_: drawn.append((rates, losses)))
    assert find_lr.main([str(tmp_path / "skipping.py"), "--ramp-steps", "20", "--to", "0.5"]) == 0, \
        capsys.readouterr().err
    applied = json.loads((tmp_path / "applied.json").read_text())
    assert len(applied) == 16 and drawn == [([rate for rate, _ in applied], [loss for _, loss in applied])]
    assert [rate for rate, _ in applied] == pytest.approx(find_lr.ramp(1e-7, 0.5, 20)[:16])  # the ramp in turn
    assert "16 steps from 1.0e-07 to " in capsys.readouterr().out


def test_no_rate_is_suggested_where_the_loss_never_fell_below_its_start(tmp_path, capsys, monkeypatch):
    """At 1e-9 to 1e-8 nothing moves: the smoothed loss's lowest was its first point, and a rate was suggested."""
    noise = [2.0 + 0.05 * ((-1) ** i) for i in range(20)]  # batches that differ: a smoothed loss that wanders
    assert find_lr.steepest(find_lr.smoothed(noise)) is not None and not find_lr.fell(noise, find_lr.smoothed(noise))
    falling = noise[:10] + [1.9, 1.8, 1.7, 1.75, 1.6, 1.5, 1.4, 1.45, 1.3, 1.2]
    assert find_lr.fell(falling, find_lr.smoothed(falling))
    assert not find_lr.fell([2.0 - 1e-7 * i for i in range(20)], find_lr.smoothed([2.0 - 1e-7 * i for i in range(20)]))
    steadily = [10 * 0.7 ** i for i in range(20)]  # falling from the first step: no noise, however steep
    assert find_lr.fell(steadily, find_lr.smoothed(steadily))
    (tmp_path / "least_squares.py").write_text(textwrap.dedent(LEAST_SQUARES))
    monkeypatch.chdir(tmp_path)
    assert find_lr.main([str(tmp_path / "least_squares.py"), "--from", "1e-9", "--to", "1e-8", "--ramp-steps", "20",
                         "--plot", str(tmp_path / "lr.png")]) == 1
    assert capsys.readouterr().err == "error: the loss did not fall over 20 steps from 1e-09 to 1e-08: try a wider " \
                                      "range (--from, --to) or more --ramp-steps\n"
    assert not (tmp_path / "lr.png").exists()
    # a loss that falls fast from the first step is no noise: 5.63 -> 0.86 still gets its suggestion
    assert find_lr.main([str(tmp_path / "least_squares.py"), "--from", "0.05", "--to", "1", "--ramp-steps", "20",
                         "--plot", str(tmp_path / "lr.png")]) == 0
    assert 0.05 <= float(re.search(r"suggested: --lr ([\d.e-]+)", capsys.readouterr().out)[1]) <= 0.70


@pytest.mark.parametrize(("tool", "nothing"), [("find_lr", "written"), ("doctor", "measured")])
def test_sigterm_as_the_recipe_is_imported_is_one_line(tool, nothing, tmp_path):
    """Loading the recipe (importing torch: a second or two) came before the tool's KeyboardInterrupt handler: a
    Ctrl-C or SIGTERM then was a traceback, exit -2."""
    recipe = tmp_path / "slow_import.py"
    recipe.write_text("import time\nfrom pathlib import Path\n\n\ndef main():\n    pass\n\n\n"
                      "Path(__file__).with_name('importing').touch()\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, f"scripts/{tool}.py", str(recipe)], cwd=find_lr.ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "importing").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, f"error: interrupted; nothing {nothing}\n")

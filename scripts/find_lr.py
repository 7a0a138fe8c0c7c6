"""Find a learning rate: the range test (Smith, "Cyclical Learning Rates for Training Neural Networks", 2017).

    python scripts/find_lr.py mnist_onecycle                     # any recipe, with any of its options
    python scripts/find_lr.py tabular_mlp --csv my.csv --target price --plot price_lr.png

The recipe trains as it would, with its own model, data, optimizer and step, for ``--ramp-steps`` optimizer
steps (100) in a temporary run directory; before every step the rates are set along an exponential ramp from
``--from`` to ``--to`` (at most 1e30), whatever the recipe's schedule says: the recipe's largest rate follows the
ramp and every other parameter group keeps its ratio to it, as a fine-tuned backbone does (a global optimizer
pre-hook: no recipe knows it is being measured). Each step's training loss, which the recipe
logs to TensorBoard anyway, is smoothed by an exponential moving average (beta 0.98, bias-corrected: the
first steps are not pulled towards 0); the curve is cut where the smoothed loss passes 4x its lowest (a loss below
0: rises by 3x its size; the recipe runs every step unless it diverges). The suggestion is the rate where the
smoothed loss falls fastest (its steepest descent against log rate), at most the rate where the loss itself
bottoms out: high enough to learn fast, below where the loss turns up; none if it never falls below its first
steps' mean by more than their noise. The average lags the loss by about 50 steps, which moves the steepest
point to higher rates: the rule is tuned at the default 100 steps, and a longer ramp suggests lower rates (on
the tests' least-squares problem: 0.14 at 100 steps, 0.037 at 300). A recipe with a one-cycle schedule is given
it as ``--max-lr``, the others as ``--lr``.

Writes a PNG of loss against rate (``--plot``, default lr_find.png) and prints the suggested option and the
command line to train with it. Your run directories are untouched: the test's own is removed afterwards.
Exit status 0; 1 with one line ``error: ...`` when the recipe fails or the loss never falls; 2 on a usage error;
130 on Ctrl-C or SIGTERM, the temporary folder removed. An existing ``--plot`` is replaced only if it is a figure
(a PNG that matplotlib wrote).
"""

import argparse
import ast
import contextlib
import importlib.util
import io
import json
import math
import shlex
import signal
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the recipes import common/ from the clone

from scripts.plot_runs import not_replaceable, save_png  # noqa: E402

# options that make a recipe do something other than train (compare runs, count compiler traps, predict,
# cross-validate, only sample): no training steps for the range test or the doctor to measure
NOT_TRAINING = ("--compare", "--traps", "--predict", "--cv", "--sample-only")
# options that would change the range test's own run: where it is, how long, what it writes
OWN_STEPS = ("--run-dir", "--resume", "--max-steps", "--log-every", "--patience", "--profile", "--checkpoint-every")


class FinderError(Exception):
    """A problem a user can fix: shown as one line, exit 1, or 2 where it is the recipe's usage error."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def load_recipe(name: str):
    """A recipe by name (recipes/NAME.py) or by path."""
    path = Path(name) if name.endswith(".py") else ROOT / "recipes" / f"{name}.py"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in (ROOT / "recipes").glob("*.py")))
        raise FinderError(f"no recipe {name!r}; give one of {known}, or the path of a recipe file")
    try:  # before running it: a file of other code is refused, not executed
        tree = ast.parse(path.read_bytes(), str(path))
    except (SyntaxError, ValueError, OSError) as err:
        raise FinderError(f"cannot read {path} as Python: {err}") from None
    if not any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
        raise FinderError(f"{path} is not a recipe: it defines no main()")
    spec = importlib.util.spec_from_file_location(f"measured_{path.stem}", path)  # a name of its own: no clash
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # an ejected copy's dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise FinderError(f"{path} fails when it is imported: {type(err).__name__}: {err}") from None
    return module


def interrupt(signum: int, frame) -> None:
    """SIGTERM as Ctrl-C: the temporary run directory is removed on the way out, and no traceback is shown."""
    raise KeyboardInterrupt


def typed(path: Path) -> str:
    """``path`` as a command run here names it: relative to the current folder when inside it, else whole (the
    printed command then works where the user is, as the recipe's own relative paths, --csv say, do)."""
    path = path.resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def first_given(options: list[str], names: tuple[str, ...]) -> str | None:
    """The first of ``names`` that ``options`` give (``--cv 3`` or ``--cv=3``), or None."""
    return next((name for name in names if any(a == name or a.startswith(name + "=") for a in options)), None)


def ramp(start: float, end: float, steps: int) -> list[float]:
    """``steps`` rates from ``start`` to ``end``, equally spaced in log scale."""
    return [start * (end / start) ** (i / max(1, steps - 1)) for i in range(steps)]


def smoothed(losses: list[float], beta: float = 0.98) -> list[float]:
    """The bias-corrected exponential moving average of ``losses`` (as Adam corrects its moments)."""
    average, out = 0.0, []
    for i, loss in enumerate(losses):
        average = beta * average + (1 - beta) * loss
        out.append(average / (1 - beta ** (i + 1)))
    return out


def until_divergence(smooth: list[float], factor: float = 4.0) -> int:
    """How many points to keep: up to where the smoothed loss passes ``factor`` times its lowest so far (a loss
    below 0, a negative log-likelihood say: where it rises above its lowest by ``factor - 1`` times its size)."""
    lowest = math.inf
    for i, loss in enumerate(smooth):
        if not math.isfinite(loss) or loss > lowest + (factor - 1) * abs(lowest):
            return i
        lowest = min(lowest, loss)
    return len(smooth)


SETTLING = 10  # points the smoothed loss needs before its slope means anything
MIN_FALL = 1e-3  # a smaller fall, relative to where the smoothed loss settled, is rounding, not learning


def trend_bottom(losses: list[float]) -> int:
    """Where the loss itself bottoms out: the step whose 5 losses around it have the lowest median (no lag, unlike
    an average; one lucky batch does not move it as it moves the lowest loss). The last index if too few."""
    medians = [statistics.median(losses[i - 2 : i + 3]) for i in range(2, len(losses) - 2)]
    return 2 + medians.index(min(medians)) if medians else len(losses) - 1


def steepest(smooth: list[float], bottom: int | None = None, skip_start: int = SETTLING) -> int | None:
    """The index where the smoothed loss falls fastest per step of log rate (the rates are log-spaced, so per
    index), leaving out the first ``skip_start`` points (the average is still settling) and everything from its
    lowest point on: past it the loss is diverging, and a dip between two spikes there is no place to train. Nor
    past ``bottom``, where the loss itself bottoms out (``trend_bottom``): the average lags the loss by about 50
    steps, so on a short ramp its steepest fall comes where the loss already turns up (a rate that diverges)."""
    if len(smooth) < skip_start + 3:
        return None
    end = min(len(smooth) - 1, smooth.index(min(smooth[skip_start:]), skip_start) + 1)
    if bottom is not None:
        end = min(end, bottom + 1)
    if end <= skip_start:
        return None
    slopes = [(smooth[i + 1] - smooth[i - 1]) / 2 for i in range(skip_start, end)]
    best = min(range(len(slopes)), key=slopes.__getitem__)
    return skip_start + best if slopes[best] < 0 else None


def fell(losses: list[float], smooth: list[float], skip_start: int = SETTLING) -> bool:
    """Whether the smoothed loss, once settled, goes below its value then (about the mean of the first
    ``skip_start`` losses) by more than their noise (two standard errors of that mean) and more than rounding
    (MIN_FALL of it): at rates too low to learn it wanders, and its steepest stretch is no place to train. The
    noise is read from the changes between successive losses, which a loss already falling does not inflate."""
    changes = [b - a for a, b in zip(losses[:skip_start], losses[1:skip_start], strict=False)]
    noise = statistics.stdev(changes) / math.sqrt(2)  # a change holds two draws of the noise
    settled = smooth[skip_start - 1]
    return min(smooth[skip_start:]) < settled - max(2 * noise / math.sqrt(skip_start), MIN_FALL * abs(settled))


def logged_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the run's TensorBoard events, by tag and step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def run_quietly(recipe, args: list[str]) -> tuple[int, str]:
    """The recipe's command in this process, its output swallowed: (exit status, its last line on stderr). A Ctrl-C
    that stopped it is raised again."""
    from common import cli

    run_recipe = getattr(recipe, "run_recipe", cli.run_recipe)  # an ejected copy's own: its options, its errors
    errors = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
            run_recipe(recipe.main, args)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    if code in (130, 143):  # the recipe saved and stopped on Ctrl-C or SIGTERM
        raise KeyboardInterrupt
    return code, (errors.getvalue().strip().splitlines() or [""])[-1]


def range_test(recipe, options: list[str], rates: list[float], work: Path) -> tuple[list[float], list[float], str]:
    """Run the recipe with ``options`` for len(rates) steps, its updates at those rates in turn; (rates, losses) up
    to where it ended, and how it ended. An fp16 step that the GradScaler skips updates nothing and logs no loss:
    it takes no rate, so each logged loss stays paired with the rate its step applied."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    applied = []  # the rate of each optimizer.step(), in order
    shares = {}  # optimizer -> each group's rate over the largest, as the recipe set them (a fine-tuned backbone's)

    def set_rate(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        applied.append(rates[min(len(applied), len(rates) - 1)])
        if optimizer not in shares:
            top = max(float(group["lr"]) for group in optimizer.param_groups)
            shares[optimizer] = [float(group["lr"]) / top if top > 0 else 1.0 for group in optimizer.param_groups]
        for group, share in zip(optimizer.param_groups, shares[optimizer], strict=True):
            group["lr"] = applied[-1] * share

    run_dir = work / "run"
    run_dir.mkdir()  # ours: the recipe does not remove a folder it did not make, so a diverged run's events stay
    args = [*options, *long_enough(recipe_options(recipe), len(rates)), "--max-steps", str(len(rates)), "--log-every",
            "1", "--run-dir", str(run_dir)]
    handle = register_optimizer_step_pre_hook(set_rate)
    try:
        code, message = run_quietly(recipe, args)
    finally:
        handle.remove()
    if code == 2:
        raise FinderError(f"the recipe refused its options: {message}", exit_code=2)
    if code and not message.startswith("error: training diverged"):  # a path may hold the word
        raise FinderError(message.removeprefix("error: ") or f"the recipe exited with status {code}")
    scalars = logged_scalars(run_dir)
    losses = scalars.get("train/loss", {})  # a step's loss, logged unless the GradScaler skipped the step
    steps = sorted(losses)[:len(applied)]  # the updates in order: the n-th logged loss's step took applied[n]
    if not steps and not code:
        raise FinderError(f"the recipe logged no train/loss to TensorBoard in {run_dir.name}/: the range test reads "
                          "each step's loss there")
    ran = len(scalars.get("train/lr", losses))  # train/lr: logged for every step, a skipped one too
    if not code and ran < len(rates):  # early stopping, say: the rest of the ramp was never tried
        raise FinderError(f"the recipe stopped after {ran} of the {len(rates)} steps, at {applied[-1]:.1e}: leave "
                          "out what ends it early (--patience, a --config that sets it)")
    ending = "diverged" if code else "ran every step"
    skipped = ran - len(losses)  # steps that logged a rate but no loss
    if skipped and not code:
        ending += f"; fp16's GradScaler skipped {skipped} more"
    return applied[:len(steps)], [losses[s] for s in steps], ending


def long_enough(known: set[str], steps: int) -> list[str]:
    """Options (after the user's, so they win) that let a recipe whose options are ``known`` run ``steps`` steps,
    however short a run its own options make: what is measured is its steps, not its schedule (the warm-up of a
    run of --steps cannot outlast it)."""
    if "--epochs" in known:
        return ["--epochs", "1000000"]
    if "--steps" in known:
        return ["--steps", str(steps), *(["--warmup-steps", "0"] if "--warmup-steps" in known else [])]
    return []


def recipe_command(recipe):
    """The recipe's command line, as click's command (``params``: its parameters' ``name``, ``opts``, ``default``)."""
    import typer

    app = typer.Typer()
    app.command()(recipe.main)
    return typer.main.get_command(app)


def recipe_parameters(recipe) -> list:
    return recipe_command(recipe).params


def refused_options(recipe, options: list[str]) -> str | None:
    """What the recipe's command line says of the user's ``options`` alone (a bad --epochs, a value left out), or
    None: in the range test, find_lr's own options come after them and would hide it."""
    import typer

    try:
        recipe_command(recipe).make_context(Path(recipe.__file__).name, list(options))
    except typer.Exit:  # --help: the recipe's, printed
        pass
    except Exception as err:  # a usage error of Typer's (its own copy of click's): one that can say what is wrong
        if not callable(getattr(err, "format_message", None)):
            raise
        return err.format_message()
    return None


def recipe_options(recipe) -> set[str]:
    """The recipe's option names, as its command line spells them."""
    return {opt for param in recipe_parameters(recipe) for opt in param.opts}


def replayed(recipe, options: list[str]) -> list[str]:
    """The options that ``--config FILE`` in ``options`` sets to other than their defaults, and ``options`` do not
    give themselves (a file that cannot be read replays nothing here: the recipe says why)."""
    path = option_value(options, "--config")
    try:
        saved = json.loads(Path(path).read_text()) if path else {}
    except (OSError, ValueError):
        return []
    return [param.opts[0] for param in recipe_parameters(recipe) if isinstance(saved, dict) and param.name in saved
            and saved[param.name] not in (None, False, param.default) and not first_given(options, param.opts)]


def option_value(options: list[str], name: str) -> str | None:
    """The value ``options`` give ``name`` (``--lr 0.1`` or ``--lr=0.1``; the last one), or None."""
    value = None
    for i, arg in enumerate(options):
        if arg == name and i + 1 < len(options):
            value = options[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def without(options: list[str], name: str) -> list[str]:
    """``options`` less ``name`` and its value (``--lr 0.1`` or ``--lr=0.1``)."""
    kept, skip = [], False
    for arg in options:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            kept.append(arg)
    return kept


def plot(rates: list[float], losses: list[float], smooth: list[float], suggestion: float | None, option: str,
         out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.0, 3.4), dpi=80)
    ax.plot(rates, losses, color="0.75", linewidth=1, label="loss per step")
    ax.plot(rates, smooth, color="C0", linewidth=1.6, label="smoothed")
    if suggestion is not None:
        ax.axvline(suggestion, color="C3", linestyle="--", linewidth=1, label=f"{option} {suggestion:.1e}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate", fontsize=9)
    ax.set_ylabel("training loss", fontsize=9)
    top = max(smooth[: max(1, len(smooth) // 5)]) * 1.3  # the ragged end above the start is of no interest
    ax.set_ylim(min(min(losses), min(smooth)) * 0.9, top)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    if hasattr(sys.stdout, "reconfigure"):  # a path an ASCII-only terminal cannot show prints as \xfc, not a traceback
        sys.stdout.reconfigure(errors="backslashreplace")
    parser = argparse.ArgumentParser(description=__doc__ and __doc__.splitlines()[0], allow_abbrev=False,
                                     usage="%(prog)s RECIPE [options] [recipe options]",
                                     epilog="Any other option is the recipe's own.")
    parser.add_argument("recipe", metavar="RECIPE", help="a recipe's name (mnist_onecycle) or a path to one")
    parser.add_argument("--ramp-steps", type=int, default=100, help="optimizer steps of the ramp [default: 100]")
    parser.add_argument("--from", dest="start", type=float, default=1e-7, help="the first rate [default: 1e-7]")
    parser.add_argument("--to", dest="end", type=float, default=10.0, help="the last rate [default: 10]")
    parser.add_argument("--plot", type=Path, default=Path("lr_find.png"), metavar="FILE.png",
                        help="where to draw loss against rate [default: lr_find.png]")
    args, options = parser.parse_known_args(argv)
    if not 20 <= args.ramp_steps <= 100_000:
        parser.error(f"argument --ramp-steps: from 20 to 100,000 steps, got {args.ramp_steps}")
    if not 0 < args.start < args.end <= 1e30 or args.end / args.start == math.inf:  # as the recipes' --lr: a rate
        # past float32 fails in the optimizer; 5e-324 to 1: no ramp between them
        parser.error(f"arguments --from and --to: need 0 < --from < --to <= 1e30, --to less than 1e300 times --from, "
                     f"got {args.start} and {args.end}")
    if args.plot.suffix.lower() != ".png":  # ".png" alone has no suffix: a name with no stem
        parser.error(f"argument --plot: give a file name that ends in .png, such as lr_find.png, not "
                     f"{str(args.plot)!r}")
    if taken := first_given(options, OWN_STEPS):
        parser.error(f"{taken}: the range test runs the recipe in a run directory of its own, for its own steps")
    if taken := first_given(options, ("--lr", "--max-lr")):  # the ramp sets it, step by step
        parser.error(f"{taken}: the range test sweeps the learning rate itself, from --from to --to")
    if taken := first_given(options, NOT_TRAINING):
        parser.error(f"{taken}: the range test measures a training run, and {taken} makes the recipe do something else")
    try:
        recipe = load_recipe(args.recipe)
    except FinderError as err:  # no such recipe, or a file that is not one
        parser.error(f"argument RECIPE: {err}")
    if taken := first_given(replayed(recipe, options), ("--patience", *NOT_TRAINING)):  # it passes the others itself
        parser.error(f"--config sets {taken}, which the range test cannot take: replay a copy of the file without it")
    optimizer = option_value(options, "--optimizer") or ("--optimizer" in replayed(recipe, options) and json.loads(
        Path(option_value(options, "--config")).read_text()).get("optimizer_name"))  # (given, or replayed)
    if optimizer == "lbfgs":  # its rate is only the line search's first trial step
        parser.error("--optimizer lbfgs: LBFGS finds its step length by line search, so the loss shows no slope over "
                     "a range of rates; the range test is for sgd, adam and adamw")
    if why := not_replaceable(args.plot):  # found before the range test, not after it
        print(f"error: cannot write --plot {args.plot}: {why}", file=sys.stderr)
        return 1
    try:
        if refused := refused_options(recipe, options):
            raise FinderError(f"the recipe refused its options: {refused}", exit_code=2)
        known = recipe_options(recipe)
        option = "--max-lr" if "--max-lr" in known else "--lr"
        if option not in known:  # the ramp sets its optimizer's rate; the suggestion is given as this option
            raise FinderError(f"{args.recipe} has no --lr or --max-lr option to suggest a rate for", exit_code=2)
        with tempfile.TemporaryDirectory(prefix="find_lr.") as work:
            rates, losses, ending = range_test(recipe, options, ramp(args.start, args.end, args.ramp_steps),
                                               Path(work))
        smooth = smoothed(losses)
        if losses and not math.isfinite(losses[0]):  # the first loss comes before any update: no rate made it so
            raise FinderError(f"the loss is not finite at the first step, before any update ({losses[0]}): check "
                              "the data and the model")
        kept = until_divergence(smooth)
        rates, losses, smooth = rates[:kept], losses[:kept], smooth[:kept]
        bottom = trend_bottom(losses) if losses else 0
        best = steepest(smooth, bottom)
        # its steepest stretch before the bottom is noise at rates too low to learn, unless the loss fell there
        if best is not None and not fell(losses, smooth[: bottom + 1]):
            best = None
        if best is None and len(smooth) < SETTLING + 3:
            at = rates[-1] if rates else args.start
            raise FinderError(f"the loss diverged after {len(losses)} steps, at {at:g}: too few to find its slope; "
                              "start lower (--from) or give more --ramp-steps")
        # bottomed out early, judged on the losses themselves: their average lags, and its settled value has the
        # fall in it already
        start, low = statistics.median(losses[:5]), statistics.median(losses[max(0, bottom - 2) : bottom + 3])
        if best is None and bottom <= SETTLING and start - low > MIN_FALL * abs(start):
            raise FinderError(f"the loss bottomed out at step {bottom + 1} of {len(losses)}, at {rates[bottom]:g}, "
                              f"too soon: its average takes {SETTLING} steps to settle, too few below that rate "
                              "to find its slope; start lower (--from) or give more --ramp-steps")
        if best is None:
            raise FinderError(f"the loss did not fall over {len(losses)} steps from {args.start:g} to "
                              f"{rates[-1] if rates else args.end:g}: try a wider range (--from, --to) or more "
                              "--ramp-steps")
        suggestion = float(f"{rates[best]:.1e}")
        try:
            plot(rates, losses, smooth, suggestion, option, args.plot)
            not_plotted = None
        except OSError as err:  # a full disk, say: the suggestion is printed all the same, then this
            from common.rundir import why_not_written

            not_plotted = f"cannot write --plot {args.plot}: {why_not_written(args.plot.parent, err)}"
    except FinderError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("error: interrupted; nothing written", file=sys.stderr)
        return 130
    except OSError as err:  # the temporary run directory, say
        print(f"error: {err.strerror or err}{f': {err.filename}' if err.filename else ''}", file=sys.stderr)
        return 1
    lowest = smooth.index(min(smooth[SETTLING:]), SETTLING)  # a suggestion needs more steps than SETTLING
    print(f"range test: {len(losses)} steps from {rates[0]:.1e} to {rates[-1]:.1e} ({ending}; smoothed loss "
          f"{smooth[SETTLING - 1]:.4f} after {SETTLING} steps -> lowest {smooth[lowest]:.4f} at {rates[lowest]:.1e}); "
          f"{'no plot' if not_plotted else f'plot in {args.plot}'}")
    print(f"suggested: {option} {suggestion:g} (steepest descent of the smoothed loss)")
    command = ["python", typed(Path(recipe.__file__)), *without(options, option), option, f"{suggestion:g}"]
    print(f"  {shlex.join(command)}")
    if not_plotted:
        print(f"error: {not_plotted}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, interrupt)
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before main's own handler: as the recipe is imported (torch with it), say
        print("error: interrupted; nothing written", file=sys.stderr)
        sys.exit(130)

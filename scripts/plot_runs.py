"""Plot runs side by side from their TensorBoard event files: one subplot per quantity, one line per run.

    python scripts/plot_runs.py runs/tiny_transformer/20250101-120000 runs/tiny_transformer/20250102-090000 \
        --out compare.png
    python scripts/plot_runs.py                       # every run under runs/, into curves.png
    python scripts/plot_runs.py runs/mnist_onecycle   # a folder of runs: each run in it

Quantities, each drawn when some run logged it: loss (train/loss solid, val/loss dashed, ema_val/loss dotted:
the averaged weights of a run with --ema), accuracy (val/acc, train/acc) or a regression's rmse (val/rmse), bits
per byte, character or token (val/bits_per_*), the learning rate (train/lr), and throughput (perf/samples_per_s or
perf/tokens_per_s). A point with no finite neighbour (a single evaluation) is drawn as a dot.
The PNG is small (a few tens of KB) so that it can go into an issue or a README.

A folder without event files, or whose event files hold no scalars, is skipped with one line (a run that never
trained); a folder that holds run directories stands for them. Exit status: 0 on success, 1 with one line
``error: ...`` when a path is missing or no run is left to plot, 2 on a usage error. An existing ``--out`` is
replaced only if it is a figure (a PNG that matplotlib wrote).
"""

import argparse
import fnmatch
import io
import json
import logging
import math
import os
import sys
import tempfile
from pathlib import Path

# (subplot title, y label, [(tag pattern, line style)]): "*" in a pattern stands for any characters
QUANTITIES = [
    ("loss", "loss", [("train/loss", "-"), ("val/loss", "--"), ("ema_val/loss", ":")]),  # ema_val: with --ema
    ("accuracy", "accuracy", [("train/acc", "-"), ("val/acc", "--"), ("ema_val/acc", ":")]),
    ("rmse", "rmse", [("train/rmse", "-"), ("val/rmse", "--"), ("ema_val/rmse", ":")]),  # a regression's
    ("bits", "bits per byte, char or token", [("train/bits_per_*", "-"), ("val/bits_per_*", "--"),
                                             ("ema_val/bits_per_*", ":")]),
    ("learning rate", "lr", [("train/lr", "-")]),
    # samples or tokens (the y label and legend say which): eager vs compiled, fp32 vs bf16
    ("throughput", "", [("perf/*_per_s", "-")]),
]


class PlotError(Exception):
    """A problem with the input: shown as one line, exit 1."""


def has_events(folder: Path) -> bool:
    return any(folder.glob("events.out.tfevents.*"))


def a_run_config(path: Path) -> bool:
    """Whether ``path`` is a run's config.json (one that cannot be read: no)."""
    try:
        return '"recipe":' in path.read_text(errors="replace")
    except OSError:
        return False


def run_folders(paths: list[Path]) -> list[Path]:
    """The run directories to plot: each path that holds event files, the runs inside a folder of runs (e.g.
    runs/ or runs/mnist_onecycle), and a one-line note for each folder skipped for holding none."""
    found = []
    for path in paths:
        if not path.is_dir():
            raise PlotError(f"{path} does not exist or is not a directory")
        try:
            inside = sorted(d for d in path.glob("**/") if d != path and has_events(d))
            if has_events(path) or not inside:
                found.append(path)
            else:  # a folder of runs: each one, and a note of each run in it that never trained (config.json only)
                found += inside + sorted(d.parent for d in path.glob("**/config.json") if not has_events(d.parent)
                                         and a_run_config(d))
        except OSError as err:  # a tree deeper than a path can name, say: said as a read, not as --out's write
            raise PlotError(f"cannot read {err.filename or path}: {err.strerror or err}") from None
    unique = {}  # a run named twice (or as runs/a and runs/../runs/a) is drawn once, as first named
    for run_dir in found:
        unique.setdefault(run_dir.resolve(), run_dir)
    found = list(unique.values())
    kept = [d for d in found if has_events(d)]
    for skipped in (d for d in found if d not in kept):
        print(f"skipped {skipped}: no TensorBoard event files (a run that never trained?)", file=sys.stderr)
    if not kept:
        raise PlotError(f"no run directory with TensorBoard event files in {', '.join(map(str, paths))}")
    return kept


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a run directory's event files, as {tag: [(step, value), ...]} sorted by step."""
    # imported here: a usage error should not wait for tensorboard's import
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # A resumed run's SummaryWriter(purge_step=...) drops the killed run's steps past its checkpoint, as it should:
    # tensorboard warns of "a TensorFlow restart" each time
    logging.getLogger("tensorboard").setLevel(logging.ERROR)
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0: keep every point
    try:
        accumulator.Reload()
    except Exception as err:  # noqa: BLE001 - a corrupt file of any kind is the same one-line error
        raise PlotError(f"cannot read the event files in {run_dir}: {err}") from None
    scalars = {}
    for tag in accumulator.Tags()["scalars"]:
        # a resumed run logs some steps twice: keep the last value of each step
        points = {e.step: e.value for e in accumulator.Scalars(tag)}
        scalars[tag] = sorted(points.items())
    return scalars


def steps_trained(run_dir: Path) -> int | None:
    """The steps a finished run trained, from its metrics.json; None: no such record."""
    try:
        steps = json.loads((run_dir / "metrics.json").read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if type(steps) is int else None


def matching(scalars: dict, pattern: str) -> list[str]:
    return sorted(tag for tag in scalars if fnmatch.fnmatchcase(tag, pattern))  # "*": any characters


def labels(run_dirs: list[Path]) -> list[str]:
    """Each run's folder name, with as many of its parents as tell it from the others (exp1/cv/fold-0)."""
    parts = [d.resolve().parts for d in run_dirs]
    depths = [1] * len(parts)
    while True:
        names = ["/".join(p[-depth:]) for p, depth in zip(parts, depths, strict=True)]
        shared = [i for i, name in enumerate(names) if names.count(name) > 1 and depths[i] < len(parts[i])]
        if not shared:
            return names
        for i in shared:
            depths[i] += 1


def isolated(values: tuple[float, ...]) -> list[int]:
    """Where a finite value has no finite neighbour (a run's only evaluation, one between non-finite ones): a line
    through it is nothing to see, so it gets a marker."""
    finite = [math.isfinite(v) for v in values]
    return [i for i, ok in enumerate(finite)
            if ok and not (i > 0 and finite[i - 1]) and not (i + 1 < len(finite) and finite[i + 1])]


def plot(run_dirs: list[Path], out: Path) -> tuple[list[str], int]:
    """Draw the figure; returns the titles of the subplots drawn and the number of runs in them."""
    runs = []
    for label, run_dir in zip(labels(run_dirs), run_dirs, strict=True):
        if scalars := read_scalars(run_dir):
            runs.append((label, scalars))
            last, trained = max(points[-1][0] for points in scalars.values()), steps_trained(run_dir)
            if trained is not None and last < trained:  # TensorBoard stops at a damaged record, and says nothing
                print(f"warning: {run_dir}: its event files end at step {last}, but it trained {trained} steps "
                      "(metrics.json): a damaged event file? drawn as far as it goes", file=sys.stderr)
        else:  # a file of another kind named like one, or a run killed before its first log line
            print(f"skipped {run_dir}: its event files hold no scalars", file=sys.stderr)
    present = [q for q in QUANTITIES if any(matching(s, tag) for _, s in runs for tag, _ in q[2])]
    if not present:
        raise PlotError("none of the runs logged train/loss, val/loss, an accuracy or rmse, bits per byte, char or "
                        "token, or train/lr")

    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in tests
    import matplotlib.pyplot as plt

    many = len(runs) > 4  # a legend in every subplot would cover the curves: one beside them instead
    legend_width = 1.5 * (1 + (len(runs) + 2) // 16) if many else 0  # inches: a column per 16 entries
    fig, axes = plt.subplots(1, len(present), figsize=(3.6 * len(present) + legend_width, 3.0), dpi=80,
                             squeeze=False, layout="constrained" if many else None)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # ten; more runs: as many spread over a colour map
    colours = colours if len(runs) <= len(colours) else [plt.get_cmap("turbo")(i / (len(runs) - 1))
                                                         for i in range(len(runs))]
    styles = {}  # the line styles drawn, and the split each stands for (train solid, val dashed, ema_val dotted)
    for ax, (title, ylabel, tags) in zip(axes[0], present, strict=True):
        units = set()  # throughput: samples/s, tokens/s, named apart in the legend and the y label
        for i, (label, scalars) in enumerate(runs):
            for pattern, style in tags:
                for tag in matching(scalars, pattern):
                    steps, values = zip(*scalars[tag], strict=True)
                    split, name = tag.split("/", 1)
                    split = name.replace("_per_s", "/s") if split == "perf" else split
                    units |= {split} if name.endswith("_per_s") else set()
                    ax.plot(steps, values, style, color=colours[i % len(colours)], linewidth=1.2, marker="o",
                            markersize=4, markevery=isolated(values), label=f"{label} {split}")
                    styles.setdefault(style, split)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.set_ylabel(ylabel or " or ".join(sorted(units)), fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if not many:
            ax.legend(fontsize=7)
    if many:  # one entry per run by colour, and one per style: train solid, val dashed, ema_val dotted
        from matplotlib.lines import Line2D

        entries = [Line2D([], [], color=colours[i]) for i in range(len(runs))]
        entries += [Line2D([], [], color="grey", linestyle=style) for style in styles]
        fig.legend(entries, [label for label, _ in runs] + list(styles.values()), loc="outside right upper", fontsize=7,
                   ncols=1 + len(entries) // 16)
    else:
        fig.tight_layout()
    save_png(fig, out)
    plt.close(fig)
    return [title for title, _, _ in present], len(runs)


def not_replaceable(out: Path) -> str | None:
    """Why ``out`` must not be replaced by a figure (a folder, or a file that is no earlier one: not a PNG that
    matplotlib wrote), or cannot be written at all; or None."""
    if out.is_dir():
        return "it is a folder"
    try:
        with open(out, "rb") as f:
            head = f.read(256)  # matplotlib's tEXt Software chunk comes before the pixels
    except (FileNotFoundError, NotADirectoryError):  # nothing there to keep
        return cannot_write_in(out.parent)
    except OSError as err:
        return f"it cannot be read to check that it is an earlier figure ({err.strerror or err})"
    if head.startswith(b"\x89PNG\r\n\x1a\n") and b"tEXtSoftware\x00Matplotlib" in head:
        return cannot_write_in(out.parent)
    return "it exists and is no figure of ours (a PNG that matplotlib wrote): choose another name"


def cannot_write_in(folder: Path) -> str | None:
    """Why no file can be made in ``folder`` (or in the nearest of its parents that exists, where the others would
    be made), or None. Tried with a file removed at once: permissions alone miss a read-only or immutable folder,
    and everything is permitted to root."""
    existing = next((p for p in [folder, *folder.parents] if p.exists()), folder)  # ".": a relative one's last
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            return None
    except OSError as err:
        return f"no file can be made in {existing} ({err.strerror or err})"


def save_png(fig, out: Path) -> None:
    """``fig`` as a PNG at ``out``, written whole or not at all (an earlier file survives a full disk)."""
    png = io.BytesIO()
    fig.savefig(png, format="png")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, png.getvalue())


def write_atomically(path: Path, data: bytes) -> None:
    # a name of its own, made new ("x"): a file of the user's called .curves.png.tmp is neither written nor removed
    tmp = path.with_name(f".{path.name[:40]}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
    try:
        with open(tmp, "xb") as file:
            file.write(data)
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    finally:
        tmp.unlink(missing_ok=True)


def given_path(value: str) -> Path:
    """A path argument; an empty one (an unset shell variable, say) is refused rather than read as '.'."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty; give a path")
    return Path(value)


def main(argv: list[str] | None = None) -> int:
    if hasattr(sys.stdout, "reconfigure"):  # a path an ASCII-only terminal cannot show prints as \xfc, not a traceback
        sys.stdout.reconfigure(errors="backslashreplace")
    parser = argparse.ArgumentParser(description=__doc__ and __doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="*", type=given_path, metavar="RUN_DIR",
                        help="run directories to compare, or folders of them [default: runs]")
    parser.add_argument("--out", type=Path, default=Path("curves.png"), metavar="FILE.png",
                        help="the PNG to write [default: curves.png]")
    args = parser.parse_args(argv)
    if args.out.suffix.lower() != ".png":  # ".png" alone has no suffix: a name with no stem
        parser.error(f"argument --out: give a file name that ends in .png, such as curves.png, not {str(args.out)!r}")
    if why := not_replaceable(args.out):  # an earlier figure is replaced; anything else is kept
        print(f"error: cannot write {args.out}: {why}", file=sys.stderr)
        return 1
    try:
        run_dirs = run_folders(args.run_dirs or [Path("runs")])
        drawn, plotted = plot(run_dirs, args.out)
    except PlotError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"error: interrupted; {args.out} not written", file=sys.stderr)
        return 130
    except OSError as err:  # e.g. --out in a folder we may not write
        in_the_way = next((p for p in args.out.parents if p.exists() and not p.is_dir()), None)  # not "File exists"
        why = f"{in_the_way} is a file, not a folder" if in_the_way else err.strerror or err
        print(f"error: cannot write {args.out}: {why}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {', '.join(drawn)} for {plotted} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

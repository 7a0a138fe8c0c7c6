"""scripts/plot_runs.py: a small valid PNG from real event files; bad input is one error line."""

import sys

import pytest
import torch
from conftest import ROOT, run_subprocess
from torch.utils.tensorboard import SummaryWriter
from torchvision.io import write_png

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(run_dir, lr=0.1, with_val=True, bits=False):
    writer = SummaryWriter(str(run_dir))
    for step in range(1, 21):
        writer.add_scalar("train/loss", 2.0 / step, step)
        writer.add_scalar("train/lr", lr * (1 - step / 25), step)
        if with_val and step % 5 == 0:
            writer.add_scalar("val/loss", 2.2 / step, step)
            writer.add_scalar("val/bits_per_byte" if bits else "val/acc", 0.5 + step / 50, step)
    writer.close()
    return run_dir


def plot(*args):
    return run_subprocess([sys.executable, "scripts/plot_runs.py", *map(str, args)], timeout=120)


def test_two_runs_make_a_small_valid_png(tmp_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", lr=0.05, bits=True)
    out = tmp_path / "plots" / "compare.png"
    result = plot(a, b, "--out", out)
    assert result.code == 0, result.stderr
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    assert 1000 < len(data) < 150_000
    assert result.stdout.strip() == f"wrote {out}: loss, accuracy, bits, learning rate for 2 run(s)"
    panels = {axes.get_title(): axes for axes in drawn_figure([a, b], tmp_path / "again.png").axes}
    assert [line.get_label() for line in panels["accuracy"].get_lines()] == ["a val"]  # the curves, not the titles
    (bits,) = panels["bits"].get_lines()
    assert bits.get_label() == "b val" and list(bits.get_xdata()) == [5, 10, 15, 20]
    assert list(bits.get_ydata()) == pytest.approx([0.5 + step / 50 for step in (5, 10, 15, 20)])


def test_a_file_named_as_the_old_temporary_file_is_kept(tmp_path):
    """The PNG was written to .OUT.tmp, then renamed: a user's file of that name was replaced, then removed."""
    notes = tmp_path / ".keep.png.tmp"
    notes.write_text("my notes")
    result = plot(make_run(tmp_path / "a"), "--out", tmp_path / "keep.png")
    assert result.code == 0, result.stderr
    assert (tmp_path / "keep.png").read_bytes()[:8] == PNG_MAGIC
    assert notes.read_text() == "my notes" and sorted(tmp_path.glob(".*")) == [notes]  # nor a temporary file left


def drawn_figure(run_dirs, out):
    """plot_runs.plot's figure, kept open to look at."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import plot_runs

    figures = []
    real_close = plt.close
    plt.close = lambda fig: figures.append(fig)  # keep the figure to look at
    try:
        plot_runs.plot(run_dirs, out)
    finally:
        plt.close = real_close
    return figures[0]


def test_throughput_in_samples_and_in_tokens_is_told_apart(tmp_path):
    """A classifier logs samples/s and the transformer tokens/s: drawn on one axis, each curve says its unit."""
    runs = []
    for name, unit in [("mlp", "samples"), ("lm", "tokens")]:
        writer = SummaryWriter(str(tmp_path / name))
        for step in range(1, 4):
            writer.add_scalar("train/loss", 1.0 / step, step)
            writer.add_scalar(f"perf/{unit}_per_s", 100.0 * step, step)
        writer.close()
        runs.append(tmp_path / name)
    panels = {axes.get_title(): axes for axes in drawn_figure(runs, tmp_path / "mixed.png").axes}
    assert [line.get_label() for line in panels["throughput"].get_lines()] == ["mlp samples/s", "lm tokens/s"]
    assert panels["throughput"].get_ylabel() == "samples/s or tokens/s"
    assert [line.get_label() for line in panels["loss"].get_lines()] == ["mlp train", "lm train"]


def test_many_runs_get_one_legend_beside_the_plots_and_a_colour_each(tmp_path):
    runs = [make_run(tmp_path / f"run{i:02d}", lr=0.1 / (i + 1)) for i in range(13)]
    out = tmp_path / "many.png"
    result = plot(*runs, "--out", out)
    assert result.code == 0 and result.stderr == "", result.stderr  # no layout warning
    width = int.from_bytes(out.read_bytes()[16:20], "big")
    assert width > 3 * 3.6 * 80  # loss, accuracy, lr at 3.6 inches and 80 dpi, and the legend beside them
    figure = drawn_figure(runs, tmp_path / "again.png")
    (legend,) = figure.legends
    labels = [text.get_text() for text in legend.get_texts()]
    assert labels == [f"run{i:02d}" for i in range(13)] + ["train", "val"]
    colours = {tuple(line.get_color()) for line in legend.get_lines()[:13]}
    assert len(colours) == 13 and not any(ax.get_legend() for ax in figure.axes)


def test_an_ema_run_draws_its_averaged_weights_dotted_and_a_lone_point_as_a_dot(tmp_path):
    """ema_val/* (a run with --ema) was never drawn; a value between non-finite ones was an invisible line."""
    writer = SummaryWriter(str(tmp_path / "ema"))
    for step, loss in zip(range(5, 35, 5), [1.0, float("nan"), 0.5, float("nan"), 0.3, 0.2], strict=True):
        writer.add_scalar("train/loss", 2.0 / step, step)
        writer.add_scalar("val/loss", loss, step)
        writer.add_scalar("ema_val/loss", 0.9 / step, step)
        writer.add_scalar("ema_val/acc", 0.5 + step / 100, step)
    writer.close()
    figure = drawn_figure([tmp_path / "ema"], tmp_path / "ema.png")
    loss, accuracy = figure.axes
    lines = {line.get_label(): line for line in loss.get_lines()}
    assert list(lines) == ["ema train", "ema val", "ema ema_val"]
    assert [lines[name].get_linestyle() for name in lines] == ["-", "--", ":"]
    assert lines["ema val"].get_markevery() == [0, 2]  # 1.0 and 0.5 stand alone; 0.3 and 0.2 make a line
    assert lines["ema train"].get_markevery() == []
    assert [line.get_label() for line in accuracy.get_lines()] == ["ema ema_val"]
    many = drawn_figure([make_run(tmp_path / f"run{i}") for i in range(5)] + [tmp_path / "ema"], tmp_path / "m.png")
    (legend,) = many.legends
    assert [text.get_text() for text in legend.get_texts()][-3:] == ["train", "val", "ema_val"]


def test_runs_named_alike_are_told_apart_and_a_run_named_twice_is_drawn_once(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import plot_runs

    folds = [make_run(tmp_path / experiment / "cv" / "fold-0") for experiment in ("exp1", "exp2")]
    other = make_run(tmp_path / "exp1" / "cv" / "fold-1")
    runs = plot_runs.run_folders([*folds, other, folds[0], tmp_path / "exp1" / "cv" / ".." / "cv" / "fold-0"])
    assert runs == [*folds, other]  # was the first fold three times
    assert plot_runs.labels(runs) == ["exp1/cv/fold-0", "exp2/cv/fold-0", "fold-1"]  # were both cv/fold-0


def test_a_resumed_run_plots_one_curve_without_tensorboards_restart_warning(tmp_path):
    for first, last in [(1, 10), (6, 12)]:  # killed after step 10, resumed from its checkpoint at step 5
        writer = SummaryWriter(str(tmp_path / "run"), purge_step=first if first > 1 else None)
        for step in range(first, last + 1):
            writer.add_scalar("train/loss", 1.0 / step + (first > 1), step)
        writer.close()
    result = plot(tmp_path / "run", "--out", tmp_path / "x.png")
    assert result.code == 0 and result.stderr == "", result.stderr  # was "Detected out of order event.step ..."
    sys.path.insert(0, str(ROOT / "scripts"))
    import plot_runs

    (points,) = plot_runs.read_scalars(tmp_path / "run").values()
    assert [step for step, _ in points] == list(range(1, 13))
    assert [round(loss, 4) for _, loss in points[4:6]] == [0.2, round(1 / 6 + 1, 4)]


def test_only_the_quantities_logged_are_drawn(tmp_path):
    out = tmp_path / "train_only.png"
    result = plot(make_run(tmp_path / "a", with_val=False), "--out", out)
    assert result.code == 0, result.stderr
    assert result.stdout.strip() == f"wrote {out}: loss, learning rate for 1 run(s)"
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_bad_input_is_one_error_line(tmp_path):
    good = make_run(tmp_path / "good")
    out = tmp_path / "x.png"
    result = plot(good, tmp_path / "absent", "--out", out)
    assert result.code == 1
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'absent'} does not exist or is not a directory"]
    assert not out.exists()
    result = plot(good, "--out", "/proc/curves.png")  # found before the event files are read and drawn
    assert result.code == 1 and result.stderr.startswith("error: cannot write /proc/curves.png: no file can be made "
                                                         "in /proc ("), result.stderr
    (tmp_path / "afile").write_text("")
    result = plot(good, "--out", tmp_path / "afile" / "x.png")  # a file where the folder should be
    assert result.code == 1 and result.stderr == f"error: cannot write {tmp_path / 'afile' / 'x.png'}: " \
                                                 f"{tmp_path / 'afile'} is a file, not a folder\n"


def test_a_failed_write_leaves_the_earlier_png_as_it_was(tmp_path):
    """The disk fills (here: a file-size limit) while the figure is written: one error line, the earlier PNG whole,
    no temporary file left."""
    good, out = make_run(tmp_path / "good"), tmp_path / "curves.png"
    assert plot(good, "--out", out).code == 0
    before = out.read_bytes()
    result = run_subprocess([sys.executable, "scripts/plot_runs.py", good, "--out", out], timeout=120,
                            max_file_bytes=len(before) // 2)
    assert result.code == 1 and result.stderr == f"error: cannot write {out}: File too large\n", result.stderr
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "good"]


def test_a_folder_without_events_is_skipped_with_one_line(tmp_path):
    """A run that failed before it trained leaves a folder without event files: it is skipped, not an error."""
    good, empty = make_run(tmp_path / "good"), tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.json").write_text("{}")
    out = tmp_path / "x.png"
    result = plot(good, empty, "--out", out)
    assert result.code == 0, result.stderr
    assert result.stderr.strip().splitlines() == [f"skipped {empty}: no TensorBoard event files (a run that never "
                                                   "trained?)"]
    assert result.stdout.strip() == f"wrote {out}: loss, accuracy, learning rate for 1 run(s)"
    alone = plot(empty, "--out", out)
    assert alone.code == 1 and alone.stderr.strip().splitlines()[-1] == (
        f"error: no run directory with TensorBoard event files in {empty}")
    # inside a folder of runs, a run that never trained (its config.json, no events) is named too
    runs = tmp_path / "runs"
    make_run(runs / "trained")
    (runs / "failed").mkdir()
    (runs / "failed" / "config.json").write_text('{"recipe": "mnist_onecycle"}')
    result = plot(runs, "--out", out)
    assert result.code == 0 and result.stdout.strip().endswith("for 1 run(s)"), result.stderr
    assert result.stderr.strip().splitlines() == [f"skipped {runs / 'failed'}: no TensorBoard event files (a run "
                                                   "that never trained?)"]


def test_a_run_whose_event_files_hold_no_scalars_is_skipped_with_one_line(tmp_path):
    good, garbage = make_run(tmp_path / "good"), tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "events.out.tfevents.1.host").write_bytes(bytes(range(256)) * 2)
    out = tmp_path / "x.png"
    result = plot(good, garbage, "--out", out)
    assert result.code == 0 and result.stdout.strip() == f"wrote {out}: loss, accuracy, learning rate for 1 run(s)"
    assert result.stderr.strip().splitlines() == [f"skipped {garbage}: its event files hold no scalars"]
    alone = plot(garbage, "--out", out)
    assert alone.code == 1 and alone.stderr.strip().splitlines()[-1].startswith("error: none of the runs logged")


def test_an_existing_file_is_replaced_only_if_it_is_an_earlier_figure(tmp_path):
    good, out = make_run(tmp_path / "good"), tmp_path / "curves.png"
    assert plot(make_run(tmp_path / "other", lr=0.5), "--out", out).code == 0
    earlier = out.read_bytes()
    assert plot(good, "--out", out).code == 0  # an earlier figure: replaced, by one of the other run
    assert out.read_bytes() != earlier and list(tmp_path.glob(".curves.png*")) == []
    assert plot(good, "--out", tmp_path / "fresh.png").code == 0
    assert out.read_bytes() == (tmp_path / "fresh.png").read_bytes()
    write_png(torch.zeros(1, 4, 4, dtype=torch.uint8), str(tmp_path / "photo.png"))  # a PNG matplotlib did not write
    (tmp_path / "notes.png").write_text("my notes")
    for name in ("photo.png", "notes.png"):
        before = (tmp_path / name).read_bytes()
        result = plot(good, "--out", tmp_path / name)
        assert (result.code, result.stderr) == (1, f"error: cannot write {tmp_path / name}: it exists and is no "
                                                   "figure of ours (a PNG that matplotlib wrote): choose another "
                                                   "name\n")
        assert (tmp_path / name).read_bytes() == before
    (tmp_path / "folder.png").mkdir()
    result = plot(good, "--out", tmp_path / "folder.png")
    assert (result.code, result.stderr) == (1, f"error: cannot write {tmp_path / 'folder.png'}: it is a folder\n")


def test_a_config_json_that_is_a_folder_is_no_run(tmp_path):
    """A folder of runs is searched for runs that never trained by their config.json: one that cannot be read is
    no run, not a failure to write the figure (as it was reported)."""
    runs, out = tmp_path / "runs", tmp_path / "x.png"
    make_run(runs / "trained")
    (runs / "odd" / "config.json").mkdir(parents=True)
    result = plot(runs, "--out", out)
    assert (result.code, result.stderr) == (0, "")
    assert result.stdout.strip() == f"wrote {out}: loss, accuracy, learning rate for 1 run(s)"


def test_a_regression_run_draws_its_rmse(tmp_path):
    writer = SummaryWriter(str(tmp_path / "reg"))
    for step in range(1, 11):
        writer.add_scalar("train/loss", 1.0 / step, step)
        writer.add_scalar("val/rmse", 2.0 / step, step)
    writer.close()
    result = plot(tmp_path / "reg", "--out", tmp_path / "reg.png")
    assert result.code == 0 and result.stdout.strip() == f"wrote {tmp_path / 'reg.png'}: loss, rmse for 1 run(s)"
    _, rmse = drawn_figure([tmp_path / "reg"], tmp_path / "again.png").axes  # the panel holds the curve, not a title
    (line,) = rmse.get_lines()
    assert line.get_label() == "reg val" and line.get_linestyle() == "--"
    assert list(line.get_xdata()) == list(range(1, 11))
    assert list(line.get_ydata()) == pytest.approx([2.0 / step for step in range(1, 11)])


def test_without_arguments_every_run_under_runs_goes_into_curves_png(tmp_path):
    for name in ("20260101-000000", "20260102-000000"):
        make_run(tmp_path / "runs" / "mnist_onecycle" / name)
    (tmp_path / "runs" / "mnist_onecycle" / "20260103-000000").mkdir()  # never trained
    result = run_subprocess([sys.executable, ROOT / "scripts" / "plot_runs.py"], cwd=tmp_path, timeout=120)
    assert result.code == 0, result.stderr
    assert result.stdout.strip() == "wrote curves.png: loss, accuracy, learning rate for 2 run(s)"
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG_MAGIC
    folder = plot(tmp_path / "runs" / "mnist_onecycle", "--out", tmp_path / "one.png")  # a folder of runs
    assert folder.code == 0 and "for 2 run(s)" in folder.stdout


def test_a_run_with_nothing_to_plot_is_an_error(tmp_path):
    writer = SummaryWriter(str(tmp_path / "other"))
    writer.add_scalar("perf/mfu", 0.1, 1)  # a scalar none of the subplots draws
    writer.close()
    result = plot(tmp_path / "other", "--out", tmp_path / "x.png")
    assert result.code == 1 and result.stderr.strip().startswith("error: none of the runs logged train/loss")


def test_usage_errors_exit_2_naming_the_option(tmp_path):
    run = make_run(tmp_path / "a")
    not_png = plot(run, "--out", tmp_path / "x.jpg")
    assert not_png.code == 2 and "argument --out: " in not_png.stderr and ".png" in not_png.stderr
    no_name = plot(run, "--out", ".png")  # it said ".png must end in .png"
    assert no_name.code == 2 and "give a file name that ends in .png, such as curves.png, not '.png'" in no_name.stderr
    unknown = plot(run, "--colour", "red")
    assert unknown.code == 2 and "--colour" in unknown.stderr
    empty = plot(run, "")  # an unset shell variable: it plotted every run under the current folder
    assert empty.code == 2 and "argument RUN_DIR: is empty; give a path" in empty.stderr


def test_ctrl_c_is_exit_130_in_one_line(tmp_path, capsys, monkeypatch):
    from scripts import plot_runs

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(plot_runs, "plot", interrupted)
    assert plot_runs.main([str(make_run(tmp_path / "a")), "--out", str(tmp_path / "x.png")]) == 130
    assert capsys.readouterr().err == f"error: interrupted; {tmp_path / 'x.png'} not written\n"


def test_a_folder_that_cannot_be_read_is_said_as_a_read_not_as_the_figures_write(tmp_path, capsys, monkeypatch):
    """A tree deeper than a path can name was "cannot write curves.png: File name too long"."""
    import errno
    from pathlib import Path

    from scripts import plot_runs

    deep = tmp_path / "runs" / "deep"

    def too_deep(self, pattern):
        raise OSError(errno.ENAMETOOLONG, "File name too long", str(deep))

    make_run(tmp_path / "runs" / "a")
    monkeypatch.setattr(Path, "glob", too_deep)
    assert plot_runs.main([str(tmp_path / "runs"), "--out", str(tmp_path / "x.png")]) == 1
    assert capsys.readouterr().err == f"error: cannot read {deep}: File name too long\n"
    assert not (tmp_path / "x.png").exists()


def test_an_event_file_damaged_midway_is_said_not_drawn_short_in_silence(tmp_path):
    """TensorBoard stops reading at a damaged record and says nothing: a run of 20 steps was drawn to step 9, and
    its accuracy panel was gone, with exit 0 and no word."""
    run = make_run(tmp_path / "run")
    (run / "metrics.json").write_text('{"recipe": "mixed_precision", "steps": 20}')
    out = tmp_path / "x.png"
    whole = plot(run, "--out", out)
    assert whole.code == 0 and whole.stderr == "", whole.stderr
    events = next(run.glob("events.out.tfevents.*"))
    data = bytearray(events.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = b"\xff" * 8
    events.write_bytes(bytes(data))
    damaged = plot(run, "--out", out)
    assert damaged.code == 0, damaged.stderr
    warning = damaged.stderr.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"warning: {run}: its event files end at step ")
    assert warning[0].endswith(", but it trained 20 steps (metrics.json): a damaged event file? drawn as far as it "
                               "goes")
    assert int(warning[0].split("end at step ")[1].split(",")[0]) < 20

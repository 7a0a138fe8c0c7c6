"""recipes/mnist_onecycle.py on a tiny MNIST written in the real IDX format."""

import json
import math
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_same_weights, load_recipe, load_weights, read_hparams, read_metrics, read_scalars
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.data import MNIST_FILES, MNIST_MEAN, MNIST_STD

RECIPE = "mnist_onecycle"
TRAIN_DIGITS = 512 - 512 // 12  # the fixture's 512 training digits less the validation split


def test_smoke_writes_the_run_directory_of_the_conventions(run_inprocess, mnist_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--epochs", 1, "--max-steps", 6, "--batch-size", 32,
                           "--data-dir", mnist_dir, "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    assert result.done_line.startswith("done: ") and f"run_dir={run_dir}" in result.done_line

    config = json.loads((run_dir / "config.json").read_text())
    assert config["batch_size"] == 32 and config["max_steps"] == 6 and config["data_dir"] == str(mnist_dir)
    metrics = read_metrics(run_dir)
    assert {"recipe", "steps", "train_loss", "val_loss", "val_acc", "samples_per_s", "wall_s"} <= metrics.keys()
    assert metrics["recipe"] == RECIPE and metrics["steps"] == 6
    assert math.isfinite(metrics["train_loss"]) and 0 <= metrics["val_acc"] <= 1
    # best.pt is chosen on digits held out of the training set; the test set is scored once, at the end
    assert f"{TRAIN_DIGITS} train / {512 - TRAIN_DIGITS} validation / 200 test digits" in result.stdout
    assert 0 <= metrics["test_acc"] <= 1 and math.isfinite(metrics["test_loss"])
    assert metrics["test_acc"] != metrics["val_acc"] or metrics["test_loss"] != metrics["val_loss"]

    scalars = read_scalars(run_dir)
    assert {"train/loss", "train/lr", "val/loss", "val/acc", "perf/samples_per_s"} <= scalars.keys()
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(v) for _, v in scalars["train/loss"])
    assert scalars["val/acc"][-1] == (6, pytest.approx(metrics["val_acc"]))
    assert scalars["test/acc"] == [(6, pytest.approx(metrics["test_acc"]))]
    # the hyper-parameters, with their own types, in the HParams tab alone (no single-point hparam/* charts),
    # beside the figures already logged; one event file for the launch
    hparams, tags = read_hparams(run_dir)
    from common.runtime import resolve_precision

    assert hparams["batch_size"] == 32 and hparams["augment"] is True
    assert hparams["precision"] == "auto"  # the option as given, beside what it chose
    assert hparams["precision_used"] == resolve_precision("auto", torch.device("cpu")).precision_used
    assert {"val/loss", "val/acc", "test/acc"} <= set(tags) and not [t for t in scalars if t.startswith("hparam")]
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(run_dir), size_guidance={"images": 0})
    events.Reload()
    assert [image.step for image in events.Images("val/misclassified")] == [6]  # the digits it got wrong

    for name in ("last.pt", "best.pt"):
        state = torch.load(run_dir / "checkpoints" / name, weights_only=True)
        assert state["recipe"] == RECIPE and state["step"] == 6
        assert {"model", "optimizer", "scheduler", "scaler", "epoch", "rng", "config"} <= state.keys()
        assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])


def test_learns_the_digits(run_inprocess, mnist_dir, tmp_path):
    # --no-augment: the fake digits' classes differ only in where their square is (5 pixels apart), which
    # the augmentation's shifts of up to 3 pixels blur; real digits keep their identity when shifted
    result = run_inprocess(RECIPE, "--epochs", 2, "--batch-size", 32, "--no-augment", "--data-dir", mnist_dir,
                           "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    metrics = read_metrics(tmp_path / "run")
    assert metrics["steps"] == 2 * (TRAIN_DIGITS // 32)
    assert metrics["val_acc"] > 0.9


def test_one_cycle_rises_to_max_lr_then_anneals_to_zero(run_inprocess, mnist_dir, tmp_path):
    result = run_inprocess(RECIPE, "--epochs", 2, "--batch-size", 32, "--max-lr", 0.2,
                           "--data-dir", mnist_dir, "--run-dir", tmp_path / "run")
    assert result.code == 0, result.stderr
    lrs = [lr for _, lr in read_scalars(tmp_path / "run")["train/lr"]]
    assert len(lrs) == 28
    peak = max(range(len(lrs)), key=lrs.__getitem__)
    assert abs(peak - 0.3 * 27) <= 1  # OneCycleLR's default pct_start is 0.3
    assert lrs[peak] == pytest.approx(0.2, rel=5e-3)  # the peak falls between two steps
    assert lrs[0] == pytest.approx(0.2 / 25, rel=1e-3)  # starts at max_lr / div_factor
    assert lrs[-1] < 0.2 * 1e-3  # anneals to almost zero
    assert all(a <= b for a, b in zip(lrs[:peak], lrs[1 : peak + 1], strict=True))  # rises steadily


@pytest.mark.parametrize("momentum", [0.95, 0.0])
def test_momentum_cycles_from_the_option_down_to_085_or_stays_off(run_inprocess, mnist_dir, tmp_path, momentum):
    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--epochs", 1, "--batch-size", 32, "--momentum", momentum,
                           "--data-dir", mnist_dir, "--checkpoint-every", 1, "--max-steps", 5, "--run-dir", run_dir)
    assert result.code == 0, result.stderr  # SGD refuses nesterov=True without momentum
    groups = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["optimizer"]["param_groups"]
    assert all(g["nesterov"] == (momentum > 0) for g in groups)
    if momentum == 0:
        assert [g["momentum"] for g in groups] == [0.0, 0.0]
    else:  # 14 steps, peak rate near step 4: by step 5 momentum has dipped from 0.95 to about 0.85
        assert all(0.85 <= g["momentum"] < 0.86 for g in groups)


def test_best_checkpoint_is_the_best_epoch_and_survives_a_resume(run_inprocess, mnist_dir, tmp_path, monkeypatch):
    # what the evaluations "measure": epoch 2 is the best; the test set is scored after each launch
    scores = iter([0.6, 0.9, 0.5, 0.7, 0.5])
    monkeypatch.setattr(load_recipe(RECIPE), "evaluate", lambda *args, **kwargs: {"loss": 1.0, "acc": next(scores)})
    run_dir = tmp_path / "run"
    common = ["--epochs", 3, "--batch-size", 32, "--data-dir", mnist_dir, "--run-dir", run_dir, "--resume", "auto"]
    assert run_inprocess(RECIPE, *common, "--max-steps", 28).code == 0  # two epochs of 14 steps, then stop
    assert run_inprocess(RECIPE, *common).code == 0  # the third epoch, resumed
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (best["step"], best["best"]) == (28, {"score": 0.9, "step": 28})
    assert (last["step"], last["best"]) == (42, {"score": 0.9, "step": 28})  # remembered across the resume
    metrics = read_metrics(run_dir)
    assert (metrics["best_val_acc"], metrics["best_step"], metrics["val_acc"]) == (0.9, 28, 0.7)
    assert metrics["test_acc"] == 0.5  # scored with best.pt's weights, once, at the end


def test_stopped_and_resumed_run_ends_with_the_same_weights(run_inprocess, mnist_dir, tmp_path):
    common = ["--epochs", 2, "--batch-size", 32, "--data-dir", mnist_dir]
    assert run_inprocess(RECIPE, *common, "--run-dir", tmp_path / "full").code == 0
    stopped = run_inprocess(RECIPE, *common, "--max-steps", 11, "--run-dir", tmp_path / "cut")
    assert stopped.code == 0 and read_metrics(tmp_path / "cut")["steps"] == 11
    resumed = run_inprocess(RECIPE, *common, "--resume", "auto", "--run-dir", tmp_path / "cut")
    assert resumed.code == 0, resumed.stderr
    assert "resumed at step 11" in resumed.stdout
    assert read_metrics(tmp_path / "cut")["steps"] == 28
    # the training loss reported is the last epoch's mean, though the cut evaluated in the middle of the first
    assert read_metrics(tmp_path / "cut")["train_loss"] == read_metrics(tmp_path / "full")["train_loss"]
    # TensorBoard shows one curve: every step once, none lost at the checkpoint's step
    scalars = read_scalars(tmp_path / "cut")
    assert [step for step, _ in scalars["train/loss"]] == list(range(1, 29))
    assert [step for step, _ in scalars["val/acc"]] == [11, 14, 28]
    assert_same_weights(load_weights(tmp_path / "full" / "checkpoints" / "last.pt"),
                        load_weights(tmp_path / "cut" / "checkpoints" / "last.pt"))


def test_offline_without_data_names_the_files_and_folder(run_inprocess, tmp_path, monkeypatch):
    tried = []

    def offline(url, *args, **kwargs):
        tried.append(url)
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    result = run_inprocess(RECIPE, "--data-dir", tmp_path / "data", "--run-dir", tmp_path / "run")
    assert result.code == 1
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert "train-images-idx3-ubyte" in result.stderr and "t10k-labels-idx1-ubyte" in result.stderr
    assert "(no network); offline?" in result.stderr  # the reason, not a guess alone
    assert [url.rsplit("/", 2)[-2:] for url in tried[:2]] == [["mnist", "train-images-idx3-ubyte.gz"],  # each mirror
                                                              ["mnist", "train-images-idx3-ubyte.gz"]]
    assert tried[0] != tried[1] and len(tried) == 2
    assert str(tmp_path / "data" / "MNIST" / "raw") in result.stderr
    assert not (tmp_path / "data").exists()  # the folders made for the download are gone with it
    monkeypatch.chdir(tmp_path)  # a relative --data-dir is named in full
    result = run_inprocess(RECIPE, "--data-dir", "rel", "--run-dir", tmp_path / "run")
    assert result.code == 1 and str(tmp_path / "rel" / "MNIST" / "raw") in result.stderr
    assert not (tmp_path / "rel").exists()


def test_mnist_files_given_gzipped_by_the_user_are_read_offline(run_inprocess, mnist_dir, tmp_path, monkeypatch):
    """torchvision takes a .gz only if it is the official archive byte for byte: these (gzipped here, the test set
    alone, or all four) were "unreadable (Error downloading ...); delete them to download again"."""
    import gzip
    import shutil

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    given = mnist_dir / "MNIST" / "raw"
    for case, gzipped in (("test-set", ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]), ("all", None)):
        raw = tmp_path / case / "MNIST" / "raw"
        shutil.copytree(given, raw)
        for name in gzipped or [p.name for p in given.iterdir()]:
            (raw / f"{name}.gz").write_bytes(gzip.compress((raw / name).read_bytes(), mtime=0))
            (raw / name).unlink()
        train_images = (raw / "train-images-idx3-ubyte").read_bytes() if gzipped else None
        result = run_inprocess(RECIPE, "--data-dir", tmp_path / case, "--max-steps", 2, "--width", 4, "--run-dir",
                               tmp_path / f"run-{case}")
        assert result.code == 0, result.stderr
        assert (raw / "t10k-images-idx3-ubyte").read_bytes() == (given / "t10k-images-idx3-ubyte").read_bytes()
        assert not list(raw.glob(".*.tmp"))
        if gzipped:  # the user's own uncompressed files as they were
            assert (raw / "train-images-idx3-ubyte").read_bytes() == train_images
    # a .gz cut short (a download stopped) is named, and left as it is: not downloaded again over the user's file
    packed = raw / "t10k-images-idx3-ubyte.gz"
    packed.write_bytes(packed.read_bytes()[:200])
    (raw / "t10k-images-idx3-ubyte").unlink()
    result = run_inprocess(RECIPE, "--data-dir", tmp_path / "all", "--max-steps", 2, "--width", 4, "--run-dir",
                           tmp_path / "run-cut")
    assert (result.code, result.stderr) == (1, f"error: {packed} is not a whole gzip file (Compressed file ended "
                                               "before the end-of-stream marker was reached); delete it to download "
                                               "it again\n")
    assert len(packed.read_bytes()) == 200 and not list(raw.glob(".*.tmp")) and not (tmp_path / "run-cut").exists()


def test_a_data_dir_that_is_a_file_is_said_so(run_inprocess, tmp_path):
    """It said "MNIST is not in .../raw and could not be downloaded ([Errno 20] Not a directory ...; offline?)"."""
    (tmp_path / "data").write_text("")
    result = run_inprocess(RECIPE, "--data-dir", tmp_path / "data", "--run-dir", tmp_path / "run")
    assert (result.code, result.stderr) == (1, f"error: cannot put MNIST in {tmp_path / 'data' / 'MNIST' / 'raw'}: "
                                               f"{tmp_path / 'data'} is a file, not a folder\n")
    assert (tmp_path / "data").read_text() == "" and not (tmp_path / "run").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="no flock on Windows")
def test_ranks_download_mnist_one_at_a_time(mnist_dir, tmp_path, monkeypatch, capsys):
    """torchrun's ranks all call load_mnist: a rank that checked a file while another wrote it failed the launch.
    The download runs under a lock on the raw folder, one file at a time."""
    import fcntl
    import gzip

    import common.data
    from common.data import load_mnist

    held = []

    def fake_download(url: str, dest: Path, md5: str) -> Path:
        fd = os.open(dest.parent, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
        dest.write_bytes(gzip.compress((mnist_dir / "MNIST" / "raw" / dest.name.removesuffix(".gz")).read_bytes()))
        return dest

    monkeypatch.setattr(common.data, "download", fake_download)
    images, labels = load_mnist(tmp_path / "data", train=True)
    assert held == [True] * 4 and torch.equal(labels, load_mnist(mnist_dir, train=True)[1])
    assert capsys.readouterr().err == ""  # a first download into an empty folder: no note of files beside others


def test_a_folder_missing_one_file_gets_that_file_alone_and_keeps_the_users_own(mnist_dir, tmp_path, monkeypatch,
                                                                                   capsys):
    """torchvision's download=True, called on a folder lacking one file, downloaded all four over the user's own
    (their Fashion-MNIST, say) and trained on MNIST without a word."""
    import gzip
    import shutil

    import common.data
    from common.data import load_mnist

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    def fake_download(url: str, dest: Path, md5: str) -> Path:
        asked.append(dest.name)
        dest.write_bytes(gzip.compress((mnist_dir / "MNIST" / "raw" / dest.name.removesuffix(".gz")).read_bytes()))
        return dest

    asked = []
    monkeypatch.setattr(urllib.request, "urlopen", offline)  # what torchvision's download would have used
    monkeypatch.setattr(common.data, "download", fake_download)
    raw = tmp_path / "own" / "MNIST" / "raw"
    shutil.copytree(mnist_dir / "MNIST" / "raw", raw)
    given = (raw / "train-images-idx3-ubyte").read_bytes()
    own = given[:16] + bytes(len(given) - 16)  # the user's own images: all black
    (raw / "train-images-idx3-ubyte").write_bytes(own)
    (raw / "t10k-labels-idx1-ubyte").unlink()
    images, _ = load_mnist(tmp_path / "own", train=True)
    assert asked == ["t10k-labels-idx1-ubyte.gz"] and (raw / "t10k-labels-idx1-ubyte").is_file()
    assert capsys.readouterr().err == f"note: {raw} lacks t10k-labels-idx1-ubyte: downloading MNIST's\n"
    assert (raw / "train-images-idx3-ubyte").read_bytes() == own
    assert torch.unique(images).numel() == 1  # trained on the user's images, not downloaded ones


@pytest.mark.skipif(sys.platform == "win32", reason="no flock on Windows")
def test_mnist_already_there_is_read_without_a_lock_and_a_lock_that_fails_is_none(mnist_dir, tmp_path, monkeypatch):
    """A shared, read-only data folder (that cannot be listed, say) holding MNIST needs no lock, and a file system
    without flock (ENOLCK on some NFS) downloads unlocked: both read or download as before the lock came."""
    import errno
    import fcntl

    from common.data import load_mnist, one_at_a_time

    def no_locks(fd, operation):
        tried.append(fd)
        raise OSError(errno.ENOLCK, "No locks available")

    tried = []
    monkeypatch.setattr(fcntl, "flock", no_locks)
    images, labels = load_mnist(mnist_dir, train=True)
    assert len(labels) == 512 and tried == []  # there already: no lock was even tried
    ran = []
    with one_at_a_time(tmp_path):
        ran.append(True)
    assert ran == [True] and len(tried) == 1  # tried, failed, and the block ran unlocked


def more_labels(images, labels):
    return images, np.concatenate([labels, labels[:16]])


@pytest.mark.parametrize("recipe", [RECIPE, "ddp_mlp"])
@pytest.mark.parametrize(("damage", "shown"), [
    (more_labels, "hold 96 images of (28, 28) pixels and 112 labels"),  # was an IndexError, or fewer images dropped
    (lambda images, labels: (images, labels * 25), "hold 96 images of (28, 28) pixels and 96 labels"),  # up to 225
    (lambda images, labels: (np.pad(images, ((0, 0), (2, 2), (2, 2))), labels), "of (32, 32) pixels"),
])
def test_well_formed_files_that_are_not_mnist_are_one_line(recipe, damage, shown, run_inprocess, tmp_path):
    """Valid IDX files of the wrong shape, count or labels: a traceback mid-run (or a silent run on other data)."""
    from conftest import synthetic_digits

    from benchmarks.mnist_files import write_mnist

    raw = write_mnist(tmp_path / "data", damage(*synthetic_digits(96, seed=1)), synthetic_digits(40, seed=2))
    result = run_inprocess(recipe, "--data-dir", tmp_path / "data", "--max-steps", 2, "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr.startswith(f"error: MNIST files in {raw.resolve()} hold "), result.stderr
    assert shown in result.stderr and result.stderr.count("\n") == 1
    assert result.stderr.endswith(", not 28x28 digits labelled 0-9; delete them to download again\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe", [RECIPE, "ddp_mlp"])
def test_a_set_too_small_to_train_on_says_so_not_blaming_an_option_not_given(recipe, run_inprocess, tmp_path):
    from conftest import synthetic_digits

    from benchmarks.mnist_files import write_mnist

    write_mnist(tmp_path / "data", synthetic_digits(3, seed=1), synthetic_digits(3, seed=2))
    result = run_inprocess(recipe, "--data-dir", tmp_path / "data", "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr.count("\n") == 1, result.stderr  # was exit 2, "--val-size: ..."
    assert "is larger than the training set (2 samples)" in result.stderr


@pytest.mark.parametrize("recipe", [RECIPE, "ddp_mlp"])
def test_files_of_one_training_digit_say_so(recipe, run_inprocess, tmp_path):
    """It was blamed on --val-size, not given. (An IDX file of no digits is refused as corrupt.)"""
    from conftest import synthetic_digits

    from benchmarks.mnist_files import write_mnist

    raw = write_mnist(tmp_path / "data", synthetic_digits(1, seed=1), synthetic_digits(3, seed=2))
    result = run_inprocess(recipe, "--data-dir", tmp_path / "data", "--batch-size", 1, "--run-dir", tmp_path / "run")
    assert result.code == 1 and result.stderr == (f"error: MNIST files in {raw.resolve()} hold 1 training digit: too "
                                                  "few to train and validate on; delete them to download again\n")
    assert not (tmp_path / "run").exists()


def test_finetune_starts_from_the_backbone_with_its_own_learning_rate(run_inprocess, mnist_dir, tmp_path):
    mnist = load_recipe(RECIPE)
    assert run_inprocess(RECIPE, "--epochs", 1, "--batch-size", 32, "--data-dir", mnist_dir,
                         "--run-dir", tmp_path / "pretrained").code == 0
    pretrained = torch.load(tmp_path / "pretrained" / "checkpoints" / "last.pt", weights_only=True)["model"]

    torch.manual_seed(123)
    model = mnist.DigitNet()
    mnist.load_backbone(model, tmp_path / "pretrained" / "checkpoints" / "last.pt", mnist_dir, 0, None)
    for key, value in model.features.state_dict().items():
        assert torch.equal(value, pretrained[f"features.{key}"]), key
    assert not torch.equal(model.head.weight, pretrained["head.weight"])  # a fresh head

    result = run_inprocess(RECIPE, "--finetune", tmp_path / "pretrained" / "checkpoints" / "last.pt",
                           "--max-lr", 0.05, "--backbone-lr-scale", 0.1, "--epochs", 1, "--max-steps", 2,
                           "--batch-size", 32, "--data-dir", mnist_dir, "--run-dir", tmp_path / "tuned")
    assert result.code == 0, result.stderr
    assert "backbone peak lr 0.005, head peak lr 0.05" in result.stdout
    state = torch.load(tmp_path / "tuned" / "checkpoints" / "last.pt", weights_only=True)
    backbone_group, head_group = state["optimizer"]["param_groups"]
    assert backbone_group["max_lr"] == pytest.approx(0.005) and head_group["max_lr"] == pytest.approx(0.05)
    assert len(backbone_group["params"]) == len(list(model.features.parameters()))
    # two small steps from the pretrained backbone stay close to it
    torch.testing.assert_close(state["model"]["features.0.0.weight"], pretrained["features.0.0.weight"],
                               atol=0.05, rtol=0)


def test_finetune_on_the_backbones_digits_must_hold_out_the_same_ones(run_inprocess, mnist_dir, tmp_path):
    """Another --seed or --val-size put digits the backbone trained on into this run's validation split, which
    chose best.pt on them. Other digits than the backbone's (a --val-size they cannot have) are no concern."""
    assert run_inprocess(RECIPE, "--data-dir", mnist_dir, "--width", 4, "--max-steps", 2, "--run-dir",
                         tmp_path / "pretrained").code == 0
    backbone = tmp_path / "pretrained" / "checkpoints" / "last.pt"
    for option, value in (("--seed", 1), ("--val-size", 100)):
        result = run_inprocess(RECIPE, "--finetune", backbone, "--data-dir", mnist_dir, "--width", 4, option, value,
                               "--max-steps", 1, "--run-dir", tmp_path / f"tuned{option}")
        assert result.code == 1 and result.stderr == (
            f"error: --finetune {backbone} trained on these digits with --seed 0 and no --val-size: pass the same, "
            "or its training digits validate this run\n"), result.stderr  # ("--val-size None": no such value)
    result = run_inprocess(RECIPE, "--finetune", backbone, "--data-dir", mnist_dir, "--width", 4, "--max-steps", 1,
                           "--run-dir", tmp_path / "tuned")
    assert result.code == 0, result.stderr
    # the split the default made, asked for by number (42: 512 // 12), is the same split: it was refused
    result = run_inprocess(RECIPE, "--finetune", backbone, "--data-dir", mnist_dir, "--width", 4, "--val-size", 42,
                           "--max-steps", 1, "--run-dir", tmp_path / "tuned-42")
    assert result.code == 0, result.stderr


def test_a_resume_keeps_the_finetune_it_started_with(run_inprocess, mnist_dir, tmp_path):
    """--finetune changed or dropped on a resume loaded nothing, yet was recorded: a --config replay of the run then
    trained from scratch (or from another backbone). Refused, naming the option."""
    assert run_inprocess(RECIPE, "--data-dir", mnist_dir, "--width", 4, "--max-steps", 2, "--run-dir",
                         tmp_path / "pretrained").code == 0
    backbone = tmp_path / "pretrained" / "checkpoints" / "last.pt"
    args = ["--data-dir", mnist_dir, "--width", 4, "--epochs", 2, "--run-dir", tmp_path / "run"]
    assert run_inprocess(RECIPE, *args, "--finetune", backbone, "--max-steps", 2).code == 0
    config = (tmp_path / "run" / "config.json").read_bytes()
    dropped = run_inprocess(RECIPE, *args, "--resume", "auto")
    assert dropped.code == 1 and f"(--finetune {backbone} there, None here)" in dropped.stderr, dropped.stderr
    assert (tmp_path / "run" / "config.json").read_bytes() == config


def test_a_backbone_rate_without_finetune_is_a_usage_error(run_inprocess, tmp_path):
    result = run_inprocess("mnist_onecycle", "--backbone-lr-scale", 0.5, "--run-dir", tmp_path / "run")
    assert result.code == 2 and "--backbone-lr-scale: sets the rate of the layers --finetune loads" in result.stderr
    assert not (tmp_path / "run").exists()


def test_finetune_from_another_recipe_is_refused(run_inprocess, mnist_dir, table_csv, tmp_path):
    assert run_inprocess("tabular_mlp", "--csv", table_csv, "--target", "label", "--epochs", 1,
                         "--run-dir", tmp_path / "tab").code == 0
    result = run_inprocess(RECIPE, "--finetune", tmp_path / "tab" / "checkpoints" / "last.pt",
                           "--data-dir", mnist_dir, "--run-dir", tmp_path / "run")
    assert result.code == 1 and "written by recipe 'tabular_mlp', not 'mnist_onecycle'" in result.stderr


def test_finetune_from_a_checkpoint_whose_weights_are_no_dict_is_one_line(run_inprocess, mnist_dir, tmp_path):
    path = tmp_path / "edited.pt"
    torch.save({"recipe": RECIPE, "model": torch.zeros(3), "config": {}, "step": 1}, path)  # was an AttributeError
    result = run_inprocess(RECIPE, "--finetune", path, "--data-dir", mnist_dir, "--run-dir", tmp_path / "run")
    assert (result.code, result.stderr) == (1, f"error: checkpoint {path} is damaged: its weights are a Tensor, not "
                                               "a dict\n")
    assert not (tmp_path / "run").exists()


def test_finetune_from_another_width_names_the_width_to_pass(run_inprocess, mnist_dir, tmp_path):
    assert run_inprocess(RECIPE, "--width", 4, "--max-steps", 1, "--batch-size", 32, "--data-dir", mnist_dir,
                         "--run-dir", tmp_path / "narrow").code == 0
    checkpoint = tmp_path / "narrow" / "checkpoints" / "last.pt"
    result = run_inprocess(RECIPE, "--finetune", checkpoint, "--data-dir", mnist_dir, "--run-dir", tmp_path / "run")
    assert result.code == 1
    assert result.stderr == f"error: --finetune {checkpoint} was trained with --width 4: pass --width 4 to build the " \
                            "same backbone\n"
    assert not (tmp_path / "run").exists()  # nothing left behind by a run that never started


def test_augmentation_warps_the_training_digits_but_keeps_their_labels(run_inprocess, mnist_dir, tmp_path,
                                                                       monkeypatch):
    """What reaches the training step, with and without --augment: the same labels in the same order, images
    warped (and every one of them: each digit its own warp), values still in the normalised range."""
    mnist = load_recipe(RECIPE)
    seen = {}
    real_step = mnist.train_step

    def recording_step(model, optimizer, loss_fn, batches, **kwargs):
        seen.setdefault(tag, []).append([t.clone() for t in batches[0]])
        return real_step(model, optimizer, loss_fn, batches, **kwargs)

    monkeypatch.setattr(mnist, "train_step", recording_step)
    for tag in ("augment", "no-augment"):
        assert run_inprocess(RECIPE, f"--{tag}", "--epochs", 1, "--max-steps", 3, "--batch-size", 32,
                             "--data-dir", mnist_dir, "--run-dir", tmp_path / tag).code == 0
    assert len(seen["augment"]) == len(seen["no-augment"]) == 3
    for (warped, labels), (plain, plain_labels) in zip(seen["augment"], seen["no-augment"], strict=True):
        assert torch.equal(labels, plain_labels)
        assert warped.shape == plain.shape and warped.dtype == plain.dtype
        assert all(not torch.equal(a, b) for a, b in zip(warped, plain, strict=True))
        assert plain.min() - 1e-5 <= warped.min() and warped.max() <= plain.max() + 1e-5  # bilinear: no overshoot
    # the warps follow from (seed, step) alone
    x = seen["no-augment"][0][0]
    assert torch.equal(mnist.augment_digits(x, mnist.augment_generator(0, 5)),
                       mnist.augment_digits(x, mnist.augment_generator(0, 5)))
    assert not torch.equal(mnist.augment_digits(x, mnist.augment_generator(0, 5)),
                           mnist.augment_digits(x, mnist.augment_generator(0, 6)))


def test_augmented_run_stopped_and_resumed_ends_with_the_same_weights(run_inprocess, mnist_dir, tmp_path):
    common = ["--augment", "--epochs", 2, "--batch-size", 32, "--width", 4, "--data-dir", mnist_dir]
    assert run_inprocess(RECIPE, *common, "--run-dir", tmp_path / "full").code == 0
    assert run_inprocess(RECIPE, *common, "--max-steps", 9, "--run-dir", tmp_path / "cut").code == 0
    resumed = run_inprocess(RECIPE, *common, "--resume", "auto", "--run-dir", tmp_path / "cut")
    assert resumed.code == 0 and "resumed at step 9" in resumed.stdout, resumed.stderr
    assert_same_weights(load_weights(tmp_path / "full" / "checkpoints" / "last.pt"),
                        load_weights(tmp_path / "cut" / "checkpoints" / "last.pt"))
    # and the augmentation did change the training: without it the weights differ
    assert run_inprocess(RECIPE, *common[1:], "--no-augment", "--run-dir", tmp_path / "plain").code == 0
    plain = load_weights(tmp_path / "plain" / "checkpoints" / "last.pt")
    full = load_weights(tmp_path / "full" / "checkpoints" / "last.pt")
    assert not all(torch.equal(plain[k], full[k]) for k in full)


def test_the_test_set_is_scored_with_the_weights_best_pt_holds(run_inprocess, mnist_dir, tmp_path):
    """The score a run reports is the deployed model's: best.pt's weights (with --ema, the average), not the
    last step's, which --predict and export.py never use."""
    from common.data import load_mnist, make_loader
    from common.loop import evaluate

    run_dir = tmp_path / "run"
    result = run_inprocess(RECIPE, "--epochs", 2, "--batch-size", 32, "--width", 4, "--ema", 0.9, "--precision",
                           "fp32", "--data-dir", mnist_dir, "--run-dir", run_dir)
    assert result.code == 0, result.stderr
    best, last = (load_weights(run_dir / "checkpoints" / name) for name in ("best.pt", "last.pt"))
    assert not all(torch.equal(best[k], last[k]) for k in best)  # two different models
    recipe = load_recipe(RECIPE)
    test_set = make_loader(torch.utils.data.TensorDataset(*load_mnist(mnist_dir, train=False)), 1000, train=False)
    scores = {}
    for name, weights in (("best", best), ("last", last)):
        model = recipe.DigitNet(4)
        model.load_state_dict(weights)
        scores[name] = evaluate(model, test_set, torch.nn.CrossEntropyLoss(), device=torch.device("cpu"))
    metrics = read_metrics(run_dir)
    assert (metrics["test_acc"], metrics["test_loss"]) == pytest.approx((scores["best"]["acc"], scores["best"]["loss"]))
    assert metrics["test_loss"] != pytest.approx(scores["last"]["loss"])
    # best.pt holds the average in place of the trained weights: no run can go on from it
    resumed = run_inprocess(RECIPE, "--epochs", 3, "--batch-size", 32, "--width", 4, "--ema", 0.9, "--precision",
                            "fp32", "--data-dir", mnist_dir, "--run-dir", tmp_path / "on",
                            "--resume", run_dir / "checkpoints" / "best.pt")
    assert resumed.code == 1 and "holds the averaged (EMA) weights, not the trained ones" in resumed.stderr
    assert not (tmp_path / "on").exists()


def test_a_launch_from_another_folder_says_which_folders_it_uses(run_inprocess, mnist_dir, tmp_path, monkeypatch):
    """--data-dir and --run-dir are relative to where a run is launched (as the README says): the header names
    the absolute folders, and runs/ goes where the command ran."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "digits").symlink_to(mnist_dir)
    monkeypatch.chdir(elsewhere)  # launched from there
    result = run_inprocess(RECIPE, "--data-dir", "digits", "--max-steps", 2, "--batch-size", 32)
    assert result.code == 0, result.stderr
    run_dir = next((elsewhere / "runs" / RECIPE).iterdir())
    assert f"run_dir {run_dir.resolve()} | device cpu" in result.stdout
    assert f"test digits from {(elsewhere / 'digits').resolve()}" in result.stdout
    # the other recipes that read data name it the same way
    (elsewhere / "t.csv").write_text("x,y\n" + "".join(
        f"{i},{'ab'[i % 2]}\n" for i in range(40)))
    result = run_inprocess("tabular_mlp", "--csv", "t.csv", "--target", "y", "--max-steps", 2, "--run-dir", "r")
    assert result.code == 0 and f"val rows of {(elsewhere / 't.csv').resolve()} | " in result.stdout, result.stderr
    (elsewhere / "t.txt").write_text("hello world, " * 200)
    result = run_inprocess("tiny_transformer", "--text", "t.txt", "--steps", 2, "--n-layer", 1, "--n-embd", 16,
                           "--n-head", 2, "--block-size", 8, "--batch-size", 2, "--eval-batches", 1,
                           "--sample-tokens", 2, "--peak-flops", 1e11, "--run-dir", "r2")
    assert result.code == 0 and f"val tokens of {(elsewhere / 't.txt').resolve()} | " in result.stdout, result.stderr


def test_a_folder_of_torchvisions_older_processed_files_is_read_without_a_download(mnist_dir, tmp_path,
                                                                                    monkeypatch):
    """Older torchvision left MNIST/processed/{training,test}.pt, which MNIST() still reads: fetching the raw files
    first downloaded 11 MB it never used, or failed offline."""
    from common.cli import RecipeError
    from common.data import load_mnist

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    processed = tmp_path / "old" / "MNIST" / "processed"
    processed.mkdir(parents=True)
    for split, train in (("training", True), ("test", False)):
        images, labels = load_mnist(mnist_dir, train=train)
        pixels = ((images * MNIST_STD + MNIST_MEAN) * 255).round().to(torch.uint8).squeeze(1)
        torch.save((pixels, labels), processed / f"{split}.pt")
    images, labels = load_mnist(tmp_path / "old", train=True)
    assert torch.equal(labels, load_mnist(mnist_dir, train=True)[1]) and images.shape == (512, 1, 28, 28)
    assert not (tmp_path / "old" / "MNIST" / "raw").exists()  # nothing downloaded, no folder made for it
    for split in ("training", "test"):  # cut short: one line naming those files (a traceback, naming raw/)
        (processed / f"{split}.pt").write_bytes((processed / f"{split}.pt").read_bytes()[:1000])
    with pytest.raises(RecipeError, match=f"^MNIST files in {processed} are "):
        load_mnist(tmp_path / "old", train=True)
    assert not (tmp_path / "old" / "MNIST" / "raw").exists()


def test_a_full_disk_while_decompressing_says_so_and_keeps_the_users_gz(run_inprocess, mnist_dir, small_disk, tmp_path):
    """It said the files were "unreadable (Error downloading ...); delete them to download again"."""
    import gzip

    raw = small_disk / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in MNIST_FILES:  # black images: the .gz files fit, the 400 KB of training images they hold do not
        given = (mnist_dir / "MNIST" / "raw" / name).read_bytes()
        content = given[:16] + bytes(len(given) - 16) if "images" in name else given
        (raw / f"{name}.gz").write_bytes(gzip.compress(content, mtime=0))
    packed = {path.name: path.read_bytes() for path in raw.iterdir()}
    result = run_inprocess(RECIPE, "--data-dir", small_disk, "--run-dir", tmp_path / "run")
    assert (result.code, result.stderr) == (1, f"error: cannot decompress {raw / 'train-images-idx3-ubyte.gz'}: No "
                                               "space left on device\n")
    assert {path.name: path.read_bytes() for path in raw.iterdir()} == packed and not (tmp_path / "run").exists()

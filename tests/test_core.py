"""The shared core: precision, the training step, evaluation, checkpoints, loaders, run directories."""

import contextlib
import errno
import hashlib
import http.client
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import ROOT, assert_same_weights, read_scalars
from torch import nn
from torch.utils.data import TensorDataset

from common import checkpoint as ckpt
from common.cli import RecipeError
from common.data import checksum, download, make_loader
from common.loop import StepStats, evaluate, train_step
from common.rundir import RunFolder, open_run_dir
from common.runlog import RunLog
from common.runtime import resolve_device, unwrap
from common.stop import StopRequest

CPU = torch.device("cpu")


def tiny_model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 3))


def tiny_data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


LOSS = nn.CrossEntropyLoss()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_on_cpu_trains(precision):
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    x, y = tiny_data().tensors
    output_dtypes = []
    model[-1].register_forward_hook(lambda module, inputs, output: output_dtypes.append(output.dtype))
    stats = train_step(model, optimizer, LOSS, [(x, y)], device=CPU, precision=precision, scaler=scaler)
    assert output_dtypes == [{"bf16": torch.bfloat16, "fp16": torch.float16}[precision]]  # the matmuls ran in 16 bits
    assert math.isfinite(stats.loss.item())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    if scaler.is_enabled():  # the step went through the scaler: it counted one good step and reported the norm
        assert scaler.state_dict()["_growth_tracker"] == 1
        assert not stats.skipped and math.isfinite(stats.grad_norm.item())


def test_autocast_computes_in_low_precision():
    from common.runtime import autocast

    with autocast(CPU, "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast(CPU, "fp32"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_fp16_overflow_is_skipped_and_the_scale_drops():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)  # scaled fp16 gradients overflow for sure
    x, y = tiny_data().tensors
    before = [p.detach().clone() for p in model.parameters()]
    stats = train_step(model, optimizer, LOSS, [(x, y)], device=CPU, precision="fp16", scaler=scaler)
    assert bool(stats.skipped)
    assert scaler.get_scale() == 2.0**29
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    for _ in range(40):  # training goes on: the scale keeps halving until steps succeed
        stats = train_step(model, optimizer, LOSS, [(x, y)], device=CPU, precision="fp16", scaler=scaler)
    assert not bool(stats.skipped)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_gradient_accumulation_equals_one_big_batch():
    x, y = tiny_data().tensors
    big, small = tiny_model(), tiny_model()
    opt_big = torch.optim.SGD(big.parameters(), lr=0.1)
    opt_small = torch.optim.SGD(small.parameters(), lr=0.1)
    train_step(big, opt_big, LOSS, [(x, y)], device=CPU)
    stats = train_step(small, opt_small, LOSS, [(x[:32], y[:32]), (x[32:], y[32:])], device=CPU)
    for a, b in zip(big.parameters(), small.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert stats.loss.item() == pytest.approx(LOSS(tiny_model()(x), y).item(), rel=1e-5)


@pytest.mark.parametrize("loss_fn", [LOSS, nn.CrossEntropyLoss(ignore_index=-1)], ids=["sizes", "ignored targets"])
def test_unequal_micro_batches_step_like_their_concatenation(loss_fn):
    x, y = tiny_data(4).tensors
    if loss_fn.ignore_index == -1:  # the 3-sample micro-batch has 2 targets that count, the other 1: 2:1, not 1:1
        y = torch.tensor([y[0].item(), -1, y[2].item(), y[3].item()])
    one, split = tiny_model(), tiny_model()
    opt_one, opt_split = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (one, split))
    train_step(one, opt_one, loss_fn, [(x, y)], device=CPU)
    stats = train_step(split, opt_split, loss_fn, [(x[:3], y[:3]), (x[3:], y[3:])], device=CPU)
    for a, b in zip(one.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # a plain mean of the two losses is 30% off
    assert stats.loss.item() == pytest.approx(loss_fn(tiny_model()(x), y).item(), rel=1e-5)


def test_evaluate_counts_only_the_targets_the_loss_counts():
    loss_fn = nn.CrossEntropyLoss(ignore_index=-1)
    x, y = tiny_data(40).tensors
    y = y.clone()
    y[:10] = -1  # a whole first batch of unknown labels, and some in the others
    y[15] = y[33] = -1
    model = tiny_model().eval()
    metrics = evaluate(model, [(x[i:i + 10], y[i:i + 10]) for i in range(0, 40, 10)], loss_fn, device=CPU)
    with torch.no_grad():
        logits = model(x)
    valid = y != -1
    assert math.isfinite(metrics["loss"])
    assert metrics["loss"] == pytest.approx(loss_fn(logits, y).item(), rel=1e-6)
    assert metrics["acc"] == pytest.approx((logits.argmax(1) == y)[valid].float().mean().item())


def test_clipping_bounds_the_update_and_reports_the_norm():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    x, y = tiny_data().tensors
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    stats = train_step(model, optimizer, LOSS, [(x, y)], device=CPU, max_grad_norm=1e-3)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert stats.grad_norm.item() > 1e-3  # the norm before clipping
    assert (after - before).norm().item() == pytest.approx(1e-3, rel=1e-3)  # lr 1 x clipped norm


def test_evaluate_uses_eval_mode_no_graph_and_restores_train_mode():
    model = tiny_model(dropout=0.5)
    model.train()
    seen = []
    model.register_forward_hook(lambda m, inputs, out: seen.append((m.training, out.requires_grad)))
    loader = make_loader(tiny_data(50), 16, train=False)
    metrics = evaluate(model, loader, LOSS, device=CPU)
    assert seen and all(mode is False and grad is False for mode, grad in seen)
    assert model.training
    # every sample counted once, the short last batch weighted by its size
    x, y = tiny_data(50).tensors
    model.eval()
    with torch.no_grad():
        logits = model(x)
    assert metrics["loss"] == pytest.approx(LOSS(logits, y).item(), rel=1e-5)
    assert metrics["acc"] == pytest.approx((logits.argmax(1) == y).float().mean().item())


def test_train_loader_shuffles_on_cpu_and_is_reproducible():
    data = TensorDataset(torch.arange(100))

    def order(seed, epoch):
        loader = make_loader(data, 10, train=True, seed=seed)
        loader.sampler.set_epoch(epoch)
        return torch.cat([batch[0] for batch in loader]).tolist()

    assert order(0, 0) != list(range(100))
    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)  # a new permutation every epoch
    assert order(0, 0) != order(1, 0)
    assert len(order(0, 0)) == 100 and len(set(order(0, 0))) == 100


def test_resumed_epoch_skips_exactly_what_was_seen():
    data = TensorDataset(torch.arange(100))
    loader = make_loader(data, 10, train=True, seed=3)
    loader.sampler.set_epoch(2)
    full = [batch[0].tolist() for batch in loader]
    loader.sampler.skip = 4 * 10  # what Run.batches sets for a run resumed after 4 steps of this epoch
    assert [batch[0].tolist() for batch in loader] == full[4:]


def test_eval_loader_keeps_order_and_every_sample():
    loader = make_loader(TensorDataset(torch.arange(25)), 10, train=False)
    assert torch.cat([b[0] for b in loader]).tolist() == list(range(25))


def test_a_tensor_dataset_is_batched_by_one_indexing_with_the_same_batches(monkeypatch):
    """make_loader fetches a TensorDataset's batch with one indexing per tensor, never row by row, and the
    batches are those of the DataLoader's own per-row fetch and stack, in the same order."""
    data = TensorDataset(torch.randn(100, 3), torch.arange(100))
    loader = make_loader(data, 8, train=True, seed=5)
    loader.sampler.set_epoch(1)
    reference = torch.utils.data.DataLoader(data, batch_size=8, sampler=loader.sampler, drop_last=True)
    expected = [[t.clone() for t in batch] for batch in reference]
    monkeypatch.setattr(TensorDataset, "__getitem__", lambda self, i: pytest.fail("fetched row by row"))
    batches = list(loader)
    assert len(batches) == len(expected) == 12
    for got, want in zip(batches, expected, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_worker_processes_load_the_same_tensor_batches():
    data = TensorDataset(torch.randn(64, 3), torch.arange(64))
    loaders = [make_loader(data, 8, train=True, seed=2, num_workers=n) for n in (0, 2)]
    assert [loader.num_workers for loader in loaders] == [0, 2]  # two worker processes load the second's batches
    for loader in loaders:
        loader.sampler.set_epoch(1)
    in_process, in_workers = ([[t.clone() for t in batch] for batch in loader] for loader in loaders)
    assert len(in_process) == len(in_workers) == 8
    for a, b in zip(in_process, in_workers, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def training_setup(dropout=0.2):
    model = tiny_model(dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=20)
    scaler = torch.amp.GradScaler("cpu")
    loader = make_loader(tiny_data(), 8, train=True, seed=0)
    return model, optimizer, scheduler, scaler, loader


def run_steps(setup, start, stop):
    model, optimizer, scheduler, scaler, loader = setup
    step = start
    epoch, skip = divmod(start, len(loader))
    while step < stop:
        loader.sampler.set_epoch(epoch)
        loader.sampler.skip = skip * 8
        for batch in loader:
            train_step(model, optimizer, LOSS, [batch], device=CPU, precision="fp16", scaler=scaler)
            scheduler.step()
            step += 1
            if step == stop:
                return
        epoch, skip = epoch + 1, 0


def test_checkpoint_round_trip_continues_bit_identically(tmp_path):
    torch.manual_seed(5)
    setup = training_setup()
    run_steps(setup, 0, 11)  # stops mid-epoch (8 steps per epoch)
    model, optimizer, scheduler, scaler, loader = setup
    path = tmp_path / "checkpoints" / "last.pt"
    run = RunFolder(tmp_path, None)
    saved = ckpt.Checkpointer(run, "test", {"a": 1}, model=model, optimizer=optimizer, scheduler=scheduler,
                              scaler=scaler, loader_generator=loader.generator)
    saved.save(11)
    run_steps(setup, 11, 17)
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(123)  # disturb the global RNG: the checkpoint must restore it
    fresh = training_setup()
    state = ckpt.load_checkpoint(path, "test")
    restored = ckpt.Checkpointer(RunFolder(tmp_path, path), "test", {"a": 1}, model=fresh[0], optimizer=fresh[1],
                                 scheduler=fresh[2], scaler=fresh[3], loader_generator=fresh[4].generator)
    assert restored.restore(state) == 11 and state["config"] == {"a": 1}
    run_steps(fresh, 11, 17)
    assert_same_weights(uninterrupted, fresh[0].state_dict())
    assert fresh[2].get_last_lr() == scheduler.get_last_lr()


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / "last.pt"
    ckpt.save_checkpoint(path, {"model": {"w": torch.ones(3)}, "recipe": "test"})
    before = path.read_bytes()

    def crash_halfway(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_halfway)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(path, {"model": {"w": torch.zeros(3)}, "recipe": "test"})
    assert path.read_bytes() == before
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    assert torch.equal(ckpt.load_checkpoint(path, "test")["model"]["w"], torch.ones(3))


@pytest.mark.parametrize(("code", "saved"), [(errno.EINVAL, True), (errno.ENOTSUP, True), (errno.EIO, False)])
def test_a_file_system_that_cannot_sync_a_folder_still_takes_checkpoints(code, saved, tmp_path, monkeypatch):
    """Some file systems refuse fsync on a folder (EINVAL): every save after its rename was "could not write
    checkpoint", though written, and no run could train there. A real failure to sync (EIO) still stops it."""
    real_fsync = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    run = RunFolder(tmp_path, None)
    model = nn.Linear(2, 1)
    checkpoints = ckpt.Checkpointer(run, "t", {}, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with contextlib.nullcontext() if saved else pytest.raises(RecipeError, match="could not write checkpoint"):
        checkpoints.save(7)
    assert ckpt.load_checkpoint(tmp_path / "checkpoints" / "last.pt", "t")["step"] == 7
    assert checkpoints.last_step == (7 if saved else None)


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "evil.pt"
    torch.save({"recipe": "test", "model": {}, "extra": Payload(marker)}, path)
    with pytest.raises(RecipeError, match="refuses to run") as err:
        ckpt.load_checkpoint(path, "test")
    assert "\n" not in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", os.urandom(4000), b"not a checkpoint"])
def test_garbage_checkpoint_is_a_clear_error(tmp_path, content):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(RecipeError, match="corrupt, truncated, or not a PyTorch checkpoint"):
        ckpt.load_checkpoint(path, "test")


def test_checkpoint_of_another_model_lists_mismatched_keys(tmp_path):
    path = tmp_path / "other.pt"
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3), nn.Linear(3, 3))
    with pytest.raises(RecipeError, match=r"unexpected: 2\.bias, 2\.weight; wrong shape: 0\.bias, 0\.weight, 3\.w"):
        ckpt.load_model_state(tiny_model(), other.state_dict(), path)


def test_checkpoint_of_another_recipe_is_refused(tmp_path):
    path = tmp_path / "x.pt"
    ckpt.save_checkpoint(path, {"recipe": "mnist_onecycle", "model": {}})
    with pytest.raises(RecipeError, match="written by recipe 'mnist_onecycle', not 'tabular_mlp'"):
        ckpt.load_checkpoint(path, "tabular_mlp")


def test_saved_model_is_unwrapped(tmp_path):
    compiled = torch.compile(tiny_model(), backend="eager")
    assert unwrap(compiled) is compiled._orig_mod
    checkpoints = ckpt.Checkpointer(RunFolder(tmp_path, None), "t", {}, model=compiled,
                                    optimizer=torch.optim.SGD(compiled.parameters(), lr=1))
    checkpoints.save(1)
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert all(not k.startswith(("_orig_mod.", "module.")) for k in state["model"])


def test_cuda_device_absent_is_a_recipe_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RecipeError, match="CUDA is not available"):
        resolve_device("cuda")
    assert resolve_device("auto") in (torch.device("cpu"), torch.device("mps"))


def test_run_dir_with_checkpoints_is_not_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    ckpt.save_checkpoint(run_dir / "checkpoints" / "last.pt", {"model": {}, "recipe": "t"})
    with pytest.raises(RecipeError, match="already holds checkpoints"):
        open_run_dir("t", run_dir, None)
    assert open_run_dir("t", run_dir, "auto") == RunFolder(run_dir, run_dir / "checkpoints" / "last.pt")
    assert open_run_dir("t", tmp_path / "new", "auto") == RunFolder(tmp_path / "new", None)


def test_a_checkpoint_from_elsewhere_never_overwrites_a_run_dirs_checkpoints(tmp_path):
    run_dir, other = tmp_path / "run", tmp_path / "other.pt"
    for path in (run_dir / "checkpoints" / "last.pt", run_dir / "checkpoints" / "best.pt", other):
        ckpt.save_checkpoint(path, {"model": {}, "recipe": "t", "config": {}})
    for elsewhere in (other, run_dir / "checkpoints" / "best.pt"):  # another run's, or this one's older best
        with pytest.raises(RecipeError, match=f"already holds checkpoints, and --resume {elsewhere} is not its last"):
            ckpt.resume_checkpoint(RunFolder(run_dir, elsewhere, held=run_dir / "checkpoints" / "last.pt"), "t", {})
    last = run_dir / "checkpoints" / "last.pt"  # its own last one, named: as --resume auto
    run = open_run_dir("t", run_dir, str(last))
    assert run == RunFolder(run_dir, last) and run.held == last and ckpt.resume_checkpoint(run, "t", {})["model"] == {}
    fresh = open_run_dir("t", tmp_path / "new", str(other))
    assert fresh.held is None and ckpt.resume_checkpoint(fresh, "t", {})["recipe"] == "t"
    # a checkpoint that is itself the problem is named as such first
    with pytest.raises(RecipeError, match="does not exist"):
        ckpt.resume_checkpoint(RunFolder(run_dir, tmp_path / "nope.pt", held=last), "t", {})


def test_a_run_dir_holding_sub_runs_is_not_overwritten_by_a_fresh_run(tmp_path):
    """--cv (fold-K/) and --compare (fp32/, ...) keep their checkpoints in sub-folders, their summary on top."""
    run_dir = tmp_path / "cv"
    fold = run_dir / "fold-0" / "checkpoints" / "last.pt"
    ckpt.save_checkpoint(fold, {"model": {}, "recipe": "t", "config": {}})
    with pytest.raises(RecipeError, match="already holds checkpoints; continue it with --resume auto, or choose"):
        open_run_dir("t", run_dir, None, holds_runs=True)  # the --cv command again
    # a single run's command: --resume auto would not continue the sub-runs (it was suggested, then refused)
    with pytest.raises(RecipeError, match=r"holds runs in sub-folders \(.*fold-0.*\), which this command would not "
                       "continue but start afresh beside: choose another --run-dir, or to continue it, give the "
                       "options it was started with$"):
        open_run_dir("t", run_dir, None)
    with pytest.raises(RecipeError, match="already holds checkpoints; this command starts afresh: choose another"):
        open_run_dir("t", run_dir, None, resumable=False)  # --compare, which refuses --resume
    assert open_run_dir("t", run_dir, "auto", holds_runs=True) == RunFolder(run_dir, None)  # the --cv parent again
    # a single run's --resume auto would start afresh beside the folds, and replace their summary
    with pytest.raises(RecipeError, match=r"holds runs in sub-folders \(.*fold-0.*\), which this command would not"):
        open_run_dir("t", run_dir, "auto")
    single = tmp_path / "single"
    ckpt.save_checkpoint(single / "checkpoints" / "last.pt", {"model": {}, "recipe": "t", "config": {}})
    with pytest.raises(RecipeError, match=r"holds a single run \(.*single/checkpoints/last.pt\)"):
        open_run_dir("t", single, "auto", holds_runs=True)  # --cv into a plain run's folder
    # a run killed in its first sharded save restarts fresh with the same command, as any run without a last
    # checkpoint does: its own folder holds no other runs (a best.pt alone is refused: tests/test_rundir.py)
    early = tmp_path / "early"
    (early / "checkpoints" / "dcp" / ".step-000002.tmp").mkdir(parents=True)
    torch.save({}, early / "checkpoints" / "dcp" / ".step-000002.tmp" / "trainer.pt")
    assert open_run_dir("t", early, "auto") == RunFolder(early, None)
    # but a finished run (metrics.json) that lost its last.pt, or all its checkpoints, is not overwritten by a new one
    (early / "metrics.json").write_text('{"recipe": "t"}')
    finished = r"holds a finished run \(its metrics.json\) but not its checkpoints/last.pt: .* choose another --run-dir"
    with pytest.raises(RecipeError, match=finished):
        open_run_dir("t", early, "auto")
    shutil.rmtree(early / "checkpoints")
    for resume in ("auto", None, str(tmp_path / "other.pt")):
        with pytest.raises(RecipeError, match=finished):
            open_run_dir("t", early, resume)
    (tmp_path / "cv2").mkdir()  # a --cv parent's metrics.json is the folds' summary, beside no checkpoint of its own
    (tmp_path / "cv2" / "metrics.json").write_text('{"recipe": "t"}')
    assert open_run_dir("t", tmp_path / "cv2", "auto", holds_runs=True) == RunFolder(tmp_path / "cv2", None)
    with pytest.raises(RecipeError, match="already holds checkpoints, and --resume"):
        ckpt.resume_checkpoint(RunFolder(run_dir, tmp_path / "x.pt", held=fold), "t", {}, load=lambda path, r: {})

class Logged:
    """A RunLog and a Checkpointer over a tiny model, started for ``steps`` steps (evaluated at the end only)."""

    def __init__(self, run_dir: Path, steps: int, every: int = 10):
        self.model = tiny_model()
        run_dir.mkdir(parents=True, exist_ok=True)
        run = RunFolder(run_dir, None)
        self.log = RunLog(run, "t", total_steps=steps, every=every)
        self.checkpoints = ckpt.Checkpointer(run, "t", {}, model=self.model,
                                             optimizer=torch.optim.SGD(self.model.parameters(), lr=0.1),
                                             parts={"log": self.log})
        self.log.start(0, {}, CPU)
        self.step = 0

    def train(self, stats: StepStats, lr: float = 0.1, items: int = 1) -> None:
        self.step += 1
        self.log.train(self.step, stats, lr=lr, items=items)


def stats(loss: float, grad_norm: float | None = None, skipped: bool | None = None) -> StepStats:
    return StepStats(torch.tensor(loss), None if grad_norm is None else torch.tensor(grad_norm),
                     None if skipped is None else torch.tensor(skipped))


def test_run_logs_scalars_and_stops_on_a_non_finite_loss(tmp_path):
    run = Logged(tmp_path, steps=100, every=5)
    for step in range(1, 7):
        run.train(stats(1.0 / step), lr=0.1 * step, items=4)
    run.log.eval(run.step, val={"loss": 0.5, "acc": 0.75})
    run.checkpoints.save(run.step)  # last.pt at step 6
    run.train(stats(float("nan")), lr=0.7, items=4)
    with pytest.raises(RecipeError, match=r"loss is nan at step 7; the last good checkpoint is .*last\.pt"):
        run.log.flush()
    run.log.writer.close()
    scalars = read_scalars(tmp_path)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert scalars["train/lr"][2][1] == pytest.approx(0.3)
    assert scalars["val/acc"] == [(6, 0.75)]
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["step"] == 6


def test_a_checkpoint_reads_the_pending_losses_first_and_never_follows_a_nan(tmp_path):
    run = Logged(tmp_path, steps=100)
    run.train(stats(0.5))
    run.checkpoints.save(run.step)
    run.train(stats(float("nan")))  # still on the device: the save must read it back before writing
    with pytest.raises(RecipeError, match=r"loss is nan at step 2"):
        run.checkpoints.save(run.step)
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["step"] == 1


def test_fp16_skipped_steps_are_counted_not_fatal(tmp_path):
    run = Logged(tmp_path, steps=2)
    run.train(stats(float("inf"), float("inf"), True))
    run.train(stats(0.5, 1.0, False))
    summary = run.log.finish(run.step)
    assert summary["skipped_steps"] == 1 and summary["train_loss"] == 0.5
    assert Path(tmp_path / "metrics.json").is_file()


def test_a_window_of_skipped_steps_shows_no_earlier_loss_as_its_own(tmp_path, capsys):
    """Every step of a window skipped (the weights past fp16's range): its line repeated the last good step's loss,
    with no word of the skipping."""
    run = Logged(tmp_path, steps=15, every=5)
    for loss, skipped in [(0.9, False), (0.8, False), (float("inf"), True), (0.7, False), (0.6, False),
                          *[(float("nan"), True)] * 5, *[(0.5, False)] * 5]:
        run.train(stats(loss, 1.0, skipped))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split("  lr ")[0] for line in lines] == [
        "step 5/15  loss 0.6000 (1 of 5 steps skipped: fp16 overflow)",
        "step 10/15  loss n/a (5 of 5 steps skipped: fp16 overflow)",  # was "loss 0.6000"
        "step 15/15  loss 0.5000"]


def test_the_count_of_skipped_steps_in_a_row_survives_a_resume(tmp_path):
    """A resume started the count at 0: a run that overflowed for good trained on past where it had stopped before."""
    run = Logged(tmp_path / "a", steps=200)
    for _ in range(30):
        run.train(stats(float("inf"), float("inf"), True))
    state = run.log.state_dict()
    resumed = Logged(tmp_path / "b", steps=200)
    resumed.log.load_state_dict(state)
    resumed.step = run.step
    with pytest.raises(RecipeError, match=r"skipped 50 steps in a row up to step 50;"):
        for _ in range(20):
            resumed.train(stats(float("inf"), float("inf"), True))
        resumed.log.flush()
    del state["skipped_in_a_row"]  # a checkpoint from before the count was kept: it loads, counting from 0
    resumed.log.load_state_dict(state)
    assert resumed.log.skipped_in_a_row == 0 and resumed.log.skipped_steps == 30


def test_fp16_that_never_steps_stops_with_what_to_try(tmp_path):
    run = Logged(tmp_path, steps=200)
    for _ in range(49):
        run.train(stats(float("inf"), float("inf"), True))
    run.train(stats(0.5, 1.0, False))  # one good step resets the count
    with pytest.raises(RecipeError, match=r"overflows fp16: the GradScaler skipped 50 steps in a row up to step 100; "
                                          r"try --precision bf16.*Try a lower --lr"):
        for _ in range(50):
            run.train(stats(float("inf"), float("inf"), True))
        run.log.flush()


def test_throughput_leaves_out_the_first_window(tmp_path, monkeypatch):
    clock = iter(range(1000))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    run = Logged(tmp_path, steps=30, every=10)
    for step in range(1, 31):
        if step == 1:
            for _ in range(50):  # the first step is slow: start-up, compilation
                time.perf_counter()
        run.train(stats(1.0), items=100)
    log = run.log  # the clock: one second a call; the first window's 10 steps took 51 of them, the others 1 each
    assert (log.items, log.seconds, tuple(log.first_window)) == (3000, 53.0, (1000, 51.0))
    assert log.throughput == 2000 / 2.0  # the two later windows alone: 1,000 items a second, not 3000 / 53


def test_a_resumed_run_leaves_out_each_launchs_start_up_and_keeps_the_earlier_speed(tmp_path, monkeypatch):
    """A relaunch that only finished wrote no throughput (and tiny_transformer an MFU of 0); then, keeping the first
    launch's first window, a resumed run counted its own start-up (compiling) as training: 3,533 samples/s against
    the 57k of its windows. Both launches here: a slow first window of 10 steps, then 1,000 items a second."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def launch(log: RunLog, steps: range) -> None:
        for step in steps:
            now[0] += 5.0 if step < steps.start + 10 else 0.1  # start-up and compiling, then 100 items in 0.1 s
            log.train(step, stats(1.0), lr=0.1, items=100)
        log.flush()

    first = RunLog(RunFolder(tmp_path / "a", None), "t", total_steps=40, every=10, write=False)
    first.start(0, {}, CPU)
    launch(first, range(1, 21))
    assert first.throughput == pytest.approx(1000.0)
    state = first.state_dict()
    for steps, expected in ((range(21, 41), 1000.0), (range(21, 21), 1000.0)):  # resumed; only finishing
        second = RunLog(RunFolder(tmp_path / "b", None), "t", total_steps=40, every=10, write=False)
        second.load_state_dict(state)
        second.start(20, {}, CPU)
        launch(second, steps)
        assert second.throughput == pytest.approx(expected)


def test_a_window_of_no_timed_step_shows_no_speed_rather_than_zero(tmp_path, monkeypatch, capsys):
    """The first step after an evaluation has no known start: it is not timed. A window of only that step (one step
    an epoch, say) and a run of only such steps say nothing of their speed, rather than 0 samples/s."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    log = RunLog(RunFolder(tmp_path, None), "t", total_steps=3, every=1, steps_per_epoch=1)
    log.start(0, {}, CPU)
    for step in range(1, 4):
        now[0] += 1.0
        log.train(step, stats(1.0), lr=0.01, items=8)
        log.eval(step, val={"loss": 0.5})
    summary = log.finish(3)
    lines = capsys.readouterr().out.strip().splitlines()[1:]
    assert lines[0].endswith("  8 samples/s  eta 0m02s")  # the first step: timed from start()
    assert lines[1].endswith("  8 samples/s")  # the throughput so far
    assert [line for line in lines[2:] if " 0 samples/s" in line] == []
    assert lines[2] == "epoch 2/3  step 2/3  loss 1.0000  lr 1.00e-02  eta 0m01s"  # the last timed window's rate
    assert summary["samples_per_s"] == pytest.approx(8.0)


def test_the_eta_counts_only_the_timed_steps_of_a_window(tmp_path, monkeypatch, capsys):
    """After an evaluation (or a save) the window's first step is not timed: a window of 10 steps timed for 9 of
    them is 9 steps' seconds, so the eta divides by 9 (it said 0m00s, or 10% too soon)."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    log = RunLog(RunFolder(tmp_path, None), "t", total_steps=100, every=10)
    log.start(0, {}, CPU)
    for step in range(1, 21):
        now[0] += 1.0  # a second a step
        log.train(step, stats(1.0), lr=0.01, items=8)
        if step == 10:
            log.eval(step, val={"loss": 0.5})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].endswith("  8 samples/s  eta 1m30s")  # 90 steps left at a second each
    assert lines[-1].endswith("  8 samples/s  eta 1m20s")

def test_spoiled_weights_are_never_saved(tmp_path):
    """A step can report a finite loss while its inf/nan gradients spoil the weights: no checkpoint of those."""
    run = Logged(tmp_path, steps=10)
    run.train(stats(0.5))
    run.checkpoints.save(run.step)
    before = (tmp_path / "checkpoints" / "last.pt").read_bytes()
    run.train(stats(0.4))
    with torch.no_grad():
        run.model[0].weight[0, 0] = float("nan")
    with pytest.raises(RecipeError, match=r"the weights hold inf/nan after step 2 \(0\.weight\); the last good"):
        run.checkpoints.save(run.step)
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == before


def can_mount_tmpfs(path: Path) -> bool:
    path.mkdir()
    return os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(path)],
                                                capture_output=True).returncode == 0


def test_a_save_that_fails_after_a_resume_names_the_checkpoint_it_resumed_from_as_intact(tmp_path, monkeypatch):
    run = Logged(tmp_path / "run", steps=10)
    run.train(stats(0.5))
    run.checkpoints.save(run.step)
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    model = tiny_model()
    resumed = ckpt.Checkpointer(RunFolder(tmp_path / "run", last, last), "t", {}, model=model,
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1), parts={"log": run.log})
    assert resumed.restore(ckpt.load_checkpoint(last, "t")) == 1

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(RecipeError, match=r"No space left on device; the previous checkpoint \(step 1\) is intact$"):
        resumed.save(2)
    run.log.writer.close()


def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    disk = tmp_path / "small-disk"
    mounted = can_mount_tmpfs(disk)
    try:
        run = Logged(disk / "run", steps=10)
        run.train(stats(0.5))
        run.checkpoints.save(run.step)  # a few KB: fits
        before = (disk / "run" / "checkpoints" / "last.pt").read_bytes()
        run.train(stats(0.4))
        if mounted:  # a real full disk: fill what is left of it
            with open(disk / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
                while True:
                    filler.write(b"x" * 1024)
        else:  # no tmpfs here: make the write fail the way a full disk does
            def no_space(*args, **kwargs):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            monkeypatch.setattr(torch, "save", no_space)
        with pytest.raises(RecipeError) as err:
            run.checkpoints.save(run.step)
        assert str(err.value) == (f"could not write checkpoint {disk / 'run' / 'checkpoints' / 'last.pt'}: No space "
                                  "left on device; the previous checkpoint (step 1) is intact")
        assert (disk / "run" / "checkpoints" / "last.pt").read_bytes() == before
        assert sorted(p.name for p in (disk / "run" / "checkpoints").iterdir()) == ["last.pt"]  # no temporary file
        run.log.writer.close()
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


def test_download_checks_the_published_checksum(tmp_path, monkeypatch):
    good = b"the published bytes\n"
    md5 = hashlib.md5(good).hexdigest()
    served = {"body": good}
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(served["body"]))
    dest = tmp_path / "data" / "file.csv"
    assert download("https://example.org/file.csv", dest, md5) == dest and dest.read_bytes() == good

    dest.write_bytes(b"altered")  # a cached file that is not the published one is fetched again
    assert download("https://example.org/file.csv", dest, md5) == dest and dest.read_bytes() == good

    served["body"] = b"a truncated or altered download"
    dest.unlink()
    with pytest.raises(RecipeError, match="downloaded with a wrong checksum"):
        download("https://example.org/file.csv", dest, md5)
    assert list(dest.parent.iterdir()) == []  # neither the file nor its .part is left behind

    def offline(url, timeout):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    dest.write_bytes(b"altered")
    with pytest.raises(RecipeError, match="exists but its checksum is not the published one.*offline"):
        download("https://example.org/file.csv", dest, md5)
    assert dest.read_bytes() == b"altered"  # what was there is left for the user to inspect


@pytest.mark.parametrize("failure", [http.client.IncompleteRead(b"par"), KeyboardInterrupt()])
def test_a_download_cut_short_leaves_no_part_file_or_new_folder(tmp_path, monkeypatch, failure):
    """A server that ends a chunked response early raises an HTTPException (not an OSError): one line, not a
    traceback. Ctrl-C or SIGTERM mid-download goes on as itself, and neither leaves a part file or folder behind."""
    class CutShort(io.BytesIO):
        def read(self, size=-1):
            raise failure

    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: CutShort())
    with pytest.raises(type(failure) if isinstance(failure, KeyboardInterrupt) else RecipeError) as raised:
        download("https://example.org/file.csv", tmp_path / "data" / "adult" / "file.csv", "0" * 32)
    if raised.type is RecipeError:
        assert "could not download https://example.org/file.csv (IncompleteRead" in str(raised.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_first_signal_asks_for_a_stop_and_the_second_quits_at_once(signum, code, capsys):
    previous = signal.getsignal(signum)
    stop = StopRequest()
    try:
        signal.raise_signal(signum)  # the handler runs now, in this thread
        assert stop.requested and "saving a checkpoint after this step" in capsys.readouterr().out
        with pytest.raises(SystemExit) as exit_:
            signal.raise_signal(signum)
        assert exit_.value.code == code
    finally:
        stop.restore()
    assert signal.getsignal(signum) is previous


def test_under_torchrun_the_same_signal_twice_is_one_request(monkeypatch, capsys, tmp_path):
    """torchrun passes on the signal it gets: under SLURM (every process SIGTERMed) each rank hears it twice, which
    must not quit without the save. Another signal still quits; a rank 0 that was not signalled (another node's
    ranks were) still says how to resume."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    stop = StopRequest()
    try:
        with pytest.raises(SystemExit) as exit_:
            stop.exit(7, tmp_path)  # agreed with another rank, not signalled here
        assert exit_.value.code == 143 and "interrupted at step 7; checkpoint saved" in capsys.readouterr().out
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # torchrun's copy
        assert stop.signal == signal.SIGTERM and "send it again" not in capsys.readouterr().out
        with pytest.raises(SystemExit) as exit_:
            signal.raise_signal(signal.SIGINT)
        assert exit_.value.code == 130
    finally:
        stop.restore()


def test_fp32_means_fp32_for_convolutions_too(tmp_path, monkeypatch):
    """cuDNN lets convolutions run in TF32 by default (10 mantissa bits on Ampere+); fp32 runs switch it off, and
    the run's config records what fp32 meant."""
    import json

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)  # PyTorch's default
    resolve_device("cpu")
    assert torch.backends.cudnn.allow_tf32 is False and torch.backends.cuda.matmul.allow_tf32 is False
    log = RunLog(RunFolder(tmp_path, None), "t", total_steps=1, every=1)
    log.start(0, {}, CPU)
    log.writer.close()
    assert json.loads((tmp_path / "config.json").read_text())["tf32"] is False


def test_loader_workers_ignore_ctrl_c_and_sigterm_which_the_main_process_handles():
    """A scheduler's SIGTERM reaches the whole process group: a worker that died of it would end a run that had
    just saved in a DataLoader traceback."""
    from common.data import make_loader

    loader = make_loader(tiny_data(), 8, train=True, num_workers=1)
    handlers = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        loader.worker_init_fn(0)  # what each worker runs first
        handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert handlers == [signal.SIG_IGN, signal.SIG_IGN]


def test_each_line_of_the_log_is_flushed_as_it_is_written(tmp_path, monkeypatch):
    """Redirected to a file (a cluster job's log), stdout is block-buffered: without a flush after each line, a
    slow run's log would show nothing for minutes, like a hung one."""
    events = []

    class Stdout(io.StringIO):
        def write(self, text):
            events.append("write")
            return super().write(text)

        def flush(self):
            events.append("flush")

    monkeypatch.setattr(sys, "stdout", Stdout())
    log = RunLog(RunFolder(tmp_path, None), "t", total_steps=2, every=1)
    for line in ("one", "two"):
        log.print(line)
        assert events[-1] == "flush"
        events.clear()


def test_a_log_file_gets_a_line_every_few_steps_in_the_format_of_the_evaluation_line(tmp_path, monkeypatch, capsys):
    """Without a terminal (a cluster job's log) a run still says every N steps where it is, how fast and when it
    will be done, flushed as written, so that a slow run reads differently from a hung one."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])  # a step takes one second
    log = RunLog(RunFolder(tmp_path, None), "t", total_steps=40, every=10, steps_per_epoch=20)
    log.start(0, {}, CPU)
    for step in range(1, 21):
        now[0] += 1.0
        log.train(step, stats(1.0 / step), lr=0.01, items=8)
    log.eval(20, val={"loss": 0.5})
    log.writer.close()
    lines = capsys.readouterr().out.strip().splitlines()[1:]  # after the header
    assert lines[0].startswith("epoch 1/2  step 10/40  loss 0.1000  lr 1.00e-02  ")
    assert lines[0].endswith("  8 samples/s  eta 0m30s")  # 30 steps left, one second each
    assert lines[1].startswith("epoch 1/2  step 20/40  loss 0.0500  ")
    assert lines[2].startswith("epoch 1/2  step 20/40  train_loss ") and "val_loss 0.5000" in lines[2]
    assert len(lines) == 3


@pytest.mark.parametrize(("device", "flags", "capability", "expected"), [
    ("cpu", {"avx512f", "avx512_bf16"}, None, ("bf16", "auto: the CPU has avx512_bf16")),
    ("cpu", {"avx512f", "amx_bf16", "avx512_bf16"}, None, ("bf16", "auto: the CPU has amx_bf16 and avx512_bf16")),
    ("cpu", {"avx512f", "avx2"}, None, ("fp32", "auto: no native bf16 matmul on this cpu")),  # AVX-512F, no BF16
    ("cuda", set(), (8, 0), ("bf16", "auto: CUDA compute capability 8.0 >= 8.0")),  # A100
    ("cuda", set(), (9, 0), ("bf16", "auto: CUDA compute capability 9.0 >= 8.0")),  # H100, H200
    ("cuda", set(), (7, 5), ("fp32", "auto: no native bf16 matmul on this cuda")),  # T4: fp16 units, never by itself
    ("mps", set(), None, ("fp32", "auto: no native bf16 matmul on this mps")),
])
def test_auto_precision_is_bf16_where_the_device_multiplies_it_natively(monkeypatch, device, flags, capability,
                                                                         expected):
    import common.runtime as runtime

    monkeypatch.setattr(runtime, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert runtime.resolve_precision("auto", torch.device(device)) == ("auto", *expected)
    assert runtime.resolve_precision("fp16", torch.device(device)) == ("fp16", "fp16", "as given")


def test_auto_precision_keeps_what_a_resumed_run_started_with(monkeypatch):
    import common.runtime as runtime

    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx512_bf16"})
    started_in_fp32 = {"config": {"precision": "fp32", "precision_used": "fp32"}}
    assert runtime.resolve_precision("auto", CPU, started_in_fp32) == ("fp32", "fp32", "as its checkpoint ran")
    assert runtime.resolve_precision("bf16", CPU, started_in_fp32) == ("bf16", "bf16", "as given")  # unless told so
    # auto stays auto through a resume, so that a replay of the resumed run's config.json chooses again
    chosen_by_auto = {"config": {"precision": "auto", "precision_used": "bf16"}}
    assert runtime.resolve_precision("auto", CPU, chosen_by_auto) == ("auto", "bf16", "as its checkpoint ran")
    older = {"config": {"precision": "bf16"}}  # written before config.json had precision_used: its precision ran
    assert runtime.resolve_precision("auto", CPU, older) == ("bf16", "bf16", "as its checkpoint ran")


def test_the_header_says_where_a_precision_came_from(run_inprocess, tmp_path):
    """A replay's precision was called "as given": a bf16 that auto chose on another machine read as the user's."""
    small = ["--max-steps", 1, "--samples", 256, "--batch-size", 128, "--width", 8, "--depth", 1, "--device", "cpu"]
    replay = ["--config", tmp_path / "default" / "config.json"]
    for run, args, why in [("default", [], "the default"), ("replay", replay, "from --config"),
                           ("given", ["--precision", "fp32"], "as given")]:
        result = run_inprocess("mixed_precision", *small, *args, "--run-dir", tmp_path / run)
        assert result.code == 0, result.stderr
        assert f"| precision fp32 ({why}) |" in result.stdout
        assert json.loads((tmp_path / run / "config.json").read_text())["precision_reason"] == why


def test_a_replay_chooses_again_where_auto_chose(run_inprocess, tmp_path, monkeypatch):
    """A config.json from a CPU with native bf16 replayed bf16 on one without, where it is emulated and slow: what
    auto chose is auto again on replay, and a precision given to the replay still wins."""
    import common.runtime as runtime

    small = ["--max-steps", 1, "--samples", 256, "--batch-size", 128, "--width", 8, "--depth", 1, "--device", "cpu"]
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx512_bf16"})
    there = run_inprocess("mixed_precision", *small, "--precision", "auto", "--run-dir", tmp_path / "there")
    assert there.code == 0 and "| precision bf16 (auto: the CPU has avx512_bf16) |" in there.stdout, there.stdout
    small[1] = 2  # resumed there without --precision: its config.json still says auto, beside what auto chose
    resumed = run_inprocess("mixed_precision", *small, "--resume", "auto", "--run-dir", tmp_path / "there")
    assert resumed.code == 0 and "| precision bf16 (as its checkpoint ran) |" in resumed.stdout, resumed.stdout
    config = json.loads((tmp_path / "there" / "config.json").read_text())
    assert (config["precision"], config["precision_used"]) == ("auto", "bf16")
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx2"})
    replay = ["--config", tmp_path / "there" / "config.json"]
    here = run_inprocess("mixed_precision", *small, *replay, "--run-dir", tmp_path / "here")
    assert here.code == 0 and "| precision fp32 (auto: no native bf16 matmul on this cpu) |" in here.stdout
    given = run_inprocess("mixed_precision", *small, *replay, "--precision", "bf16", "--run-dir", tmp_path / "given")
    assert given.code == 0 and "| precision bf16 (as given) |" in given.stdout


GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop \
sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
"""


def test_an_arm_cpu_with_bf16_multiplies_it_natively(tmp_path, monkeypatch):
    """Arm lists its features under "Features", not "flags": a Graviton3 (BF16) was told "no native bf16 matmul on
    this cpu: emulated, it would be slower" by the doctor, and auto chose fp32 there."""
    import common.runtime as runtime

    (tmp_path / "cpuinfo").write_text(GRAVITON3)
    flags = runtime.cpu_flags(tmp_path / "cpuinfo")
    assert {"asimd", "sve", "bf16"} <= flags
    monkeypatch.setattr(runtime, "cpu_flags", lambda: flags)
    assert runtime.resolve_precision("auto", CPU) == ("auto", "bf16", "auto: the CPU has bf16")
    monkeypatch.setattr(runtime, "cpu_flags", lambda: flags - {"bf16", "svebf16"})  # a Graviton2's: no BF16
    assert runtime.resolve_precision("auto", CPU) == ("auto", "fp32", "auto: no native bf16 matmul on this cpu")


def test_this_machines_cpu_flags_are_read():
    from common.runtime import cpu_flags

    if not Path("/proc/cpuinfo").is_file():
        pytest.skip("no /proc/cpuinfo")
    assert "fpu" in cpu_flags() or "sse2" in cpu_flags() or "asimd" in cpu_flags()


def test_accumulation_skips_the_all_reduce_of_a_compiled_ddp_model_too(tmp_path, monkeypatch):
    """Under --compile the DDP module is inside torch.compile's wrapper: train_step still finds it, so only the
    last micro-batch's backward all-reduces (no_sync around the others)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    entered = []
    no_sync = DistributedDataParallel.no_sync
    monkeypatch.setattr(DistributedDataParallel, "no_sync", lambda self: entered.append(1) or no_sync(self))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for compiled in (False, True):
            entered.clear()
            model = DistributedDataParallel(nn.Linear(4, 2))
            model = torch.compile(model, backend="eager") if compiled else model
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            batches = [(torch.randn(3, 4), torch.randint(2, (3,))) for _ in range(4)]
            train_step(model, optimizer, nn.CrossEntropyLoss(), batches, device=torch.device("cpu"))
            assert len(entered) == 3, compiled  # 4 micro-batches: the first three accumulate without syncing
    finally:
        dist.destroy_process_group()


def sigterm_to_self():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler runs at once; the run is not left to time out


@pytest.mark.parametrize(("raised", "code"), [(KeyboardInterrupt, 130), (lambda: __import__("typer").Exit(3), 3),
                                              (sigterm_to_self, 143)])
def test_ctrl_c_before_training_exits_130_not_0(raised, code, tmp_path):
    """Before a StopRequest listens, Ctrl-C reaches typer, which returns 130 instead of raising it; so does any
    typer.Exit. run_recipe exits with that status, after the command's clean-ups (here: the run directory)."""
    from common.cli import run_recipe

    def main(run_dir: Path = Path("unused")):
        open_run_dir("test", run_dir, None)
        raise raised()

    with pytest.raises(SystemExit) as exit_:
        run_recipe(main, ["--run-dir", str(tmp_path / "run")])
    assert exit_.value.code == code
    assert not (tmp_path / "run").exists()  # released and removed: it held no checkpoint
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # as it was before the command


@pytest.mark.parametrize("failure", ["peer lost", "peer lost, then torchrun's SIGTERM", "peer lost after a Ctrl-C",
                                     "bug", "timeout"])
def test_a_collective_whose_peer_died_is_one_line_and_any_other_runtime_error_a_traceback(failure, tmp_path, capsys):
    """Under torchrun, a worker killed (or out of memory) leaves the others failing in their next collective: that is
    one line on the survivors, not their tracebacks. A RuntimeError of any other kind is a bug and keeps its own, a
    collective's timeout too (ranks out of step: the traceback shows where). torchrun SIGTERMs the survivors, which
    may hear it before the collective fails (a DataLoader worker holds the dead peer's socket open): that was
    "interrupted: the step failed as the signal reached its helpers too", exit 143."""
    import torch.distributed as dist

    from common.cli import run_recipe

    raised = {"peer lost": RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed "
                                        "by peer [127.0.0.1]:21633. This is typically caused by a remote worker "
                                        "crashing."),
              "bug": RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
              "timeout": dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)")}

    raised["peer lost, then torchrun's SIGTERM"] = raised["peer lost after a Ctrl-C"] = raised["peer lost"]

    def main(run_dir: Path = Path("unused")):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        if failure.endswith(("SIGTERM", "Ctrl-C")):
            StopRequest()  # the recipe's, listening
            signal.raise_signal(signal.SIGTERM if failure.endswith("SIGTERM") else signal.SIGINT)  # heard: "saving ..."
        raise raised[failure]

    if failure.endswith("Ctrl-C"):  # a terminal's reaches every rank, and the peer went with it: interrupted
        with pytest.raises(SystemExit) as exit_:
            run_recipe(main, [])
        assert exit_.value.code == 130 and capsys.readouterr().err == ""
        return
    if not failure.startswith("peer lost"):
        with pytest.raises(RuntimeError) as error:
            run_recipe(main, [])
        assert error.value is raised[failure] and not dist.is_initialized()  # destroyed on this way out too
        return
    with pytest.raises(SystemExit) as exit_:
        run_recipe(main, [])
    assert exit_.value.code == 1 and not dist.is_initialized()
    assert capsys.readouterr().err == ("error: another process of this run stopped (Connection closed by peer "
                                       "[127.0.0.1]:21633): torchrun's report names it; with --max-restarts the group "
                                       "resumes from the last checkpoint\n")


@pytest.mark.parametrize("filename, shown", [(b"run/events.out.tfevents.1", ": run/events.out.tfevents.1"),
                                              ("run/config.json", ": run/config.json"), (None, "")])
def test_an_os_error_no_piece_reported_is_one_line_naming_its_file_as_text(filename, shown, capsys):
    """TensorBoard's writer names its events file in bytes: the line said "No space left on device: b'run/...'"."""
    from common.cli import run_recipe

    def main(run_dir: Path = Path("unused")):
        raise OSError(28, "No space left on device", filename)

    with pytest.raises(SystemExit) as exit_:
        run_recipe(main, [])
    assert exit_.value.code == 1
    assert capsys.readouterr().err == f"error: No space left on device{shown} (any checkpoint written is intact)\n"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_step_that_fails_because_the_stop_signal_reached_its_helpers_too_is_an_interruption(signum, capsys):
    """A terminal's Ctrl-C goes to the whole group: to torch.compile's C++ compiler too, whose death failed the
    compile. The run ended "error: torch.compile cannot compile the model here" (exit 1), not as interrupted."""
    from common.cli import run_recipe

    class CppCompileError(RuntimeError):
        pass

    def main(run_dir: Path = Path("unused")):
        StopRequest()  # the recipe's, listening
        signal.raise_signal(signum)  # heard: "saving a checkpoint after this step" ...
        failed = RuntimeError("backend='inductor' raised: CppCompileError: C++ compile error")  # ... but the step
        failed.inner_exception = CppCompileError("C++ compile error")  # fails, as Dynamo wraps the compiler's
        raise failed

    previous = signal.getsignal(signum)
    with pytest.raises(SystemExit) as exit_:
        run_recipe(main, [])
    out, err = capsys.readouterr()
    assert exit_.value.code == 128 + signum and err == ""
    assert out.endswith("interrupted: the step failed as the signal reached its helpers too (backend='inductor' "
                        "raised: CppCompileError: C++ compile error); nothing saved since the last checkpoint\n")
    assert signal.getsignal(signum) == previous  # the command's clean-ups ran


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--epochs", "0"], 2, "Invalid value for '--epochs': Input should be greater than or equal to 1"),
    (["--resume", "{tmp}/none.pt"], 1, "checkpoint {tmp}/none.pt does not exist"),
])
def test_torchruns_report_quotes_the_error_usage_errors_too(run_inprocess, tmp_path, monkeypatch, args, code, message):
    """torchrun's report of a failed worker quotes TORCHELASTIC_ERROR_FILE; a usage error wrote none (<N/A> there)."""
    import json

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    result = run_inprocess("mixed_precision", *[a.format(tmp=tmp_path) for a in args], "--run-dir", tmp_path / "run")
    assert result.code == code
    written = json.loads((tmp_path / "error.json").read_text())["message"]
    assert written["message"] == message.format(tmp=tmp_path) == written["extraInfo"]["py_callstack"]


def test_out_of_memory_is_one_line_saying_what_to_shrink(run_inprocess, tmp_path, capsys):
    """A model or batch too big for the machine is a runtime problem its user caused: one line, not a traceback."""
    from common.cli import run_recipe

    # 3 PB of weights: past any machine's address space, so refused at once whatever its memory and overcommit
    result = run_inprocess("mixed_precision", "--width", 10**12, "--run-dir", tmp_path / "run")
    assert result.code == 1 and not (tmp_path / "run").exists()
    assert result.stderr == ("error: out of memory (allocating 2,920,627.6 GiB more); try a smaller --batch-size, "
                             "model or data set\n")
    for option in ("--width", "--samples"):  # past int64: torch's "Overflow when unpacking long" was a traceback
        result = run_inprocess("mixed_precision", option, 10**20, "--run-dir", tmp_path / "run")
        assert result.code == 1 and not (tmp_path / "run").exists()
        assert result.stderr == "error: out of memory; try a smaller --batch-size, model or data set\n"

    def windows(run_dir: Path = Path("unused")):  # as a CPU on Windows says it (a RuntimeError of its own words)
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: you "
                           "tried to allocate 4000000000 bytes.")

    with pytest.raises(SystemExit) as exit_:
        run_recipe(windows, [])
    assert capsys.readouterr().err == "error: out of memory (allocating 3.7 GiB more); try a smaller --batch-size, " \
                                      "model or data set\n"

    def main(run_dir: Path = Path("unused")):  # as a GPU says it
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
                                     "79.15 GiB of which 3.31 MiB is free.")

    with pytest.raises(SystemExit) as exit_:
        run_recipe(main, [])
    assert exit_.value.code == 1
    assert capsys.readouterr().err == "error: out of memory (allocating 20.00 MiB more); try a smaller --batch-size, " \
                                      "model or data set\n"


def test_the_training_data_checksum_tells_other_data_apart():
    images, labels = torch.rand(64, 1, 28, 28), torch.randint(10, (64,))
    same = checksum(images.clone(), labels.clone())
    assert checksum(images, labels) == same and len(same) == 8
    changed = images.clone()
    changed[5, 0, 3, 3] += 1e-3
    assert checksum(changed, labels) != same  # one pixel
    assert checksum(images, labels.flip(0)) != same  # the same labels in another order
    assert checksum(images[:, 0].transpose(1, 2), labels) != checksum(images[:, 0], labels)  # a view: its values


def test_a_disk_turned_read_only_under_a_json_file_is_one_error(tmp_path, monkeypatch):
    """Writing metrics.json where the disk turned read-only: removing the temporary file fails too (EROFS, even for a
    file that was never made), which was a traceback in place of the one-line error."""
    from common.rundir import write_json

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "write_text", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(RecipeError, match=r"^could not write .*metrics.json: Read-only file system$"):
        write_json(tmp_path / "metrics.json", {"steps": 1})


def test_a_signal_while_a_json_file_is_written_leaves_the_old_one_and_no_temporary_file(tmp_path, monkeypatch):
    """SIGTERM's exit (a SystemExit) in the middle of writing metrics.json left .metrics.json.tmp in the run folder:
    only an OSError removed it."""
    import common.rundir

    path = tmp_path / "metrics.json"
    common.rundir.write_json(path, {"steps": 1})

    def signalled(*args):
        raise SystemExit(143)

    monkeypatch.setattr(common.rundir.os, "replace", signalled)
    with pytest.raises(SystemExit) as exit_:
        common.rundir.write_json(path, {"steps": 2})
    assert exit_.value.code == 143 and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]
    assert json.loads(path.read_text()) == {"steps": 1}


def test_an_infinite_option_in_config_json_replays_as_itself(tmp_path):
    """--max-grad-norm inf (no clipping) is written as Infinity, which --config reads back as inf: as null it would
    replay as the option's default, clipping at 1.0."""
    from common.rundir import write_json

    write_json(tmp_path / "config.json", {"max_grad_norm": math.inf})
    assert json.loads((tmp_path / "config.json").read_text()) == {"max_grad_norm": math.inf}


def test_sums_over_a_data_set_are_float64_except_on_mps_which_has_none():
    """evaluate's (and ddp_mlp's) totals: float64 on an MPS device raises TypeError at the first evaluation."""
    from common.loop import sum_dtype

    assert sum_dtype(torch.device("cpu")) == sum_dtype(torch.device("cuda")) == torch.float64
    assert sum_dtype(torch.device("mps")) == torch.float32


def test_a_checkpoint_is_saved_where_a_folder_cannot_be_opened_as_a_file(monkeypatch, tmp_path):
    """Windows: os.open of a folder is PermissionError, which stopped every run at its first checkpoint."""
    import common.checkpoint as checkpoint

    real_open = os.open

    def windows_open(path, flags, *args):
        if Path(path).is_dir():
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(checkpoint.os, "open", windows_open)
    checkpoint.save_checkpoint(tmp_path / "last.pt", {"step": 3})
    assert torch.load(tmp_path / "last.pt", weights_only=True) == {"step": 3}


def test_the_core_imports_without_unix_only_modules():
    """Windows has no `resource` (nor fcntl, imported where the lock is taken): an import of it ended the recipe."""
    code = "import sys; sys.modules['resource'] = sys.modules['fcntl'] = None; import common.resources, common.rundir"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("body", "code", "line"), [
    ("pass", 0, None),
    ("raise cli.RecipeError('it went wrong')", 1, "error: it went wrong"),
    ("raise typer.BadParameter('not so', param_hint='--x')", 2, "Invalid value for --x: not so"),
    ("sys.exit(143)", 143, None),  # a stop request's exit
])
def test_a_torchrun_worker_leaves_without_interpreter_shutdown_whatever_its_exit(body, code, line, tmp_path):
    """Shutdown with gloo's threads alive now and then aborted a rank (SIGABRT: 1 launch in 9 of a diverging ddp_mlp
    run), which torchrun reports as a crash. Clean exits skipped it already; errors, usage errors and stops went
    through it. A handler registered with atexit runs only in a shutdown."""
    script = tmp_path / "worker.py"
    script.write_text(f"import atexit, sys\nsys.path.insert(0, {str(ROOT)!r})\nimport typer\nfrom common import cli\n"
                      "atexit.register(lambda: print('shutdown ran', flush=True))\n"
                      f"def main(x: int = 0):\n    {body}\ncli.run_recipe(main, [])\n")
    alone = [({}, True)] if body == "pass" else []  # (outside torchrun the handler runs: the script can tell)
    for env, shutdown in [({"TORCHELASTIC_RUN_ID": "t"}, False), *alone]:
        result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120,
                                env={k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"} | env)
        assert result.returncode == code, result.stderr
        assert ("shutdown ran" in result.stdout) is shutdown, (env, result.stdout)
        assert line is None or line in result.stderr, result.stderr


def test_a_torchrun_worker_that_ends_on_an_error_takes_its_loader_processes_with_it(tmp_path):
    """Interpreter shutdown ended a DataLoader's worker processes (daemons, which a traceback kept referenced);
    os._exit skips it: they outlived the rank (4 of them, half a minute) until it killed them."""
    script = tmp_path / "worker.py"
    script.write_text(f"import multiprocessing, signal, sys, time\nsys.path.insert(0, {str(ROOT)!r})\n"
                      "from common import cli\n"
                      "def loader_worker():  # as common.data's: the main process alone answers SIGTERM\n"
                      "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    time.sleep(60)\n"
                      "def main(x: int = 0):\n    worker = multiprocessing.Process(target=loader_worker, daemon=True)\n"
                      f"    worker.start()\n    open({str(tmp_path / 'pid')!r}, 'w').write(str(worker.pid))\n"
                      "    raise cli.RecipeError('it went wrong')\n"
                      "if __name__ == '__main__':\n    cli.run_recipe(main, [])\n")
    with open(tmp_path / "err", "w") as err:  # a file, not a pipe: the loader process would hold a pipe open
        code = subprocess.run([sys.executable, script], stdout=subprocess.DEVNULL, stderr=err, timeout=120,
                              env=os.environ | {"TORCHELASTIC_RUN_ID": "t"}).returncode
    assert code == 1 and (tmp_path / "err").read_text() == "error: it went wrong\n"
    pid = int((tmp_path / "pid").read_text())
    status = Path(f"/proc/{pid}/status")
    deadline = time.monotonic() + 5
    while status.exists() and "State:\tZ" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not status.exists() or "State:\tZ" in status.read_text()  # gone, or a zombie not yet reaped
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(("saved", "here", "how"), [
    (2, 1, " in 2 processes in all (torchrun's --nnodes x --nproc_per_node), or start afresh"),
    (1, 2, " in one process (plain python), or start afresh"),
    (2, 2, ", or start afresh")])
def test_a_changed_option_refused_says_how_many_processes_to_resume_in(saved, here, how):
    """The refusal names the launch the checkpoint needs where the process count differs too: a per-process
    batch, saved at 2 x 16, read as another option at 1 x 16."""
    checkpoint = {"config": {"lr": 0.1, "batch_size": 16, "world_size": saved}}
    with pytest.raises(RecipeError) as refused:
        ckpt.check_same_run(checkpoint, Path("last.pt"), {"lr": 0.2, "batch_size": 16, "world_size": here})
    message = str(refused.value)  # (outside a command the options are named by their keys: lr, world size)
    assert message.startswith("checkpoint last.pt was started with other options (lr 0.1 there, 0.2 here")
    assert message.endswith(f"): resume with the options it was started with{how} in another --run-dir"), message


@pytest.mark.parametrize(("saved", "message"), [
    ({"lr": 0.1}, "(it records no augment (True here); it records no world size (2 here)): use that version, or "),
    ({"lr": 0.1, "augment": True, "world_size": 2, "ema_decay": 0.9, "compare_all": False}, "(it has compare all "
     "False, which this version lacks; it has ema decay 0.9, which this version lacks): use that version, or "),
    ({"lr": 0.2, "world_size": 1, "ema_decay": 0.9}, "(it records no augment (True here); it has ema decay 0.9, "
     "which this version lacks; lr 0.2 there, 0.1 here; world size 1 there, 2 here): use that version, or ")])
def test_an_option_recorded_on_one_side_alone_is_said_to_be_another_version_s(saved, message):
    """An older version's checkpoint (or one from a copy before an option was added or removed) said "--augment
    None there, True here" and "resume with the options it was started with in None processes": advice no value of
    any option could follow."""
    with pytest.raises(RecipeError) as refused:
        ckpt.check_same_run({"config": saved}, Path("last.pt"), {"lr": 0.1, "augment": True, "world_size": 2})
    assert str(refused.value) == f"checkpoint last.pt was started by another version of this recipe {message}" \
        "start afresh in another --run-dir"

"""recipes/tiny_transformer.py scaled out under torchrun on CPU with gloo: DDP and FSDP2 end with the weights of
one process, sharded (DCP) checkpoints resume at another world size, a killed worker and a lost node finish
with the same weights, and FSDP holds about 1/N of the model state per rank."""

import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    ROOT,
    TORCHRUN,
    assert_same_weights,
    load_recipe,
    load_weights,
    read_metrics,
    read_scalars,
    run_torchrun,
    worker_pids,
)

RECIPE = "recipes/tiny_transformer.py"
# A tiny model (2 layers, 32 wide, block 16); lr high enough, and clipping tight enough, that the weights move
# and clipping acts: a gradient summed instead of averaged over the ranks (pytorch/pytorch#162338) shows up.
TINY = ["--steps", 6, "--eval-every", 3, "--n-layer", 2, "--n-head", 2, "--n-embd", 32, "--block-size", 16,
        "--eval-batches", 2, "--sample-tokens", 8, "--peak-flops", 1e11, "--warmup-steps", 2, "--lr", 1e-2,
        "--max-grad-norm", 0.5, "--precision", "fp32"]  # the same weights at any world size: fp32 rounds alike
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # float rounding: a mean of 16 rows against the mean of two means of 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_close_weights(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        torch.testing.assert_close(a[key], b[key], **TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")
        worst = max(worst, (a[key] - b[key]).abs().max().item())
    print(f"largest weight difference {worst:.2e}")
    return worst


def grad_norms(run_dir: Path) -> list[float]:
    return [value for _, value in read_scalars(run_dir)["train/grad_norm"]]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus_txt):
    """The reference: one process, global batch 16, 6 steps."""
    from conftest import run_subprocess

    run_dir = tmp_path_factory.mktemp("one") / "run"
    result = run_subprocess([RECIPE, "--text", corpus_txt, *TINY, "--batch-size", 16, "--run-dir", run_dir])
    assert result.code == 0, result.stderr
    return run_dir


def test_a_ddp_run_of_three_processes_stopped_and_resumed_ends_with_the_weights_of_one_never_stopped(corpus_txt,
                                                                                                   tmp_path):
    """DDP buckets the gradients in parameter order, then after the first backward in the order they came. A resumed
    run reduced its first step in the first buckets, while an unbroken one was past them: with three ranks the sums
    round otherwise (4e-8 apart here; two ranks add a + b alike in any order, which is why no 2-rank test saw it)."""
    args = ["--nproc_per_node=3", RECIPE, "--text", corpus_txt, *TINY, "--batch-size", 4, "--parallel", "ddp",
            "--resume", "auto"]
    assert run_torchrun([*args, "--run-dir", tmp_path / "ref"]).code == 0
    stopped = run_torchrun([*args, "--run-dir", tmp_path / "run", "--max-steps", 2])
    assert stopped.code == 0, stopped.stderr
    resumed = run_torchrun([*args, "--run-dir", tmp_path / "run"])
    assert resumed.code == 0, resumed.stderr
    assert_same_weights(load_weights(tmp_path / "ref" / "checkpoints" / "last.pt"),
                        load_weights(tmp_path / "run" / "checkpoints" / "last.pt"))


def test_a_sharded_run_s_best_pt_holds_its_best_step_s_weights_when_that_is_not_the_last(corpus_txt, tmp_path):
    """best.pt of an FSDP run is one file made at the end from its best step's folder. In the tests beside this one
    the best step is the last, so a best.pt made from the last folder passed them unseen."""
    from conftest import run_subprocess

    # the rate warms up to 0.3 until step 5, past what the model takes: the validation loss rises after step 3
    overshoot = [*TINY, "--batch-size", 8]
    overshoot[overshoot.index("--lr") + 1], overshoot[overshoot.index("--warmup-steps") + 1] = 0.3, 5
    result = run_torchrun(["--nproc_per_node=1", RECIPE, "--text", corpus_txt, *overshoot, "--parallel", "fsdp",
                           "--run-dir", tmp_path / "fsdp"])
    assert result.code == 0, result.stderr
    best = torch.load(tmp_path / "fsdp" / "checkpoints" / "best.pt", weights_only=True)
    assert best["step"] == read_metrics(tmp_path / "fsdp")["best_step"] == 3
    # step 3's weights, from one plain process stopped there (the schedule is --steps', so it is the same run)
    result = run_subprocess([RECIPE, "--text", corpus_txt, *overshoot, "--max-steps", 3, "--run-dir", tmp_path / "one"])
    assert result.code == 0, result.stderr
    assert_close_weights(load_weights(tmp_path / "one" / "checkpoints" / "last.pt"), best["model"])


@pytest.mark.parametrize("parallel, per_rank", [("ddp", ["--batch-size", 4, "--grad-accum", 2]),
                                                 ("fsdp", ["--batch-size", 8])])
def test_two_ranks_end_with_the_weights_of_one_process(parallel, per_rank, one_process, corpus_txt, tmp_path):
    run_dir = tmp_path / parallel
    result = run_torchrun(["--nproc_per_node=2", RECIPE, "--text", corpus_txt, *TINY, *per_rank,
                           "--parallel", parallel, "--run-dir", run_dir])
    assert result.code == 0, result.stderr
    wrapper = {"ddp": "DistributedDataParallel", "fsdp": "FSDPGPT"}[parallel]
    assert f"parallel {parallel}: {wrapper} | global batch 16 (2 x " in result.stdout
    metrics = read_metrics(run_dir)
    assert metrics["world_size"] == 2 and metrics["steps"] == 6
    # MFU: the tokens of both ranks over the peak of both ranks' devices (--peak-flops each), not of one
    gpt = load_recipe("tiny_transformer")
    flops_per_token = gpt.GPT(gpt.GPTConfig(256, block_size=16, n_layer=2, n_head=2, n_embd=32)).flops_per_token()
    assert metrics["mfu"] == pytest.approx(flops_per_token * metrics["tokens_per_s"] / (1e11 * 2), rel=1e-6)
    # the same gradient norms (so averaged, not summed, across ranks; and clipped as a whole under FSDP)...
    reference_norms = grad_norms(one_process)
    assert max(reference_norms) > 0.5  # clipping acted
    torch.testing.assert_close(grad_norms(run_dir), reference_norms, rtol=1e-4, atol=1e-6)
    # ...and the same weights (under FSDP, last.pt is made from the final sharded checkpoint)
    assert_close_weights(load_weights(one_process / "checkpoints" / "last.pt"),
                         load_weights(run_dir / "checkpoints" / "last.pt"))
    assert read_metrics(run_dir)["val_loss"] == pytest.approx(read_metrics(one_process)["val_loss"], rel=1e-5)
    # the training loss logged is the whole global batch's, as in one process (not rank 0's half of it)
    torch.testing.assert_close([v for _, v in read_scalars(run_dir)["train/loss"]],
                               [v for _, v in read_scalars(one_process)["train/loss"]], rtol=1e-5, atol=0)

    if parallel == "fsdp":
        # Each rank holds half of the weights, gradients and AdamW state: the account counts local shards.
        sharded, whole = (read_metrics(d)["memory"] for d in (run_dir, one_process))
        for part in ("weight_bytes", "gradient_bytes", "optimizer_state_bytes", "model_state_bytes"):
            ratio = sharded[part] / whole[part]
            print(f"{part}: {sharded[part]} per rank at 2 ranks, {whole[part]} in one process ({ratio:.3f}x)")
            assert whole[part] > 0 and ratio <= 0.55, part
        steps = sorted(p.name for p in (run_dir / "checkpoints" / "dcp").iterdir())
        assert steps == ["step-000003", "step-000006"]  # complete ones only, no temporary folder left
        assert sorted(p.name for p in (run_dir / "checkpoints" / "dcp" / "step-000006").iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp", "trainer.pt"]  # each rank wrote its shard
        # best.pt, one file made at the end from the best step's folder: that step's weights
        best, last = (torch.load(run_dir / "checkpoints" / name, weights_only=True) for name in ("best.pt", "last.pt"))
        assert best["step"] == read_metrics(run_dir)["best_step"] in (3, 6) and last["step"] == 6
        same = all(torch.equal(best["model"][k], last["model"][k]) for k in last["model"])
        assert same == (best["step"] == 6)


@pytest.mark.parametrize("parallel, wrapper", [("ddp", "DistributedDataParallel"), ("fsdp", "FSDPGPT")])
def test_one_process_under_torchrun_wraps_for_real(parallel, wrapper, one_process, corpus_txt, tmp_path):
    """A one-GPU machine (the GPU check's) runs DDP and FSDP at world size 1: the group and the wrap are real."""
    result = run_torchrun(["--nproc_per_node=1", RECIPE, "--text", corpus_txt, *TINY, "--batch-size", 16,
                           "--parallel", parallel, "--run-dir", tmp_path / "run"])
    assert result.code == 0, result.stderr
    assert f"parallel {parallel}: {wrapper} | global batch 16 (1 x 16 x 1)" in result.stdout
    assert_close_weights(load_weights(one_process / "checkpoints" / "last.pt"),
                         load_weights(tmp_path / "run" / "checkpoints" / "last.pt"))


def test_the_ejected_transformer_runs_sharded_under_torchrun_to_the_same_weights(one_process, corpus_txt, tmp_path):
    """scripts/eject.py's copy of the recipe, without common/, is still the whole recipe: FSDP2 and DCP included."""
    from conftest import run_subprocess

    script, run_dir = tmp_path / "train.py", tmp_path / "run"
    assert run_subprocess(["scripts/eject.py", "tiny_transformer", script]).code == 0
    result = run_torchrun(["--nproc_per_node=2", script, "--text", corpus_txt, *TINY, "--batch-size", 8,
                           "--parallel", "fsdp", "--run-dir", run_dir])
    assert result.code == 0, result.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints" / "dcp").iterdir()) == ["step-000003", "step-000006"]
    assert_close_weights(load_weights(one_process / "checkpoints" / "last.pt"),
                         load_weights(run_dir / "checkpoints" / "last.pt"))


def test_fsdp_bf16_computes_in_bf16_reduces_in_fp32_and_keeps_fp32_weights(one_process, corpus_txt, tmp_path):
    """--precision bf16 under FSDP2: MixedPrecisionPolicy gathers bf16 copies of the weights for compute and
    reduces gradients in fp32; the sharded master weights (and so the checkpoint) stay fp32. Against the fp32
    run of one process, the gradient norms agree to bf16's precision (a sum over the ranks instead of a mean
    would double them) and the weights end close but not equal (they were computed in bf16)."""
    run_dir = tmp_path / "fsdp_bf16"
    result = run_torchrun(["--nproc_per_node=2", RECIPE, "--text", corpus_txt, *TINY, "--batch-size", 8,
                           "--parallel", "fsdp", "--precision", "bf16", "--run-dir", run_dir])
    assert result.code == 0, result.stderr
    assert read_metrics(run_dir)["world_size"] == 2 and read_metrics(run_dir)["steps"] == 6
    torch.testing.assert_close(grad_norms(run_dir), grad_norms(one_process), rtol=0.05, atol=0)
    weights, reference = (load_weights(d / "checkpoints" / "last.pt") for d in (run_dir, one_process))
    assert {w.dtype for w in weights.values()} == {torch.float32}  # fp32 master weights
    differences = [(weights[k] - reference[k]).abs().max().item() for k in reference]
    print(f"grad norms {grad_norms(run_dir)} vs fp32 {grad_norms(one_process)}; largest weight difference "
          f"{max(differences):.2e}")
    assert 1e-4 < max(differences) < 5e-2  # bf16 compute: moved off the fp32 path, but not far
    assert read_metrics(run_dir)["val_loss"] == pytest.approx(read_metrics(one_process)["val_loss"], rel=0.02)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fsdp_shards_every_block_and_the_root_with_the_precision_policy(precision, monkeypatch):
    """The run above cannot tell an fp32 gradient reduction from a bf16 one within its tolerances: the policy can."""
    gpt, sharded = load_recipe("tiny_transformer"), []
    monkeypatch.setattr(gpt, "init_device_mesh", lambda kind, shape: ("mesh", kind, shape))
    monkeypatch.setattr(gpt, "fully_shard", lambda module, mesh, mp_policy: sharded.append((module, mesh, mp_policy)))
    model = gpt.GPT(gpt.GPTConfig(256, block_size=16, n_layer=2, n_head=2, n_embd=32))
    gpt.shard_model(model, torch.device("cpu"), 2, precision)
    assert [module for module, _, _ in sharded] == [*model.blocks, model]
    assert {mesh for _, mesh, _ in sharded} == {("mesh", "cpu", (2,))}
    policies = {(p.param_dtype, p.reduce_dtype) for _, _, p in sharded}
    assert policies == ({(torch.bfloat16, torch.float32)} if precision == "bf16" else {(None, None)})


def test_sharded_checkpoint_resumes_at_another_world_size(run_inprocess, one_process, corpus_txt, tmp_path):
    """1 process to step 2, 2 ranks to step 4, 1 process to step 6: the weights of a run that never stopped."""
    run_dir = tmp_path / "run"
    args = ["--text", corpus_txt, *TINY, "--parallel", "fsdp", "--global-batch", 16, "--checkpoint-every", 1,
            "--run-dir", run_dir, "--resume", "auto"]
    first = run_inprocess("tiny_transformer", *args, "--max-steps", 2)
    assert first.code == 0, first.stderr
    dcp_dir = run_dir / "checkpoints" / "dcp"
    assert (dcp_dir / "step-000002" / ".metadata").is_file()

    shutil.copy(run_dir / "checkpoints" / "last.pt", tmp_path / "step2.pt")  # the single file finish() left

    second = run_torchrun(["--nproc_per_node=2", RECIPE, *args, "--max-steps", 4])
    assert second.code == 0, second.stderr
    assert "resumed at step 2" in second.stdout and "global batch 16 (2 x 8 x 1)" in second.stdout
    # the last complete ones are kept; older ones deleted
    assert sorted(p.name for p in dcp_dir.iterdir()) == ["step-000002", "step-000003", "step-000004"]

    # The single file of step 2, resumed at 2 ranks in another folder, gives each rank its shards: the same weights.
    from_file = run_torchrun(["--nproc_per_node=2", RECIPE, *args[:-4], "--run-dir", tmp_path / "from_file",
                              "--resume", tmp_path / "step2.pt", "--max-steps", 4])
    assert from_file.code == 0 and "resumed at step 2" in from_file.stdout, from_file.stderr[-2000:]
    assert_close_weights(load_weights(run_dir / "checkpoints" / "last.pt"),
                         load_weights(tmp_path / "from_file" / "checkpoints" / "last.pt"))

    # A save cut short (never renamed) and a step folder copied in part are both passed over, with a warning.
    (dcp_dir / ".step-000005.tmp").mkdir()
    (dcp_dir / ".step-000005.tmp" / "__0_0.distcp").write_bytes(b"half")
    shutil.copytree(dcp_dir / "step-000004", dcp_dir / "step-000005")  # all but a shard (it was taken as complete)
    (dcp_dir / "step-000005" / "__1_0.distcp").unlink()
    third = run_inprocess("tiny_transformer", *args)
    assert third.code == 0, third.stderr
    assert "resumed at step 4" in third.stdout
    assert "step-000005 is incomplete (its __1_0.distcp is missing)" in third.stderr
    assert ".step-000005.tmp is a save that never finished" in third.stderr
    assert read_metrics(run_dir)["steps"] == 6
    assert_close_weights(load_weights(one_process / "checkpoints" / "last.pt"),
                         load_weights(run_dir / "checkpoints" / "last.pt"))

    # Sampling works from the single file and from a sharded folder, in one process, with the same text.
    samples = [run_inprocess("tiny_transformer", "--sample-only", "--resume", path, "--sample-tokens", 20)
               for path in (run_dir / "checkpoints" / "last.pt", dcp_dir / "step-000006")]
    assert all(s.code == 0 for s in samples), [s.stderr for s in samples]
    assert samples[0].stdout == samples[1].stdout and len(samples[0].stdout) > 10

    # Relaunched once finished: nothing trained, nothing overwritten.
    files = {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    again = run_inprocess("tiny_transformer", *args)
    assert again.code == 0 and "already finished" in again.stdout
    assert {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()} == files


class RunsCode:
    """A pickle that, unpickled, creates ``path``: what a hostile checkpoint's .metadata would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_bad_input_to_a_sharded_run(run_inprocess, corpus_txt, tmp_path, capsys):
    bad = run_inprocess("tiny_transformer", "--parallel", "zero", "--text", corpus_txt)
    assert bad.code == 2 and "--parallel" in bad.stderr

    run_dir = tmp_path / "run"
    args = ["--text", corpus_txt, *TINY, "--parallel", "fsdp", "--batch-size", 8, "--max-steps", 3]
    assert run_inprocess("tiny_transformer", *args, "--run-dir", run_dir).code == 0
    step = run_dir / "checkpoints" / "dcp" / "step-000003"
    from scripts import export  # its trainer.pt was "not a checkpoint of a recipe of this project"

    assert export.main([str(step / "trainer.pt"), str(tmp_path / "exported")]) == 1
    assert capsys.readouterr().err == f"error: {step / 'trainer.pt'} holds a sharded checkpoint's training state, " \
                                      f"not its weights: pass its folder, {step}\n"

    # a fresh run over existing sharded checkpoints would overwrite them: refused
    fresh = run_inprocess("tiny_transformer", *args, "--run-dir", run_dir)
    assert fresh.code == 1 and "already holds checkpoints" in fresh.stderr
    # another model shape: one line naming the option
    wider = run_inprocess("tiny_transformer", *args, "--n-embd", 64, "--run-dir", tmp_path / "wider",
                          "--resume", step)
    assert wider.code == 1 and wider.stderr.startswith("error: ") and "--n-embd 32 there, 64 here" in wider.stderr
    assert len(wider.stderr.strip().splitlines()) == 1
    # the global batch must stay: --batch-size may change only with the world size or --grad-accum
    other_batch = run_inprocess("tiny_transformer", *args, "--batch-size", 4, "--run-dir", tmp_path / "b",
                                "--resume", step)
    assert other_batch.code == 1 and "--global-batch 8 there, 4 here" in other_batch.stderr
    # a shard that is damaged (DCP raises a BaseException for it): still one line
    damaged = tmp_path / "damaged" / "step-000003"
    shutil.copytree(step, damaged)
    shard = damaged / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-64] + b"\0" * 64)  # its last tensor, at the same size
    going_on = args[:-2]  # without --max-steps 3: a finished checkpoint is refused before its shards are read
    broken = run_inprocess("tiny_transformer", *going_on, "--run-dir", tmp_path / "broken", "--resume", damaged)
    assert broken.code == 1 and len(broken.stderr.strip().splitlines()) == 1, broken.stderr
    assert broken.stderr.startswith(f"error: checkpoint {damaged} does not fit this model or optimizer, or is "
                                    "damaged: ")
    shard.write_bytes(b"\0" * 64)  # shorter than its .metadata says: named so before DCP reads it
    broken = run_inprocess("tiny_transformer", *going_on, "--run-dir", tmp_path / "broken", "--resume", damaged)
    assert broken.code == 1 and broken.stderr == f"error: checkpoint {damaged} is incomplete: its __0_0.distcp is " \
                                                 "cut short (a copy in progress, or a lost file)\n"
    (damaged / ".metadata").write_bytes(b"junk")  # DCP logged tracebacks of its own for this one (to the root logger,
    from conftest import run_subprocess  # whose last-resort handler a process of its own shows on stderr)

    broken = run_subprocess([RECIPE, *going_on, "--run-dir", tmp_path / "broken2", "--resume", damaged])
    assert broken.code == 1 and len(broken.stderr.strip().splitlines()) == 1, broken.stderr
    assert f"error: {damaged / '.metadata'} is not DCP checkpoint metadata (" in broken.stderr
    # DCP unpickles .metadata with plain pickle: code in it ran on --resume, --sample-only and export, before the error
    (damaged / ".metadata").write_bytes(pickle.dumps(RunsCode(tmp_path / "ran")))
    for command in ([RECIPE, *going_on, "--run-dir", tmp_path / "broken3", "--resume", damaged],
                    [RECIPE, "--sample-only", "--resume", damaged],
                    ["scripts/export.py", damaged, tmp_path / "exported"]):
        result = run_subprocess(command)
        assert result.code == 1 and result.stderr == (
            f"error: {damaged / '.metadata'} is not DCP checkpoint metadata (it names posix.system, which no DCP "
            "metadata holds): refused before DCP loads it, which would run any code in it (a checkpoint from "
            "elsewhere, or damaged)\n"), result.stderr
        assert not (tmp_path / "ran").exists()
    # the values DCP keeps as pickles (the optimizer's lr, betas) it unpickles with weights_only=False: code there ran
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    whole["optimizer"]["param_groups"][0]["initial_lr"] = RunsCode(tmp_path / "ran")
    hostile = tmp_path / "hostile" / "step-000003"
    dcp.save(whole, checkpoint_id=hostile)
    shutil.copy(step / "trainer.pt", hostile / "trainer.pt")
    for command in ([RECIPE, *going_on, "--run-dir", tmp_path / "hostile_run", "--resume", hostile],
                    [RECIPE, "--sample-only", "--resume", hostile], ["scripts/export.py", hostile, tmp_path / "ex"]):
        result = run_subprocess(command)
        assert result.code == 1 and result.stderr == (
            f"error: {hostile / '__0_0.distcp'} holds optimizer.param_groups.0.initial_lr as a pickle of more than "
            "data (it refers to Python code (posix.system)): refused before DCP loads it, which would run any code in "
            "it (a checkpoint from elsewhere, or damaged)\n"), result.stderr
        assert not (tmp_path / "ran").exists() and not (tmp_path / "hostile_run").exists()
    # a run folder whose only step folder is incomplete (copied by rsync, trainer.pt last): --resume auto trained
    # from step 0 over it and deleted it when it reached that step; a fresh run started there too
    copying = tmp_path / "copying"
    shutil.copytree(run_dir / "checkpoints" / "dcp", copying / "checkpoints" / "dcp")
    (copying / "checkpoints" / "dcp" / "step-000003" / "trainer.pt").unlink()
    before = sorted(p.name for p in copying.rglob("*"))
    again = run_inprocess("tiny_transformer", *going_on, "--run-dir", copying, "--resume", "auto")
    assert again.code == 1 and again.stderr.splitlines()[-1] == (
        f"error: {copying}'s only checkpoints are incomplete (step-000003 lacks its trainer.pt, .metadata or a "
        "shard: a copy in progress?), which this run would start afresh over and delete: complete them, or remove "
        "them"), again.stderr
    fresh = run_inprocess("tiny_transformer", *going_on, "--run-dir", copying)
    assert fresh.code == 1 and "already holds checkpoints" in fresh.stderr, fresh.stderr
    assert sorted(p.name for p in copying.rglob("*")) == before
    # so too when .metadata is what has not arrived (its trainer.pt, found first, hid the folder's state)
    shutil.copy(step / "trainer.pt", copying / "checkpoints" / "dcp" / "step-000003" / "trainer.pt")
    (copying / "checkpoints" / "dcp" / "step-000003" / ".metadata").unlink()
    before = sorted(p.name for p in copying.rglob("*"))
    again = run_inprocess("tiny_transformer", *going_on, "--run-dir", copying, "--resume", "auto")
    assert again.code == 1 and "only checkpoints are incomplete (step-000003 lacks" in again.stderr, again.stderr
    assert sorted(p.name for p in copying.rglob("*")) == before
    # another recipe's sharded checkpoint
    trainer = torch.load(step / "trainer.pt", weights_only=True)
    torch.save({**trainer, "recipe": "ddp_mlp"}, step / "trainer.pt")
    foreign = run_inprocess("tiny_transformer", *args, "--run-dir", tmp_path / "foreign", "--resume", step)
    assert foreign.code == 1 and "written by recipe 'ddp_mlp', not 'tiny_transformer'" in foreign.stderr
    torch.save(trainer, step / "trainer.pt")  # its own again
    # a folder that is no checkpoint at all
    empty = run_inprocess("tiny_transformer", *args, "--run-dir", tmp_path / "empty", "--resume", tmp_path)
    assert empty.code == 1 and "is not a complete sharded checkpoint" in empty.stderr
    # resumed in the other checkpoint format: the refusal names what differs in words, not as an option
    single = run_inprocess("tiny_transformer", *args[:-4], "--batch-size", 8, "--max-steps", 3, "--parallel", "none",
                           "--run-dir", run_dir, "--resume", "auto")
    assert single.code == 1 and "checkpoint format sharded (--parallel fsdp) there, single file here" in single.stderr
    # so too when the run was killed before it left last.pt (only its step folders are there): it trained from step 0
    # over them, its config.json rewritten
    for name in ("last.pt", "best.pt"):
        (run_dir / "checkpoints" / name).unlink()
    config = (run_dir / "config.json").read_bytes()
    killed = run_inprocess("tiny_transformer", *args[:-4], "--batch-size", 8, "--max-steps", 3, "--parallel", "auto",
                           "--run-dir", run_dir, "--resume", "auto")
    assert killed.code == 1 and "checkpoint format sharded (--parallel fsdp) there, single file here" in killed.stderr
    assert (run_dir / "config.json").read_bytes() == config and not (run_dir / "checkpoints" / "last.pt").exists()
    # what sharded runs do not keep, and a global batch that does not split: usage errors naming the option
    unbatched = [a for i, a in enumerate(args) if "--batch-size" not in args[i - 1: i + 1]]
    for given, option, why in [([*args, "--precision", "fp16"], "--precision", "use bf16 with --parallel fsdp"),
                               ([*unbatched, "--global-batch", 7, "--grad-accum", 2], "--global-batch",
                                "does not split into"),
                               ([*args, "--global-batch", 16], "--batch-size", "--global-batch sets it for you")]:
        refused = run_inprocess("tiny_transformer", *given, "--run-dir", tmp_path / "refused")
        assert refused.code == 2 and option in refused.stderr and why in refused.stderr, refused.stderr


def test_parallel_none_under_torchrun_is_refused_on_every_rank(corpus_txt, tmp_path):
    result = run_torchrun(["--nproc_per_node=2", RECIPE, "--text", corpus_txt, *TINY, "--parallel", "none",
                           "--run-dir", tmp_path / "run"])
    assert result.code != 0  # every rank that gets to say it (torchrun may stop the other first); lines may interleave
    assert 1 <= result.stderr.count("error: --parallel none trains one process, but torchrun started 2") <= 2


def test_parallel_none_is_refused_on_a_rank_other_than_0_before_any_folder(corpus_txt, tmp_path, monkeypatch,
                                                                           run_inprocess):
    """Above, rank 0's refusal alone ends the group (torchrun stops the rest): rank 1 must refuse of itself too."""
    monkeypatch.setattr(load_recipe("tiny_transformer"), "init_distributed", lambda device: (1, 2, device))
    result = run_inprocess("tiny_transformer", "--text", corpus_txt, *TINY, "--parallel", "none", "--run-dir",
                           tmp_path / "run")
    assert result.code == 1 and "error: --parallel none trains one process, but torchrun started 2" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_sharded_run_that_diverges_names_its_last_good_sharded_checkpoint(run_inprocess, corpus_txt, tmp_path):
    """Weights of ~1e30 are finite (step 1 saves them) but overflow in the next forward pass."""
    run_dir = tmp_path / "run"
    result = run_inprocess("tiny_transformer", "--text", corpus_txt, *TINY[4:], "--steps", 4, "--eval-every", 2,
                           "--checkpoint-every", 1, "--lr", 1e30, "--max-grad-norm", 0, "--parallel", "fsdp",
                           "--batch-size", 8, "--run-dir", run_dir)
    assert result.code == 1 and "Traceback" not in result.stderr
    good = run_dir / "checkpoints" / "dcp" / "step-000001"
    assert result.stderr.strip().splitlines() == [
        f"error: training diverged: the loss is nan at step 2; the last good checkpoint is {good}. Try a lower --lr"]
    assert (good / ".metadata").is_file()


LONG = ["--steps", 24, "--eval-every", 12, "--checkpoint-every", 3, "--global-batch", 16, "--parallel", "fsdp",
        "--resume", "auto"]


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not path.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.05)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus_txt):
    """The reference of the fault tests: 24 steps in one process."""
    from conftest import run_subprocess

    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = run_subprocess([RECIPE, "--text", corpus_txt, *TINY, *LONG, "--run-dir", run_dir])
    assert result.code == 0, result.stderr
    return load_weights(run_dir / "checkpoints" / "last.pt")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")
def test_killed_worker_restarts_from_the_last_sharded_checkpoint(uninterrupted, corpus_txt, tmp_path):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen([str(c) for c in [*TORCHRUN, "--nproc_per_node=2", "--max-restarts=1", RECIPE,
                                                  "--text", corpus_txt, *TINY, *LONG, "--run-dir", run_dir]],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(run_dir / "checkpoints" / "dcp" / "step-000006", launcher)
    workers = worker_pids(launcher.pid)
    assert launcher.poll() is None and workers, "the run ended before a worker could be killed"
    os.kill(workers[-1], signal.SIGKILL)
    output = launcher.communicate(timeout=180)[0]
    assert launcher.returncode == 0, output
    assert "resumed at step" in output
    assert read_metrics(run_dir)["steps"] == 24
    assert_close_weights(uninterrupted, load_weights(run_dir / "checkpoints" / "last.pt"))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="kills one node's process group")
def test_lost_node_the_survivor_reforms_at_world_size_one_and_finishes(uninterrupted, corpus_txt, tmp_path):
    """Two torchrun agents (nodes) on this machine, elastic 1 to 2 nodes; the second is killed mid-run with its
    worker. The first re-forms the group alone, resumes resharded, finishes with the weights of one process."""
    run_dir, port = tmp_path / "run", free_port()
    agent = [*TORCHRUN, "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=3", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
             "--rdzv-conf=join_timeout=60,last_call_timeout=10,close_timeout=5", RECIPE, "--text", corpus_txt, *TINY,
             *LONG, "--run-dir", run_dir]
    # last_call_timeout: both nodes join the first round (a node arriving after it would make the first restart
    # the group); after the loss the survivor waits that long for others, then goes on alone.
    nodes = []
    for _ in range(2):  # the first agent hosts the rendezvous store (it binds the port): the one that survives
        nodes.append(subprocess.Popen([str(c) for c in agent], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
        time.sleep(1)
    try:
        wait_for(run_dir / "checkpoints" / "dcp" / "step-000006", nodes[0])
        assert nodes[0].poll() is None and nodes[1].poll() is None, "the run ended before a node could be lost"
        lost = [nodes[1].pid, *worker_pids(nodes[1].pid)]  # torchrun's workers have their own session
        for pid in lost:  # the agent first, so that it restarts nothing
            os.kill(pid, signal.SIGKILL)
        output = nodes[0].communicate(timeout=150)[0]
    finally:
        for node in nodes:
            if node.poll() is None:
                for pid in [node.pid, *worker_pids(node.pid)]:
                    os.kill(pid, signal.SIGKILL)
    assert nodes[0].returncode == 0, output[-4000:]
    assert "1 process(es) | resumed at step" in output  # (the first run's rank 0 may have been either node)
    assert read_metrics(run_dir)["steps"] == 24 and read_metrics(run_dir)["world_size"] == 1
    assert_close_weights(uninterrupted, load_weights(run_dir / "checkpoints" / "last.pt"))


def test_activation_checkpointing_recomputes_to_the_same_weights(run_inprocess, one_process, corpus_txt, tmp_path,
                                                                  monkeypatch):
    from conftest import load_recipe

    recipe, calls = load_recipe("tiny_transformer"), []
    real = recipe.checkpoint
    monkeypatch.setattr(recipe, "checkpoint", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    result = run_inprocess("tiny_transformer", "--text", corpus_txt, *TINY, "--batch-size", 16,
                           "--activation-checkpointing", "--run-dir", tmp_path / "ac")
    assert result.code == 0, result.stderr
    assert len(calls) == 2 * 6  # every block (2) of every training step (6), never in evaluation or sampling
    assert_close_weights(load_weights(one_process / "checkpoints" / "last.pt"),
                         load_weights(tmp_path / "ac" / "checkpoints" / "last.pt"))


def test_pruning_keeps_the_last_complete_checkpoints_and_the_best_one(tmp_path):
    """Of six complete step folders the last three stay, and the best (step 2) though it is older; an incomplete
    folder is not a checkpoint and pruning leaves it alone."""
    from common.sharded import KEEP, prune

    for step in range(1, 7):
        folder = tmp_path / f"step-{step:06d}"
        folder.mkdir()
        (folder / ".metadata").write_bytes(b"")
        (folder / "trainer.pt").write_bytes(b"")
    (tmp_path / "step-000007").mkdir()  # no .metadata: a save cut short
    prune(tmp_path, best_step=2)
    assert KEEP == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000004", "step-000005", "step-000006",
                                                          "step-000007"]


def test_a_step_folder_counts_only_with_every_shard_its_metadata_names_whole(tmp_path):
    from common.dcp_check import incomplete

    step = tmp_path / "step-000001"
    dcp.save({"w": torch.ones(4), "lr": 0.1}, checkpoint_id=step, no_dist=True)
    (step / "trainer.pt").write_bytes(b"")
    assert incomplete(step) is None
    shard = step / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    assert incomplete(step) == "its __0_0.distcp is cut short"
    shard.unlink()
    assert incomplete(step) == "its __0_0.distcp is missing"
    (step / ".metadata").write_bytes(b"junk")  # counted, and refused with the reason when loaded
    assert incomplete(step) is None
    from common.cli import RecipeError
    from common.dcp_check import read_dcp_metadata

    (step / ".metadata").write_bytes(pickle.dumps({}))  # a pickle of data, but no Metadata: said so
    with pytest.raises(RecipeError, match=r"is not DCP checkpoint metadata \(it holds no DCP Metadata\)"):
        read_dcp_metadata(step / ".metadata")
    (step / "trainer.pt").unlink()
    assert incomplete(step) == "no .metadata or trainer.pt"


def test_a_step_folder_damaged_after_its_save_is_one_line_at_the_single_files(run_inprocess, corpus_txt, tmp_path,
                                                                              monkeypatch):
    """DCP raises its CheckpointException, a BaseException, for a shard it cannot read: it was a traceback."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    import common.sharded

    def damaged(*args, **kwargs):
        try:
            raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")
        except RuntimeError as err:
            raise CheckpointException("CheckpointException ranks", {0: _wrap_exception(err)}) from None

    monkeypatch.setattr(common.sharded, "dcp_to_torch_save", damaged)
    run_dir = tmp_path / "run"
    result = run_inprocess("tiny_transformer", "--text", corpus_txt, *TINY, "--parallel", "fsdp", "--batch-size", 8,
                           "--run-dir", run_dir)
    assert result.code == 1 and result.stderr.strip().splitlines() == [
        f"error: could not write the single-file checkpoints in {run_dir / 'checkpoints'}: a step folder in "
        f"{run_dir / 'checkpoints' / 'dcp'} is damaged (PytorchStreamReader failed reading zip archive: failed "
        "finding central directory)"]


TORCH_WRITE_FAILED = "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"


def write_failed(context: OSError | None = None) -> RuntimeError:
    """torch.save's RuntimeError for a write that failed, raised while handling ``context`` (a full disk's OSError,
    as torch's writer raises it), or with none."""
    try:
        if context is None:
            raise RuntimeError(TORCH_WRITE_FAILED)
        try:
            raise context
        except OSError:
            raise RuntimeError(TORCH_WRITE_FAILED) from None
    except RuntimeError as err:
        return err


@pytest.mark.parametrize(("where", "error", "why"), [
    ("to_single_file", OSError(28, "No space left on device"), "No space left on device"),
    # torch.save to a path (dcp_to_torch_save's) says only this of a full disk: it was a traceback
    ("dcp_to_torch_save", write_failed(), f"the write failed ({TORCH_WRITE_FAILED})"),
    ("dcp_to_torch_save", write_failed(OSError(28, "No space left on device")), "No space left on device"),
])
def test_a_full_disk_at_the_single_file_copies_is_one_line_and_leaves_the_sharded_checkpoints(
        where, error, why, run_inprocess, corpus_txt, tmp_path, monkeypatch):
    import common.sharded

    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(common.sharded, where, full)
    run_dir = tmp_path / "run"
    result = run_inprocess("tiny_transformer", "--text", corpus_txt, *TINY, "--parallel", "fsdp", "--batch-size", 8,
                           "--run-dir", run_dir)
    assert result.code == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: could not write the single-file checkpoints in {run_dir / 'checkpoints'}: {why}; the sharded "
        f"checkpoints in {run_dir / 'checkpoints' / 'dcp'} are intact"]
    assert (run_dir / "checkpoints" / "dcp" / "step-000006" / ".metadata").is_file()


def test_a_really_full_disk_at_the_single_file_copies_says_so(run_inprocess, corpus_txt, tmp_path, monkeypatch):
    """The copy of a step folder went through a file that torch.save opened itself: a full disk was "the write failed
    ([enforce fail at inline_container.cc:672] . unexpected pos ...)"."""
    import contextlib

    import common.sharded

    disk = tmp_path / "small-disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)]).returncode:
        pytest.skip("no tmpfs can be mounted here (not root)")
    convert = common.sharded.to_single_file

    def on_a_full_disk(*args):
        with open(disk / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
            while True:
                filler.write(b"x" * 1024)
        return convert(*args)

    monkeypatch.setattr(common.sharded, "to_single_file", on_a_full_disk)
    try:
        run_dir = disk / "run"
        result = run_inprocess("tiny_transformer", "--text", corpus_txt, *TINY, "--parallel", "fsdp",
                               "--batch-size", 8, "--run-dir", run_dir)
        assert result.code == 1 and result.stderr.strip().splitlines() == [
            f"error: could not write the single-file checkpoints in {run_dir / 'checkpoints'}: No space left on "
            f"device; the sharded checkpoints in {run_dir / 'checkpoints' / 'dcp'} are intact"]
        assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["dcp"]  # no temporary file left
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_failed_write_gathered_from_the_ranks_is_said_with_the_free_space(tmp_path):
    """DCP gathers the ranks' errors pickled, without the OSError behind them: torch's words alone, and the space."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from common.sharded import failure

    err = CheckpointException("CheckpointException ranks", {1: _wrap_exception(write_failed())})
    said = str(failure(err, tmp_path))
    assert re.fullmatch(re.escape(TORCH_WRITE_FAILED) + r"; [\d,]+\.\d MB free on that disk", said), said
    assert str(failure(err, tmp_path / "gone")) == TORCH_WRITE_FAILED  # a folder since removed: no second error
    err = CheckpointException("ranks", {1: _wrap_exception(write_failed()), 0: _wrap_exception(write_failed(
        OSError(28, "No space left on device")))})
    assert str(failure(err, tmp_path)) == "[Errno 28] No space left on device"  # the one OSError there is


def test_the_last_good_checkpoint_is_the_resumed_one_until_the_run_saves_its_own(tmp_path):
    from common.rundir import RunFolder, last_file
    from common.runlog import RunLog
    from common.sharded import last_sharded

    elsewhere = tmp_path / "other" / "last.pt"
    run = RunFolder(tmp_path / "run", elsewhere)
    single, sharded = (RunLog(run, "t", total_steps=1, every=1, last_checkpoint=last) for last in (last_file,
                                                                                                   last_sharded))
    assert single.last_good() == elsewhere and sharded.last_good() == elsewhere
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.pt").write_bytes(b"")
    step = tmp_path / "run" / "checkpoints" / "dcp" / "step-000004"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "trainer.pt").write_bytes(b"")
    assert single.last_good() == tmp_path / "run" / "checkpoints" / "last.pt"
    assert sharded.last_good() == step


def test_a_compiled_fsdp_run_resumes_from_its_own_sharded_checkpoint(run_inprocess, corpus_txt, tmp_path,
                                                                     monkeypatch):
    """torch.compile's wrapper prefixes parameter names (_orig_mod.); DCP's state dicts do not, and nothing here
    rebuilds them from model.state_dict(): a compiled sharded run resumes, and may change --compile on the way."""
    compiled, compile_ = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiled.append(1) or compile_(*a, **k))
    args = ["--text", corpus_txt, *TINY, "--parallel", "fsdp", "--batch-size", 8, "--run-dir", tmp_path / "run",
            "--resume", "auto"]
    launches = []
    for options in (["--compile", "--max-steps", 2], ["--compile", "--max-steps", 4], []):  # the last one eager
        result = run_inprocess("tiny_transformer", *args, *options)
        assert result.code == 0, result.stderr
        launches.append(len(compiled))
    assert launches[0] > 0 and launches[1] > launches[0] and launches[2] == launches[1]
    assert "resumed at step 4" in result.stdout and read_metrics(tmp_path / "run")["steps"] == 6


@pytest.mark.parametrize("resumed", [False, True])
def test_a_full_disk_during_a_sharded_save_is_one_line_and_leaves_no_partial_folder(resumed, run_inprocess, corpus_txt,
                                                                                     tmp_path, monkeypatch):
    """dcp.save wraps a rank's OSError in its CheckpointException, a BaseException that ``except OSError`` misses."""
    import errno

    from common import sharded

    real_save = sharded.dcp.save

    def full_at_step_6(state, checkpoint_id):
        if "step-000006" in str(checkpoint_id):
            real_save(state, checkpoint_id=checkpoint_id)  # writes part of it, then the disk is full
            full = OSError(errno.ENOSPC, "No space left on device")  # as torch's writer reports it, or as the OS
            raise sharded.CheckpointException("save failed", {0: (write_failed(full) if resumed else full,
                                                                   traceback.StackSummary())})
        return real_save(state, checkpoint_id=checkpoint_id)

    run_dir = tmp_path / "run"
    args = ["--text", corpus_txt, *TINY, "--parallel", "fsdp", "--batch-size", 8, "--run-dir", run_dir]
    if resumed:  # the step-3 checkpoint is the one this launch resumed from (it said "no earlier checkpoint")
        assert run_inprocess("tiny_transformer", *args, "--max-steps", 3).code == 0
        args += ["--resume", "auto"]
    monkeypatch.setattr(sharded.dcp, "save", full_at_step_6)
    result = run_inprocess("tiny_transformer", *args)
    assert result.code == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: could not write checkpoint {run_dir / 'checkpoints' / 'dcp' / 'step-000006'}: No space left on "
        "device; the previous checkpoint (step 3) is intact"]
    assert sorted(p.name for p in (run_dir / "checkpoints" / "dcp").iterdir()) == ["step-000003"]  # no .tmp left


def test_ctrl_c_while_loading_a_sharded_checkpoint_is_no_damaged_checkpoint(monkeypatch, tmp_path):
    """DCP wraps whatever a rank raised, Ctrl-C included, in its CheckpointException: a KeyboardInterrupt during
    the load must stay one (and stop the run as Ctrl-C does), not read as a checkpoint that does not fit."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from common import sharded

    def interrupted(*args, **kwargs):
        raise CheckpointException("load failed", {0: (KeyboardInterrupt(), traceback.StackSummary())})

    def damaged(*args, **kwargs):
        raise CheckpointException("load failed", {0: (EOFError(), traceback.StackSummary())})

    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(sharded.dcp, "load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sharded.load_sharded(tmp_path, model)
    monkeypatch.setattr(sharded.dcp, "load", damaged)
    with pytest.raises(sharded.RecipeError, match="or is damaged"):
        sharded.load_sharded(tmp_path, model)


def test_a_sharded_run_killed_after_its_last_save_still_ends_with_its_single_files(run_inprocess, corpus_txt,
                                                                                  tmp_path):
    """Killed between the last step folder and the single files (SIGTERM at the last step, say), the relaunch only
    finishes: it must still leave last.pt and best.pt for sampling and export."""
    run_dir = tmp_path / "run"
    args = ["--text", corpus_txt, *TINY, "--parallel", "fsdp", "--batch-size", 8, "--run-dir", run_dir]
    assert run_inprocess("tiny_transformer", *args).code == 0
    expected = {name: load_weights(run_dir / "checkpoints" / name) for name in ("last.pt", "best.pt")}
    for name in ("last.pt", "best.pt", "../metrics.json"):  # as the kill left it
        (run_dir / "checkpoints" / name).unlink()
    again = run_inprocess("tiny_transformer", *args, "--resume", "auto")
    assert again.code == 0, again.stderr
    assert "resumed at step 6" in again.stdout
    for name, weights in expected.items():
        assert_same_weights(weights, load_weights(run_dir / "checkpoints" / name))


def test_a_relaunch_that_only_finishes_never_takes_down_the_step_folder_it_resumed_from(run_inprocess, corpus_txt,
                                                                                      tmp_path, monkeypatch):
    """Killed after a periodic save, then relaunched with --max-steps at that step: the relaunch saves that step again
    (its trainer.pt), and must not remove and rewrite the step's shards, as a kill in between would lose the step."""
    from common import sharded

    run_dir = tmp_path / "run"
    args = ["--text", corpus_txt, *TINY, "--parallel", "fsdp", "--batch-size", 8, "--run-dir", run_dir,
            "--checkpoint-every", 1, "--resume", "auto"]
    assert run_inprocess("tiny_transformer", *args, "--max-steps", 5).code == 0
    shutil.rmtree(run_dir / "checkpoints" / "dcp" / "step-000005")  # as a kill after step 4's save left it
    for name in ("checkpoints/last.pt", "checkpoints/best.pt", "metrics.json"):
        (run_dir / name).unlink()
    step_dir = run_dir / "checkpoints" / "dcp" / "step-000004"
    shards = {path.name: path.stat().st_ino for path in step_dir.iterdir() if path.name != "trainer.pt"}
    trainer, trainer_file = (step_dir / "trainer.pt").read_bytes(), (step_dir / "trainer.pt").stat().st_ino
    os.link(step_dir / "trainer.pt", tmp_path / "held.pt")  # its inode stays taken: no new file can reuse it
    save = sharded.save_checkpoint

    def full_disk_in_the_step_folder(path: Path, state: dict) -> None:
        if path.parent == step_dir:
            raise OSError(28, "No space left on device", str(path))
        save(path, state)

    monkeypatch.setattr(sharded, "save_checkpoint", full_disk_in_the_step_folder)
    failed = run_inprocess("tiny_transformer", *args, "--max-steps", 4)  # it said "No space left on device (any ...)"
    assert (failed.code, failed.stderr) == (1, f"error: could not write checkpoint {step_dir}: No space left on "
                                               "device; the previous checkpoint (step 4) is intact\n")
    assert (step_dir / "trainer.pt").read_bytes() == trainer
    monkeypatch.setattr(sharded, "save_checkpoint", save)
    again = run_inprocess("tiny_transformer", *args, "--max-steps", 4)
    assert again.code == 0, again.stderr
    assert "resumed at step 4" in again.stdout
    # the shards as they were (never rewritten), a new trainer.pt (saved again, as one atomic file)
    assert {path.name: path.stat().st_ino for path in step_dir.iterdir() if path.name != "trainer.pt"} == shards
    assert (step_dir / "trainer.pt").stat().st_ino != trainer_file
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 4


def test_a_sharded_run_stopped_by_sigterm_leaves_the_single_files_of_its_last_step(corpus_txt, tmp_path):
    """last.pt and best.pt are what --sample-only and export.py read: after a stop, those of the step it stopped at,
    not of an earlier launch (nor none at all)."""
    run_dir = tmp_path / "run"
    args = [sys.executable, RECIPE, "--text", corpus_txt, *TINY, "--steps", 100_000, "--parallel", "fsdp",
            "--checkpoint-every", 1, "--run-dir", run_dir]
    process = subprocess.Popen([str(a) for a in args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    wait_for(run_dir / "checkpoints" / "dcp" / "step-000004", process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 143 and "Traceback" not in stderr, stderr
    stopped_at = int(stdout.split("interrupted at step ")[1].split(";")[0])
    newest = sorted((run_dir / "checkpoints" / "dcp").glob("step-*"))[-1]
    assert newest.name == f"step-{stopped_at:06d}"
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert last["step"] == stopped_at and best["step"] == best["best"]["step"] == last["best"]["step"] <= stopped_at

"""What would make a recipe's run faster here: its alternatives measured side by side, and the rules of
PyTorch's Performance Tuning Guide checked against the live run.

    python scripts/doctor.py mnist_onecycle                      # any recipe, with the options you train with
    python scripts/doctor.py tabular_mlp --csv my.csv --target price --rounds 3

1. The live run: the recipe runs as given, in this process, for a few dozen steps with ``--profile``, while
   global hooks watch it (every module call, every optimizer step): where a step's time goes (waiting for data,
   forward, backward, optimizer), and the guide's rules: evaluation without gradients, autograd's anomaly mode
   off, gradients freed between steps (``zero_grad(set_to_none=True)``), no bias on a convolution that a batch
   norm follows, channels_last convolutions, and on CUDA matrix sizes that are multiples of 8 under autocast,
   host-device syncs per step (``torch.cuda.set_sync_debug_mode``; the median between two step starts),
   ``cudnn.benchmark`` and TF32.
2. The alternatives that apply on this device (bf16 where the device multiplies it natively, ``--compile``
   where a C++ compiler is found, DataLoader workers, a larger batch), each a run of its own in a subprocess,
   interleaved with the run as given (A B C C B A ...) for ``--rounds`` rounds: the speed-up is the median of
   the rounds' ratios of training throughput (the first window, or the first epoch if shorter, left out: start-up
   and compiling), with its range.
3. The alternatives that were faster in every round, by 1.1x or more at the median, and leave the training as it
   is (not a larger batch) are measured together, the same way, and recommended as one command line if together
   they pass the same test; otherwise the best of them alone is.

One table (rule or alternative, what was measured, verdict) and the command; ``--json FILE`` writes the same
figures: the throughput as given per round (``as_given_samples_per_s``, or tokens), and each alternative's speed-ups
over it (``speedups``). Nothing is written where your runs are: every run is in a temporary folder, removed afterwards.
Exit status 0; 1 with one line ``error: ...`` when the recipe fails as given; 2 on a usage error; 130 on Ctrl-C or
SIGTERM, the temporary folders removed.
"""

import argparse
import itertools
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.find_lr import (  # noqa: E402
    NOT_TRAINING,
    first_given,
    interrupt,
    load_recipe,
    long_enough,
    option_value,
    recipe_options,
    refused_options,
    replayed,
    run_quietly,
    typed,
)
from scripts.find_lr import FinderError as DoctorError  # noqa: E402 - the same one-line error
from scripts.plot_runs import cannot_write_in, write_atomically  # noqa: E402

ALTERNATIVES = ["bf16", "compile", "workers", "batch"]
OWN_OPTIONS = ("--run-dir", "--resume", "--max-steps", "--log-every", "--profile", "--checkpoint-every")


@dataclass
class Observed:
    """What the hooks saw of the live run."""

    steps: int = 0
    anomaly_mode: bool = False
    grads_reused: int = 0  # steps whose gradients were the previous step's tensors, zeroed in place
    eval_with_grad: set[str] = field(default_factory=set)  # eval-mode modules called with autograd recording
    conv_bias_before_norm: set[str] = field(default_factory=set)
    convs_not_channels_last: set[str] = field(default_factory=set)
    matrices: dict[str, tuple[int, int]] = field(default_factory=dict)  # weight shapes of layers that multiply
    # CUDA: the warnings of set_sync_debug_mode, and how many had come by each step's start: the syncs of a typical
    # step, the median between two starts (set-up, evaluation and checkpoints copy whole models; a step does not)
    warnings: list = field(default_factory=list)
    syncs_by_step: list[int] = field(default_factory=list)

    @property
    def syncs_per_step(self) -> float:
        counts = self.syncs_by_step
        steps = [b - a for a, b in itertools.pairwise(counts)]
        return float(statistics.median(steps)) if steps else math.nan
    cudnn_benchmark: bool | None = None
    matmul_precision: str = "highest"


def watch(observed: Observed):
    """The global hooks: every optimizer step, every module call. Returns a function that removes them."""
    import torch
    from torch import nn
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    previous: list[nn.Module | None] = [None]

    def before_step(optimizer, args, kwargs) -> None:
        observed.steps += 1
        observed.syncs_by_step.append(sum("synchronizing" in str(w.message) for w in observed.warnings))
        observed.anomaly_mode |= torch.is_anomaly_enabled()
        observed.cudnn_benchmark = torch.backends.cudnn.benchmark
        observed.matmul_precision = torch.get_float32_matmul_precision()
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # a gradient tensor met at an earlier step was zeroed in place, not freed (set_to_none=False)
        observed.grads_reused += any(getattr(g, "doctor_seen", False) for g in grads)
        for g in grads:
            g.doctor_seen = True

    def before_forward(module: nn.Module, inputs) -> None:
        kind = type(module).__name__
        if not module.training and torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
            observed.eval_with_grad.add(kind)
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.ndim >= 2 and not isinstance(module, nn.Embedding):
            observed.matrices.setdefault(kind + str(len(observed.matrices)), tuple(weight.shape[:2]))
        conv = previous[0] if isinstance(previous[0], nn.modules.conv._ConvNd) else None
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and conv is not None and conv.bias is not None:
            observed.conv_bias_before_norm.add(type(conv).__name__)
        image = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].ndim == 4 else None
        if isinstance(module, nn.Conv2d) and image is not None and not image.is_contiguous(
                memory_format=torch.channels_last):
            observed.convs_not_channels_last.add(kind)
        if not list(module.children()):
            previous[0] = module

    handles = [register_optimizer_step_pre_hook(before_step), register_module_forward_pre_hook(before_forward)]
    return lambda: [handle.remove() for handle in handles]


def live_run(recipe, options: list[str], steps: int, work: Path) -> tuple[Observed, dict, dict, str]:
    """The recipe as given, in this process, with the hooks and --profile: (what was seen, its config.json, its
    profile.json, what its throughput counts: samples or tokens)."""
    import torch

    observed, run_dir = Observed(), work / "live"
    remove = watch(observed)
    profiled = max(5, steps // 2)
    args = [*options, "--max-steps", str(steps), "--profile", str(profiled), "--log-every", str(steps),
            "--run-dir", str(run_dir)]
    with warnings.catch_warnings(record=True) as observed.warnings:
        warnings.simplefilter("always")
        sync_debug = torch.cuda.is_available()
        if sync_debug:  # every synchronising CUDA call warns; counted below
            torch.cuda.set_sync_debug_mode("warn")
        try:
            code, line = run_quietly(recipe, args)
        finally:
            remove()
            if sync_debug:
                torch.cuda.set_sync_debug_mode("default")
    if code == 2:
        raise DoctorError(f"the recipe refused its options: {line}", exit_code=2)
    if code:
        raise DoctorError(f"the recipe fails as given: {line.removeprefix('error: ') or f'exit status {code}'}")
    read = lambda name: json.loads((run_dir / name).read_text()) if (run_dir / name).is_file() else {}  # noqa: E731
    unit = next((k.removesuffix("_per_s") for k in read("metrics.json") if k.endswith("_per_s")), "samples")
    return observed, read("config.json"), read("profile.json"), unit


def throughput(recipe_path: Path, options: list[str], steps: int, window: int, run_dir: Path) -> float:
    """Training items (samples or tokens) per second of one run in a subprocess, without its first window."""
    args = [sys.executable, str(recipe_path), *options, "--max-steps", str(steps), "--log-every", str(window),
            "--run-dir", str(run_dir)]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode in (130, 143):  # the run stopped on Ctrl-C or SIGTERM: so does the doctor
        raise KeyboardInterrupt
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1])
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        speed = next(v for k, v in metrics.items() if k.endswith("_per_s"))
    except (OSError, ValueError, AttributeError, StopIteration):  # no file, not JSON, no object, no throughput
        raise RuntimeError(f"its {run_dir.name}/metrics.json holds no throughput (samples_per_s or tokens_per_s), "
                           "which the doctor measures") from None
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if metrics.get("steps", steps) < steps:  # its first window, start-up included, would then count in it
        raise RuntimeError(f"the run ended at step {metrics['steps']} of the {steps} measured (--patience, or a "
                           "short run): give a longer one")
    return speed


def side_by_side(recipe_path: Path, variants: dict[str, list[str]], rounds: int, steps: int, window: int,
                 work: Path) -> dict[str, list[float] | str]:
    """Each variant's speed-up over the first ("as given") in every round, interleaved, every other round in
    reverse (A B C C B A ...: none always runs first); or why it failed."""
    speeds: dict[str, list[float] | str] = {name: [] for name in variants}
    in_order = list(enumerate(variants.items()))
    for r in range(rounds):
        for i, (name, options) in in_order[::-1] if r % 2 else in_order:
            if isinstance(speeds[name], str):
                continue
            try:
                speeds[name].append(throughput(recipe_path, options, steps, window, work / f"r{r}-{i}"))
            except RuntimeError as err:
                speeds[name] = f"cannot run here: {err}"
    base = speeds.pop(next(iter(variants)))
    if isinstance(base, str):  # it ran in the live run, but not now in a process of its own
        raise DoctorError(f"the recipe fails as given: {base.removeprefix('cannot run here: ')}")
    return {name: s if isinstance(s, str) else [a / b for a, b in zip(s, base, strict=True)]
            for name, s in speeds.items()} | {"as given": base}


def clearly_faster(ratios: list[float] | str) -> bool:
    """Faster than as given in every round, and by 1.1x or more at the median (a failed run is its message)."""
    return not isinstance(ratios, str) and min(ratios) > 1.0 and statistics.median(ratios) >= 1.1


def spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def alternatives(known: set[str], options: list[str], config: dict, wanted: list[str]) -> tuple[dict, list]:
    """The alternatives to measure ({name: (options, changes_training)}), and rows for those that cannot run."""
    import torch

    from common.runtime import native_bf16

    device = torch.device(config.get("device_used", "cpu"))
    found, rows = {}, []
    if "bf16" in wanted and "--precision" in known and config.get("precision_used") == "fp32":
        why = native_bf16(device)
        if why:
            found["--precision bf16"] = (["--precision", "bf16"], False)
        else:
            rows.append(("--precision bf16", "not measured", f"no native bf16 matmul on this {device.type}: "
                         "emulated, it would be slower"))
    # what the live run used (its config.json: a --config file replays options too), not only the command line
    if "compile" in wanted and "--compile" in known and not config.get("compile", "--compile" in options):
        if device.type == "cpu" and not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")):
            rows.append(("--compile", "not measured", "torch.compile on a CPU needs a C++ compiler (g++): none found"))
        else:
            found["--compile"] = (["--compile"], False)
    workers_used = int(config.get("num_workers", option_value(options, "--num-workers") or 0))
    if "workers" in wanted and "--num-workers" in known and workers_used == 0:
        workers = min(4, max(1, (os.cpu_count() or 2) - 1))
        found[f"--num-workers {workers}"] = (["--num-workers", str(workers)], False)
    # --global-batch sets --batch-size (the transformer refuses both): the one given is doubled
    size = "--global-batch" if option_value(options, "--global-batch") else "--batch-size"
    batch = option_value(options, size) or str(config.get("batch_size") or "")
    if "batch" in wanted and config.get("optimizer_name") == "lbfgs":
        rows.append(("--batch-size x2", "not measured", "lbfgs trains on the whole table at once"))
    elif "batch" in wanted and size in known and batch.isdigit():
        found[f"{size} {2 * int(batch)}"] = ([size, str(2 * int(batch))], True)
    elif "batch" in wanted and "--batch-size" in known:  # a size the recipe chooses from the data, say
        rows.append(("--batch-size x2", "not measured", "the run records no batch size to double: give --batch-size"))
    return found, rows


def rule_rows(observed: Observed, config: dict, profile: dict, options: list[str]) -> list[tuple[str, str, str]]:
    """The tuning guide's rules against the live run: (rule, what was seen, verdict)."""
    rows = []
    ms = profile.get("ms_per_step", {})
    if ms:
        total = sum(ms.values())
        share = ms["data"] / total if total else 0.0
        rows.append(("data loading", f"{100 * share:.0f}% of a {total:.1f} ms step waits for data",
                     "ok" if share < 0.1 else "the loop waits for its data: more --num-workers, or batches built "
                                              "in one indexing (__getitems__)"))
    on_cuda = config.get("device_used", "cpu").startswith("cuda")
    if on_cuda:
        per_step = observed.syncs_per_step
        if math.isnan(per_step):  # fewer than two steps started: no interval to count in
            rows.append(("host-device syncs", "not measured: fewer than 2 steps ran", "n/a"))
        else:
            rows.append(("host-device syncs", f"{per_step:.1f} per step (torch.cuda.set_sync_debug_mode)",
                         "ok" if per_step <= 1 else "each stalls the GPU: keep losses on the device, read them back "
                                                    "every few steps"))
        rows.append(("cudnn.benchmark", str(observed.cudnn_benchmark),
                     "ok" if observed.cudnn_benchmark or not any(k.startswith("Conv") for k in observed.matrices) else
                     "fixed-size convolutions run faster with torch.backends.cudnn.benchmark = True"))
        if config.get("precision_used") == "fp32":
            tf32 = observed.matmul_precision != "highest"  # "high" or "medium": TF32 (or bf16) matmuls already
            rows.append(("TF32 matmuls", f"float32 matmul precision {observed.matmul_precision!r}",
                         "ok: TF32 is on" if tf32 else "fp32 as asked; from compute capability 8.0 (Ampere), "
                         "--precision bf16 (or TF32) is several times faster"))
    else:
        rows.append(("host-device syncs", "not measured: a CPU has no asynchronous queue to stall",
                     "n/a on cpu"))
    rows.append(("evaluation without autograd", ", ".join(sorted(observed.eval_with_grad)) or "no eval-mode call "
                 "recorded a graph", "ok" if not observed.eval_with_grad else "wrap evaluation in torch.no_grad()"))
    rows.append(("debug APIs off", f"anomaly detection {'on' if observed.anomaly_mode else 'off'}; "
                 f"CUDA_LAUNCH_BLOCKING={os.environ.get('CUDA_LAUNCH_BLOCKING', 'unset')}",
                 "ok" if not observed.anomaly_mode and os.environ.get("CUDA_LAUNCH_BLOCKING") != "1" else
                 "turn off: they slow every step"))
    rows.append(("zero_grad(set_to_none=True)", f"{observed.grads_reused} of {observed.steps} steps reused the "
                 "last step's gradient tensors", "ok" if not observed.grads_reused else
                 "free the gradients (set_to_none=True) instead of zeroing them"))
    if observed.conv_bias_before_norm or any(k.startswith("Conv") for k in observed.matrices):
        rows.append(("no conv bias before batch norm", ", ".join(sorted(observed.conv_bias_before_norm)) or "none",
                     "ok" if not observed.conv_bias_before_norm else "bias=False: the norm subtracts it again"))
        rows.append(("channels_last convolutions", ", ".join(sorted(observed.convs_not_channels_last)) or
                     "every Conv2d input is channels_last", "ok" if not observed.convs_not_channels_last else
                     "model.to(memory_format=torch.channels_last) and the inputs too"))
    if on_cuda and config.get("precision_used") in ("bf16", "fp16"):  # tensor cores: a CPU has none
        odd = sorted({d for shape in observed.matrices.values() for d in shape if d % 8})
        rows.append(("sizes multiples of 8 under autocast", f"dims not a multiple of 8: {odd}" if odd else
                     "every matrix dim is", "ok" if not odd else "tensor cores work in tiles of 8: pad where you "
                     "can (a vocabulary, a hidden size); input and class counts are what they are"))
    accumulating = int(option_value(options, "--grad-accum") or 1) > 1
    rows.append(("no_sync while accumulating", "one process: no gradients to all-reduce" if config.get(
        "world_size", 1) == 1 else "under DDP", "n/a here" if not accumulating or config.get("world_size", 1) == 1
        else "ok (common/loop.py::train_step)"))
    return rows


def not_a_report(path: Path) -> str | None:
    """Why a report must not be written to ``path`` (a folder; a file that is no earlier report; a folder that cannot
    be written), or None."""
    if path.is_dir():
        return "it is a folder"
    if not path.parent.is_dir():
        return f"{path.parent} is not a folder"
    try:
        earlier_report = isinstance(saved := json.loads(path.read_text()), dict) and "recommended_options" in saved
    except FileNotFoundError:
        earlier_report = True  # nothing there to keep
    except (OSError, ValueError, TypeError):  # unreadable, not JSON, JSON but no object
        earlier_report = False
    if not earlier_report:
        return "it exists and is no doctor's report (a run's config.json?): choose another"
    return cannot_write_in(path.parent)


def main(argv: list[str] | None = None) -> int:
    if hasattr(sys.stdout, "reconfigure"):  # a path an ASCII-only terminal cannot show prints as \xfc, not a traceback
        sys.stdout.reconfigure(errors="backslashreplace")
    parser = argparse.ArgumentParser(description=__doc__ and " ".join(__doc__.split("\n\n")[0].split()),
                                     allow_abbrev=False, usage="%(prog)s RECIPE [options] [recipe options]",
                                     epilog="Any other option is the recipe's own.")
    parser.add_argument("recipe", metavar="RECIPE", help="a recipe's name (mnist_onecycle) or a path to one")
    # three: on a shared machine one run in a dozen is slowed by a neighbour, and the median of three shrugs it off
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every variant [default: 3]")
    parser.add_argument("--window", type=int, help="steps per measured window [default: from the live run's "
                        "step time, about a second]")
    parser.add_argument("--try", dest="wanted", default=",".join(ALTERNATIVES),
                        help=f"the alternatives to try, of {','.join(ALTERNATIVES)} [default: all that apply]")
    parser.add_argument("--json", type=Path, metavar="FILE.json", help="also write the figures here (a new file, or an "
                        "earlier report)")
    args, options = parser.parse_known_args(argv)
    wanted = [w for w in args.wanted.split(",") if w]
    if not wanted or not set(wanted) <= set(ALTERNATIVES):
        parser.error(f"argument --try: {args.wanted!r}: each of {', '.join(ALTERNATIVES)}")
    if not 1 <= args.rounds <= 100 or (args.window is not None and not 1 <= args.window <= 10_000):
        parser.error("arguments --rounds and --window: from 1 to 100 rounds, of 1 to 10,000 steps")
    if args.json is not None and args.json.suffix.lower() != ".json":  # not a checkpoint or a table by mistake
        parser.error(f"argument --json: give a file name that ends in .json, such as report.json, not "
                     f"{str(args.json)!r}")
    if taken := first_given(options, OWN_OPTIONS):
        parser.error(f"{taken}: the doctor runs the recipe in run directories of its own, for its own steps")
    if taken := first_given(options, NOT_TRAINING):
        parser.error(f"{taken}: the doctor measures a training run, and {taken} makes the recipe do something else")
    try:
        recipe = load_recipe(args.recipe)
    except DoctorError as err:  # no such recipe, or a file that is not one
        parser.error(f"argument RECIPE: {err}")
    if taken := first_given(replayed(recipe, options), ("--profile", "--checkpoint-every", *NOT_TRAINING)):
        parser.error(f"--config sets {taken}, which the doctor cannot take: replay a copy of the file without it")
    if args.json is not None and (why := not_a_report(args.json)):  # found before measuring, not after it
        print(f"error: cannot write --json {args.json}: {why}", file=sys.stderr)
        return 1
    try:
        if refused := refused_options(recipe, options):  # its own --epochs or --steps after them would hide them
            raise DoctorError(f"the recipe refused its options: {refused}", exit_code=2)
        recipe_path = Path(recipe.__file__).resolve()
        known = recipe_options(recipe)
        with tempfile.TemporaryDirectory(prefix="doctor.") as folder:
            work = Path(folder)
            # each run as long as the steps measured (--max-steps ends it), however short its own options make it
            observed, config, profile, unit = live_run(recipe, [*options, *long_enough(known, 30)], 30, work)
            step_ms = sum(profile.get("ms_per_step", {}).values()) or 50.0
            window = args.window or max(3, min(200, round(1000 / step_ms)))
            steps = 3 * window  # the first window (start-up, compiling) is left out of the throughput
            length = long_enough(known, steps)
            found, rows = alternatives(known, options, config, wanted)
            variants = {"as given": options} | {name: [*options, *extra] for name, (extra, _) in found.items()}
            measured = side_by_side(recipe_path, {name: [*variant, *length] for name, variant in variants.items()},
                                    args.rounds, steps, window, work)
            faster = [n for n, (_, changes) in found.items() if not changes and clearly_faster(measured[n])]
            chosen = faster
            if len(faster) > 1:
                together = [*options, *(a for n in faster for a in found[n][0])]
                both = side_by_side(recipe_path, {"as given": [*options, *length], "recommended": [*together, *length]},
                                    args.rounds, steps, window, work)
                if clearly_faster(both["recommended"]):
                    measured["recommended"] = both["recommended"]
                else:  # together they lose what each gained alone (two ways of using the same cores, say)
                    measured["together"] = both["recommended"]
                    chosen = [max(faster, key=lambda n: statistics.median(measured[n]))]
            if len(chosen) == 1:
                measured["recommended"] = measured[chosen[0]]
            recommended = [*options, *(a for n in chosen for a in found[n][0])]
    except DoctorError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("error: interrupted; nothing measured", file=sys.stderr)
        return 130
    except OSError as err:  # no temporary folder can be made, or a run's process cannot be started
        print(f"error: {err.strerror or err}{f': {err.filename}' if err.filename else ''}", file=sys.stderr)
        return 1
    table = [("as given", f"{statistics.median(measured['as given']):,.0f} {unit}/s", "the baseline")]
    for name, (_, changes) in found.items():
        result = measured[name]
        if isinstance(result, str):
            table.append((name, "not measured", result))
            continue
        median = statistics.median(result)
        verdict = ("faster in every round" if name in faster else "no clear gain here" if median >= 0.95 else
                   "slower here")
        if changes and clearly_faster(result):  # the test the others pass, not the median alone
            verdict = "faster per sample, but it changes the training: retune --lr"
        table.append((name, spread(result), verdict))
    table += rows + rule_rows(observed, config, profile, options)
    print(f"doctor: {recipe_path.stem} on {config.get('device_used')} ({config.get('precision_used')}), {args.rounds} "
          f"interleaved round(s) of {steps} steps per variant, throughput without the first {window} (or the first "
          "epoch, if shorter)")
    print("| rule or alternative | measured | verdict |\n|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    name = typed(recipe_path)  # as a command run here names it
    if chosen:
        if chosen != faster:
            together = measured["together"]  # its figures, or why it could not run
            how = f"failed ({together})" if isinstance(together, str) else \
                f"measured {spread(together)}, not clearly faster"
            print(f"together, {' and '.join(faster)} {how}: the best of them alone")
        print(f"recommended ({spread(measured['recommended'])} the throughput as given):\n  "
              f"{shlex.join(['python', name, *recommended])}")
    else:
        print("recommended: as given; no alternative was faster in every round by 1.1x or more\n  "
              f"{shlex.join(['python', name, *options])}")
    if args.json:
        report = {"recipe": recipe_path.stem, "options": options, "measured_with": length, "rows": table,
                  "window": window, f"as_given_{unit}_per_s": measured["as given"],  # per round, as the speed-ups
                  "speedups": {name: m for name, m in measured.items() if name != "as given"},  # over it, or why not
                  "recommended": recommended if chosen else options, "recommended_options": chosen}
        try:
            write_atomically(args.json, (json.dumps(report, indent=2) + "\n").encode())
        except OSError as err:
            print(f"error: cannot write --json {args.json}: {err.strerror or err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, interrupt)
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before main's own handler: as the recipe is imported (torch with it), say
        print("error: interrupted; nothing measured", file=sys.stderr)
        sys.exit(130)

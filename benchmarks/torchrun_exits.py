"""Launch a finished-job torchrun N times in a row and count how each launch ended (the gloo SIGABRT study).

    python benchmarks/torchrun_exits.py --launches 20 --parallel fsdp

Each launch trains recipes/tiny_transformer.py for a few steps on 2 CPU ranks (gloo) in a fresh run
directory. A launch counts as clean when torchrun exits 0 and reports no worker killed by a signal; the
script prints one line per launch and a summary, and exits 1 if any launch was not clean.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", "4", "--eval-every", "2", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size",
        "16", "--batch-size", "8", "--eval-batches", "2", "--sample-tokens", "8", "--peak-flops", "1e11"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--parallel", choices=["ddp", "fsdp"], default="fsdp")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("def forward(self, x):\n    return self.head(self.body(x))  # logits\n" * 40)
        clean = 0
        for i in range(args.launches):
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                   "recipes/tiny_transformer.py", "--text", str(corpus), *TINY, "--parallel",
                                   args.parallel, "--run-dir", str(Path(tmp) / f"run{i}")],
                                  cwd=ROOT, capture_output=True, text=True, env={"PYTHONFAULTHANDLER": "1",
                                                                                 **os.environ})
            output = proc.stdout + proc.stderr
            signalled = re.findall(r"Signal \d+ \(SIG\w+\) received by PID", output)
            aborted = "terminate called without an active exception" in output
            ok = proc.returncode == 0 and not signalled and not aborted and "done: " in proc.stdout
            clean += ok
            print(f"launch {i + 1:2d}: exit {proc.returncode}{' ' + signalled[0] if signalled else ''}"
                  f"{' (terminate called)' if aborted else ''} -> {'clean' if ok else 'NOT CLEAN'}", flush=True)
    print(f"{clean} of {args.launches} launches clean ({args.parallel}, 2 gloo ranks)")
    sys.exit(0 if clean == args.launches else 1)


if __name__ == "__main__":
    main()

"""AdamW's beta2 for recipes/tiny_transformer.py: validation loss with 0.95 and 0.99, at two batch sizes.

    python benchmarks/beta2_sweep.py --steps 2000 --out beta2.json

Each run trains the recipe on a character-level text (the first 1,115,394 characters of this Python's
standard library, nanoGPT's shakespeare_char length) at nanoGPT's CPU shape (4 layers, 128 wide, 4 heads,
block 64), otherwise with the recipe's defaults, and scores last.pt on the whole validation split (the last
10%) in non-overlapping windows (benchmarks/char_lm.py's score_windows). --jobs runs that many at once, one
thread each.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import char_lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-sizes", default="12,32")
    parser.add_argument("--betas", default="0.95,0.99")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1" if args.jobs > 1 else os.environ.get("OMP_NUM_THREADS", "2")
    with tempfile.TemporaryDirectory() as tmp:
        text = char_lm.char_text(Path(tmp) / "text.txt")
        grid = [(b, beta2, seed) for b in map(int, args.batch_sizes.split(","))
                for beta2 in map(float, args.betas.split(",")) for seed in map(int, args.seeds.split(","))]

        def one(point):
            batch, beta2, seed = point
            settings = {"--steps": args.steps, "--batch-size": batch, "--beta2": beta2, "--n-layer": 4,
                        "--n-embd": 128, "--n-head": 4, "--block-size": 64}
            seconds, loss = char_lm.train_recipe_lm(text, Path(tmp) / f"run_{batch}_{beta2}_{seed}", settings, seed)
            print(f"batch {batch} beta2 {beta2} seed {seed}: val loss {loss:.4f} ({seconds:.0f} s)", flush=True)
            return {"batch": batch, "beta2": beta2, "seed": seed, "val_loss": loss, "seconds": seconds}

        with ThreadPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(one, grid))
    print("| batch | beta2 | val loss (nats/char), per seed | mean |\n|---|---|---|---|")
    for batch in sorted({r["batch"] for r in rows}):
        for beta2 in sorted({r["beta2"] for r in rows}):
            losses = [r["val_loss"] for r in rows if r["batch"] == batch and r["beta2"] == beta2]
            print(f"| {batch} | {beta2} | {', '.join(f'{v:.4f}' for v in losses)} | {statistics.mean(losses):.4f} |")
    if args.out:
        args.out.write_text(json.dumps({"steps": args.steps, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()

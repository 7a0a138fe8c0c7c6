#!/usr/bin/env bash
# The README's pictures: each recipe's run with its default options, drawn by scripts/plot_runs.py.
#
#     bash benchmarks/readme_figures.sh MNIST_DIR ADULT_CSV
#
# MNIST_DIR: a folder with MNIST's official test set (t10k-*-ubyte.gz, as torchvision leaves them in
# data/MNIST/raw); ADULT_CSV: the Adult census table as one CSV with a header row and an income column.
# Only MNIST's official test set was on the machine these were made on, so the MNIST recipes train on its
# first 8,000 digits (less their validation split) and are tested on the other 2,000. Everything else is each
# recipe's default. Runs go to a temporary folder; the PNGs to docs/.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 2 ]; then
    echo "usage: bash benchmarks/readme_figures.sh MNIST_DIR ADULT_CSV" >&2
    exit 2
fi
mnist=$1 adult=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python benchmarks/mnist_files.py split "$mnist" "$work/mnist" --train 8000 >/dev/null
common=(--device cpu)
python recipes/mnist_onecycle.py --epochs 3 --data-dir "$work/mnist" --run-dir "$work/mnist_onecycle" \
    "${common[@]}" | tail -1
python -m torch.distributed.run --nproc_per_node=2 recipes/ddp_mlp.py --data-dir "$work/mnist" \
    --run-dir "$work/ddp_mlp" "${common[@]}" | tail -1
python recipes/tabular_mlp.py --csv "$adult" --target income --run-dir "$work/tabular_mlp" \
    "${common[@]}" | tail -1
python recipes/tiny_transformer.py --run-dir "$work/tiny_transformer" "${common[@]}" | tail -1
python recipes/mixed_precision.py --compare --run-dir "$work/mixed_precision" "${common[@]}" | tail -1
python recipes/compiled_model.py --compare --run-dir "$work/compiled_model" "${common[@]}" | tail -1
for recipe in mnist_onecycle ddp_mlp tabular_mlp tiny_transformer; do
    python scripts/plot_runs.py "$work/$recipe" --out "docs/$recipe.png"
done
# the benchmark's ratios, as curves: the same training in each precision, and eager against compiled
trained=$(for p in fp32 bf16 fp16; do
    if [ -d "$work/mixed_precision/$p" ]; then echo "$work/mixed_precision/$p"; fi
done)
python scripts/plot_runs.py $trained --out docs/mixed_precision.png  # the precisions fast enough to train here
python scripts/plot_runs.py "$work"/compiled_model/eager "$work"/compiled_model/compiled --out docs/compiled_model.png
ls -l docs/*.png

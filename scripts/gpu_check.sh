#!/usr/bin/env bash
# Every recipe on one CUDA machine, in one call: bf16, fp16 and bf16 + torch.compile, then DDP under
# torchrun with nccl. Prints one markdown table (throughput, final train loss, peak GPU memory, wall time,
# status) and writes it to OUT/table.md, with every figure in OUT/results.json.
#
#   bash scripts/gpu_check.sh [OUT]            # on a CUDA machine; OUT defaults to gpu_check_out/
#   bash scripts/gpu_check.sh --smoke OUT      # the same plumbing on this CPU: 2 steps, tiny models
#
# Made for a GPU lent for a few minutes with no network: the data is generated here, each run is a few
# hundred steps (about 5 minutes in all on one H100, most of it process start-up and torch.compile), and a
# failed or hung run is recorded in the table instead of stopping the rest.
#
# Environment: PYTHON (default: python on PATH), GPU_CHECK_STEPS (optimizer steps per run, default 300),
# GPU_CHECK_TIMEOUT (seconds before a run is killed, default 180), GPU_CHECK_KEEP_CHECKPOINTS=1 (keep each
# run's checkpoints/, deleted by default once the run is recorded).
# Exit status: 0 when every run is ok, 1 when any failed (the table says which), 2 on a usage error.

set -euo pipefail

usage() { echo "usage: bash scripts/gpu_check.sh [--smoke] [OUT]   (OUT defaults to gpu_check_out)" >&2; exit 2; }

SMOKE=0
OUT=""
for arg in "$@"; do
    case "$arg" in
        --smoke) SMOKE=1 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        -*) usage ;;
        *) [[ -z "$OUT" ]] || usage; OUT=$arg ;;
    esac
done
OUT=${OUT:-gpu_check_out}
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# ---- Is there a GPU? (before anything is written, so that a wrong machine costs one line) ----------------
# -W ignore and 2>/dev/null: torch warns on stderr when it finds a driver but no device; one line is enough.
probe='import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
gpu = f"{n} x {torch.cuda.get_device_name(0)}" if n else "no CUDA device"
print(n, f"torch {torch.__version__} (CUDA {torch.version.cuda}), {gpu}")'
if ! probe_out=$("$PYTHON" -W ignore -c "$probe" 2>/dev/null); then
    echo "error: $PYTHON cannot import torch, so CUDA cannot be checked: install requirements.txt (or set PYTHON)" >&2
    exit 1
fi
read -r NGPU ENVIRONMENT <<<"$probe_out"
if [[ $SMOKE == 0 && $NGPU == 0 ]]; then
    echo "error: CUDA is not available ($ENVIRONMENT); run this on a CUDA machine, or use --smoke for a CPU check" >&2
    exit 1
fi

# ---- The output folder: ours alone, so a rerun may clear it ------------------------------------------------
# A recipe refuses to start in a --run-dir that holds checkpoints, so a rerun must start from empty folders;
# the marker file makes sure that what gets deleted is an earlier check's output and nothing else.
if [[ -d "$OUT" && -n "$(ls -A "$OUT")" && ! -e "$OUT/.gpu_check" ]]; then
    echo "error: $OUT is not empty and was not written by gpu_check.sh; give another folder" >&2
    exit 1
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -rf "$OUT/data" "$OUT/runs" "$OUT/logs" "$OUT/runs.tsv" "$OUT/table.md" "$OUT/results.json"
touch "$OUT/.gpu_check"
mkdir -p "$OUT/runs" "$OUT/logs"
cd "$REPO"  # recipes/ and scripts/ are addressed from the repository root

# ---- What to run -------------------------------------------------------------------------------------------
if [[ $SMOKE == 1 ]]; then
    # CPU plumbing check: the sizes of tests/conftest.py's SMOKE_ARGS, 2 steps, bf16 only (fp16 and compile
    # would only measure this CPU's emulation and Inductor's C++ compiler), DDP as 2 gloo processes.
    STEPS=2
    DEVICE=cpu
    VARIANTS=(bf16)
    NPROC=2
    BACKEND=gloo
    "$PYTHON" scripts/gpu_check.py data "$OUT/data" --digits 512 200 --rows 300
    declare -A ARGS=(
        [mnist_onecycle]="--data-dir $OUT/data --max-steps $STEPS --batch-size 32"
        [tabular_mlp]="--csv $OUT/data/table.csv --target label --epochs 1 --max-steps $STEPS --batch-size 32"
        [tiny_transformer]="--steps $STEPS --eval-every $STEPS --n-layer 2 --n-head 2 --n-embd 32 --block-size 16
                            --batch-size 8 --eval-batches 2 --sample-tokens 20 --peak-flops 1e11"
        [mixed_precision]="--epochs 1 --max-steps $STEPS --samples 256 --batch-size 64 --width 32 --depth 2"
        [compiled_model]="--epochs 1 --max-steps $STEPS --samples 512 --batch-size 128 --width 16 --depth 2"
        [ddp_mlp]="--data-dir $OUT/data --epochs 1 --max-steps $STEPS --batch-size 32 --hidden 64"
    )
    DDP_ARGS=${ARGS[ddp_mlp]}  # --batch-size is per process
else
    STEPS=${GPU_CHECK_STEPS:-300}
    DEVICE=cuda
    VARIANTS=(bf16 fp16 bf16-compile)
    NPROC=$NGPU
    BACKEND=nccl
    N_TRAIN=20000
    "$PYTHON" scripts/gpu_check.py data "$OUT/data" --digits "$N_TRAIN" 2000 --rows 20000
    # --max-steps stops a run early; --epochs must still be large enough to reach it:
    # epochs SAMPLES BATCH -> passes over SAMPLES in batches of BATCH (last one dropped) to make $STEPS steps
    epochs() {
        local per_epoch=$(( $1 / $2 ))
        (( per_epoch > 0 )) || per_epoch=1  # batch larger than the data: let the recipe say so
        echo $(( (STEPS + per_epoch - 1) / per_epoch ))
    }
    # Default model sizes and batches throughout. The recipes' own --epochs defaults already give more than
    # $STEPS steps for mnist_onecycle (312 per epoch) and tabular_mlp (62 per epoch); the others need more.
    declare -A ARGS=(
        [mnist_onecycle]="--data-dir $OUT/data --max-steps $STEPS"
        [tabular_mlp]="--csv $OUT/data/table.csv --target label --max-steps $STEPS"
        [tiny_transformer]="--steps $STEPS"
        [mixed_precision]="--epochs $(epochs 32768 512) --max-steps $STEPS"
        [compiled_model]="--epochs $(epochs 131072 8192) --max-steps $STEPS"
        [ddp_mlp]="--data-dir $OUT/data --epochs $(epochs "$N_TRAIN" 1024) --max-steps $STEPS"
    )
    # Under torchrun each rank takes its 1/NPROC share of the data, 1024 digits per step (per process).
    DDP_ARGS="--data-dir $OUT/data --epochs $(epochs $(( N_TRAIN / NPROC )) 1024) --max-steps $STEPS"
fi
RECIPES=(mnist_onecycle tabular_mlp tiny_transformer mixed_precision compiled_model ddp_mlp)
TIMEOUT=${GPU_CHECK_TIMEOUT:-180}
KEEP_CHECKPOINTS=${GPU_CHECK_KEEP_CHECKPOINTS:-0}

variant_flags() {
    case "$1" in
        bf16) echo "--precision bf16" ;;
        fp16) echo "--precision fp16" ;;
        bf16-compile) echo "--precision bf16 --compile" ;;
    esac
}

# ---- One run -----------------------------------------------------------------------------------------------
START=$(date +%s.%N)
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# run_one RECIPE VARIANT COMMAND...: run COMMAND with its own --run-dir, output to OUT/logs, killed after
# $TIMEOUT s; append a line to OUT/runs.tsv and print one progress line. Never fails the script: a run's
# failure is a row in the table.
run_one() {
    local recipe=$1 variant=$2
    shift 2
    local run_dir="$OUT/runs/$recipe-$variant" log="$OUT/logs/$recipe-$variant"
    local command=("$@" --device "$DEVICE" --run-dir "$run_dir" --no-progress)
    printf '%-17s %-19s ' "$recipe" "$variant"  # before the run: a hung run still shows in the log
    local started rc=0
    started=$(date +%s.%N)
    timeout --kill-after=10 "$TIMEOUT" "${command[@]}" >"$log.out" 2>"$log.err" </dev/null || rc=$?
    local wall
    wall=$(since "$started")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$recipe" "$variant" "$rc" "$wall" "$run_dir" "$log.err" \
        "$(printf '%q ' "${command[@]}")" >>"$OUT/runs.tsv"
    # The table needs metrics.json, not the weights: 19 runs' checkpoints (~200 MB) would only make the
    # output folder slow to fetch from a lent machine.
    [[ $KEEP_CHECKPOINTS == 1 ]] || rm -rf "$run_dir/checkpoints"
    local status="ok"
    if [[ $rc != 0 || ! -f "$run_dir/metrics.json" ]]; then status="FAILED (exit $rc, see $log.err)"; fi
    printf '%6.1f s  %s  [%s s in all]\n' "$wall" "$status" "$(since "$START")"
}

echo "gpu_check: $ENVIRONMENT | $STEPS steps per run | device $DEVICE | output $OUT"
# Eager variants first, then DDP, then the compiled ones (the slowest): a check cut short still says most.
for variant in "${VARIANTS[@]}"; do
    [[ $variant == *compile* ]] && continue
    for recipe in "${RECIPES[@]}"; do
        # shellcheck disable=SC2086  # ARGS and the variant flags are word lists
        run_one "$recipe" "$variant" "$PYTHON" "recipes/$recipe.py" ${ARGS[$recipe]} $(variant_flags "$variant")
    done
done
# shellcheck disable=SC2086
run_one ddp_mlp "torchrun-bf16-x$NPROC" "$PYTHON" -m torch.distributed.run --standalone \
    --nproc_per_node="$NPROC" recipes/ddp_mlp.py --backend "$BACKEND" $DDP_ARGS --precision bf16
for variant in "${VARIANTS[@]}"; do
    [[ $variant == *compile* ]] || continue
    for recipe in "${RECIPES[@]}"; do
        # shellcheck disable=SC2086
        run_one "$recipe" "$variant" "$PYTHON" "recipes/$recipe.py" ${ARGS[$recipe]} $(variant_flags "$variant")
    done
done

# ---- The table ---------------------------------------------------------------------------------------------
echo
# The table command exits 1 when any run failed: so does this script, after the table is out.
status=0
"$PYTHON" scripts/gpu_check.py table "$OUT" --environment "$ENVIRONMENT" --elapsed "$(since "$START")" \
    --smoke "$SMOKE" || status=$?
echo
echo "table: $OUT/table.md | figures: $OUT/results.json | logs: $OUT/logs | $(since "$START") s in all"
exit "$status"

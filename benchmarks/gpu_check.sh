#!/usr/bin/env bash
# The recipes on one CUDA machine, in one call of about 6 minutes: every recipe in bf16, fp16 where it
# teaches something (mixed_precision's GradScaler, the transformer), torch.compile where it does
# (compiled_model, the transformer), DDP under torchrun with nccl, and an FSDP2 row. Writes OUT/table.md
# (throughput, final train loss, MFU, peak GPU memory, wall time, status) after every run, so a check cut
# short still says what it did, with every figure in OUT/results.json and one short log in OUT/log.txt.
#
#   bash benchmarks/gpu_check.sh [OUT]            # on a CUDA machine; OUT defaults to gpu_check_out/
#   bash benchmarks/gpu_check.sh --smoke OUT      # the same plumbing on this CPU: 2 steps, tiny models
#
# Made for a GPU lent for a few minutes with no network, whose tool brings back only a few files: OUT gets
# four (table.md, results.json, log.txt, the .gpu_check marker); the data, the runs and each run's full
# output go to a work folder elsewhere. The data is generated here; each run is a cold process (start-up
# and, for --compile, cold Inductor/Triton compiles dominate), so there are few of them and few steps. A
# run that fails, hangs or would pass the time budget is a row of the table, and the rest still run.
#
# Environment: PYTHON (default: python on PATH), GPU_CHECK_STEPS (optimizer steps per run, default 150),
# GPU_CHECK_BUDGET (seconds for all runs together, default 330: later runs are skipped, and a run is
# killed when the budget ends), GPU_CHECK_TIMEOUT (seconds before one run is killed, default 120),
# GPU_CHECK_WORK (the work folder; default a new folder under $TMPDIR or /tmp, kept and named at the end).
# Exit status: 0 when no run failed and none was skipped for time, 1 otherwise (the table says which),
# 2 on a usage error.

set -euo pipefail

usage() { echo "usage: bash benchmarks/gpu_check.sh [--smoke] [OUT]   (OUT defaults to gpu_check_out)" >&2; exit 2; }

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
cd "$REPO"  # recipes/ and benchmarks/ are addressed from the repository root
for name in GPU_CHECK_STEPS GPU_CHECK_BUDGET GPU_CHECK_TIMEOUT; do
    value=${!name:-1}
    [[ $value =~ ^[0-9]+$ ]] || { echo "usage: $name must be a whole number of ${name#GPU_CHECK_}, not '$value'" >&2; exit 2; }
done

# ---- Probe: torch and the GPUs first (a wrong machine costs one line and writes nothing), then the ------
# ---- packages, the APIs an older torch lacks, and one recipe's --help, all in one Python process -------
# -W ignore and 2>/dev/null: torch warns on stderr when it finds a driver but no device; one line is enough.
PROBE_START=$(date +%s.%N)
if ! probe_out=$("$PYTHON" -W ignore benchmarks/gpu_check.py probe --need-cuda $((1 - SMOKE)) 2>/dev/null); then
    echo "error: $PYTHON cannot run benchmarks/gpu_check.py probe, so CUDA cannot be checked:" \
         "$(head -n 1 <<<"$probe_out") (install requirements.txt, or set PYTHON)" >&2
    exit 1
fi
IFS=$'\t' read -r NGPU PEAK_BF16 PEAK_FP16 HAS_PARALLEL ENVIRONMENT <<<"$(head -n 1 <<<"$probe_out")"
if [[ $SMOKE == 0 && $NGPU == 0 ]]; then
    echo "error: CUDA is not available ($ENVIRONMENT); run this on a CUDA machine, or use --smoke for a CPU check" >&2
    exit 1
fi

# ---- The output folder (ours alone, so a rerun may overwrite it) and the work folder -------------------
# A recipe refuses to start in a --run-dir that holds checkpoints, so a rerun must start from empty folders;
# the marker files make sure that what gets deleted is an earlier check's output and nothing else.
for dir in "$OUT" ${GPU_CHECK_WORK:+"$GPU_CHECK_WORK"}; do
    if [[ -d "$dir" && -n "$(ls -A "$dir")" && ! -e "$dir/.gpu_check" ]]; then
        echo "error: $dir is not empty and was not written by gpu_check.sh; give another folder" >&2
        exit 1
    fi
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [[ -n ${GPU_CHECK_WORK:-} ]]; then
    mkdir -p "$GPU_CHECK_WORK"
    WORK=$(cd "$GPU_CHECK_WORK" && pwd)
else
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
fi
[[ $WORK != "$OUT" && $WORK != "$OUT"/* ]] || { echo "error: GPU_CHECK_WORK must be outside $OUT" >&2; exit 1; }
rm -rf "$OUT/table.md" "$OUT/results.json" "$OUT/log.txt" "$WORK/data" "$WORK/runs" "$WORK/logs" "$WORK/runs.tsv"
touch "$OUT/.gpu_check" "$WORK/.gpu_check"
mkdir -p "$WORK/runs" "$WORK/logs"
RUNS="$WORK/runs.tsv"
: >"$RUNS"
LOG="$OUT/log.txt"
LOG_LIMIT=100000  # bytes: the lent machine's tool brings back small files only

# say TEXT: a progress line on stdout and in OUT/log.txt
say() { printf '%s\n' "$*"; printf '%s\n' "$*" >>"$LOG"; }
# log_tail FILE TITLE: the end of a failed run's output in OUT/log.txt, within LOG_LIMIT
log_tail() {
    local size
    size=$(wc -c <"$LOG")
    if (( size > LOG_LIMIT )); then
        [[ -e "$WORK/.log_full" ]] || echo "(log.txt full: the rest is in $WORK/logs)" >>"$LOG"
        touch "$WORK/.log_full"
        return
    fi
    { echo "--- $2: last 25 lines of $1 ---"; tail -n 25 "$1" 2>/dev/null | cut -c 1-300; } >>"$LOG"
}

say "gpu_check: $ENVIRONMENT (probe: $(awk -v a="$PROBE_START" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s)"
tail -n +2 <<<"$probe_out" | sed 's/^/  /' | tee -a "$LOG"

# ---- What to run -------------------------------------------------------------------------------------------
if [[ $SMOKE == 1 ]]; then
    # CPU plumbing check: the sizes of tests/conftest.py's SMOKE_ARGS, 2 steps, bf16 only (fp16 and compile
    # would only measure this CPU's emulation and Inductor's C++ compiler), DDP as 2 gloo processes.
    STEPS=2
    DEVICE=cpu
    NPROC=2
    BACKEND=gloo
    BUDGET=${GPU_CHECK_BUDGET:-900}
    "$PYTHON" benchmarks/gpu_check.py data "$WORK/data" --digits 512 200 --rows 300 >>"$LOG"
    TT_ARGS="--steps $STEPS --eval-every $STEPS --n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --batch-size 8
             --eval-batches 2 --sample-tokens 20"
    declare -A ARGS=(
        [mnist_onecycle]="--data-dir $WORK/data --max-steps $STEPS --batch-size 32"
        [tabular_mlp]="--csv $WORK/data/table.csv --target label --epochs 1 --max-steps $STEPS --batch-size 32"
        [tiny_transformer]="$TT_ARGS --peak-flops 1e11"
        [mixed_precision]="--epochs 1 --max-steps $STEPS --samples 256 --batch-size 64 --width 32 --depth 2"
        [compiled_model]="--epochs 1 --max-steps $STEPS --samples 512 --batch-size 128 --width 16 --depth 2"
        [ddp_mlp]="--data-dir $WORK/data --epochs 1 --max-steps $STEPS --batch-size 32 --hidden 64"
    )
    DDP_ARGS=${ARGS[ddp_mlp]}  # --batch-size is per process
    PLAN=("mnist_onecycle bf16" "tabular_mlp bf16" "tiny_transformer bf16" "mixed_precision bf16"
          "compiled_model bf16" "ddp_mlp bf16" "ddp" "fsdp")
else
    STEPS=${GPU_CHECK_STEPS:-150}
    DEVICE=cuda
    # Two ranks with two GPUs or more: enough to show that gradients are all-reduced across devices.
    NPROC=$(( NGPU >= 2 ? 2 : 1 ))
    BACKEND=nccl
    BUDGET=${GPU_CHECK_BUDGET:-330}
    N_TRAIN=20000
    DDP_TRAIN=$(( N_TRAIN - N_TRAIN / 12 ))  # ddp_mlp holds out a twelfth of the digits for validation
    "$PYTHON" benchmarks/gpu_check.py data "$WORK/data" --digits "$N_TRAIN" 2000 --rows 20000 >>"$LOG"
    # --max-steps stops a run early; --epochs must still be large enough to reach it:
    # epochs SAMPLES BATCH -> passes over SAMPLES in batches of BATCH (last one dropped) to make $STEPS steps
    epochs() {
        local per_epoch=$(( $1 / $2 ))
        (( per_epoch > 0 )) || per_epoch=1  # batch larger than the data: let the recipe say so
        echo $(( (STEPS + per_epoch - 1) / per_epoch ))
    }
    # Default model sizes and batches; the transformer evaluates and samples once, at the end, briefly.
    TT_ARGS="--steps $STEPS --eval-every $STEPS --eval-batches 5 --sample-tokens 50"
    declare -A ARGS=(
        [mnist_onecycle]="--data-dir $WORK/data --max-steps $STEPS"
        [tabular_mlp]="--csv $WORK/data/table.csv --target label --max-steps $STEPS"
        [tiny_transformer]="$TT_ARGS"
        [mixed_precision]="--epochs $(epochs 32768 512) --max-steps $STEPS"
        [compiled_model]="--epochs $(epochs 131072 8192) --max-steps $STEPS"
        [ddp_mlp]="--data-dir $WORK/data --epochs $(epochs "$DDP_TRAIN" 1024) --max-steps $STEPS"
    )
    # Under torchrun each rank takes its 1/NPROC share of the data, 1024 digits per step (per process).
    DDP_ARGS="--data-dir $WORK/data --epochs $(epochs $(( DDP_TRAIN / NPROC )) 1024) --max-steps $STEPS"
    # Most telling first: a check cut short still says most. 12 runs: on an H200 host with 16 cores, 11-26 s
    # each eager (start-up is most of it) and 43 s for compiled_model's cold compile, 250 s before the
    # transformer's compile: hence the 330 s budget.
    PLAN=("tiny_transformer bf16" "mnist_onecycle bf16" "tabular_mlp bf16" "mixed_precision bf16"
          "compiled_model bf16" "ddp_mlp bf16" "ddp" "fsdp" "mixed_precision fp16" "tiny_transformer fp16"
          "compiled_model bf16-compile" "tiny_transformer bf16-compile")
fi
TIMEOUT=${GPU_CHECK_TIMEOUT:-120}
MIN_RUN=15  # seconds: a run given less than this could only be killed

variant_flags() {
    case "$1" in
        bf16) echo "--precision bf16" ;;
        fp16) echo "--precision fp16" ;;
        bf16-compile) echo "--precision bf16 --compile" ;;
    esac
}
# The transformer's MFU against the GPU's datasheet peak where the probe knows the GPU (the recipe would
# otherwise measure its own matmul peak, after the model is on the GPU: see common/peak_flops.py::device_peak_flops).
peak_flags() {  # peak_flags RECIPE VARIANT
    local peak=""
    case "$2" in bf16*) peak=$PEAK_BF16 ;; fp16*) peak=$PEAK_FP16 ;; esac
    if [[ $1 == tiny_transformer && $peak != "-" && -n $peak && $SMOKE == 0 ]]; then echo "--peak-flops $peak"; fi
}

# ---- One run -----------------------------------------------------------------------------------------------
START=$(date +%s.%N)
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
left() { awk -v a="$START" -v b="$(date +%s.%N)" -v budget="$BUDGET" 'BEGIN { printf "%d", budget - (b - a) }'; }

# table [--running RECIPE/VARIANT] [--final]: rewrite OUT/table.md and OUT/results.json from runs.tsv
table() {
    "$PYTHON" benchmarks/gpu_check.py table "$OUT" --runs "$RUNS" --environment "$ENVIRONMENT" \
        --elapsed "$(since "$START")" --smoke "$SMOKE" --steps "$STEPS" "$@"
}
# record RECIPE VARIANT EXIT WALL RUN_DIR STDERR_LOG COMMAND NOTE: one line of runs.tsv
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$RUNS"; }
skip() {  # skip RECIPE VARIANT WHY
    record "$1" "$2" skipped 0 - - - "$3"
    say "$(printf '%-17s %-24s skipped: %s' "$1" "$2" "$3")"
    table
}

# run_one RECIPE VARIANT NOTE COMMAND...: run COMMAND with its own --run-dir, output to WORK/logs, killed
# after $TIMEOUT s or when the budget ends; record it, rewrite the table, print one progress line. Never
# fails the script: a run's failure is a row in the table.
run_one() {
    local recipe=$1 variant=$2 note=$3
    shift 3
    local remaining
    remaining=$(left)
    if (( remaining < MIN_RUN )); then
        skip "$recipe" "$variant" "the check's ${BUDGET} s time budget was spent"
        return
    fi
    local limit=$(( remaining < TIMEOUT ? remaining : TIMEOUT ))
    local run_dir="$WORK/runs/$recipe-$variant" log="$WORK/logs/$recipe-$variant"
    local command=("$@" --device "$DEVICE" --run-dir "$run_dir")
    table --running "$recipe/$variant"  # killed during this run, the table still says what was done
    printf '%-17s %-24s ' "$recipe" "$variant"  # before the run: a hung run still shows in the output
    local started rc=0
    started=$(date +%s.%N)
    timeout --kill-after=10 "$limit" "${command[@]}" >"$log.out" 2>"$log.err" </dev/null || rc=$?
    local wall
    wall=$(since "$started")
    if (( limit < TIMEOUT )) && [[ $rc == 124 || $rc == 137 ]]; then  # killed by the budget, not its own limit
        note="${note:+$note; }cut off by the check's ${BUDGET} s budget: GPU_CHECK_BUDGET gives it more"
    fi
    record "$recipe" "$variant" "$rc" "$wall" "$run_dir" "$log.err" "$(printf '%q ' "${command[@]}")" "$note"
    # The table needs metrics.json, not the weights.
    rm -rf "$run_dir/checkpoints"
    local status="ok"
    if [[ $rc != 0 || ! -f "$run_dir/metrics.json" ]]; then
        status="FAILED (exit $rc, see $log.err)"
        log_tail "$log.err" "$recipe $variant"
    fi
    printf '%6.1f s  %s  [%s s in all]\n' "$wall" "$status" "$(since "$START")"
    printf '%-17s %-24s %6.1f s  %s\n' "$recipe" "$variant" "$wall" "$status" >>"$LOG"
    table
}

# A kill of the whole check (the lent machine's time is up) still leaves a table that says so.
trap 'table >/dev/null 2>&1; echo "gpu_check: stopped after $(since "$START") s; table: $OUT/table.md" >&2; exit 143' TERM INT

say "$STEPS steps per run | device $DEVICE | budget $BUDGET s | output $OUT | work folder $WORK"
for entry in "${PLAN[@]}"; do
    read -r recipe variant <<<"$entry"
    case "$recipe" in
        ddp)
            if (( NPROC == 1 )); then
                note="1 nccl rank on 1 GPU: proves the plumbing (process group, DDP wrapper, checkpoints), not scaling"
            else
                note=""
            fi
            # shellcheck disable=SC2086  # the argument strings are word lists
            run_one ddp_mlp "torchrun-$BACKEND-bf16-x$NPROC" "$note" "$PYTHON" -m torch.distributed.run \
                --standalone --nproc_per_node="$NPROC" recipes/ddp_mlp.py --backend "$BACKEND" $DDP_ARGS \
                --precision bf16
            ;;
        fsdp)
            # FSDP2 (fully_shard) over nccl in bf16, once the transformer recipe takes --parallel fsdp.
            fsdp_variant="torchrun-fsdp2-bf16-x$NPROC"
            if [[ $HAS_PARALLEL != 1 ]]; then
                skip tiny_transformer "$fsdp_variant" \
                    "recipes/tiny_transformer.py has no --parallel yet (this row runs once its --help lists it)"
            else
                (( NPROC > 1 )) && note="" || note="1 rank: FSDP2 plumbing only, nothing is sharded"
                # shellcheck disable=SC2086
                run_one tiny_transformer "$fsdp_variant" "$note" "$PYTHON" -m torch.distributed.run --standalone \
                    --nproc_per_node="$NPROC" recipes/tiny_transformer.py --parallel fsdp ${ARGS[tiny_transformer]} \
                    --precision bf16 $(peak_flags tiny_transformer bf16)
            fi
            ;;
        *)
            # shellcheck disable=SC2086
            run_one "$recipe" "$variant" "" "$PYTHON" "recipes/$recipe.py" ${ARGS[$recipe]} \
                $(variant_flags "$variant") $(peak_flags "$recipe" "$variant")
            ;;
    esac
done

# ---- The table ---------------------------------------------------------------------------------------------
echo
# The table command exits 1 when any run failed or was skipped for time: so does this script.
status=0
table --final || status=$?
echo
say "table: $OUT/table.md | figures: $OUT/results.json | log: $LOG | full output: $WORK/logs | $(since "$START") s in all"
exit "$status"

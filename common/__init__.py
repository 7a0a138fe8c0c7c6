"""The shared core of torch-recipes: plain functions and small classes that every recipe calls.

cli (options, errors) · runtime (device, seed, precision) · peak_flops (what MFU is a fraction of) · loop
(train_step, evaluate, where a resumed loop is) · data (loaders, MNIST, downloads) · rundir (run directory, resume
point, "already finished") · checkpoint (atomic save, safe load, RNG, the Checkpointer) · runlog (config.json,
TensorBoard, the console, metrics.json) · stop (Ctrl-C and SIGTERM) · best (best.pt, the K best, patience) · ema (a
moving average of the weights) · profile (--profile) · resources (the memory account) · sharded (DCP checkpoints of
FSDP runs) · dcp_check (the check of a sharded save) · torchrun (its environment) · hf_gpt2 and hf_tokens (GPT-2
folders in Hugging Face's format). Recipes import names (``from common.loop import train_step``) or a module (``from
common import cli``, then ``cli.Epochs``), at their top: scripts/eject.py copies what either names.
"""

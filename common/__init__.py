"""The shared core of torch-recipes: plain functions and small classes that every recipe calls.

cli (options, errors) · runtime (device, seed, precision, peak FLOP/s) · loop (train_step, evaluate) ·
checkpoint (atomic save, safe load, RNG) · data (loaders, MNIST, downloads) · rundir (run directory, resume,
Ctrl-C and SIGTERM) · resume (what a resumed run may change) · tracking (logging, checkpoints and metrics while
training) · sharded (DCP checkpoints of FSDP runs) · resources (the memory account).
Recipes import names directly (``from common.loop import train_step``); scripts/eject.py relies on that.
"""

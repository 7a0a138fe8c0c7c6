"""DataLoaders with sound defaults, resumable shuffling, MNIST as tensors, and checked downloads.

The DataLoader's own defaults suit neither training nor reproducibility: it does not shuffle, draws its
worker seeds from the global RNG (so adding an evaluation changes the next epoch's dropout masks), and
cannot start part-way through an epoch. ``make_loader`` fixes all three.
"""

import contextlib
import gzip
import hashlib
import http.client
import itertools
import os
import shutil
import signal
import sys
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from common.cli import RecipeError
from common.rundir import remove_empty, why_not_written

MNIST_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def checksum(*tensors: torch.Tensor) -> str:
    """A checksum of a run's training data, which its checkpoints keep: a resume on other data is refused, even one
    whose epochs are as long (a table's rows replaced by as many others)."""
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def same_file(path: str | Path | None) -> str | None:
    """A data file's path as the file it names (absolute, links followed), to compare by file, not by spelling."""
    return path and str(Path(path).resolve())

class ResumableSampler(Sampler):
    """A training sampler that a resumed run can start part-way through an epoch: ``skip`` (set by
    ``common.loop.batches_left``) leaves out the epoch's first samples. The wrapped order depends on (seed, epoch)
    alone, so the resumed epoch is the interrupted one: no sample is seen twice or missed."""

    def __init__(self, sampler: Sampler):
        self.sampler, self.skip = sampler, 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return len(self.sampler) - self.skip


class TensorBatches(TensorDataset):
    """A TensorDataset whose batch is one indexing of each tensor (the DataLoader hands ``__getitems__`` the batch's
    indices) instead of a ``__getitem__`` per row and a stack: 25 ms of Python per 4,096 rows become under 2."""

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(indices)
        return tuple(t[index] for t in self.tensors)


def built_batch(batch):
    return batch  # the DataLoader's collate step, when ``__getitems__`` has already built the batch


def ignore_stop_signals(worker_id: int) -> None:
    # Ctrl-C, and a scheduler's SIGTERM, reach the whole process group; the main process saves a checkpoint and
    # stops the workers (a worker killed by the signal instead would end the run in a traceback after the save).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_loader(dataset: Dataset, batch_size: int | None, *, train: bool, seed: int = 0, num_workers: int = 0,
                device: torch.device = torch.device("cpu"), sampler: Sampler | Iterable[int] | None = None,
                collate_fn: Callable | None = None) -> DataLoader:
    """A DataLoader for training (shuffled, also on CPU; full batches only) or evaluation (in order). Training
    shuffles with a seeded one-replica ``DistributedSampler`` unless ``sampler`` is given (DDP's sharded one), in
    a ``ResumableSampler``: call ``loader.sampler.set_epoch(epoch)`` every epoch. ``collate_fn``: e.g.
    ``built_batch`` for batches a ``__getitems__`` built (a plain TensorDataset gets both, as ``TensorBatches``)."""
    worker_init_fn = ignore_stop_signals if num_workers > 0 else None
    # Its own generator for worker seeds: every new iterator draws one, and drawing from the global RNG
    # instead would shift the dropout masks of a resumed run.
    generator = torch.Generator().manual_seed(seed)
    if type(dataset) is TensorDataset and collate_fn is None:
        dataset, collate_fn = TensorBatches(*dataset.tensors), built_batch
    if train:
        # DistributedSampler's rule, a permutation seeded by seed + epoch, is what makes an epoch resumable
        sampler = ResumableSampler(sampler if sampler is not None else
                                   DistributedSampler(dataset, num_replicas=1, rank=0, seed=seed))
        if len(sampler) < batch_size:
            raise RecipeError(f"--batch-size {batch_size} is larger than the training set ({len(sampler)} samples"
                              f"{' in this process' if getattr(sampler.sampler, 'num_replicas', 1) > 1 else ''})")
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers, generator=generator,
                      worker_init_fn=worker_init_fn, collate_fn=collate_fn,
                      drop_last=train,  # equal-sized steps: a tiny last batch gives a noisy, over-weighted update
                      pin_memory=device.type == "cuda",  # page-locked memory: the copy to the GPU is asynchronous
                      persistent_workers=num_workers > 0)  # no worker start-up cost every epoch


def load_mnist(data_dir: Path, *, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST as images (N, 1, 28, 28) float32, normalised once, and labels (N,) int64: decoded and normalised up
    front instead of torchvision's per-image PIL transforms, which cost more CPU than a small CNN's forward."""
    from torchvision.datasets import MNIST  # imported here: only the MNIST recipes need torchvision

    raw = Path(data_dir).resolve() / "MNIST" / "raw"
    created = [d for d in [raw, *raw.parents] if not d.exists()]
    there = all((raw / name).exists() for name in MNIST_FILES)  # nothing to write: no lock (a read-only share)
    legacy = all((raw.parent / "processed" / f).is_file() for f in ("training.pt", "test.pt"))  # older torchvision's
    read = raw.parent / "processed" if legacy else raw  # where MNIST() reads (its older files first)
    try:
        if not (there or legacy):
            raw.mkdir(parents=True, exist_ok=True)
            with one_at_a_time(raw):  # torchrun's ranks: one fetches the files, the others find them there
                fetch_mnist(raw)
        dataset = MNIST(str(data_dir), train=train)
    except RecipeError:
        remove_empty(created)
        raise
    except (OSError, RuntimeError) as err:
        if legacy or all((raw / name).exists() for name in MNIST_FILES):
            raise RecipeError(f"MNIST files in {read} are unreadable ({err}); delete them to download again") from None
        remove_empty(created)  # a file where a folder on its way should be, say ("Not a directory" says nothing)
        reason = why_not_written(raw, err) if isinstance(err, OSError) else err
        raise RecipeError(f"cannot put MNIST in {raw}: {reason}") from None
    except Exception as err:  # torchvision signals malformed IDX files with assorted exception types
        raise RecipeError(f"MNIST files in {read} are corrupt ({type(err).__name__}: {err}); delete them to "
                          "download again") from None
    data, labels = dataset.data, dataset.targets  # well-formed IDX files may still not be MNIST's
    labelled = len(labels) == len(data) and (not len(labels) or 0 <= labels.min() <= labels.max() <= 9)
    if data.shape[1:] != (28, 28) or not labelled:
        raise RecipeError(f"MNIST files in {read} hold {len(data)} images of {tuple(data.shape[1:])} pixels and "
                          f"{len(labels)} labels, not 28x28 digits labelled 0-9; delete them to download again")
    if train and len(labels) < 2:  # a run holds out at least one to validate on (no IDX file holds none)
        raise RecipeError(f"MNIST files in {read} hold 1 training digit: too few to train and validate on; delete "
                          "them to download again")
    # uint8 (N, 28, 28) -> float32 (N, 1, 28, 28): a channel axis for the convolutions, values standardised
    images = (data.unsqueeze(1).float() / 255 - MNIST_MEAN) / MNIST_STD
    return images, labels


def fetch_mnist(raw: Path) -> None:
    """Each MNIST file missing from ``raw``: decompressed from its .gz there, else from one downloaded (checked
    against its published MD5). Nothing there is written over: torchvision's ``download=True`` would download all
    four files again over a folder that lacks one, the user's own files too."""
    from torchvision.datasets import MNIST

    given = any((raw / name).exists() or (raw / f"{name}.gz").exists() for name in MNIST_FILES)
    for name in MNIST_FILES:
        packed = raw / f"{name}.gz"
        if (raw / name).exists():
            continue
        for mirror in MNIST.mirrors if not packed.exists() else []:  # the next mirror if one fails
            if mirror == MNIST.mirrors[0] and given:  # beside a user's own files (Fashion-MNIST, say): mixed
                print(f"note: {raw} lacks {name}: downloading MNIST's", file=sys.stderr)
            try:
                download(mirror + packed.name, packed, dict(MNIST.resources)[packed.name])
                break
            except RecipeError as err:
                if mirror == MNIST.mirrors[-1]:
                    lacks = [n for n in MNIST_FILES if not (raw / n).exists() and not (raw / f"{n}.gz").exists()]
                    raise RecipeError(f"{raw} lacks {', '.join(lacks)} (or their .gz), and {err}") from None
        tmp = raw / f".{name}.tmp"
        try:
            with gzip.open(packed) as source, open(tmp, "wb") as out:
                shutil.copyfileobj(source, out)
            tmp.replace(raw / name)  # whole, or not there
        except (EOFError, zlib.error, gzip.BadGzipFile) as err:
            raise RecipeError(f"{packed} is not a whole gzip file ({err}); delete it to download it again") from None
        except OSError as err:  # a full disk, a read-only folder
            raise RecipeError(f"cannot decompress {packed}: {why_not_written(raw, err)}") from None
        finally:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def one_at_a_time(folder: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder`` while the block runs, waiting for it: processes that would write the
    same files (torchrun's ranks fetching MNIST) take turns, and the later ones find them there. The kernel drops
    it with its process. (No flock on Windows, nor where the file system has none: then no lock.)"""
    fd = None
    if sys.platform != "win32":
        import fcntl

        with contextlib.suppress(OSError):  # a folder that cannot be listed; ENOLCK on some network file systems
            fd = os.open(folder, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def download(url: str, dest: Path, md5: str) -> Path:
    """Download ``url`` to ``dest`` unless a file with the right MD5 is already there (the checksum the
    data set's publishers and torchvision use; it guards against truncated or altered files)."""
    if dest.is_file() and _md5(dest) == md5:
        return dest
    created = [d for d in [dest.parent, *dest.parent.parents] if not d.exists()]
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file where the folder should be ("File exists" says nothing)
        raise RecipeError(f"cannot download to {dest.parent}: {why_not_written(dest.parent, err)}") from None
    tmp = dest.with_name(f".{dest.name}.part")
    try:
        with urllib.request.urlopen(url, timeout=30) as response, open(tmp, "wb") as f:
            shutil.copyfileobj(response, f)
    except BaseException as err:  # Ctrl-C and SIGTERM too: no part file or new folder is left
        tmp.unlink(missing_ok=True)
        remove_empty(created)
        if not isinstance(err, urllib.error.URLError | OSError | http.client.HTTPException):  # a cut-off response
            raise
        reason = getattr(err, "reason", err)
        found = f"{dest} exists but its checksum is not the published one; " if dest.exists() else ""
        raise RecipeError(f"{found}could not download {url} ({reason}); offline? place the file at {dest}") from None
    if _md5(tmp) != md5:
        tmp.unlink()
        raise RecipeError(f"{url} downloaded with a wrong checksum; place a good copy at {dest}")
    tmp.replace(dest)
    return dest


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def synthetic_classification(n: int, n_features: int, n_classes: int, *, seed: int, task_seed: int = 0):
    """A learnable data set that needs no download: Gaussian inputs (drawn with ``seed``) labelled by a
    fixed random two-layer "teacher" network (drawn with ``task_seed``: keep it equal across splits).
    Recipes about speed (precision, compilation) use it so that they run anywhere."""
    teacher = torch.Generator().manual_seed(task_seed)
    w1 = torch.randn(n_features, 4 * n_classes, generator=teacher) / n_features**0.5
    w2 = torch.randn(4 * n_classes, n_classes, generator=teacher)
    x = torch.randn(n, n_features, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (torch.tanh(x @ w1) @ w2).argmax(dim=1))

"""Write MNIST-format (IDX) files, e.g. to split the official test set into a small train/test pair.

    python benchmarks/mnist_files.py split MNIST_DIR /tmp/mnist8k --train 8000 [--seed 0]

MNIST_DIR holds the official test set, t10k-{images-idx3,labels-idx1}-ubyte.gz (as torchvision leaves them
in data/MNIST/raw);
it writes /tmp/mnist8k/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte, the layout
torchvision.datasets.MNIST reads, so any recipe can use it with --data-dir /tmp/mnist8k.
The tests use ``write_idx`` to build tiny MNIST data sets in the real format.
"""

import gzip
import struct
import sys
from pathlib import Path

import numpy as np

IDX_DTYPE_CODE = 0x08  # unsigned byte: the only element type MNIST uses


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX: two zero bytes, a dtype code, the number of dimensions, each dimension as big-endian uint32,
    then the raw bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, IDX_DTYPE_CODE, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + array.tobytes())


def read_idx(path: Path) -> np.ndarray:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    _, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if dtype_code != IDX_DTYPE_CODE:
        raise ValueError(f"{path}: not a uint8 IDX file")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def write_mnist(root: Path, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray]) -> Path:
    """Write (images, labels) pairs where torchvision.datasets.MNIST(root) finds them; returns the raw folder."""
    raw = root / "MNIST" / "raw"
    for prefix, (images, labels) in [("train", train), ("t10k", test)]:
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return raw


def split_test_set(source: Path, dest: Path, n_train: int, seed: int | None = None) -> Path:
    """The first ``n_train`` digits of the official test set as a training set, the rest as its test set;
    with ``seed``, the digits are shuffled (a seeded permutation) first. Unshuffled, the test half is the
    harder one: MNIST's last 5,000 test digits were written by students, the first 5,000 by census staff."""
    images = read_idx(source / "t10k-images-idx3-ubyte.gz")
    labels = read_idx(source / "t10k-labels-idx1-ubyte.gz")
    if seed is not None:
        order = np.random.default_rng(seed).permutation(len(labels))
        images, labels = images[order], labels[order]
    return write_mnist(dest, (images[:n_train], labels[:n_train]), (images[n_train:], labels[n_train:]))


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "split":
        sys.exit("usage: python benchmarks/mnist_files.py split SOURCE_DIR DEST_DIR [--train N] [--seed S]")
    n = int(sys.argv[sys.argv.index("--train") + 1]) if "--train" in sys.argv else 8000
    seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else None
    print(split_test_set(Path(sys.argv[2]), Path(sys.argv[3]), n, seed))

"""docs/guide.md's "Concepts → where to read them" table names files and definitions that exist."""

import ast
import re

from conftest import ROOT

README = (ROOT / "docs" / "guide.md").read_text()
SECTION = README.split("## Concepts → where to read them", 1)[1].split("\n## ", 1)[0]
REFERENCES = re.findall(r"`([\w/]+\.py)::([\w.]+)`", SECTION)
CONCEPTS = ["tensors and dtypes", "device moves", "memory accounting", "autograd and gradient accumulation",
            "`no_grad` and `detach`", "broadcasting", "`view` vs `reshape`", "einsum", "`nn.Module` rules",
            "the hand-written Linear", "buffers", "map-style and iterable datasets", "DataLoader settings",
            "optimizers and parameter groups", "schedulers", "the training step and loop",
            "checkpoints with RNG state", "mixed precision (AMP)", "`torch.compile`", "DistributedDataParallel"]


def definitions(path) -> set[str]:
    """Top-level functions and classes, and Class.method for their methods."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{item.name}" for item in node.body if isinstance(item, ast.FunctionDef)}
    return names


def test_every_concept_has_a_row():
    rows = [line.split("|")[1].strip() for line in SECTION.splitlines() if line.startswith("| ")]
    assert rows[1:] == CONCEPTS  # rows[0] is the header


def test_every_reference_exists():
    """Every row names a definition, and every code span naming a .py file is one FILE::NAME that exists (one in
    another form was skipped, unchecked)."""
    rows = [line.split("|")[2] for line in SECTION.splitlines() if line.startswith("| ")][1:]
    assert all(re.search(r"`[\w/]+\.py::[\w.]+`", row) for row in rows), rows
    spans = re.findall(r"`([^`]*\.py[^`]*)`", SECTION)
    unread = [span for span in spans if not re.fullmatch(r"[\w/]+\.py::[\w.]+", span)]
    assert not unread and len(REFERENCES) >= len(CONCEPTS), unread
    for file, name in REFERENCES:
        path = ROOT / file
        assert path.is_file(), file
        assert name in definitions(path), f"{file}::{name}"

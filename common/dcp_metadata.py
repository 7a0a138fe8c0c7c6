"""A DCP checkpoint's ``.metadata`` read without running anything in it. DCP unpickles that file with plain
``pickle``, so a step folder from elsewhere could run code when loaded, which ``weights_only=True`` rules out for
the ``.pt`` files. Read here first, with only DCP's own classes and a few of torch's allowed, it is refused unrun."""

import dataclasses
import enum
import pickle
from pathlib import Path

import torch

from common.cli import RecipeError

SAFE = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PurePath")}


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or module == "torch" or (module, name) in SAFE:
            found = super().find_class(module, name)  # a torch module is imported already
            # DCP's dataclasses and enums (records, not a writer or a planner), torch's dtypes, or one of SAFE
            record = isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
            if record and module != "torch" or isinstance(found, torch.dtype) or (module, name) in SAFE:
                return found
        raise pickle.UnpicklingError(f"it names {module}.{name}, which no DCP metadata holds")


def check_dcp_metadata(path: Path) -> None:
    """Refuse, as a RecipeError, a ``.metadata`` that is not DCP's plain metadata (code, or no pickle at all)."""
    try:
        with open(path, "rb") as f:
            MetadataUnpickler(f).load()
    except Exception as err:  # noqa: BLE001 - whatever a damaged or foreign file raises, it is refused alike
        raise RecipeError(f"{path} is not DCP checkpoint metadata ({err}): refused before DCP loads it, which would "
                          "run any code in it (a checkpoint from elsewhere, or damaged)") from None

"""A DCP step folder checked against its ``.metadata`` before DCP reads it: all there, and only data. DCP
unpickles ``.metadata`` with plain ``pickle``, and the values it keeps as bytes (the optimizer's lr and betas) with
``weights_only=False``, so a step folder from elsewhere could run code when loaded, as ``weights_only=True`` rules
out for the ``.pt`` files. Read here first (only DCP's records and a few of torch's allowed), it is refused unrun."""

import dataclasses
import enum
import io
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from common.cli import RecipeError

SAFE = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PurePath")}
REFUSED = "refused before DCP loads it, which would run any code in it (a checkpoint from elsewhere, or damaged)"


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or module == "torch" or (module, name) in SAFE:
            found = super().find_class(module, name)  # a torch module is imported already
            # DCP's dataclasses and enums (records, not a writer or a planner), torch's dtypes, or one of SAFE
            record = isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
            if record and module != "torch" or isinstance(found, torch.dtype) or (module, name) in SAFE:
                return found
        raise pickle.UnpicklingError(f"it names {module}.{name}, which no DCP metadata holds")


def read_dcp_metadata(path: Path) -> Metadata:
    """A ``.metadata`` file's contents, or a RecipeError if it is not DCP's plain metadata (code, or no pickle)."""
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("it holds no DCP Metadata")
        files = [(where.relative_path, where.offset, where.length) for where in metadata.storage_data.values()]
        if not all(isinstance(path, str) and offset >= 0 and length >= 0 for path, offset, length in files):
            raise pickle.UnpicklingError("its storage_data names no files")  # what the checks below read
        return metadata
    except Exception as err:  # noqa: BLE001 - whatever a damaged or foreign file raises, it is refused alike
        raise RecipeError(f"{path} is not DCP checkpoint metadata ({err}): {REFUSED}") from None


def missing_shard(folder: Path, metadata) -> str | None:
    """What a step folder lacks of the shard files its ``.metadata`` names (a copy in progress, a lost file)."""
    for where in metadata.storage_data.values():
        shard = folder / where.relative_path
        if not shard.is_file():
            return f"its {where.relative_path} is missing"
        if shard.stat().st_size < where.offset + where.length:
            return f"its {where.relative_path} is cut short"
    return None


def incomplete(step_dir: Path) -> str | None:
    """What a step folder lacks (a copy in progress, a lost file): trainer.pt, .metadata, or a shard file, whole;
    None: nothing (a damaged .metadata too, which loading the folder refuses, saying why)."""
    if not (step_dir / ".metadata").is_file() or not (step_dir / "trainer.pt").is_file():
        return "no .metadata or trainer.pt"
    try:
        return missing_shard(step_dir, read_dcp_metadata(step_dir / ".metadata"))
    except RecipeError:
        return None


def check_dcp_folder(folder: Path) -> None:
    """Refuse, as a RecipeError, a step folder whose ``.metadata`` is not DCP's, whose shards are not all there, or
    that stores as bytes anything ``torch.load(..., weights_only=True)`` refuses."""
    metadata = read_dcp_metadata(folder / ".metadata")
    if missing := missing_shard(folder, metadata):
        raise RecipeError(f"checkpoint {folder} is incomplete: {missing} (a copy in progress, or a lost file)")
    for index, where in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            with open(folder / where.relative_path, "rb") as f:
                f.seek(where.offset)
                value = io.BytesIO(f.read(where.length))
            try:
                torch.load(value, weights_only=True)
            except Exception as err:  # noqa: BLE001 - as above
                code = re.search(r"GLOBAL (\S+)", str(err))  # as common/checkpoint.py's load_checkpoint says it
                reason = f"it refers to Python code ({code.group(1)})" if code else "it is corrupt"
                raise RecipeError(f"{folder / where.relative_path} holds {index.fqn} as a pickle of more than data "
                                  f"({reason}): {REFUSED}") from None

"""A model directory read without its weights: ``config.json`` and the safetensors headers and index
give every tensor's name, dtype and shape and the checkpoint's size, so ``plan`` runs in a second for
a 70B model without torch, even with shard files absent."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.jobfile.bounds import json_loads

#: Refuse headers larger than this: a real one is a few MB even for thousands of tensors.
MAX_HEADER_BYTES = 100 << 20
_SIZES = {8: "F64 I64 U64", 4: "F32 I32 U32", 2: "F16 BF16 I16 U16", 1: "F8_E4M3 F8_E5M2 I8 U8 BOOL"}
DTYPE_BYTES = {dtype: size for size, names in _SIZES.items() for dtype in names.split()}


class ModelFilesError(ValueError):
    """A model directory that cannot be read: the message names the file and the fix."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES.get(self.dtype, 2)


@dataclass(frozen=True)
class ModelFiles:
    """What a model directory says about itself, weights unread. ``tensors`` is empty when no
    safetensors header could be read (index without shards, a .bin checkpoint); ``checkpoint_bytes``
    then comes from the index's ``total_size`` or the file sizes (None: nothing tells it)."""

    config: Mapping[str, Any]
    tensors: Mapping[str, TensorInfo] = field(default_factory=dict)
    checkpoint_bytes: int | None = None
    largest_shard_bytes: int = 0
    notes: tuple[str, ...] = ()

    @property
    def has_lm_head(self) -> bool | None:
        """Whether the checkpoint stores a separate LM head; None when no names are known."""
        return any(name.endswith("lm_head.weight") for name in self.tensors) if self.tensors else None


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares, from its header alone."""
    try:
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ModelFilesError(f"{path}: shorter than a safetensors header; is the download complete?")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise ModelFilesError(f"{path}: header of {length} bytes; not a safetensors file")
            raw = handle.read(length)
    except OSError as error:
        raise ModelFilesError(f"{path}: cannot read ({error.strerror})") from error
    if len(raw) < length:
        raise ModelFilesError(f"{path}: header cut short; is the download complete?")
    try:
        header = json_loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ModelFilesError(f"{path}: header is not JSON ({error}); not a safetensors file") from error
    if not isinstance(header, dict):
        raise ModelFilesError(f"{path}: header is not a JSON object; not a safetensors file")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or "dtype" not in entry or not isinstance(entry.get("shape"), list):
            raise ModelFilesError(f"{path}: tensor {name!r} has no dtype/shape; not a safetensors file")
        tensors[name] = TensorInfo(str(entry["dtype"]), tuple(int(s) for s in entry["shape"]))
    return tensors


def read_model_files(directory: str | Path) -> ModelFiles:
    """``config.json`` plus the safetensors index and headers of ``directory``."""
    root = Path(directory)
    config = _read_json(root / "config.json")
    if not isinstance(config, dict):
        raise ModelFilesError(f"{root / 'config.json'}: not a JSON object")
    index_path, single = root / "model.safetensors.index.json", root / "model.safetensors"
    if not index_path.is_file() and single.is_file():
        nbytes = single.stat().st_size
        return ModelFiles(config, read_header(single), nbytes, nbytes)
    if not index_path.is_file():
        bins = sorted(root.glob("*.bin"))
        total = sum(p.stat().st_size for p in bins) or None
        note = "no safetensors files: tensor names unknown" + ("" if total else ", checkpoint size unknown")
        return ModelFiles(config, {}, total, max((p.stat().st_size for p in bins), default=0), (note,))
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ModelFilesError(f"{index_path}: no weight_map; not a safetensors index")
    metadata = index.get("metadata") or {}
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    shards = sorted(set(map(str, weight_map.values())))
    missing = [shard for shard in shards if not (root / shard).is_file()]
    present = [root / shard for shard in shards if shard not in missing]
    tensors = {name: info for path in present for name, info in read_header(path).items()}
    largest = max((path.stat().st_size for path in present), default=0)
    notes: tuple[str, ...] = ()
    if missing:
        notes = (f"{len(missing)} shard(s) not present ({missing[0]}, ...): sizes from the index",)
        tensors = {}  # a partial tensor list would mislead more than none
    size = int(total) if isinstance(total, (int, float)) else sum(t.nbytes for t in tensors.values()) or None
    return ModelFiles(config, tensors, size, largest, notes)


def _read_json(path: Path) -> Any:
    try:
        return json_loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        fix = "point model.path at a Hugging Face model directory"
        raise ModelFilesError(f"{path}: no {path.name}; {fix}") from None
    except OSError as error:
        raise ModelFilesError(f"{path}: cannot read ({error.strerror})") from error
    except ValueError as error:
        raise ModelFilesError(f"{path}: not valid JSON ({error})") from error

"""``model.path`` as a hub id (``org/name``), resolved to its snapshot in the local HF cache; it is
downloaded only with ``model.allow_download: true`` on a machine that is not offline. The child
trains from that fixed snapshot and never touches the network."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from qlora_supervise.supervisor.jobfile.problems import job_error

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: What a download fetches: the config, the tokenizer and the safetensors weights, nothing else.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def looks_like_hub_id(value: str, job_dir: Path) -> bool:
    """``org/name`` that is not a path the job file could mean."""
    return bool(_HUB_ID.match(value)) and not (job_dir / value).exists() and not value.startswith(".")


def resolve_hub_id(repo_id: str, allow_download: bool) -> str:
    """The snapshot directory of ``repo_id``; raises the job error that says how to get it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    with contextlib.suppress(LocalEntryNotFoundError):
        return str(snapshot_download(repo_id, local_files_only=True))
    cache = constants.HF_HUB_CACHE
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if not allow_download or offline:
        why = "the machine is offline (HF_HUB_OFFLINE)" if offline else "model.allow_download is false"
        raise job_error(
            f"hub id {repo_id!r} is not in the local Hugging Face cache ({cache}) and {why}",
            f"download it first (`hf download {repo_id}`), set model.allow_download: true on a machine "
            "with network, or give a local model directory",
        )
    try:
        return str(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS))
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise job_error(
            f"hub id {repo_id!r} is not in the cache ({cache}) and the download failed: {error}",
            "check the id, the network and the token (`hf auth login` if gated), or give a local directory",
        ) from None


def describe(model_dir: str) -> str:
    """``org/name @ 1a2b3c4d5e6f (hub cache: <dir>)`` for a snapshot, else the directory itself."""
    parts = Path(model_dir).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        repo = parts[-3].removeprefix("models--").replace("--", "/", 1)
        return f"{repo} @ {parts[-1][:12]} (hub cache: {model_dir})"
    return model_dir

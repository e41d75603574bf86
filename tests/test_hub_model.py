"""model.path as a hub id, resolved through a local Hugging Face cache (no network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from huggingface_hub import scan_cache_dir
from huggingface_hub.file_download import repo_folder_name

from qlora_supervise.supervisor.commands.cli import main
from qlora_supervise.supervisor.jobfile import JobError, load_job

SHA = "0123456789abcdef0123456789abcdef01234567"
CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128}


def _cache(hf_home: Path, repo_id: str) -> Path:
    """A hub cache with one snapshot in huggingface_hub's layout: blobs, snapshot symlinks, refs/main."""
    repo = hf_home / "hub" / repo_folder_name(repo_id=repo_id, repo_type="model")
    blob = repo / "blobs" / "c0ffee"
    blob.parent.mkdir(parents=True)
    blob.write_text(json.dumps(CONFIG))
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(Path("../../blobs/c0ffee"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return snapshot


def _job(tmp_path: Path, model: str, **model_fields: object) -> Path:
    (tmp_path / "data.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump({"model": {"path": model, **model_fields}, "data": {"path": "data.jsonl"}})
    )
    return path


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(home / "hub"))
    return home


def test_a_cached_hub_id_resolves_to_its_snapshot_and_validate_names_it(
    tmp_path: Path, hf_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """org/name in the cache becomes the snapshot directory; validate prints the id and the revision."""
    snapshot = _cache(hf_home, "lab-org/tiny-llama")
    repos = scan_cache_dir(hf_home / "hub").repos
    assert [(r.repo_id, [rev.commit_hash for rev in r.revisions]) for r in repos] == [
        ("lab-org/tiny-llama", [SHA])
    ]
    job = load_job(_job(tmp_path, "lab-org/tiny-llama"))
    assert Path(job.knobs.model) == snapshot
    assert main(["validate", str(tmp_path / "job.yaml")]) == 0
    assert f"model: lab-org/tiny-llama @ {SHA[:12]} (hub cache: {snapshot})" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("offline", "allow", "why"), [("1", True, "offline"), ("0", False, "allow_download is false")]
)
def test_an_uncached_hub_id_is_refused_with_the_way_to_get_it(
    tmp_path: Path, hf_home: Path, monkeypatch: pytest.MonkeyPatch, offline: str, allow: bool, why: str
) -> None:
    """Not cached, and offline or not allowed to download: a problem at model.path naming the fix."""
    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    with pytest.raises(JobError) as caught:
        load_job(_job(tmp_path, "lab-org/not-here", allow_download=allow))
    (problem,) = caught.value.problems
    text = problem.render()
    assert "model.path" in text and why in text and "hf download lab-org/not-here" in text


def test_a_local_directory_named_like_a_hub_id_stays_a_directory(tmp_path: Path, hf_home: Path) -> None:
    """org/name that exists next to the job file is that directory, not a hub lookup."""
    local = tmp_path / "lab-org" / "tiny-llama"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps(CONFIG))
    assert Path(load_job(_job(tmp_path, "lab-org/tiny-llama")).knobs.model) == local

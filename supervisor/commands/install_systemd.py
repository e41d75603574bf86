"""``qlora-supervise install-systemd JOB [--user | --system] [--force] [--root DIR]``: writes the template
unit (package data) rendered for this machine and the job, with every path made absolute, as
``<config>/qlora-supervise/<name>.yaml`` (``<config>``: ``/etc``, or ``$XDG_CONFIG_HOME`` for ``--user``;
all under ``--root`` if given), then prints the ``systemctl`` lines to run. Existing files are never
overwritten without ``--force``: a unit edited by an admin is theirs. A user unit drops
``User=``/``Group=`` and the sandboxing that needs a privileged manager."""

from __future__ import annotations

import contextlib
import getpass
import os
import pwd
import shutil
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from qlora_supervise.supervisor.commands import BadInput
from qlora_supervise.supervisor.commands.validate import load_or_exit
from qlora_supervise.supervisor.facts.trainer import OWN
from qlora_supervise.supervisor.jobfile import Job
from qlora_supervise.supervisor.trainers.trainer import tool_job_copy

UNIT_NAME = "qlora-supervise@.service"
ENV_NAME = "qlora-supervise.env"
ENV_EXAMPLE = "qlora-supervise.env.example"
#: Seconds systemd waits beyond the child's checkpoint grace before SIGKILL (the supervisor's
#: own exit and the journal's fsync come after the child's save).
STOP_MARGIN_S = 120
#: Settings a user manager cannot apply (no privileges to switch users, mount or filter devices):
#: these, and every ``Protect*``, ``Private*`` and ``Device*`` sandboxing key.
SYSTEM_ONLY = frozenset({"User", "Group", "ReadWritePaths", "CapabilityBoundingSet", "AmbientCapabilities"})
SYSTEM_ONLY_PREFIXES = ("Protect", "Private", "Device")


def install_systemd_command(
    job_path: str,
    user_mode: bool = False,
    force: bool = False,
    root: str | None = None,
    name: str | None = None,
    service_user: str | None = None,
) -> int:
    """Write the unit, the job copy and (once) the environment file; print what to run next."""
    job = load_or_exit(job_path, head="not installed")
    instance = name or Path(job_path).stem
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") if user_mode else Path("/etc")
    config = (Path(root) if root else Path("/")) / config.relative_to(config.anchor)
    unit_file = config / "systemd" / ("user" if user_mode else "system") / UNIT_NAME
    job_file, env = config / "qlora-supervise" / f"{instance}.yaml", config / "qlora-supervise" / ENV_NAME
    if (existing := [p for p in (unit_file, job_file) if p.exists()]) and not force:
        raise BadInput(f"refusing to overwrite {', '.join(map(str, existing))}: pass --force to replace them")
    # The user who asked (through sudo too); root is never the default service user.
    user = service_user or os.environ.get("SUDO_USER") or getpass.getuser()
    user = "qlora" if user == "root" and not service_user else user
    unit_text = render_unit(_packaged(UNIT_NAME), job, user_mode, user)
    _write(unit_file, unit_text)
    _write(job_file, job_copy(job))
    if not env.exists():  # the shared environment file is the admin's after the first write
        _write(env, _packaged(ENV_EXAMPLE))
    tools = ("systemctl --user", "journalctl --user") if user_mode else ("sudo systemctl", "journalctl")
    systemctl, journalctl = tools
    unit = f"qlora-supervise@{instance}"
    print(
        f"\nnext:\n"
        f"  {systemctl} daemon-reload\n"
        f"  {systemctl} enable --now {unit}\n"
        f"  {systemctl} status {unit}\n"
        f"  {journalctl} -u {unit} -f            # -p warning: retries and give-ups only\n"
        f"  qlora-supervise status {job.output_dir}\n"
        f"edit {env} for PATH, HF_HOME and CUDA_VISIBLE_DEVICES first."
    )
    if not user_mode:
        for line in service_warnings(job, user, unit_text):
            print(line)
    return 0


def service_warnings(job: Job, user: str, unit_text: str) -> list[str]:
    """What stops a system unit before its first step: a ``User=`` with no such account, and the
    job's files under /tmp, which ``PrivateTmp=yes`` replaces with an empty folder of the unit's own."""
    lines = []
    try:
        pwd.getpwnam(user)
    except KeyError:
        lines.append(
            f"warning: the unit runs as User={user}, and there is no such user here: create it first "
            f"(`sudo useradd --system --create-home {user}`) and give it read access to the model and "
            f"data and write access to {job.output_dir}, or install with --service-user NAME"
        )
    # The job's paths the service must see: its model, data, output_dir and a tool's config.
    named = (("model", job.knobs.model), ("data.path", job.data.path), ("data.eval_path", job.data.eval_path))
    paths = [(field, value) for field, value in named if value and value.startswith("/")]
    if "\nPrivateTmp=yes" in "\n" + unit_text:
        for field, path in [("output_dir", str(job.output_dir)), *paths, *job.trainer.service_paths()]:
            real = Path(os.path.realpath(path))
            tmp = next((t for t in ("/tmp", "/var/tmp") if real == Path(t) or Path(t) in real.parents), None)
            if tmp is not None:
                lines.append(
                    f"warning: {field} is under {tmp} ({path}), which the unit's PrivateTmp=yes hides (the "
                    "service gets an empty /tmp of its own): move it out of /tmp (for example to "
                    "/srv/qlora), or remove PrivateTmp=yes from the unit"
                )
    return lines


def _packaged(name: str) -> str:
    """A file of the unit's package data (``systemd/`` of the clone, ``qlora_supervise/systemd`` of a
    wheel); an editable install made before ``systemd/`` was a package reads it from the clone."""
    with contextlib.suppress(ModuleNotFoundError, FileNotFoundError):
        return (resources.files("qlora_supervise.systemd") / name).read_text(encoding="utf-8")
    beside = Path(__file__).resolve().parents[2] / "systemd" / name
    try:
        return beside.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(
            f"the packaged {name} is missing from this installation (looked in qlora_supervise.systemd "
            f"and {beside.parent}): reinstall qlora-supervise",
        ) from None


def render_unit(template: str, job: Job, user_mode: bool, service_user: str) -> str:
    """The template with this machine's executable, user, stop timeout and writable paths."""
    cli = "qlora_supervise.supervisor.commands.cli"
    executable = shutil.which("qlora-supervise") or f"{sys.executable} -m {cli}"
    out: list[str] = []
    for line in template.splitlines():
        key = line.split("=", 1)[0] if "=" in line and not line.startswith("#") else ""
        if user_mode and (key in SYSTEM_ONLY or key.startswith(SYSTEM_ONLY_PREFIXES)):
            continue
        if user_mode:  # %E: the user manager's config directory ($XDG_CONFIG_HOME)
            line = line.replace("/etc/qlora-supervise/", "%E/qlora-supervise/")
        if key in ("User", "Group"):
            line = f"{key}={service_user}"
        elif key == "ExecStart":
            line = line.replace("/usr/bin/env qlora-supervise", executable)
        elif key == "TimeoutStopSec":
            line = f"TimeoutStopSec={int(job.supervise.stop_grace) + STOP_MARGIN_S}"
        elif key == "WantedBy" and user_mode:
            line = "WantedBy=default.target"
        out.append(line)
        if key == "ReadWritePaths" and line.endswith("/srv/qlora"):
            out.append(f"ReadWritePaths={job.output_dir}")
    return "\n".join(out) + "\n"


def job_copy(job: Job) -> str:
    """The job as submitted, with its paths absolute (the copy lives in another directory)."""
    raw: dict[str, Any] = yaml.safe_load(job.raw_text)
    if job.trainer.kind != OWN:  # a tool's job: its own paths (supervisor/trainers/)
        return tool_job_copy(job, raw)
    model, base = raw["model"], job.job_file.parent
    if isinstance(model.get("path"), str) and (base / model["path"]).exists():
        model["path"] = str((base / model["path"]).resolve())  # a hub id stays a hub id
    if model.get("fallbacks"):
        model["fallbacks"] = list(job.fallback_models)
    raw["data"]["path"] = job.data.path
    if job.data.eval_path is not None:
        raw["data"]["eval_path"] = job.data.eval_path
    raw["output_dir"] = str(job.output_dir)
    header = f"# installed by qlora-supervise install-systemd from {job.job_file}\n"
    return header + yaml.safe_dump(raw, sort_keys=False)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")

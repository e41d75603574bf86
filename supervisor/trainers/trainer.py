"""A tool the user already runs, as the job's :class:`~...facts.trainer.Trainer`. The supervisor never
imports the tool: it reads the user's config once (YAML, or an hf-script's flags), writes each attempt's
config with the ladder's changes into the attempt's directory (``<kind>.yaml`` or ``command.json``; the
user's file is never touched) beside ``trainer-config.diff`` (``key: old -> new`` lines that ``status``
prints), and starts the tool with the shim on its ``PYTHONPATH``. A ``script`` attempt gets
``script-knobs.json`` instead: the knobs the shim changes where the script builds them, learnt from what
earlier attempts reported it asks for."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies.rungs import DEFAULT_LADDERS
from qlora_supervise.supervisor.facts.trainer import Ladders, Trainer
from qlora_supervise.supervisor.jobfile.advice import Advice
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.jobfile.problems import Problem, show
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.generations import TOOL_CONFIG, TOOL_CONFIG_PREFIX
from qlora_supervise.supervisor.record.rundir import TRAINER_OUTPUT, AttemptDir, ensure_dir
from qlora_supervise.supervisor.trainers import flags, model_facts
from qlora_supervise.supervisor.trainers.mapping import attempt_config, config_diff, flatten, unmapped_changes
from qlora_supervise.supervisor.trainers.tool import RUNG_KNOBS, Table, Tool, rungs_for, writable
from qlora_supervise.trainer_child.contract import processes, script_knobs
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.durable import write_text_atomic
from qlora_supervise.trainer_child.contract.events import ScriptKnobs, Started, parse_event, read_events
from qlora_supervise.trainer_child.contract.script_knobs import CHANGES_FILE, ScriptChanges
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, Knobs

DIFF_NAME = "trainer-config.diff"
#: The same name as trainer_child.shim.SHIM_SPEC_ENV (tests/test_trainer_shim.py checks they agree).
SHIM_SPEC_ENV = "QLORA_SUPERVISE_SHIM_SPEC"
SHIM_SITE = Path(processes.__file__).resolve().parent.parent / "shim" / "site"
SHIM_SILENT = (
    "the trainer's process wrote none of our events (no `started` line in {events}): the shim did "
    "not attach (is qlora-supervise importable by {python}? does the tool build a transformers "
    "Trainer?), so this attempt is classified from its stderr tail alone"
)
SHIM_PACKAGE = "qlora_supervise"
_PROBE = (
    "import importlib.util, sys; "
    "print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))"
)


class UnmappedKnobsError(RuntimeError):
    """The policy changed a knob the tool's config has no key for: a bug, never journalled as run."""


@dataclass(frozen=True)
class ToolTrainer:
    """A tool that is not ours. ``config``: the user's file (or an hf-script's flags), read once."""

    tool: Tool
    config: Mapping[str, Any]
    config_path: Path | None = None  # None: hf-script (its config is on the command line)
    command: tuple[str, ...] = ()  # hf-script: the user's argv
    python: str = sys.executable  # the interpreter of the tool's venv
    workdir: Path | None = None  # where the tool runs (None: the job file's folder)

    spare = False  # a spare holds our trainer's imports, not the tool's

    @property
    def kind(self) -> str:
        return self.tool.kind

    def unread_keys(self) -> dict[str, Any]:
        """The config's keys (dotted where nested) that the supervisor reads into no knob or field."""
        table = self.tool.table
        read = {key for row in table.rows for key in (row.key, *row.preferred)}
        read |= {table.max_steps_key, table.epochs_key, table.save_steps_key, table.targets_key}
        read |= {table.data_key, table.output_key, table.resume_key}
        return {key: value for key, value in flatten(self.config).items() if key not in read}

    def config_view(self) -> dict[str, Any]:
        """``trainer.config`` (the file, or the argv) and ``trainer.config.<key>`` per unread key."""
        where = str(self.config_path) if self.config_path is not None else list(self.command)
        unread = {f"{TOOL_CONFIG_PREFIX}{key}": value for key, value in self.unread_keys().items()}
        return {TOOL_CONFIG: where, **unread}

    def rungs(self) -> frozenset[str]:
        return rungs_for(self.tool.table, self.config) | self.tool.shim_rungs

    def ladders(self, overrides: Ladders) -> dict[FailureKind, tuple[str, ...]]:
        """Every stage ladder (the job's override, else the default) with only the tool's rungs: a rung
        it cannot take would change our journal while the tool trained on as before."""
        allowed = self.rungs()
        kinds = {**DEFAULT_LADDERS, **overrides}
        return {kind: tuple(name for name in ladder if name in allowed) for kind, ladder in kinds.items()}

    def cannot_take(self) -> frozenset[str]:
        return frozenset(RUNG_KNOBS) - self.rungs()

    def unmodelled(self, model_dir: str) -> str | None:
        return model_facts.unmodelled(self.tool, self.config, model_dir)

    def attention(self) -> str | None:
        return self.tool.attention(self.config)

    def cwd(self, job_dir: Path, run_dir: Path, command: Sequence[str]) -> Path:
        # Our own child (a merge: no command) runs in the run dir: no user's ``peft/`` shadows peft.
        return (self.workdir or job_dir) if command else run_dir

    def attempt_argv(
        self, attempt_dir: Path, run_dir: Path, job: Knobs, knobs: Knobs, resume_from: str | None
    ) -> tuple[str, ...]:
        """Write the attempt's config (or argv) and its diff; return the argv that runs it.
        Raises :class:`UnmappedKnobsError` when ``knobs`` change what the tool cannot be told."""
        table = self.tool.table
        unmapped = [] if self.tool.settings_in_code else unmapped_changes(table, self.config, job, knobs)
        if unmapped:
            raise UnmappedKnobsError(
                f"internal error: the attempt changes {', '.join(unmapped)}, which {self.kind} "
                "has no config key for; the tool would train as before while the journal said otherwise"
            )
        output = ensure_dir(run_dir / TRAINER_OUTPUT)  # the tool saves there: never through a link
        if self.tool.settings_in_code:  # the script runs as written; the shim changes its knobs
            # script-knobs.json: the knobs it changes, each with what was asked. Before any attempt
            # reached train() only the knobs reported change; after, the job's stand for those never reported.
            keys = {row.knob: row.key for row in table.rows}
            asked, complete = asked_by_script(run_dir)
            asked = {**{knob: getattr(job, knob) for knob in keys}, **asked} if complete else asked
            changed = {name: value for name, value in asked.items() if getattr(knobs, name) != value}
            replaced = str(asked["model"]) if "model" in changed else None  # its tokenizer follows it
            ScriptChanges(tuple(changed), str(output), replaced, changed).write(attempt_dir)
            lines = [f"{keys.get(k, k)}: {v} -> {getattr(knobs, k)}" for k, v in changed.items()]
            _write_diff(attempt_dir, lines)
            return self.command
        config = attempt_config(table, self.config, job, knobs, str(output), resume_from)
        _write_diff(attempt_dir, config_diff(self.config, config))
        if not self.tool.entry:  # the script's own argv, its flags changed
            old, new = flatten(self.config), flatten(config)
            changes = {key: new.get(key) for key in {*old, *new} if old.get(key) != new.get(key)}
            argv = flags.with_flags(self.command, changes)
            write_text_atomic(attempt_dir / "command.json", json.dumps(argv, indent=2) + "\n")
            return tuple(argv)
        path = attempt_dir / f"{self.kind}.yaml"
        header = f"# qlora-supervise wrote this for one attempt from {self.config_path}: edit that file\n"
        write_text_atomic(path, header + yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
        return (self.python, *self.tool.entry, str(path))

    def saved_alone(self, run_dir: Path) -> bool:
        return tool_saved(run_dir)  # a tool without the shim saves into its own output dir only

    def summary(self) -> list[str]:
        table = self.tool.table
        if self.tool.settings_in_code:
            return [
                f"trainer: script {' '.join(self.command)} (run as written in {self.workdir}; never written)",
                "its settings are in its code: attempt 1 runs it unchanged and reports what it builds "
                "(the model, batch, seq_len above are TrainingArguments' defaults until then); later "
                f"attempts change only the ladder's knobs where it builds them: {_keys(table, self.config)}",
                f"rungs: {', '.join(sorted(self.rungs()))}",
            ]
        source = self.config_path if self.config_path is not None else "the flags of trainer.command"
        return [
            f"trainer: {self.kind}, config {source} (read once; never modified: each attempt "
            f"writes its own copy into attempt-NNN/)",
            f"keys the ladder may set: {_keys(table, self.config)}; {table.output_key} and "
            f"{table.resume_key} are set for every attempt; every other key is passed through",
            f"rungs: {', '.join(sorted(self.rungs()))} (the others change what this tool cannot be told, "
            "so its ladders leave them out)",
        ]

    def model_words(self) -> tuple[str, str, str]:
        row = self.tool.table.row("model")
        key = row.key if row is not None else "model"
        if self.config_path is None:
            return (key, "trainer.command", f"--{key} DIR")
        return (key, str(self.config_path), f"{key}: DIR")

    def built_knobs(self, knobs: Knobs, run_dir: Path) -> Knobs:
        if not self.tool.settings_in_code:
            return knobs  # its config, read at load, is what it builds
        return script_knobs.with_values(knobs, asked_by_script(run_dir)[0])

    def probes_data(self) -> bool:
        return False  # a tool reads its own data (a hub dataset, a mixture)

    def service_paths(self) -> list[tuple[str, str]]:
        return [] if self.config_path is None else [("trainer.config", str(self.config_path))]


def _write_diff(attempt_dir: Path, lines: list[str]) -> None:
    write_text_atomic(attempt_dir / DIFF_NAME, "".join(f"{line}\n" for line in lines))


def _keys(table: Table, config: Mapping[str, Any]) -> str:
    return ", ".join(row.key for row in table.rows if row.knob != "model" and writable(row, config))


def tool_saved(run_dir: Path) -> bool:
    """Whether the tool saved anything into its output dir (the loop creates it: that proves nothing)."""
    output = run_dir / TRAINER_OUTPUT
    try:
        return output.is_dir() and any(output.iterdir())
    except OSError:  # gone or unreadable in between: nothing saved that we can read
        return False


def saved_by_the_tool_only(run_dir: Path, adapter: Path) -> Path | None:
    """The tool's output directory when it holds the result and ``adapter`` was never written."""
    return run_dir / TRAINER_OUTPUT if not adapter.exists() and tool_saved(run_dir) else None


def read_diff(attempt_dir: Path) -> list[str] | None:
    """The attempt's diff lines (None: not a tool's attempt, or unreadable); a script's attempt that
    ran: what it asked for and got where it builds each value, where they differ or it could not."""
    event = _script_report(attempt_dir) if (attempt_dir / CHANGES_FILE).is_file() else None
    if event is not None:
        # The output folder moves on every attempt (as a tool's does): not a change worth a line.
        settings = [s for s in event.settings if s.knob != "output_dir"]
        return [s.line() for s in settings if s.asked != s.got or s.why_not]
    try:
        return (attempt_dir / DIFF_NAME).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None


def tool_job_copy(job: Job, raw: dict[str, Any]) -> str:
    """``install-systemd``'s copy of a tool's job, its paths absolute (the copy lives elsewhere); the
    tool still runs in its folder, so relative paths inside its config keep their meaning."""
    trainer = job.trainer
    if not isinstance(trainer, ToolTrainer):
        raise TypeError("not a tool's job")  # install_systemd asks only for a tool's
    section = raw["trainer"]
    if trainer.config_path is not None:
        section["config"] = str(trainer.config_path)
    if "python" in section:
        section["python"] = trainer.python
    section["workdir"] = str(trainer.workdir or job.job_file.parent)
    if section.get("fallbacks"):
        section["fallbacks"] = list(job.fallback_models)
    raw["output_dir"] = str(job.output_dir)
    header = f"# installed by qlora-supervise install-systemd from {job.job_file}\n"
    return header + yaml.safe_dump(raw, sort_keys=False)


def _script_report(attempt_dir: Path) -> ScriptKnobs | None:
    """The attempt's ``script_knobs`` event: what its script built (None: no report)."""
    found = [e for e in read_events(AttemptDir(attempt_dir).events) if isinstance(e, ScriptKnobs)]
    return found[-1] if found else None


def asked_by_script(run_dir: Path) -> tuple[dict[str, script_knobs.Value], bool]:
    """What the script asks for, each knob from the newest attempt that reported it (attempt 1
    changes nothing), and whether any attempt reached ``train()`` (a knob not reported: never built)."""
    attempts = sorted(run_dir.glob("attempt-[0-9][0-9][0-9]"))
    reports = [event for attempt in attempts if (event := _script_report(attempt)) is not None]
    asked = {knob: value for event in reports for knob, value in script_knobs.asked(event.settings).items()}
    return asked, any(event.complete for event in reports)


# The shim in a tool's process: the environment that puts it on the PYTHONPATH (found beside the
# contract's processes module; nothing of it is imported here) with the spec named, and whether it
# attached (its ``started`` line in the attempt's events file), said in the journal when it did not.
def trainer_env(env: Mapping[str, str], spec: AttemptSpec, spec_path: Path) -> dict[str, str]:
    """``env`` plus the shim for a foreign attempt (``spec.command`` set); unchanged for ours."""
    out = dict(env)
    if not spec.command:
        return out
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM_SITE), out.get("PYTHONPATH", "")) if p)
    out[SHIM_SPEC_ENV] = str(spec_path)
    # It runs in the user's folder: no __pycache__ written beside the modules it imports from there.
    out["PYTHONDONTWRITEBYTECODE"] = "1"
    return out


def shim_attached(events_file: Path) -> bool:
    try:
        lines = events_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    return any(isinstance(parse_event(line), Started) for line in lines)


def note_shim(spec: AttemptSpec, log: FilteringBoundLogger) -> bool:
    """Log ``shim_not_attached`` where a tool's attempt left no ``started``; True: attached, or ours."""
    events_file = Path(spec.events_file)
    if not spec.command or shim_attached(events_file):
        return True
    log.warning(Event.SHIM_NOT_ATTACHED, why=SHIM_SILENT.format(events=events_file, python=spec.command[0]))
    return False


def output_moving(spec: AttemptSpec, log_path: Path, wall_now: float, timeout_s: float) -> bool:
    """Whether a tool without the shim wrote to its log within ``timeout_s``: with no heartbeats, its
    own output is the only sign of progress left. False for our child and a tool the shim speaks for."""
    if not spec.command or shim_attached(Path(spec.events_file)):
        return False
    try:
        return wall_now - log_path.stat().st_mtime <= timeout_s
    except OSError:
        return False


# Whether the tool, and the shim, can be imported by the interpreter that will run them (``find_spec``
# there, once per interpreter): a missing tool fails every start; without qlora-supervise, no shim.
def tool_problems(trainer: Trainer) -> list[Problem]:
    """The tool's package missing for its interpreter, with the fix; [] when it is there, for our
    own trainer, or when the interpreter could not be asked (the attempt will say what is wrong)."""
    if not isinstance(trainer, ToolTrainer):
        return []
    package, python = trainer.tool.package, trainer.python
    if package is None or package not in _missing(trainer, python):
        return []
    why = f"{package} is not installed for this interpreter: the tool would fail on every start"
    pip = f"{python} -m pip install {package}"
    fix = f"install it there (`{pip}`), or name the python of the venv it is in (trainer.python)"
    return [Problem("trainer.python", why, show(python), fix)]


def tool_advice(trainer: Trainer) -> list[Advice]:
    """What validate warns of and run says at start about a tool: no shim in its interpreter, and
    each old key name the tool would drop without a word (its value then unused)."""
    if not isinstance(trainer, ToolTrainer):
        return []
    found = []
    # The python it runs in: trainer.python, or a script's first word where that is a python (a script
    # started by another program is that program's business).
    first = trainer.command[0] if trainer.command else ""
    python = shutil.which(first) if Path(first).name.startswith("python") else None
    python = trainer.python if trainer.tool.entry else python
    if python is not None and SHIM_PACKAGE in _missing(trainer, python):
        what = (
            f"qlora-supervise is not importable by {python}, so the shim cannot attach in the "
            "tool's process: no heartbeats, error reports or checkpoints of ours, each restart at step 0"
        )
        pip = f"{python} -m pip install --no-deps qlora-supervise"
        found.append(Advice("trainer.python", what, f"install it there without its dependencies: `{pip}`"))
    where = trainer.config_path.name if trainer.config_path is not None else "trainer.command"
    for old, new in trainer.tool.table.renamed.items():
        if old in trainer.config:
            what = (
                f"{trainer.kind} no longer reads {old} and drops it silently, so it runs with "
                f"{new}'s value (or its default) instead"
            )
            both = f" (both are set: delete {old})" if new in trainer.config else ""
            found.append(Advice(f"{where}: {old}", what, f"rename it to {new}{both}"))
    return found


def _missing(trainer: ToolTrainer, python: str) -> frozenset[str]:
    """Which of the tool's package and ours ``python`` cannot find, asked once from the folder the
    tool runs in and with the PYTHONPATH it inherits (both decide what it finds: the cache's key)."""
    packages = tuple(p for p in (trainer.tool.package, SHIM_PACKAGE) if p)
    workdir = str(trainer.workdir) if trainer.workdir is not None else None
    return _missing_cached(python, packages, workdir, os.environ.get("PYTHONPATH", ""))


@functools.cache
def _missing_cached(
    python: str, packages: tuple[str, ...], workdir: str | None, _pythonpath: str
) -> frozenset[str]:
    try:
        done = subprocess.run(
            [python, "-c", _PROBE, *packages],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()  # not asked: the attempt itself will say what is wrong
    return frozenset(done.stdout.split()) & set(packages) if done.returncode == 0 else frozenset()

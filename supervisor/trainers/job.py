"""``load_job``: any job file, our own trainer's or a tool's (its ``trainer:`` section). A tool's job
has no ``model``, ``data``, ``quantization``, ``lora`` or ``train`` section: its config holds those."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from pydantic import field_validator

from qlora_supervise.supervisor.facts.trainer import OWN
from qlora_supervise.supervisor.jobfile import bounds, schema
from qlora_supervise.supervisor.jobfile import load as jobload
from qlora_supervise.supervisor.jobfile.hub import looks_like_hub_id
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.jobfile.problems import JobError, Problem, did_you_mean, job_error, show
from qlora_supervise.supervisor.jobfile.world import model_dir_problem
from qlora_supervise.supervisor.trainers import flags, model_facts
from qlora_supervise.supervisor.trainers.mapping import config_problems, knobs_from, lookup, present
from qlora_supervise.supervisor.trainers.tools import TOOLS
from qlora_supervise.supervisor.trainers.trainer import ToolTrainer
from qlora_supervise.trainer_child.contract.spec import DataSpec, Knobs, TrainSpec

#: trainer.kind: ours, or a registered tool's.
KINDS = (OWN, *TOOLS)
#: Sections of our own trainer that a foreign tool's config replaces.
OWN_ONLY = ("model", "data", "quantization", "lora", "train")
FOREIGN_KEYS = ("trainer", "resources", "supervise", "diagnose", "output_dir")


class TrainerSection(schema.Section):
    """``trainer:``: ``kind``, the tool's ``config`` file, or ``command`` (a script's argv)."""

    kind: str = OWN
    config: schema.ResolvedPath | None = None
    command: schema.HookArgv | None = None  # argv, never a shell string
    python: schema.ResolvedPath | None = None  # the tool venv's interpreter; default: this one
    # Default: the config's folder (a script: the job file's), where its relative paths mean most.
    workdir: schema.ResolvedPath | None = None
    fallbacks: schema.PathList = ()  # smaller models for the last rung (script: swapped in at load)

    @field_validator("kind")
    @classmethod
    def _known(cls, kind: str) -> str:
        if kind not in KINDS:
            raise job_error("not an allowed value", did_you_mean(kind, KINDS))
        return kind


def load_job(path: str | os.PathLike[str]) -> Job:
    """Read, parse and validate any job file (:func:`.jobfile.load.load_job` for our trainer's)."""
    job_file, text, raw = jobload.read_job_file(path)
    tool = load_tool(job_file, text, raw, list(jobload.duplicate_keys(text))) if "trainer" in raw else None
    own = {key: value for key, value in raw.items() if key != "trainer"}
    return tool if tool is not None else jobload.job_of(job_file, text, own)


def load_tool(job_file: Path, text: str, raw: Mapping[str, Any], problems: list[Problem]) -> Job | None:
    """The Job of a ``trainer:`` job; None when the kind is ``own`` (the usual sections follow)."""
    context = {"job_dir": str(job_file.parent)}
    found: list[Problem] = []
    section, _ = jobload.validate_section("trainer", TrainerSection, raw, context, found)
    if section is not None and section.kind == OWN and not found:
        return None
    problems += found + _section_problems(raw, section)
    resources, _ = jobload.validate_section("resources", schema.ResourcesSection, raw, context, problems)
    supervise, _ = jobload.validate_section("supervise", schema.SuperviseSection, raw, context, problems)
    diagnose, _ = jobload.validate_section("diagnose", schema.DiagnoseSection, raw, context, problems)
    output_dir = jobload.validate_output_dir(raw, context, problems)
    trainer = _tool_trainer(section, job_file.parent, problems) if section and section.kind in TOOLS else None
    if problems or trainer is None or output_dir is None:
        raise JobError(problems)
    assert resources is not None and supervise is not None and diagnose is not None and section is not None
    knobs, train, unparsed = _tool_specs(trainer)
    dataset = lookup(trainer.config, trainer.tool.table.data_key)
    return Job(
        job_file=job_file,
        raw_text=text,
        output_dir=output_dir,
        knobs=knobs,
        data=DataSpec(path=str(dataset) if isinstance(dataset, str) else "", text_field=None),
        train=train,
        resources=resources.spec(),
        supervise=supervise,
        fallback_models=tuple(str(path) for path in section.fallbacks),
        diagnose=diagnose.spec(),
        trainer=trainer,
        unparsed=unparsed,
    )


def _section_problems(raw: Mapping[str, Any], section: TrainerSection | None) -> list[Problem]:
    """Our trainer's sections in a tool's job, unknown top-level keys, the kind's own needs."""
    kind = section.kind if section is not None else "the tool"
    there = "delete it: the tool's config holds these values (the supervisor reads them there)"
    problems = [
        Problem(str(key), f"not used with trainer.kind {kind}", "a section", there)
        if key in OWN_ONLY
        else Problem(str(key), "unknown key", show(raw[key]), f"allowed: {', '.join(FOREIGN_KEYS)}")
        for key in raw
        if key in OWN_ONLY or key not in FOREIGN_KEYS
    ]
    nproc = raw["resources"].get("nproc_per_node", 1) if isinstance(raw.get("resources"), dict) else 1
    if nproc != 1:
        why = "a foreign trainer runs as one process here"
        problems.append(Problem("resources.nproc_per_node", why, show(nproc), "delete it (or 1)"))
    if section is None:
        return problems
    tool = TOOLS.get(section.kind)
    script = tool is not None and not tool.entry  # its config is its command
    required = f"required for kind {kind}"
    if script and not section.command:
        flags = "" if tool is not None and tool.settings_in_code else " --output_dir, out,"
        argv = f"write the script's argv as a list: [python, train.py,{flags} ...]"
        problems.append(Problem("trainer.command", required, None, argv))
    if not script and section.config is None:
        fix = "name the tool's own config file (relative to this job file)"
        problems.append(Problem("trainer.config", required, None, fix))
    if not script and section.command:
        why, fix = f"only for kind hf-script, not {kind}", "delete it: the supervisor starts the tool itself"
        problems.append(Problem("trainer.command", why, show(list(section.command)), fix))
    # Each fallback is a model directory, for a tool that can swap its model in (the script).
    if section.fallbacks and (tool is None or "smaller_model" not in tool.shim_rungs):
        takers = ", ".join(name for name, t in TOOLS.items() if "smaller_model" in t.shim_rungs)
        fix = f"delete it: trainer.fallbacks is for kind {takers} (the others: their own config)"
        return [*problems, Problem("trainer.fallbacks", f"not used with trainer.kind {kind}", None, fix)]
    found = (model_dir_problem(f"trainer.fallbacks.{i}", path) for i, path in enumerate(section.fallbacks))
    return problems + [problem for problem in found if problem is not None]


def _tool_trainer(section: TrainerSection, job_dir: Path, problems: list[Problem]) -> ToolTrainer | None:
    """The trainer with its config read (problems appended); None when it cannot be read."""
    tool = TOOLS[section.kind]
    python = str(section.python) if section.python else sys.executable
    if section.python is not None and not os.access(section.python, os.X_OK):
        why = "no such interpreter (or not executable)"
        fix = "name the python of the tool's venv, e.g. /opt/axolotl-venv/bin/python"
        problems.append(Problem("trainer.python", why, show(python), fix))
    if section.command and shutil.which(section.command[0]) is None:
        why = "its first word is no program on PATH"
        fix = "write the interpreter's path (e.g. /opt/venv/bin/python) or a program on PATH"
        problems.append(Problem("trainer.command", why, show(section.command[0]), fix))
    config: dict[str, Any] = {}
    where, workdir, path = "trainer.command", section.workdir or job_dir, None
    if tool.settings_in_code:  # its flags are its own: nothing of its config is read before it runs
        problems += tool.command_problems(section.command, workdir) if section.command else []
    elif not tool.entry:  # a script: its config is the flags of its command
        config, found = flags.parse(section.command or ())
        problems += found
    elif section.config is None or (read := read_config(section.config, problems)) is None:
        return None
    else:
        config, path = read, section.config
        where, workdir = f"trainer.config ({section.config.name})", section.workdir or section.config.parent
    problems += config_problems(tool.table, config, where)
    row = tool.table.row("model")  # the tool's model, (key, path); None: no model row, or no path
    value = lookup(config, row.key) if row is not None else None
    model = (row.key, value) if row is not None and isinstance(value, str) and value else None
    problems += model_problems(*model, where, workdir) if model else []
    types = model_type(tool_model_path(model[1], workdir)) if model else None
    problems += model_facts.target_problems(tool, config, where, types)
    problems += tool.data_problems(config, where, workdir)
    return ToolTrainer(tool, MappingProxyType(dict(config)), path, section.command or (), python, workdir)


def model_problems(key: str, value: str, where: str, workdir: Path) -> list[Problem]:
    """The tool's model (``key``: ``value``) is a local directory with a config.json, as ``model.path`` is:
    the tool runs offline and the supervisor reads the model's shape there."""
    name = f"{where}: {key}"
    if not Path(value).is_absolute() and looks_like_hub_id(value, workdir):
        why = "a hub id, but the tool runs offline (HF_HUB_OFFLINE=1) and the supervisor reads config.json"
        fix = f"download it (`hf download {value} --local-dir DIR`) and point {key} at that directory"
        return [Problem(name, why, show(value), fix)]
    if value.startswith("~"):  # the tool opens the path as written: no shell expands it there
        why = "starts with ~, which the tool does not expand (it would look for a folder named ~)"
        return [Problem(name, why, show(value), f"write the full path: {os.path.expanduser(value)}")]
    return [problem] if (problem := model_dir_problem(name, Path(tool_model_path(value, workdir)))) else []


def read_config(path: Path, problems: list[Problem]) -> dict[str, Any] | None:
    """The tool's YAML config as a mapping (safe YAML); a problem when it is missing or not a mapping."""
    where = f"trainer.config ({path})"
    try:
        value = bounds.safe_load_bounded(bounds.read_bounded(path))
    except bounds.InputBoundError as error:
        found = Problem(where, error.why, error.got, error.fix)
    except bounds.AliasBombError as error:
        found = Problem(where, f"YAML aliases refused: {error}", None, "write the values out")
    except FileNotFoundError:
        fix = "check the path (relative to the job file)"
        found = Problem("trainer.config", "no such file", show(str(path)), fix)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        found = Problem(where, f"cannot read it: {error}", None, "fix the file")
    else:
        if isinstance(value, dict):
            return value
        found = Problem(where, "not a mapping of keys", show(value), "the tool's config is a YAML mapping")
    problems.append(found)
    return None


def _tool_specs(trainer: ToolTrainer) -> tuple[Knobs, TrainSpec, dict[str, Any]]:
    """The tool's knobs, train spec, and values that did not parse (``max_steps: ten``) by job view name."""
    tool, config, table = trainer.tool, trainer.config, trainer.tool.table
    knobs = knobs_from(table, config)
    # The supervisor's reads see the model where the tool will (the knob only; the config unchanged).
    model = tool_model_path(knobs.model, trainer.workdir)
    head = model_facts.keeps_head_dtype(tool, config)  # read only: what the tool does, not a rung
    knobs = model_facts.with_saved_4bit(dataclasses.replace(knobs, model=model, bf16_head=head), model)
    steps = lookup(config, table.max_steps_key)
    epochs = lookup(config, table.epochs_key)
    save = lookup(config, table.save_steps_key)
    train = TrainSpec(
        max_steps=steps if isinstance(steps, int) and not isinstance(steps, bool) else -1,
        epochs=float(epochs) if _positive(epochs) else table.epochs_default,
        save_steps=save if isinstance(save, int) and _positive(save) else table.save_steps_default,
        merge=False,
        target_modules=model_facts.lora_targets(tool, config, model_type(knobs.model)),
    )
    names = ("train.max_steps", "train.epochs", "train.save_steps")
    views = zip(names, (steps, epochs, save), (train.max_steps, train.epochs, train.save_steps), strict=True)
    return knobs, train, {name: v for name, v, got in views if present(v) and v != got}


def model_type(model: str) -> str | None:
    """``model_type`` from the model directory's config.json (None: no such file, or unreadable)."""
    return value if isinstance(value := model_facts.model_config(model).get("model_type"), str) else None


def tool_model_path(model: str, workdir: Path | None) -> str:
    """``model`` as the tool opens it from ``workdir``: a relative path made absolute there; an
    absolute path, a hub id (``org/name`` that is no path there) or no workdir: unchanged."""
    if not model or workdir is None or Path(model).is_absolute() or looks_like_hub_id(model, workdir):
        return model
    return os.path.normpath(workdir.absolute() / model)  # symlinks kept, as the tool would open it


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0

"""The world pass of validation: checks across fields and against the file system, run after the
shape pass for every section that passed it."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from qlora_supervise.supervisor.facts.units import format_duration
from qlora_supervise.supervisor.jobfile import data_probe, schema
from qlora_supervise.supervisor.jobfile.model_files import ModelFilesError, read_model_files
from qlora_supervise.supervisor.jobfile.problems import Problem, did_you_mean, show
from qlora_supervise.supervisor.jobfile.system_paths import system_folder
from qlora_supervise.supervisor.watching.gpu import visible_gpu_count
from qlora_supervise.trainer_child.contract import targets

#: The most of the data ``eval_fraction`` may hold out: beyond it, less is trained on than evaluated.
MAX_EVAL_FRACTION = 0.5
#: Why a textfile name is refused: node_exporter's collector skips every other name.
NOT_PROM = "node_exporter's textfile collector reads only *.prom files"


def world_problems(
    sections: Mapping[str, schema.Section], output_dir: Path | None, bad: frozenset[str]
) -> list[Problem]:
    """Every problem across fields or with the file system. ``sections`` may be partial; a check
    that involves a field of ``bad`` (failed the shape pass) is skipped: its default would lie."""
    problems: list[Problem] = []
    if isinstance(model := sections.get("model"), schema.ModelSection):
        paths = [] if "model.path" in bad else [("model.path", model.path)]
        if "model.fallbacks" not in bad:
            paths += [(f"model.fallbacks.{i}", p) for i, p in enumerate(model.fallbacks)]
        problems += [problem for name, path in paths if (problem := model_dir_problem(name, path))]
        if isinstance(lora := sections.get("lora"), schema.LoraSection):
            problems += _target_module_problems(model, lora, bad)
    if isinstance(data := sections.get("data"), schema.DataSection):
        problems += _data_problems(data, bad)
    if isinstance(train := sections.get("train"), schema.TrainSection):
        problems += _train_problems(train, data if isinstance(data, schema.DataSection) else None, bad)
    if isinstance(resources := sections.get("resources"), schema.ResourcesSection):
        problems += _rank_problems(resources, bad)
        if isinstance(train, schema.TrainSection):
            problems += _rank_batch_problems(train, resources, bad)
    if isinstance(supervise := sections.get("supervise"), schema.SuperviseSection):
        problems += _supervise_problems(supervise, bad)
    if output_dir is not None:
        problems += _output_dir_problems(output_dir)
    return problems


def model_dir_problem(name: str, path: Path) -> Problem | None:
    """Why ``path`` is not a local model directory (config.json inside), or None."""
    if not path.exists():
        return Problem(name, "no such directory", show(path), "give a local model directory")
    if not path.is_dir():
        return Problem(name, "not a directory", show(path), "give the model's directory")
    if not (path / "config.json").is_file():
        fix = "point at a Hugging Face model directory (config.json + weights)"
        return Problem(name, "no config.json in the directory", show(path), fix)
    return None


def _target_module_problems(
    model: schema.ModelSection, lora: schema.LoraSection, bad: frozenset[str]
) -> list[Problem]:
    """Each target module names a Linear layer of the model, read from its safetensors headers (no
    torch): Llama names on Phi-3 match ``o_proj`` alone. Without the blocks' tensor names (a ``.bin``
    checkpoint) only a keyword is resolved."""
    if bad & {"model.path", "lora.target_modules"} or model_dir_problem("model.path", model.path):
        return []
    try:
        files = read_model_files(model.path)
    except ModelFilesError as error:
        return [Problem("model.path", str(error), show(model.path), "fix or re-download the model files")]
    model_type = str(raw_type) if (raw_type := files.config.get("model_type")) else None
    layers, wanted = targets.linear_leaves(files.tensors, model_type), lora.target_modules
    try:
        if layers:
            targets.check(wanted, model_type, layers, targets.expert_leaves(files.tensors))
        else:
            targets.resolve(wanted, model_type)
    except targets.TargetsError as error:
        shown = show(list(wanted) if isinstance(wanted, tuple) else wanted)
        return [Problem("lora.target_modules", error.problem, shown, error.fix)]
    return []


def _data_problems(data: schema.DataSection, bad: frozenset[str]) -> list[Problem]:
    """Exactly one of text_field / messages_field, at most one eval source, and readable sources."""
    problems = []
    fields_ok = not bad & {"data.text_field", "data.messages_field"}
    if fields_ok and data.text_field is not None and data.messages_field is not None:
        why, fix = "both text_field and messages_field are set", "set one of them; the other to null"
        problems.append(Problem("data.messages_field", why, show(data.messages_field), fix))
    if fields_ok and data.text_field is None and data.messages_field is None:
        why = "neither text_field nor messages_field is set"
        problems.append(Problem("data.text_field", why, None, "set one"))
    eval_ok = not bad & {"data.eval_path", "data.eval_fraction"}
    if eval_ok and data.eval_path is not None and data.eval_fraction > 0:
        why, fix = "both eval_path and eval_fraction are set", "use eval_path or eval_fraction, not both"
        problems.append(Problem("data.eval_fraction", why, show(data.eval_fraction), fix))
    if "data.eval_fraction" not in bad and data.eval_fraction > MAX_EVAL_FRACTION:
        limit = f"{MAX_EVAL_FRACTION:g}"
        why = f"holds out more than {limit} of the data for evaluation, leaving less to train on"
        fix = f"use {limit} or less (0.05 to 0.1 is usual), or a separate data.eval_path"
        problems.append(Problem("data.eval_fraction", why, show(data.eval_fraction), fix))
    for name, path in (("data.path", data.path), ("data.eval_path", data.eval_path)):
        if name not in bad and path is not None:
            problems += _source_problems(name, path, data, fields_ok)
    return problems


def _source_problems(path_name: str, path: Path, data: schema.DataSection, fields_ok: bool) -> list[Problem]:
    """The data at ``path`` exists in a format the probe reads, has the named fields; every record trains."""
    if not path.exists():
        fix = "check the path (relative to the job file)"
        return [Problem(path_name, "no such file or directory", show(path), fix)]
    try:
        found = data_probe.probe(path)
    except data_probe.DataProbeError as error:
        return [Problem(path_name, str(error), show(path), f"use {data_probe.FORMATS_HELP}")]
    if not fields_ok:
        return []
    problems = []
    fields = (("data.text_field", data.text_field, False), ("data.messages_field", data.messages_field, True))
    for field_name, field, messages in fields:
        if field is not None and (why := data_probe.field_problem(found, field, messages=messages)):
            where = "" if path_name == "data.path" else f" ({path_name})"
            known = field in found.fields
            fix = "fix the data or the field" if known else did_you_mean(field, found.fields, "fields")
            problems.append(Problem(field_name, why + where, show(field), fix))
    if problems:
        return problems
    messages = data.messages_field is not None
    field = data.messages_field if messages else data.text_field
    if field is None:
        return []
    try:
        data_probe.scan_records(path, field, messages=messages)
    except data_probe.DataRowError as error:
        fix = "fix or remove that record (training would stop there)"
        return [Problem(path_name, str(error), show(str(error.path)), fix)]
    except (OSError, data_probe.DataProbeError) as error:
        return [Problem(path_name, f"cannot read the data: {error}", show(path), "")]
    return []


def split_sizes(records: int, eval_fraction: float) -> tuple[int, int]:
    """(train rows, eval rows) as the child's ``Dataset.train_test_split`` counts them: eval rounded
    up, train down. Too small a split is only a warning: the data checked may be a sample."""
    return math.floor((1 - eval_fraction) * records), math.ceil(eval_fraction * records)


def _train_problems(
    train: schema.TrainSection, data: schema.DataSection | None, bad: frozenset[str]
) -> list[Problem]:
    """The effective batch divides into micro-batches, max_steps or epochs sets the length, and
    eval_steps has eval data (``data`` None: its section failed, not checked)."""
    problems = []
    batch_ok = not bad & {"train.effective_batch_size", "train.micro_batch_size"}
    if batch_ok and train.effective_batch_size % train.micro_batch_size:
        fix = f"make it a multiple of train.micro_batch_size ({train.micro_batch_size})"
        got = show(train.effective_batch_size)
        problems.append(Problem("train.effective_batch_size", "not divisible by micro_batch_size", got, fix))
    length_ok = not bad & {"train.max_steps", "train.epochs"}
    if length_ok and train.max_steps is None and train.epochs is None:
        why = "neither max_steps nor epochs is set"
        problems.append(Problem("train.max_steps", why, None, "set one of them"))
    eval_fields = {"train.eval_steps", "data.eval_path", "data.eval_fraction"}
    no_eval = data is not None and data.eval_path is None and data.eval_fraction == 0
    if no_eval and train.eval_steps is not None and not bad & eval_fields:
        fix = "set data.eval_path or data.eval_fraction, or remove eval_steps"
        why = "evaluation asked for but there is no eval data"
        problems.append(Problem("train.eval_steps", why, show(train.eval_steps), fix))
    return problems


def _rank_problems(resources: schema.ResourcesSection, bad: frozenset[str]) -> list[Problem]:
    """Ranks train on the first ``nproc_per_node`` visible GPUs, one each: a job that names one GPU
    cannot mean that, and a GPU host needs as many GPUs as ranks (None visible: no driver, gloo)."""
    ranks = resources.nproc_per_node
    if ranks == 1 and resources.parallel == "fsdp" and not bad & {"resources.nproc_per_node"}:
        why = "FSDP shards the weights over the ranks; one rank has nothing to shard them with"
        return [Problem("resources.parallel", why, "fsdp", "set nproc_per_node: 2 or more, or parallel: ddp")]
    if ranks == 1 or bad & {"resources.nproc_per_node", "resources.gpu"}:
        return []
    if resources.parallel == "fsdp" and resources.gpu == "cpu":
        why = "accelerate runs CPU ranks as DDP only: FSDP needs GPUs (trainer_child/recipe/fsdp.py)"
        return [Problem("resources.parallel", why, "fsdp", "set parallel: ddp, or gpu: auto on a GPU host")]
    if resources.gpu not in ("auto", "cpu"):
        why = f"names one GPU, but nproc_per_node {ranks} puts rank N on visible GPU N (LOCAL_RANK)"
        fix = (
            "set gpu: auto and choose the cards with CUDA_VISIBLE_DEVICES (or gpu: cpu, or nproc_per_node: 1)"
        )
        return [Problem("resources.gpu", why, show(resources.gpu), fix)]
    gpus = visible_gpu_count() if resources.gpu == "auto" else None
    if gpus is not None and 0 < gpus < ranks:
        fix = f"lower nproc_per_node to {gpus} or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        why = f"{ranks} ranks need {ranks} GPUs, but {gpus} GPU(s) are visible"
        return [Problem("resources.nproc_per_node", why, show(ranks), fix)]
    return []


def _rank_batch_problems(
    train: schema.TrainSection, resources: schema.ResourcesSection, bad: frozenset[str]
) -> list[Problem]:
    fields = {"train.effective_batch_size", "train.micro_batch_size", "resources.nproc_per_node"}
    batch, ranks = train.effective_batch_size, resources.nproc_per_node
    per_step = train.micro_batch_size * ranks
    if ranks == 1 or bad & fields or batch % train.micro_batch_size or batch % per_step == 0:
        return []  # one rank, or no whole micro-batches: _train_problems says so already
    fix = f"make it a multiple of micro_batch_size x nproc_per_node ({per_step})"
    why = f"not divisible by micro_batch_size x nproc_per_node ({train.micro_batch_size} x {ranks})"
    return [Problem("train.effective_batch_size", why, show(batch), fix)]


def _supervise_problems(supervise: schema.SuperviseSection, bad: frozenset[str]) -> list[Problem]:
    problems = []
    backoff_ok = not bad & {"supervise.backoff_max", "supervise.backoff_initial"}
    if backoff_ok and supervise.backoff_max < supervise.backoff_initial:
        fix = f"use at least backoff_initial ({format_duration(supervise.backoff_initial)})"
        got = show(format_duration(supervise.backoff_max))
        problems.append(Problem("supervise.backoff_max", "smaller than backoff_initial", got, fix))
    path = supervise.metrics_textfile
    if path is not None and "supervise.metrics_textfile" not in bad and (found := textfile_problem(path)):
        problems.append(Problem("supervise.metrics_textfile", found[0], show(path), found[1]))
    return problems


def _output_dir_problems(output_dir: Path) -> list[Problem]:
    if (found := system_folder(output_dir)) is not None:
        return [Problem("output_dir", found[0], show(output_dir), found[1])]
    if output_dir.exists() and not output_dir.is_dir():
        why, fix = "exists and is not a directory", "choose a directory path"
        return [Problem("output_dir", why, show(output_dir), fix)]
    existing = output_dir
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable"
        return [Problem("output_dir", why, show(output_dir), "choose a writable place")]
    return []


def textfile_problem(path: Path) -> tuple[str, str] | None:
    """Why ``path`` cannot be the metrics textfile, and the fix; None when it can be written.
    Its nearest existing directory must take a temp file: tried, since ``os.access`` says yes to
    root where no file can go (/proc, a read-only bind mount)."""
    if path.is_dir():
        return "is a directory", f"name a file in it, e.g. {path / 'job.prom'}"
    if path.suffix != ".prom":
        return NOT_PROM, f"name it {path.stem}.prom"
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory", "choose a path under a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".qlora-supervise-probe-", suffix=".tmp"):
            pass
    except OSError as error:
        fix = "make it writable by the supervisor's user, or choose node_exporter's textfile directory"
        return f"cannot be created: {existing} does not take a file ({error.strerror or error})", fix
    return None

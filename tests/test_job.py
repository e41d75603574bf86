"""The job file: parsing, validation with every problem at once, and the specs it produces."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from qlora_supervise.policies.decide import Settings
from qlora_supervise.supervisor.commands.validate import validate_command
from qlora_supervise.supervisor.jobfile import Job, JobError, load_job
from qlora_supervise.supervisor.jobfile.problems import FILE_PATH
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec, Knobs, Resources, TrainSpec

MODEL = "model: {path: ./model}\n"
MINIMAL = MODEL + "data: {path: ./data.jsonl}\n"


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A directory with a fake model (just config.json) and a two-record JSON Lines file."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text("{}")
    rows = [
        {"text": "hello", "messages": [{"role": "user", "content": "hi"}]},
        {"text": "bye", "messages": []},
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "broken.jsonl").write_text("\n{not json\n")
    return tmp_path


def write(job_dir: Path, text: str, name: str = "job.yaml") -> Path:
    path = job_dir / name
    path.write_text(textwrap.dedent(text))
    return path


def problems_of(path: Path) -> dict[str, str]:
    """field path -> rendered problem line, for a job that must fail."""
    with pytest.raises(JobError) as caught:
        load_job(path)
    return {p.path: p.render() for p in caught.value.problems}


# --------------------------------------------------------------------------- valid jobs


def test_minimal_job_defaults_follow_the_seed_recipe(job_dir: Path) -> None:
    """A job naming only model and data gets NF4, double quant, r 8, alpha 16, q/k/v/o, paged 8-bit AdamW."""
    job = load_job(write(job_dir, MINIMAL))
    k, t, s = job.knobs, job.train, job.supervise
    assert (k.load_in_4bit, k.quant_type, k.double_quant, t.compute_dtype) == (True, "nf4", True, "auto")
    assert (k.lora_r, k.lora_alpha, t.lora_dropout) == (8, 16, 0.05)
    assert t.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert (k.micro_batch_size, k.effective_batch, k.gradient_checkpointing) == (1, 16, True)
    assert (k.optimizer, t.learning_rate, t.lr_scheduler) == ("paged_adamw_8bit", 2e-4, "cosine")
    assert (t.warmup_ratio, t.max_grad_norm, t.max_steps, t.epochs) == (0.03, 0.3, -1, 1.0)
    assert (job.data.text_field, job.data.messages_field) == ("text", None)
    assert job.resources == Resources(device="auto", gpu_memory_limit=None, cpu_memory_limit=None)
    assert (s.hang_timeout, s.backoff_initial, s.backoff_max, s.contention_wait) == (
        1200.0,
        2.0,
        60.0,
        1800.0,
    )
    assert s.max_attempts == 8 and s.ladders == {} and s.keep_effective_batch is True


#: Spec fields a job fills from what it names, not from a default (eval_enabled follows the eval data).
FILLED_BY_THE_JOB = {("Knobs", "model"), ("Knobs", "eval_enabled"), ("DataSpec", "path")}
#: The policy's Settings field -> the supervise key that sets it.
SETTINGS_KEYS = {
    "max_attempts": "max_attempts",
    "max_no_progress": "max_no_progress_attempts",
    "degrade_on_contention": "degrade_on_contention",
    "contention_wait_s": "contention_wait",
    "disk_wait_s": "disk_wait",
}


def test_schema_defaults_are_the_protocol_defaults(job_dir: Path) -> None:
    """A job that sets nothing gets each protocol dataclass's own default in every field (one set)."""
    job = load_job(write(job_dir, MINIMAL))
    disagree = []
    pairs = [(job.knobs, Knobs(model="")), (job.data, DataSpec(path="")), (job.train, TrainSpec())]
    for got, default in [*pairs, (job.resources, Resources())]:
        for field in dataclasses.fields(default):
            if (type(default).__name__, field.name) in FILLED_BY_THE_JOB:
                continue
            if getattr(got, field.name) != getattr(default, field.name):
                disagree.append(f"{type(default).__name__}.{field.name}")
    for setting, key in SETTINGS_KEYS.items():
        if getattr(job.supervise, key) != getattr(Settings(), setting):
            disagree.append(f"Settings.{setting} vs supervise.{key}")
    assert disagree == []
    assert {f.name for f in dataclasses.fields(Settings)} >= set(SETTINGS_KEYS)


def test_paths_resolve_against_the_job_directory_not_the_cwd(
    job_dir: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative paths are taken from the job file's directory and come back absolute."""
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    job = load_job(write(job_dir, MINIMAL + "output_dir: out/run1\n"))
    assert job.knobs.model == str(job_dir / "model")
    assert job.data.path == str(job_dir / "data.jsonl")
    assert job.output_dir == job_dir / "out" / "run1"
    assert job.job_file.parent == job_dir and job.job_file == job_dir / "job.yaml"
    assert job.raw_text == MINIMAL + "output_dir: out/run1\n"


FULL = """\
model: {path: ./model, fallbacks: [./small], trust_remote_code: true}
data: {path: ./data.jsonl, text_field: text, eval_fraction: 0.1}
quantization: {load_in_4bit: true, quant_type: fp4, double_quant: false, compute_dtype: bf16}
lora: {r: 16, alpha: 32, dropout: 0.1, target_modules: [q_proj, v_proj]}
train:
  max_seq_len: 1024
  micro_batch_size: 4
  effective_batch_size: 32
  gradient_checkpointing: false
  optimizer: adamw_torch
  learning_rate: 1e-4
  lr_scheduler: linear
  warmup_ratio: 0.1
  max_grad_norm: 1.0
  max_steps: 200
  epochs: null
  save_steps: 25
  logging_steps: 5
  eval_steps: 50
  eval_batch_size: 2
  packing: true
  seed: 7
  merge: true
resources: {gpu: 1, gpu_memory_limit: 24GiB, cpu_memory_limit: 64GB}
supervise:
  max_attempts: 5
  hang_timeout: 1h30m
  max_no_progress_attempts: 2
  backoff_initial: 5s
  backoff_max: 2m
  keep_effective_batch: true
  contention_wait: 0
  degrade_on_contention: true
  ladders:
    oom_forward: [halve_micro_batch, shorten_seq_len]
    oom_eval: []
output_dir: /tmp/qlora-supervise-test-run
"""


def test_full_job_round_trips_into_knobs_and_specs(job_dir: Path) -> None:
    """Every field of a complete job lands in Knobs, DataSpec, TrainSpec, Resources and supervise."""
    job = load_job(write(job_dir, FULL))
    assert job.knobs == Knobs(
        model=str(job_dir / "model"),
        micro_batch_size=4,
        grad_accum=8,
        max_seq_len=1024,
        gradient_checkpointing=False,
        optimizer="adamw_torch",
        lora_r=16,
        lora_alpha=32,
        quant_type="fp4",
        double_quant=False,
        load_in_4bit=True,
        eval_batch_size=2,
        eval_enabled=True,
    )
    data = job.data
    assert (data.path, data.text_field, data.messages_field) == (str(job_dir / "data.jsonl"), "text", None)
    assert (data.eval_path, data.eval_fraction) == (None, 0.1)
    train = job.train
    assert (train.learning_rate, train.lr_scheduler, train.warmup_ratio, train.max_grad_norm) == (
        1e-4,
        "linear",
        0.1,
        1.0,
    )
    assert (train.max_steps, train.save_steps, train.logging_steps, train.eval_steps) == (200, 25, 5, 50)
    assert (train.packing, train.seed, train.lora_dropout, train.merge) == (True, 7, 0.1, True)
    assert (train.target_modules, train.compute_dtype, train.trust_remote_code) == (
        ("q_proj", "v_proj"),
        "bf16",
        True,
    )
    assert job.fallback_models == (str(job_dir / "small"),)
    assert job.resources == Resources(
        device="cuda:1", gpu_memory_limit=24 * 2**30, cpu_memory_limit=64 * 10**9
    )
    s = job.supervise
    assert (s.hang_timeout, s.backoff_initial, s.backoff_max, s.contention_wait) == (5400.0, 5.0, 120.0, 0.0)
    assert (s.max_attempts, s.max_no_progress_attempts, s.degrade_on_contention) == (5, 2, True)
    assert s.ladders == {
        FailureKind.OOM_FORWARD: ("halve_micro_batch", "shorten_seq_len"),
        FailureKind.OOM_EVAL: (),
    }
    assert job.output_dir == Path("/tmp/qlora-supervise-test-run")


def test_specs_survive_the_attempt_spec_json_contract(job_dir: Path) -> None:
    """Knobs and specs built from a job pass through AttemptSpec JSON unchanged."""
    job = load_job(write(job_dir, FULL))
    spec = AttemptSpec(
        attempt=1,
        run_dir=str(job.output_dir),
        knobs=job.knobs,
        data=job.data,
        train=job.train,
        events_file="e",
        error_file="r",
        checkpoints_dir="c",
        adapter_dir="a",
        merged_dir="m",
        device=job.resources.device,
        gpu_memory_limit=job.resources.gpu_memory_limit,
    )
    assert AttemptSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("train", "max_steps", "epochs"),
    [("{max_steps: 100}", 100, 1.0), ("{epochs: 3}", -1, 3.0), ("{epochs: 0.5}", -1, 0.5)],
)
def test_train_length_max_steps_wins_else_epochs(
    job_dir: Path, train: str, max_steps: int, epochs: float
) -> None:
    """max_steps is passed when set; otherwise it is -1 and epochs decide the length."""
    spec = load_job(write(job_dir, MINIMAL + f"train: {train}\n")).train
    assert (spec.max_steps, spec.epochs) == (max_steps, epochs)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ("lora: {target_modules: all-linear}", lambda j: j.train.target_modules == "all-linear"),
        ("resources: {gpu: cpu}", lambda j: j.resources.device == "cpu"),
        ("resources: {gpu: 'cuda:2'}", lambda j: j.resources.device == "cuda:2"),
        (
            "resources: {gpu: GPU-5a1b2c3d-0000-1111}",
            lambda j: j.resources.device == "GPU-5a1b2c3d-0000-1111",
        ),
        ("resources: {gpu_memory_limit: 500MiB}", lambda j: j.resources.gpu_memory_limit == 500 * 2**20),
        ("resources: {cpu_memory_limit: 1000000B}", lambda j: j.resources.cpu_memory_limit == 10**6),
        ("supervise: {hang_timeout: 90}", lambda j: j.supervise.hang_timeout == 90.0),
        ("train: {learning_rate: 3e-5}", lambda j: j.train.learning_rate == 3e-5),  # YAML 1.1 reads a string
        ("data: {path: ./data.jsonl, eval_path: ./data.jsonl}", lambda j: j.knobs.eval_enabled),
        ("data: {path: ./data.jsonl}", lambda j: not j.knobs.eval_enabled),
        ("train:", lambda j: j.knobs.micro_batch_size == 1),  # an empty section means the defaults
    ],
)
def test_valid_variants(job_dir: Path, extra: str, check: Callable[[Job], bool]) -> None:
    """Alternative spellings the schema allows are accepted and normalised."""
    text = "model: {path: ./model}\n" if extra.startswith("data:") else MINIMAL
    assert check(load_job(write(job_dir, text + extra + "\n")))


def test_messages_field_replaces_the_default_text_field(job_dir: Path) -> None:
    """Naming messages_field alone turns the default text_field off."""
    job = load_job(
        write(job_dir, "model: {path: ./model}\ndata: {path: ./data.jsonl, messages_field: messages}\n")
    )
    assert job.data.text_field is None and job.data.messages_field == "messages"


def test_job_is_frozen(job_dir: Path) -> None:
    """A loaded job cannot be changed: the loop reads it, never edits it."""
    job = load_job(write(job_dir, MINIMAL))
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.knobs.micro_batch_size = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.output_dir = Path("/elsewhere")  # type: ignore[misc]
    with pytest.raises(Exception, match="frozen"):
        job.supervise.max_attempts = 1
    assert isinstance(job, Job)


# --------------------------------------------------------------------------- one problem each

BAD_CASES = [
    # (yaml added to MINIMAL, or replacing it when it names model:/data:, field path, words in the line)
    ("train: {micro_batch_size: 0}", "train.micro_batch_size", "must be > 0"),
    ("train: {micro_batch_size: -2}", "train.micro_batch_size", "got -2"),
    ("train: {micro_batch_size: '4'}", "train.micro_batch_size", "wrong type"),
    ("train: {micro_batch_size: 1.5}", "train.micro_batch_size", "whole number"),
    ("train: {micro_batch_size: 3}", "train.effective_batch_size", "multiple of train.micro_batch_size (3)"),
    ("train: {micro_batchsize: 2}", "train.micro_batchsize", "did you mean 'micro_batch_size'?"),
    ("train: {optimizer: adam}", "train.optimizer", "allowed: adamw_8bit, adamw_torch"),
    ("train: {optimizer: paged_adamw8bit}", "train.optimizer", "did you mean 'paged_adamw_8bit'?"),
    ("train: {lr_scheduler: cosin}", "train.lr_scheduler", "did you mean 'cosine'?"),
    ("train: {learning_rate: 0}", "train.learning_rate", "must be > 0"),
    ("train: {learning_rate: fast}", "train.learning_rate", "wrong type"),
    ("train: {warmup_ratio: 1.5}", "train.warmup_ratio", "must be < 1"),
    ("train: {epochs: null}", "train.max_steps", "neither max_steps nor epochs"),
    ("train: {eval_steps: 10}", "train.eval_steps", "no eval data"),
    ("train: {gradient_checkpointing: maybe}", "train.gradient_checkpointing", "true or false"),
    ("train: {seed: -1}", "train.seed", ">= 0"),
    ("train: [1, 2]", "train", "must be a mapping"),
    ("quantization: {quant_type: int8}", "quantization.quant_type", "fp4, nf4"),
    ("quantization: {compute_dtype: bfloat16}", "quantization.compute_dtype", "did you mean 'bf16'?"),
    ("quantization: {compute_dtype: half}", "quantization.compute_dtype", "allowed: auto, bf16, fp16, fp32"),
    ("lora: {r: 0}", "lora.r", "must be > 0"),
    ("lora: {dropout: -0.1}", "lora.dropout", ">= 0"),
    ("lora: {target_modules: []}", "lora.target_modules", "all-linear"),
    ("lora: {target_modules: all_linear}", "lora.target_modules", "not a list of module names"),
    ("resources: {gpu_memory_limit: 20x}", "resources.gpu_memory_limit", "unknown unit 'x'"),
    ("resources: {gpu_memory_limit: 24G}", "resources.gpu_memory_limit", "GiB"),
    ("resources: {gpu_memory_limit: 0}", "resources.gpu_memory_limit", "must be > 0"),
    ("resources: {cpu_memory_limit: -1GB}", "resources.cpu_memory_limit", "bad byte size"),
    ("resources: {gpu: gpu0}", "resources.gpu", "GPU UUID"),
    ("resources: {gpu: -1}", "resources.gpu", "not a device"),
    ("supervise: {hang_timeout: 20x}", "supervise.hang_timeout", "bad duration"),
    ("supervise: {hang_timeout: 0}", "supervise.hang_timeout", "must be > 0"),
    ("supervise: {max_attempts: 0}", "supervise.max_attempts", "must be > 0"),
    (
        "supervise: {backoff_initial: 10s, backoff_max: 5s}",
        "supervise.backoff_max",
        "at least backoff_initial",
    ),
    (
        "supervise: {ladders: {oom_forwad: [halve_micro_batch]}}",
        "supervise.ladders.oom_forwad",
        "'oom_forward'",
    ),
    (
        "supervise: {ladders: {oom_forward: [halve_microbatch]}}",
        "supervise.ladders.oom_forward.0",
        "unknown rung",
    ),
    ("supervise: {ladders: {oom_forward: halve_micro_batch}}", "supervise.ladders.oom_forward", "a list"),
    ("outptu_dir: ./x", "outptu_dir", "did you mean 'output_dir'?"),
    ("output_dir: ./data.jsonl", "output_dir", "not a directory"),
    ("model: {path: ./nowhere}\ndata: {path: ./data.jsonl}", "model.path", "no such directory"),
    ("model: {path: ./data.jsonl}\ndata: {path: ./data.jsonl}", "model.path", "not a directory"),
    ("model: {path: .}\ndata: {path: ./data.jsonl}", "model.path", "no config.json"),
    (
        "model: {path: ./model, fallbacks: [./nowhere]}\ndata: {path: ./data.jsonl}",
        "model.fallbacks.0",
        "no such",
    ),
    ("model: {path: ./model, pth: 1}\ndata: {path: ./data.jsonl}", "model.pth", "did you mean 'path'?"),
    ("model: {fallbacks: []}\ndata: {path: ./data.jsonl}", "model.path", "missing"),
    ("model: ./model\ndata: {path: ./data.jsonl}", "model", "must be a mapping"),
    ("data: {path: ./data.jsonl}", "model", "required section is missing"),
    (MODEL + "data: {path: ./nodata.jsonl}", "data.path", "no such file"),
    (
        MODEL + "data: {path: ./data.jsonl, text_field: body}",
        "data.text_field",
        "no field 'body'",
    ),
    (
        MODEL + "data: {path: ./data.jsonl, text_field: txt}",
        "data.text_field",
        "did you mean 'text'",
    ),
    (
        MODEL + "data: {path: ./data.jsonl, text_field: messages}",
        "data.text_field",
        "not text",
    ),
    (
        MODEL + "data: {path: ./data.jsonl, messages_field: text}",
        "data.messages_field",
        "messages",
    ),
    (
        MODEL + "data: {path: ./data.jsonl, text_field: text, messages_field: messages}",
        "data.messages_field",
        "both",
    ),
    (MODEL + "data: {path: ./data.jsonl, text_field: null}", "data.text_field", "neither"),
    (MODEL + "data: {path: ./data.jsonl, eval_fraction: 1.0}", "data.eval_fraction", "< 1"),
    (
        MODEL + "data: {path: ./data.jsonl, eval_path: ./data.jsonl, eval_fraction: 0.1}",
        "data.eval_fraction",
        "not both",
    ),
    (
        MODEL + "data: {path: ./data.jsonl, eval_path: ./no.jsonl}",
        "data.eval_path",
        "no such",
    ),
    (MODEL + "data: {path: ./empty.jsonl}", "data.path", "no records"),
    (MODEL + "data: {path: ./broken.jsonl}", "data.path", "line 2 is not valid JSON"),
    (MODEL + "data: {path: ./job.yaml}", "data.path", "unknown data format '.yaml'"),
    ("train: {seed: 1}\ntrain: {seed: 2}", "train", "key given twice (lines 3 and 4)"),
]


@pytest.mark.parametrize(
    ("yaml_text", "path", "words"), BAD_CASES, ids=[c[1] + ":" + c[2] for c in BAD_CASES]
)
def test_each_bad_field_is_named_with_its_fix(job_dir: Path, yaml_text: str, path: str, words: str) -> None:
    """A single mistake yields a problem at its field path that shows the value and what would fix it."""
    text = yaml_text + "\n" if yaml_text.startswith(("model:", "data:")) else MINIMAL + yaml_text + "\n"
    found = problems_of(write(job_dir, text))
    assert path in found, found
    assert words in found[path], found[path]
    assert found[path].startswith(f"  {path}: ")


def test_empty_json_list_has_no_records(job_dir: Path) -> None:
    """A .json data file holding an empty list is reported as having no records."""
    (job_dir / "empty.json").write_text("[]")
    found = problems_of(write(job_dir, "model: {path: ./model}\ndata: {path: ./empty.json}\n"))
    assert "empty list" in found["data.path"]


# --------------------------------------------------------------------------- many problems at once

BROKEN = """\
model: {path: ./nomodel, fallbacks: [./model, 3]}
data: {path: ./data.jsonl, text_field: txt}
quantization: {quant_type: nf5}
lora: {r: 0}
train: {micro_batchsize: 4, micro_batch_size: 3, effective_batch_size: 16, optimizer: adam, eval_steps: 10}
resources: {gpu_memory_limit: 20x}
supervise: {hang_timeout: soon, ladders: {oom_forward: [halve_microbatch]}}
outptu_dir: x
"""
BROKEN_PATHS = {
    "model.path",
    "model.fallbacks.1",
    "data.text_field",
    "quantization.quant_type",
    "lora.r",
    "train.micro_batchsize",
    "train.effective_batch_size",
    "train.optimizer",
    "train.eval_steps",
    "resources.gpu_memory_limit",
    "supervise.hang_timeout",
    "supervise.ladders.oom_forward.0",
    "outptu_dir",
}


def test_every_problem_is_reported_together(job_dir: Path) -> None:
    """One load lists the problems of every section, including checks on fields beside a bad one."""
    assert set(problems_of(write(job_dir, BROKEN))) == BROKEN_PATHS


def test_bad_field_does_not_cause_false_problems(job_dir: Path) -> None:
    """A field that failed its type check is not used (with its default) by cross-field checks."""
    text = "model: {path: ./model}\ndata: {path: ./data.jsonl, messages_field: 5}\n"
    assert set(problems_of(write(job_dir, text))) == {"data.messages_field"}


# --------------------------------------------------------------------------- the file itself


def test_missing_job_file(tmp_path: Path) -> None:
    """A job file that does not exist is one clear problem, not a traceback."""
    found = problems_of(tmp_path / "nope.yaml")
    assert "no such file" in found[FILE_PATH]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "the job file is empty"),
        ("# only a comment\n", "the job file is empty"),
        ("- model\n- data\n", "top level is a list"),
        ("just words\n", "top level is a string"),
    ],
)
def test_empty_or_non_mapping_file(tmp_path: Path, text: str, words: str) -> None:
    """An empty file or a top level that is not a mapping is named as such."""
    found = problems_of(write(tmp_path, text))
    assert words in found[FILE_PATH]


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    """A YAML syntax error is reported with its line and the text found there."""
    found = problems_of(write(tmp_path, "model:\n  path: ./m\n   extra: 1\n"))
    (where, line), *_ = found.items()
    assert where.startswith("line 3"), where
    assert "YAML syntax error" in line and "extra: 1" in line


def test_python_tags_are_refused_not_executed(tmp_path: Path) -> None:
    """A !!python/object tag is a problem naming the tag; the object is never constructed."""
    marker = tmp_path / "pwned"
    text = f'model: !!python/object/apply:os.system ["touch {marker}"]\ndata: {{path: x}}\n'
    found = problems_of(write(tmp_path, text))
    (line,) = found.values()
    assert "'!!python/object/apply:os.system' is not allowed" in line and "safe_load" in line
    assert not marker.exists()


# --------------------------------------------------------------------------- data formats


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _pyarrow_write(path: Path, columns: dict[str, list[object]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("d.csv", lambda p: p.write_text("text,label\nhello,1\n")),
        ("d.json", lambda p: p.write_text(json.dumps([{"text": "a", "label": 1}]))),
        ("d.json", lambda p: p.write_text(json.dumps({"text": ["a", "b"], "label": [1, 2]}))),
        ("d.json", lambda p: p.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": 2}\n')),
        ("d.parquet", lambda p: _pyarrow_write(p, {"text": ["a", "b"], "label": [1, 2]})),
        (
            "saved",
            lambda p: (
                p.mkdir(),
                (p / "dataset_info.json").write_text(json.dumps({"features": {"text": {}, "label": {}}})),
                (p / "state.json").write_text("{}"),
            ),
        ),
        (
            "dict",
            lambda p: (
                p.mkdir(),
                (p / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]})),
                (p / "train").mkdir(),
                (p / "train" / "dataset_info.json").write_text(
                    json.dumps({"features": {"text": {}, "label": {}}})
                ),
            ),
        ),
        ("files", lambda p: _pyarrow_write(_mkdir(p) / "part-0.parquet", {"text": ["a"], "label": [1]})),
    ],
    ids=["csv", "json-list", "json-columns", "json-lines", "parquet", "save_to_disk", "dataset_dict", "dir"],
)
def test_data_fields_are_read_from_every_format(
    job_dir: Path, name: str, make: Callable[[Path], object]
) -> None:
    """The text field is found (and a wrong one named) in csv, json, parquet and saved datasets."""
    make(job_dir / name)
    load_job(write(job_dir, f"model: {{path: ./model}}\ndata: {{path: ./{name}}}\n"))
    found = problems_of(
        write(job_dir, f"model: {{path: ./model}}\ndata: {{path: ./{name}, text_field: body}}\n")
    )
    assert "no field 'body'" in found["data.text_field"] and "fields: label, text" in found["data.text_field"]


# --------------------------------------------------------------------------- validate command


def test_validate_command_prints_a_summary(job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A good job prints OK with model, rows, effective batch as micro x accumulation, and output_dir."""
    job = write(job_dir, MINIMAL + "train: {micro_batch_size: 4, effective_batch_size: 32}\n")
    assert validate_command(str(job)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{job}: OK\n")
    assert "2 records" in out and "effective batch: 32 = micro-batch 4 x accumulation 8" in out
    assert f"output_dir: {job_dir / 'run'}" in out


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_validate_cli_lists_every_problem_and_exits_2(job_dir: Path) -> None:
    """`qlora-supervise validate` on a broken job exits 2 and prints each problem on its own line."""
    result = _cli("validate", str(write(job_dir, BROKEN)))
    assert result.returncode == 2, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith(f"{len(BROKEN_PATHS)} problems")
    assert {line.split(": ", 1)[0].strip() for line in lines[1:]} == BROKEN_PATHS
    assert all((line.startswith("  ") and "(got " in line) or "(missing" in line for line in lines[1:])


def test_validate_cli_ok_and_missing_file(job_dir: Path) -> None:
    """The CLI exits 0 with OK for a good job and 2 with a clear message for a missing file."""
    good = _cli("validate", str(write(job_dir, MINIMAL)))
    assert good.returncode == 0 and ": OK" in good.stdout
    missing = _cli("validate", str(job_dir / "absent.yaml"))
    assert missing.returncode == 2 and "no such file" in missing.stdout


def test_job_module_does_not_import_heavy_libraries() -> None:
    """Loading and validating jobs pulls in neither torch nor transformers, datasets or peft."""
    code = (
        "import sys, qlora_supervise.supervisor.jobfile as j, qlora_supervise.supervisor.commands.validate;"
        "bad = [m for m in ('torch', 'transformers', 'datasets', 'peft') if m in sys.modules];"
        "print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_keep_effective_batch_false_is_refused_with_the_reason(job_dir: Path) -> None:
    """Bug 3: a setting nothing reads is not silently accepted; false says why it cannot help."""
    path = write(job_dir, MINIMAL + "supervise:\n  keep_effective_batch: false\n")
    rendered = problems_of(path)["supervise.keep_effective_batch"]
    assert "saves no memory" in rendered and "keep_effective_batch: true" in rendered
    assert load_job(write(job_dir, MINIMAL + "supervise:\n  keep_effective_batch: true\n")).supervise

"""A foreign trainer's config that does not fit a capped card: our supervisor vs the tool's own
``auto_find_batch_size``, for ``trl sft``, axolotl and LLaMA-Factory.

    python -m bench.trainers.foreign_trainers --out OUT [--tool trl-sft|axolotl|llamafactory] [--python PY]
                                     [--cap 12GiB] [--steps 6] [--deadline-s 480]
    python -m bench.trainers.foreign_trainers --out /tmp/ft --tiny     # the same on the CPU, tiny model

One user config as a user writes it for the tool (micro-batch 8 x accumulation 2 at seq 1024, no
gradient checkpointing, paged AdamW 8-bit, r 8 on q/k/v/o, in the tool's own keys) is run twice on
the same model, under the same memory cap, both with the tool venv's interpreter ``--python``:

* **supervised**: ``qlora-supervise run job.yaml`` with ``trainer: {kind: TOOL, config: FILE}``
  (the pre-flight, the ladder, the shim in the tool's process, resume from our checkpoints);
* **auto_find_batch_size**: the tool's own entry point (``trl.scripts.sft``, ``axolotl.cli.train``,
  ``llamafactory.launcher``) on the same file plus ``auto_find_batch_size: true``, in a wrapper that
  applies the cap the way our child does (``torch.cuda.set_per_process_memory_fraction``; on the
  CPU ``RLIMIT_DATA`` after the imports) and prints a line per try (the batch size transformers
  tries) and per optimizer step.

On the GPU the model is the Llama-2-7B shape with random bf16 weights, built in this command by
``bench/models/memory_grid.py``'s ``build_all`` (its data rows are all longer than the sequence), and
both runs share the card at once (each is capped per process). ``--tiny`` uses the repository's
tiny model on the CPU (micro-batch 16 at seq 256 does not fit the cap there, 8 does), one run
after the other. Writes ``OUT/results.json`` and ``OUT/table.txt`` (printed last): attempts,
OOMs, lost steps, the effective batch first and last, steps done and wall time; and each run's
logs and journals under ``OUT/supervised/`` and ``OUT/auto/`` (the runs themselves, checkpoints
and all, stay under ``--work``). Not a test.

On the GPU machine, from the project root (``.whl`` carried, with ``.whl/axolotl/`` or
``.whl/llamafactory/`` for a tool), in one command of under 9 minutes::

    bash bench/trainers/device_tool_venvs.sh > $OUT/setup.log 2>&1; \
    /tmp/supenv/bin/python -m bench.trainers.foreign_trainers --out $OUT --tool axolotl \
      --python /tmp/axenv/bin/python --cap 12GiB --deadline-s 420 > $OUT/console.log 2>&1; \
    echo rc=$?; cat $OUT/table.txt

(``trl-sft`` runs in ``/tmp/supenv`` itself: ``--python /tmp/supenv/bin/python``.)

Both runs use the working tree's code even where an older qlora_supervise wheel is installed: a
symlinked ``qlora_supervise`` namespace is put first on their ``PYTHONPATH`` (as ``.ci/typecheck``
does); this process itself imports the installed one (``pip install -e .``, or the ``.whl`` in
``/tmp/supenv``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from .._launch import env_with_root, module_argv

ROOT = Path(__file__).resolve().parents[2]
GiB, MiB = 1 << 30, 1 << 20
TRY, STEP = "BENCH_TRY", "BENCH_STEP"


def source_path() -> str:
    """A folder whose ``qlora_supervise`` is this working tree (a namespace of symlinks)."""
    tree = Path(tempfile.gettempdir()) / f"foreign-trainers-src-{os.getuid()}"
    package = tree / "qlora_supervise"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("supervisor", "policies", "trainer_child"):
        link = package / name
        if not link.exists():
            link.symlink_to(ROOT / name)
    return str(tree)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = os.pathsep.join([source_path(), *(p for p in paths if p != source_path())])
    return {
        **os.environ,
        "PYTHONPATH": path,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(extra or {}),
    }


# --------------------------------------------------------------------------- the model and data


def build(work: Path, tiny: bool, seq: int) -> tuple[Path, Path]:
    """The model directory and a dataset directory (``datasets.load_dataset(dir)`` reads it)."""
    if tiny:
        base = work / "tiny"
        if not (base / "model" / "config.json").is_file():
            argv = [sys.executable, "-m", "qlora_supervise.trainer_child.recipe.tiny", str(base)]
            subprocess.run(argv, check=True, env=child_env(), capture_output=True)
        rows_file = base / "data.jsonl"
    else:
        from ..models.memory_grid import build_all  # the GPU benches' one builder of random-weight shapes

        info = build_all(["7b-32k"], work, False, seq)
        print("build:", json.dumps(info), flush=True)
        base = work / "7b-32k"
        rows_file = base / "data.jsonl"
    data = work / "dataset"
    data.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
    # text only: trl would read a messages column as chat turns
    (data / "train.jsonl").write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in rows))
    # LLaMA-Factory reads a dataset by name from dataset_dir/dataset_info.json, as instruction and
    # response: the first 16 words of each row ask, the rest answer.
    pairs = [r["text"].split(" ") for r in rows]
    (data / "pairs.jsonl").write_text(
        "".join(
            json.dumps({"instruction": " ".join(w[:16]), "output": " ".join(w[16:])}) + "\n" for w in pairs
        )
    )
    columns = {"prompt": "instruction", "response": "output"}
    (data / "dataset_info.json").write_text(
        json.dumps({"rows": {"file_name": "pairs.jsonl", "columns": columns}})
    )
    return base / "model", data


def user_config(tool: str, model: Path, data: Path, tiny: bool, steps: int) -> dict[str, Any]:
    """The config as a user writes it for ``tool``; on the CPU the tiny model's numbers (see --tiny)."""
    if tool == "axolotl":
        return axolotl_config(model, data, tiny, steps)
    if tool == "llamafactory":
        return llamafactory_config(model, data, tiny, steps)
    return {
        "model_name_or_path": str(model),
        "dataset_name": str(data),
        "use_peft": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "load_in_4bit": True,
        "use_bnb_nested_quant": True,
        "dtype": "float32" if tiny else "bfloat16",
        "bf16": not tiny,
        "per_device_train_batch_size": 16 if tiny else 8,
        "gradient_accumulation_steps": 1 if tiny else 2,
        "gradient_checkpointing": False,
        "max_length": 256 if tiny else 1024,
        "optim": "adamw_torch" if tiny else "paged_adamw_8bit",
        "learning_rate": 2.0e-4,
        "max_steps": steps,
        "save_steps": 2,
        "logging_steps": 1,
        "report_to": "none",
        "seed": 42,
        "output_dir": "./out",
    }


def axolotl_config(model: Path, data: Path, tiny: bool, steps: int) -> dict[str, Any]:
    """The same job in axolotl's keys: the rows as a ``completion`` dataset (its ``text`` field)."""
    config: dict[str, Any] = {
        "base_model": str(model),
        "datasets": [{"path": str(data / "train.jsonl"), "ds_type": "json", "type": "completion"}],
        "dataset_prepared_path": "./prepared",
        "adapter": "qlora",
        "load_in_4bit": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "sequence_len": 256 if tiny else 1024,
        "excess_length_strategy": "truncate",  # every row is longer: axolotl would drop them all
        "micro_batch_size": 16 if tiny else 8,
        "gradient_accumulation_steps": 1 if tiny else 2,
        "gradient_checkpointing": False,
        "optimizer": "adamw_torch" if tiny else "paged_adamw_8bit",
        "learning_rate": 2.0e-4,
        "lr_scheduler": "cosine",
        "bf16": not tiny,
        "sdp_attention": True,
        "max_steps": steps,
        "save_steps": 2,
        "logging_steps": 1,
        "seed": 42,
        "output_dir": "./out",
    }
    if tiny:  # axolotl turns its Triton LoRA kernels on by itself; on the CPU they cannot run
        config |= {"lora_qkv_kernel": False, "lora_o_kernel": False, "lora_mlp_kernel": False}
    return config


def llamafactory_config(model: Path, data: Path, tiny: bool, steps: int) -> dict[str, Any]:
    """The same job in LLaMA-Factory's keys (its checkpointing is on unless disabled: disabled, as
    in the other two configs)."""
    return {
        "model_name_or_path": str(model),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "lora_rank": 8,
        "lora_alpha": 16,
        "lora_target": "q_proj,k_proj,v_proj,o_proj",
        "quantization_bit": 4,
        "quantization_method": "bnb",
        "dataset": "rows",
        "dataset_dir": str(data),
        "template": "default",
        "cutoff_len": 256 if tiny else 1024,
        "per_device_train_batch_size": 16 if tiny else 8,
        "gradient_accumulation_steps": 1 if tiny else 2,
        "disable_gradient_checkpointing": True,
        "optim": "adamw_torch" if tiny else "paged_adamw_8bit",
        "learning_rate": 2.0e-4,
        "lr_scheduler_type": "cosine",
        "max_steps": steps,
        "save_steps": 2,
        "logging_steps": 1,
        "bf16": not tiny,
        "report_to": "none",
        "seed": 42,
        "output_dir": "./out",
    }


CONFIG_NAME = {"trl-sft": "sft.yaml", "axolotl": "axolotl.yaml", "llamafactory": "llamafactory.yaml"}


#: The tests' headroom on the tiny model above the tool's data segment after the stack's imports
#: (tests/_child.py, tests/test_trainer_tools_real.py): micro-batch 16 at seq 256 is over it, 8
#: under, for trl and axolotl. LLaMA-Factory's is trl's, unmeasured (it cannot run here: docs/trainers.md).
CPU_HEADROOM = {"trl-sft": 970 * MiB, "axolotl": 490 * MiB, "llamafactory": 970 * MiB}


def cpu_cap(tool: str, python: str) -> int:
    """The tiny model's cap for ``tool``, from its interpreter's own import baseline."""
    argv = [python, "-m", "qlora_supervise.trainer_child.recipe.stack", "--bytes"]
    done = subprocess.run(argv, check=True, env=child_env(), capture_output=True, text=True)
    return int(done.stdout.split()[-1]) + CPU_HEADROOM[tool]


# --------------------------------------------------------------------------- the two runs


def start_supervised(
    out: Path, tool: str, python: str, config: dict[str, Any], cap: int, tiny: bool
) -> tuple[subprocess.Popen[bytes], Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME[tool]).write_text(yaml.safe_dump(config, sort_keys=False))
    limit = {"cpu_memory_limit": f"{cap}B"} if tiny else {"gpu_memory_limit": f"{cap}B"}
    job = {
        "trainer": {"kind": tool, "config": CONFIG_NAME[tool], "python": python},
        "resources": {"gpu": "cpu" if tiny else "0", **limit},
        "supervise": {"hang_timeout": "10m", "backoff_initial": "1s", "backoff_max": "5s"},
        "output_dir": "./run",
    }
    (out / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    argv = [
        sys.executable,
        "-m",
        "qlora_supervise.supervisor.commands.cli",
        "run",
        str(out / "job.yaml"),
        "--plain",
    ]
    log = (out / "supervisor.log").open("wb")
    return subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=child_env()
    ), out / "supervisor.log"


def start_auto(
    out: Path, tool: str, python: str, config: dict[str, Any], cap: int, tiny: bool
) -> tuple[subprocess.Popen[bytes], Path]:
    out.mkdir(parents=True, exist_ok=True)
    name = "auto-" + CONFIG_NAME[tool]
    (out / name).write_text(yaml.safe_dump({**config, "auto_find_batch_size": True}, sort_keys=False))
    argv = [*module_argv(__spec__, python), "--_auto", str(out / name), "--_cap", str(cap), "--tool", tool]
    argv += ["--tiny"] if tiny else []
    log = (out / "tool.log").open("wb")
    # The same allocator setting our child gets (expandable segments on), so only the policy differs.
    env = env_with_root(child_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}))  # cwd is OUT
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out), out / "tool.log"


def auto_child(tool: str, config: str, cap: int, tiny: bool) -> None:
    """The tool's own entry point with ``auto_find_batch_size``, capped as our child caps itself."""
    import torch  # noqa: F401 - the stack first: the CPU cap counts from after the imports
    import transformers
    import trl  # noqa: F401

    from qlora_supervise.trainer_child.run import memory

    memory.apply_cpu_cap(cap) if tiny else memory.apply_gpu_cap(cap)
    inner = transformers.Trainer._inner_training_loop

    def traced(self: Any, batch_size: int | None = None, *args: Any, **kwargs: Any) -> Any:
        print(f"{TRY} batch_size={batch_size}", flush=True)
        return inner(self, batch_size, *args, **kwargs)

    class Steps(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            print(f"{STEP} {state.global_step}", flush=True)

    init = transformers.Trainer.__init__

    def with_steps(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.add_callback(Steps())

    transformers.Trainer._inner_training_loop = traced  # type: ignore[method-assign]
    transformers.Trainer.__init__ = with_steps  # type: ignore[method-assign]
    if tool == "axolotl":  # what `axolotl train FILE` runs, as our launch does
        sys.argv = ["axolotl", config]
        runpy.run_module("axolotl.cli.train", run_name="__main__")
    elif tool == "llamafactory":  # what `llamafactory-cli train FILE` runs on one GPU
        sys.argv = ["llamafactory", config]
        runpy.run_module("llamafactory.launcher", run_name="__main__")
    else:
        sys.argv = ["trl-sft", "--config", config]
        runpy.run_module("trl.scripts.sft", run_name="__main__")


def keep_logs(runs: Path, out: Path) -> None:
    """The logs and journals of both runs into OUT (not the checkpoints: they can be large)."""
    sup = runs / "supervised"
    names = ["supervisor.log", "job.yaml", *CONFIG_NAME.values(), "run/attempts.jsonl", "run/events.jsonl"]
    files = [sup / n for n in names] + sorted(sup.glob("run/attempt-*/*"))
    files += [runs / "auto" / "tool.log", *sorted((runs / "auto").glob("auto-*.yaml"))]
    for path in files:
        if path.is_file() and path.stat().st_size < 20 * MiB:
            target = out / path.relative_to(runs)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


def wait(
    procs: list[subprocess.Popen[bytes]], deadline: float, started: float
) -> list[tuple[int | None, float]]:
    """Each process's exit status and its seconds from ``started`` to its own exit (runs that
    share the card end at different times); past ``deadline`` the rest are stopped."""
    ended: dict[int, float] = {}
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for i, proc in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic() - started
        time.sleep(0.2)
    for i, proc in enumerate(procs):
        if i in ended:
            continue
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ended[i] = time.monotonic() - started
    return [(proc.returncode, ended[i]) for i, proc in enumerate(procs)]


# --------------------------------------------------------------------------- results


def supervised_result(out: Path, code: int | None, seconds: float) -> dict[str, Any]:
    from qlora_supervise.supervisor.record.journal import read_attempts

    records, _ = read_attempts(out / "run" / "attempts.jsonl")
    ooms = [
        r for r in records if r.failure is not None and r.failure.kind.value.startswith(("oom", "host_oom"))
    ]
    batches = [f"{r.knobs.micro_batch_size}x{r.knobs.grad_accum}={r.knobs.effective_batch}" for r in records]
    return {
        "exit": code,
        "attempts": len(records),
        "ooms": len(ooms),
        "oom_kinds": [r.failure.kind.value for r in ooms if r.failure is not None],
        "lost_steps": sum(r.lost_steps for r in records),
        "effective_batch": [r.knobs.effective_batch for r in records][:1]
        + [r.knobs.effective_batch for r in records][-1:],
        "micro_x_accum": batches,
        "changes": [r.decision.rung for r in records if r.decision is not None and r.restarts],
        "steps": max((r.steps_completed for r in records), default=0),
        "finished": bool(records) and records[-1].outcome.value == "succeeded",
        "wall_s": round(seconds, 1),
    }


def auto_result(log: Path, config: dict[str, Any], code: int | None, seconds: float) -> dict[str, Any]:
    text = log.read_text(errors="replace") if log.is_file() else ""
    tries = [int(b) for b in re.findall(rf"{TRY} batch_size=(\d+)", text)]
    steps = [int(s) for s in re.findall(rf"{STEP} (\d+)", text)]
    # Each new try starts at step 0 in the same process: every step before the last try's is lost.
    last_try = text.rfind(TRY)
    done = [int(s) for s in re.findall(rf"{STEP} (\d+)", text[last_try:])] if last_try >= 0 else []
    accum = int(config["gradient_accumulation_steps"])
    died_oom = code not in (0, None) and re.search(r"out of memory|can't allocate memory", text) is not None
    return {
        "exit": code,
        "attempts": len(tries),
        "ooms": max(len(tries) - 1, 0) + int(died_oom),
        "lost_steps": len(steps) - len(done),
        "effective_batch": [tries[0] * accum, tries[-1] * accum] if tries else [],
        "micro_x_accum": [f"{b}x{accum}={b * accum}" for b in tries],
        "steps": max(done, default=0),
        "finished": code == 0 and bool(done) and max(done) >= int(config["max_steps"]),
        "wall_s": round(seconds, 1),
    }


def _cell(result: dict[str, Any], key: str) -> str:
    value = result.get(key)
    if value is None:
        return "-"
    if isinstance(value, list):
        return (" -> " if key == "effective_batch" else ", ").join(str(v) for v in value)
    return str(value)


ROWS = (
    ("attempts", "attempts"),
    ("OOMs", "ooms"),
    ("lost steps", "lost_steps"),
    ("effective batch (first -> last)", "effective_batch"),
    ("micro x accum per attempt", "micro_x_accum"),
    ("ladder's changes", "changes"),
    ("steps done", "steps"),
    ("finished", "finished"),
    ("exit code", "exit"),
    ("wall s", "wall_s"),
)


def table(results: dict[str, dict[str, Any]], tool: str, cap: int, tiny: bool) -> str:
    where = (
        f"CPU, tiny model, RLIMIT_DATA {cap / MiB:.0f} MiB"
        if tiny
        else f"GPU, 7B shape, cap {cap / GiB:.1f} GiB"
    )
    a, b = results["supervised"], results["auto_find_batch_size"]
    rows = [("", "qlora-supervise", f"{tool.split('-')[0]} auto_find_batch_size")]
    rows += [(label, _cell(a, key), _cell(b, key)) for label, key in ROWS]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{tool.replace('-', ' ')}, one config ({where})"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "foreign_trainers")
    p.add_argument("--tiny", action="store_true", help="the CPU and the tiny model")
    p.add_argument("--tool", choices=sorted(CONFIG_NAME), default="trl-sft")
    p.add_argument("--python", default=sys.executable, help="the tool venv's interpreter (both runs)")
    p.add_argument("--cap", default="12GiB", help="GPU memory cap of each run (ignored with --tiny)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--deadline-s", type=float, default=480.0)
    p.add_argument("--_auto", help=argparse.SUPPRESS)
    p.add_argument("--_cap", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._auto:  # its PYTHONPATH starts with source_path() (child_env)
        auto_child(args.tool, args._auto, int(args._cap), args.tiny)
        return 0
    if args.out is None:
        p.error("--out is required")
    start = time.monotonic()
    deadline = start + args.deadline_s
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]  # the builder's subprocesses too
    from qlora_supervise.supervisor.facts.units import parse_bytes

    model, data = build(args.work, args.tiny, 1024)
    cap = cpu_cap(args.tool, args.python) if args.tiny else parse_bytes(args.cap)
    config = user_config(args.tool, model, data, args.tiny, args.steps)
    results: dict[str, dict[str, Any]] = {}
    runs = args.work / "runs"  # checkpoints and models stay out of OUT: only the logs go there
    shutil.rmtree(runs, ignore_errors=True)
    started = time.monotonic()
    sup, _ = start_supervised(runs / "supervised", args.tool, args.python, config, cap, args.tiny)
    if args.tiny:  # two cores: one run after the other
        ((code_a, seconds_a),) = wait([sup], deadline, started)
        started = time.monotonic()
        auto, auto_log = start_auto(runs / "auto", args.tool, args.python, config, cap, args.tiny)
        ((code_b, seconds_b),) = wait([auto], deadline, started)
    else:  # one H200: both at once, each capped per process
        auto, auto_log = start_auto(runs / "auto", args.tool, args.python, config, cap, args.tiny)
        (code_a, seconds_a), (code_b, seconds_b) = wait([sup, auto], deadline, started)
    results["supervised"] = supervised_result(runs / "supervised", code_a, seconds_a)
    results["auto_find_batch_size"] = auto_result(auto_log, config, code_b, seconds_b)
    keep_logs(runs, args.out)
    text = table(results, args.tool, cap, args.tiny)
    report = {"tool": args.tool, "python": args.python, "tiny": args.tiny, "cap_bytes": cap,
              "config": config, "results": results,
              "total_s": round(time.monotonic() - start, 1)}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "table.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

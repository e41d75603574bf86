"""The failure classifier: text signatures, stage from frames, OOM rules, exit precedence, CLI."""

# ruff: noqa: E501  -- table rows hold whole error messages; one case per line keeps the tables readable

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qlora_supervise.supervisor.commands.classify import classify_command, format_size
from qlora_supervise.supervisor.diagnosis._frames import Frame, frame_stage, parse_frames, stage_from_frames
from qlora_supervise.supervisor.diagnosis._oom_rules import contention, derive, fragmentation
from qlora_supervise.supervisor.diagnosis.classify import classify_exit, classify_text
from qlora_supervise.supervisor.facts.failure import ChildExit, Failure, KilledBy
from qlora_supervise.trainer_child.contract.codes import ExitCode, FailureKind, Stage
from qlora_supervise.trainer_child.contract.report import ErrorReport

GIB, MIB = 1024**3, 1024**2
SITE = "/venv/lib/python3.11/site-packages"
K = FailureKind

# --- frames and messages, written from the documented formats with our own values ---------------

TRAIN = ("/work/train.py", "main", "trainer.train()")
HF_STEP = (f"{SITE}/transformers/trainer.py", "training_step", "loss = self.compute_loss(model, inputs)")
HF_BACKWARD = (f"{SITE}/transformers/trainer.py", "training_step", "self.accelerator.backward(loss)")
TENSOR_BACKWARD = (f"{SITE}/torch/_tensor.py", "backward", "torch.autograd.backward(self, gradient)")
ENGINE = (
    f"{SITE}/torch/autograd/graph.py",
    "_engine_run_backward",
    "return Variable._execution_engine.run_backward(",
)
CKPT_UNPACK = (f"{SITE}/torch/utils/checkpoint.py", "unpack_hook", "frame.recompute_fn(*args)")
MLP = (
    f"{SITE}/transformers/models/llama/modeling_llama.py",
    "forward",
    "down = self.down_proj(self.act_fn(x))",
)
RMSNORM = (
    f"{SITE}/transformers/models/llama/modeling_llama.py",
    "forward",
    "hidden = hidden.to(torch.float32)",
)
CE = (
    f"{SITE}/torch/nn/functional.py",
    "cross_entropy",
    "return torch._C._nn.cross_entropy_loss(input, target)",
)
OPT_STEP = ("/work/train.py", "train", "optimizer.step()")
ADAMW = (
    f"{SITE}/torch/optim/adamw.py",
    "_multi_tensor_adamw",
    "exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)",
)
INIT_GROUP = (f"{SITE}/torch/optim/adam.py", "_init_group", "state['exp_avg'] = torch.zeros_like(p)")
CLOSURE = ("/work/train.py", "closure", "loss = model(**batch).loss")
LIGHTNING_STEP = (
    f"{SITE}/lightning/pytorch/core/optimizer.py",
    "step",
    "step_output = self._strategy.optimizer_step()",
)
FROM_PRETRAINED = (
    f"{SITE}/transformers/modeling_utils.py",
    "from_pretrained",
    "model = cls._load_pretrained_model()",
)
APPLY = (f"{SITE}/torch/nn/modules/module.py", "_apply", "param_applied = fn(param)")
CONVERT = (f"{SITE}/torch/nn/modules/module.py", "convert", "return t.to(device)")
PREPARE_KBIT = (
    f"{SITE}/peft/utils/other.py",
    "prepare_model_for_kbit_training",
    "param.data = param.data.to(torch.float32)",
)
EVALUATE = (f"{SITE}/transformers/trainer.py", "evaluate", "output = eval_loop(eval_dataloader)")
PREDICTION_STEP = (f"{SITE}/transformers/trainer.py", "prediction_step", "outputs = model(**inputs)")
GENERATE = (f"{SITE}/transformers/generation/utils.py", "generate", "result = self._sample(input_ids)")
MERGE_UNLOAD = (
    f"{SITE}/peft/tuners/lora/model.py",
    "merge_and_unload",
    "return self._unload_and_optionally_merge()",
)
MERGE_SCRIPT = ("/work/merge_adapter.py", "main", "model = PeftModel.from_pretrained(base, adapter_dir)")
SAVE_MERGED = ("/work/export.py", "main", "merged.save_pretrained(out_dir)")

NEW_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {req}. GPU 0 has a total capacity "
    "of {total} of which {free} is free. {procs}Including non-PyTorch memory, this process has {mine} "
    "memory in use. Of the allocated memory {alloc} is allocated by PyTorch, and {unalloc} is reserved "
    "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
OLD_OOM = (
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate {req} (GPU 0; {total} total "
    "capacity; {alloc} already allocated; {free} free; {reserved} reserved in total by PyTorch) If "
    "reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation."
)
PLAIN_OOM = NEW_OOM.format(
    req="1.00 GiB", total="23.64 GiB", free="400.00 MiB", procs="", mine="23.20 GiB",
    alloc="22.80 GiB", unalloc="200.00 MiB",
)  # fmt: skip
H200_CAPPED = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 204.00 MiB. GPU 0 has a total "
    "capacity of 139.80 GiB of which 131.17 GiB is free. Including non-PyTorch memory, this process "
    "has 8.62 GiB memory in use. 8.00 GiB allowed; Of the allocated memory 7.58 GiB is allocated by "
    "PyTorch, and 306.47 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation."
)
CPU_OOM = (
    "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
    "memory: you tried to allocate 268435456 bytes. Error code 12 (Cannot allocate memory)"
)
DRIVER_OOM = (
    "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at "
    "some other API call, so the stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1."
)
CUBLAS_OOM = "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
ILLEGAL = (
    "RuntimeError: CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
    "asynchronously reported at some other API call, so the stacktrace below might be incorrect."
)
ASSERT = "RuntimeError: CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."


def tb(*frames: tuple[str, str, str], error: str = "", prefix: str = "") -> str:
    """A CPython traceback, outermost frame first, ending with ``error``."""
    lines = [f"{prefix}Traceback (most recent call last):"]
    for path, function, source in frames:
        lines += [f'{prefix}  File "{path}", line 42, in {function}', f"{prefix}    {source}"]
    return "\n".join([*lines, *(prefix + line for line in error.splitlines())])


# --- classify_text: kinds -----------------------------------------------------------------------

TEXT_CASES: list[tuple[str, str, FailureKind, Stage]] = [
    ("new wording in backward", tb(TRAIN, HF_BACKWARD, TENSOR_BACKWARD, ENGINE, error=PLAIN_OOM), K.OOM_BACKWARD, Stage.BACKWARD),
    ("old wording in the loss", tb(TRAIN, HF_STEP, CE, error=OLD_OOM.format(req="2.00 GiB", total="15.78 GiB", alloc="12.00 GiB", free="1.00 GiB", reserved="12.50 GiB")), K.OOM_FORWARD, Stage.FORWARD),
    ("our capped H200 run in the MLP", tb(TRAIN, HF_STEP, MLP, error=H200_CAPPED), K.OOM_FORWARD, Stage.FORWARD),
    ("optimizer state at the first step", tb(TRAIN, OPT_STEP, INIT_GROUP, error=PLAIN_OOM), K.OOM_OPTIMIZER, Stage.OPTIMIZER),
    ("multi-tensor AdamW", tb(OPT_STEP, ADAMW, error=PLAIN_OOM), K.OOM_OPTIMIZER, Stage.OPTIMIZER),
    ("weights moved with .to()", tb(FROM_PRETRAINED, APPLY, CONVERT, error=PLAIN_OOM), K.OOM_LOAD, Stage.LOAD),
    ("prepare_model_for_kbit_training", tb(TRAIN, PREPARE_KBIT, error=PLAIN_OOM), K.OOM_LOAD, Stage.LOAD),
    ("evaluate wins over its forward", tb(TRAIN, EVALUATE, PREDICTION_STEP, MLP, error=PLAIN_OOM), K.OOM_EVAL, Stage.EVAL),
    ("generate", tb(TRAIN, GENERATE, MLP, error=PLAIN_OOM), K.OOM_EVAL, Stage.EVAL),
    ("merge_and_unload", tb(TRAIN, MERGE_UNLOAD, error=PLAIN_OOM), K.OOM_MERGE, Stage.MERGE),
    ("adapter load inside a merge script", tb(MERGE_SCRIPT, FROM_PRETRAINED, APPLY, error=PLAIN_OOM), K.OOM_MERGE, Stage.MERGE),
    ("saving a merged model from an export script", tb(SAVE_MERGED, error=PLAIN_OOM), K.OOM_MERGE, Stage.MERGE),
    ("HIP", tb(TRAIN, HF_STEP, MLP, error="torch.OutOfMemoryError: HIP out of memory. Tried to allocate 224.00 MiB."), K.OOM_FORWARD, Stage.FORWARD),
    ("XPU", tb(TRAIN, HF_BACKWARD, error="torch.OutOfMemoryError: XPU out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 47.98 GiB. Of the allocated memory 45.00 GiB is allocated by PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated."), K.OOM_BACKWARD, Stage.BACKWARD),
    ("CUBLAS alloc failure in backward", tb(HF_BACKWARD, TENSOR_BACKWARD, ENGINE, error=CUBLAS_OOM), K.OOM_BACKWARD, Stage.BACKWARD),
    ("driver-level out of memory at load", tb(FROM_PRETRAINED, APPLY, CONVERT, error=DRIVER_OOM), K.OOM_LOAD, Stage.LOAD),
    ("CPU allocator with stage frames", tb(TRAIN, HF_STEP, MLP, error=CPU_OOM), K.OOM_FORWARD, Stage.FORWARD),
    ("bare CPU allocator message", CPU_OOM, K.HOST_OOM, Stage.UNKNOWN),
    ("shell Killed line", "Loading checkpoint shards:  40%|####      | 2/5 [00:31<00:47]Killed", K.HOST_OOM, Stage.LOAD),
    ("launcher exit -9", "E0101 00:00:00.000000 1 torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: -9) local_rank: 0 (pid: 1234) of binary: /usr/bin/python3", K.HOST_OOM, Stage.UNKNOWN),
    ("kernel OOM killer line", "[12345.678901] Out of memory: Killed process 4321 (python) total-vm:90000000kB, anon-rss:60000000kB", K.HOST_OOM, Stage.UNKNOWN),
    ("bnb CUDA setup failed", "RuntimeError:\n        CUDA Setup failed despite GPU being available. Please run the following command to get more information:\n        python -m bitsandbytes", K.BNB_CUDA_SETUP, Stage.SETUP),
    ("bnb CPU-only build", f"{SITE}/bitsandbytes/libbitsandbytes_cpu.so: undefined symbol: cadam32bit_grad_fp32", K.BNB_CUDA_SETUP, Stage.SETUP),
    ("NCCL watchdog", "[rank1]:[E1201 10:00:00.000000 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600123 milliseconds before timing out.", K.NCCL, Stage.UNKNOWN),
    ("NCCL system error", "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error\nncclSystemError: System call (e.g. socket, malloc) or external library call failed", K.NCCL, Stage.UNKNOWN),
    ("illegal memory access in optimizer.step", tb(TRAIN, OPT_STEP, ADAMW, error=ILLEGAL), K.OTHER, Stage.OPTIMIZER),
    ("device-side assert in the loss", tb(TRAIN, HF_STEP, CE, error=ASSERT), K.OTHER, Stage.FORWARD),
    ("KeyError in merge_and_unload", tb(TRAIN, MERGE_UNLOAD, error="KeyError: 'base_model.model.layers.3.self_attn.q_proj'"), K.OTHER, Stage.MERGE),
    ("dtype mismatch in a LoRA layer", tb(TRAIN, HF_STEP, MLP, error="RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16"), K.OTHER, Stage.FORWARD),
    ("notebook header names a non-OOM class", "ValueError                                Traceback (most recent call last)\n<ipython-input-3-abc> in <cell line: 1>()\n----> 1 merged = model.merge_and_unload()\n", K.OTHER, Stage.MERGE),
    ("kernel assertion lines without the exception line", "/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1289: indexSelectLargeIndex: block: [1,0,0], thread: [0,0,0] Assertion `srcIndex < srcSelectDimSize` failed.\n" + tb(TRAIN, HF_STEP, MLP), K.OTHER, Stage.FORWARD),
    ("traceback cut before its exception line", tb(TRAIN, HF_BACKWARD, TENSOR_BACKWARD), K.OOM_BACKWARD, Stage.BACKWARD),
    ("no traceback, no error", "step 10 loss 1.23\nstep 20 loss 1.11\n", K.OTHER, Stage.UNKNOWN),
    ("OOM without any stage frame", PLAIN_OOM, K.OOM_FORWARD, Stage.UNKNOWN),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "kind", "stage"), TEXT_CASES, ids=[c[0] for c in TEXT_CASES])
def test_classify_text(name: str, text: str, kind: FailureKind, stage: Stage) -> None:
    """Each documented failure text gets its kind and the stage its frames name."""
    failure = classify_text(text)
    assert (failure.kind, failure.stage) == (kind, stage), failure.evidence


def test_non_oom_errors_are_never_called_oom() -> None:
    """Illegal access, device-side assert, merge KeyError and dtype errors are not OOMs."""
    for name, text, kind, _ in TEXT_CASES:
        if kind is K.OTHER:
            assert not classify_text(text).kind.is_oom, name


def test_a_warning_that_mentions_memory_is_not_an_oom() -> None:
    """Prose that mentions running out of memory does not make a KeyError an OOM."""
    text = "UserWarning: large batches may run out of memory on small cards\n" + tb(
        TRAIN, MERGE_UNLOAD, error="KeyError: 'lm_head'"
    )
    assert classify_text(text).kind is K.OTHER


def test_long_log_is_read_from_its_end() -> None:
    """A log of many megabytes is classified from its tail, where the failure is."""
    progress = "".join(f"{{'loss': 1.{i % 100:02d}, 'epoch': {i}}}\n" for i in range(100_000))
    text = progress + tb(TRAIN, HF_BACKWARD, TENSOR_BACKWARD, error=PLAIN_OOM)
    assert len(text) > 2_000_000
    assert classify_text(text).kind is K.OOM_BACKWARD


def test_rank_prefixed_traceback() -> None:
    """``[rankN]:`` prefixes on every line do not hide the frames or the message."""
    text = tb(TRAIN, HF_BACKWARD, TENSOR_BACKWARD, error=PLAIN_OOM, prefix="[rank3]: ")
    assert classify_text(text).kind is K.OOM_BACKWARD


def test_message_printed_before_its_traceback() -> None:
    """A logger may print the message first and the traceback after: the frames still count."""
    text = PLAIN_OOM + "\n" + tb(TRAIN, OPT_STEP, ADAMW)
    assert classify_text(text).kind is K.OOM_OPTIMIZER


def test_fragmentation_hint_sentence_alone_is_not_fragmentation() -> None:
    """Every allocator message mentions fragmentation; without the numbers it decides nothing."""
    assert "fragmentation" in PLAIN_OOM
    assert classify_text(tb(TRAIN, HF_STEP, MLP, error=PLAIN_OOM)).kind is K.OOM_FORWARD


def test_failure_numbers_carry_bytes_and_derived_values() -> None:
    """Numbers are integers; old wording gets reserved_unallocated and others_in_use derived."""
    text = OLD_OOM.format(
        req="2.00 GiB", total="16.00 GiB", alloc="10.00 GiB", free="1.00 GiB", reserved="11.00 GiB"
    )
    numbers = classify_text(text).numbers
    assert numbers["tried_to_allocate"] == 2 * GIB
    assert numbers["reserved_unallocated"] == 1 * GIB
    assert numbers["others_in_use"] == 4 * GIB


# --- stage from frames --------------------------------------------------------------------------


def frames(*items: tuple[str, str, str]) -> list[Frame]:
    return [Frame(*item) for item in items]


STAGE_CASES: list[tuple[str, list[Frame], Stage]] = [
    ("checkpoint recompute inside backward is backward", frames(TRAIN, HF_BACKWARD, ENGINE, CKPT_UNPACK, MLP), Stage.BACKWARD),
    ("forward inside optimizer.step(closure) is forward", frames(TRAIN, OPT_STEP, CLOSURE, MLP), Stage.FORWARD),
    ("backward inside Lightning's optimizer step is backward", frames(TRAIN, LIGHTNING_STEP, TENSOR_BACKWARD), Stage.BACKWARD),
    ("a .to() inside a model forward is forward, not load", frames(TRAIN, HF_STEP, RMSNORM), Stage.FORWARD),
    ("load frames", frames(TRAIN, FROM_PRETRAINED, APPLY, CONVERT), Stage.LOAD),
    ("merge beats eval", frames(MERGE_UNLOAD, GENERATE), Stage.MERGE),
    ("no stage frame", frames(TRAIN), Stage.UNKNOWN),
]  # fmt: skip


@pytest.mark.parametrize(("name", "chain", "stage"), STAGE_CASES, ids=[c[0] for c in STAGE_CASES])
def test_stage_from_frames(name: str, chain: list[Frame], stage: Stage) -> None:
    """The documented stage rule: contexts, then the deepest training frame, recompute is backward."""
    assert stage_from_frames(chain).stage is stage


def test_ipython_and_rich_layouts_give_frames() -> None:
    """IPython (``p in f()`` + ``--> N``) and rich (``│ p:N in f │`` + ``❱``) layouts are read."""
    ipython = (
        "/x/site-packages/transformers/trainer.py in evaluate(self)\n   3000 \n-> 3001     out = loop()\n"
    )
    rich = (
        "│ /x/site-packages/peft/tuners/lora/model.py:400 in merge_and_unload   │\n│ ❱ 401 │   return x │\n"
    )
    assert stage_from_frames(parse_frames(ipython)).stage is Stage.EVAL
    assert stage_from_frames(parse_frames(rich)).stage is Stage.MERGE


def test_source_line_is_read_before_the_function_name() -> None:
    """Within one frame the call in progress decides: ``loss.backward()`` in optimizer_step."""
    assert frame_stage(Frame("/x/strategy.py", "optimizer_step", "loss.backward()")) is Stage.BACKWARD


# --- fragmentation and contention rules ---------------------------------------------------------


def new_numbers(**values: float) -> dict[str, int]:
    return {key: round(value * GIB) for key, value in values.items()}


def test_fragmentation_needs_a_large_unallocated_pool_that_covers_the_request() -> None:
    """unallocated >= max(512 MiB, min(1 GiB, 5 %)), unallocated + free >= request, card not full."""
    base = {"total_capacity": 24.0, "free": 0.5, "already_allocated": 18.0}
    assert fragmentation(derive(new_numbers(**base, reserved_unallocated=3.0, tried_to_allocate=3.2)))
    assert not fragmentation(derive(new_numbers(**base, reserved_unallocated=3.0, tried_to_allocate=4.0)))
    assert not fragmentation(derive(new_numbers(**base, reserved_unallocated=0.6, tried_to_allocate=0.2)))
    small_card = {"total_capacity": 8.0, "free": 0.0, "already_allocated": 6.0}
    assert fragmentation(derive(new_numbers(**small_card, reserved_unallocated=0.6, tried_to_allocate=0.3)))
    # 5 % of a small card is still the allocator's ordinary slack: not fragmentation.
    assert not fragmentation(
        derive(new_numbers(**small_card, reserved_unallocated=0.45, tried_to_allocate=0.3))
    )


def test_a_full_card_is_no_fragmentation() -> None:
    """When allocated + request fill >= 95 % of the capacity, unallocated slack is no remedy (H200, 8 GiB cap)."""
    full = new_numbers(total_capacity=8.0, free=0.0, already_allocated=7.58, tried_to_allocate=0.34)
    assert not fragmentation(derive({**full, "reserved_unallocated": round(0.6 * GIB)}))


def test_fragmentation_under_a_cap_counts_only_headroom_below_the_cap() -> None:
    """With ``N allowed``, the device's free memory beyond the cap does not serve the request."""
    capped = new_numbers(
        total_capacity=140,
        free=120,
        allowed=8,
        already_allocated=5.8,
        reserved_unallocated=2.0,
        tried_to_allocate=3.0,
    )
    assert fragmentation(derive(capped)) is None
    assert classify_text(H200_CAPPED).kind is K.OOM_FORWARD  # 306 MiB unallocated: not fragmentation


def test_contention_when_others_hold_half_the_card() -> None:
    """others = total - free - max(this process, reserved) >= 50 % of the total is contention."""
    text = NEW_OOM.format(
        req="1.00 GiB", total="24.00 GiB", free="100.00 MiB", procs="Process 77 has 15.00 GiB memory in use. ",
        mine="8.50 GiB", alloc="8.00 GiB", unalloc="200.00 MiB",
    )  # fmt: skip
    failure = classify_text(tb(TRAIN, HF_STEP, MLP, error=text))
    assert (failure.kind, failure.stage) == (K.OOM_CONTENTION, Stage.FORWARD)
    assert failure.numbers["processes"] == {77: 15 * GIB}


def test_contention_from_zero_byte_process_lines_uses_the_gap() -> None:
    """Drivers in containers print 0 bytes per process: total - free - ours still shows others."""
    numbers = derive(
        new_numbers(
            total_capacity=80, free=0.01, process_in_use=0, already_allocated=10, reserved_unallocated=0.1
        )
        | {"processes": {1: 0, 2: 0}}
    )
    assert contention(numbers)


def test_contention_is_checked_before_fragmentation() -> None:
    """Others holding most of the card win over fragmentation numbers."""
    old = OLD_OOM.format(
        req="1.00 GiB", total="32.00 GiB", alloc="2.00 GiB", free="10.00 MiB", reserved="4.00 GiB"
    )
    assert classify_text(old).kind is K.OOM_CONTENTION


def test_some_other_process_below_half_leaves_the_stage_kind() -> None:
    """Another process with 30 % of the card and no fragmentation: the stage decides."""
    text = NEW_OOM.format(
        req="1.00 GiB", total="20.00 GiB", free="100.00 MiB", procs="Process 9 has 6.00 GiB memory in use. ",
        mine="13.80 GiB", alloc="13.50 GiB", unalloc="200.00 MiB",
    )  # fmt: skip
    assert classify_text(tb(TRAIN, HF_BACKWARD, TENSOR_BACKWARD, error=text)).kind is K.OOM_BACKWARD


def test_capped_process_at_its_cap_is_not_contention() -> None:
    """A process stopped by its own ``allowed`` cap is not waiting for others."""
    numbers = derive(
        new_numbers(
            total_capacity=80,
            free=10,
            process_in_use=8,
            allowed=8,
            already_allocated=7.5,
            tried_to_allocate=1,
        )
    )
    assert contention(numbers) is None


# --- classify_exit precedence -------------------------------------------------------------------


def report(**fields: object) -> ErrorReport:
    base: dict[str, object] = {
        "exit_code": int(ExitCode.OOM),
        "exception_type": "OutOfMemoryError",
        "message": PLAIN_OOM,
        "traceback": "",
        "stage": "backward",
        "step": 12,
        "is_oom": True,
    }
    base.update(fields)
    return ErrorReport(**base)  # type: ignore[arg-type]


EXITED_OOM = ChildExit(returncode=int(ExitCode.OOM), signal=None, killed_by_supervisor=None, duration_s=60.0)
SIGKILLED = ChildExit(
    returncode=-signal.SIGKILL, signal=signal.SIGKILL, killed_by_supervisor=None, duration_s=9.0
)


def test_hang_kill_wins_over_everything() -> None:
    """A child the supervisor killed for hanging is a hang, whatever its report says."""
    hung = ChildExit(returncode=-9, signal=9, killed_by_supervisor=KilledBy.HANG, duration_s=900.0)
    assert classify_exit(hung, report(), "Killed", cgroup_oom_kills=1).kind is K.HANG


def test_report_stage_decides_an_oom() -> None:
    """An OOM report is an OOM of the report's stage, with the report's numbers."""
    numbers = {"tried_to_allocate": GIB, "total_capacity": 24 * GIB, "free": 0, "already_allocated": 23 * GIB}
    failure = classify_exit(EXITED_OOM, report(oom_numbers=numbers), "")
    assert (failure.kind, failure.stage) == (K.OOM_BACKWARD, Stage.BACKWARD)
    assert failure.evidence.startswith("error report: OutOfMemoryError in backward at step 12")


def test_report_numbers_still_go_through_fragmentation() -> None:
    """Fragmentation numbers in a report turn a backward OOM into oom_fragmentation."""
    numbers = new_numbers(
        tried_to_allocate=2, total_capacity=24, free=0.2, already_allocated=18, reserved_unallocated=4
    )
    failure = classify_exit(EXITED_OOM, report(oom_numbers=numbers), "")
    assert (failure.kind, failure.stage) == (K.OOM_FRAGMENTATION, Stage.BACKWARD)


def test_nvml_sample_shows_contention_the_message_does_not() -> None:
    """NVML's count of other processes' memory is a second witness for contention."""
    failure = classify_exit(
        EXITED_OOM, report(oom_numbers={}), "", gpu_others_bytes=50 * GIB, gpu_total_bytes=80 * GIB
    )
    assert failure.kind is K.OOM_CONTENTION


def test_cpu_oom_in_our_child_is_an_oom_of_its_stage() -> None:
    """The CPU cap emulates a small card: a CPU allocator failure in forward is oom_forward."""
    cpu = report(exception_type="RuntimeError", message=CPU_OOM, stage="forward", device="cpu",
                 oom_numbers={"tried_to_allocate": 268435456})  # fmt: skip
    assert classify_exit(EXITED_OOM, cpu, "").kind is K.OOM_FORWARD


def test_report_config_error_and_bnb_setup() -> None:
    """A config_error report is config_error; a bitsandbytes setup failure is bnb_cuda_setup."""
    config = report(exception_type="ConfigError", message="no field 'text'", is_oom=False, config_error=True)
    bnb = report(exception_type="RuntimeError", message="CUDA Setup failed despite GPU being available.",
                 is_oom=False, stage="setup")  # fmt: skip
    failed = ChildExit(int(ExitCode.FAILED), None, None, 3.0)
    assert classify_exit(ChildExit(int(ExitCode.CONFIG), None, None, 1.0), config, "").kind is K.CONFIG_ERROR
    assert classify_exit(failed, bnb, "").kind is K.BNB_CUDA_SETUP


def test_report_not_flagged_oom_but_naming_one_is_an_oom() -> None:
    """A report whose text is an allocator failure counts as OOM even if the flag was missed."""
    missed = report(exception_type="MemoryError", message="", is_oom=False, stage="load")
    assert classify_exit(ChildExit(int(ExitCode.FAILED), None, None, 3.0), missed, "").kind is K.OOM_LOAD


def test_report_of_a_non_oom_error_is_other_at_its_stage() -> None:
    """An illegal memory access reported in optimizer is other, stage optimizer."""
    bad = report(exception_type="RuntimeError", message=ILLEGAL, is_oom=False, stage="optimizer")
    failure = classify_exit(ChildExit(int(ExitCode.FAILED), None, None, 3.0), bad, "")
    assert (failure.kind, failure.stage) == (K.OTHER, Stage.OPTIMIZER)


def test_sigkill_with_cgroup_oom_kill_is_host_oom() -> None:
    """SIGKILL plus an oom_kill increment in memory.events is the kernel's OOM killer."""
    failure = classify_exit(SIGKILLED, None, "", cgroup_oom_kills=1)
    assert failure.kind is K.HOST_OOM and "oom_kill" in failure.evidence


def test_host_oom_kill_takes_its_stage_from_the_last_heartbeat() -> None:
    """A kernel OOM kill with no frames in stderr is recorded at the stage the heartbeats last showed."""
    failure = classify_exit(SIGKILLED, None, "", cgroup_oom_kills=1, last_stage=Stage.OPTIMIZER, last_step=7)
    assert (failure.kind, failure.stage) == (K.HOST_OOM, Stage.OPTIMIZER)
    assert "last heartbeat" in failure.evidence
    killed = classify_exit(SIGKILLED, None, "step 3\nKilled\n", last_stage=Stage.BACKWARD)
    assert (killed.kind, killed.stage) == (K.HOST_OOM, Stage.BACKWARD)


def test_sigkill_with_killed_line_is_host_oom() -> None:
    """Without cgroup evidence, a ``Killed`` line in stderr still says host OOM."""
    assert classify_exit(SIGKILLED, None, "step 3\nKilled\n").kind is K.HOST_OOM


def test_sigkill_without_evidence_is_other_and_says_so() -> None:
    """A bare SIGKILL is not called an OOM; the evidence says what was missing."""
    failure = classify_exit(SIGKILLED, None, "step 3\n")
    assert failure.kind is K.OTHER and "without OOM-kill evidence" in failure.evidence


def test_exit_137_counts_as_sigkill() -> None:
    """A shell's 137 (128 + SIGKILL) reads like a SIGKILL."""
    assert classify_exit(ChildExit(137, None, None, 5.0), None, "", cgroup_oom_kills=2).kind is K.HOST_OOM


def test_config_exit_code_without_report() -> None:
    """The reserved CONFIG exit code without a report is still config_error."""
    assert classify_exit(ChildExit(int(ExitCode.CONFIG), None, None, 1.0), None, "").kind is K.CONFIG_ERROR


def test_stderr_is_the_fallback_without_a_report() -> None:
    """No report, ordinary exit: the stderr tail is classified like any log."""
    stderr = tb(TRAIN, HF_STEP, CE, error=PLAIN_OOM)
    failure = classify_exit(ChildExit(1, None, None, 5.0), None, stderr)
    assert failure.kind is K.OOM_FORWARD and failure.evidence.startswith("no error report")


def test_oom_exit_code_without_report_or_message() -> None:
    """The reserved OOM code with nothing else is an OOM of unknown stage (oom_forward)."""
    failure = classify_exit(EXITED_OOM, None, "")
    assert (failure.kind, failure.stage) == (K.OOM_FORWARD, Stage.UNKNOWN)


def test_nothing_known_is_other() -> None:
    """An ordinary non-zero exit with an empty stderr is other."""
    assert classify_exit(ChildExit(1, None, None, 5.0), None, "").kind is K.OTHER


# --- CLI ----------------------------------------------------------------------------------------


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli", "classify", *args]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=60, check=False)


def test_cli_json_from_stdin() -> None:
    """``classify - --json`` prints one object with kind, stage, integer bytes and evidence."""
    result = run_cli("-", "--json", stdin=tb(TRAIN, HF_BACKWARD, TENSOR_BACKWARD, error=PLAIN_OOM))
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["kind"] == "oom_backward" and payload["stage"] == "backward"
    assert payload["numbers"]["tried_to_allocate"] == GIB
    assert isinstance(payload["evidence"], str) and payload["evidence"]


def test_cli_human_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The human form shows kind, stage, sizes in GiB/MiB and the evidence."""
    log = tmp_path / "train.log"
    log.write_text(tb(TRAIN, HF_STEP, MLP, error=H200_CAPPED))
    assert classify_command(str(log), as_json=False) == 0
    out = capsys.readouterr().out
    assert "kind      oom_forward" in out and "8.00 GiB" in out and "204.00 MiB" in out
    assert "evidence" in out


def test_cli_missing_file_names_it_and_returns_2() -> None:
    """A missing file is reported on stderr by name with exit status 2."""
    result = run_cli("/no/such/log.txt")
    assert result.returncode == 2 and "/no/such/log.txt" in result.stderr


def test_format_size_matches_pytorch() -> None:
    """Sizes print like PyTorch's: MiB up to and including 1 GiB, then GiB."""
    assert format_size(GIB) == "1024.00 MiB"
    assert format_size(GIB + 1) == "1.00 GiB"
    assert format_size(512) == "512 bytes"


def test_failure_json_dict_has_string_pids() -> None:
    """JSON keys are strings: process ids come out as strings, bytes as integers."""
    failure = Failure(K.OOM_CONTENTION, Stage.FORWARD, {"processes": {12: 5}}, "x")
    assert failure.to_json()["numbers"] == {"processes": {"12": 5}}


# --- the two dependency worlds ------------------------------------------------------------------


def test_importing_the_classifier_does_not_import_torch() -> None:
    """The supervisor's classifier and CLI load without torch."""
    code = (
        "import sys, qlora_supervise.supervisor.diagnosis.classify, qlora_supervise.supervisor.commands.classify; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_cut_merge_log_without_frames_is_presumed_merge_oom() -> None:
    """A merge run's log that stops with no traceback (a kill while loading) is presumed an OOM in merge."""
    text = (
        "2026-11-29 09:00:01 INFO export: merging LoRA adapter into the base model\n"
        "Loading checkpoint shards: 100%|##########| 4/4 [00:12<00:00,  3.01s/it]\n"
    )
    failure = classify_text(text)
    assert failure.kind is FailureKind.OOM_MERGE
    assert failure.stage is Stage.MERGE
    assert "presumed" in failure.evidence


def test_training_log_without_merge_words_stays_other() -> None:
    """A cut log that names no stage and no merge stays `other`."""
    text = "INFO step 10 loss 1.23\nINFO step 20 loss 1.10\n"
    assert classify_text(text).kind is FailureKind.OTHER


def test_our_childs_failure_line_names_the_stage_without_frames() -> None:
    """A child log whose traceback is gone still has the child's last line naming its stage."""
    text = (
        "trainer child failed in backward: OutOfMemoryError: CUDA out of memory. Tried to allocate "
        "172.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which 131.20 GiB is free. Including "
        "non-PyTorch memory, this process has 8.59 GiB memory in use. 8.00 GiB allowed; Of the allocated "
        "memory 7.48 GiB is allocated by PyTorch, and 376.71 MiB is reserved by PyTorch but unallocated.\n"
    )
    failure = classify_text(text)
    assert failure.kind is FailureKind.OOM_BACKWARD
    assert failure.stage is Stage.BACKWARD


AXOLOTL_IMPORT = """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.12/site-packages/axolotl/cli/train.py", line 107, in do_cli
    from axolotl.cli.config import load_cfg
  File "/venv/lib/python3.12/site-packages/posthog/consumer.py", line 6, in <module>
    import backoff
ModuleNotFoundError: No module named 'backoff'
"""


def test_a_child_that_dies_importing_is_a_config_error_and_the_text_alone_stays_other() -> None:
    """Without a report, a child ending in an import failure is the config's (the same on every
    start); classify_text, for logs of any command, keeps its corpus labelling (``other``)."""
    failed = ChildExit(returncode=1, signal=None, killed_by_supervisor=None, duration_s=9.0)
    found = classify_exit(failed, None, AXOLOTL_IMPORT)
    assert found.kind is FailureKind.CONFIG_ERROR and "trainer.python" in found.evidence
    assert found.message == "ModuleNotFoundError: No module named 'backoff'"
    assert classify_text(AXOLOTL_IMPORT).kind is FailureKind.OTHER
    # After steps, or where the import error is an interpreter's shutdown after another failure,
    # the import says nothing of the environment.
    after = classify_exit(failed, None, AXOLOTL_IMPORT, last_stage=Stage.SAVE, last_step=412)
    assert after.kind is FailureKind.OTHER
    shutdown = (
        "RuntimeError: CUDA error: unspecified launch failure\n"
        "Exception ignored in: <function _Loader.__del__ at 0x7f>\n"
        "ImportError: sys.meta_path is None, Python is likely shutting down\n"
    )
    assert classify_exit(failed, None, shutdown).kind is not FailureKind.CONFIG_ERROR
    # An OOM text that merely mentions an import earlier is still the OOM.
    oom = AXOLOTL_IMPORT + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"
    assert classify_exit(failed, None, oom).kind.is_oom

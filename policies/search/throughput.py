"""The throughput model: predicted tokens/s of a QLoRA config, next to the memory model.
Much of a 4-bit micro-step's cost is fixed (docs/planning.md), so per micro-step: launch cost per
layer + cost per 4-bit weight byte + (block work + head work) per token + offload's copies, per
checkpointing mode, fitted by ``bench/models/fit_throughput.py`` (:mod:`.throughput_fit`); per
optimizer step, accumulation micro-steps + a cost per adapter parameter. Measured speeds beat the
model (:class:`SpeedCalibration`): a measured config keeps its speed, the others are scaled by their
mode's median measured/predicted ratio (by all of them for a mode with none)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qlora_supervise.policies.memory.gpu import DEFAULT_TARGETS, lora_params, per_weight
from qlora_supervise.policies.memory.gpu import predict as predict_memory
from qlora_supervise.policies.memory.shape import ModelShape, Targets
from qlora_supervise.policies.search import throughput_fit as fit
from qlora_supervise.trainer_child.contract.spec import Knobs

#: Host <-> card bandwidth an offloaded activation crosses twice. A prior, unmeasured: a quarter of
#: PCIe 5.0 x16 (``save_on_cpu`` copies unoverlapped), so an unmeasured rung does not win on optimism.
OFFLOAD_BYTES_PER_S = 12.5e9


def weight_bytes(shape: ModelShape, knobs: Knobs) -> int:
    """Bytes of the quantized linear layers: what each micro-step dequantizes."""
    return int(shape.layers * shape.layer_params * per_weight(knobs))


def work_per_token(shape: ModelShape, seq_len: int) -> int:
    """Multiply-adds per token of the decoder blocks' forward: the linear layers, the experts a
    token is routed through (counted as 4-bit ones: unmeasured), attention."""
    return shape.layers * (shape.layer_params + shape.active_expert_params + seq_len * shape.q_dim)


def head_work_per_token(shape: ModelShape) -> int:
    """Multiply-adds per token of the LM head and its loss (trl's chunked fp32 log-softmax)."""
    return shape.vocab * shape.hidden


def adapter_params(shape: ModelShape, knobs: Knobs, targets: Targets = DEFAULT_TARGETS) -> int:
    return lora_params(shape, knobs.lora_r, targets)


@dataclass(frozen=True)
class Coefficients:
    """The fitted numbers (by checkpointing mode ``"ckpt"`` / ``"no_ckpt"``, or optimizer kind)."""

    launch_s_per_layer: Mapping[str, float]
    fixed_s_per_byte: Mapping[str, float]
    token_s: Mapping[str, float]
    head_token_s: Mapping[str, float]
    optimizer_s_per_param: Mapping[str, float]
    bf16_head_token_factor: float = 1.0


_PER_MODE = (fit.LAUNCH_S_PER_LAYER, fit.FIXED_S_PER_BYTE, fit.TOKEN_S, fit.HEAD_TOKEN_S)
FITTED = Coefficients(*_PER_MODE, fit.OPTIMIZER_S_PER_PARAM, fit.BF16_HEAD_TOKEN_FACTOR)


@dataclass(frozen=True)
class StepTime:
    """A predicted (or measured) step: seconds per micro-step and per optimizer step, and tokens/s."""

    micro_step_s: float
    optimizer_step_s: float
    tokens_per_s: float
    measured: bool = False  # True: this host measured these knobs (or a calibration scaled it)


def optimizer_seconds(
    shape: ModelShape, knobs: Knobs, targets: Targets = DEFAULT_TARGETS, c: Coefficients = FITTED
) -> float:
    """Seconds of one optimizer step over the adapter (by optimizer kind; unknown kinds as adamw_torch)."""
    per_param = c.optimizer_s_per_param.get(knobs.optimizer, c.optimizer_s_per_param["adamw_torch"])
    return per_param * adapter_params(shape, knobs, targets)


def predict(
    shape: ModelShape, knobs: Knobs, targets: Targets = DEFAULT_TARGETS, c: Coefficients = FITTED
) -> StepTime:
    """The model's step time and tokens/s for ``knobs`` (one rank; ranks add throughput, not speed):
    ``grad_accum`` forward + backward micro-steps by the fitted model, then the optimizer step."""
    mode = "ckpt" if knobs.gradient_checkpointing else "no_ckpt"
    tokens = knobs.micro_batch_size * knobs.max_seq_len
    head = c.bf16_head_token_factor if knobs.bf16_head else 1.0
    micro = c.launch_s_per_layer[mode] * shape.layers + c.fixed_s_per_byte[mode] * weight_bytes(shape, knobs)
    per_token = c.token_s[mode] * work_per_token(shape, knobs.max_seq_len)
    per_token += c.head_token_s[mode] * head_work_per_token(shape)
    micro += tokens * per_token * head
    if knobs.activation_offload:
        on_card = dataclasses.replace(knobs, activation_offload=False)
        saved = predict_memory(shape, on_card, targets).components.get("activations", 0)
        micro += 2 * saved / OFFLOAD_BYTES_PER_S
    step = knobs.grad_accum * micro + optimizer_seconds(shape, knobs, targets, c)
    return StepTime(micro, step, tokens * knobs.grad_accum / step if step > 0 else 0.0)


def speed_key(knobs: Knobs) -> Knobs:
    """The knobs that decide training speed, so a measured config is found again however the
    others (eval, the allocator, alpha, the model's path) were set."""
    # The store is read per shape: the same shape under another model path is the same speed.
    plain = dataclasses.replace(knobs, model="", lora_alpha=1, eval_batch_size=1, eval_enabled=False)
    return dataclasses.replace(plain, merge_on_cpu=False, expandable_segments=True, gpus="")


@dataclass(frozen=True)
class SpeedObservation:
    """Training tokens/s measured for ``knobs`` (a run's heartbeats, or the per-host store)."""

    knobs: Knobs
    tokens_per_s: float


@dataclass(frozen=True)
class SpeedCalibration:
    """What measurements say: exact configs measured, and a scale per checkpointing mode."""

    measured: tuple[SpeedObservation, ...] = ()
    scale: tuple[tuple[bool, float], ...] = ()  # (checkpointing, measured / predicted tokens/s)
    overall: float | None = None  # the median over every observation, for a mode with none


#: A measured/predicted ratio outside this is another machine or a broken measurement: clamped.
SCALE_RANGE = (0.1, 10.0)


def calibrate(
    shape: ModelShape, observations: Sequence[SpeedObservation], targets: Targets = DEFAULT_TARGETS
) -> SpeedCalibration:
    """The calibration ``observations`` of this shape give (newest last; the newest of a config wins)."""
    latest = {speed_key(o.knobs): o for o in observations if o.tokens_per_s > 0 and o.knobs.world_size == 1}
    ratios: dict[bool, list[float]] = {True: [], False: []}
    low, high = SCALE_RANGE
    for key, o in latest.items():
        if (predicted := predict(shape, key, targets).tokens_per_s) > 0:
            ratios[key.gradient_checkpointing].append(min(max(o.tokens_per_s / predicted, low), high))
    every = [r for rs in ratios.values() for r in rs]
    scale = tuple((mode, statistics.median(rs)) for mode, rs in ratios.items() if rs)
    return SpeedCalibration(tuple(latest.values()), scale, statistics.median(every) if every else None)


def rank_speed(
    shape: ModelShape,
    knobs: Knobs,
    calibration: SpeedCalibration | None = None,
    targets: Targets = DEFAULT_TARGETS,
) -> StepTime:
    """The step time the ranking uses: measured where these knobs were measured, else the model
    scaled by its checkpointing mode's measured ratio, else the model."""
    model = predict(shape, knobs, targets)
    if calibration is None:
        return model
    key = speed_key(knobs)
    for o in calibration.measured:  # called for every candidate the search ranks: the key once
        if speed_key(o.knobs) == key:
            return _at(knobs, o.tokens_per_s, model)
    mode = knobs.gradient_checkpointing
    factor = next((s for ckpt, s in calibration.scale if ckpt is mode), calibration.overall)
    return model if factor is None else _at(knobs, model.tokens_per_s * factor, model)


def _at(knobs: Knobs, tokens_per_s: float, model: StepTime) -> StepTime:
    step = knobs.micro_batch_size * knobs.grad_accum * knobs.max_seq_len / tokens_per_s
    micro = model.micro_step_s * step / model.optimizer_step_s if model.optimizer_step_s else step
    return StepTime(micro, step, tokens_per_s, measured=True)

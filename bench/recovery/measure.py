"""What each approach did, read back from the files it left (never from what it printed).

Every number comes from the run directory: the children's events files (the first heartbeat of
each optimizer step is written when that step completes, with the step's tokens/s), their
``spec.json`` (the knobs and the checkpoint resumed from), ``error.json`` and, for the
supervised runs, the journal and ``events.jsonl``. The same readers serve our supervised child,
the restart loop (its attempts have the supervisor's layout) and the bare run; ``auto-batch``
keeps its tries in one events file.

Definitions (also in RESULTS.md):

* *executed*: optimizer steps completed, summed over attempts/tries (a step done twice counts twice);
* *kept*: steps the result keeps: ``max_steps`` when finished, else the newest complete checkpoint
  (what a rerun would resume from); *lost* = executed − kept;
* *to first step*: from the approach's start to the first completed step of the config that
  finished (of its last attempt or try);
* *tokens/s*: median over the final attempt's steps, its first step left out (warm-up);
* *OOM → next step*: from a failed attempt's failure (``error.json``'s ``failed_at``, written by
  the first spare version, else its
  ``time``, else the journal's end of the attempt) to the next attempt's first completed step;
  the supervisor's own ``first_step.since_failure_s`` beside it where it logs one. It splits into
  *OOM → training* (to the next attempt's first forward pass: the restart itself) and that
  attempt's *first step* (first forward pass to first completed step; in the long-row scenario
  it is the long row's step). The target "≤ 5 s plus a step" reads OOM → training ≤ 5 s.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

from ..scenarios import gpu_ladder
from .scenarios import Scenario


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One trainer process's steps, read from its attempt directory."""

    number: int
    resumed_from: int
    step_times: dict[int, float]  # step -> wall time its first heartbeat was written
    rates: dict[int, float]  # step -> tokens/s of that step
    knobs: dict[str, Any]
    failed_at: float | None  # from error.json, when it wrote one
    training_at: float | None = None  # the first forward pass began (the ``stage`` event)

    @property
    def last_step(self) -> int:
        return max(self.step_times, default=self.resumed_from)

    @property
    def executed(self) -> int:
        return max(0, self.last_step - self.resumed_from)

    def first_step_at(self) -> float | None:
        later = [t for step, t in self.step_times.items() if step > self.resumed_from]
        return min(later) if later else None

    def median_rate(self) -> float | None:
        steps = sorted(step for step in self.rates if step > self.resumed_from)
        values = [self.rates[s] for s in steps[1:]] or [self.rates[s] for s in steps]
        return round(statistics.median(values), 1) if values else None

    def first_step_s(self) -> float | None:
        """From the first forward pass to the first completed step: the step a recovery waits for."""
        first = self.first_step_at()
        return round(first - self.training_at, 2) if first and self.training_at else None

    def step_s(self) -> float | None:
        """Median time between consecutive completed steps (one step's time)."""
        times = [self.step_times[s] for s in sorted(self.step_times) if s > self.resumed_from]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return round(statistics.median(gaps), 2) if gaps else None


def step_log(events: list[dict[str, Any]]) -> tuple[dict[int, float], dict[int, float]]:
    """(step -> time of its first heartbeat, step -> tokens/s) from a child's events."""
    times: dict[int, float] = {}
    rates: dict[int, float] = {}
    for event in events:
        step = event.get("step")
        if event.get("event") != "heartbeat" or not isinstance(step, int) or step in times:
            continue
        times[step] = float(event["time"])
        if isinstance(event.get("tokens_per_s"), int | float):
            rates[step] = float(event["tokens_per_s"])
    return times, rates


def read_attempt(directory: Path) -> Attempt | None:
    """The attempt in ``directory`` (``attempt-NNN``), or None without a spec."""
    from qlora_supervise.trainer_child.contract.checkpoints import checkpoint_step

    spec_path = directory / "spec.json"
    if not spec_path.is_file():
        return None
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    resumed = checkpoint_step(Path(spec["resume_from"])) if spec.get("resume_from") else 0
    events = gpu_ladder.read_jsonl(directory / "child-events.jsonl")
    times, rates = step_log(events)
    training = next(
        (e["time"] for e in events if e.get("event") == "stage" and e.get("stage") == "forward"), None
    )
    error = directory / "error.json"
    failed_at = None
    if error.is_file():
        with_times = json.loads(error.read_text(encoding="utf-8"))
        failed_at = with_times.get("failed_at") or with_times.get("time")
    times = {step: t for step, t in times.items() if step >= (resumed or 0)}
    return Attempt(int(spec["attempt"]), resumed or 0, times, rates, spec["knobs"], failed_at, training)


def attempts_in(run_dir: Path) -> list[Attempt]:
    found = [read_attempt(d) for d in sorted(run_dir.glob("attempt-[0-9][0-9][0-9]"))]
    return [a for a in found if a is not None]


def kept_steps(run_dir: Path, finished: bool, max_steps: int) -> int:
    """``max_steps`` when finished, else the newest complete checkpoint's step (0 for none)."""
    from qlora_supervise.trainer_child.contract.checkpoints import newest_complete_checkpoint

    if finished:
        return max_steps
    newest = newest_complete_checkpoint(run_dir / "checkpoints")
    return newest[0] if newest else 0


def config_text(knobs: dict[str, Any]) -> str:
    return f"{gpu_ladder.knob_batch(knobs)} {knobs.get('optimizer', '?')} r{knobs.get('lora_r', '?')}"


def row(
    s: Scenario, approach: str, attempts: list[Attempt], finished: bool, started_at: float
) -> dict[str, Any]:
    """The fields every approach reports, from its attempts (tries for auto-batch)."""
    final = attempts[-1] if attempts else None
    executed = sum(a.executed for a in attempts)
    knobs = final.knobs if final else {}
    effective = knobs.get("micro_batch_size", 0) * knobs.get("grad_accum", 0)
    first = final.first_step_at() if final and finished else None
    return {
        "approach": approach,
        "finished": finished,
        "attempts": len(attempts),
        "to_first_step_s": round(first - started_at, 1) if first else None,
        "steps_executed": executed,
        "effective_batch_written": s.effective_batch,
        "effective_batch_final": effective or None,
        "effective_batch_kept": effective == s.effective_batch,
        "final_config": config_text(knobs) if knobs else None,
        "tokens_per_s": final.median_rate() if final else None,
    }


def with_kept(result: dict[str, Any], kept: int) -> dict[str, Any]:
    result["steps_kept"] = kept
    result["steps_lost"] = max(0, result["steps_executed"] - kept)
    return result

"""The speed trial's candidates: the chosen config and the fastest others it may switch to in-process.

Every candidate of the ranking fits both budgets (the card's and, where there is one, the host's);
those that differ from the chosen config in more than what changes without a reload, and those
predicted far slower than it, are not timed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from qlora_supervise.policies.search.search_result import Ranked
from qlora_supervise.trainer_child.contract.spec import Knobs, TrialCandidate

#: The speed trial times at most this many candidates, the chosen one first.
TRIAL_SIZE = 3
#: The speed trial skips a candidate predicted at less than this share of the chosen config's
#: tokens/s: the model's error is well inside it, so such a candidate cannot win, and it is the
#: slow one that eats the trial (H200: 599 predicted against 4,076 took 45 s of a 54 s trial).
TRIAL_SLOWEST_SHARE = 0.5


def trial_candidates(
    knobs: Knobs, peak: int, tokens_per_s: float, ranking: Sequence[Ranked], host_peak: int | None = None
) -> tuple[TrialCandidate, ...]:
    """The chosen config and the fastest others that differ from it only in what changes without a
    reload (micro-batch with its accumulation, checkpointing); empty when there is no other.

    Every candidate of the ranking fits both budgets (the host's too, where there is one); one
    predicted at less than :data:`TRIAL_SLOWEST_SHARE` of the chosen config's speed is not timed.
    """

    def reloadless(k: Knobs) -> Knobs:
        # The allocator setting is no training knob: candidates differ from the job's in it alone.
        return dataclasses.replace(
            k, micro_batch_size=1, grad_accum=1, gradient_checkpointing=False, expandable_segments=True
        )

    def timed(k: Knobs) -> tuple[int, int, bool]:
        return k.micro_batch_size, k.grad_accum, k.gradient_checkpointing

    seen = {timed(knobs)}
    others = []
    for r in ranking:
        if r.tokens_per_s < tokens_per_s * TRIAL_SLOWEST_SHARE:
            continue
        if reloadless(r.knobs) == reloadless(knobs) and timed(r.knobs) not in seen:
            seen.add(timed(r.knobs))
            others.append(r)
    if not others or knobs.world_size > 1:  # one process only: ranks would have to agree
        return ()
    first = _candidate(knobs, tokens_per_s, peak, host_peak)
    rest = (
        _candidate(r.knobs, r.tokens_per_s, r.peak_bytes, r.host_peak_bytes) for r in others[: TRIAL_SIZE - 1]
    )
    return (first, *rest)


def _candidate(knobs: Knobs, tokens_per_s: float, peak: int, host_peak: int | None) -> TrialCandidate:
    return TrialCandidate(
        knobs.micro_batch_size,
        knobs.grad_accum,
        knobs.gradient_checkpointing,
        round(tokens_per_s, 1),
        peak,
        host_peak,
    )

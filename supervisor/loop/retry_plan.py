"""What ``run --retry`` runs after a give-up on memory: the ladder's next rung, not the failed config.

A memory give-up is rarely "no rung is left": more often the attempt budget (``max_attempts``)
or the crash-loop guard ran out while the ladder still had rungs. Replaying the config that just
failed would fail the same way (issue 21 item 15), so the lifted verdict asks the policy again,
as if the attempt had just failed, with a budget started afresh: the attempts before the lift were
judged already. Where the ladder is truly exhausted the policy still says GiveUp, and the retry
replays the last config once, as it always did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.rungs import Survives
from qlora_supervise.supervisor.record.history import policy_history
from qlora_supervise.supervisor.record.records import AttemptRecord


def next_rung_after_lift(
    records: Sequence[AttemptRecord], settings: policy.Settings
) -> tuple[policy.Restart, bool] | None:
    """The policy's restart for the last (lifted) attempt's memory failure, and whether it starts
    from step 0; None when that attempt did not fail of memory or the ladder has nothing left."""
    last = records[-1] if records else None
    if last is None or last.failure is None or not last.failure.kind.is_oom:
        return None
    same_phase = [r for r in records if r.phase is last.phase]
    history = policy_history(same_phase)
    failed = sum(1 for past in history if past.kind is not None)
    # A fresh budget: the attempts already spent do not count against the retry.
    fresh = dataclasses.replace(settings, max_attempts=settings.max_attempts + failed)
    decision = policy.decide(last.failure, last.knobs, history, fresh, phase=last.phase.value)
    if not isinstance(decision, policy.Restart) or decision.knobs == last.knobs:
        return None
    return decision, decision.survives is Survives.ADAPTER_REINIT

"""A host OOM kill after progress: retried unchanged once before the ladder moves (issue 21 item 4).

On a shared host the kernel's OOM killer often picks the trainer for a neighbour's spike: the
biggest process loses, whatever caused the pressure. A kill that came after the attempt trained
steps says the config *did* fit for a while, so the first such kill is retried with the same
knobs; a second kill in a row with those knobs (or one before any step) is the config's own and
walks the stage's ladder as any OOM does. This also holds at the ladder's bottom: the run does
not give up at the first kill after progress. Under activation offload the child's own host use is
the likely cause, so no plain retry: offload is charged at once (:mod:`.climb`).
"""

from __future__ import annotations

from collections.abc import Sequence

from qlora_supervise.policies.rungs import Survives
from qlora_supervise.policies.verdicts import FailureLike, PastAttempt, Restart
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import Knobs


def retry_after_kill(failure: FailureLike, knobs: Knobs, failed: Sequence[PastAttempt]) -> Restart | None:
    """Restart unchanged when ``failure`` is the first host OOM kill after progress with ``knobs``.

    ``failed``: the failed attempts, the one that just failed last. None: the ladder decides.
    """
    if failure.kind is not FailureKind.HOST_OOM or not failed or failed[-1].steps_progressed <= 0:
        return None
    if knobs.activation_offload:  # the child itself held the host's RAM: offload is charged (climb.py)
        return None
    before = failed[-2] if len(failed) > 1 else None
    if before is not None and before.kind is FailureKind.HOST_OOM and before.knobs == knobs:
        return None  # the plain retry was had and was killed too: the config's own peak
    why = (
        f"host OOM kill after {failed[-1].steps_progressed} step(s) of progress: the config fitted "
        "until then and the kernel may have picked the trainer for another process's spike; "
        "retry unchanged once before the ladder moves"
    )
    return Restart(knobs, "retry_unchanged", {}, why, Survives.ALL)

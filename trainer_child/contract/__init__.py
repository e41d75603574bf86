"""The one contract between the supervisor and the trainer child, the only part of ``trainer_child``
the supervisor and the policies import (no torch): the :class:`~.spec.AttemptSpec` the supervisor
writes, and the child's answers in files: its events (:mod:`.events`), an :class:`~.report.ErrorReport`
on any failure, a reserved :class:`~.codes.ExitCode`; under torchrun per rank (:func:`.spec.rank_file`)."""

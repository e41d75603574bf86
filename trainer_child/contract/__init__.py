"""The one contract between the supervisor and the trainer child: the only part of
``trainer_child`` that ``supervisor/`` and ``policies/`` import, and it never imports torch.

The supervisor writes an :class:`~.spec.AttemptSpec` to ``attempt-NNN/spec.json`` and starts
``python -m qlora_supervise.trainer_child --spec attempt-NNN/spec.json``. The child speaks back
through files, never through log scraping: ``spec.events_file`` (one JSON object per line,
:mod:`.events`), ``spec.error_file`` (an :class:`~.report.ErrorReport`, written atomically on any
failure) and a reserved :class:`~.codes.ExitCode`.

Under torchrun every rank runs the child with the same spec and writes its own events and error
report, rank N at :func:`.spec.rank_file`; rank 0 alone writes checkpoints and the adapter.
"""

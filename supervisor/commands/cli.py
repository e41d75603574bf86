"""The ``qlora-supervise`` command line. Each subcommand lives in its own module and is imported only
when it runs, so ``--help`` is instant and nothing here pulls in torch (the tiny model is a child's)."""

from __future__ import annotations

import importlib
import os
import sys
from argparse import ArgumentParser, RawDescriptionHelpFormatter
from collections.abc import Sequence
from typing import Any

from qlora_supervise.supervisor import __version__
from qlora_supervise.supervisor.exit_codes import EXIT_CODES_HELP, SupervisorExit

DESCRIPTION = """\
An OOM-resilient supervisor for QLoRA fine-tuning. `run` starts the trainer as a child
process, classifies each failure (which stage ran out of memory, fragmentation, contention,
host OOM, hang, ...), and restarts from the last good checkpoint with a cheaper config
chosen by a policy ladder. Every decision goes to <output_dir>/events.jsonl and
attempts.jsonl."""
JOB_HELP = "the job file (YAML)"


def _build_parser() -> ArgumentParser:
    # Long because it declares every subcommand and flag in one place, the order --help shows them.
    # Each subcommand's dests are the keyword parameters of its function: ``target``, by default
    # ``<name>:<name>_command`` (with ``-`` as ``_``) in this package.
    raw: dict[str, Any] = {"epilog": EXIT_CODES_HELP, "formatter_class": RawDescriptionHelpFormatter}
    parser = ArgumentParser(prog="qlora-supervise", description=DESCRIPTION, **raw)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, help: str, target: str = "", job: str = "", **more: Any) -> ArgumentParser:
        """The subcommand ``name``, with a positional job file ``job`` (its dest) where given."""
        parser = sub.add_parser(name, help=help, **more)
        module = name.replace("-", "_")
        parser.set_defaults(target=target or f"{module}:{module}_command")
        if job:
            parser.add_argument(job, metavar="job", help=JOB_HELP)
        return parser

    def flag(parser: ArgumentParser, name: str, help: str) -> None:
        dest = "as_json" if name == "--json" else name[2:].replace("-", "_")
        parser.add_argument(name, action="store_true", help=help, dest=dest)

    what = "supervise a fine-tune until it finishes or the ladder gives up"
    run = command("run", what, "run:run_job", "job_path", **raw)
    flag(run, "--plain", "one progress line per logging step, even on a terminal")
    flag(run, "--as-written", "start from the job's own config, not the memory model's pre-flight choice")
    what = "start a new generation in the same output_dir (the current one moves to generations/N/); needed "
    what += "when the job changes what is trained (model, data, LoRA, quantization, lr, seq_len, batch)"
    flag(run, "--restart", what)
    flag(run, "--retry", "lift the run's verdict (gave up, not retryable) and try its last config again")

    command("validate", "check a job file and report every problem at once", job="path")

    classify = command("classify", "classify a failure from a log or traceback")
    classify.add_argument("path", metavar="file", help="the log file, or - for standard input")
    flag(classify, "--json", "print one JSON object")

    what = "write a tiny Llama-shaped model, dataset and job.yaml"
    tiny = command("make-tiny", what, "demo:make_tiny_command")
    tiny.add_argument("directory", metavar="dir", help="directory to write into")

    demo = command("demo", "make the tiny model and supervise a job that does not fit its memory cap")
    what = "working directory (default: ./demo-run)"
    demo.add_argument("--dir", dest="directory", metavar="DIR", default="demo-run", help=what)

    what = "predict the peak memory by component and the config the supervisor would start from"
    plan = command("plan", what, job="job_path")
    what = "the card's memory, e.g. 24GiB (default: the job's cap, else NVML)"
    plan.add_argument("--gpu-memory", help=what)
    what = "the host's RAM, e.g. 32GiB (default: the job's host_memory_limit, else what is available now, "
    what += "capped by the cgroup, less a reserve)"
    plan.add_argument("--host-memory", help=what)
    flag(plan, "--json", "print one JSON object (schema in docs/planning.md)")

    status = command("status", "summarise the attempts of one or more run directories")
    status.add_argument("output_dirs", nargs="*", metavar="RUN_DIR", help="jobs' output_dirs (default: .)")
    flag(status, "--json", "print one JSON object (schema in docs/run-directory.md)")
    flag(status, "--follow", "print again on every change until the runs end")

    explain = command("explain", "the retry story as a table, JSON, or a memory-over-time plot")
    explain.add_argument("run_dir", help="the job's output_dir")
    flag(explain, "--json", "print one JSON object (schema in docs/run-directory.md)")
    explain.add_argument("--plot", metavar="FILE.png", help="draw memory over time for every attempt")
    explain.add_argument("--model-config", help="the model's config.json, when its directory is gone")

    merge = command("merge", "merge a finished run's adapter into its base model")
    merge.add_argument("run_dir", help="the job's output_dir (with adapter/)")
    merge.add_argument("--out", help="where the merged model goes (default: RUN_DIR/merged)")
    merge.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto")

    what = "write the systemd unit and the job; print what to run"
    install = command("install-systemd", what, job="job_path")
    scope = install.add_mutually_exclusive_group()
    scope.add_argument("--system", dest="user_mode", action="store_false", help="a system unit (default)")
    scope.add_argument("--user", dest="user_mode", action="store_true", help="a unit of your user's manager")
    install.set_defaults(user_mode=False)
    flag(install, "--force", "overwrite an existing unit or job copy")
    install.add_argument("--root", help="install under this directory instead of / (packaging, tests)")
    install.add_argument("--name", help="the instance name (default: the job file's stem)")
    install.add_argument("--service-user", help="User= of a system unit (default: you, or qlora for root)")
    return parser


#: The exit status of a command whose reader went away (``classify FILE | head``): what a shell
#: reports for a program killed by SIGPIPE (128 + 13), which Python ignores in favour of an error.
BROKEN_PIPE_EXIT = 141


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(_build_parser().parse_args(argv))
    module, function = args.pop("target").split(":")
    try:
        command = getattr(importlib.import_module(f"qlora_supervise.supervisor.commands.{module}"), function)
        code = command(**args)
        sys.stdout.flush()  # here, not at exit: a closed pipe must end in the except below
        return int(code)
    except SupervisorExit as stop:
        if stop.message:
            print(f"qlora-supervise: {stop.message}", file=sys.stderr)
        return int(stop.code)
    except BrokenPipeError:
        # The reader (head, less) has all it wanted. Point stdout at /dev/null so that the
        # interpreter's own flush at exit finds nothing to fail on, and leave quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())

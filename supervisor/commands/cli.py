"""The ``qlora-supervise`` command line.

Each subcommand lives in its own module and is imported only when it runs, so ``--help`` is
instant and nothing here pulls in torch (the tiny-model maker runs as a child process).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from qlora_supervise.supervisor import __version__
from qlora_supervise.supervisor.exit_codes import EXIT_CODES_HELP, SupervisorExit

DESCRIPTION = """\
An OOM-resilient supervisor for QLoRA fine-tuning. `run` starts the trainer as a child
process, classifies each failure (which stage ran out of memory, fragmentation, contention,
host OOM, hang, ...), and restarts from the last good checkpoint with a cheaper config
chosen by a policy ladder. Every decision goes to <output_dir>/events.jsonl and
attempts.jsonl."""


def _build_parser() -> argparse.ArgumentParser:
    # Long because it declares every subcommand and flag in one place, the order --help shows them.
    parser = argparse.ArgumentParser(
        prog="qlora-supervise",
        description=DESCRIPTION,
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="supervise a fine-tune until it finishes or the ladder gives up",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("job", help="the job file (YAML)")
    run.add_argument(
        "--plain", action="store_true", help="one progress line per logging step, even on a terminal"
    )
    run.add_argument(
        "--as-written",
        action="store_true",
        help="start from the job's own config, not the memory model's pre-flight choice",
    )
    run.add_argument(
        "--restart",
        action="store_true",
        help="start a new generation in the same output_dir (the current one moves to generations/N/); "
        "needed when the job changes what is trained (model, data, LoRA, quantization, lr, seq_len, batch)",
    )
    run.add_argument(
        "--retry",
        action="store_true",
        help="lift the run's verdict (gave up, not retryable) and try its last config again",
    )

    validate = sub.add_parser("validate", help="check a job file and report every problem at once")
    validate.add_argument("job", help="the job file (YAML)")

    classify = sub.add_parser("classify", help="classify a failure from a log or traceback")
    classify.add_argument("file", help="the log file, or - for standard input")
    classify.add_argument("--json", action="store_true", help="print one JSON object")

    tiny = sub.add_parser("make-tiny", help="write a tiny Llama-shaped model, dataset and job.yaml")
    tiny.add_argument("dir", help="directory to write into")

    demo = sub.add_parser(
        "demo", help="make the tiny model and supervise a job that does not fit its memory cap"
    )
    demo.add_argument("--dir", default="demo-run", help="working directory (default: ./demo-run)")

    plan = sub.add_parser(
        "plan", help="predict the peak memory by component and the config the supervisor would start from"
    )
    plan.add_argument("job", help="the job file (YAML)")
    plan.add_argument(
        "--gpu-memory", help="the card's memory, e.g. 24GiB (default: the job's cap, else NVML)"
    )
    plan.add_argument(
        "--host-memory",
        help="the host's RAM, e.g. 32GiB (default: the job's host_memory_limit, else what is available "
        "now, capped by the cgroup, less a reserve)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object (schema in the README)")

    status = sub.add_parser("status", help="summarise the attempts of one or more run directories")
    status.add_argument("output_dirs", nargs="*", metavar="RUN_DIR", help="jobs' output_dirs (default: .)")
    status.add_argument(
        "--json", action="store_true", help="print one JSON object (schema in --help of status)"
    )
    status.add_argument(
        "--follow", action="store_true", help="print again on every change until the runs end"
    )

    explain = sub.add_parser("explain", help="the retry story as a table, JSON, or a memory-over-time plot")
    explain.add_argument("run_dir", help="the job's output_dir")
    explain.add_argument("--json", action="store_true", help="print one JSON object")
    explain.add_argument("--plot", metavar="FILE.png", help="draw memory over time for every attempt")
    explain.add_argument("--model-config", help="the model's config.json, when its directory is gone")

    merge = sub.add_parser("merge", help="merge a finished run's adapter into its base model")
    merge.add_argument("run_dir", help="the job's output_dir (with adapter/)")
    merge.add_argument("--out", help="where the merged model goes (default: RUN_DIR/merged)")
    merge.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto")

    install = sub.add_parser("install-systemd", help="write the systemd unit and the job; print what to run")
    install.add_argument("job", help="the job file (YAML)")
    scope = install.add_mutually_exclusive_group()
    scope.add_argument("--system", dest="user", action="store_false", help="a system unit (default)")
    scope.add_argument("--user", dest="user", action="store_true", help="a unit of your user's manager")
    install.set_defaults(user=False)
    install.add_argument("--force", action="store_true", help="overwrite an existing unit or job copy")
    install.add_argument("--root", help="install under this directory instead of / (packaging, tests)")
    install.add_argument("--name", help="the instance name (default: the job file's stem)")
    install.add_argument("--service-user", help="User= of a system unit (default: you, or qlora for root)")
    return parser


#: The exit status of a command whose reader went away (``classify FILE | head``): what a shell
#: reports for a program killed by SIGPIPE (128 + 13), which Python ignores in favour of an error.
BROKEN_PIPE_EXIT = 141


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        code = _dispatch(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe must end in the except below
        return code
    except SupervisorExit as stop:
        if stop.message:
            print(f"qlora-supervise: {stop.message}", file=sys.stderr)
        return int(stop.code)
    except BrokenPipeError:
        # The reader (head, less) has all it wanted. Point stdout at /dev/null so that the
        # interpreter's own flush at exit finds nothing to fail on, and leave quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE_EXIT


def _dispatch(args: argparse.Namespace) -> int:
    # Imports are local so that each command loads only what it uses.
    if args.command == "run":
        from qlora_supervise.supervisor.commands.run import run_job

        return run_job(
            args.job, plain=args.plain, as_written=args.as_written, restart=args.restart, retry=args.retry
        )
    if args.command == "validate":
        from qlora_supervise.supervisor.commands.validate import validate_command

        return validate_command(args.job)
    if args.command == "classify":
        from qlora_supervise.supervisor.commands.classify import classify_command

        return classify_command(args.file, as_json=args.json)
    if args.command == "make-tiny":
        from qlora_supervise.supervisor.commands.demo import make_tiny_command

        return make_tiny_command(args.dir)
    if args.command == "demo":
        from qlora_supervise.supervisor.commands.demo import demo_command

        return demo_command(args.dir)
    if args.command == "plan":
        from qlora_supervise.supervisor.commands.plan import plan_command

        return plan_command(
            args.job, gpu_memory=args.gpu_memory, as_json=args.json, host_memory=args.host_memory
        )
    if args.command == "status":
        from qlora_supervise.supervisor.commands.status import status_command

        return status_command(args.output_dirs, as_json=args.json, follow=args.follow)
    return _dispatch_more(args)


def _dispatch_more(args: argparse.Namespace) -> int:
    if args.command == "explain":
        from qlora_supervise.supervisor.commands.explain import explain_command

        return explain_command(
            args.run_dir, as_json=args.json, plot=args.plot, model_config=args.model_config
        )
    if args.command == "merge":
        from qlora_supervise.supervisor.commands.merge import merge_command

        return merge_command(args.run_dir, out=args.out, device=args.device)
    if args.command == "install-systemd":
        from qlora_supervise.supervisor.commands.install_systemd import install_systemd_command

        return install_systemd_command(
            args.job,
            user_mode=args.user,
            force=args.force,
            root=args.root,
            name=args.name,
            service_user=args.service_user,
        )
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())

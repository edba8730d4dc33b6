"""The gpufeed command and its subcommands; convert is gpufeed convert.

Each subcommand lives in its own module, imported only when used, with ``add_arguments(parser)`` and
``run(args) -> int``. Errors from gpufeed end the command with one clear sentence, not a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from gpufeed import __version__
from gpufeed import errors
from gpufeed.errors import GpufeedError
from gpufeed.formats import FORMATS

#: subcommand -> (module, one-line help)
COMMANDS = {
    "convert": ("gpufeed.convert.command", f"convert a dataset to {' / '.join(FORMATS)}"),
    "verify": ("gpufeed.convert.verify", "read every output back and check it against its manifest"),
    "clean": ("gpufeed.convert.clean", "give up a stopped or killed conversion: remove what it left, and only that"),
    "synth": ("gpufeed.pipelines.synth", "write synthetic data in a dataset's real on-disk layout"),
    "demo": ("gpufeed.convert.demo", "synthesise a small ImageNet and convert it to every format"),
    "bench": ("gpufeed.bench.cli", "benchmark conversion, reading and training on storage tiers"),
    "report": ("gpufeed.bench.report", "turn benchmark results into a storage-tier comparison report"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default only where it tells something: not for flags (``--gray``: off unless
    given; ``--no-progress``'s stored ``True`` would read as the opposite of what it does), not for options
    without a default, and not where the help already states it."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is None or default is True or default is False or default == argparse.SUPPRESS
                or action.nargs == 0 or "(default" in text.lower()):
            return text
        if isinstance(default, (list, tuple)):  # as typed on the command line, not a Python repr
            default = ",".join(map(str, default))
        return f"{text} (default: {str(default).replace('%', '%%')})"


def add_command(subparsers, name: str, help_: str) -> argparse.ArgumentParser:
    """A subcommand's parser, its one-line help also its description (argparse expands ``%`` in a help
    string, not in a description: a literal one is escaped for the help)."""
    return subparsers.add_parser(name, help=help_.replace("%", "%%"), description=help_,
                                 formatter_class=HelpFormatter)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or with ``command`` (one of :data:`COMMANDS`) of that one only: its
    module is the only one imported (``gpufeed convert`` then starts without the benchmarks' imports,
    ~0.25 s of a cold start here)."""
    parser = argparse.ArgumentParser(prog="gpufeed", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"gpufeed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_) in COMMANDS.items():
        p = add_command(sub, name, help_)
        if command is None or name == command:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_module=mod)
    return parser


#: The warning filter handed to the helper processes multiprocessing starts (its resource tracker, the local
#: processes' fork server): at the end of a run stopped by Ctrl-C or SIGTERM, whose local processes gpufeed ends
#: on purpose, the tracker could print "There appear to be 1 leaked semaphore objects to clean up at shutdown"
#: after gpufeed's own last line (seen once, in a fresh clone's run of the suite), for a semaphore it then removes
#: itself: bookkeeping, not a leak, and not a line a user can act on.
QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"


def quiet_helpers() -> None:
    """Give the helper processes multiprocessing starts from now on :data:`QUIET_TRACKER` (they take this
    interpreter's ``-W`` options)."""
    if QUIET_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(QUIET_TRACKER)


def main(argv: list[str] | None = None, prog: str = "gpufeed") -> int:
    quiet_helpers()
    argv = sys.argv[1:] if argv is None else list(argv)
    # The first argument names the subcommand (the top level has no option taking a value), else the full
    # parser explains what is wrong or prints the help.
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    errors.INVOCATION = [prog, *argv]
    try:
        return _run(args)
    finally:
        errors.INVOCATION = None


def convert_main(argv: list[str] | None = None) -> int:
    """``convert ...`` is ``gpufeed convert ...``."""
    return main(["convert", *(sys.argv[1:] if argv is None else argv)])


def entry() -> None:
    """The ``gpufeed`` console script (and ``python -m gpufeed``): :func:`main`, then :func:`leave`."""
    leave(main())


def convert_entry() -> None:
    """The ``convert`` console script."""
    leave(convert_main())


def leave(code: int) -> None:
    """End the process with ``code`` once the command is done. Where Ray was loaded, the interpreter's own
    teardown after the exit handlers takes ~0.2-0.3 s (Ray's core library unloading; its runtime was stopped
    already), so after the exit handlers have run and the output is flushed the process ends at once."""
    if "ray" not in sys.modules:
        raise SystemExit(code)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`gpufeed ... | head`), or a stream closed already
            pass
    os._exit(code)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler ending a job), raised where Ctrl-C's KeyboardInterrupt would be, so that it
    stops a command the same way: local processes ended, nothing left running, one line saying how to resume."""


def _terminated(signum, frame):
    raise Terminated()


def _run(args) -> int:
    import signal

    try:
        before = signal.signal(signal.SIGTERM, _terminated)
    except ValueError:
        before = None  # not the main thread (main() called from a thread): SIGTERM keeps its handler
    try:
        return int(args._module.run(args) or 0)
    except GpufeedError as e:
        print(f"gpufeed: error: {e}", file=sys.stderr)
        return 2
    except PermissionError as e:  # where no step said more (a benchmark reading a dataset file): one line naming it
        what = f"{e.filename}: {e.strerror or e}" if e.filename else str(e)
        print(f"gpufeed: error: {what}: the user running gpufeed may not use it; change its permissions (chmod, "
              "chown), or run as a user who may", file=sys.stderr)
        return 2
    except Terminated:
        print("gpufeed: terminated (SIGTERM); rerun the same command to resume", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("gpufeed: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    finally:
        if before is not None:  # main() called from Python: the caller's SIGTERM handling, as it was
            signal.signal(signal.SIGTERM, before)

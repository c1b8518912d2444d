"""The one console helper for every ntx CLI.

Results go to stdout (JSON with `--json`); progress, status and errors go to stderr.
`run_app` is the error boundary: an `NtxError` becomes one `error: ...` line and a
non-zero exit; a traceback is shown only with `-v`/`NTX_DEBUG=1`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

from ntx_common.errors import NtxError

err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)


def verbose_requested(argv: list[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return os.environ.get("NTX_DEBUG") == "1" or "-v" in argv or "--verbose" in argv


def print_json(obj: Any) -> None:
    """Write one JSON document to stdout (machine-readable results)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def status(message: str) -> None:
    err.print(message)


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}")


def error_line(exc: BaseException) -> str:
    return f"error: {exc}"


def run_app(app: Any, argv: list[str] | None = None) -> None:
    """Run a typer app with the ntx error boundary around it."""
    try:
        app(args=argv, standalone_mode=False)
    except NtxError as exc:
        _report(exc, exc.exit_code, argv)
    except KeyboardInterrupt:
        err.print("interrupted")
        raise SystemExit(130) from None
    except OSError as exc:  # an unexpected OS failure still gets one clear line
        _report(exc, 1, argv)
    except SystemExit:
        raise
    except Exception as exc:  # click's own usage errors arrive here too
        _click_or_crash(exc, argv)


def _report(exc: BaseException, code: int, argv: list[str] | None) -> None:
    if verbose_requested(argv):
        err.print_exception()
    err.print(escape(error_line(exc)), markup=True)
    if not verbose_requested(argv):
        err.print("[dim](run with -v for the traceback)[/]")
    raise SystemExit(code)


def _click_or_crash(exc: Exception, argv: list[str] | None) -> None:
    import typer

    if isinstance(exc, typer.Exit):
        raise SystemExit(exc.exit_code)
    if isinstance(exc, typer.Abort):
        err.print("aborted")
        raise SystemExit(1)
    # click's usage errors (typer vendors its own click): duck-typed, they know how to show themselves
    if callable(getattr(exc, "show", None)) and isinstance(getattr(exc, "exit_code", None), int):
        exc.show(file=sys.stderr)
        raise SystemExit(exc.exit_code)
    _report(exc, 1, argv) if verbose_requested(argv) else _crash(exc)


def _crash(exc: Exception) -> None:
    err.print(escape(f"error: internal error: {type(exc).__name__}: {exc}"))
    err.print("[dim](this is a bug in ntx; run with -v for the traceback)[/]")
    raise SystemExit(70)

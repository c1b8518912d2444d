"""The shared CLI boundary: NtxError -> one `error:` line on stderr and a non-zero exit."""

import pytest
import typer

from ntx_common.console import run_app
from ntx_common.errors import GGUFError, UsageError
from ntx_common.options import confirm_or_refuse


def _app(exc):
    app = typer.Typer()

    @app.command()
    def go() -> None:
        raise exc

    return app


def test_ntx_error_becomes_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        run_app(_app(GGUFError("model.gguf: bad magic b'GGUX' (not a GGUF file)")), [])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "error: model.gguf: bad magic" in err
    assert "Traceback" not in err


def test_usage_error_exit_code(capsys):
    with pytest.raises(SystemExit) as info:
        run_app(_app(UsageError("bad option")), [])
    assert info.value.code == 2


def test_verbose_shows_traceback(capsys, monkeypatch):
    monkeypatch.setenv("NTX_DEBUG", "1")
    with pytest.raises(SystemExit):
        run_app(_app(GGUFError("x")), [])
    assert "Traceback" in capsys.readouterr().err


def test_unexpected_exception_is_reported_as_bug(capsys):
    with pytest.raises(SystemExit) as info:
        run_app(_app(ZeroDivisionError("boom")), [])
    assert info.value.code == 70
    assert "internal error: ZeroDivisionError" in capsys.readouterr().err


def test_mutation_without_tty_refuses():
    with pytest.raises(UsageError, match="without --yes"):
        confirm_or_refuse("bind 0000:01:00.0", yes=False, stdin_isatty=False)
    confirm_or_refuse("bind 0000:01:00.0", yes=True, stdin_isatty=False)

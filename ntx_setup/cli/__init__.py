"""`ntx-setup` command line (entry point: `ntx_setup.cli:main`)."""

from ntx_setup.cli.main import app, main

__all__ = ["app", "main"]

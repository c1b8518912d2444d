"""`python -m ntx_io` = `ntx-io` (for machines where the package is not installed)."""

from ntx_io.cli.main import main

main()

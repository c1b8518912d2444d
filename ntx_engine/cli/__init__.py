"""Console scripts of the engine (`ntx-run`)."""

"""Guarded machine setup for NVMe-to-GPU streaming (`ntx-setup`). Imports neither ntx_io nor ntx_engine."""

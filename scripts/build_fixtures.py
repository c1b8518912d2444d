#!/usr/bin/env python3
"""Build (once) the test fixtures under the cache dir; a placeholder until the oracle lands."""
import argparse
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--cache", type=Path, required=True)
args = ap.parse_args()
args.cache.mkdir(parents=True, exist_ok=True)

"""`ntx-io`: the storage layer's command line (`main.py` holds the commands, `render.py` the output)."""

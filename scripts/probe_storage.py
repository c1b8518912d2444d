"""Which O_DIRECT request size and queue depth read this disk fastest: prints the export line
for NTX_READ_CHUNK_MB / NTX_READ_WORKERS (the engine's storage reader settings)."""
import sys, itertools
from ntx_io.reader import open_reader
from ntx_engine.links import storage_bps
best = None
for chunk, workers in itertools.product((8, 32, 64), (8, 16, 32)):
    r, _ = open_reader(sys.argv[1], "direct", workers=workers, chunk=chunk << 20)
    bps = storage_bps(r, 2 << 30)
    r.close()
    print(f"# direct chunk {chunk} MiB workers {workers}: {bps / 1e9:.2f} GB/s", file=sys.stderr)
    if best is None or bps > best[0]:
        best = (bps, chunk, workers)
print(f"export NTX_READ_CHUNK_MB={best[1]} NTX_READ_WORKERS={best[2]}")

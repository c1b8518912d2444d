"""cuda_runs.resident_runs: which layers of a plan become one decode graph (no GPU needed)."""

from ntx_engine.backends.cuda_runs import resident_runs


def test_runs_are_maximal_vram_stretches_of_two_or_more():
    tiers = ["vram"] * 3 + ["ram", "vram", "cpu"] + ["vram"] * 2 + ["storage"] + ["vram"] * 4
    assert resident_runs(tiers) == [[0, 1, 2], [6, 7], [9, 10, 11, 12]]
    assert resident_runs(tiers, min_len=3) == [[0, 1, 2], [9, 10, 11, 12]]
    assert resident_runs(["ram", "cpu", "storage"]) == []
    assert resident_runs(["vram"] * 5) == [[0, 1, 2, 3, 4]]

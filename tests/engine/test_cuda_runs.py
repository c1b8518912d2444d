"""cuda_runs.resident_runs: which layers of a plan become one decode graph (no GPU needed)."""

from ntx_engine.backends.cuda_runs import resident_runs


def test_runs_are_maximal_vram_stretches_of_two_or_more():
    tiers = ["vram"] * 3 + ["ram", "vram", "cpu"] + ["vram"] * 2 + ["storage"] + ["vram"] * 4
    assert resident_runs(tiers) == [[0, 1, 2], [6, 7], [9, 10, 11, 12]]
    assert resident_runs(tiers, min_len=3) == [[0, 1, 2], [9, 10, 11, 12]]
    assert resident_runs(["ram", "cpu", "storage"]) == []
    assert resident_runs(["vram"] * 5) == [[0, 1, 2, 3, 4]]


class _Model:
    """The parts of a Transformer ResidentRuns wraps: forward loops over the pass's layers and
    calls run_layer; run_layer records which layers ran one by one."""

    def __init__(self, n):
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(n_layers=n, is_moe=False)
        self.backend = SimpleNamespace(flush=lambda: None)
        self.source = SimpleNamespace(resident={})
        self.one_by_one: list[int] = []
        self.settle = lambda x: x

    def forward(self, ids, start, all_logits=False, layers=None):
        x, pos = "x", list(range(start, start + len(ids)))
        for i in (range(self.cfg.n_layers) if layers is None else layers):
            x = self.run_layer(i, None, x, pos, start)
        return x

    def run_layer(self, i, lw, x, pos, start):
        self.one_by_one.append(i)
        return x


def test_a_pass_that_skips_part_of_a_run_never_replays_it(monkeypatch):
    """A speculative draft with --skip (layers 2 and 3 left out of the run 0..4) must run the
    run's other layers one by one: a graph of the whole run would compute the skipped ones."""
    from ntx_engine.backends import cuda_runs

    model = _Model(8)
    runs = cuda_runs.ResidentRuns(model, [[0, 1, 2, 3, 4]])
    replayed = []
    monkeypatch.setattr(runs, "_capture", lambda run, x, pos, start: None)

    def replay(run, x, pos):
        replayed.append(tuple(run.layers))
        run.x_out = "y"
    monkeypatch.setattr(runs, "_replay", replay)
    model.forward([1], 10)  # warm-up: the run goes one by one once
    assert model.one_by_one == list(range(8)) and not replayed
    model.one_by_one.clear()
    model.forward([1], 11)  # the whole run in the pass: one replay, then 5..7 one by one
    assert replayed == [(0, 1, 2, 3, 4)] and model.one_by_one == [5, 6, 7]
    model.one_by_one.clear()
    model.forward([1], 12, layers=[0, 1, 4, 5, 6, 7])  # the draft skips 2 and 3
    assert replayed == [(0, 1, 2, 3, 4)] and model.one_by_one == [0, 1, 4, 5, 6, 7]
    model.one_by_one.clear()
    model.forward([1, 2, 3], 13)  # a multi-token pass (verify, prefill): never a decode graph
    assert model.one_by_one == list(range(8))


def test_install_leaves_out_moe_and_off(monkeypatch):
    from types import SimpleNamespace

    from ntx_engine.backends import cuda_runs

    tiers = ["vram", "vram", "ram", "ram"]
    model = _Model(4)
    monkeypatch.setenv("NTX_CUDA_RUN_GRAPHS", "0")
    assert cuda_runs.install(model, tiers) is None
    monkeypatch.setenv("NTX_CUDA_RUN_GRAPHS", "resident")
    got = cuda_runs.install(_Model(4), tiers)
    assert set(got.runs) == {0} and got.streamed == frozenset()
    monkeypatch.setenv("NTX_CUDA_RUN_GRAPHS", "1")
    got = cuda_runs.install(_Model(4), tiers)
    assert got.streamed == frozenset({2, 3})
    moe = _Model(4)
    moe.cfg = SimpleNamespace(n_layers=4, is_moe=True)
    assert cuda_runs.install(moe, tiers) is None

"""ntx's inference engine. `from ntx_engine import Engine, EngineConfig` is the Python API
(docs/python.md); the names load lazily so that importing the package stays cheap."""

__all__ = ["Engine", "EngineConfig", "GenerationStats"]


def __getattr__(name: str):
    if name in __all__:
        from ntx_engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ntx_engine' has no attribute {name!r}")

"""ntx-serve: an OpenAI-compatible HTTP server over one loaded ntx engine."""

__all__ = ["create_app"]


def __getattr__(name: str):
    # lazy: `ntx-serve --help` must not import fastapi and the engine
    if name == "create_app":
        from ntx_serve.app import create_app

        return create_app
    raise AttributeError(name)

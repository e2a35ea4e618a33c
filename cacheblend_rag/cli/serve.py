"""``cacheblend-rag serve``: an OpenAI-compatible HTTP API over an ingested corpus."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ..errors import CacheBlendError
from .output import print_error, shown
from .overrides import KV_REMOTE_OPTION, use_kv_remote

err_console = Console(stderr=True)


def serve(
    corpus: Annotated[Path, typer.Option("--corpus", help="Corpus directory built by `ingest`.")],
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8000,
    engine: Annotated[
        str | None, typer.Option("--engine", help="torch (default) or vllm (needs the \\[vllm] extra).")
    ] = None,
    kv_remote: Annotated[str | None, KV_REMOTE_OPTION] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model (default: the corpus's).")] = None,
    served_model_name: Annotated[
        str | None, typer.Option("--served-model-name", help="Model id clients name (default: the model's).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key", envvar="CACHEBLEND_SERVE_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1."
        ),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens", min=1, help="Tokens to generate when a request names no limit (default 256)."
        ),
    ] = None,
    drain_timeout: Annotated[
        float, typer.Option("--drain-timeout", min=0, help="Seconds SIGTERM waits for requests in flight.")
    ] = 60.0,
) -> None:
    """Serve /v1/chat/completions, /v1/completions, /v1/models and /health (OpenAI's API) over CORPUS.

    Prompts that contain the text of stored chunks reuse their KV; requests meet in the batch scheduler.
    SIGTERM drains the requests in flight, then exits."""
    from ..engine import ENGINE_KINDS

    try:
        from ..server import EngineBackend, ServeState, create_app, serve_app
    except ImportError as exc:
        print_error(err_console, f"{exc}: pip install 'cacheblend-rag[serve]'")
        raise typer.Exit(1) from exc

    try:
        if engine is not None and engine not in ENGINE_KINDS:
            raise CacheBlendError(f"unknown engine {engine!r}; available: {', '.join(ENGINE_KINDS)}")
        settings = use_kv_remote(kv_remote)
        backend = EngineBackend(
            corpus, model=model, served_name=served_model_name, engine_kind=engine, config=settings
        )
    except (CacheBlendError, ValueError) as exc:
        print_error(err_console, exc)
        raise typer.Exit(1) from exc
    state = ServeState()
    app = create_app(
        backend,
        state,
        api_key=api_key,
        default_max_tokens=max_tokens or settings.max_tokens,
        max_request_bytes=settings.max_request_bytes,
    )
    err_console.print(
        f"serving {shown(backend.model_id)} ({backend.kind} engine) over {shown(corpus)} "
        f"on http://{shown(host)}:{port}/v1",
        highlight=False,
    )
    drained = serve_app(app, state, host, port, drain_timeout)
    if not drained and state.draining:
        raise typer.Exit(1)

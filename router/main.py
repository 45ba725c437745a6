"""The router process: the OpenAI-compatible HTTP API under uvicorn.

Owns the tokenizer (chat template, incremental detokenizer) and the
Dispatcher that talks to the workers. SIGTERM or Ctrl-C starts uvicorn's
graceful shutdown: no new connections, in-flight streams get up to
`drain_timeout_s` to finish.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import uvicorn

from deploy.logs import setup_logging
from deploy.model_folder import context_length
from deploy.settings import Settings
from protos.grammar import ll_tokenizer
from router.app import create_app
from router.dispatcher import Dispatcher

log = logging.getLogger(__name__)


def uvicorn_config(app, settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning" if settings.log_level == "info" else settings.log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        timeout_keep_alive=max(1, round(settings.keep_alive_s)),
        lifespan="off",
    )


def run(settings: Settings) -> None:
    """Process main for the router (a `spawn` target)."""
    setup_logging(settings.log_level, "router")
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(settings.model_dir))
    # llguidance's view of it (~0.5 s) is built now, not by the first request with a schema.
    threading.Thread(target=ll_tokenizer, args=(tokenizer,), name="grammar-tokenizer", daemon=True).start()
    dispatcher = Dispatcher(settings, max_context=context_length(settings.model_dir))
    app = create_app(dispatcher, tokenizer, settings)
    server = uvicorn.Server(uvicorn_config(app, settings))

    async def main() -> None:
        await dispatcher.start()
        try:
            await server.serve()
        finally:
            await dispatcher.stop()

    asyncio.run(main())
    log.info("router stopped")

"""OpenAI-compatible HTTP server over the Engine (rank 0).

    python -m numa_runtime.serve --model DIR --port 8000

`build_app(AsyncEngine(engine), ServeConfig(...))` gives the FastAPI app for embedding.
"""
from .app import ServeConfig, build_app
from .async_engine import AsyncEngine

__all__ = ["AsyncEngine", "ServeConfig", "build_app"]

"""Serving: the decoding engine behind an HTTP server (OpenAI-compatible API and chat page)."""

from moaspec.serving.app import create_app, listen, run_server
from moaspec.serving.engine import Engine, Overloaded

__all__ = ["Engine", "Overloaded", "create_app", "listen", "run_server"]

"""Engines: the models that generate text, behind one ``Engine`` contract.

Also the home of the shared lowest-level helpers (jsonl.py, breaker.py), which import
nothing of ours and which every package may import (README, "Develop").
"""

from __future__ import annotations

from pathlib import Path

from engines.base import Engine
from engines.settings import EngineSettings, LlamaCppSettings

__all__ = ["Engine", "create_engine"]


def create_engine(name: str, settings: EngineSettings, models_dir: Path) -> Engine:
    """Build the backend the settings name; ``start()`` it before use."""
    # Backends are imported here, not above: importing this package (for the shared
    # helpers too) must not load llama.cpp's native library or an HTTP client.
    if isinstance(settings, LlamaCppSettings):
        from engines.llama_cpp import LlamaCppEngine

        return LlamaCppEngine(name, settings, models_dir)
    from engines.openai_http import OpenAIHTTPEngine

    return OpenAIHTTPEngine(name, settings)

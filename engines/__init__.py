"""Engines: the models that generate text, behind one ``Engine`` contract."""

from __future__ import annotations

from pathlib import Path

from engines.base import Engine
from engines.llama_cpp import LlamaCppEngine
from engines.openai_http import OpenAIHTTPEngine
from engines.settings import EngineSettings, LlamaCppSettings

__all__ = ["Engine", "create_engine"]


def create_engine(name: str, settings: EngineSettings, models_dir: Path) -> Engine:
    """Build the backend the settings name; ``start()`` it before use."""
    if isinstance(settings, LlamaCppSettings):
        return LlamaCppEngine(name, settings, models_dir)
    return OpenAIHTTPEngine(name, settings)

"""Gateway: the OpenAI-compatible HTTP API, config, CLI, and the pipeline that wires the rest."""

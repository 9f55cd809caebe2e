"""Operations: metrics, logs, traces, rate limits and API keys."""

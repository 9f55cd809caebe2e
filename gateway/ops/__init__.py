"""Operations: metrics, logs, traces and rate limits."""

"""Semantic cache: exact and semantic lookup with false-hit guards, scoped by namespace.

Built so far: keys and namespaces (entry.py), guards (guards.py), the in-process
store (memory_store.py) and lookup/write-back over it (semantic_cache.py). Still to
come with the cache issue: the Redis store and replica sync, warm-up, admin
commands, evaluation, and wiring into the gateway's request path.
"""

"""Semantic cache: exact and semantic lookup with false-hit guards, memory and Redis stores.

Not built yet (see the semantic cache issue).
"""

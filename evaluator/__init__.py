"""Evaluator: confidence signals, calibration and the early-exit reasoning loop.

Not built yet (see the evaluator issue).
"""

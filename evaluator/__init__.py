"""Evaluator: confidence signals, calibration and the early-exit reasoning loop.

Built so far: answer extraction and grading (answers), the signals (signals), labelled
runs (runs) and the calibrator that maps signals to P(correct) (calibration). The loop
is not built yet (see the evaluator issue).
"""

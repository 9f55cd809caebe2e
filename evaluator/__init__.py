"""Evaluator: confidence signals, calibration and the early-exit reasoning loop.

Answer extraction and grading (answers); labelled runs (runs) and the signals read from
them (signals); the calibrator that maps signals to P(correct) (calibration) and its
training rows (training); the loop's decisions (policy) and the loop (loop). Data for
both: the trace bank (bank) and outcome collection for the router (collect); stopping
policies replayed over the bank (replay), swept and reported (replay_report).
"""

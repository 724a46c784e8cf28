"""Profiling: what the hardware does (hardware/) and what the model costs (model/).

measure.py is what both share: units, bandwidth conventions, sample statistics, the timer.
"""

"""Galvatron (PKU-DAIR/Hetu-Galvatron) files: hardware (hardware.py), model profiles (model.py)
and strategies (strategy.py), each to and from ours; compare.py prices a Galvatron strategy
beside our pick (search.compare)."""

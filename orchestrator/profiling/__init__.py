"""Profiling: what the hardware does (collectives) and what the model costs (model_*.py).

Hardware, pure (no torch.distributed needed): bandwidth, groups, fit, analytic, galvatron, report.
Hardware, run on every rank of a job together: timing, collectives, overlap.
"""

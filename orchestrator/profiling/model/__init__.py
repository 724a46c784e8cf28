"""Model profiling: what to profile (plan), one runner per point (runner: measured or analytic
timing), the point model and its timing, memory counting, FLOPs and device sheets (analytic),
fits against sequence length, and the report."""

"""Hardware profiling: collectives, p2p and overlap timed on every rank (benchmarks.py lists
them), process-group layouts, the inventory, alpha-beta fits, analytic link-sheet profiles,
reports (Galvatron export/import: orchestrator.interop.galvatron)."""

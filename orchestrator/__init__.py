"""orchestrator: from a Slurm cluster and a model to the fastest parallel layout."""
__version__ = "0.1.0"

"""train: run a ParallelLayout for real (data, optimizer, parallel engine, checkpoints, summary)."""

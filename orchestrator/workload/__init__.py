"""One definition of what a layout does on a rank: what it communicates in one iteration.

`comm.rank_comms(model, layout, rank)` lists every collective and point-to-point message a rank
issues in one steady-state training iteration of `stage=train`'s engine (train/engine.py), with
its group, bytes, dtype, phase and count. `params.stage_parameters` and `buckets.plan_buckets`
are the pieces the engine itself uses (its gradient buckets are planned by the same function),
so the list is the engine's, not a second opinion; tests/test_train_engine.py checks it against
the collectives a recorder sees when the real engine runs a step on gloo, for every layout of
its matrix. Pure Python: the planner and the tracer import it without torch.
"""

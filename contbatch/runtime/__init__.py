"""The step: `EngineCore` (one step at a time, on the engine thread) and the machinery it runs
on (`StepBatch`, `StepRunner`, buckets, CUDA graphs, compiled forwards, the step in flight).

Knows requests, the scheduler, the cache and the attention backends; nothing of the manager,
the server or tensor parallelism (a `DriverRunner` wraps the runner from outside).
"""

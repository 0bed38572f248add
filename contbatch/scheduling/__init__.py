from .scheduler import SCHEDULER_MAPPING, FIFOScheduler, PrefillFirstScheduler, ScheduledChunk, Scheduler, StepPlan

__all__ = ["SCHEDULER_MAPPING", "FIFOScheduler", "PrefillFirstScheduler", "ScheduledChunk", "Scheduler", "StepPlan"]

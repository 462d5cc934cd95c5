"""The scheduler's core, Ray-free: intake (samples -> complete, advantaged rollouts), the ledger and settled ids,
staleness and admission (by steps and by tokens), choosing and planning steps, and the state a checkpoint keeps.
`core.SchedulerCore` holds it all; `actors/scheduler_actor.py` is the actor around it."""

"""A step's layout, computed on the rollout side: packing samples into micro-batches, balancing them over DP
ranks, the step schedule, one rank's shard, and context-parallel splits (docs/scheduler.md)."""

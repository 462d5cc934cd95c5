"""vgbs-ray core: importable without a Ray cluster or Megatron.

Modules (one concept each; docs/architecture.md lists them all):
  errors      one error base class and its kinds
  config      ParallelConfig, BatchConfig (frozen, validated at construction)
  flops       FLOPs cost of a dense GQA transformer per sequence
  sample      the data contract of a sample and a rollout, with validation
  packing     first-fit-decreasing packing and alignment splitting
  balancing   assigning micro-batches to DP ranks (strided, tokens, flops)
  schedule    build_dp_schedule: rollouts -> steps -> micro-batches -> ranks
  shard       StepShard: what one DP rank trains in one step
  loss        per-rollout loss accounting (torch)
  metrics     (sum, count) metric pairs and their count-weighted reduction
  scheduler/  the scheduler's core, Ray-free (intake, ledger, staleness, steps, its state)
  producer_core  a producer's bookkeeping, Ray-free
"""

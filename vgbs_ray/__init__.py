"""vgbs-ray core: importable without a Ray cluster or Megatron.

One folder per concept (docs/architecture.md lists every module):
  errors, config, sample   the error kinds, the schedule's configs, the data contract of a sample and a rollout
  failure_policy           the run controller's one pure decision: decide(state, event) -> (state, action)
  producer_core            a producer's bookkeeping, Ray-free
  layout/      a step laid out on the rollout side: packing, balancing, the schedule, one rank's shard
  losses/      per-rollout loss accounting, its normalisers, advantages, the policy-loss API and built-ins
  models/      model families, the Hugging Face weight mapping, LoRA in PEFT's format, FLOPs per sequence
  scheduler/   the scheduler's core, Ray-free (intake, ledger, staleness, steps, its state)
  agents/      the public agent API
"""

"""The rank side: one Megatron-Core policy on one rank, without Ray (its configs, the GPTModel of a family,
the train step, LoRA layers, Hugging Face checkpoints, rendezvous, the CPU redirects). `actors/train_actor.py`
and `actors/train_group.py` are the Ray shells around it; tests drive it in-process."""

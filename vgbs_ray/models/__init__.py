"""The models a job trains, described without Megatron: model families and their Hugging Face name mapping,
LoRA adapters in PEFT's format, and the FLOPs cost per sequence (docs/models.md, docs/lora.md)."""

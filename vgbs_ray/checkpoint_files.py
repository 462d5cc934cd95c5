"""The files of a Hugging Face checkpoint directory besides the weights: its tokenizer travels with it.

A directory has a tokenizer when it holds `tokenizer.json` or `tokenizer_config.json`; every export
of the policy (the engines' starting checkpoint, `write_hf_checkpoint`) copies whichever tokenizer
files the source has, so engines and agents use the checkpoint's own tokenizer and chat template.
"""

from __future__ import annotations

import json
import os
import shutil

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")


def has_tokenizer(directory: str | os.PathLike | None) -> bool:
    return directory is not None and any(os.path.isfile(os.path.join(directory, name))
                                         for name in ("tokenizer.json", "tokenizer_config.json"))


def has_weights(directory: str | os.PathLike) -> bool:
    """Whether the directory holds weights (safetensors or PyTorch bin files), not only a config and tokenizer."""
    return any(name.endswith((".safetensors", ".bin")) for name in os.listdir(directory))


def tokenizer_size(directory: str | os.PathLike) -> int:
    """How many token ids the directory's tokenizer makes (transformers' `len(tokenizer)`: the vocabulary
    and the added tokens). Read from `tokenizer.json` with the `tokenizers` library, which loads in
    milliseconds where importing transformers costs a job's driver ~3 s; the ids of
    `tokenizer_config.json`'s `added_tokens_decoder` count too. A directory with only slow-tokenizer
    files (no tokenizer.json) is loaded with transformers."""
    fast = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(fast):
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(directory))
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(fast).get_vocab_size(with_added_tokens=True)
    added = _read_json(os.path.join(directory, "tokenizer_config.json")).get("added_tokens_decoder") or {}
    return max([size, *(int(token_id) + 1 for token_id in added)])


AUTO_TOKENIZER_KEEPS_BACKEND = frozenset({"llama", "qwen3", "qwen3_moe"})
"""Model types for which transformers' AutoTokenizer (the pinned version) loads a tokenizer that names
`TokenizersBackend` with that very class; for others, such as qwen2, it picks the model's own class."""


def load_tokenizer(directory: str | os.PathLike):
    """The directory's Hugging Face tokenizer, as `AutoTokenizer.from_pretrained` loads it. When its
    `tokenizer_config.json` names `TokenizersBackend` (transformers 5's class over tokenizer.json, what
    `save_pretrained` writes for a fast tokenizer) and the directory's `config.json`, if any, has a model type
    in AUTO_TOKENIZER_KEEPS_BACKEND, the tokenizer is loaded with that class directly: the same tokenizer
    (tests/test_job_config.py compares them), without AutoTokenizer's imports, which pull in torch (~3 s of CPU
    in a process that needs none, such as an agent producer)."""
    direct = _read_json(os.path.join(directory, "tokenizer_config.json")).get("tokenizer_class") == "TokenizersBackend"
    model_config = os.path.join(directory, "config.json")
    if direct and os.path.isfile(model_config):
        direct = _read_json(model_config).get("model_type") in AUTO_TOKENIZER_KEEPS_BACKEND
    if direct:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _read_json(path: str) -> dict:
    """The file's JSON object; empty when there is no such file."""
    if not os.path.isfile(path):
        return {}
    with open(path) as handle:
        return json.load(handle)


def copy_tokenizer(source: str | os.PathLike | None, destination: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files `source` has into `destination`; returns their names (none when source is None)."""
    if source is None or os.path.abspath(source) == os.path.abspath(destination):
        return []
    copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
    for name in copied:
        shutil.copy(os.path.join(source, name), os.path.join(destination, name))
    return copied

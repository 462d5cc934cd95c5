"""Build nested frozen-dataclass configs from YAML mappings plus `section.key=value` overrides.

The configs themselves (vgbs_ray.config, actors.*) validate their values; this module only
maps keys onto fields, and fails on a key no config has, naming it and the valid keys (or, for a
key that moved, where it lives now: a config class's `moved_keys`; for one that was removed, why:
its `removed_keys`; for one the job derives from other keys, which: its `derived_keys`, left out of
`--help` too).
A string literal right under a field (torchtitan style) is that field's help text.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, Mapping

import yaml

from vgbs_ray.errors import ConfigError


def _dataclass_type(annotation) -> type | None:
    """The dataclass inside an annotation like `X`, `X | None` or `Optional[X]`, else None."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def config_from_mapping(cls: type, mapping: Mapping[str, Any] | None, where: str = "", base: Any = None) -> Any:
    """Instantiate dataclass `cls` from `mapping`, on top of `base` (or the field defaults).

    Dataclass-typed fields recurse, so a partial section changes only the keys it names.
    Raises ConfigError for a key that is not a field (naming the dotted key and the valid
    ones), and re-raises the config's own validation errors with the section prefixed.
    """
    mapping = dict(mapping or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(mapping) - set(fields))
    moved = {key: getattr(cls, "moved_keys", {})[key] for key in unknown if key in getattr(cls, "moved_keys", {})}
    if moved:
        raise ConfigError("; ".join(f"config key '{where}{key}' moved: set {new}" for key, new in moved.items()))
    removed = {key: getattr(cls, "removed_keys", {})[key] for key in unknown
               if key in getattr(cls, "removed_keys", {})}
    if removed:
        raise ConfigError("; ".join(f"config key '{where}{key}' was removed: {why}" for key, why in removed.items()))
    derived = {key: source for key, source in getattr(cls, "derived_keys", {}).items() if key in mapping}
    if derived:
        raise ConfigError("; ".join(f"config key '{where}{key}' is not set by hand: the job derives it from {source}"
                                    for key, source in derived.items()))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {[where + k for k in unknown]}; valid keys under "
            f"'{where.rstrip('.') or 'top level'}': {sorted(fields)}"
        )
    values = {}
    for name, value in mapping.items():
        nested = _dataclass_type(hints[name])
        if nested is not None and isinstance(value, Mapping):
            nested_base = getattr(base, name) if base is not None else _field_default(fields[name])
            value = config_from_mapping(nested, value, f"{where}{name}.", nested_base)
        elif nested is not None and isinstance(value, (list, tuple)):  # a list of sections (e.g. tenants)
            value = tuple(item if dataclasses.is_dataclass(item) else
                          config_from_mapping(nested, item, f"{where}{name}[{index}].")
                          for index, item in enumerate(value))
        elif isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, str) and float in (hints[name], *typing.get_args(hints[name])):
            value = _float_or_text(value)
        values[name] = value
    try:
        return dataclasses.replace(base, **values) if base is not None else cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"config section '{where.rstrip('.') or cls.__name__}': {error}") from error


def _float_or_text(value: str) -> float | str:
    """YAML 1.1 (PyYAML) reads `5e-3` as a string (it wants `5.0e-3`); a float field takes it as the number."""
    try:
        return float(value)
    except ValueError:
        return value


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def apply_overrides(mapping: Mapping[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `mapping` with each `a.b.c=value` set (value parsed as YAML)."""
    result = _deep_copy(mapping)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. batch.global_batch_size=16)")
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{part}' is a value, not a section")
        node[leaf] = yaml.safe_load(raw)
    return result


def load_yaml(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    with open(path) as handle:
        loaded = yaml.safe_load(handle) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded


def _deep_copy(mapping):
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in mapping.items()}


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal written right under it in the class body."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def describe(cls: type, prefix: str = "", base: Any = None) -> list[str]:
    """One help line per leaf option: dotted key, default (from `base` if given), and help text."""
    lines = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in getattr(cls, "derived_keys", {}):
            continue
        nested = _dataclass_type(hints[f.name])
        default = getattr(base, f.name) if base is not None else _field_default(f)
        if nested is not None and (dataclasses.is_dataclass(default) or default is None):
            lines.extend(describe(nested, f"{prefix}{f.name}.", default))
            continue
        text = f"  {prefix}{f.name} = {default!r}"
        if f.name in docs:
            text += f"\n      {docs[f.name]}"
        lines.append(text)
    return lines

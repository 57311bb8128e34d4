"""Config plumbing shared by every stage.

A stage's config is a frozen dataclass whose fields each carry a docstring
(``field(metadata={"help": ...})``). ``load_config`` resolves defaults <- YAML
file <- ``--set key=value`` overrides, type-checks every value against the
field's annotation, and returns the instance; ``config_hash`` is the sha256 of
its canonical JSON, stored with every output the config produced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pipeline.errors import ConfigError

T = TypeVar("T")


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(name, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{name}: {value!r} fits none of {annotation}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{name}: {value!r} is not one of {list(args)}")
        return value
    if origin in (dict, typing.Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        kt, vt = args or (str, Any)
        return {_coerce(name, k, kt): _coerce(name, v, vt) for k, v in value.items()}
    if origin in (tuple, typing.Tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return tuple(_coerce(name, v, inner) for v in value)
    if annotation is Any:
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true/false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    return value


def parse_set(items: list[str] | None) -> dict[str, Any]:
    """``["a=1", "b.c=x"]`` -> ``{"a": 1, "b.c": "x"}``; values parsed as YAML scalars."""
    import yaml

    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(raw) if raw != "" else ""
    return out


def load_config(cls: type[T], file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> T:
    """Defaults <- YAML ``file`` <- ``overrides``; unknown keys are errors."""
    import yaml

    values: dict[str, Any] = {}
    if file is not None:
        try:
            loaded = yaml.safe_load(Path(file).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {file} must hold a mapping of key: value")
        values.update(loaded)
    values.update(overrides or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {unknown} for {cls.__name__}",
            hint=f"known keys: {', '.join(sorted(fields))}",
        )
    kwargs = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None


def config_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_json(cfg: Any) -> str:
    return json.dumps(config_dict(cfg), sort_keys=True, separators=(",", ":"), default=str)


def config_hash(cfg: Any) -> str:
    """sha256 of the config's canonical JSON (sorted keys, no whitespace)."""
    return hashlib.sha256(config_json(cfg).encode()).hexdigest()


def describe(cls: type) -> list[tuple[str, Any, str]]:
    """(name, default, help) for every field, for --help texts and docs."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        )
        out.append((f.name, default, f.metadata.get("help", "")))
    return out

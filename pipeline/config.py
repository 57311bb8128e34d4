"""Config plumbing shared by every stage.

A stage's config is a frozen dataclass whose fields each carry a docstring
(``field(metadata={"help": ...})``) and, where a value has a valid range, its
bounds (``metadata={"ge": 0, "le": 1}``; also ``gt``/``lt``). ``load_config``
resolves defaults <- YAML file <- ``--set key=value`` overrides, type-checks
every value against the field's annotation, checks every bound, and returns the
instance, so a bad value is refused before any work starts; ``config_hash`` is
the sha256 of its canonical JSON, stored with every output the config produced.

Values are read as YAML users write them: ``1e-4`` is a number (PyYAML's YAML 1.1
resolver reads it as a string; :func:`yaml_load` uses the YAML 1.2 rule), an
integer is accepted where a float is expected, and an integer is accepted for a
string field (``kl_reference=2``, ``run_id: 7``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pipeline.errors import ConfigError

T = TypeVar("T")

# YAML 1.2 core-schema floats: 1e-4, 1E5, .5, -2.5e+3 (PyYAML's 1.1 rule needs a dot and a signed exponent).
_FLOAT_RE = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$")
_LOADER: Any = None


def _loader() -> Any:
    global _LOADER
    if _LOADER is None:
        import yaml

        class Loader(yaml.SafeLoader):
            pass

        Loader.add_implicit_resolver(
            "tag:yaml.org,2002:float",
            re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
            list("-+0123456789."))
        _LOADER = Loader
    return _LOADER


def yaml_load(text: str) -> Any:
    """``yaml.safe_load`` that also reads ``1e-4`` / ``1E5`` as floats (YAML 1.2)."""
    import yaml

    return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass


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
        if isinstance(value, float) and value.is_integer():   # 1e3 written for 1000
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"[-+]?[0-9]+", value.strip()):
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if isinstance(value, int) and not isinstance(value, bool):   # kl_reference=2, run_id: 7
            return str(value)
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
        if not key.strip():
            raise ConfigError(f"--set {item!r}: expected key=value")
        try:
            out[key.strip()] = yaml_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: not a YAML value ({_first_line(exc)})",
                              hint="quote strings that contain YAML syntax, e.g. --set \"key='a: b'\"") from None
    return out


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


_BOUNDS = (("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
           ("le", "<=", lambda v, b: v <= b), ("lt", "<", lambda v, b: v < b))


def bounds_text(f: dataclasses.Field) -> str:
    """``">= 0, <= 1"`` for a field with range metadata, else ``""``."""
    return ", ".join(f"{word} {f.metadata[key]}" for key, word, _ in _BOUNDS if key in f.metadata)


def check_ranges(cfg: Any) -> None:
    """Refuse NaN and any value outside its field's ``ge``/``gt``/``le``/``lt`` bounds."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        values = value if isinstance(value, tuple) else (value,)
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if isinstance(v, float) and math.isnan(v):
                raise ConfigError(f"{f.name}: NaN is not a valid value")
            for key, _word, ok in _BOUNDS:
                if key in f.metadata and not ok(v, f.metadata[key]):
                    raise ConfigError(f"{f.name}={v!r} is out of range: must be {bounds_text(f)}",
                                      hint=f"{f.name}: {f.metadata.get('help', '')}".rstrip(": "))


def load_config(cls: type[T], file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> T:
    """Defaults <- YAML ``file`` <- ``overrides``; unknown keys are errors."""
    import yaml

    values: dict[str, Any] = {}
    if file is not None:
        try:
            loaded = yaml_load(Path(file).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {file} is a directory") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {file} is not UTF-8 text") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {file} is not valid YAML: {_first_line(exc)}") from None
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
        cfg = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None
    check_ranges(cfg)
    return cfg


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
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        )
        help_ = f.metadata.get("help", "")
        rng = bounds_text(f)
        out.append((f.name, default, f"{help_} ({rng})" if rng else help_))
    return out


def keys_epilog(cls: type) -> str:
    """The ``config keys`` block of a command's --help: every key, its default and meaning."""
    lines = "\n".join(f"  {name} (default {default!r}): {help_}" for name, default, help_ in describe(cls))
    return "config keys (--config FILE / --set key=value; numbers like 1e-4 are fine):\n" + lines

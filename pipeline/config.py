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
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(name, value, arg)
            except ConfigError:
                continue   # the next member of the union may fit
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


# The experiment file's sections: one per command that reads a stage config. A config class names its
# section with a ``config_section`` class attribute; an experiment file holds ``rollout:``, ``admission:``,
# ``train:`` ... mappings, and each command reads its own.
SECTIONS = ("rollout", "admission", "train", "demo", "maintain", "policy")


class ConfigPrinted(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by :func:`load_config` when ``--print-config`` asked for the resolved config instead of a run."""

    def __init__(self, section: str | None, resolved: dict[str, Any]):
        super().__init__(section)
        self.section = section
        self.resolved = resolved


# Set by the CLI for one command run with --print-config (see pipeline.cli.main).
PRINT_CONFIG = False


def section_of(cls: type) -> str | None:
    """The experiment-file section a config class is read from (None: flat files only)."""
    return getattr(cls, "config_section", None)


def did_you_mean(key: str, known: list[str] | tuple[str, ...]) -> str | None:
    """``"did you mean `lr`?"`` for a key close to a known one, else None."""
    import difflib

    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
    if not close:
        return None
    return "did you mean " + " or ".join(f"`{c}`" for c in close) + "?"


def _unknown_keys_error(unknown: list[str], known: list[str], where: str) -> ConfigError:
    guesses = [f"{k}: {g}" for k in unknown if (g := did_you_mean(k, known))]
    hint = "; ".join(guesses) if guesses else f"known keys: {', '.join(known)}"
    if guesses:
        hint += " (all keys: `--help`, or --print-config for the resolved values)"
    return ConfigError(f"unknown config key(s) {unknown} for {where}", hint=hint)


def _read_file(file: str | Path) -> dict[str, Any]:
    import yaml

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
    return loaded


def refuse_other_sections(file: str | Path | None, section: str, *, command: str, hint: str) -> None:
    """A command that reads only its own section of an experiment file refuses a file with other
    sections (it would ignore them silently): one line naming them."""
    if file is None:
        return
    loaded = _read_file(file)
    others = [k for k in SECTIONS if k in loaded and k != section and loaded[k]]
    if others:
        raise ConfigError(f"config file {file}: {command} reads only its `{section}:` section and would ignore "
                          + ", ".join(f"`{k}:`" for k in others), hint=hint)


def _section_values(cls: type, file: str | Path | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The values for ``cls`` from a flat or sectioned file plus flat or dotted overrides, with
    OmegaConf interpolations (``${train.seed}``) resolved across the whole experiment tree."""
    section = section_of(cls)
    loaded = _read_file(file) if file is not None else {}
    if section is None:   # a config that is not a section of experiment files: flat keys only
        return {**loaded, **overrides}
    sectioned = any(k in SECTIONS for k in loaded)
    if sectioned:
        stray = sorted(k for k in loaded if k not in SECTIONS)
        if stray:
            raise ConfigError(
                f"config file {file} mixes sections ({', '.join(k for k in SECTIONS if k in loaded)}) with "
                f"top-level key(s) {stray}",
                hint="; ".join(g for k in stray if (g := did_you_mean(k, SECTIONS)))
                or f"put each key under its stage's section ({', '.join(SECTIONS)})")
        for name in SECTIONS:
            if name in loaded and not isinstance(loaded[name] or {}, dict):
                raise ConfigError(f"config file {file}: section `{name}` must be a mapping of key: value")
        tree: dict[str, Any] = {k: dict(v or {}) for k, v in loaded.items()}
    else:
        tree = {section: dict(loaded)}
    tree.setdefault(section, {})
    for key, value in overrides.items():
        head, dot, rest = key.partition(".")
        if dot and head in SECTIONS:
            if head != section:
                raise ConfigError(
                    f"override {key!r} is for the `{head}` section; this command reads `{section}`",
                    hint=f"write --set {section}.KEY=VALUE (or KEY=VALUE) for this command; "
                         f"pass `{head}.` overrides to the command that reads `{head}`")
            key = rest
        tree[section][key] = value
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        resolved = OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config for `{section}`: {_first_line(exc)}",
                          hint="interpolations are written ${section.key}, e.g. ${train.seed}") from None
    assert isinstance(resolved, dict)
    values = resolved[section]
    assert isinstance(values, dict)
    return {str(k): v for k, v in values.items()}


def load_config(cls: type[T], file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> T:
    """Defaults <- YAML ``file`` <- ``overrides``; unknown keys are errors.

    ``file`` is either flat (``key: value`` for this command, as before) or an experiment tree with one
    section per stage (``rollout:``, ``admission:``, ``train:``, ...: :data:`SECTIONS`), of which the
    command reads its own (the class's ``config_section``). Overrides are ``key`` or ``section.key``
    (``--set train.lr=1e-4``); values may interpolate others (``${train.seed}``, OmegaConf syntax).
    """
    values = _section_values(cls, file, dict(overrides or {}))
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        section = section_of(cls)
        raise _unknown_keys_error(unknown, sorted(fields),
                                  cls.__name__ + (f" (section `{section}`)" if section else ""))
    kwargs = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    try:
        cfg = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None
    check_ranges(cfg)
    if PRINT_CONFIG:
        raise ConfigPrinted(section_of(cls), json.loads(config_json(cfg)))
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

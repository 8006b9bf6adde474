"""Reading a config: YAML file + ``key=value`` overrides -> one OmegaConf structured config -> :class:`JaxRLConfig`.

Overrides use verl's (Hydra's) command-line spelling: ``a.b.c=value`` where ``value`` is parsed as
YAML by OmegaConf (``1e-6``, ``True``, ``[console,jsonl]``, ``null``, ``${trainer.project_name}``).
Unknown keys get a "did you mean" suggestion; verl keys with no JAX meaning become compat notes
(:mod:`jaxrl.config.compat`). Value checks are :mod:`jaxrl.config.checks` / :mod:`jaxrl.config.cross`.
"""

from __future__ import annotations

import difflib
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxrl.config import compat, schema
from jaxrl.config.errors import ConfigError
from jaxrl.config.schema import JaxRLConfig
from jaxrl.paths import expand_shared

__all__ = ["LEAVES", "RL_KEYS", "SECTIONS", "KeyTable", "assign", "classify", "raw_pairs", "resolve", "suggest",
           "type_name"]


# ------------------------------------------------------------------------------ key lookups
@dataclass(frozen=True)
class KeyTable:
    """What reading a config needs to know of its schema: every leaf key and its type, the sections, the free-form
    mapping fields, and the verl compat tables.

    Attributes:
      root: the schema's root dataclass (:class:`JaxRLConfig`, or an offline trainer's).
      leaves: full dotted leaf key -> annotated type.
      sections: full dotted section key -> dataclass.
      mapping_leaves: the free-form mapping fields (``reward_model.reward_kwargs``): ``field.a.b=value`` sets a
        key inside them, as Hydra's ``+reward_model.reward_kwargs.max_resp_len=...`` does in verl.
      compat: the schema's :class:`~jaxrl.config.compat.CompatTable`.
    """

    root: type
    leaves: dict
    sections: dict
    mapping_leaves: tuple
    compat: compat.CompatTable

    @classmethod
    def of(cls, root: type, compat_table: compat.CompatTable) -> "KeyTable":
        leaves, sections = schema.schema_keys(root)
        mapping = tuple(k for k, tp in leaves.items() if typing.get_origin(tp) is dict)
        return cls(root, leaves, sections, mapping, compat_table)

    def mapping_leaf(self, key: str) -> str | None:
        """The mapping field ``key`` points inside (``'reward_model.reward_kwargs.x.y'`` -> its field), or None."""
        return next((m for m in self.mapping_leaves if key.startswith(m + ".")), None)


RL_KEYS = KeyTable.of(JaxRLConfig, compat.RL)  # python -m jaxrl.train's config
LEAVES, SECTIONS = RL_KEYS.leaves, RL_KEYS.sections


def mapping_leaf(key: str, table: KeyTable = RL_KEYS) -> str | None:
    """The mapping field ``key`` points inside (``'reward_model.reward_kwargs.x.y'`` -> its field), or None."""
    return table.mapping_leaf(key)


def type_name(tp: Any) -> str:
    """Human name of a schema field type, e.g. ``Optional[int]`` -> ``'int or null'``."""
    if tp is Any:
        return "a str or a list of str"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in inner) + " or null"
    if origin is list:
        return f"a list of {type_name(args[0])}" if args else "a list"
    if origin is dict:
        return "a mapping (key: value, ...)"
    return {int: "int", float: "float", bool: "bool (True/False)", str: "str"}.get(tp, getattr(tp, "__name__", str(tp)))


def suggest(key: str, table: KeyTable = RL_KEYS) -> str | None:
    """Closest valid leaf key of ``table`` to an unknown ``key``.

    Order: the same last segment in another section (a key put in the wrong section), then the
    closest sibling in the same (valid) section, then the closest full dotted key whose last
    segment also resembles the given one.
    """
    leaves, sections = table.leaves, table.sections
    parent, _, last = key.rpartition(".")
    same_name = [k for k in leaves if k.rpartition(".")[2] == last]
    if same_name:
        return difflib.get_close_matches(key, same_name, n=1, cutoff=0.0)[0]
    if parent == "" or parent in sections:
        siblings = [k.rpartition(".")[2] for k in leaves if k.rpartition(".")[0] == parent]
        match = difflib.get_close_matches(last, siblings, n=1, cutoff=0.6)
        if match:
            return f"{parent}.{match[0]}" if parent else match[0]
    candidates = [
        k for k in leaves if difflib.SequenceMatcher(None, last, k.rpartition(".")[2]).ratio() >= 0.6
    ]
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def _unknown_key_message(key: str, source: str, table: KeyTable) -> str:
    leaves, sections = table.leaves, table.sections
    guess = suggest(key, table)
    if guess is not None:
        return f"Unknown config key '{key}'; did you mean '{guess}'? (from {source})"
    parent = key.rpartition(".")[0]
    while parent and parent not in sections:
        parent = parent.rpartition(".")[0]
    if parent:
        under = sorted(k[len(parent) + 1 :] for k in leaves if k.startswith(parent + "."))
        where = f"valid keys under '{parent}': {', '.join(under)}"
    else:
        where = "valid top-level sections: " + ", ".join(s for s in sections if "." not in s)
    return f"Unknown config key '{key}' (from {source}); {where}"


# ---------------------------------------------------------------------------- raw inputs
def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist (--config expects a YAML file)")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def _parse_override(item: str) -> tuple[str, Any]:
    """``'a.b=value'`` -> ``('a.b', parsed value)`` with OmegaConf's YAML value grammar."""
    if item.lstrip().startswith("~"):
        raise ConfigError(f"override '{item}': deleting keys ('~key') is not supported; every key has a default")
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value (e.g. data.train_batch_size=16)")
    key, raw = item.split("=", 1)
    key = key.strip()
    key = key.lstrip("+")  # Hydra's '+key=' / '++key=': every jaxrl key already exists
    if not key or not all(part.strip() for part in key.split(".")):
        raise ConfigError(f"override '{item}' has an empty key segment; expected e.g. trainer.total_epochs=3")
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]), resolve=False)["v"]
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"override '{item}': cannot parse the value {raw!r}: {e}") from None
    return key, value


def _flatten(key: str, value: Any, source: str, out: list[tuple[str, Any, str]], table: KeyTable) -> None:
    """Append ``(full dotted leaf key, value, source)`` for ``value`` placed at ``key``."""
    if key in table.sections:
        if value is None:  # an empty YAML section ("data:" with everything commented out)
            return
        if not isinstance(value, dict):
            raise ConfigError(
                f"'{key}' is a config section; expected a mapping of its keys, got {value!r} (from {source})"
            )
        for k, v in value.items():
            _flatten(f"{key}.{k}", v, source, out, table)
    elif isinstance(value, dict) and value and key not in table.leaves:
        for k, v in value.items():  # an unknown (or compat-only) mapping: check each leaf inside it
            _flatten(f"{key}.{k}", v, source, out, table)
    else:
        out.append((key, value, source))


def raw_pairs(config_path: str | Path | None, overrides: Sequence[str],
              table: KeyTable = RL_KEYS) -> list[tuple[str, Any, str]]:
    pairs: list[tuple[str, Any, str]] = []
    if config_path is not None:
        path = Path(config_path).expanduser()
        raw = _read_yaml(path)
        for k, v in raw.items():
            if str(k) == "defaults":
                raise ConfigError(
                    f"'defaults' (a Hydra defaults list) in {path} is not supported: jaxrl does not compose "
                    "config groups; write the keys you change in one file (the schema fills the rest)"
                )
            _flatten(str(k), v, f"config file {path}", pairs, table)
    for item in overrides:
        key, value = _parse_override(item)
        _flatten(key, value, f"override '{item}'", pairs, table)
    return pairs


def classify(pairs: list[tuple[str, Any, str]],
             table: KeyTable = RL_KEYS) -> tuple[list[tuple[str, Any, str]], list[compat.CompatNote]]:
    """Split raw pairs into schema assignments and compat notes; raise on unknown keys."""
    kept: list[tuple[str, Any, str]] = []
    notes: dict[str, compat.CompatNote] = {}
    tables = table.compat
    for key, value, source in pairs:
        if key in table.leaves or table.mapping_leaf(key) is not None:
            note = tables.lookup_note(key, schema_field=True)
            if note is not None:
                notes[key] = compat.CompatNote(key, value, note)
            kept.append((key, value, source))
        elif key in tables.renames:
            notes[key] = compat.CompatNote(key, value, tables.rename_note(key))
            kept.append((tables.renames[key], value, source))
        else:
            note = tables.lookup_note(key, schema_field=False)
            if note is None:
                raise ConfigError(_unknown_key_message(key, source, table))
            bad = tables.unsupported_value(key, value)
            if bad is not None:
                raise ConfigError(f"{bad} (from {source})")
            notes[key] = compat.CompatNote(key, value, note)
    return kept, list(notes.values())


# ------------------------------------------------------------------------------- merging
def _prepare(key: str, value: Any, table: KeyTable) -> Any:
    """Expand ``${JAXRL_SHARED}`` in strings; wrap a scalar given for a list field into a list."""
    if isinstance(value, str):
        value = expand_shared(value)
    elif isinstance(value, list):
        value = [expand_shared(v) if isinstance(v, str) else v for v in value]
    if key not in table.leaves:  # a key inside a mapping field: any value
        return value
    if typing.get_origin(table.leaves[key]) is list and value is not None and not isinstance(value, list):
        value = [value]
    return value


def assign(cfg: Any, kept: list[tuple[str, Any, str]], table: KeyTable = RL_KEYS) -> None:
    for key, value, source in kept:
        value = _prepare(key, value, table)
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except OmegaConfBaseException:
            expected = type_name(table.leaves.get(key) or table.leaves[table.mapping_leaf(key)])
            if value is None:
                raise ConfigError(f"{key}=null is invalid; expected {expected} (from {source})") from None
            raise ConfigError(
                f"{key}={value!r} has the wrong type ({type(value).__name__}); expected {expected} (from {source})"
            ) from None


_MISSING_INTERP = re.compile(r"Interpolation key '([^']+)' not found")


def resolve(cfg: Any, table: KeyTable = RL_KEYS) -> Any:
    """The structured config as an instance of ``table.root`` (interpolations resolved).

    Raises:
      ConfigError: an interpolation that cannot be resolved (names the key, its raw value and, for a missing key,
        the closest valid one).
    """
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        try:
            raw = OmegaConf.to_container(cfg, resolve=False)
            for part in key.split("."):
                raw = raw[part]
        except (KeyError, TypeError):
            raw = None
        msg = f"{key}={raw!r}: cannot resolve the interpolation: {getattr(e, 'msg', str(e)).splitlines()[0]}"
        missing = _MISSING_INTERP.search(str(e))
        if missing:
            guess = suggest(missing.group(1), table)
            if guess is not None:
                msg += f"; did you mean '{guess}'?"
        raise ConfigError(msg) from None

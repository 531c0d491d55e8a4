"""Mistakes Hydra finds on the command line, as one sentence each, with the choices it knows.

Hydra reports a bad override with its own multi-line text and exit status 1; ``ditrun`` lets
Hydra raise the exception instead (``HYDRA_FULL_ERROR``) and prints ``ditrun: error: <one
sentence>`` with exit status 2, like every other user mistake. Only Hydra's own composition
errors (and the OmegaConf error behind one) are turned into sentences: an OmegaConf error raised
while the job runs is a bug and keeps its traceback.

``check_composed`` covers what Hydra lets through: a value left missing (``???``), an
interpolation that does not resolve, and a key added with ``+`` that ditrun never reads.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from typing import Iterator, Optional

from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    ValidationError,
)

from ditrun.errors import UserError

_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def sentence(err: BaseException) -> Optional[str]:
    """The one sentence for a mistake Hydra found while composing the config; None for anything else."""
    if isinstance(err, MissingConfigException):
        return _unknown_choice(err)
    if isinstance(err, OverrideParseException):
        lines = [line for line in str(err).splitlines() if not line.startswith(("Error parsing", "See "))]
        reason = lines[0] if lines else "unknown reason"
        return f"the override {err.override!r} cannot be parsed ({reason}); write key=value (Hydra's override grammar)."
    if isinstance(err, ConfigCompositionException):
        cause = err.__cause__
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
            return _unknown_key(cause)
        if isinstance(cause, ValidationError) and cause.full_key:
            return _wrong_type(cause)
    if isinstance(err, HydraException):
        return _with_hints(err)
    return None


def _with_hints(err: BaseException) -> str:
    """Hydra's message as one sentence, its numbered hints kept ("... add --multirun to your command line")."""
    lines = [line.strip().replace("\\'", "'") for line in str(err).strip().splitlines() if line.strip()]
    hints = [re.sub(r"^\d+\.\s*", "", line).rstrip(".") for line in lines[1:]]
    if not hints:
        return _first_line(err)
    return f"{lines[0].rstrip('.:')}: {'; '.join(hint[:1].lower() + hint[1:] for hint in hints)}."


def _first_line(err: BaseException) -> str:
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return line if line.endswith(".") else f"{line}."


def _unknown_choice(err: MissingConfigException) -> str:
    """``model=huge``: Hydra names the file it looked for (``model/huge``) and the group's options."""
    if not err.options or not err.missing_cfg_file or "/" not in err.missing_cfg_file:
        return _first_line(err)
    group, choice = err.missing_cfg_file.rsplit("/", 1)
    return f"{group}={choice} is not a choice of config group {group!r}; allowed: {', '.join(err.options)}."


def _unknown_key(err) -> str:
    parent = err.parent_node
    keys = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
    where = err.full_key.rsplit(".", 1)[0] if "." in err.full_key else None
    owner = f"a key of {where}" if where else "a top-level key"
    close = difflib.get_close_matches(str(err.key), keys, n=1)
    hint = f" (did you mean {(where + '.' if where else '') + close[0]}?)" if close else ""
    return f"{err.full_key} is not {owner}{hint}; allowed: {', '.join(keys)}."


def _wrong_type(err: ValidationError) -> str:
    expected = _expected_type(err.object_type, str(err.key))
    if expected is None:
        return f"{err.full_key}={err.value!r} is not valid: {_first_line(err.__cause__ or err)}"
    unset = f"; write {err.full_key}=null to unset it" if expected.endswith("or null") else ""
    return f"{err.full_key}={err.value!r} is not {expected} (its type in ditrun/config.py){unset}."


def _expected_type(schema, key: str) -> Optional[str]:
    if not dataclasses.is_dataclass(schema):
        return None
    hint = typing.get_type_hints(schema).get(key)
    args = typing.get_args(hint)
    if type(None) in args:
        inner = _type_words(next(a for a in args if a is not type(None)))
        return (inner.replace(" or ", ", ") + " or null") if inner else None
    return _type_words(hint)


def _type_words(hint) -> Optional[str]:
    if hint in _TYPE_WORDS:
        return _TYPE_WORDS[hint]
    if typing.get_origin(hint) is list:
        item = _type_words(typing.get_args(hint)[0]) if typing.get_args(hint) else None
        return f"a list [...] of {item.split(' ', 1)[1]}s" if item and item.startswith("a") else "a list [...]"
    return None


def check_composed(cfg) -> None:
    """What Hydra composes without complaint but ditrun cannot run with (see the module docstring)."""
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as err:
        raise UserError(f"{err.full_key} has no value (???); set it on the command line ({err.full_key}=...).")
    except InterpolationResolutionError as err:
        raise UserError(f"{err.full_key} cannot be resolved: {_first_line(err)}")
    extra = next(_unread_keys(cfg, ""), None)
    if extra is not None:
        raise UserError(
            f"{extra} is not a ditrun setting (added with +{extra}=...); ditrun would ignore it, so "
            "remove it (ditrun --cfg job lists every key)."
        )


def _unread_keys(node, prefix: str) -> Iterator[str]:
    """Keys under ``node`` that its schema (a dataclass of ditrun/config.py) does not have."""
    if isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _unread_keys(node._get_node(i), f"{prefix}[{i}]")
        return
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in node.keys():
        path = f"{prefix}.{key}" if prefix else str(key)
        if known is not None and key not in known:
            yield path
        else:
            yield from _unread_keys(node._get_node(key), path)

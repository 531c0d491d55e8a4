"""What ``ditrun --help`` says of the config groups, derived from the schema and the option files.

The help page itself is Hydra's help template, ``conf/hydra/help/ditrun.yaml``; its list of groups is the
``${ditrun.help_groups:}`` resolver registered here, so a group or option added to ``config.py`` or ``conf/``
shows up without a second list to keep.
"""

from __future__ import annotations

import dataclasses
import re
from importlib import resources

from omegaconf import OmegaConf

from ditrun.config import RunConfig

GROUPS_LEFT_OUT = ("testing",)
"""Groups of the schema that are for the tests, not for runs."""


def register_help() -> None:
    """The resolver the help template reads; Hydra resolves it only when ``--help`` prints the page."""
    OmegaConf.register_new_resolver("ditrun.help_groups", _groups_from_root, replace=True)


def _groups_from_root(*, _root_) -> str:
    choices = OmegaConf.select(_root_, "hydra.runtime.choices", default=None) or {}
    return config_groups(dict(choices)).replace("$", "$$")  # the page is a string.Template after this


def config_groups(choices: dict) -> str:
    """One line per group of ``RunConfig``: ``group=<options>`` (the chosen one first) where ``conf/<group>/``
    has option files, else ``group.<key>=...``, then the first phrase of the group's docstring."""
    lines = []
    for field in dataclasses.fields(RunConfig):
        schema = _schema(field)
        if dataclasses.is_dataclass(schema) and field.name not in GROUPS_LEFT_OUT:
            lines.append((_usage(field.name, choices.get(field.name)), _phrase(type(schema).__doc__ or "")))
    width = max(len(usage) for usage, _ in lines)
    return "\n".join(f"  {usage:<{width}}  {phrase}" for usage, phrase in lines)


def _schema(field: dataclasses.Field):
    """The field's default (a group's is its dataclass, made by its factory)."""
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def group_options(group: str) -> list[str]:
    """The option files of ``conf/<group>/`` (none for a group that is only keys)."""
    folder = resources.files("ditrun.conf") / group
    if not folder.is_dir():
        return []
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def _usage(group: str, chosen) -> str:
    options = group_options(group)
    if not options:
        return f"{group}.<key>=..."
    ordered = [chosen] + [o for o in options if o != chosen] if chosen in options else options
    return f"{group}={'|'.join(ordered)}"


def _phrase(docstring: str) -> str:
    """A docstring's first phrase: to its first colon or full stop, without parentheses or markup."""
    text = " ".join(docstring.split())
    text = re.sub(r"\s*\([^)]*\)", "", text).replace("``", "")
    return re.split(r"[:.](?:\s|$)", text, maxsplit=1)[0]

"""The prefill patterns, by name: the one place that lists them.

A new pattern is a new file of this folder holding a :class:`~.base.Pattern` subclass, plus one
line below. Head-config files, the ``default_pattern`` setting, the planner's budget checks,
both estimators and the offline search (a pattern with a ``search`` knob) find it here, and so
do the settings: a pattern with settings of its own (budgets the user sets for every head)
declares their model in its file (``Pattern.settings_model``), and
:mod:`vllm_sparse_backend.settings` makes it the group ``settings.patterns.<name>``, named as the
pattern is registered (its heads read that group).
"""

from __future__ import annotations

from .a_shape import AShape
from .base import Pattern
from .block_sparse import BlockSparse
from .dense import Dense
from .flex_prefill import FlexPrefill
from .vertical_slash import VerticalSlash

PATTERNS: dict[str, Pattern] = {p.name: p for p in (
    Dense(),
    AShape(),
    VerticalSlash(),
    BlockSparse(),
    FlexPrefill(),
)}


def check_pattern_name(name: str) -> str:
    """``name`` if a pattern is registered under it (the ``default_pattern`` setting, a head-config
    file's ``pattern``); ValueError naming the known ones otherwise."""
    if name not in PATTERNS:
        raise ValueError(f"unknown pattern '{name}' (known: {', '.join(PATTERNS)})")
    return name


def get_pattern(name: str) -> Pattern:
    """The registered pattern called ``name`` (KeyError naming the known ones otherwise)."""
    try:
        return PATTERNS[name]
    except KeyError:
        raise KeyError(f"unknown pattern {name!r} (known: {', '.join(PATTERNS)})") from None

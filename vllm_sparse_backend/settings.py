"""The settings as the plugin reads them: :class:`SparseSettings`, assembled from the groups of
:mod:`.config` and the settings each registered pattern declares in its own file
(``Pattern.settings_model``), one group ``patterns.<name>`` per pattern that has settings.

This module sits above the pattern registry, so that :mod:`.config` imports nothing of the
plugin (an import circle once ran through it). A new pattern with settings adds them in its file
and its line in ``prefill/patterns/__init__.py``; nothing here changes.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import Field, create_model

from .config import NameCheck, PatternGroups, Setting, SparseSettingsBase, nest_settings as _nest, read_settings
from .prefill.patterns import PATTERNS
from .prefill.patterns.base import Pattern


def pattern_settings_model(patterns: Mapping[str, Pattern]) -> type[PatternGroups]:
    """The model of ``settings.patterns``: one group per pattern of ``patterns`` that declares
    settings, named as it is registered, in the registry's order."""
    groups: dict[str, Any] = {
        name: (pattern.settings_model, Field(default_factory=pattern.settings_model,
                                             description=f"Settings of the {name} pattern's heads."))
        for name, pattern in patterns.items() if pattern.settings_model is not None}
    return create_model("PatternSettings", __base__=PatternGroups, **groups)


PatternSettings = pattern_settings_model(PATTERNS)


class SparseSettings(SparseSettingsBase):
    """Every setting of the plugin (:class:`.config.SparseSettingsBase`), the registered
    patterns' own under ``patterns``."""

    patterns: PatternSettings = Field(default_factory=PatternSettings, description=(
        "Each pattern's own parameters; a head-config entry overrides its per-head ones."))


# Every setting by its flat name (= its environment variable's suffix and its flat JSON key).
SETTINGS: Mapping[str, Setting] = SparseSettings.flat_settings


def nest_settings(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`.config.nest_settings` for :class:`SparseSettings`: each flat name moved to its
    nested place, a later layer winning."""
    return _nest(SETTINGS, *layers)


def load_settings(env: Mapping[str, str] | None = None,
                  names: Mapping[str, NameCheck] | None = None) -> SparseSettings:
    """:class:`SparseSettings` from ``VLLM_SPARSE_CONFIG`` and the ``VLLM_SPARSE_*`` variables
    (:func:`.config.read_settings`; ``names`` checks registered names, as
    ``startup.load_checked_settings`` passes them)."""
    return read_settings(SparseSettings, env, names)

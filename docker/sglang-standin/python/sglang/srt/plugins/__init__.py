"""Stand-in for SGLang's plugin loader: general plugins are the ``sglang.srt.plugins`` entry points,
restricted to the names in ``SGLANG_PLUGINS`` (comma-separated) when it is set. Each is imported and
called; one that fails is logged and skipped, as SGLang does."""

import logging
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

logger = logging.getLogger(__name__)

GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"


def discovered(group: str = GENERAL_PLUGINS_GROUP) -> list[str]:
    """The entry point names of ``group``, before any filter."""
    return sorted(ep.name for ep in entry_points(group=group))


def load_plugins_by_group(group: str = GENERAL_PLUGINS_GROUP) -> dict[str, Callable[[], Any]]:
    allowed = {x.strip() for x in os.environ.get("SGLANG_PLUGINS", "").split(",") if x.strip()} or None
    plugins: dict[str, Callable[[], Any]] = {}
    for ep in entry_points(group=group):
        if allowed is not None and ep.name not in allowed:
            logger.info("Skipping plugin %s (not in SGLANG_PLUGINS)", ep.name)
            continue
        try:
            plugins[ep.name] = ep.load()
            logger.info("Loaded plugin %s from group %s", ep.name, group)
        except Exception:
            logger.exception("Failed to load plugin %s from group %s", ep.name, group)
    return plugins


def load_plugins() -> list[str]:
    """Loads and calls the general plugins; returns the names that loaded."""
    loaded = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    for name, func in loaded.items():
        try:
            func()
        except Exception:
            logger.exception("Plugin %s failed", name)
    return sorted(loaded)

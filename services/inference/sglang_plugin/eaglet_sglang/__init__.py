"""eaglet's hidden-state dump plugin for SGLang.

Installed as a distribution with an entry point in SGLang's group ``sglang.srt.plugins``:
``load_plugins()`` calls ``register`` first thing in every scheduler process (and in the launcher,
where it does nothing further). No SGLang file is edited.

Environment of the server process: ``EAGLET_DUMP_DIR`` (required), ``EAGLET_DUMP_TIMEOUT_S``,
``EAGLET_AUX_LAYER_IDS``; see ``plugin.DumpSettings``. Launch flags: ``services/inference/sglang_launch.py``.
"""

import logging

from eaglet_sglang import versions
from eaglet_sglang.plugin import DumpPlugin, DumpSettings

log = logging.getLogger(__name__)

PLUGIN: DumpPlugin | None = None
"""This process's plugin once registered (``PLUGIN.flush()`` waits for pending dumps)."""


def register() -> None:
    """Entry point: records the AROUND hooks; SGLang's ``load_plugins`` applies them."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global PLUGIN
    if PLUGIN is not None:
        return
    PLUGIN = DumpPlugin(DumpSettings.from_env())
    HookRegistry.register(versions.FORWARD, PLUGIN.around_forward, HookType.AROUND)
    HookRegistry.register(versions.INIT_ATTENTION, PLUGIN.around_init_attention_backends, HookType.AROUND)
    HookRegistry.register(versions.LOGITS_FORWARD, PLUGIN.around_logits_forward, HookType.AROUND)
    log.info("eaglet dump plugin registered: dumps to %s", PLUGIN.settings.dump_dir)

"""The SGLang versions the plugin is built and tested against, and the names it hooks.

0.5.23 is the pinned release (pyproject's ``sglang-cpu`` group, the default image). 0.5.17 is the
newest release whose torch (2.11) matches the GPU machines we measure on. The contract test reads
both released wheels and fails when one of these names, signatures or fields moves.
"""

import re

SUPPORTED = ("0.5.23", "0.5.17")
DEFAULT = SUPPORTED[0]

# AROUND hooks (``sglang.srt.plugins.hook_registry``): target -> why.
FORWARD = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
INIT_ATTENTION = "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends"
LOGITS_FORWARD = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"

# Versions that capture the aux states themselves with a server flag (and hand the final-norm states
# beside them as ``LogitsProcessorOutput.last_hidden_states``). Older ones: the plugin enables capture.
CAPTURE_FLAG_SINCE = (0, 5, 23)

# The prefill CUDA graph backend (``cuda_graph_config.prefill.backend``) that captures the logits
# processor too; where the final states come from its input (before the capture flag) it is refused.
TC_PIECEWISE = "tc_piecewise"


def parse(version: str) -> tuple[int, int, int]:
    """``"0.5.23"`` -> ``(0, 5, 23)``; a suffix such as ``.post1`` or ``rc0`` is ignored."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"SGLang version {version!r} is not of the form X.Y.Z")
    return int(m[1]), int(m[2]), int(m[3])


def has_capture_flag(version: str) -> bool:
    """Whether ``--enable-return-aux-hidden-states`` exists (capture-only mode, no draft)."""
    return parse(version) >= CAPTURE_FLAG_SINCE

"""The GPUs handed from the inference service to the trainer: which the server held, which the trainer may take.

The inference supervisor records the GPUs its server could use when it releases them (``RunMeta.released_gpus``,
in the host's numbering, as ``nvidia-smi`` and ``CUDA_VISIBLE_DEVICES`` give them). The trainer service starts
``EAGLET_TRAIN_GPUS`` processes: a count (the first N GPUs) or a list (those GPUs, as ``CUDA_VISIBLE_DEVICES``).
Before it touches a GPU, each trainer process checks that the GPUs it would use are among the released ones.
"""

import shutil
import subprocess
from collections.abc import Mapping

SETTING = "EAGLET_TRAIN_GPUS"
HIDDEN = ("", "none", "void")  # NVIDIA_VISIBLE_DEVICES values that give a container no GPU


class GpuHandoffError(RuntimeError):
    """The trainer would use a GPU the inference service did not release, or more GPUs than it released."""


def parse_gpu_list(text: str) -> list[str]:
    """``"0,1, 2"`` -> ``["0", "1", "2"]``: GPU indexes or UUIDs, as ``CUDA_VISIBLE_DEVICES`` takes them."""
    return [g.strip() for g in text.split(",") if g.strip()]


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """The GPUs a process started with ``env`` may use: ``CUDA_VISIBLE_DEVICES`` if set, else the container's
    ``NVIDIA_VISIBLE_DEVICES`` list, else every GPU ``nvidia-smi`` lists; none where there is no GPU."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return parse_gpu_list(env["CUDA_VISIBLE_DEVICES"])
    container = env.get("NVIDIA_VISIBLE_DEVICES")
    if container is not None and container.strip().lower() in HIDDEN:
        return []
    if container is not None and container.strip().lower() != "all":
        return parse_gpu_list(container)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listed = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=30, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []  # a driver that does not answer: the server holds no GPU we could name
    return parse_gpu_list(listed.replace("\n", ","))


def cuda_devices() -> list[str]:
    """The GPUs torch sees, by index, for a process whose environment names none (an image without nvidia-smi).
    Counted through the driver: no CUDA context, no GPU memory taken."""
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def parse_train_gpus(spec: str) -> tuple[int, list[str] | None]:
    """``EAGLET_TRAIN_GPUS``: processes and, for a list, which GPUs. ``"4"`` -> (4, None); ``"0,2"`` ->
    (2, ["0", "2"]); ``"0"`` -> (0, None): one plain process (CPU). ValueError naming the setting otherwise."""
    text = spec.strip()
    if text.isdigit():
        return int(text), None
    gpus = parse_gpu_list(text)
    named = all(g.isdigit() or g.startswith(("GPU-", "MIG-")) for g in gpus)
    if not gpus or not named or len(set(gpus)) != len(gpus):
        raise ValueError(
            f"{SETTING}={spec!r}: give a number of GPUs (4) or a list of distinct GPUs by index or UUID (0,1,2,3)"
        )
    return len(gpus), gpus


def check_handoff(using: list[str], released: list[str], where: str) -> None:
    """GpuHandoffError unless every GPU in ``using`` is one of ``released``; ``where`` names the record read."""
    if len(using) > len(released):
        raise GpuHandoffError(
            f"the trainer would use {len(using)} GPUs ({','.join(using)}) but the inference service released "
            f"{len(released)} ({','.join(released)}, {where}); set {SETTING} to at most {len(released)}"
        )
    foreign = [g for g in using if g not in released]
    if foreign:
        raise GpuHandoffError(
            f"the trainer would use GPU(s) {','.join(foreign)}, which the inference service did not hold: it "
            f"released {','.join(released)} ({where}); set {SETTING} to some of those (e.g. "
            f"{SETTING}={','.join(released[: len(using)])})"
        )

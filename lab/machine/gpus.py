"""The NVIDIA GPUs of this host, counted without torch (the app asks before torch loads): from the
driver's listing in /proc, or from `nvidia-smi` where there is none (WSL2)."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from typing import Optional

NVIDIA_SMI = ("nvidia-smi", "/usr/lib/wsl/lib/nvidia-smi")  # on PATH, or where WSL2 keeps it


def visible_gpus(driver: str = "/proc/driver/nvidia/gpus", smi: tuple[str, ...] = NVIDIA_SMI) -> int:
    """NVIDIA GPUs this process may use, read without torch (the app asks before torch loads): the
    GPUs the driver lists in /proc (or, where there is no such folder, as on WSL2 whose driver lives
    in Windows, the GPUs `nvidia-smi -L` lists), limited by CUDA_VISIBLE_DEVICES when it is set."""
    try:
        present = len(os.listdir(driver))
    except OSError:
        present = listed_gpus(smi)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    wanted = [entry for entry in visible.split(",") if entry.strip()]
    listed = []
    for entry in wanted:  # CUDA stops at the first entry that is not a device
        if entry.strip().lstrip("-").isdigit() and int(entry) < 0:
            break
        listed.append(entry)
    return min(present, len(listed))


@functools.lru_cache(maxsize=None)
def listed_gpus(smi: tuple[str, ...] = NVIDIA_SMI) -> int:
    """How many GPUs `nvidia-smi -L` lists (0 if no nvidia-smi of `smi` runs); asked once per
    process, since the app counts GPUs on every rerun."""
    listing = nvidia_smi(["-L"], smi) or ""
    return sum(line.startswith("GPU ") for line in listing.splitlines())  # not the indented MIG lines


def nvidia_smi(args: list[str], smi: tuple[str, ...] = NVIDIA_SMI) -> Optional[str]:
    """What the first nvidia-smi of `smi` that exists prints with `args`, or None if none runs."""
    program = next((found for found in map(shutil.which, smi) if found), None)
    if program is None:
        return None
    try:
        done = subprocess.run([program, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None

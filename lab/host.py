"""A short description of the machine, printed beside every measurement so results can be compared."""
from __future__ import annotations

import platform

import torch

from engine.device import cpu_cores


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what platform reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> list[str]:
    """Names of the CUDA devices torch sees (empty on a CPU host)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def describe() -> dict:
    """CPU, core count, GPUs, torch version and intra-op threads, as a plain dict."""
    return {"cpu": cpu_model(), "cores": cpu_cores(), "gpus": gpus(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version()}


def summary(info: dict) -> str:
    """One line for headers: 'AMD EPYC, 2 cores, no GPU, torch 2.13.0+cpu'."""
    gpu = ", ".join(info["gpus"]) if info["gpus"] else "no GPU"
    return f"{info['cpu']}, {info['cores']} cores, {gpu}, torch {info['torch']}"

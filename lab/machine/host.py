"""A short description of the machine, printed beside every measurement so results can be compared,
and the device the notebooks run on."""
from __future__ import annotations

import ctypes
import gc
import os
import platform
import subprocess
from typing import Optional

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


def gpu_compute_modes() -> list[str]:
    """Each GPU's compute mode as nvidia-smi names it ("Default", "Exclusive_Process", "Prohibited");
    [] where nvidia-smi is missing or fails (a CPU host)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def exclusive_gpus(modes: Optional[list[str]] = None) -> bool:
    """Whether a GPU here serves one process at a time (EXCLUSIVE_PROCESS, as rented machines often
    are): two stage processes, or a process holding a CUDA context and its stage process, cannot
    share it."""
    return any(mode.lower().startswith("exclusive") for mode in (gpu_compute_modes() if modes is None else modes))


def stage_processes_refused(stages: int, gpus: int, parent_holds_context: bool, exclusive: bool) -> Optional[str]:
    """Why `stages` stage processes cannot run on `gpus` GPUs in this compute mode, or None if they can."""
    if not exclusive or (stages <= gpus and not parent_holds_context):
        return None
    clash = (f"{stages} stage processes on {gpus} GPU(s) would share one" if stages > gpus else
             "a stage process would meet this process's own CUDA context on its GPU")
    return (f"the GPUs are in EXCLUSIVE_PROCESS compute mode (nvidia-smi), where a GPU serves one process at a "
            f"time: {clash}. Run the stages as threads (transport \"threads\"), or set the mode to Default "
            f"(sudo nvidia-smi -c DEFAULT)")


def stage_processes_refused_here(stages: int, parent_holds_context: bool) -> Optional[str]:
    """`stage_processes_refused` for this host's GPUs and their compute mode (nvidia-smi)."""
    return stage_processes_refused(stages, torch.cuda.device_count(), parent_holds_context, exclusive_gpus())


def free_gpu_memory() -> None:
    """Give back what this process's CUDA allocator keeps cached (after the garbage that still holds
    a model or a failed step's tensors is gone), so that the next run, or a stage process, finds the
    GPU free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe() -> dict:
    """CPU, core count, GPUs, torch version and intra-op threads, as a plain dict."""
    return {"cpu": cpu_model(), "cores": cpu_cores(), "gpus": gpus(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version()}


def summary(info: dict) -> str:
    """One line for headers: 'AMD EPYC, 2 cores, no GPU, torch 2.13.0+cpu'."""
    gpu = ", ".join(info["gpus"]) if info["gpus"] else "no GPU"
    return f"{info['cpu']}, {info['cores']} cores, {gpu}, torch {info['torch']}"


DEVICE_VARIABLE = "GPIPE_LAB_DEVICE"


def lab_device() -> str:
    """Where the notebooks' stages run: GPIPE_LAB_DEVICE ("cpu", "cuda", or "auto" for a GPU when
    there is one); the CPU unless asked, so that results read the same on every host."""
    asked = os.environ.get(DEVICE_VARIABLE, "cpu")
    if asked not in ("cpu", "cuda", "auto"):
        raise ValueError(f"{DEVICE_VARIABLE}={asked!r}: expected cpu, cuda or auto")
    if asked == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{DEVICE_VARIABLE}=cuda, but this host has no CUDA GPU (torch.cuda.is_available() is False)")
    if asked == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return asked


def device_note(device: str) -> str:
    """One sentence saying where a notebook's stages run and how to change it."""
    found = gpus()
    if device == "cuda":
        shared = " (stages beyond that share them; cells that need a device per stage are replayed)"
        return (f"Stages run on **{len(found)} GPU(s)**: {', '.join(found)}{shared}. "
                f"Set {DEVICE_VARIABLE}=cpu for the CPU.")
    if found:
        return (f"Stages run on the **CPU**, {cpu_cores()} cores. This host has {len(found)} GPU(s) ({found[0]}): "
                f"set {DEVICE_VARIABLE}=cuda before starting Jupyter to use them.")
    return f"Stages run on the **CPU**, {cpu_cores()} cores (no GPU here)."


def keep_freed_cpu_memory() -> bool:
    """Opt-in host tuning: glibc's malloc keeps freed memory for reuse, so activations re-allocated
    every micro-batch stop costing page faults. Process-wide, Linux with glibc; returns whether it
    did. The engine never calls it: benchmarks and the lab do, alike for all they compare."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        settings = ((-3, 32 << 20), (-1, 1 << 30), (-2, 64 << 20))  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD
        return all(libc.mallopt(option, value) == 1 for option, value in settings)
    except (OSError, AttributeError):
        return False


def available_host_bytes() -> int:
    """The host memory free for new work now (MemAvailable), or all of it where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

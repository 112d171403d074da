"""How the processes that one process starts on this host meet, with no socket beyond loopback.

A TCPStore listens on every interface, and gloo binds to the address the host name resolves to: on
a café's network anyone could write into the Store. The lab's own groups (ProcessPool,
lab.studies.allreduce, lab.engine_time.peers) are on one host, so they need no network at all:

    meeting = Meeting()                               # a FileStore in a private folder (mode 0700)
    Children(..., [(meeting.path, rank, size) ...], env=meeting.env)
    join(path, rank, size)                            # in each child: gloo on loopback, via the file
    meeting.close()                                   # the folder goes (also if the parent exits)

Runs over several hosts (torchrun) keep torch.distributed's trust model (docs/processes.md, "Security").
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import weakref
from datetime import timedelta

from lab.machine.process_tree import orphaned

IFF_LOOPBACK = 0x8  # the interface flag Linux shows in /sys/class/net/NAME/flags
STORE_FOLDER = re.compile(r"gpipe-store-(\d+)-")  # a Meeting's folder: named after the process that made it


def loopback_interface(net: str = "/sys/class/net") -> str:
    """The name of this host's loopback interface ("lo" on Linux, "lo0" on macOS)."""
    try:
        for name in sorted(os.listdir(net)):
            with open(os.path.join(net, name, "flags")) as flags:
                if int(flags.read(), 16) & IFF_LOOPBACK:
                    return name
    except (OSError, ValueError):
        pass
    names = [name for _, name in socket.if_nameindex()]
    return "lo0" if "lo0" in names else "lo"


class Meeting:
    """Where local processes meet: a FileStore in a folder only this user can enter, removed by
    `close()` or at exit. `env` puts each member's gloo and NCCL on the loopback interface."""

    def __init__(self):
        sweep_orphan_folders()
        self.folder = tempfile.mkdtemp(prefix=f"gpipe-store-{os.getpid()}-")  # mode 0700
        self.path = os.path.join(self.folder, "store")
        self.env = dict.fromkeys(("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"), loopback_interface())
        # NCCL's watchdog would kill a stage process on a transfer error; the lane reports it instead
        self.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)

    def close(self) -> None:
        """Remove the store's folder (after the members have left)."""
        self._finalizer()


def sweep_orphan_folders(under: str = "") -> list[str]:
    """Remove the Meeting folders whose process is gone, and say which: a process killed outright
    (SIGKILL, the OOM killer) or ended by os._exit runs no finalizer. Every new Meeting sweeps first,
    so a lab restarted that way all day does not fill the temporary folder."""
    under = under or tempfile.gettempdir()
    removed = orphaned(under, STORE_FOLDER)
    for name in removed:
        shutil.rmtree(os.path.join(under, name), ignore_errors=True)
    return removed


def join(path: str, rank: int, size: int, timeout: float = 120.0, backend: str = "gloo") -> None:
    """In a member: the default process group of `backend`, met through the FileStore at `path`."""
    import torch.distributed as dist

    store = dist.FileStore(path, -1)
    store.set_timeout(timedelta(seconds=timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)

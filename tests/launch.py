"""Starting processes from tests: torchrun agents as two "nodes" on loopback, and finding what is left."""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(script_args, rdzv_id, timeout, done, env=None):
    """Two torchrun agents, one process each, meeting at a rendezvous on loopback: two "nodes". Runs
    until `done()` or both agents exit, then stops both (an agent whose peer died may otherwise sit in
    torchrun's exit barrier for minutes). Returns the agents' outputs."""
    port = free_port()
    agent = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, *script_args]
    logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
    nodes = [subprocess.Popen([sys.executable, *agent], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env={**os.environ, **(env or {})}) for log in logs]
    try:
        deadline = time.monotonic() + timeout
        while not done() and any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return outputs


def children(pid):
    """Pids of the live processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found

"""Launching the engine on several "machines" from one: two torchrun agents, one process each,
meeting at a c10d rendezvous on loopback, exactly as two hosts would over a network (lesson 9 runs
`python -m lab.train` this way and draws its trace; the tests check faults across nodes with it)."""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from lab.machine.loopback import loopback_interface

ROOT = Path(__file__).resolve().parents[2]
# Every agent and worker started here runs on this host: their gloo binds to the loopback interface
# (torchrun's own Store still listens on every interface while it runs: docs/processes.md, "Security").
ON_LOOPBACK = {"GLOO_SOCKET_IFNAME": loopback_interface()}


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (another process may take it before it is
    used: `two_nodes` tries again on a new one when that happened)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(script_args: list[str], port: int, rdzv_id: str, node_rank: Optional[int] = None,
                  per_node: int = 1, agent_args: tuple = ()) -> list[str]:
    """The torchrun command of one of two agents ("nodes") of `per_node` processes each."""
    rank = [] if node_rank is None else ["--node-rank", str(node_rank)]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node), *rank,
            *agent_args, "--local-addr", "127.0.0.1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, *script_args]


def two_nodes(script_args: list[str], rdzv_id: str, timeout: float, done: Callable[[], bool] = lambda: False,
              env: Optional[dict] = None, port: Optional[int] = None, per_node: int = 1,
              agent_args: tuple = ()) -> list[str]:
    """Run two torchrun agents of `per_node` processes each on this machine, meeting at `port` (a
    free one by default), until `done()` or both exit, at most `timeout` seconds; then stop both and
    everything they started (an agent whose peer died may otherwise sit in torchrun's exit barrier
    for minutes). Returns each agent's output. A free port found taken by the time the agents bind
    it (another process got it first) is replaced by a new one, up to three times."""
    for _ in range(3):
        outputs = _two_agents(script_args, rdzv_id, timeout, done, env, port or free_port(), per_node, agent_args)
        if port or not port_taken(outputs):
            return outputs
    return outputs


def port_taken(outputs: list[str]) -> bool:
    """Whether the agents found their rendezvous port taken (another process bound it first)."""
    return any("address already in use" in output.lower() for output in outputs)


def _two_agents(script_args: list[str], rdzv_id: str, timeout: float, done: Callable[[], bool],
                env: Optional[dict], port: int, per_node: int, agent_args: tuple) -> list[str]:
    """One try of `two_nodes` at `port`."""
    logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
    command = agent_command(script_args, port, rdzv_id, per_node=per_node, agent_args=agent_args)
    nodes = [subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env={**os.environ, **ON_LOOPBACK, **(env or {})}) for log in logs]
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


def train_on_two_nodes(train_args: list[str], timeout: float = 180.0) -> dict:
    """`python -m lab.train` on two torchrun agents of this machine (one stage each, c10d rendezvous
    on loopback): rank 0's trace of the last step (events, messages, losses), the agents' outputs,
    and the command each agent ran. Raises RuntimeError with the agents' output if no trace came."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        args = ["-m", "lab.train", *train_args, "--trace-out", str(path)]
        rdzv_id = "gpipe-lab-two-nodes"
        for _ in range(3):  # a new port if the free one was taken before the agents bound it
            port = free_port()
            outputs = two_nodes(args, rdzv_id, timeout, port=port)
            if path.exists() or not port_taken(outputs):
                break
        if not path.exists():
            raise RuntimeError("the two-node run wrote no trace; the agents printed:\n" + "\n".join(outputs))
        trace = json.loads(path.read_text())
    return {**trace, "outputs": outputs, "command": shlex.join(agent_command(args, port, rdzv_id))}


def train_on_this_host(train_args: list[str], processes: int, timeout: float = 180.0) -> dict:
    """`torchrun --standalone --nproc-per-node P -m lab.train ...` (a data-parallel mesh with
    `--data-parallel`): rank 0's trace of the last step (events, messages, the stages' all-reduces,
    losses), its output and the command. Raises RuntimeError with the output if no trace came."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
                   "-m", "lab.train", *train_args, "--trace-out", str(path)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **ON_LOOPBACK})
        if not path.exists():
            raise RuntimeError(f"the run wrote no trace (exit code {done.returncode}):\n{done.stdout}\n"
                               f"{done.stderr[-3000:]}")
        trace = json.loads(path.read_text())
    return {**trace, "output": done.stdout, "command": shlex.join(["torchrun", *command[3:-2]])}

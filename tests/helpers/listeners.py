"""Sockets in tests: which addresses a process and those it started listen on, read from /proc
(no `ss` or `lsof` needed)."""
import ipaddress
import os
import subprocess
import time
from pathlib import Path

from lab.machine.process_tree import descendants, kill

STATES = {"tcp": "0A", "tcp6": "0A", "udp": "07", "udp6": "07"}  # LISTEN; UDP: bound, unconnected


def _address(hexadecimal: str) -> ipaddress._BaseAddress:
    """An address as /proc/net/* writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hexadecimal)
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def listening(pids: list[int]) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket listening, or UDP socket bound, in the processes `pids`."""
    inodes = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:  # gone meanwhile
            continue
    found = set()
    for table, state in STATES.items():
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == state and fields[9] in inodes:
                address, port = fields[1].split(":")
                found.add((inodes[fields[9]], str(_address(address)), int(port, 16)))
    return found


def beyond_loopback(sockets) -> list[tuple[int, str, int]]:
    """Those of `sockets` (from `listening`) that another machine could reach."""
    def loopback(text: str) -> bool:
        address = ipaddress.ip_address(text)
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_loopback
    return sorted(s for s in sockets if not loopback(s[1]))


def run_watching_sockets(command: list[str], timeout: float, **options) -> tuple[subprocess.CompletedProcess, set]:
    """Run `command` to its end (at most `timeout` seconds, then it is killed), looking every 0.1 s
    at the sockets it and its descendants listen on; returns its result and every socket seen."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options)
    seen = set()
    deadline = time.monotonic() + timeout
    try:
        while process.poll() is None and time.monotonic() < deadline:
            seen |= listening([process.pid, *descendants(process.pid)])
            time.sleep(0.1)
    finally:
        if process.poll() is None:  # out of time: it and everything it started (rows run in sessions of their own)
            kill([*descendants(process.pid), process.pid])
        out, err = process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, out, err), seen

"""nbclient's NotebookClient with its channels polled in short slices.

Under nbclient, about one run in fifteen of a cell that draws into an ipywidgets Output widget
while the engine runs (notebook 03's sliders) took exactly the client's timeout: the kernel had
finished the cell in under 2 s (its own timestamps on the reply), and the client received the
reply only when its poll of the shell socket (zmq.asyncio) timed out, then went on without an
error: the client's asyncio poll missed the socket's wake-up (seen waiting there with the reply
already sent), not the lab's code. Polling in one-second slices bounds such a miss to a second.
"""
from __future__ import annotations

import time
from queue import Empty

from jupyter_core.utils import run_sync
from nbclient import NotebookClient

SLICE_SECONDS = 1.0


def _sliced(get_msg):
    async def get_msg_in_slices(timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = SLICE_SECONDS if deadline is None else min(SLICE_SECONDS, max(0.0, deadline - time.monotonic()))
            try:
                return await get_msg(timeout=left)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
    return get_msg_in_slices


class SlicedPollsClient(NotebookClient):
    """A NotebookClient whose shell and IOPub channels are polled one second at a time."""

    async def async_start_new_kernel_client(self):
        client = await super().async_start_new_kernel_client()
        for channel in (client.shell_channel, client.iopub_channel):
            channel.get_msg = _sliced(channel.get_msg)
        return client

    start_new_kernel_client = run_sync(async_start_new_kernel_client)  # what setup_kernel() calls

"""Schedules as torch.distributed.pipelining writes them, made by torch's own schedule classes on
stand-in stages (no process group: a schedule computes every rank's actions when it is made), in
both of its CSV forms: compute only, and compute and comms (its SEND/RECV lowering pass added)."""
import csv
import io

import torch
from torch.distributed.pipelining import schedules as torch_schedules

# torch's multi-stage schedules: each rank holds two of its "stages" (the lab's chunks), in a loop
# (rank r holds r and r + ranks) or a V (rank r holds r and 2 ranks - 1 - r)
SHAPES = {"ScheduleInterleaved1F1B": "loop", "ScheduleInterleavedZeroBubble": "loop",
          "ScheduleZBVZeroBubble": "V", "ScheduleDualPipeV": "V"}


class StandInStage:
    """What a torch schedule reads of a PipelineStage when it is made."""

    def __init__(self, index: int, count: int, ranks: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, count, ranks, 0
        self.is_first, self.is_last = index == 0, index == count - 1
        self.submod = torch.nn.Identity()


def exported(name: str, ranks: int, micro_batches: int, form: str = "compute_only") -> str:
    """The CSV text torch writes for schedule class `name` with `ranks` ranks of two stages each."""
    count = 2 * ranks
    mine = [0, count - 1] if SHAPES[name] == "V" else [0, ranks]
    schedule = getattr(torch_schedules, name)([StandInStage(i, count, ranks) for i in mine],
                                              n_microbatches=micro_batches)
    actions = {rank: [a for a in row if a is not None] for rank, row in schedule.pipeline_order.items()}
    if form == "compute_comms":
        actions = torch_schedules._add_send_recv(actions, schedule.stage_index_to_group_rank.__getitem__, count)
    elif form != "compute_only":
        raise ValueError(f"unknown form {form!r}; expected 'compute_only' or 'compute_comms'")
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in sorted(actions):
        writer.writerow([str(action) for action in actions[rank]])
    return out.getvalue()


def lowered(text: str) -> dict:
    """torch's SEND/RECV lowering pass run on a compute-only text (rank r's line holds its stage r):
    what torch's `_load_csv` does to a schedule before it runs it."""
    actions = {rank: [torch_schedules._Action.from_str(word) for word in line.split(",")]
               for rank, line in enumerate(text.strip().splitlines())}
    return torch_schedules._add_send_recv(actions, lambda stage: stage, len(actions))

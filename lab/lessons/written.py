"""Schedules written by hand (notebook 12): a 1F1B, a deadlock's fix and a split backward, judged
by the engine's own check and replay."""
from __future__ import annotations

from engine import schedule as schedules
from lab.lessons.feedback import SAYS, Feedback, attempted, exercise
from lab.schedules import writer as schedule_writer

WRITTEN = dict(stages=4, micro_batches=8, checkpoint="never")  # notebook 12's setting for its schedules
BROKEN = ("stage 0: F0 B0 F1 B1 F2 B2 F3 B3\n"   # notebook 12's deadlock, K=3, M=4, no recompute: stage 0
          "stage 1: F0 F1 B0 B1 F2 F3 B2 B3\n"   # tries to hold one micro-batch at a time
          "stage 2: F0 F1 B0 B1 F2 F3 B2 B3")


def _written(text, name: str, stages: int, micro_batches: int, checkpoint: str = "never"):
    """The schedule and the engine's report of a text answer; Feedback with the engine's words if it
    refuses it (or its text is not a schedule)."""
    attempted(text, name)
    text = _as_text(text)
    if not isinstance(text, str):
        raise Feedback(f"got {type(text).__name__} {text!r:.60}: {SAYS['schedule text']}")
    try:
        written = schedule_writer.parse(text)
    except ValueError as error:
        raise Feedback(f"{error}: {SAYS['schedule text']}") from None
    if len(written) != stages:
        raise Feedback(f"got {len(written)} lines of tasks for K={stages} stages: {SAYS['stage count']}")
    try:
        return written, schedules.check(written, micro_batches, checkpoint)
    except ValueError as error:
        family = "still deadlocks" if "deadlocks" in str(error) and name == "FIXED" else "engine refuses"
        raise Feedback(f"{error}: {SAYS[family]}") from None


def _as_text(answer):
    """A schedule given as the engine builds it (a Schedule, or one list of Tasks per stage, as
    engine.schedule.one_f_one_b returns) or as lists of task names per stage, in the text `parse`
    reads; anything else as it is."""
    if isinstance(answer, str) or not isinstance(answer, (list, tuple)) or not answer:
        return answer
    if not all(isinstance(stage, (list, tuple)) for stage in answer):
        return answer
    if all(isinstance(task, schedules.Task) for stage in answer for task in stage):
        return schedule_writer.format(answer)
    if all(isinstance(task, str) for stage in answer for task in stage):
        return "\n".join(f"stage {k}: {' '.join(stage)}" for k, stage in enumerate(answer))
    return answer


def _unit_cost(report) -> str:
    return f"unit-cost makespan {report.makespan:g}, bubble {report.bubble:.0%}, at most {report.held:g} held"


@exercise
def check_written_1f1b(text) -> str:
    """MY_1F1B: 1F1B for K=4, M=8, no recompute, as text, one line of tasks per stage."""
    written, report = _written(text, "MY_1F1B", WRITTEN["stages"], WRITTEN["micro_batches"])
    best = schedules.check(schedules.one_f_one_b(**WRITTEN), WRITTEN["micro_batches"], "never")
    if any(t.op == "W" for tasks in written for t in tasks):
        raise Feedback(SAYS["split in 1F1B"])
    if report.held > best.held:
        raise Feedback(f"{_unit_cost(report)}: {SAYS['holds too many']}")
    if report.makespan > best.makespan:
        backwards = [[t.micro for t in tasks if t.op == "B"] for tasks in written]
        if any(order != sorted(order) for order in backwards):
            k = next(k for k, order in enumerate(backwards) if order != sorted(order))
            raise Feedback(f"{_unit_cost(report)}, 1F1B's is {best.makespan:g}: stage {k} runs its backwards in the "
                           f"order {backwards[k]}: {SAYS['1F1B backward order']}")
        raise Feedback(f"{_unit_cost(report)}, 1F1B's is {best.makespan:g}: {SAYS['slower than 1F1B']}")
    return f"✓ legal, 1F1B's {_unit_cost(report)}"


@exercise
def check_deadlock_fix(text) -> str:
    """FIXED: the schedule BROKEN (K=3, M=4, no recompute) reordered so that it runs, as text."""
    attempted(text, "FIXED")
    text = _as_text(text)
    given = schedule_writer.parse(BROKEN)
    if isinstance(text, str):
        try:
            tasks = schedule_writer.parse(text)
        except ValueError:
            tasks = None
        if tasks is not None and len(tasks) == len(given) and any(sorted(a) != sorted(b) for a, b in zip(tasks, given)):
            k = next(k for k, (a, b) in enumerate(zip(tasks, given)) if sorted(a) != sorted(b))
            raise Feedback(f"stage {k}'s tasks are not BROKEN's stage {k}'s: {SAYS['not a reorder']}")
    _, report = _written(text, "FIXED", len(given), 4)
    return f"✓ it runs: {_unit_cost(report)}"


@exercise
def check_split_schedule(text) -> str:
    """MY_SPLIT: a schedule for K=4, M=8, no recompute, with W split off, as text."""
    written, report = _written(text, "MY_SPLIT", WRITTEN["stages"], WRITTEN["micro_batches"])
    best = schedules.check(schedules.one_f_one_b(**WRITTEN), WRITTEN["micro_batches"], "never")
    if not any(t.op == "W" for tasks in written for t in tasks):
        raise Feedback(f"{_unit_cost(report)}: {SAYS['no W']}")
    if report.held > best.held:
        raise Feedback(f"{_unit_cost(report)}: {SAYS['holds more than 1F1B']}")
    if report.bubble >= best.bubble - 1e-9:
        raise Feedback(f"{_unit_cost(report)}, 1F1B's bubble is {best.bubble:.0%}: {SAYS['bubble not smaller']}")
    return f"✓ {_unit_cost(report)}, against 1F1B's bubble of {best.bubble:.0%}"

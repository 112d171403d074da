"""Stages as processes: a plug-in to the thread engine, imported only by what uses it. In reading order:

1. runner.py: `RankRunner`, one rank's share of a call (GPipe(..., group=...) uses it);
2. transport.py: `ProcessTransport`, the thread transport's calls over a `Lane` (its protocol);
3. wire.py: the frames stage processes exchange (header, then payload), never pickle;
4. shm_lane.py and gloo_lane.py: the two lanes (shared memory on one host; gloo, NCCL for GPUs);
   turns.py: one order for a call's transfers, posted in it by every rank;
   works.py: every wait with a bound (works, Store keys, set-ups);
5. replicas.py: data parallelism, the all-reduce of a stage with its replicas.
"""

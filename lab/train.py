"""Train the zoo's character Transformer through the pipeline, printing loss and samples/s.

    python -m lab.train --steps 200 --stages 2                       # stages as threads of this process
    torchrun --standalone --nproc-per-node 2 -m lab.train --steps 200  # one process per stage
    torchrun --standalone --nproc-per-node 4 -m lab.train --stages 2 --data-parallel 2  # 2 pipelines as replicas
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 -m lab.train --steps 200     # one stage per machine

Under torchrun every rank runs this same script: it joins the group, builds the same model from the
same seed, keeps its own stage, and passes its inputs (first rank) or targets (last rank) to
`pipe.step`; rank 0 prints. Stages run on the CPU unless `--device cuda` asks for GPUs: then each
rank takes its GPU (cuda:LOCAL_RANK mod the GPUs it sees), the ranks tell each other which physical
GPU that is, and they talk over NCCL when none shares one (also when CUDA_VISIBLE_DEVICES shows each
rank a single GPU), else over gloo through host memory (NCCL refuses two ranks on one GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from engine import GPipe
from engine.distributed.transport import gpu_identity, one_gpu_each
from engine.schedule import SCHEDULES, check_checkpoint_mode, check_layout
from lab import zoo
from lab.machine.host import stage_processes_refused_here


def parser() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(prog="python -m lab.train", description=__doc__.splitlines()[0])
    options.add_argument("--steps", type=int, default=100)
    options.add_argument("--stages", type=int, default=None, help="K (threads: default 2; under torchrun: the "
                         "world's size over --data-parallel)")
    options.add_argument("--data-parallel", type=int, default=1, help="D pipelines training as replicas, each on "
                         "its shard of the batch (under torchrun: D x K processes, a ('dp', 'pp') device mesh)")
    options.add_argument("--micro-batches", type=int, default=8, help="M")
    options.add_argument("--batch", type=int, default=32, help="N, sequences per mini-batch (the global batch: "
                         "each replica takes N/D)")
    options.add_argument("--blocks", type=int, default=4, help="Transformer blocks (the model has blocks + 2 layers)")
    options.add_argument("--width", type=int, default=64)
    options.add_argument("--checkpoint", default="except_last", type=checkpoint_option,
                         help="always, except_last (default) or never; or one per stage, comma-separated "
                              "(always,never: only stage 0 recomputes)")
    options.add_argument("--schedule", default="gpipe", choices=list(SCHEDULES))
    options.add_argument("--virtual-stages", type=int, default=None,
                         help="chunks of layers per stage (v; default: the fewest the schedule accepts)")
    options.add_argument("--lr", type=float, default=3e-3)
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                         help="where the stages run: cpu (default), or cuda (threads: spread over the GPUs; "
                              "under torchrun: each rank on its own GPU)")
    options.add_argument("--log-every", type=int, default=10)
    options.add_argument("--trace-out", default=None, help="write the last step's trace (every stage's tasks "
                         "and messages) as JSON to this file, from rank 0")
    return options


def checkpoint_option(text: str):
    """--checkpoint's value: one mode, or one per stage separated by commas (a tuple); the built-in
    schedules this command runs have no R's of their own, so "as_written" is refused."""
    modes = tuple(text.split(",")) if "," in text else text
    try:
        mode = check_checkpoint_mode(modes)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if "as_written" in (mode if isinstance(mode, tuple) else (mode,)):
        raise argparse.ArgumentTypeError("'as_written' is for a schedule written by hand; lab.train runs built-in "
                                         "ones: use always, except_last or never (one, or one per stage)")
    return mode


def per_stage(mode) -> str:
    """A checkpoint mode as the command line writes it: "never", or "always,never" (one per stage)."""
    return ",".join(mode) if isinstance(mode, tuple) else mode


def backend_for(device: str, gpus: list[str]) -> str:
    """The backend of the pipeline's (and replicas') groups: NCCL when the stages are on GPUs and no
    two ranks share a physical GPU (`gpus`: each rank's GPU identity, so a rank that sees one GPU
    through CUDA_VISIBLE_DEVICES counts as its own), else gloo (CPU stages, or ranks sharing GPUs,
    which NCCL refuses; activations then cross through host memory)."""
    return "nccl" if device == "cuda" and one_gpu_each(gpus) else "gloo"


def gpus_of_ranks(device: torch.device) -> list[str]:
    """Every rank's physical GPU identity (engine.distributed.transport.gpu_identity), told over the
    world's gloo group."""
    told: list = [None] * dist.get_world_size()
    dist.all_gather_object(told, gpu_identity(device))
    return told


def launched_by_torchrun() -> bool:
    return dist.is_available() and dist.is_torchelastic_launched()


class Refused(Exception):
    """A setting this run cannot have: its one line, said by rank 0, and exit status 2."""


@dataclass
class Placement:
    """Where this process sits: its rank, the pipeline's stages, its groups, and how stages talk."""

    rank: int = 0
    stages: int = 2
    pipeline: object = None       # the pipeline's process group (None: stage threads)
    data_parallel: object = None  # the group of this stage's replicas
    replica: int = 0
    transport: str = ""


def check_arguments(args) -> None:
    """Raise Refused for what can be told before any process group exists."""
    for name in ("steps", "stages", "data_parallel", "micro_batches", "batch", "blocks", "width", "log_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise Refused(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise Refused("--device cuda, but this host has no CUDA GPU (torch.cuda.is_available() is False)")
    replicas = args.data_parallel
    if replicas > 1 and not launched_by_torchrun():
        raise Refused(f"--data-parallel {replicas} needs one process per stage and replica: torchrun "
                      f"--nproc-per-node {replicas * (args.stages or 2)} -m lab.train --stages {args.stages or 2} "
                      f"--data-parallel {replicas}")
    if args.batch % replicas:
        raise Refused(f"--batch {args.batch} cannot be split into {replicas} equal shards")


def place(args) -> Placement:
    """Join torchrun's group, if this process was launched by it, and make the pipeline's groups (a
    mesh of D replicas x K stages with --data-parallel); else K stage threads here."""
    if not launched_by_torchrun():
        stages = args.stages or 2
        return Placement(stages=stages, transport=f"threads: {stages} stage threads in this process")
    # a failed neighbour is reported by the pipe on every rank; NCCL's watchdog would kill the process first
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    dist.init_process_group("gloo")  # the world's group; the stages' groups get the backend chosen below
    backend = "gloo"
    if args.device == "cuda":
        refused = stage_processes_refused_here(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), False)
        if refused:
            raise Refused(refused)
        gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(gpu)
        backend = backend_for(args.device, gpus_of_ranks(gpu))
    replicas, world = args.data_parallel, dist.get_world_size()
    placed = Placement(rank=dist.get_rank(), stages=world // replicas)
    if world % replicas or (args.stages is not None and args.stages != placed.stages):
        raise Refused(f"{world} processes cannot be --data-parallel {replicas} pipelines"
                      + (f" of --stages {args.stages}" if args.stages else "") + "; start D x K processes")
    if replicas > 1:
        mesh = init_device_mesh(args.device, (replicas, placed.stages), mesh_dim_names=("dp", "pp"),
                                backend_override={"dp": backend, "pp": backend})
        placed.pipeline, placed.data_parallel = mesh.get_group("pp"), mesh.get_group("dp")
        placed.replica = dist.get_rank(placed.data_parallel)
    else:
        placed.pipeline = dist.group.WORLD if backend == "gloo" else dist.new_group(backend=backend)
    placed.transport = (f"processes: {replicas} pipeline(s) of {placed.stages} ranks over torch.distributed "
                        f"({dist.get_backend(placed.pipeline)})")
    return placed


def build_pipe(args, placed: Placement) -> GPipe:
    """The zoo's Transformer as this run's pipe, or Refused if K stages cannot hold it so."""
    layers = zoo.card("transformer").layer_count(args.blocks)
    if placed.stages > layers:
        raise Refused(f"{placed.stages} stages but the model has {layers} layers; use more --blocks")
    virtual = args.virtual_stages or SCHEDULES[args.schedule].fewest_chunks
    try:
        check_layout(args.schedule, placed.stages, args.micro_batches, virtual, layers, args.checkpoint)
    except ValueError as error:
        raise Refused(str(error)) from None
    return GPipe(zoo.build("transformer", args.blocks, args.width, args.seed), placed.stages,
                 chunks=args.micro_batches, checkpoint=args.checkpoint, schedule=args.schedule, seed=args.seed,
                 threads_per_stage=1, group=placed.pipeline, data_parallel=placed.data_parallel,
                 devices=args.device, virtual_stages=virtual)


def heading(args, placed: Placement, pipe: GPipe) -> str:
    """Rank 0's first line: the model, the pipeline's shape, and where its stages run."""
    virtual = pipe.virtual_stages
    return (f"# lab.train: char Transformer, {zoo.card('transformer').layer_count(args.blocks)} layers, width "
            f"{args.width}, batch {args.batch}, K={placed.stages}, M={args.micro_batches}, {args.schedule}"
            + (f" (v={virtual})" if virtual > 1 else "") + f", checkpoint {per_stage(args.checkpoint)}; "
            f"{placed.transport}; stages on {pipe.devices[0].type}")


def train(pipe: GPipe, args, placed: Placement) -> list[float]:
    """`args.steps` steps of Adam, this replica's shard of each mini-batch; the losses, printed as
    they come every --log-every steps with the samples per second."""
    task = zoo.get("transformer")
    optimizer = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    stage = dist.get_rank(placed.pipeline) if placed.pipeline is not None else 0
    # the inputs go to the rank of the first chunk, the targets to the last one's (ZB-V's is stage 0)
    first, last = (placed.pipeline is None or pipe.placement[chunk] == stage for chunk in (0, -1))
    window, losses = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        batch = task.batch(args.batch, args.width, args.seed + step)
        inputs, targets = (t.chunk(args.data_parallel)[placed.replica] for t in batch)
        optimizer.zero_grad()
        loss = pipe.step(inputs if first else None, targets if last else None, task.loss_fn)
        optimizer.step()
        losses.append(loss.item())
        if placed.rank == 0 and (step % args.log_every == 0 or step == args.steps):
            now = time.perf_counter()
            done = args.log_every if step % args.log_every == 0 else step % args.log_every
            print(f"step {step:5d}  loss {losses[-1]:.4f}  samples/s {done * args.batch / (now - window):8.1f}",
                  flush=True)
            window = now
    return losses


def report(pipe: GPipe, args, placed: Placement, losses: list[float], seconds: float) -> None:
    """Rank 0's last line (what each boundary carried per step), and --trace-out's file."""
    trace = pipe.trace
    crossed = ", ".join(f"{b['activations'] / 1e3:.1f} kB forward and {b['gradients'] / 1e3:.1f} kB back"
                        for b in trace.boundary_bytes) if trace.messages else "nothing (threads share memory)"
    reduced = "" if not trace.reductions else "; each stage all-reduced " + ", ".join(
        f"{r.bytes / 1e3:.1f} kB" for r in trace.reductions) + \
        f" of gradients with its {args.data_parallel - 1} replica(s)"
    print(f"# done: {args.steps} steps in {seconds:.1f} s; loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}; per step each boundary carried {crossed}{reduced}", flush=True)
    if args.trace_out:
        Path(args.trace_out).write_text(json.dumps(
            {"stages": trace.stages, "transport": trace.transport, "lane": trace.lane,
             "backend": dist.get_backend(placed.pipeline) if placed.pipeline is not None else None,
             "events": trace.to_records(), "messages": [asdict(m) for m in trace.messages],
             "reductions": [asdict(r) for r in trace.reductions], "losses": losses}))


def main(argv=None) -> int:
    """Train, printing as it goes; exit status 2 with one line for a setting it cannot run."""
    args = parser().parse_args(argv)
    placed = Placement()
    try:
        check_arguments(args)
        placed = place(args)
        pipe = build_pipe(args, placed)
    except Refused as refused:
        if placed.rank == 0:
            print(f"python -m lab.train: error: {refused}", file=sys.stderr)
        return 2
    if placed.rank == 0:
        print(heading(args, placed, pipe), flush=True)
    start = time.perf_counter()
    losses = train(pipe, args, placed)
    if placed.rank == 0:
        report(pipe, args, placed, losses, time.perf_counter() - start)
    pipe.close()
    if launched_by_torchrun():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where stages run, and the CUDA and NCCL logic that can be checked without a GPU: the device policy
(the same for every K, CPU unless asked), control messages kept on the host, the CUDA-to-host hop,
the order of receive and start mark, serial runs settling each task, NCCL channels that each carry
traffic one way, the GPU memory budget's arithmetic and the choices the lab makes from the host."""
import pytest
import torch
import torch.distributed as dist
from small_models import mlp
from torch import nn

from engine import GPipe
from engine import schedule as schedules
from engine.device import StageDevice, home_device, resolve_devices
from engine.distributed.gloo_lane import edge_groups, lands_on, neighbour_pairs
from lab.config import RunConfig
from lab.machine import host
from lab.machine.gpus import visible_gpus
from lab.studies import fit, speedup
from lab.studies.gpu_sizing import gpu_start
from lab.train import backend_for

LOSS = nn.CrossEntropyLoss()
CPU = torch.device("cpu")


@pytest.fixture
def pretend_gpus(monkeypatch):
    """This host as torch would see it with four GPUs (nothing may actually use them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_model_built_on_the_cpu_stays_there_for_every_k_even_with_gpus(pretend_gpus, batch, stages):
    model = mlp()
    pipe = GPipe(model, stages, chunks=2)
    assert pipe.devices == [CPU] * stages
    assert all(p.device == CPU for p in model.parameters())


def test_device_names_place_every_stage(pretend_gpus):
    assert resolve_devices("cpu", 3) == [CPU] * 3
    assert resolve_devices("cuda", 6) == [torch.device("cuda", k % 4) for k in range(6)]   # spread, then shared
    assert resolve_devices("cuda:2", 2) == [torch.device("cuda", 2)] * 2
    assert resolve_devices(["cpu", "cuda:1"], 2) == [CPU, torch.device("cuda", 1)]


def test_the_models_device_is_its_home_and_a_split_model_must_say_where():
    assert home_device(mlp()) == CPU
    assert home_device(nn.Sequential(nn.ReLU())) == CPU            # nothing to go by: the CPU
    split = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to("meta"))
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\).*devices="):
        home_device(split)
    with pytest.raises(ValueError, match="devices has 1 entries but there are 2 stages"):
        resolve_devices(["cpu"], 2)


def test_control_messages_stay_on_the_host_and_payloads_go_to_the_stage():
    gpu = torch.device("cuda", 1)
    assert lands_on("act", gpu) == gpu and lands_on("grad", gpu) == gpu
    assert all(lands_on(kind, gpu) == CPU for kind in ("end", "done", "bye"))


def test_a_hop_from_a_gpu_stage_to_the_host_needs_no_cuda_event(monkeypatch):
    """A copy to the host is complete when .to() returns; asking CUDA for a stream of the CPU crashed."""
    sender = StageDevice(CPU, threads=1)
    sender.is_cuda = True   # the sender's side as on a GPU stage; the destination is the host

    def no_cuda(*args, **kwargs):
        raise AssertionError("a hop to the host must not touch CUDA streams or events")
    monkeypatch.setattr(torch.cuda, "Event", no_cuda)
    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    value = (torch.ones(2), None)
    moved, ready = sender.send(value, CPU)
    assert ready is None and torch.equal(moved[0], value[0]) and moved[1] is None


@pytest.mark.parametrize("serial", [False, True])
def test_a_task_is_marked_started_after_its_input_is_received_and_serial_runs_settle_each(monkeypatch, batch,
                                                                                          serial):
    calls = []
    for name in ("receive", "mark", "settle"):
        original = getattr(StageDevice, name)
        monkeypatch.setattr(StageDevice, name,
                            lambda self, *a, _o=original, _n=name: (calls.append(_n), _o(self, *a))[1])
    x, y = batch
    pipe = GPipe(mlp(), 2, chunks=3, threads_per_stage=1)
    pipe.step(x, y, LOSS, serial=serial)
    tasks = sum(len(tasks) for tasks in pipe.task_lists(3))
    received = [i for i, name in enumerate(calls) if name == "receive"]
    assert len(received) == 3 + 3  # stage 1's forwards and stage 0's backwards
    if serial:  # one thread: each receive is followed at once by its task's start mark
        assert all(calls[i + 1] == "mark" for i in received)
    assert calls.count("settle") == (tasks if serial else 0) + 4  # and each of the 2 stages at the call's start and end


@pytest.mark.parametrize("name", list(schedules.SCHEDULES))
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_every_payload_travels_the_nccl_group_of_its_two_ranks(name, stages):
    """Each message a schedule sends between two ranks has their group (both ways: the turns keep
    the two from crossing, tests/engine/distributed/test_turns.py), and no pair has a second one."""
    kind = schedules.SCHEDULES[name]
    plan = schedules.Schedule(kind(stages, 2 * stages, "never", kind.fewest_chunks))
    chunks, owner = len(plan.placement), plan.placement
    pairs = neighbour_pairs(stages, plan.placement)
    assert len(pairs) == len(set(pairs)) and all(a < b for a, b in pairs)
    for tasks in plan:
        for task in tasks:
            target = task.chunk + 1 if task.op == "F" else task.chunk - 1 if task.op == "B" else None
            if target is None or not 0 <= target < chunks:
                continue
            source, destination = owner[task.chunk], owner[target]
            if source != destination:
                assert (min(source, destination), max(source, destination)) in pairs


def test_every_rank_makes_every_pipelines_nccl_groups_in_one_order(monkeypatch):
    """Two pipelines of two stages on ranks {0, 1} and {2, 3}: torch.distributed needs every rank of
    the world to make each group, in the same order; each rank keeps the one with its neighbour."""
    made: dict[int, list] = {}
    for me in range(4):
        monkeypatch.setattr(dist, "get_rank", lambda me=me: me)
        monkeypatch.setattr(dist, "new_group", lambda ranks, me=me, **options: made.setdefault(me, []).append(
            (tuple(ranks), options["backend"])) or tuple(sorted(ranks)))
        mine = edge_groups([(0, 1), (2, 3)], [0, 1] if me < 2 else [2, 3], 2, (0, 1))
        peer = me ^ 1   # its neighbour in its pipeline, rank 0 or 1 of each two-rank group
        assert set(mine) == {peer % 2}, "keyed by the neighbour's rank in the pipeline"
        assert all(group == tuple(sorted([me, peer])) and local == sorted([me, peer]).index(peer)
                   for group, local in mine.values())
    assert made[0] == made[1] == made[2] == made[3] == [((0, 1), "nccl"), ((2, 3), "nccl")]


def test_the_gpu_memory_budget_counts_what_the_step_allocated():
    gib = 2 ** 30
    assert fit.cuda_cap_fraction(gib, baseline=gib, total=80 * gib) == pytest.approx((1 + 1.25) / 80)
    assert fit.cuda_cap_fraction(80 * gib, baseline=0, total=80 * gib) == 1.0
    assert fit.step_peak([5 * gib, 3 * gib], [4 * gib, 0]) == 3 * gib   # GPU 1 allocated most for the step
    with pytest.raises(RuntimeError, match="baseline held memory freed during the step"):
        fit.step_peak([5 * gib, 3 * gib], [4 * gib, 3 * gib], state_bytes=2 * gib)  # grew 1 GiB, state alone 2
    base, budget, most = fit.table1_setting("cuda")
    assert budget >= gib and base.width >= 256 and most >= 1024
    assert fit.table1_setting("cuda", quick=True)[1] >= 256 * 2 ** 20   # far above any workspace
    assert fit.table1_setting("cpu")[1] == 24 * 2 ** 20


def test_the_libraries_workspaces_per_stage_stream_are_not_counted_against_the_budget():
    """Every stage stream gets its own cuBLAS workspace (32 MiB on a recent GPU, an eighth of the quick
    budget): measured once per GPU and held out of the step's peak, once per stage on that GPU."""
    mib, measured = 2 ** 20, []
    per_stream = lambda gpu: measured.append(gpu) or (32 if gpu == 0 else 8) * mib
    assert fit.library_workspaces(["cuda:0", "cuda:1", "cuda:0", "cuda"], per_stream) == {0: 96 * mib, 1: 8 * mib}
    assert measured == [0, 1], "one measurement per GPU"
    assert fit.step_peak([200 * mib], [20 * mib + 96 * mib]) == 84 * mib


def test_speedup_tables_are_sized_for_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # on a GPU host the sizing takes minutes
    cpu, gpu = speedup.table_setting("cpu"), speedup.table_setting("cuda")  # no GPU to size on: the GPU's start
    assert cpu.width == 128 and cpu.layers == 8 and gpu == gpu_start() and gpu.device == "cuda" and gpu.context == 128


def test_train_picks_nccl_only_when_no_two_ranks_share_a_physical_gpu():
    one_each = ["GPU-0", "GPU-1"]   # identities (UUIDs): one per physical GPU
    assert backend_for("cuda", one_each) == "nccl"
    # CUDA_VISIBLE_DEVICES shows each rank one GPU (cuda:0 on both): still a GPU of its own each
    assert backend_for("cuda", ["GPU-0", "GPU-5"]) == "nccl"
    assert backend_for("cuda", ["GPU-0", "GPU-0"]) == "gloo"   # NCCL refuses
    # without a UUID, the identity is the machine's and the PCI location: one location on two hosts is two GPUs
    assert backend_for("cuda", ["host-a/0:1:0", "host-b/0:1:0"]) == "nccl"
    assert backend_for("cpu", one_each) == "gloo"


def test_gpus_are_counted_without_torch_as_the_app_needs(tmp_path, monkeypatch):
    for name in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (tmp_path / name).mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus(str(tmp_path)) == 3
    assert visible_gpus(str(tmp_path / "absent"), smi=(str(tmp_path / "no-smi"),)) == 0   # not this host's nvidia-smi
    for visible, count in (("1", 1), ("0,2", 2), ("", 0), ("-1", 0), ("0,-1,1", 1), ("0,1,2,3,4", 3)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert visible_gpus(str(tmp_path)) == count, visible


def test_without_the_drivers_folder_gpus_are_counted_by_nvidia_smi_as_on_wsl2(tmp_path, monkeypatch):
    """WSL2 has no /proc/driver/nvidia/gpus: nvidia-smi -L (on PATH or in /usr/lib/wsl/lib) counts
    them, its indented MIG lines not counted, and CUDA_VISIBLE_DEVICES still limits them."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA RTX 4090 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA A100 (UUID: GPU-b)'\n"
                   "echo '  MIG 1g.10gb     Device  0: (UUID: MIG-c)'\n")
    smi.chmod(0o755)
    absent = str(tmp_path / "absent")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus(absent, smi=(str(tmp_path / "no-smi"), str(smi))) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert visible_gpus(absent, smi=(str(smi),)) == 1
    assert visible_gpus(absent, smi=(str(tmp_path / "no-smi"),)) == 0


def test_a_pools_stage_takes_the_gpu_of_its_pool_rank_not_an_inherited_local_rank(pretend_gpus, monkeypatch):
    """A pool started from a torchrun worker: its children inherit LOCAL_RANK=3, yet stage k is on
    cuda:k mod the GPUs (four, faked), as the pool's own ranks say."""
    from lab.processes import server as pool
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(pool, "join", lambda *args, **kwargs: None)   # no group: only where the stage goes
    selected = []
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    placed = [pool.StageServer(rank, 6, "", 1, False, "cuda").device for rank in range(6)]
    assert placed == selected == [torch.device("cuda", k % 4) for k in range(6)]  # each selects its own GPU
    assert pool.StageServer(1, 2, "", 1, False, "cpu").device == "cpu"


@pytest.mark.parametrize("local_rank,expected", [(None, 3), ("2", 2)])
def test_without_local_rank_a_replicas_stage_takes_the_gpu_of_its_world_rank(pretend_gpus, monkeypatch,
                                                                             local_rank, expected):
    """Replica 1's stage 1 of pipelines of K=2 is world rank 3: cuda:3, not cuda:1 beside replica 0's
    stage 1; under torchrun, LOCAL_RANK decides. That GPU becomes the process's current device (else
    NCCL, and the user's own CUDA calls, would guess cuda:0); a CPU stage sets none."""
    from engine.distributed import runner
    from engine.distributed.transport import Ranks
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(runner, "check_group", lambda group, stages: Ranks(1, 2))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert runner.rank_and_device(None, 2, "cuda", None) == (1, torch.device("cuda", expected))
    assert runner.rank_and_device(None, 2, "cpu", None) == (1, CPU) and current == [torch.device("cuda", expected)]


def test_the_notebooks_device_is_the_cpu_unless_asked(monkeypatch):
    monkeypatch.delenv(host.DEVICE_VARIABLE, raising=False)
    assert host.lab_device() == "cpu"
    monkeypatch.setenv(host.DEVICE_VARIABLE, "auto")
    assert host.lab_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv(host.DEVICE_VARIABLE, "tpu")
    with pytest.raises(ValueError, match="GPIPE_LAB_DEVICE='tpu': expected cpu, cuda or auto"):
        host.lab_device()
    assert "CPU" in host.device_note("cpu")


def test_the_lab_runs_where_its_configuration_says(pretend_gpus):
    from lab.runs.experiments import devices_for
    assert devices_for(RunConfig(stages=3)) == ["cpu"] * 3


def test_cpu_cores_heeds_a_cgroup_quota(monkeypatch):
    """A container limited to 2 CPUs on a 16-core host runs 2 stages at once, not 16."""
    import io

    from engine import device
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: set(range(16)))
    for quota, cores in (("200000 100000\n", 2), ("150000 100000", 1), ("50000 100000", 1), ("max 100000", 16)):
        monkeypatch.setattr(device, "open", lambda path, text=quota: io.StringIO(text), raising=False)
        assert device.cpu_cores() == cores, quota

    def no_cgroup(path):
        raise FileNotFoundError(path)
    monkeypatch.setattr(device, "open", no_cgroup, raising=False)
    assert device.cpu_cores() == 16


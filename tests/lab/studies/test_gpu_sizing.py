"""The GPU table's sizing by arithmetic on measured rates, judged on fake GPUs whose costs are known:
the size it picks meets the target on every stage and fits every cell, on paper, for a T4-like, an
H100-like and an H200-like GPU, one and eight of each; and its probes are small."""
import pytest
import torch

from lab.config import RunConfig
from lab.runs.experiments import block_balance
from lab.studies import gpu_sizing
from lab.studies.gpu_sizing import GPU_TARGET, Probe, shape_of

GIB = 2 ** 30


class FakeGpu:
    """A GPU and host whose costs follow known formulas: FLOPs at `tflops`, at half of it on 128 tokens;
    a host that takes fixed seconds per stage and per block to issue F, R and B; a block that holds
    68 bytes per channel per token for its backward (float32), a stage 4 per channel and its logits."""

    def __init__(self, name: str, memory_gib: float, tflops: float):
        self.name, self.memory, self.flops = name, memory_gib * GIB, tflops * 1e12
        self.host_per_stage, self.host_per_block = 3 * 400e-6, 3 * 150e-6
        self.probed: list[RunConfig] = []

    def stage_bytes_per_token(self, width: int, blocks: int) -> float:
        return blocks * 68 * width + 4 * width + 3 * 4 * 65

    def probe(self, config: RunConfig) -> Probe:
        self.probed.append(config)
        shape = shape_of(config.width, config.context, config.batch, config.blocks)
        tokens = config.batch * config.context
        gpu = 4 * config.blocks * shape.forward_flops_per_token() * tokens / (self.flops * tokens / (tokens + 128))
        return Probe(gpu + 30e-6, self.host_per_stage + config.blocks * self.host_per_block,
                     tokens * self.stage_bytes_per_token(config.width, config.blocks), tokens)

    def truth(self, config: RunConfig, gpus: int) -> dict:
        """(K, M) -> the busiest GPU's bytes by the fake's own formulas, each stage's layers counted."""
        shape = shape_of(config.width, config.context, config.batch, config.blocks)
        layers = [shape.extra_parameters[0]] + [shape.block_parameters] * config.blocks + [shape.extra_parameters[1]]
        model = torch.nn.Sequential(torch.nn.Identity(), *[torch.nn.Tanh() for _ in range(config.blocks)],
                                    torch.nn.Identity())
        cells = {}
        for k in (1, 2, 4, 8):
            for m in (1, 4, 32):
                held, graphs, first = [0.0] * min(k, gpus), [[] for _ in range(gpus)], 0
                for stage, size in enumerate(block_balance(model, k)):
                    chunk = range(first, first + size)
                    blocks = sum(1 for layer in chunk if 0 < layer < len(layers) - 1)
                    tokens = -(-config.batch // m) * config.context
                    kept = config.batch * config.context * (8 if first == 0 else 4 * config.width)
                    held[stage % gpus] += 8 * sum(layers[i] for i in chunk) + kept
                    graphs[stage % gpus].append(tokens * self.stage_bytes_per_token(config.width, blocks))
                    first += size
                cells[(k, m)] = max(h + sum(sorted(g)[-m:]) for h, g in zip(held, graphs))   # one graph per micro-batch
        return cells


# A T4's 15 GiB cannot meet the target with this host: the K=1, M=1 cell recomputes every block on
# the whole batch at once (16 blocks x 68 x width bytes per token), while 10x at K=8, M=32 needs about
# 8e9 / width^2 x (1 + 2.7 / blocks per stage) x 32 tokens in the batch: 17 GiB at width 2048, more
# at any other. It gets the best size that fits, and says the target is not met.
GPUS = [(FakeGpu("T4-like", 15, 8.1), False), (FakeGpu("H100-like", 79, 51), True),
        (FakeGpu("H200-like", 139, 60), True)]


@pytest.mark.parametrize("gpu, meets", GPUS, ids=lambda case: getattr(case, "name", ""))
@pytest.mark.parametrize("count", [1, 8])
def test_the_chosen_size_meets_the_target_on_every_stage_and_fits_every_cell(gpu, meets, count):
    gpu.probed.clear()
    start = gpu_sizing.gpu_start()
    sizing = gpu_sizing.sized(start, gpu.probe, [gpu.memory] * count, host_bytes=lambda: 512 * GIB)
    chosen = sizing.config
    assert len(sizing.ratios) == 8 and sizing.met == meets == (min(sizing.ratios) >= GPU_TARGET), sizing.describe()
    if not meets:
        assert "NOT met: the best that fits" in sizing.describe() and min(sizing.ratios) > 3
    cells = gpu.truth(chosen, count)
    assert len(cells) == 12 and max(cells.values()) <= gpu.memory, (cells, sizing.describe())
    shape = shape_of(chosen.width, chosen.context, chosen.batch, chosen.blocks)
    for n, ratio in zip(shape.stage_blocks(8), sizing.ratios):   # each stage's ratio is its own composition's
        probe = gpu.probe(gpu_sizing._probe_config(chosen, n, shape.tokens(32)))
        assert ratio == pytest.approx(probe.gpu / probe.host)
    # probes are one stage of a few blocks, never the whole batch nor the table's depth
    assert all(p.stages == 1 and p.micro_batches == 1 and p.blocks <= 4 for p in gpu.probed)
    assert all(p.batch * p.context <= max(gpu_sizing.PROBE_TOKENS, shape.tokens(32)) for p in gpu.probed)
    said = sizing.describe()
    assert f"context {chosen.context}" in said and f"{shape.tokens(32)} tokens per micro-batch" in said
    assert "GFLOP per F task" in said and "TFLOP/s per stage" in said and "TF32 matrix products off" in said
    assert len(sizing.tflops) == 8 and all(0 < t <= gpu.flops / 1e12 for t in sizing.tflops)


def test_a_check_under_the_target_is_said_and_scales_the_predictions_after_it():
    """The rates are probed on 4096 tokens; a GPU twice as quick per token on 512 or fewer makes the
    arithmetic pass a size that its check, at the size's own tokens, measures under the target. The
    sizing says so, and scales what it predicts of the sizes after: it checks no other size of those
    tokens, which would miss alike, and ends at the best it measured, saying the target is not met."""
    gpu = FakeGpu("quick on small tasks", 139, 60)
    original = gpu.probe

    def quicker_on_few_tokens(config):
        found = original(config)
        return found._replace(gpu=found.gpu * (0.5 if config.batch * config.context <= 512 else 1.0))
    sizing = gpu_sizing.sized(gpu_sizing.gpu_start(), quicker_on_few_tokens, [gpu.memory], host_bytes=lambda: 512 * GIB)
    checks = [line for line in sizing.tried if "measured" in line]
    assert checks == ["width 4096, context 128, batch 128, 16 blocks: predicted 13.5x, measured 8.2x"]
    assert not sizing.met and min(sizing.ratios) == pytest.approx(8.2, abs=0.05)


def test_where_nothing_meets_the_target_the_best_that_fits_is_said_so():
    gpu = FakeGpu("a slow GPU", 15, 0.5)
    gpu.host_per_block = 3 * 5e-3
    sizing = gpu_sizing.sized(gpu_sizing.gpu_start(quick=True), gpu.probe, [gpu.memory], quick=True,
                              host_bytes=lambda: 512 * GIB)
    assert not sizing.met and "NOT met: the best that fits" in sizing.describe()
    assert max(gpu.truth(sizing.config, 1).values()) <= gpu.memory
    with pytest.raises(RuntimeError, match="no size of the GPU table's model fits this host's GPUs"):
        gpu_sizing.sized(gpu_sizing.gpu_start(), gpu.probe, [1 * GIB], host_bytes=lambda: 512 * GIB)


def test_a_size_the_host_cannot_build_is_not_weighed():
    """Stage processes each build the whole model on the host first: a host of 64 GiB rules out
    the sizes whose nine copies it could not hold, and the sizing says how many."""
    gpu = FakeGpu("H200-like", 139, 60)
    start = gpu_sizing.gpu_start(transport="processes")
    sizing = gpu_sizing.sized(start, gpu.probe, [gpu.memory] * 8, host_bytes=lambda: 64 * GIB)
    assert gpu_sizing.host_bytes_to_build(sizing.config, 8) <= gpu_sizing.HOST_SHARE * 64 * GIB
    threads = gpu_sizing.host_bytes_to_build(start.but(transport="threads"), 8)
    assert gpu_sizing.host_bytes_to_build(start, 8) == 9 * threads
    assert "not the host's memory" in sizing.tried[-1]


def test_the_probe_runs_one_stage_here_and_the_sizing_runs_end_to_end_on_a_cpu(monkeypatch):
    """The real probe on this host's CPU (a GPU host runs the same code on its GPU): positive times
    and a peak that grows with a block; the sizing through it, on a tiny candidate list, says that a
    CPU is not launch-bound nor GPU-bound: its ratio is 1."""
    config = RunConfig(model="transformer", blocks=1, width=32, context=16, batch=4, stages=1, micro_batches=1,
                       checkpoint="always")
    one, two = gpu_sizing.probe_on_gpu(config), gpu_sizing.probe_on_gpu(config.but(blocks=2))
    assert one.tokens == 64 and 0 < one.gpu and 0 < one.host and 0 < one.peak_bytes < two.peak_bytes
    rates = gpu_sizing.rates_from(one, two)
    assert rates.block_per_token > 0   # counted by the ledger; the times' difference is the host's, not judged
    for name, value in (("WIDTHS", (32,)), ("CONTEXTS", (16,)), ("BATCHES", (32,)), ("DEPTHS_QUICK", (14,))):
        monkeypatch.setattr(gpu_sizing, name, value)
    sizing = gpu_sizing.sized(gpu_sizing.gpu_start(quick=True).but(device="cpu"), gpu_sizing.probe_on_gpu,
                              [8 * GIB], quick=True)
    assert not sizing.met and all(r == pytest.approx(1.0) for r in sizing.ratios)
    assert (sizing.config.width, sizing.config.context, sizing.config.blocks) == (32, 16, 14)



def test_a_stages_tflops_are_its_blocks_flops_over_its_tasks_seconds():
    config = gpu_sizing.gpu_start().but(stages=2)    # 16 blocks: 8 a stage
    shape = shape_of(config.width, config.context, config.batch, config.blocks)
    events = [dict(stage=0, start=0.0, end=0.5), dict(stage=0, start=1.0, end=1.5), dict(stage=1, start=0.0, end=2.0)]
    work = 4 * 8 * shape.forward_flops_per_token() * config.batch * config.context
    assert gpu_sizing.stage_tflops(config, events) == pytest.approx((work / 1e12, work / 2e12))


def test_each_stage_process_adds_its_context_to_its_gpu_in_every_cell():
    """Stage processes run the cells whose K the GPUs can hold, one per GPU, each with a CUDA context
    of its own, and the shared pool keeps them up while the other cells run as threads."""
    shape = shape_of(1024, 128, 32, 16)
    rates = gpu_sizing.Rates(1e-7, 1e-4, 1e-3, 1e4, 1e3)
    plain = gpu_sizing.peak_bytes(shape, rates, 4)
    with_contexts = gpu_sizing.peak_bytes(shape, rates, 4, per_process=GIB)
    assert {cell: with_contexts[cell] - plain[cell] for cell in plain} == {
        (k, m): GIB for k in (1, 2, 4, 8) for m in (1, 4, 32)}


def test_the_header_says_whether_float32_matrix_products_use_tf32_by_either_setting():
    import torch
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        assert "TF32 matrix products off" in gpu_sizing.precision_said("float32")
        matmul.fp32_precision = "tf32"
        assert "TF32 matrix products on" in gpu_sizing.precision_said("float32")
        matmul.fp32_precision = "ieee"
        assert "TF32 matrix products off" in gpu_sizing.precision_said("float32")
        assert "bfloat16 autocast" in gpu_sizing.precision_said("bf16")
    finally:
        matmul.fp32_precision = before

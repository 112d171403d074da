"""Data shared by the engine tests (their small models: tests/helpers/small_models.py), and how the suite
runs in parallel."""
import os
import tempfile

import pytest

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # Workers share the host's cores, so polling while waiting takes a core another worker's test
    # needs; every process the tests start inherits these. A torch thread waiting at the end of a
    # parallel region sleeps at once (OpenMP reads this when torch loads). A stage process that has
    # a core of its own polls its lane before it sleeps (shm_lane.spin_for counts the host's cores);
    # beside another worker's test no core is its own. The tests of spinning itself set their own.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GPIPE_SPIN_SECONDS", "0")

import torch  # noqa: E402  (after OMP_WAIT_POLICY, which OpenMP reads when torch loads it)

from engine.device import cpu_cores  # noqa: E402

# Tests that share a costly module fixture run on one pytest-xdist worker (--dist loadgroup), so that
# it starts once: the browser tests' server, the process tests' pools, the breakdown's records, the
# replicas' torchrun mesh.
SHARED_FIXTURES = {"app_server": "browser", "pools": "pools", "quick_records": "breakdown",
                   "replica_mesh": "replica_mesh"}


@pytest.fixture(scope="session", autouse=True)
def temporary_folder_of_the_run(tmp_path_factory):
    """The processes the tests start write their temporary files (torchrun's torchelastic_* folders,
    which a killed agent leaves behind) under pytest's own folder for the run, which pytest prunes;
    this process's Meetings too, so that they sweep where the children's were made."""
    os.environ["TMPDIR"] = tempfile.tempdir = str(tmp_path_factory.mktemp("tmp"))


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pytest.ini): one worker more than this process's cores. Many tests wait (for a
    process to start, a timeout to pass, a page to draw); with one worker per core those waits left
    a core idle (1.85 of 2 cores busy over a run of the suite), a worker more fills them (1.97)."""
    return cpu_cores() + 1


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(items):
    for item in items:
        for fixture, group in SHARED_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def batch():
    torch.manual_seed(1)
    return torch.randn(24, 16), torch.randint(0, 3, (24,))

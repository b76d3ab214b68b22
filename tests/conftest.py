"""Shared test setup: the repository root is importable and the embedded default
is cached in one place for the whole session (OPSD_CACHE).

The suite runs on two pytest-xdist workers (pytest.ini). Each worker, and every
process a test starts, uses one torch thread: two workers with two threads each on
two cores spend their time waiting for each other. Tests that share an expensive
module fixture (a training or evaluation run) are kept on one worker, so the run
happens once."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OPSD_CACHE", str(ROOT / ".cache" / "opsd"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import torch  # noqa: E402 (after OMP_NUM_THREADS above, which torch reads when it loads)

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Without a GPU, the Triton kernels (decode_attention, decode_qkv, decode_matmul, decode_sampler) run in
# Triton's CPU interpreter.
# Triton reads the switch when it is imported, so it is set before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def interpreted_triton():
    """Triton's CPU interpreter, where the kernels' tests run (the decode_* modules); with a
    GPU they skip: bench/ checks the compiled kernels (BENCHMARKS.md)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a GPU is present: the compiled kernels are checked by the benchmarks in bench/")
    pytest.importorskip("triton")


# Module fixtures that train or evaluate: the tests using one of them share a worker.
SHARED_RUN_FIXTURES = ("base_run", "trained_run", "tiny_run", "probed", "one_process_step")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    groups = {}
    for item in items:
        if (mark := item.get_closest_marker("xdist_group")) is not None:  # the test's own group: one group a test
            groups[item.nodeid] = mark.args[0]
            continue
        for name in SHARED_RUN_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                groups[item.nodeid] = f"{item.module.__name__}.{name}"
                item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
                break
    # The long runs (marked slow, with the rest of their group) go first: the workers take
    # tests in this order, so the short ones fill in at the end and both finish together,
    # instead of one worker running a long test alone at the end.
    slow_groups = {groups.get(i.nodeid) for i in items if i.get_closest_marker("slow")} - {None}
    items.sort(key=lambda i: not (i.get_closest_marker("slow") or groups.get(i.nodeid) in slow_groups))



def pytest_configure(config):
    """Under pytest 9 (to 9.2 at least), pytest-xdist 3.8's --dist loadgroup renames a grouped test's
    nodeid where pytest no longer reads it: groups are spread over both workers and every shared
    run is made twice (the suite takes minutes longer). Refused, with the fix."""
    if config.getoption("dist", None) == "loadgroup" and int(pytest.__version__.split(".")[0]) >= 9:
        raise pytest.UsageError(f"pytest {pytest.__version__} breaks pytest-xdist's --dist loadgroup (pytest.ini): "
                                "install the pinned pytest 8 (pip install -r requirements.txt)")

import gc
import os
import threading

import pytest
import torch


def pytest_configure(config):
    """Each xdist worker takes its share of the cores for torch's threads (and passes it to the processes it
    starts), instead of every worker taking them all.

    Why: two workers of two threads each on two cores left OpenMP's threads waiting on each other; a fit that
    takes 4 s alone took 41 s in the suite."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


@pytest.fixture(autouse=True, scope="session")
def _long_lived_objects_frozen():
    """The test process freezes what it holds once it has collected the tests (gc.freeze, as a pre-fork server
    does), so each fit's strategy leaves it alone instead of collecting it before the first step.

    Why: a test worker lives through hundreds of fits and holds every test module and its imports; one full
    collection over that heap took 1.25 s, before every fit (104 s of one 230-test run). The strategy's own
    collect-and-freeze is tested in tests/strategies/test_garbage_collection.py, which lifts this freeze."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves ``os.environ`` as it found it.

    Why: a DDP Trainer run inside the test process sets LOCAL_RANK, NODE_RANK and MASTER_PORT; a later test's
    2-rank `pl-lowprec fit` inherited them, took itself for a rank an outside launcher had started, never started
    its second rank, and waited for it until the test's 600 s timeout."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def fresh_flags(monkeypatch):
    """``launched_ranks``' process-global flags, new for the test: rank 0 neither failing nor leaving.

    Why: an earlier test's failed fit in this process leaves them set (as a real failed run would), and a test of a
    rank 0 that ended well read it as failed."""
    from pl_lowprec.distributed import launched_ranks

    monkeypatch.setattr(launched_ranks, "_leaving", threading.Event())
    monkeypatch.setattr(launched_ranks, "_failing", threading.Event())


@pytest.fixture
def datasets_cache_in_tmp(tmp_path_factory, monkeypatch):
    """load_dataset's Arrow copies go to a temporary directory of their own, not to ~/.cache
    (``pytest.mark.usefixtures``); not into ``tmp_path``, which a test may check holds only what it wrote."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-cache")))


def _process_group_started() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@pytest.fixture
def no_process_group_left():
    """A marker, with nothing of its own to do: a DDP or FSDP strategy's fit in this process starts a one-process
    group, which Lightning leaves; a test that runs one names this fixture, and ``_no_process_group_leaked`` then
    destroys the group after it without failing it, so the next test on this worker can start its own."""


@pytest.fixture(autouse=True)
def _no_process_group_leaked(request):
    """Destroy a process group a test leaves started; fail the test at its own teardown where it did not name
    ``no_process_group_left``, instead of a later test on the same xdist worker.

    Why: a leaked one-process group broke the next test file on its worker ('trying to initialize the default
    process group twice'), far from the test that leaked it. The check is one ``is_initialized()`` call a test."""
    yield
    if not _process_group_started():
        return
    torch.distributed.destroy_process_group()
    if "no_process_group_left" not in request.fixturenames:
        pytest.fail(
            "This test left a torch.distributed process group started (a DDP or FSDP strategy's fit in the test"
            " process starts a one-process group, which Lightning leaves). It was destroyed now; name the fixture"
            " no_process_group_left (@pytest.mark.usefixtures) in the test, or destroy the group in it.",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

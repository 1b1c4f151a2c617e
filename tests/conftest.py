"""Shared test setup: few threads (the machine is shared), and fixtures for tiny real models."""

from __future__ import annotations

import os

import pytest

# Workers and the jobs tests start share 2 cores: OpenMP threads that spin while waiting take the CPU from the
# other worker (set before torch loads its OpenMP; subprocesses inherit it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

# Two threads, split among pytest-xdist workers (`make test` runs one more than the cores: three here, one thread each).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("RF_TEST_THREADS", max(1, 2 // _WORKERS))))


@pytest.fixture(autouse=True)
def _same_threads_after():
    """Restore torch's thread count after a test that changed it (``trainer.run.Run``, called in-process, sets
    one per core): the tests after it on that worker would otherwise compute with other round-off, and share
    the cores with the other worker's threads."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _same_signal_handlers_after():
    """Restore Ctrl-C's and the stop signals' handlers, and the signals blocked, after a test that changed them (a
    run stopped in-process ignores the stop signals for the rest of its process; a tool run in-process leaves its
    Ctrl-C handler): the signal tests after it on that worker would otherwise meet another handler, or none."""
    import signal

    from trainer.stopping import SIGNALS

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *SIGNALS)}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    for sig, handler in handlers.items():
        if signal.getsignal(sig) != handler:
            signal.signal(sig, handler)
    if signal.pthread_sigmask(signal.SIG_BLOCK, []) != blocked:  # a library that blocked signals in this thread
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random tiny SD3 model saved with save_pretrained, loaded back by tests through the adapter."""
    from trainer.models.tiny import build_tiny_sd3

    return str(build_tiny_sd3(tmp_path_factory.mktemp("models") / "tiny-sd3"))


@pytest.fixture(scope="session")
def warmed_tiny_checkpoint(tmp_path_factory, tiny_model_dir) -> str:
    """tiny_model_dir after the default 600-step digits warm-up: a checkpoint for ``train.init_from``, made once
    per run (tests/warm_start.py)."""
    from warm_start import warmed_checkpoint

    return str(warmed_checkpoint(tmp_path_factory, tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_aesthetic_model_dir(tmp_path_factory):
    """A tiny random aesthetic predictor (tests/fixtures_models.py), for its scorer's tests and a job's replicas."""
    from fixtures_models import build_tiny_aesthetic

    return build_tiny_aesthetic(tmp_path_factory.mktemp("aesthetic-models"))


LONG_MODULE_FIXTURES = ("test_backends.py", "test_ocr_paddle.py", "test_preference_server.py", "test_geneval_server.py")
"""Test modules whose module-scoped fixtures take 5 s (reward servers with models) to 200 s (torchrun series)."""


def _queue_position(item: pytest.Item) -> int:
    if "warmed_tiny_checkpoint" in getattr(item, "fixturenames", ()):
        return 0
    if item.path.name in LONG_MODULE_FIXTURES:
        return 1
    return 3 if "test_docker_compose" in item.nodeid else 2


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Conformance cases of adapters whose ``TinySpec.slow_dtype_cases`` is set (and their ``+ip`` and other
    variants) go to the slow tier on the CPU in reduced precision; tests marked ``gpu`` skip, saying why, where
    CUDA is missing (deselected by default). Sets the order of a few tests (below)."""
    conformance = [item for item in items if "test_adapter_conformance" in item.nodeid]
    slow_dtypes = set()
    if conformance:
        from tiny_models import TINY_NAMES, tiny

        slow_dtypes = {name for name in TINY_NAMES if tiny(name).slow_dtype_cases}
    for item in conformance:
        params = getattr(getattr(item, "callspec", None), "params", {})
        case = str(params.get("case", params.get("name", ""))).partition("+")[0]  # a variant's: its adapter's
        target = getattr(params.get("target"), "device", None), getattr(params.get("target"), "dtype", None)
        if case in slow_dtypes and target[0] == "cpu" and target[1] != "float32":
            item.add_marker(pytest.mark.slow)
    # First, the runs from the shared warm-up, then the modules whose module fixtures are long to make, each
    # contiguous: pytest-xdist's work stealing hands a worker the first half of the queue and steals from the end
    # of a queue, so one worker makes each and runs all its tests. (A module fixture is made once per worker that
    # runs one of its tests: test_backends' torchrun series, made twice when the split fell in that module, cost
    # 190 s.) Last, the compose tests: CI prepares their Docker images meanwhile.
    items.sort(key=_queue_position)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

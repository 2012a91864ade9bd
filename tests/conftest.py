"""Shared fixtures: one loaded shipped model per test session, and one served app (a real Ray
Serve on loopback, started on first use) for every module that talks to it over HTTP. Every test
must leave the process-wide settings as it found them (`process_state`), and runs in an order
pytest-randomly shuffles (the seed is printed at the start and the end: replay an order with
`--randomly-seed=N`, keep the file order with `-p no:randomly`)."""

import os
from types import SimpleNamespace

from deployments._proc import LOOPBACK_RAY_ENV, direct_http_env, free_port

# Every Ray this session starts (the served app's, the scale-out test's, `serve run` in a
# subprocess) listens on 127.0.0.1 only. Ray reads this when it is imported: before anything here
# imports it.
os.environ.update(LOOPBACK_RAY_ENV)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import mtplx  # noqa: E402  (before MLX: it puts an optimized BLAS under mlx.core on Linux)

# Importing these sets process-wide state once (Ray: RAY_CLIENT_MODE and sys.excepthook; mlx-lm:
# TRANSFORMERS_NO_ADVISORY_WARNINGS): here, so that it is every test's starting point.
import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402, F401
import process_state  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402, F401


@pytest.fixture(scope="session")
def model():
    return mtplx.load_model()


# The @serve.batch window is widened in tests so that "concurrent" requests sent from client
# threads on a loaded 2-core machine reliably share a window; production default is 0.02 s.
# Access: the test app requires an API key (from a file, as a user would configure it), so every
# test goes through the authenticated path; test_http.py checks the refusals.
# Backpressure: at most 4 windows of 8 rows at a replica and 24 rows waiting at the ingress.
TEST_API_KEY = "mtplx-test-key-0123456789"
TEST_APP_ARGS = {"batch_wait_timeout_s": 0.25, "max_concurrent_batches": 4, "default_max_tokens": 64,
                 "max_waiting_rows": 24, "max_tokens_limit": 2000, "max_body_bytes": 256 * 1024,
                 "replica_cpus": 1,
                 # rows of the one replica a test kills wait for its replacement, which takes longer
                 # than the default minute to start on a loaded 2-core machine
                 "failover_timeout_s": 180.0}
AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}


# Serve's direct ingress for the Ray this test process starts (`serve_app`): the app's ingress then
# answers on a port of its own too, so that both HTTP fronts are tested. Ray's processes read it at
# start. The range holds the ingresses of test_real_shape's two extra applications too.
DIRECT_PORT = free_port()
os.environ.update(direct_http_env(DIRECT_PORT, ports=8))


def _seed_line(config) -> str:
    seed = config.getoption("randomly_seed", None)
    if not isinstance(seed, int):
        return "test order: as in the files (pytest-randomly off)"
    return f"test order shuffled by pytest-randomly, seed {seed}: replay with --randomly-seed={seed}"


def pytest_sessionstart(session):
    # (pytest-randomly's own header line is hidden under -q, which scripts/test.sh passes)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(_seed_line(session.config))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Tests that start Ray (marked `ray`) run after all the others, each group in pytest-randomly's
    order: the session's shared Serve cluster, once up, stays up to the end, and its idle
    processes take about a quarter of one core from every test that runs after it."""
    starts_ray = [item.get_closest_marker("ray") is not None for item in items]
    items[:] = [i for i, ray in zip(items, starts_ray) if not ray] + [i for i, ray in zip(items, starts_ray) if ray]


def pytest_terminal_summary(terminalreporter, config):
    terminalreporter.write_line(_seed_line(config))


@pytest.fixture(autouse=True)
def _process_settings_unchanged(request):
    """A test (with its function-scoped fixtures) leaves the process-wide settings as it found
    them; fixtures of a wider scope restore theirs with `process_state.restored()`."""
    before = process_state.snapshot()
    yield
    changed = process_state.changes(before, process_state.snapshot())
    if changed:
        process_state.restore(before)
        pytest.fail(f"left process-wide settings changed (now restored): {changed}", pytrace=False)


@pytest.fixture(autouse=True)
def _mlx_random_seeded(request):
    """MLX's global random state, reset before each test from pytest-randomly's seed as that plugin
    resets Python's and NumPy's: a test that draws from it gets the same values whatever ran before."""
    seed = request.config.getoption("randomly_seed", None)
    mx.random.seed(seed if isinstance(seed, int) else 0)


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="session")
def serve_app(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api_keys"
    key_file.write_text(f"# test keys\n{TEST_API_KEY}\nsecond-key-for-rotation\n")
    store_path = tmp_path_factory.mktemp("responses") / "responses.sqlite3"     # the Responses API's store
    import ray
    from ray import serve

    from deployments import build_app

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="mtplx-tests")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(dict(TEST_APP_ARGS, api_keys_file=str(key_file), responses_store_path=str(store_path))),
              name="mtplx", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    direct = f"http://127.0.0.1:{DIRECT_PORT}"
    try:
        yield SimpleNamespace(base=base, api=f"{base}/v1", headers=dict(AUTH),
                              direct=direct if _answers(direct) else None, store_path=str(store_path))
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()


@pytest.fixture(scope="session")
def ref_model(model):
    """The engine in this process (tests/conftest.py's shared shipped model), for references."""
    return model


@pytest.fixture()
def client(serve_app):
    import openai

    return openai.OpenAI(base_url=serve_app.api, api_key=TEST_API_KEY, max_retries=0, timeout=120)


@pytest.fixture()
def http(serve_app):
    import httpx

    with httpx.Client(base_url=serve_app.base, timeout=120, headers=serve_app.headers) as c:
        yield c

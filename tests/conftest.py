"""Shared fixtures: one loaded shipped model per test session, and one served app (a real Ray
Serve on loopback, started on first use) for every module that talks to it over HTTP."""

import os
from types import SimpleNamespace

import pytest

import mtplx
from deployments._proc import direct_http_env, free_port


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
                 "replica_cpus": 1}
AUTH = {"Authorization": f"Bearer {TEST_API_KEY}"}


# Serve's direct ingress for whichever Ray this test process starts (an in-process replica's
# metrics start one on first use, before the served app may): the app's ingress then answers on a
# port of its own too, so that both HTTP fronts are tested. Ray's processes read it at start. The
# range holds the ingresses of test_real_shape's two extra applications too.
DIRECT_PORT = free_port()
os.environ.update(direct_http_env(DIRECT_PORT, ports=8))


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="session")
def serve_app(tmp_path_factory):
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    key_file = tmp_path_factory.mktemp("keys") / "api_keys"
    key_file.write_text(f"# test keys\n{TEST_API_KEY}\nsecond-key-for-rotation\n")
    store_path = tmp_path_factory.mktemp("responses") / "responses.sqlite3"     # the Responses API's store
    import ray
    from ray import serve

    from deployments import build_app

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="mtplx-tests",
                 _node_ip_address="127.0.0.1")
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

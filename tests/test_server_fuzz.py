"""Schemathesis against a real server: whatever the body (valid by the schema or not), no 5xx."""
from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="SKIPPED: schemathesis is not installed, so the "
                                   "server is not fuzzed (pip install -r requirements-test.txt)")
from hypothesis import HealthCheck, settings  # noqa: E402

from test_server import ServerProcess, tiny_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    # NOTE: --max-tokens-cap keeps every generated request to a few tokens, so examples are fast.
    srv = ServerProcess(["--model", tiny_model_dir(tmp_path_factory), "--dtype", "float32",
                         "--max-model-len", "256", "--max-tokens-cap", "4", "--num-threads", "1"])
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.base + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, fuzz_server):
    response = case.call(timeout=30)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.text}"
    if response.status_code >= 400 and "application/json" in str(response.headers.get("content-type")):
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_server_survived(fuzz_server):
    """Runs after the fuzzing: both valid (200) and invalid (400) bodies reached the server."""
    seen = httpx.get(fuzz_server.base + "/metrics").text
    print("\n" + "\n".join(line for line in seen.splitlines() if line.startswith("numa_runtime_http_responses_total")))
    assert 'numa_runtime_http_responses_total{code="200"}' in seen
    assert 'numa_runtime_http_responses_total{code="400"}' in seen
    assert httpx.get(fuzz_server.base + "/health").status_code == 200
    r = httpx.post(fuzz_server.base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2

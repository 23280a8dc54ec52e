"""The RunPod client against a real HTTP server on 127.0.0.1 (tests/runpod_fake.py), no mocks."""

from __future__ import annotations

import socket
import time

import pytest
from runpod_fake import SERVER_EDITION, problem
from runpod_fake import TEST_KEY as RUNPOD_TEST_KEY

from h3core.errors import ConfigError, RemoteAPIError
from h3core.pod import Cloud, RetryPolicy, RunPodClient, fetch_catalog
from h3core.pod.client import api_key_from_env, base_url_from_env, check_pod_id
from h3core.pod.models import CreateGpu, CreatePodRequest, Mounts, PersistentMount

FAST = RetryPolicy(attempts=4, backoff_s=0.5, max_backoff_s=4, max_retry_after_s=60)


class Sleeps(list):
    """Records the waits a client asks for instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
def client(runpod, sleeps) -> RunPodClient:
    return RunPodClient(RUNPOD_TEST_KEY, runpod.base_url, retry=FAST, sleep=sleeps, read_timeout_s=2, write_timeout_s=2)


def _request(count: int = 8, datacenter: str = "EUR-IS-1", **overrides) -> CreatePodRequest:
    values = dict(
        name="h3-test", image="runpod/pytorch:1.0.3-cu1300-torch291-ubuntu2404",
        gpu=CreateGpu(id=SERVER_EDITION, count=count, min_cuda_version="13.0"), cloud=Cloud.SECURE,
        data_center_ids=[datacenter], disk=50, ports=["22/tcp"], env={},
        mounts=Mounts(persistent=PersistentMount(size=100, path="/workspace")), start_ssh=True,
    )
    values.update(overrides)
    return CreatePodRequest(**values)


def _assert_one_line_without_key(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text and RUNPOD_TEST_KEY not in text
    return text


# --- catalog -------------------------------------------------------------------------------------


def test_catalog_reads_stock_for_count_cloud_and_cuda_floor(client, runpod):
    catalog = fetch_catalog(client, SERVER_EDITION, 8, Cloud.SECURE, "13.0")
    (sent,) = runpod.sent("GET")
    assert sent.path == f"/v2/catalog/gpus/{SERVER_EDITION}" and sent.authorized
    assert sent.query == {"include": "AVAILABILITY", "product": "POD", "count": "8", "cloud": "SECURE", "minCudaVersion": "13.0"}
    assert [(dc.id, dc.availability.value) for dc in catalog.data_centers] == [
        ("EUR-IS-1", "HIGH"), ("US-KS-2", "MEDIUM"), ("US-TX-3", "NONE")  # CA-MTL-1 runs CUDA 12.8
    ]
    assert [dc.id for dc in catalog.in_stock()] == ["EUR-IS-1", "US-KS-2"]
    assert catalog.availability.value == "HIGH" and catalog.memory_gb == 96 and catalog.max_count == 8
    assert catalog.price_per_gpu_hour == 1.89 and catalog.price_per_hour == pytest.approx(15.12)


def test_catalog_without_cuda_floor_and_on_community(client, runpod):
    any_cuda = fetch_catalog(client, SERVER_EDITION, 8, Cloud.SECURE, None)
    assert "minCudaVersion" not in runpod.requests[-1].query
    assert [dc.id for dc in any_cuda.in_stock()] == ["CA-MTL-1", "EUR-IS-1", "US-KS-2"]  # HIGH tie: by id
    community = fetch_catalog(client, SERVER_EDITION, 8, Cloud.COMMUNITY, "13.0")
    assert [dc.id for dc in community.in_stock()] == ["EU-RO-1"] and community.price_per_gpu_hour == 1.59


def test_catalog_with_nothing_in_stock_has_no_data_centers(client):
    catalog = fetch_catalog(client, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 8, Cloud.SECURE, "13.0")
    assert catalog.data_centers == [] and catalog.availability.value == "NONE"


def test_unknown_gpu_type_is_one_line_without_retry(client, runpod, sleeps):
    with pytest.raises(RemoteAPIError) as err:
        client.gpu_type("NVIDIA RTX 9999", count=1, cloud=Cloud.SECURE, min_cuda=None)
    text = _assert_one_line_without_key(err.value)
    assert "HTTP 404 Not Found" in text and "unknown GPU type id 'NVIDIA RTX 9999'" in text
    assert len(runpod.sent("GET")) == 1 and sleeps == []


# --- auth and errors -----------------------------------------------------------------------------


def test_wrong_key_is_401_with_a_hint_and_without_the_key(runpod, sleeps):
    wrong = "rpa_WRONGKEY_abcdef"
    client = RunPodClient(wrong, runpod.base_url, retry=FAST, sleep=sleeps)
    with pytest.raises(RemoteAPIError) as err:
        client.list_pods()
    text = str(err.value)
    assert "HTTP 401 Unauthorized: invalid bearer token" in text and "RUNPOD_API_KEY" in text
    assert wrong not in text and "\n" not in text
    assert runpod.requests[-1].authorized is False and sleeps == []


def test_server_echoing_the_key_is_redacted(client, runpod):
    runpod.script("GET", "/v2/pods", 403, problem(403, "Forbidden", f"key {RUNPOD_TEST_KEY} lacks pod:read"))
    with pytest.raises(RemoteAPIError) as err:
        client.list_pods()
    text = _assert_one_line_without_key(err.value)
    assert "key <redacted> lacks pod:read" in text and "permissions" in text


def test_unknown_pod_is_404_with_one_clear_line(client, runpod, sleeps):
    with pytest.raises(RemoteAPIError) as err:
        client.get_pod("nosuchpod1")
    text = _assert_one_line_without_key(err.value)
    assert "HTTP 404 Not Found: pod not found" in text and "unknown pod id 'nosuchpod1'" in text and "h3 pod list" in text
    assert sleeps == [] and len(runpod.sent("GET")) == 1


def test_malformed_pod_id_is_refused_before_any_request(client, runpod):
    for bad in ("../v2/account", "a b", ""):
        with pytest.raises(ConfigError):
            check_pod_id(bad)
        with pytest.raises(ConfigError):
            client.terminate_pod(bad)
    assert runpod.requests == []


def test_402_on_create_says_add_funds_and_is_sent_once(client, runpod, sleeps):
    runpod.script("POST", "/v2/pods", 402, problem(402, "Payment Required", "insufficient balance"), times=3)
    with pytest.raises(RemoteAPIError) as err:
        client.create_pod(_request())
    text = _assert_one_line_without_key(err.value)
    assert "HTTP 402 Payment Required: insufficient balance" in text and "add funds" in text
    assert len(runpod.sent("POST")) == 1 and sleeps == [] and runpod.pods == {}


def test_422_lists_the_schema_violations_and_is_not_retried(client, runpod, sleeps):
    invalid = _request().model_copy(update={"disk": 0})  # bypasses h3's own check; the server's schema catches it
    with pytest.raises(RemoteAPIError) as err:
        client.create_pod(invalid)
    text = _assert_one_line_without_key(err.value)
    assert "HTTP 422 Unprocessable Entity: Request validation failed." in text and "minimum of 1" in text
    assert len(runpod.sent("POST")) == 1 and sleeps == []


def test_400_no_capacity_points_at_the_catalog(client, runpod):
    with pytest.raises(RemoteAPIError) as err:
        client.create_pod(_request(datacenter="US-TX-3"))  # only 4 free there
    text = _assert_one_line_without_key(err.value)
    assert "HTTP 400 Bad Request" in text and "no longer any instances" in text and "h3 pod catalog" in text


# --- retries (reads only) ------------------------------------------------------------------------


def test_429_on_a_read_waits_retry_after_then_succeeds(client, runpod, sleeps):
    runpod.script("GET", "/v2/pods", 429, problem(429, "Too Many Requests", "rate limit exceeded for the minute window"),
                  headers={"Retry-After": "7"}, times=2)
    assert client.list_pods() == []
    assert sleeps == [7.0, 7.0] and len(runpod.sent("GET", "/v2/pods")) == 3


def test_429_without_retry_after_backs_off(client, runpod, sleeps):
    runpod.script("GET", "/v2/pods", 429, problem(429, "Too Many Requests", "slow down"))
    client.list_pods()
    assert sleeps == [0.5]


def test_429_with_a_retry_after_longer_than_allowed_fails_at_once(client, runpod, sleeps):
    runpod.script("GET", "/v2/pods", 429, problem(429, "Too Many Requests", "hour window"), headers={"Retry-After": "3600"})
    with pytest.raises(RemoteAPIError) as err:
        client.list_pods()
    assert "wait 3600 s" in _assert_one_line_without_key(err.value)
    assert sleeps == [] and len(runpod.sent("GET")) == 1


def test_5xx_on_a_read_backs_off_exponentially_then_succeeds(client, runpod, sleeps):
    runpod.script("GET", "/v2/pods", 503, times=3)
    assert client.list_pods() == []
    assert sleeps == [0.5, 1.0, 2.0] and len(runpod.sent("GET")) == 4


def test_5xx_that_persists_gives_up_after_the_attempts(client, runpod, sleeps):
    runpod.script("GET", "/v2/pods", 502, problem(502, "Bad Gateway", "upstream down"), times=10)
    with pytest.raises(RemoteAPIError) as err:
        client.list_pods()
    text = _assert_one_line_without_key(err.value)
    assert "failed after 4 tries: HTTP 502 Bad Gateway: upstream down" in text
    assert sleeps == [0.5, 1.0, 2.0] and len(runpod.sent("GET")) == 4


def test_backoff_is_capped():
    policy = RetryPolicy(backoff_s=1, max_backoff_s=5)
    assert [policy.backoff(n) for n in range(1, 6)] == [1, 2, 4, 5, 5]


# --- writes are never retried ------------------------------------------------------------------------


def test_create_5xx_is_not_retried_and_says_check_the_list(client, runpod, sleeps):
    runpod.script("POST", "/v2/pods", 503, times=5)
    with pytest.raises(RemoteAPIError) as err:
        client.create_pod(_request())
    text = _assert_one_line_without_key(err.value)
    assert "HTTP 503" in text and "the pod may exist" in text and "h3 pod list" in text
    assert len(runpod.sent("POST")) == 1 and sleeps == []


def test_create_429_is_not_retried(client, runpod, sleeps):
    runpod.script("POST", "/v2/pods", 429, problem(429, "Too Many Requests", "minute window"), headers={"Retry-After": "3"})
    with pytest.raises(RemoteAPIError) as err:
        client.create_pod(_request())
    assert "nothing was created; rate limited; try again in 3 s" in _assert_one_line_without_key(err.value)
    assert len(runpod.sent("POST")) == 1 and sleeps == []


def test_terminate_5xx_is_not_retried(client, runpod, sleeps):
    pod = runpod.add_pod()
    runpod.script("DELETE", f"/v2/pods/{pod['id']}", 500, times=3)
    with pytest.raises(RemoteAPIError):
        client.terminate_pod(pod["id"])
    assert len(runpod.sent("DELETE")) == 1 and sleeps == [] and pod["id"] in runpod.pods


def test_create_sends_a_schema_valid_body_and_returns_the_pod(client, runpod):
    pod = client.create_pod(_request())
    (sent,) = runpod.sent("POST", "/v2/pods")
    assert runpod.spec.body_errors(runpod.spec.route("POST", "/v2/pods")[1], sent.body) == []
    assert sent.body == _request().body()
    assert pod.status == "PROVISIONING" and pod.data_center_id == "EUR-IS-1" and pod.gpu.count == 8
    assert pod.cost == pytest.approx(15.12) and pod.ssh.direct is None


def test_terminate_deletes_and_unknown_id_is_clear(client, runpod):
    pod = runpod.add_pod()
    client.terminate_pod(pod["id"])
    assert runpod.pods == {}
    with pytest.raises(RemoteAPIError) as err:
        client.terminate_pod(pod["id"])
    assert f"unknown pod id '{pod['id']}'" in _assert_one_line_without_key(err.value)


# --- timeouts and unreachable servers --------------------------------------------------------------


def test_a_stalled_read_times_out_and_is_retried(runpod, sleeps):
    client = RunPodClient(RUNPOD_TEST_KEY, runpod.base_url, retry=RetryPolicy(attempts=2, backoff_s=0), sleep=sleeps,
                          read_timeout_s=0.2)
    runpod.script("GET", "/v2/pods", stall=True, times=5)
    start = time.monotonic()
    with pytest.raises(RemoteAPIError) as err:
        client.list_pods()
    assert time.monotonic() - start < 3
    assert "failed after 2 tries: no complete answer within 0.2 s" in _assert_one_line_without_key(err.value)
    assert len(runpod.sent("GET")) == 2


def test_a_stalled_create_times_out_once_and_says_it_may_exist(runpod, sleeps):
    client = RunPodClient(RUNPOD_TEST_KEY, runpod.base_url, retry=FAST, sleep=sleeps, write_timeout_s=0.2)
    runpod.script("POST", "/v2/pods", stall=True, times=5)
    with pytest.raises(RemoteAPIError) as err:
        client.create_pod(_request())
    text = _assert_one_line_without_key(err.value)
    assert "no complete answer within 0.2 s" in text and "may or may not have been applied" in text and "h3 pod list" in text
    assert len(runpod.sent("POST")) == 1 and sleeps == []


def test_connection_refused_is_retried_then_one_line(sleeps):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again when the block ends: nothing listens there
    client = RunPodClient(RUNPOD_TEST_KEY, f"http://127.0.0.1:{port}", retry=RetryPolicy(attempts=3, backoff_s=0.01), sleep=sleeps)
    with pytest.raises(RemoteAPIError) as err:
        client.list_pods()
    text = _assert_one_line_without_key(err.value)
    assert f"cannot reach http://127.0.0.1:{port}: connection refused" in text and "RUNPOD_API_BASE_URL" in text
    assert sleeps == [0.01, 0.02]


def test_an_answer_of_the_wrong_shape_is_one_line(client, runpod):
    runpod.script("GET", "/v2/pods/pod0000001", 200, {"id": "pod0000001"})
    with pytest.raises(RemoteAPIError) as err:
        client.get_pod("pod0000001")
    assert "unexpected answer (name: Field required)" in _assert_one_line_without_key(err.value)
    runpod.contract_violations.clear()  # the fake was told to break the contract here


# --- environment ------------------------------------------------------------------------------------


def test_missing_key_is_a_config_error(monkeypatch):
    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="RUNPOD_API_KEY is not set"):
        api_key_from_env()


def test_a_key_with_a_line_break_is_refused_without_echoing_it(monkeypatch):
    monkeypatch.setenv("RUNPOD_API_KEY", "rpa_abc\nSECRETPART")
    with pytest.raises(ConfigError) as err:
        api_key_from_env()
    assert "SECRETPART" not in str(err.value) and "line breaks" in str(err.value)


@pytest.mark.parametrize("url", ["ftp://api.runpod.io", "api.runpod.io", "http://api.runpod.io"])
def test_base_url_must_be_https_except_on_loopback(monkeypatch, url):
    monkeypatch.setenv("RUNPOD_API_BASE_URL", url)
    with pytest.raises(ConfigError, match="RUNPOD_API_BASE_URL"):
        base_url_from_env()


def test_base_url_defaults_to_production_and_accepts_loopback_http(monkeypatch):
    monkeypatch.delenv("RUNPOD_API_BASE_URL", raising=False)
    assert base_url_from_env() == "https://api.runpod.io"
    monkeypatch.setenv("RUNPOD_API_BASE_URL", "http://127.0.0.1:8080/")
    assert base_url_from_env() == "http://127.0.0.1:8080"


def test_client_repr_hides_the_key():
    client = RunPodClient(RUNPOD_TEST_KEY)
    assert RUNPOD_TEST_KEY not in repr(client) and RUNPOD_TEST_KEY not in repr(client._session.auth)

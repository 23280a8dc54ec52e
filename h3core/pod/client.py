"""A small, guarded client for RunPod's REST API v2 on `requests`.

Guarantees (each one tested against a real HTTP server on loopback):

- The API key comes from `RUNPOD_API_KEY` only. It is sent as a bearer token and never appears in
  a message, whole or in part: every error text passes through `redact` (the key, and any run of
  6 or more of its characters, e.g. a key cut by a server's own truncation) *before* it is cut to
  length, and the key is checked for characters that would make `requests` echo the header in its
  own exception.
- Every request has a deadline for the whole exchange (`deadline.Deadline`), not only a timeout
  per socket read, and a size cap on its answer (`deadline.MAX_ANSWER_BYTES`, decompressed),
  whatever the server's HTTP version: a server that trickles one byte every few seconds, or
  sends an endless body or a gzip bomb, still ends in time and in bounded memory.
- Every transport failure (refused, reset, a broken chunked body, a corrupt gzip body, a redirect
  loop, a malformed answer) is one `RemoteAPIError` line, never a traceback.
- Reads (GET) are retried: a 429 waits what `Retry-After` says, a 5xx, a timeout or a dropped
  connection backs off exponentially. Writes (create, terminate) are sent exactly once: a retried
  create can start a second paid pod. Only a clear refusal (HTTP 4xx) says nothing happened; any
  other outcome of a write (a 5xx, a 3xx, a 2xx h3 cannot read, a transport failure, Ctrl-C while
  it was in flight, an answer h3 fails to interpret for any reason) says it may have been applied
  and to check `h3 pod list` before trying again.
- An HTTP error becomes one `RemoteAPIError` line built from the RFC 9457 problem body
  (`title`, `detail`, `errors`) plus what to do about it.
"""

from __future__ import annotations

import email.utils
import http.client
import re
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, TypeVar
from urllib.parse import quote, urlsplit

import requests
import urllib3
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from h3core.errors import ConfigError, Interrupted, RemoteAPIError
from h3core.files.text import parse_json
from h3core.settings import env_str
from h3core.pod.deadline import MAX_ANSWER_BYTES, AnswerTooLarge, BoundedAdapter, Deadline, DeadlinePassed
from h3core.pod.models import Cloud, CreatePodRequest, GpuType, NetworkVolume, Pod

API_KEY_VAR = "RUNPOD_API_KEY"
BASE_URL_VAR = "RUNPOD_API_BASE_URL"
DEFAULT_BASE_URL = "https://api.runpod.io"
KEYS_WHERE = "in the RunPod console (Settings, API Keys)"
READ_TIMEOUT_S = 30.0
WRITE_TIMEOUT_S = 60.0

_LOOPBACK = {"127.0.0.1", "::1", "localhost"}
_POD_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_DETAIL_CHARS = 400
_KEY_FRAGMENT = 6  # a run of this many characters of the key is a fragment of it: never shown
_MAX_REDIRECTS = 5
CREATE_CHECK = "the pod may exist and cost money: check `h3 pod list` before trying again (h3 never repeats a create by itself)"

Model = TypeVar("Model", bound=BaseModel)


class RetryPolicy(BaseModel):
    """How reads are retried. Writes are never retried."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    attempts: int = Field(4, ge=1, description="Tries per read, the first one included.")
    backoff_s: float = Field(1.0, ge=0, description="Wait after the first 5xx/network failure; doubles each time.")
    max_backoff_s: float = Field(16.0, ge=0, description="Longest exponential backoff wait.")
    max_retry_after_s: float = Field(
        120.0, ge=0, description="Longest Retry-After h3 waits out; a longer one fails at once with the wait named."
    )

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1-based) after a 5xx or network failure."""
        return min(self.backoff_s * 2 ** (retry - 1), self.max_backoff_s)


DEFAULT_RETRY = RetryPolicy()


class _Bearer(requests.auth.AuthBase):
    """Bearer auth as an auth object, so `.netrc` cannot replace it and a cross-host redirect drops it."""

    def __init__(self, key: str):
        self._key = key

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        request.headers["Authorization"] = f"Bearer {self._key}"
        return request

    def __repr__(self) -> str:
        return "_Bearer(<redacted>)"


def api_key_from_env() -> str:
    """`RUNPOD_API_KEY`, checked; a missing or malformed key is a `ConfigError` that never echoes it."""
    key = env_str(API_KEY_VAR)
    if not key:
        raise ConfigError(f"{API_KEY_VAR} is not set; create an API key {KEYS_WHERE} and export {API_KEY_VAR}=...")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ConfigError(
            f"{API_KEY_VAR} holds spaces, line breaks or non-ASCII characters; paste the key again, exactly as RunPod shows it"
        )
    return key


def base_url_from_env() -> str:
    """`RUNPOD_API_BASE_URL` or the production URL; plain http is allowed only to loopback."""
    url = (env_str(BASE_URL_VAR) or DEFAULT_BASE_URL).rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{BASE_URL_VAR}={url!r} is not an http(s) URL; e.g. {DEFAULT_BASE_URL}")
    if parts.scheme == "http" and parts.hostname not in _LOOPBACK:
        raise ConfigError(
            f"{BASE_URL_VAR}={url!r} would send {API_KEY_VAR} unencrypted; use https (plain http only to 127.0.0.1)"
        )
    return url


def check_pod_id(pod_id: str) -> str:
    """A pod id as RunPod issues them (letters, digits, '-', '_'); anything else is a `ConfigError`."""
    if not _POD_ID.match(pod_id):
        raise ConfigError(f"{pod_id!r} is not a RunPod pod id (letters and digits, e.g. 7h9k2m4n6p); `h3 pod list` shows yours")
    return pod_id


def _one_line(text: str, limit: int = _DETAIL_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def redact(text: str, secret: str) -> str:
    """`text` without `secret`: the whole of it, and every run of `_KEY_FRAGMENT` or more characters
    that also occurs in it (a key cut in two by truncation, or echoed in part), become `<redacted>`."""
    if not secret:
        return text
    text = text.replace(secret, "<redacted>")
    n = _KEY_FRAGMENT
    if len(secret) < n:
        return text
    grams = {secret[i : i + n] for i in range(len(secret) - n + 1)}
    hidden = [False] * len(text)
    for i in range(len(text) - n + 1):
        if text[i : i + n] in grams:
            hidden[i : i + n] = [True] * n
    out, i = [], 0
    while i < len(text):
        if hidden[i]:
            while i < len(text) and hidden[i]:
                i += 1
            out.append("<redacted>")
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


class _TransportFailure(Exception):
    """No usable HTTP answer: `reason` in words; `retry`: a read may be tried again."""

    def __init__(self, reason: str, retry: bool):
        super().__init__(reason)
        self.reason, self.retry = reason, retry


def _transport_failure(err: BaseException, deadline: Deadline, base_url: str) -> _TransportFailure:
    """One classification of everything `requests` (or what it wraps) raises for a failed exchange."""
    if deadline.expired or isinstance(err, (requests.Timeout, DeadlinePassed)):
        return _TransportFailure(f"no complete answer within {deadline.seconds:g} s", True)
    if isinstance(err, AnswerTooLarge):
        return _TransportFailure(f"{err} (RunPod's answers are a few kB; is {BASE_URL_VAR} RunPod's API?)", False)
    if isinstance(err, requests.TooManyRedirects):
        return _TransportFailure(f"more than {_MAX_REDIRECTS} redirects (a redirect loop?)", False)
    if isinstance(err, requests.exceptions.ChunkedEncodingError):
        return _TransportFailure("the answer was cut off (a broken chunked body)", True)
    if isinstance(err, requests.exceptions.ContentDecodingError):
        return _TransportFailure("the answer's compressed body is corrupt (bad gzip/deflate data)", True)
    if isinstance(err, requests.ConnectionError):
        return _TransportFailure(f"cannot reach {base_url}: {_network_reason(err)}", True)
    return _TransportFailure(f"a malformed HTTP answer ({type(err).__name__})", False)


_DELAY_SECONDS = re.compile(r"[0-9]{1,10}")  # RFC 9110 delay-seconds: ASCII digits (str.isdigit also takes '²')


def _retry_after_s(response: requests.Response) -> Optional[float]:
    """`Retry-After` in seconds (ASCII delay-seconds or an HTTP date), None when absent or unreadable."""
    value = str(response.headers.get("Retry-After", "")).strip()
    if not value:
        return None
    if _DELAY_SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, OverflowError, IndexError):
        return None


def _network_reason(err: requests.RequestException) -> str:
    text = str(err)
    if "NameResolution" in text or "Name or service not known" in text:
        return "the host name does not resolve"
    if "refused" in text.lower():
        return "connection refused"
    return "connection failed"


def _rate_limited_hint(response: requests.Response) -> str:
    wait = _retry_after_s(response)
    return "rate limited; try again " + (f"in {wait:.0f} s" if wait is not None else "in a minute")


_STATUS_HINTS = {
    400: "RunPod refused the request (a rule it checks, or no capacity for this GPU there)",
    401: f"the API key was rejected: check {API_KEY_VAR} (create a key {KEYS_WHERE})",
    402: "insufficient balance: add funds to the RunPod account",
    403: "the API key has no access to this; create a key with read/write pod permissions",
    409: "the pod is not in a state that allows this",
    422: "RunPod rejected the request body (an h3 bug or an unsupported value)",
}


class RunPodClient:
    """Typed calls to the v2 endpoints `h3 pod` needs. Construct with `from_env()` in commands.

    Timeouts default to `READ_TIMEOUT_S` / `WRITE_TIMEOUT_S` and the retry policy to `DEFAULT_RETRY`
    (read when the client is made); `sleep` is how retries wait (injectable for tests);
    `max_answer_bytes` caps every answer's body (decompressed).
    """

    def __init__(
        self,
        api_key: str,
        base_url: str = DEFAULT_BASE_URL,
        *,
        read_timeout_s: Optional[float] = None,
        write_timeout_s: Optional[float] = None,
        retry: Optional[RetryPolicy] = None,
        sleep: Optional[Callable[[float], None]] = None,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ):
        self._api_key = api_key
        self.base_url = base_url.rstrip("/")
        self.read_timeout_s = read_timeout_s or READ_TIMEOUT_S
        self.write_timeout_s = write_timeout_s or WRITE_TIMEOUT_S
        self.retry = retry if retry is not None else DEFAULT_RETRY
        self._sleep = sleep if sleep is not None else time.sleep
        self._session = requests.Session()
        self._session.mount("http://", BoundedAdapter(max_answer_bytes))
        self._session.mount("https://", BoundedAdapter(max_answer_bytes))
        self._session.max_redirects = _MAX_REDIRECTS
        self._session.auth = _Bearer(api_key)
        self._session.headers["Accept"] = "application/json"
        self._session.headers["User-Agent"] = "h3-pod"

    @classmethod
    def from_env(cls, **kwargs: Any) -> "RunPodClient":
        """A client for `RUNPOD_API_KEY` at `RUNPOD_API_BASE_URL` (default production)."""
        return cls(api_key_from_env(), base_url_from_env(), **kwargs)

    def __repr__(self) -> str:
        return f"RunPodClient(base_url={self.base_url!r})"

    # --- endpoints ---------------------------------------------------------------------------

    def gpu_type(self, gpu_type_id: str, *, count: int, cloud: Cloud, min_cuda: Optional[str]) -> GpuType:
        """One GPU type with its pod stock for `count` GPUs on `cloud` (hosts with CUDA >= `min_cuda`)."""
        params: dict[str, Any] = {"include": "AVAILABILITY", "product": "POD", "count": count, "cloud": cloud.value}
        if min_cuda:
            params["minCudaVersion"] = min_cuda
        data = self._get(
            f"/v2/catalog/gpus/{quote(gpu_type_id, safe='')}", params, f"catalog for {gpu_type_id!r}",
            not_found=f"unknown GPU type id {gpu_type_id!r}; ids are exact, e.g. 'NVIDIA RTX PRO 6000 Blackwell Server Edition'",
        )
        return self._parse(GpuType, data, "catalog")

    def network_volume(self, volume_id: str) -> NetworkVolume:
        data = self._get(
            f"/v2/network-volumes/{quote(volume_id, safe='')}", None, f"network volume {volume_id!r}",
            not_found=f"unknown network volume id {volume_id!r}; the RunPod console lists your volumes",
        )
        return self._parse(NetworkVolume, data, "network volume")

    def ssh_keys(self) -> list[str]:
        """The account's registered SSH public keys (what `startSsh` puts on a pod by default)."""
        data = self._get("/v2/account/ssh-keys", None, "account SSH keys")
        keys = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(keys, list):
            raise RemoteAPIError(self._redact("RunPod account SSH keys: unexpected answer (no 'keys' list)"))
        return [str(k) for k in keys]

    def list_pods(self) -> list[Pod]:
        data = self._get("/v2/pods", None, "pod list")
        pods = data.get("pods") if isinstance(data, dict) else None
        if not isinstance(pods, list):
            raise RemoteAPIError(self._redact("RunPod pod list: unexpected answer (no 'pods' list)"))
        return [self._parse(Pod, p, "pod list") for p in pods]

    def get_pod(self, pod_id: str) -> Pod:
        check_pod_id(pod_id)
        data = self._get(f"/v2/pods/{pod_id}", None, f"pod {pod_id}", not_found=self._unknown_pod(pod_id))
        return self._parse(Pod, data, f"pod {pod_id}")

    def create_pod(self, request: CreatePodRequest) -> Pod:
        """POST the body once. Never retried: a second attempt could start a second paid pod.

        A 4xx is RunPod refusing (nothing was created); a 2xx carrying a pod is the pod; anything
        else (a 5xx, a 3xx, a 2xx h3 cannot read) may have created one, and says so.
        """
        what = "create pod"
        response = self._send_once("POST", "/v2/pods", request.body(), what, CREATE_CHECK)
        with self._answer_to_a_write(what, CREATE_CHECK):
            status = response.status_code
            if 400 <= status < 500:
                raise self._api_error(response, what, hint=self._create_hint(response))
            if not 200 <= status < 300:
                raise self._ambiguous(what, self._problem_text(response), CREATE_CHECK)
            try:
                return self._parse(Pod, self._json(response, what), what)
            except RemoteAPIError as err:
                raise self._ambiguous(what, f"HTTP {status} with an answer h3 cannot read ({_reason_of(err)})", CREATE_CHECK) from None
        raise AssertionError("unreachable")  # pragma: no cover - the block returns or raises

    def terminate_pod(self, pod_id: str) -> None:
        """DELETE the pod (its persistent storage with it). Sent once."""
        check_pod_id(pod_id)
        what, check = f"terminate pod {pod_id}", f"check `h3 pod get {pod_id}` before trying again"
        response = self._send_once("DELETE", f"/v2/pods/{pod_id}", None, what, check)
        with self._answer_to_a_write(what, check):
            status = response.status_code
            if 400 <= status < 500:
                hint = self._unknown_pod(pod_id) if status == 404 else None
                raise self._api_error(response, what, hint=hint)
            if status not in (200, 202, 204):
                raise self._ambiguous(what, self._problem_text(response), check)

    # --- transport -----------------------------------------------------------------------------

    def _get(self, path: str, params: Optional[dict[str, Any]], what: str, not_found: Optional[str] = None) -> Any:
        """GET with retries for 429 (Retry-After), 5xx and network failures; JSON body on success."""
        url = self.base_url + path
        failure = ""
        for attempt in range(1, self.retry.attempts + 1):
            try:
                response = self._exchange("GET", url, self.read_timeout_s, params=params)
            except _TransportFailure as err:
                if not err.retry:
                    raise RemoteAPIError(self._redact(f"RunPod {what} failed: {err.reason}; check {BASE_URL_VAR} ({self.base_url})")) from None
                failure, wait = err.reason, self.retry.backoff(attempt)
            else:
                if response.ok:
                    return self._json(response, what)
                if response.status_code == 429:
                    wait = self._rate_limit_wait(response, what, attempt)
                elif response.status_code < 500:
                    hint = not_found if response.status_code == 404 and not_found else None
                    raise self._api_error(response, what, hint=hint)
                else:
                    wait = self.retry.backoff(attempt)
                failure = self._problem_text(response)
            if attempt < self.retry.attempts:
                self._sleep(wait)
        raise RemoteAPIError(self._redact(
            f"RunPod {what} failed after {self.retry.attempts} tries: {failure}; "
            f"try again later, or check {BASE_URL_VAR}"
        ))

    def _rate_limit_wait(self, response: requests.Response, what: str, attempt: int) -> float:
        """Seconds to wait after a 429: Retry-After if given (failing at once when too long), else backoff."""
        wait = _retry_after_s(response)
        if wait is None:
            return self.retry.backoff(attempt)
        if wait > self.retry.max_retry_after_s:
            raise RemoteAPIError(self._redact(
                f"RunPod {what}: rate limited (HTTP 429); RunPod asks to wait {wait:.0f} s, try again then"
            ))
        return wait

    def _exchange(self, method: str, url: str, timeout: float, **kwargs: Any) -> requests.Response:
        """One HTTP exchange under a whole-request deadline; every failure is a `_TransportFailure`."""
        deadline = Deadline(timeout)
        try:
            return deadline.call(lambda: self._session.request(method, url, timeout=timeout, **kwargs))
        except (requests.RequestException, http.client.HTTPException, urllib3.exceptions.HTTPError, OSError,
                AnswerTooLarge, DeadlinePassed) as err:
            raise _transport_failure(err, deadline, self.base_url) from None

    def _send_once(self, method: str, path: str, body: Optional[dict[str, Any]], what: str, check: str) -> requests.Response:
        """One write request. A transport failure, or Ctrl-C / SIGTERM while it is in flight, may have applied it."""
        try:
            return self._exchange(method, self.base_url + path, self.write_timeout_s, json=body, allow_redirects=False)
        except _TransportFailure as err:
            raise self._ambiguous(what, err.reason, check) from None
        except KeyboardInterrupt as stop:
            raise Interrupted.by(stop, self._redact(f" while RunPod {what} was in flight; it may or may not have been applied: {check}")) from None

    @contextmanager
    def _answer_to_a_write(self, what: str, check: str) -> Iterator[None]:
        """Reading the answer to a write that was sent: any failure that is not already one of the
        client's own lines (a bug, a header h3 cannot parse) still says it may have been applied."""
        try:
            yield
        except (RemoteAPIError, Interrupted):
            raise
        except KeyboardInterrupt as stop:
            raise Interrupted.by(stop, self._redact(f" while reading RunPod's answer to {what}; it may or may not have been applied: {check}")) from None
        except Exception as err:
            raise self._ambiguous(what, f"an answer h3 failed to interpret ({type(err).__name__})", check) from None

    def _ambiguous(self, what: str, reason: str, check: str) -> RemoteAPIError:
        """The one message for a write whose outcome is unknown."""
        return RemoteAPIError(self._redact(f"RunPod {what}: {reason}; it may or may not have been applied: {check}"))

    # --- answers and errors ----------------------------------------------------------------------

    def _json(self, response: requests.Response, what: str) -> Any:
        """The answer's JSON, read as h3 reads any JSON (`h3core.files.text`: bounded in depth and numbers)."""
        try:
            return parse_json(response.content, f"RunPod {what}: HTTP {response.status_code} with a body that is not JSON h3 reads",
                              f"is {BASE_URL_VAR} ({self.base_url}) RunPod's API?", error=RemoteAPIError)
        except RemoteAPIError as err:
            raise RemoteAPIError(self._redact(str(err))) from None

    def _parse(self, model: type[Model], data: Any, what: str) -> Model:
        try:
            return model.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise RemoteAPIError(self._redact(
                f"RunPod {what}: unexpected answer ({where}: {first['msg']}); h3's RunPod client may need an update"
            )) from None

    def _problem_text(self, response: requests.Response) -> str:
        """'HTTP 404 Not Found: pod not found (errors: ...)' from an RFC 9457 body, or the status line."""
        try:
            problem = parse_json(response.content, "the error body", "", error=RemoteAPIError)
        except RemoteAPIError:
            problem = None
        if not isinstance(problem, dict):
            return f"HTTP {response.status_code} {response.reason or ''}".strip()
        title = problem.get("title") or response.reason or ""
        text = f"HTTP {response.status_code} {title}".strip()
        if problem.get("detail"):
            text += f": {problem['detail']}"
        errors = problem.get("errors")
        if isinstance(errors, list) and errors:
            text += " (" + "; ".join(str(e) for e in errors[:5]) + ")"
        return _one_line(self._redact(text))  # redact first: a cut must not split the key out of reach

    def _api_error(self, response: requests.Response, what: str, hint: Optional[str] = None) -> RemoteAPIError:
        status = response.status_code
        if hint is None:
            hint = _STATUS_HINTS.get(status)
        if hint is None and status == 429:
            hint = _rate_limited_hint(response)
        if hint is None and status >= 500:
            hint = "RunPod had a server error"
        message = f"RunPod {what} failed: {self._problem_text(response)}"
        return RemoteAPIError(self._redact(message + (f"; {hint}" if hint else "")))

    def _create_hint(self, response: requests.Response) -> Optional[str]:
        status = response.status_code
        if status == 400:
            return "no capacity there right now, or a rule RunPod checks: pick another data center from `h3 pod catalog`"
        if status == 429:
            return "nothing was created; " + _rate_limited_hint(response)
        return (_STATUS_HINTS.get(status) or "RunPod refused it") + "; nothing was created"

    def _unknown_pod(self, pod_id: str) -> str:
        return f"unknown pod id {pod_id!r}; `h3 pod list` shows your pods"

    def _redact(self, text: str) -> str:
        return redact(text, self._api_key)


def _reason_of(err: RemoteAPIError) -> str:
    """The part of a client error after 'RunPod <what>: ' (for wrapping it in another message)."""
    return str(err).split(": ", 1)[-1]

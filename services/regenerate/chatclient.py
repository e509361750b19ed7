"""A client of an OpenAI-compatible chat endpoint (``POST {base}/chat/completions``): SGLang's and vLLM's, a hosted
API, or eaglet's reference server, all through the same path.

Retries what a busy or restarting server answers (429, 5xx, timeouts, refused and dropped connections) with
exponential backoff and jitter, honouring ``Retry-After``; anything else (400: a prompt over the context, 401: a bad
key) fails the prompt at once with the server's reason. The key is sent as a bearer token and never logged.
"""

import logging
import random
import time
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class EndpointError(RuntimeError):
    """The endpoint refused a request, or kept failing it past the tries allowed; the message says why."""


@dataclass(frozen=True)
class Completion:
    content: str
    reasoning: str | None
    """The reasoning of a reasoning model, where the server parses it out (``reasoning_content``)."""
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    tries: int


class ChatClient:
    """Thread-safe (one ``httpx.Client``): the jobs call it from as many threads as their concurrency."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_tries: int = 8,
        connections: int = 8,
        sleep=time.sleep,
    ):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, limits=limits)
        self.url = base_url
        self.model = model
        self.max_tries = max_tries
        self.sleep = sleep

    def close(self) -> None:
        self.http.close()

    def complete(
        self, messages: list[dict[str, str]], *, max_tokens: int, temperature: float, top_p: float
    ) -> Completion:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "n": 1,
            "stream": False,
        }
        for tries in range(1, self.max_tries + 1):
            try:
                response = self.http.post("/chat/completions", json=body)
            except (httpx.TimeoutException, httpx.TransportError) as e:
                why, wait = f"{type(e).__name__}: {e}", None
            else:
                if response.status_code == 200:
                    return _completion(response, tries)
                why = f"HTTP {response.status_code}: {_reason(response)}"
                if response.status_code not in RETRY_STATUS:
                    raise EndpointError(f"{self.url} refused the request: {why}")
                wait = _retry_after(response)
            if tries == self.max_tries:
                raise EndpointError(f"{self.url}: {why}; gave up after {tries} tries")
            delay = wait if wait is not None else _backoff(tries)
            log.warning("%s: %s; try %d of %d again in %.1fs", self.url, why, tries + 1, self.max_tries, delay)
            self.sleep(delay)
        raise AssertionError("unreachable")


def _backoff(tries: int) -> float:
    """Full jitter: a crowd of clients that failed together does not come back together."""
    return random.uniform(0, min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (tries - 1)))


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return min(BACKOFF_MAX_S, max(0.0, float(response.headers["retry-after"])))
    except (KeyError, ValueError):
        return None  # absent, or an HTTP date: our own backoff


def _reason(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:300]
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])[:300]
    return str(body)[:300]


def _completion(response: httpx.Response, tries: int) -> Completion:
    try:
        body = response.json()
        choice = body["choices"][0]
        message = choice["message"]
        usage = body.get("usage") or {}
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise TypeError(f"content is {type(content).__name__}")
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        return Completion(
            content=content,
            reasoning=reasoning if isinstance(reasoning, str) and reasoning else None,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            finish_reason=str(choice.get("finish_reason") or ""),
            tries=tries,
        )
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise EndpointError(f"answer is not a chat completion ({type(e).__name__}: {e}): {response.text[:200]}") from e

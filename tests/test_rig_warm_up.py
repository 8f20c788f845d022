"""The P/D warm-up of the test rig and the demo (``rig.proxy.warm_up``): a loaded machine
can miss vLLM's 5 s side-channel handshake or leave an engine's HTTP server silent for seconds,
so a failed request and an HTTP error or timeout are both retried, with a growing pause, and the
last reason is reported when every attempt failed."""

from __future__ import annotations

import urllib.error

import pytest

from lab.rig import proxy


def _result(error: str | None, tokens: list[int]) -> proxy.PDResult:
    pre = proxy.Completion(token_ids=[1], logprobs=[0.0], wall_s=0.1)
    dec = proxy.Completion(token_ids=tokens, logprobs=[0.0] * len(tokens), wall_s=0.2,
                           error=error)
    return proxy.PDResult(prefill=pre, decode=dec, ttft_s=0.3, transfer=None)


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(proxy.time, "sleep", slept.append)
    return slept


def _scripted(monkeypatch: pytest.MonkeyPatch, outcomes: list) -> list[int]:
    calls: list[int] = []

    def pd_request(p, d, prompt, max_tokens):
        calls.append(len(calls) + 1)
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(proxy, "pd_request", pd_request)
    return calls


def test_http_errors_and_failed_requests_are_retried(monkeypatch, sleeps) -> None:
    calls = _scripted(monkeypatch, [
        _result("handshake_setup_failed", []),
        TimeoutError("timed out"),  # what urlopen raises when /metrics is silent for 10 s
        urllib.error.URLError(ConnectionRefusedError(111, "refused")),
        _result(None, [7, 8]),
    ])
    log: list[str] = []
    res = proxy.warm_up(None, None, log=log)  # type: ignore[arg-type]
    assert res.decode.token_ids == [7, 8]
    assert calls == [1, 2, 3, 4]
    assert sleeps == [3.0, 6.0, 9.0]
    assert [line.split(":", 1)[0] for line in log] == [
        "warm-up attempt 1 failed", "warm-up attempt 2 failed", "warm-up attempt 3 failed"]
    assert "handshake_setup_failed" in log[0] and "timed out" in log[1]


def test_every_attempt_failing_names_the_last_reason(monkeypatch, sleeps) -> None:
    _scripted(monkeypatch, [_result("x", [])] * 4 + [TimeoutError("stream exceeded 120s")])
    with pytest.raises(RuntimeError, match="failed 5 times; last: TimeoutError: stream exceeded"):
        proxy.warm_up(None, None)  # type: ignore[arg-type]
    assert sleeps == [3.0, 6.0, 9.0, 12.0]


def test_other_exceptions_are_not_swallowed(monkeypatch, sleeps) -> None:
    _scripted(monkeypatch, [RuntimeError("P returned no kv_transfer_params")])
    with pytest.raises(RuntimeError, match="no kv_transfer_params"):
        proxy.warm_up(None, None)  # type: ignore[arg-type]
    assert sleeps == []

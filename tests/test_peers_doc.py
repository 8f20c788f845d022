"""docs/peers.md's measured tables are what the raw records say (``lab/results/peers.jsonl``,
``python -m scripts.peer_restart report --write``), and the verdict a table row reads is the
one its answers give."""

from __future__ import annotations

from lab import peers_report


def test_the_published_tables_are_the_records():
    text = peers_report.DOC.read_text()
    assert peers_report.render(text) == text, "run: python -m scripts.peer_restart report --write"


def _a(outcome: str, tag: str = "fresh-0") -> dict:
    return {"outcome": outcome, "tag": tag}


def test_verdicts():
    stale = [_a("error", "stale/s0"), _a("error", "stale/s1")]
    assert peers_report.verdict(stale, [_a("ok"), _a("ok")]) == "recovered"
    assert peers_report.verdict(stale, [_a("error"), _a("ok")], 30) == \
        "recovered once P's 30 s lease ran out (1 failed before)"
    assert peers_report.verdict(stale, [_a("error")] * 3) == "not recovered"
    assert peers_report.verdict(stale, [_a("ok"), _a("error")]) == "recovered, then failed"
    assert peers_report.verdict(stale, [_a("ok"), _a("wrong")]) == "**WRONG TOKENS**"
    assert peers_report.verdict([_a("ok", "stale/s0")], [_a("ok")]) == "stale params answered"

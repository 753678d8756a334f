"""trainer/verifier.py without reasoning-gym: a worker that never starts is the run's one-line error, not rewards of 0
(the scoring itself, a reply that runs over included, is tests/test_reasoning_gym.py's)."""

from __future__ import annotations

import pytest

from trainer import verifier


def test_a_verifier_worker_that_never_starts_is_one_line(monkeypatch):
    monkeypatch.setattr(verifier, "_WORKER_MODULE", "trainer.no_such_worker")
    v = verifier.Verifier(timeout=5.0)
    try:
        with pytest.raises(verifier.VerifierError) as e:
            v.score("<answer>1</answer>", {"task": "chain_sum", "config": {}, "entry": {}})
    finally:
        v.close()
    msg = str(e.value)
    assert msg.startswith("--reasoning_gym: could not start the verifier process (it exited; its stderr ends: ")
    assert "No module named trainer.no_such_worker" in msg and "\n" not in msg and v.timeouts == v.failures == 0


def test_configure_takes_seconds_and_keeps_a_verifier_with_the_same_time(monkeypatch):
    monkeypatch.setattr(verifier, "_shared", [])
    with pytest.raises(ValueError, match="--verifier_timeout 0.0 must be a number of seconds > 0"):
        verifier.configure(0.0)
    verifier.configure(3.0)
    first = verifier.shared()
    verifier.configure(3.0)
    assert verifier.shared() is first and first.timeout == 3.0 and verifier.timeouts() == 0
    verifier.configure(4.0)
    assert verifier.shared() is not first and verifier.shared().timeout == 4.0
    verifier.shared().close()

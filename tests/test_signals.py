"""trainer/run/signals.py: a stop request arriving twice (scheduler + launcher) is one request; only a
Ctrl-C given again after the grace window stops at once."""

from __future__ import annotations

import signal

import pytest

from trainer.run import signals as S


def _request(monkeypatch) -> tuple[S.StopRequest, list[float]]:
    clock = [100.0]
    monkeypatch.setattr(S.time, "monotonic", lambda: clock[0])
    return S.StopRequest(grace_s=1.0), clock


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_repeat_within_the_grace_window_is_absorbed(monkeypatch, sig):
    req, clock = _request(monkeypatch)
    req._handle(sig, None)
    clock[0] += 0.05  # torchrun forwarding the scheduler's signal, or the terminal's Ctrl-C
    req._handle(sig, None)
    assert req.signal == signal.Signals(sig).name


def test_only_a_later_ctrl_c_stops_at_once(monkeypatch, capsys):
    req, clock = _request(monkeypatch)
    req._handle(signal.SIGTERM, None)
    clock[0] += 30
    req._handle(signal.SIGTERM, None)  # a scheduler repeating itself: still finishing the step
    req._handle(signal.SIGUSR1, None)
    assert "already stopping" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt, match="second signal"):
        req._handle(signal.SIGINT, None)
    req2, clock = _request(monkeypatch)
    req2._handle(signal.SIGINT, None)
    clock[0] += 1.5
    with pytest.raises(KeyboardInterrupt):
        req2._handle(signal.SIGINT, None)


def test_install_and_restore_put_the_handlers_back():
    before = signal.getsignal(signal.SIGTERM)
    req = S.StopRequest().install()
    assert signal.getsignal(signal.SIGTERM) == req._handle
    req.restore()
    assert signal.getsignal(signal.SIGTERM) == before

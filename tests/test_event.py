"""ep_comm.EventOverlap with DeepEP 2.x's additions: ``current_stream_wait(release_handle=...)``,
``with event(release_handle=True)``, and a hook that runs once after the next wait. On the CPU an
``EventHandle`` is complete when made, so waiting only runs the bookkeeping."""
from __future__ import annotations

import pytest

from ep_comm import EventHandle, EventOverlap


def test_current_stream_wait_keeps_or_releases_the_handle():
    event = EventOverlap(EventHandle())
    event.current_stream_wait()
    assert event.event is not None
    event.current_stream_wait(release_handle=True)
    assert event.event is None
    with pytest.raises(ValueError, match="no event"):
        event.current_stream_wait()


def test_context_manager_releases_only_when_called_with_release_handle():
    event = EventOverlap(EventHandle())
    with event:
        pass
    assert event.event is not None
    with event(release_handle=True) as same:
        assert same is event
    assert event.event is None
    with event:  # no event left: nothing to wait for
        pass


def test_hook_after_wait_runs_once():
    calls = []
    event = EventOverlap(EventHandle())
    event.register_hook_after_wait(lambda: calls.append("hook"))
    with pytest.raises(ValueError, match="already registered"):
        event.register_hook_after_wait(lambda: None)
    event.current_stream_wait()
    event.current_stream_wait()
    assert calls == ["hook"]

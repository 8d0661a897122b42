"""Promotion (``clm.checkpoint.promotion``) on a folder and on real S3 (SeaweedFS): candidates do not move
``latest``; promotion moves it forward only, audited; of concurrent promotions against one live version exactly
one wins; a promoter that dies between its writes leaves the pointer whole and the history consistent."""

from __future__ import annotations

import threading

import pytest

from clm.checkpoint import save_checkpoint
from clm.checkpoint.promotion import LiveMoved, PromotionRefused, live_version, promote, read_audit, record_refusal
from clm.checkpoint.versions import checkpoint_files, publish_files, read_latest
from clm.heads import CLMHeadPair

from support.storage import FINGERPRINT, SMALL


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("checkpoint") / "ckpt"
    save_checkpoint(folder, CLMHeadPair(SMALL, seed=4), FINGERPRINT)
    return checkpoint_files(folder)


def test_a_candidate_waits_for_promotion_and_every_move_is_audited(store, files):
    assert publish_files(store, "heads", files) == 1  # published as before: live at once
    assert publish_files(store, "heads", files, promote=False) == 2  # a candidate
    assert live_version(store, "heads") == 1

    done = promote(store, "heads", 2, actor="ops@test", reason="gate passed", expected_live=1,
                   verdict={"passed": True})
    assert (done.promoted, done.live_before, done.live_after) == (True, 1, 2)
    assert live_version(store, "heads") == 2
    history = read_audit(store, "heads")
    assert [(e["action"], e["from_version"], e["to_version"]) for e in history] == [("promoted", "v0001", "v0002")]
    assert history[0]["actor"] == "ops@test" and history[0]["verdict"] == {"passed": True}
    assert not history[0]["forced"]


def test_latest_never_moves_backwards_and_refusals_are_audited(store, files):
    for _ in range(3):
        publish_files(store, "m", files)
    with pytest.raises(PromotionRefused, match="v0002 is not newer than the live v0003"):
        promote(store, "m", 2, actor="a", forced=True, reason="roll back")
    with pytest.raises(PromotionRefused, match="no complete version v0009"):
        promote(store, "m", 9, actor="a")
    record_refusal(store, "m", 3, actor="trainer job j1", reason="gate failed", verdict={"passed": False})
    assert live_version(store, "m") == 3
    assert [(e["action"], e["to_version"]) for e in read_audit(store, "m")] == [
        ("refused", "v0002"), ("refused", "v0009"), ("refused", "v0003")]


def test_two_promotions_against_one_live_version_leave_one_winner(store, files):
    publish_files(store, "race", files)
    candidates = [publish_files(store, "race", files, promote=False) for _ in range(4)]
    barrier = threading.Barrier(len(candidates))
    outcomes: dict[int, str] = {}

    def attempt(version: int) -> None:
        barrier.wait()
        try:
            promote(store, "race", version, actor=f"p{version}", expected_live=1)
            outcomes[version] = "won"
        except LiveMoved:
            outcomes[version] = "live moved"
        except PromotionRefused:  # a lower candidate arriving after a higher one won: backwards
            outcomes[version] = "refused"

    threads = [threading.Thread(target=attempt, args=(version,)) for version in candidates]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [version for version, outcome in outcomes.items() if outcome == "won"]
    assert len(winners) == 1, outcomes
    assert live_version(store, "race") == winners[0]
    history = read_audit(store, "race")
    assert [e["to_version"] for e in history if e["action"] == "promoted"] == [f"v{winners[0]:04d}"]
    assert sum(e["action"] == "refused" for e in history) == len(candidates) - 1


@pytest.mark.parametrize("moved", [False, True])
def test_a_promoter_dying_between_its_writes_leaves_one_story(store, files, monkeypatch, moved):
    """The intent is written, then the process dies before (or right after) moving latest: the pointer is whole,
    and the history reports the intent as abandoned (or promoted) from where the pointer is."""
    publish_files(store, "crash", files)
    publish_files(store, "crash", files, promote=False)
    real_put = store.put

    def dying_put(key, data, **conditions):
        if key.endswith("/latest"):
            if moved:
                real_put(key, data, **conditions)
            raise SystemExit("killed")  # what a SIGKILL leaves: no further write of this promoter
        return real_put(key, data, **conditions)

    monkeypatch.setattr(store, "put", dying_put)
    with pytest.raises(SystemExit):
        promote(store, "crash", 2, actor="dies", expected_live=1)
    monkeypatch.undo()
    assert read_latest(store, "crash")[0] == (2 if moved else 1)
    (entry,) = read_audit(store, "crash")
    assert entry["recovered"] and entry["action"] == ("promoted" if moved else "abandoned")
    if not moved:  # the next promoter succeeds against the version still live
        promote(store, "crash", 2, actor="again", expected_live=1)
        assert [e["action"] for e in read_audit(store, "crash")] == ["abandoned", "promoted"]

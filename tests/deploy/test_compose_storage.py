"""`make test-compose`'s storage driver: overlay2 where overlay mounts work, else vfs (several times the disk).

The choice is made by mounting a real overlay in the run's work folder, so a machine
or container that cannot (no CAP_SYS_ADMIN, an upper file system overlay refuses)
falls back to vfs instead of failing at the first image layer.
"""

from __future__ import annotations

import subprocess

import pytest

from clm_devtools.compose import STORAGE_DRIVERS, choose_storage_driver, overlay_mounts_work


def test_a_named_driver_is_used_as_named_and_an_unknown_one_is_refused(tmp_path):
    for driver in STORAGE_DRIVERS:
        assert choose_storage_driver(driver, tmp_path) == driver
    with pytest.raises(ValueError, match="'zfs'.*auto or one of overlay2, vfs"):
        choose_storage_driver("zfs", tmp_path)


def test_auto_follows_a_real_overlay_mount_and_leaves_nothing_behind(tmp_path):
    works = overlay_mounts_work(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the probe's folders are gone, nothing left mounted
    mounts = subprocess.run(["cat", "/proc/mounts"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in mounts
    assert choose_storage_driver("auto", tmp_path) == ("overlay2" if works else "vfs")

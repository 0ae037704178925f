"""bench/harness/bigmem.big_memory: a big part holds the lock file `flock <file> <command>` takes."""
import subprocess

from bench.harness.bigmem import LOCK_ENV, MIB_ENV, big_memory


def flock_is_free(path):
    """Whether flock(1), the lock people take by hand, gets the file right now."""
    return subprocess.run(["flock", "-n", str(path), "true"]).returncode == 0


def test_a_part_over_the_threshold_holds_the_lock_flock_1_takes_until_it_ends(tmp_path, monkeypatch):
    lock = tmp_path / "bigmem.lock"
    monkeypatch.setenv(LOCK_ENV, str(lock))
    monkeypatch.setenv(MIB_ENV, "6144")
    with big_memory(17000, "10000000x64") as held:
        assert held["lock"] == str(lock)
        assert not flock_is_free(lock)
    assert flock_is_free(lock)


def test_a_part_under_the_threshold_takes_no_lock(tmp_path, monkeypatch):
    lock = tmp_path / "bigmem.lock"
    monkeypatch.setenv(LOCK_ENV, str(lock))
    with big_memory(6000, "1000000x64") as held:
        assert held is None and not lock.exists()


def test_without_the_variable_nothing_is_locked(monkeypatch):
    monkeypatch.delenv(LOCK_ENV, raising=False)
    with big_memory(17000, "10000000x64") as held:
        assert held is None

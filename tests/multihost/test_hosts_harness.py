"""The many-hosts harness (tests/hosts.py) does what the multi-host tests
rely on: each host has its own address on one bridge, its own loopback and hostname,
its own /tmp and home, everything else read-only; checkpoint files left on a
host fail the check; processes die by SIGKILL per process and per host; a
killed test run's namespaces and processes are removed by the next run; the
object store on its own host is reached by the others. Real namespaces and
processes, no TensorFlow (these tests are cheap)."""
import os
import signal
import subprocess
import sys
import time

import pytest

import hosts

PY = sys.executable


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    with hosts.network_or_skip(tmp_path_factory.mktemp("hosts")) as n:
        yield n


@pytest.fixture(scope="module")
def pair(net):
    return net.host("a"), net.host("b")


def run(host, code, timeout=60):
    """Runs Python `code` on `host` to completion: (exit code, stdout lines)."""
    p = host.start([PY, "-c", code], name=f"py-{time.monotonic_ns()}")
    return p.wait(timeout), p.lines


SERVE = ("import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
         "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print('listening', flush=True); "
         "[c.sendall(b'hello') or c.close() for c in iter(lambda: s.accept()[0], None)]")


def listen(host, address, port):
    p = host.start([PY, "-c", SERVE, address, str(port)], name=f"listen-{address}-{port}")
    p.wait_line(lambda ln: ln == "listening", timeout=60)
    return p


def test_each_host_has_its_own_address_and_reaches_the_others_over_the_bridge(pair):
    a, b = pair
    assert a.address != b.address and a.address.startswith("10.213.") and b.address.startswith("10.213.")
    server = listen(b, b.address, 7001)
    try:
        assert a.connect(7001, address=b.address)
        code, lines = run(a, f"import socket; print(socket.create_connection(('{b.address}', 7001), 5).recv(5))")
        assert code == 0 and lines == ["b'hello'"], lines
    finally:
        server.kill()


def test_each_host_has_its_own_hostname(pair):
    for h in pair:
        code, lines = run(h, "import socket; print(socket.gethostname())")
        assert code == 0 and lines == [h.name], lines


def test_hosts_share_no_loopback(pair):
    a, b = pair
    server = listen(b, "127.0.0.1", 7002)
    try:
        assert b.connect(7002, address="127.0.0.1")
        assert not a.connect(7002, address="127.0.0.1")
    finally:
        server.kill()


def test_no_host_address_is_in_the_machines_own_network_namespace(pair):
    out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert "10.213." not in out
    assert all(h.netns in os.listdir("/run/netns") for h in pair)


def test_each_host_has_a_private_tmp_and_home(pair, tmp_path):
    a, b = pair
    (tmp_path / "the-tests-own").write_text("x")
    code, lines = run(a, "import os; open('/tmp/mine', 'w').write('a'); "
                         "open(os.path.expanduser('~/mine'), 'w').write('a'); print(sorted(os.listdir('/tmp')))")
    # neither the test's /tmp nor b's; only the entries holding the checkout or interpreter, if under /tmp
    assert code == 0 and lines == [str(sorted(["mine", *a.net.tmp_shares]))], lines
    assert open(os.path.join(a.tmp, "mine")).read() == "a" and os.path.exists(os.path.join(a.home, "mine"))
    code, lines = run(b, "import os; print(os.path.exists('/tmp/mine'), os.path.exists(os.path.expanduser('~/mine')))")
    assert code == 0 and lines == ["False False"], lines
    assert not os.path.exists("/tmp/mine")


def test_the_checkout_and_everything_else_but_the_private_directories_are_read_only(pair):
    a, _ = pair
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code, lines = run(a, "import errno\n"
                         f"for d in ({checkout!r}, '/var/tmp', '/etc'):\n"
                         "    try:\n"
                         "        open(d + '/evh-probe', 'w')\n"
                         "        print(d, 'writable')\n"
                         "    except OSError as e:\n"
                         "        print(d, errno.errorcode[e.errno])\n"
                         f"print(open({os.path.join(checkout, 'pyproject.toml')!r}).read(9))")
    assert code == 0 and lines == [f"{checkout} EROFS", "/var/tmp EROFS", "/etc EROFS", "[build-sy"], lines


def test_a_checkpoint_file_left_on_a_host_fails_the_check(net):
    h = net.host("ckpt-writer")
    net.assert_no_checkpoint_files()
    code, _ = run(h, "import os; d = '/tmp/job/delta-0000000002'; os.makedirs(d); "
                     "open(d + '/ckpt.data-00000-of-00001', 'wb').write(b'rows')")
    assert code == 0
    with pytest.raises(AssertionError, match=r"ckpt-writer: ckpt-writer/tmp/job/delta-0000000002/ckpt\.data"):
        net.assert_no_checkpoint_files()
    os.remove(os.path.join(h.tmp, "job", "delta-0000000002", "ckpt.data-00000-of-00001"))
    assert net.checkpoint_files() == {}   # nothing left; the write trace still names it
    assert "tmp/job/delta-0000000002/ckpt.data-00000-of-00001" in net.checkpoint_writes()["ckpt-writer"]


def test_sigkill_ends_one_process_or_every_process_of_a_host(net):
    h = net.host("killed")
    p1 = h.start([PY, "-c", "import time; print('up', flush=True); time.sleep(600)"], name="p1")
    p2 = h.start([PY, "-c", "import time; print('up', flush=True); time.sleep(600)"], name="p2")
    p1.wait_line(lambda ln: ln == "up")
    p2.wait_line(lambda ln: ln == "up")
    p1.kill()
    assert p1.popen.returncode == -signal.SIGKILL and p2.alive()
    h.kill_all()
    assert p2.popen.returncode == -signal.SIGKILL and h.pids() == []


def test_a_killed_test_run_leaves_nothing_behind_after_the_next_run_starts(tmp_path):
    if hosts.available() is not None:
        pytest.skip(f"many-hosts test needs network and mount namespaces: {hosts.available()}")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys; sys.path.insert(0, {tests!r}); import hosts; net = hosts.Network({str(tmp_path / 'w')!r}); "
            "p = net.host('h').start([sys.executable, '-c', 'import time; print(1, flush=True); time.sleep(600)']); "
            "p.wait_line(lambda ln: ln == '1'); print(net.run_prefix, p.pid, flush=True); import time; time.sleep(600)")
    driver = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    prefix, pid = driver.stdout.readline().split()
    driver.kill()   # SIGKILL: no cleanup of its own ran
    driver.wait()
    assert [n for n in os.listdir("/run/netns") if n.startswith(prefix)]
    with hosts.Network(tmp_path / "next"):
        assert not [n for n in os.listdir("/run/netns") if n.startswith(prefix)]
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}")


def test_the_object_store_on_its_own_host_is_what_the_other_hosts_share(net):
    store = net.object_store()
    writer, reader = net.host("s3-writer"), net.host("s3-reader")
    root = store.root("probe")
    code, _ = run(writer, f"import fsspec\nwith fsspec.open({root + '/obj'!r}, 'wb') as f:\n    f.write(b'shared')")
    assert code == 0, open(writer.procs[-1].log_path).read()
    assert store.keys("probe/") == ["probe/obj"]
    code, lines = run(reader, f"import fsspec\nwith fsspec.open({root + '/obj'!r}, 'rb') as f:\n    print(f.read())")
    assert code == 0 and lines == ["b'shared'"], open(reader.procs[-1].log_path).read()


@pytest.fixture
def writes_of(net):
    """Runs Python code to completion on a new host of that name: call it with (name, code); asserts
    the code succeeded and returns the paths the check saw that host write (net.checkpoint_writes)."""
    def run_on(name, code):
        h = net.host(name)
        status, _ = run(h, code)
        assert status == 0, open(h.procs[-1].log_path).read()
        return net.checkpoint_writes()[name]
    return run_on


def test_a_checkpoint_file_written_and_deleted_between_scans_fails_the_check(net, writes_of):
    written = writes_of("transient", "import os; p = '/tmp/ckpt.tmp-3'; open(p, 'wb').write(b'rows'); os.remove(p); "
                                     "d = '/tmp/evstore-stage-1-x'; os.makedirs(d); p = d + '/ckpt.tmp-4'; "
                                     "open(p, 'wb').write(b'rows'); os.remove(p); os.rmdir(d)")
    assert "transient" not in net.checkpoint_files()   # nothing left to scan
    # The file in a watched directory by its name; the new directory at least by its own.
    assert "tmp/ckpt.tmp-3" in written and "tmp/evstore-stage-1-x/" in written, written
    with pytest.raises(AssertionError, match=r"written outside the object store: .*transient: tmp/ckpt\.tmp-3"):
        net.assert_no_checkpoint_files()


def test_a_file_holding_a_bundle_index_fails_the_check_whatever_its_name(writes_of):
    written = writes_of("renamed", "import tensorflow as tf; v = tf.Variable([1.0]); "
                                   "p = tf.train.Checkpoint(v=v).write('/tmp/x'); import os; "
                                   "os.rename(p + '.index', '/tmp/innocent'); print(p)")
    assert "tmp/innocent" in written and "tmp/x.index" in written


def test_a_restore_download_deleted_at_once_still_fails_the_check(writes_of):
    written = writes_of("restorer", "import os; d = '/tmp/evstore-restore-full-0000000001-ab'; os.makedirs(d); "
                                    "open(d + '/ckpt.index', 'wb').write(b'x'); import shutil; shutil.rmtree(d)")
    assert written[0] == "tmp/evstore-restore-full-0000000001-ab/"

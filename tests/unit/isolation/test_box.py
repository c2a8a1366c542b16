"""The box for model-written code (`streamrl.isolation.box`), attacked as a policy under RL
would: each test is a program that tries to get out, and asserts that the box held."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from streamrl.isolation.box import BOX_ENVIRONMENT, BoxLimits, BoxResult, run_in_box

LIMITS = BoxLimits(wall_s=10.0, memory_mb=512)


def run(code: str, limits: BoxLimits = LIMITS, **kwargs: object) -> BoxResult:
    files = {"main.py": textwrap.dedent(code).encode()}
    return run_in_box(["python", "/box/main.py"], limits=limits, files=files, **kwargs)  # type: ignore[arg-type]


def out(result: BoxResult) -> str:
    return result.stdout.decode()


def processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in process.info["cmdline"] or ()):
            found.append(process)
    return found


def test_a_program_runs_with_its_stdin_files_and_output() -> None:
    result = run_in_box(
        ["python", "/box/main.py", "arg"],
        limits=LIMITS,
        files={
            "main.py": b"import sys\ndata = sys.stdin.buffer.read()\n"
            b"print(len(data), open('/box/extra.txt').read(), sys.argv[1:])\n"
            b"print('warning', file=sys.stderr)\n",
            "extra.txt": b"hello",
        },
        stdin=b"x" * 3_000_000,  # larger than a pipe's buffer: written while it is read
    )
    assert out(result) == "3000000 hello ['arg']\n"
    assert result.stderr == b"warning\n"
    assert (result.returncode, result.timed_out, result.output_cut) == (0, False, False)


def test_the_program_is_an_unprivileged_user_without_capabilities() -> None:
    result = run(
        """
        import os
        status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())
        print(os.getuid(), os.getgid(), int(status['CapEff'], 16), status['NoNewPrivs'].strip())
        """
    )
    uid, gid, capabilities, no_new_privs = out(result).split()
    assert int(uid) != 0
    assert int(gid) != 0
    assert (capabilities, no_new_privs) == ("0", "1")


def test_processes_it_starts_cannot_reach_the_host(tmp_path: Path) -> None:
    """With no audit hook to remove, subprocess, os.system and ctypes' system all run — as the
    box's unprivileged user, inside its read-only view."""
    target = tmp_path / "pwned"
    result = run(
        f"""
        import ctypes, os, subprocess
        print(subprocess.run(['id', '-u'], capture_output=True, text=True).stdout.strip())
        os.system('touch {target} 2>/dev/null')
        ctypes.CDLL(None).system(b'touch {target} /usr/pwned {sys.prefix}/pwned 2>/dev/null')
        print(os.path.exists('{tmp_path}'))
        """
    )
    uid, host_dir_visible = out(result).split()
    assert int(uid) != 0
    assert host_dir_visible == "False"
    assert not target.exists()
    assert not Path("/usr/pwned").exists()
    assert not Path(sys.prefix, "pwned").exists()


def test_nothing_outside_scratch_is_writable() -> None:
    """New files only, so that a box that failed would not have damaged what it wrote to."""
    name = f"pwned-{uuid.uuid4().hex}"
    stdlib = Path(json.__file__).parent.parent  # visible read-only in the box
    site_packages = Path(psutil.__file__).parent.parent
    targets = [Path("/usr/lib"), stdlib, site_packages, Path(sys.prefix), Path("/etc"), Path("/")]
    result = run(
        f"""
        import errno
        for folder in {[str(t) for t in targets]!r} + ['/box', '/proc']:
            try:
                open(folder + '/{name}', 'w').write('pwned')
                print('wrote', folder)
            except OSError as e:
                print(errno.errorcode[e.errno])
        open('/tmp/mine.txt', 'w').write('scratch is writable')
        print(open('/tmp/mine.txt').read())
        """
    )
    lines = out(result).splitlines()
    written = [t / name for t in targets if (t / name).exists()]
    for path in written:
        path.unlink()
    assert written == []
    assert not any(line.startswith("wrote") for line in lines), lines
    assert lines[-1] == "scratch is writable"


def test_scratch_is_private_and_bounded() -> None:
    limits = BoxLimits(wall_s=10.0, memory_mb=512, scratch_mb=8, file_mb=64)
    result = run(
        """
        import os
        print(sorted(os.listdir('/tmp')))
        try:
            with open('/tmp/big', 'wb') as f:
                f.write(b'x' * (32 * 1024**2))
        except OSError as e:
            print('refused', e.strerror)
        """,
        limits,
    )
    listed, refused = out(result).splitlines()
    # Private: nothing of the host's /tmp, only the way to an interpreter bound under it.
    prefixes = (sys.prefix, sys.base_prefix)
    assert all(any(p.startswith(f"/tmp/{n}") for p in prefixes) for n in eval(listed))
    assert refused == "refused No space left on device"


def test_the_callers_environment_and_its_credentials_are_not_visible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller's secrets are neither in the program's environment nor in any /proc entry it
    can read (the caller's own /proc/<pid>/environ included)."""
    secret = f"planted-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    result = run(
        f"""
        import glob, json, os
        seen = b''
        for path in glob.glob('/proc/[0-9]*/environ') + ['/proc/{os.getpid()}/environ']:
            try:
                seen += open(path, 'rb').read()
            except OSError:
                pass
        print(json.dumps([sorted(os.environ), len(glob.glob('/proc/[0-9]*')), b'{secret}' in seen]))
        """
    )
    names, processes_seen, leaked = json.loads(out(result))
    assert leaked is False
    assert set(names) <= {*BOX_ENVIRONMENT, "PWD"}
    assert processes_seen <= 3  # the box's init, the program (and the glob's own /proc/self)


def test_the_network_cannot_be_reached() -> None:
    with socket.socket() as server:  # a real listener on the host: reachable without the box
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run(
            f"""
            import socket
            try:
                socket.create_connection(('127.0.0.1', {port}), timeout=2)
                print('connected')
            except OSError as e:
                print('refused', type(e).__name__)
            print(socket.if_nameindex())
            """
        )
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # a connection made would wait in the backlog
            server.accept()
    refused, interfaces = out(result).splitlines()
    assert refused.startswith("refused")
    assert interfaces == "[(1, 'lo')]"  # the box's own loopback, down; no host interface


def test_a_setsid_child_does_not_outlive_the_call() -> None:
    marker = f"box-survivor-{uuid.uuid4().hex}"
    result = run(
        f"""
        import os, subprocess, sys
        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'],
                         start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)',
                                      '{marker}'])
        print('started')
        """
    )
    assert out(result) == "started\n"
    time.sleep(0.2)
    assert processes_with(marker) == []


def test_a_killed_worker_leaves_no_box_behind(tmp_path: Path) -> None:
    marker = f"box-orphan-{uuid.uuid4().hex}"
    program = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'], "
        "start_new_session=True)\n"
        "time.sleep(60)\n"
    )
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom streamrl.isolation.box import BoxLimits, run_in_box\n"
            "run_in_box(['python', '/box/main.py'], limits=BoxLimits(wall_s=60), "
            "files={'main.py': sys.argv[1].encode()})",
            program,
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while len(processes_with(marker)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(marker), "the box never started its child"
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    deadline = time.monotonic() + 5
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []


def test_no_namespace_of_its_own_and_no_io_uring() -> None:
    """Inside a user namespace of its own a program could mount a tmpfs around the scratch
    limit; the syscall filter refuses it, by each way in, while threads and processes work."""
    result = run(
        """
        import ctypes, errno, subprocess, threading
        libc = ctypes.CDLL(None, use_errno=True)
        def refused(value):
            return errno.errorcode.get(ctypes.get_errno(), '?') if value == -1 else 'allowed'
        CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x20000, 17
        print(refused(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS)))
        print(refused(libc.syscall(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)))  # clone, x86-64
        print(refused(libc.syscall(425, 8, ctypes.create_string_buffer(120))))  # io_uring_setup
        print(subprocess.run(['unshare', '--user', '--map-root-user', 'true']).returncode != 0)
        thread = threading.Thread(target=print, args=('thread',))
        thread.start()
        thread.join()
        print(subprocess.run(['true']).returncode)
        """
    )
    assert out(result).splitlines() == ["EPERM", "EPERM", "EPERM", "True", "thread", "0"]


def test_a_fork_bomb_is_stopped_at_the_process_limit() -> None:
    limits = BoxLimits(wall_s=10.0, memory_mb=256, processes=6)
    started = time.monotonic()
    result = run(
        """
        import os, time
        children = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                children += 1
        except OSError as e:
            print(children, type(e).__name__)
        """,
        limits,
    )
    children, error = out(result).split()
    assert int(children) <= 5
    assert error == "BlockingIOError"
    assert time.monotonic() - started < 5  # the sleeping children died with the box


def test_two_boxes_count_their_processes_apart() -> None:
    from concurrent.futures import ThreadPoolExecutor

    limits = BoxLimits(wall_s=10.0, memory_mb=256, processes=4)
    code = """
        import os, time
        pids = []
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                time.sleep(1)
                os._exit(0)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)
        print('ok')
        """
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: run(code, limits), range(2)))
    assert [out(r) for r in results] == ["ok\n", "ok\n"]


def test_a_memory_hog_gets_a_memory_error() -> None:
    result = run("data = bytearray(2 * 1024**3)\nprint('allocated')", BoxLimits(wall_s=10.0))
    assert "allocated" not in out(result)
    assert result.returncode == 1
    assert b"MemoryError" in result.stderr


def test_fifos_in_scratch_do_not_hang_the_call() -> None:
    started = time.monotonic()
    result = run(
        """
        import os
        for name in ('.stdout', '.stderr', 'out', 'err'):
            os.mkfifo(name)
        print('done')
        """
    )
    assert out(result) == "done\n"
    assert time.monotonic() - started < 5


def test_a_flood_of_output_is_cut_and_costs_only_its_time() -> None:
    limits = BoxLimits(wall_s=30.0, memory_mb=512, output_bytes=64 * 1024)
    result = run(
        """
        import sys
        chunk = b'a' * 1024**2
        for _ in range(100):
            sys.stdout.buffer.write(chunk)
            sys.stderr.buffer.write(chunk)
        sys.stderr.write('last words')
        """,
        limits,
    )
    assert result.returncode == 0
    assert result.output_cut
    assert result.stdout == b"a" * 64 * 1024
    assert len(result.stderr) == 64 * 1024
    assert result.stderr.endswith(b"last words")


def test_a_program_that_ignores_sigterm_is_killed_at_its_limit() -> None:
    marker = f"box-stubborn-{uuid.uuid4().hex}"
    started = time.monotonic()
    result = run(
        f"""
        import signal, subprocess, sys
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, '-c',
                          'import signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\n'
                          'time.sleep(60)', '{marker}'], start_new_session=True)
        while True:
            pass
        """,
        BoxLimits(wall_s=1.5, memory_mb=256),
    )
    elapsed = time.monotonic() - started
    assert result.timed_out
    assert result.returncode == -signal.SIGKILL
    assert 1.5 <= elapsed < 4
    assert processes_with(marker) == []


def test_a_program_that_cannot_be_found_says_so() -> None:
    result = run_in_box(["/usr/bin/no-such-program"], limits=LIMITS)
    assert result.returncode == 127
    assert b"cannot run /usr/bin/no-such-program" in result.stderr


def test_without_bwrap_the_box_refuses_with_the_fix(tmp_path: Path) -> None:
    no_bwrap = {**os.environ, "PATH": str(tmp_path)}
    probe = subprocess.run(
        [sys.executable, "-c", "from streamrl.isolation.box import check_box\ncheck_box()"],
        env=no_bwrap,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode != 0
    assert "BoxUnavailableError" in probe.stderr
    assert "apt-get install bubblewrap" in probe.stderr
    doctor = [sys.executable, "-m", "streamrl", "doctor"]
    failed = subprocess.run(doctor, env=no_bwrap, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    assert "FAIL  box for model-written code" in failed.stdout
    assert "apt-get install bubblewrap" in failed.stdout
    passed = subprocess.run(doctor, capture_output=True, text=True, timeout=120)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "ok    box for model-written code: bubblewrap" in passed.stdout


def test_an_interpreter_under_tmp_is_not_hidden_by_the_scratch(tmp_path: Path) -> None:
    """A virtualenv under /tmp (a CI checkout) is bound on top of the box's /tmp scratch."""
    import site
    import venv

    assert str(tmp_path).startswith("/tmp/")
    venv.create(tmp_path / "venv", with_pip=False)
    root = Path(__file__).resolve().parents[3]
    code = (
        "from streamrl.isolation.box import BoxLimits, run_in_box\n"
        "r = run_in_box(['python', '/box/m.py'], limits=BoxLimits(wall_s=30), "
        "files={'m.py': b'import sys; print(sys.prefix)'})\n"
        "print(r.returncode, r.stdout.decode().strip(), r.stderr.decode()[-300:])\n"
    )
    ran = subprocess.run(
        [str(tmp_path / "venv/bin/python"), "-c", code],
        env={**os.environ, "PYTHONPATH": f"{root}:{':'.join(site.getsitepackages())}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.stdout.split()[:2] == ["0", str(tmp_path / "venv")], ran.stdout + ran.stderr


def test_a_virtualenv_reached_through_a_symlink_runs_in_the_box(tmp_path: Path) -> None:
    """`.venv -> /elsewhere/.venv`: the box binds the real prefix, so the interpreter is
    started by its real folder (it used to fail: bwrap could not find `<link>/bin/python`)."""
    real = Path(sys.prefix).resolve()
    (tmp_path / "venv-link").symlink_to(real, target_is_directory=True)
    root = Path(__file__).resolve().parents[3]
    code = (
        "from streamrl.isolation.box import BoxLimits, run_in_box\n"
        "r = run_in_box(['python', '/box/m.py'], limits=BoxLimits(wall_s=30), "
        "files={'m.py': b'import sys, numpy; print(sys.prefix)'})\n"
        "print(r.returncode, r.stdout.decode().strip(), r.stderr.decode()[-300:])\n"
    )
    ran = subprocess.run(
        [str(tmp_path / "venv-link/bin/python"), "-c", code],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.stdout.split()[:2] == ["0", str(real)], ran.stdout + ran.stderr

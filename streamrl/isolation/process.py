"""The plumbing of one box call (`streamrl.isolation.box`): the descriptors that carry the
caller's files in, the box's init found and killed, and the program's stdin, stdout and stderr
served together until they close.

The box's init is found through bwrap's `--info-fd` and held as a pidfd, so the kill on timeout
reaches that process even if its pid were reused. Killing it tears the PID namespace down: the
kernel kills every process left in the box. Output is read from pipes the caller made before the
program started: the first `keep` bytes of stdout (and of the private channel, when the box has
one), the last `keep` of stderr (an error's last line says what it was); the rest is read and
dropped, so memory stays bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import selectors
import signal
import subprocess
import time

__all__ = ["Streams", "box_init", "close_quietly", "kill_box", "memfd", "wait_box"]


def memfd(name: str, content: bytes) -> int:
    fd = os.memfd_create(f"box-{name}", 0)
    _write_all(fd, content)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _write_all(fd: int, content: bytes) -> None:
    view = memoryview(content)
    while view:
        view = view[os.write(fd, view) :]


def box_init(info_fd: int) -> int | None:
    """A pidfd of the box's init (bwrap's --info-fd names it), or None if bwrap failed."""
    data = b""
    while True:
        chunk = os.read(info_fd, 4096)
        data += chunk
        with contextlib.suppress(ValueError):
            pid = int(json.loads(data)["child-pid"])
            try:
                return os.pidfd_open(pid)
            except ProcessLookupError:  # already done
                return None
        if not chunk:
            return None


def kill_box(process: subprocess.Popen[bytes], init: int | None) -> None:
    """SIGKILL the box's init — the kernel then kills everything in its PID namespace — and
    bwrap itself."""
    if init is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(init, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def wait_box(process: subprocess.Popen[bytes], deadline: float, init: int | None) -> int:
    """bwrap's exit status (negative: the program's signal) once the box is gone: bwrap has
    exited and so has the box's init — whose exit waits until the kernel has killed every
    process left in its namespace."""
    try:
        code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill_box(process, init)
        code = process.wait()
    if init is not None and not _exited(init, max(1.0, deadline - time.monotonic())):
        kill_box(process, init)
        _exited(init, 10.0)
    return 128 - code if code > 128 else code  # bwrap exits 128+N for a program killed by N


def _exited(pidfd: int, timeout_s: float) -> bool:
    """Whether the process of `pidfd` exits within `timeout_s` (a pidfd polls readable then)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def close_quietly(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


@dataclasses.dataclass
class Streams:
    """The program's stdin, stdout, stderr and the read end of its private channel (if any),
    served together until all are closed."""

    process: subprocess.Popen[bytes]
    keep: int
    channel_fd: int | None = None
    stdout: bytearray = dataclasses.field(default_factory=bytearray)
    stderr: bytearray = dataclasses.field(default_factory=bytearray)
    channel: bytearray = dataclasses.field(default_factory=bytearray)
    cut: bool = False

    def communicate(self, stdin: bytes, *, deadline: float) -> bool:
        """Write `stdin`, read the output; False if `deadline` came first."""
        p = self.process
        assert p.stdin is not None
        assert p.stdout is not None
        assert p.stderr is not None
        with selectors.DefaultSelector() as selector:
            kept = {p.stdout.fileno(): self.stdout, p.stderr.fileno(): None}
            if self.channel_fd is not None:
                kept[self.channel_fd] = self.channel
            for fd, head in kept.items():
                os.set_blocking(fd, False)
                selector.register(fd, selectors.EVENT_READ, head)
            pending = memoryview(stdin)
            if pending:
                os.set_blocking(p.stdin.fileno(), False)
                selector.register(p.stdin.fileno(), selectors.EVENT_WRITE)
            else:
                p.stdin.close()
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                for key, _ in selector.select(remaining):
                    if key.events & selectors.EVENT_WRITE:
                        pending = self._write(selector, key.fd, pending)
                    else:
                        self._read(selector, key.fd, head=key.data)
        if len(self.stderr) > self.keep:
            del self.stderr[: len(self.stderr) - self.keep]
        return True

    def _write(self, selector: selectors.BaseSelector, fd: int, pending: memoryview) -> memoryview:
        assert self.process.stdin
        try:
            pending = pending[os.write(fd, pending[: 1 << 16]) :]
        except BrokenPipeError:  # the program stopped reading: the rest is not wanted
            pending = pending[:0]
        if not pending:
            selector.unregister(fd)
            self.process.stdin.close()
        return pending

    def _read(self, selector: selectors.BaseSelector, fd: int, *, head: bytearray | None) -> None:
        """Read what `fd` has: kept up to `keep` bytes into `head` (stdout, the channel), or
        the last `keep` bytes for stderr (`head` None)."""
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            selector.unregister(fd)
            return
        if head is not None:
            room = self.keep - len(head)
            self.cut |= len(chunk) > room
            head += chunk[: max(0, room)]
        else:
            self.stderr += chunk
            if len(self.stderr) > 2 * self.keep:
                self.cut = True
                del self.stderr[: len(self.stderr) - self.keep]

"""The system calls a program in the box is refused: a seccomp filter (built with libseccomp,
through `pyseccomp`) that bwrap installs just before the program starts.

What it closes is kernel surface the box does not need and an attacker would: making namespaces
(`unshare`, `clone` with CLONE_NEWUSER, `setns` — inside a user namespace of its own a program
could mount an unbounded tmpfs around the box's scratch limit), mounting, the kernel keyring,
eBPF, perf events, userfaultfd and io_uring (the usual ways into kernel exploits). `clone3`
answers ENOSYS, so the C library falls back to `clone`, whose flags the filter can read.
Everything else a program, a compiler or a test harness does (threads, fork/exec, pipes, files
in scratch) is allowed: the box's namespaces, uid and limits hold those.

Syscalls of another architecture than the interpreter's (i386 on x86-64) kill the program.
"""

from __future__ import annotations

import errno
import functools
import os

__all__ = ["REFUSED", "box_filter"]

CLONE_NEWUSER = 0x10000000

REFUSED = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen",
    "fsmount", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)  # fmt: skip


@functools.cache
def box_filter() -> bytes:
    """The compiled BPF program (what bwrap's --seccomp reads from a descriptor).

    Raises:
        RuntimeError: libseccomp is not installed (`apt-get install libseccomp2`).
    """
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as error:  # pyseccomp loads libseccomp.so.2 on import
        raise RuntimeError(
            f"the box's syscall filter needs libseccomp ({error}): install it (Debian/Ubuntu: "
            "`apt-get install libseccomp2`; Fedora: `dnf install libseccomp`)"
        ) from error
    refuse = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in REFUSED:
        rules.add_rule(refuse, name)
    new_user = seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER)
    rules.add_rule(refuse, "clone", new_user)
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    fd = os.memfd_create("box-seccomp", 0)
    try:
        with os.fdopen(os.dup(fd), "wb") as exported:
            rules.export_bpf(exported)
        os.lseek(fd, 0, os.SEEK_SET)
        return _read_all(fd)
    finally:
        os.close(fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)

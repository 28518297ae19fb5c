"""The seccomp filter of a sandboxed call: a classic-BPF program, built here in pure Python.

Why it exists: the namespaces and the private root (:mod:`tools.sandbox.command`) leave every
system call an unprivileged user has. A few of them are the usual kernel attack surface or
reach out of the call: nested namespaces (``unshare``, ``clone`` with namespace flags,
``setns``), ``io_uring``, ``userfaultfd``, ``ptrace`` and ``process_vm_readv/writev``, ``bpf``,
the key ring, mounts, ``perf_event_open``, ``kexec``, module loading, file handles. And
signals: the code shares its user id with its supervisor, so ``kill(supervisor, SIGSTOP)``
would stop the deadline. This filter denies all of them.

Why a hand-built program and not libseccomp: the supervisor installs the filter with one
``prctl(PR_SET_SECCOMP)`` (ctypes, standard library) in the code's process just before the
code runs, so it needs the program as bytes; Debian's ``python3-seccomp`` lives in the system
interpreter's ``dist-packages`` (outside the trainer's virtual environment, built for Debian's
Python), and the ~90 instructions below are easier to read and test than a binding. The program also
compares only the low 32 bits of ``int`` arguments (pids), which is what the kernel uses
(libseccomp compares all 64).

What it guarantees (for x86_64 and aarch64; :func:`build_filter` raises ``ValueError`` for
another machine, so the probe refuses rather than run unfiltered):

- a system call of another architecture (``int 0x80`` on x86_64) or of the x32 ABI fails with
  ``EPERM``;
- :data:`DENIED` calls fail with ``EPERM``; ``clone3`` fails with ``ENOSYS`` (its flags are in
  memory, which a filter cannot read; the C library then falls back to ``clone``);
- ``clone`` and ``unshare`` with any namespace flag fail with ``EPERM`` (plain fork and
  threads are allowed);
- ``kill``, ``tkill``, ``tgkill``, ``rt_sigqueueinfo``, ``rt_tgsigqueueinfo`` and
  ``pidfd_open`` aimed at a protected pid (the sandbox's init and the supervisor), at ``-1``
  (every process) or at a protected process group fail with ``EPERM``;
- everything else is allowed.
"""

from __future__ import annotations

import errno
import functools
import platform
import struct
import sys

__all__ = ["DENIED", "NAMESPACE_FLAGS", "SIGNALS", "SYSCALLS", "build_filter", "filter_hex"]

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "process_madvise", "process_mrelease", "bpf", "keyctl", "add_key", "request_key",
    "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "perf_event_open", "kexec_load", "kexec_file_load",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "setns",
    "open_by_handle_at", "name_to_handle_at", "init_module", "finit_module", "delete_module",
)  # fmt: skip
"""System calls that always fail (``EPERM``)."""
SIGNALS = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open")
"""System calls whose first argument (a pid) is checked against the protected pids."""
NAMESPACE_FLAGS = (
    0x00000080  # CLONE_NEWTIME
    | 0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
)
"""``clone``/``unshare`` flags that make a namespace: refused."""

_COMMON = {
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "pidfd_send_signal": 424, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "pidfd_open": 434, "clone3": 435,
    "pidfd_getfd": 438, "process_madvise": 440, "mount_setattr": 442, "process_mrelease": 448,
}  # fmt: skip
# From <asm/unistd_64.h> (x86_64) and <asm-generic/unistd.h> (aarch64).
SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        **_COMMON,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
        "bpf": 321, "keyctl": 250, "add_key": 248, "request_key": 249, "mount": 165,
        "umount2": 166, "pivot_root": 155, "perf_event_open": 298, "kexec_load": 246,
        "kexec_file_load": 320, "userfaultfd": 323, "setns": 308, "unshare": 272, "clone": 56,
        "kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129,
        "rt_tgsigqueueinfo": 297, "open_by_handle_at": 304, "name_to_handle_at": 303,
        "init_module": 175, "finit_module": 313, "delete_module": 176,
    },
    "aarch64": {
        **_COMMON,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
        "bpf": 280, "keyctl": 219, "add_key": 217, "request_key": 218, "mount": 40,
        "umount2": 39, "pivot_root": 41, "perf_event_open": 241, "kexec_load": 104,
        "kexec_file_load": 294, "userfaultfd": 282, "setns": 268, "unshare": 97, "clone": 220,
        "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138,
        "rt_tgsigqueueinfo": 240, "open_by_handle_at": 265, "name_to_handle_at": 264,
        "init_module": 105, "finit_module": 273, "delete_module": 106,
    },
}  # fmt: skip
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000  # x86_64: system calls of the x32 ABI

# Classic BPF opcodes (<linux/filter.h>) and seccomp return values (<linux/seccomp.h>).
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data
_MAX_JUMP = 255


def _arg0_low() -> int:
    """Offset of the low 32 bits of the first argument (what the kernel reads as an int)."""
    return _ARG0 if sys.byteorder == "little" else _ARG0 + 4


class _Program:
    """A tiny assembler: instructions whose jump targets are labels, resolved at the end."""

    def __init__(self) -> None:
        self.code: list[tuple[int, str | int, str | int, int]] = []
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        self.code.append((code, jt, jf, k & 0xFFFFFFFF))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = bytearray()
        for i, (code, jt, jf, k) in enumerate(self.code):
            offsets = []
            for target in (jt, jf):
                offset = target if isinstance(target, int) else self.labels[target] - i - 1
                if not 0 <= offset <= _MAX_JUMP:
                    raise ValueError(f"seccomp: jump of {offset} at instruction {i}")
                offsets.append(offset)
            out += struct.pack("=HBBI", code, offsets[0], offsets[1], k)
        return bytes(out)


def build_filter(protected_pids: tuple[int, ...], machine: str | None = None) -> bytes:
    """The filter (``struct sock_filter`` array) for ``machine`` (default: this one).

    ``protected_pids``: pids (and process groups) the code may not signal, seen from inside
    the sandbox's PID namespace.

    Raises:
        ValueError: ``machine`` is not x86_64 or aarch64.
    """
    machine = machine or platform.machine()
    if machine not in SYSCALLS:
        raise ValueError(
            f"seccomp: no system call table for machine {machine!r} (x86_64 and aarch64 only)"
        )
    nr = SYSCALLS[machine]
    p = _Program()
    p.op(_LD_W_ABS, _ARCH)
    p.op(_JEQ_K, _AUDIT_ARCH[machine], jt=0, jf="deny")
    p.op(_LD_W_ABS, _NR)
    if machine == "x86_64":
        p.op(_JGE_K, _X32_BIT, jt="deny", jf=0)
    for name in DENIED:
        p.op(_JEQ_K, nr[name], jt="deny", jf=0)
    p.op(_JEQ_K, nr["clone3"], jt="enosys", jf=0)
    for name in ("clone", "unshare"):
        p.op(_JEQ_K, nr[name], jt=0, jf=2)
        p.op(_LD_W_ABS, _arg0_low())
        p.op(_JSET_K, NAMESPACE_FLAGS, jt="deny", jf="allow")
    targets = sorted({t for pid in protected_pids for t in (pid, -pid)} | {-1})
    for name in SIGNALS:
        p.op(_JEQ_K, nr[name], jt=0, jf=len(targets) + 2)
        p.op(_LD_W_ABS, _arg0_low())
        for target in targets:
            p.op(_JEQ_K, target, jt="deny", jf=0)
        p.op(_RET_K, _RET_ALLOW)
    p.label("allow")
    p.op(_RET_K, _RET_ALLOW)
    p.label("deny")
    p.op(_RET_K, _RET_ERRNO | errno.EPERM)
    p.label("enosys")
    p.op(_RET_K, _RET_ERRNO | errno.ENOSYS)
    return p.assemble()


@functools.cache
def filter_hex(protected_pids: tuple[int, ...]) -> str:
    """:func:`build_filter` for this machine, as hex (how the supervisor's config carries it)."""
    return build_filter(protected_pids).hex()

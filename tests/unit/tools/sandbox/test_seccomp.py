"""The seccomp filter: its decisions (the program run by a classic-BPF interpreter, both
machines), and the real kernel enforcing it once the supervisor installs it."""

from __future__ import annotations

import errno
import platform
import struct
import subprocess
import sys

import pytest

from tools.sandbox.config import SUPERVISOR_FILE
from tools.sandbox.seccomp import DENIED, NAMESPACE_FLAGS, SYSCALLS, build_filter, filter_hex

ALLOW = 0x7FFF0000
EPERM = 0x00050000 | errno.EPERM
ENOSYS = 0x00050000 | errno.ENOSYS
ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
READ = {"x86_64": 0, "aarch64": 63}
CLONE_NEWUSER, CLONE_NEWNET, CLONE_FILES, SIGCHLD = 0x10000000, 0x40000000, 0x400, 17
PROTECTED = (1, 2)


def run_bpf(program: bytes, nr: int, arch: int, *args: int) -> int:
    """Run a classic-BPF seccomp program on one system call (``struct seccomp_data``)."""
    argv = [a & 0xFFFFFFFFFFFFFFFF for a in (*args, *([0] * (6 - len(args))))]
    data = struct.pack("=iIQ6Q", nr, arch, 0, *argv)
    code = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    for _ in range(len(code)):  # forward jumps only: at most one pass
        op, jt, jf, k = code[pc]
        if op == 0x20:  # ld [k]
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif op == 0x15:  # jeq
            pc += 1 + (jt if acc == k else jf)
        elif op == 0x35:  # jge
            pc += 1 + (jt if acc >= k else jf)
        elif op == 0x45:  # jset
            pc += 1 + (jt if acc & k else jf)
        elif op == 0x06:  # ret
            return k
        else:
            raise AssertionError(f"unexpected opcode {op:#x}")
    raise AssertionError("the program fell off its end")


@pytest.fixture(params=["x86_64", "aarch64"])
def machine(request: pytest.FixtureRequest) -> str:
    return request.param


def decide(machine: str, name: str, *args: int) -> int:
    return run_bpf(build_filter(PROTECTED, machine), SYSCALLS[machine][name], ARCH[machine], *args)


def test_every_denied_call_fails_with_eperm(machine: str):
    for name in DENIED:
        assert decide(machine, name) == EPERM, name


def test_ordinary_calls_are_allowed(machine: str):
    program = build_filter(PROTECTED, machine)
    assert run_bpf(program, READ[machine], ARCH[machine]) == ALLOW


def test_namespaces_are_refused_but_fork_threads_and_unshare_of_files_are_not(machine: str):
    assert decide(machine, "clone", CLONE_NEWUSER | SIGCHLD) == EPERM
    assert decide(machine, "unshare", CLONE_NEWUSER) == EPERM
    assert decide(machine, "unshare", CLONE_NEWNET) == EPERM
    for flag in range(32):
        if NAMESPACE_FLAGS & (1 << flag):
            assert decide(machine, "unshare", 1 << flag) == EPERM, hex(1 << flag)
    assert decide(machine, "clone", SIGCHLD) == ALLOW  # fork
    assert decide(machine, "clone", 0x3D0F00) == ALLOW  # glibc's pthread_create flags
    assert decide(machine, "unshare", CLONE_FILES) == ALLOW
    assert decide(machine, "clone3") == ENOSYS  # the C library falls back to clone


def test_signals_to_the_supervisor_and_to_everyone_are_refused(machine: str):
    for name in ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open"):
        for target in (1, 2, -1, -2, 0x1_0000_0002):  # high bits are ignored by the kernel
            assert decide(machine, name, target, 19) == EPERM, (name, target)
        for target in (0, 3, 17, -3, -17):
            assert decide(machine, name, target, 19) == ALLOW, (name, target)


def test_other_architectures_and_x32_are_refused(machine: str):
    program = build_filter(PROTECTED, machine)
    assert run_bpf(program, READ[machine], 0x40000003) == EPERM  # i386
    if machine == "x86_64":
        assert run_bpf(program, 0x40000000 | READ[machine], ARCH[machine]) == EPERM


def test_an_unknown_machine_is_refused():
    with pytest.raises(ValueError, match="riscv64"):
        build_filter(PROTECTED, "riscv64")


KERNEL_CHECK = """
import ctypes, errno, os, signal, sys, threading
sys.path.insert(0, {sup_dir!r})
import supervisor
supervisor.install_seccomp({program!r})
assert "ctypes" not in sys.modules
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(result):
    return errno.errorcode.get(ctypes.get_errno(), "0") if result == -1 else "ok"
print("unshare", errno_of(libc.unshare(0x10000000)))
print("io_uring_setup", errno_of(libc.syscall({io_uring}, 8, 0)))
victim = os.fork()
if victim == 0:
    signal.pause()
    os._exit(0)
print("ptrace", errno_of(libc.ptrace(16, victim, 0, 0)))  # PTRACE_ATTACH: root may, unfiltered
os.kill(victim, signal.SIGKILL)
os.waitpid(victim, 0)
for pid in (-1, 1):
    try:
        os.kill(pid, 0)
        print("kill", pid, "ok")
    except OSError as e:
        print("kill", pid, errno.errorcode[e.errno])
pid = os.fork()
if pid == 0:
    os._exit(7)
print("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
t = threading.Thread(target=lambda: None)
t.start()
t.join()
print("thread ok")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="seccomp is Linux only")
def test_the_kernel_enforces_the_installed_filter():
    code = KERNEL_CHECK.format(
        sup_dir=str(SUPERVISOR_FILE.parent),
        program=filter_hex(PROTECTED),
        io_uring=SYSCALLS[platform.machine()]["io_uring_setup"],
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "unshare EPERM",
        "io_uring_setup EPERM",
        "ptrace EPERM",
        "kill -1 EPERM",
        "kill 1 EPERM",
        "fork 7",
        "thread ok",
    ]

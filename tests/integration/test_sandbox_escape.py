"""Sandbox escape suite: model-written code attacking the python tool's boundary.

Every attack of issue 13 (the audit hook switched off from inside, ``dir_fd`` path bypass, a
fork bomb past the cap, 300 MB written to the host's /tmp, /etc/passwd and a secret file read,
the host's /dev/shm written, TCP to 127.0.0.1, the parent's environment read from /proc) and
the usual ones (/proc/1/environ, unix and abstract sockets, ctypes, gc/frames/subclasses to
reach ``os.system``, symlinks, disk fill, signalling host processes, outliving the call).

Each attack runs three ways:

- in the sandbox (bubblewrap + audit hook): it must fail;
- in the sandbox with the audit hook off (what a successful hook bypass leaves): it must fail,
  so the boundary is the kernel, not the interpreter;
- without the sandbox and without the hook (the control): it must succeed, which proves the
  attack and its check are real (a check that cannot see an escape would pass vacuously).

Issue 21's attacks on the limits: 96 x 16 MB memfds under ``memory_mb=256``, a fork bomb
across processes (children forking grandchildren), memory spread over several processes,
nested user namespaces, io_uring, userfaultfd, ptrace of the supervisor, and SIGSTOP of the
supervisor to outlive the wall limit. The per-call limits are a cgroup (v1 on this machine),
the system calls are refused by the seccomp filter; the control runs with ``cgroups="off"``.

Success is judged on the host, never by the attacker's word alone: a planted secret found in
the output, a connection reaching a loopback listener, a file appearing in the host's /tmp or
/dev/shm, a host process killed, more processes/bytes than the limits allow (also the peak
memory and processes the call's cgroup counted), or a call running past its wall limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.waiting import until
from tools import ToolResult
from tools.python_sandbox import SUPERVISOR_MARKER, PythonTool, SandboxUnavailableError

pytestmark = pytest.mark.integration

MAX_PROCESSES = 8
DISK_MB = 64
MEMORY_MB = 256
CALL_MEMORY_MB = MEMORY_MB + DISK_MB
"""What a call's processes and files may use together (its cgroup's limit)."""
SANDBOX_PIDS = 3
"""bwrap (outside and its init) and the supervisor: in the call's cgroup besides the code."""
WALL_S = 8.0
SHORT_WALL_S = 3.0
"""The wall limit of the attacks on the clock (the supervisor stopped)."""
OUTSIDE_GRACE_S = 1.0
USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(platform.machine(), -1)


@dataclass
class Target:
    """What the attacks aim at on the host, and what the checks look at afterwards."""

    token: str
    secret_path: Path
    port: int
    abstract: str
    unix_path: Path
    victim: subprocess.Popen[bytes]
    connections: list[str] = field(default_factory=list)

    @property
    def host_tmp_glob(self) -> str:
        return f"/tmp/agentrl-escape-{self.token}*"

    @property
    def host_shm_path(self) -> str:
        return f"/dev/shm/agentrl-escape-{self.token}"

    def fill(self, code: str) -> str:
        return code.format(
            token=self.token,
            secret=str(self.secret_path),
            secret_dir=str(self.secret_path.parent),
            port=self.port,
            abstract=self.abstract,
            unix_path=str(self.unix_path),
            victim=self.victim.pid,
            shm=self.host_shm_path,
            max_processes=MAX_PROCESSES,
            userfaultfd=USERFAULTFD,
        )


@pytest.fixture
async def target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Target]:
    token = secrets.token_hex(8)
    secret_dir = tmp_path / "host-secrets"
    secret_dir.mkdir()
    secret = secret_dir / "secret.txt"
    secret.write_text(f"SECRET-{token}\n")
    # This process's environment holds secrets too (API keys): the code must not inherit them.
    monkeypatch.setenv("AGENTRL_ESCAPE_SECRET", f"ENVSECRET-{token}")
    connections: list[str] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append("connected")
        writer.close()

    tcp = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    abstract = f"\0agentrl-escape-{token}"
    unix_path = tmp_path / "control.sock"
    abstract_server = await asyncio.start_unix_server(on_connect, abstract)
    unix_server = await asyncio.start_unix_server(on_connect, str(unix_path))
    # A host process holding secrets in its environment (the trainer, a server).
    victim = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        env={"AGENTRL_ESCAPE_SECRET": f"ENVSECRET-{token}", "OMP_NUM_THREADS": "1"},
    )
    t = Target(
        token=token,
        secret_path=secret,
        port=tcp.sockets[0].getsockname()[1],
        abstract=abstract,
        unix_path=unix_path,
        victim=victim,
        connections=connections,
    )
    try:
        yield t
    finally:
        victim.kill()
        victim.wait()
        for server in (tcp, abstract_server, unix_server):
            server.close()
        for path in [*glob.glob(t.host_tmp_glob), t.host_shm_path]:
            with contextlib.suppress(OSError):
                os.remove(path)


def sandboxed(audit_hook: bool, wall_time_s: float = WALL_S) -> PythonTool:
    return PythonTool(
        wall_time_s=wall_time_s,
        memory_mb=MEMORY_MB,
        max_processes=MAX_PROCESSES,
        disk_mb=DISK_MB,
        audit_hook=audit_hook,
        cgroups="required",  # this machine has them (root, cgroup v1); users mostly v2
    )


def unprotected(wall_time_s: float = WALL_S) -> PythonTool:
    """The control: no isolation, no cgroup, no audit hook (the code on the bare host)."""
    return PythonTool(
        wall_time_s=wall_time_s,
        memory_mb=MEMORY_MB,
        bwrap="/nonexistent/bwrap",
        allow_unsandboxed=True,
        audit_hook=False,
        cgroups="off",
    )


def leaked(t: Target, r: ToolResult) -> bool:
    return t.token in r.content


def last_int(r: ToolResult) -> int:
    lines = [line for line in r.content.splitlines() if line.strip().isdigit()]
    return int(lines[-1]) if lines else 0


def over_memory(r: ToolResult, claimed_mb: int) -> bool:
    """More memory than a call may have: claimed by the code, or counted by its cgroup."""
    return claimed_mb > CALL_MEMORY_MB or r.metrics.get("memory_peak_mb", 0) > CALL_MEMORY_MB


def over_processes(r: ToolResult, claimed: int) -> bool:
    """More processes than a call may have: claimed by the code, or counted by its cgroup."""
    return claimed > MAX_PROCESSES or r.metrics.get("pids_peak", 0) > MAX_PROCESSES + SANDBOX_PIDS


@dataclass
class Attack:
    code: str
    succeeded: Callable[[Target, ToolResult], bool]
    wall_time_s: float = WALL_S


HOOK_SWITCH_OFF = """
import sys

class Evil(str):
    # The audit hook once ran isinstance() on arguments: a __class__ property runs user code
    # inside the hook, which then flips the hook's own "busy" flag through its frame.
    @property
    def __class__(self):
        try:
            sys._getframe(1).f_locals["state"]["busy"] = True
        except Exception as e:
            print("switch-off failed:", type(e).__name__)
        return str

import os
try:
    os.listdir(Evil("."))
except Exception as e:
    print("listdir:", type(e).__name__)
for path in ["{secret}", "/etc/passwd", "/etc/shadow"]:
    try:
        print(open(path).read())
    except Exception as e:
        print(path, type(e).__name__)
"""

DIR_FD = """
import os
for directory, name in [("{secret_dir}", "secret.txt"), ("/etc", "passwd"), ("/", "etc/passwd")]:
    try:
        fd = os.open(directory, os.O_RDONLY)
        print(os.read(os.open(name, os.O_RDONLY, dir_fd=fd), 200).decode())
    except Exception as e:
        print(directory, name, type(e).__name__)
"""

FORK_BOMB = """
import os, time
alive = 1
for _ in range(30):
    try:
        if os.fork() == 0:
            time.sleep(2)
            os._exit(0)
        alive += 1
    except OSError as e:
        print("fork failed:", e.strerror)
        break
    except PermissionError as e:
        print("fork refused:", e)
        break
print(alive)
"""

HOST_TMP_300MB = """
import os
written = 0
try:
    for i in range(30):
        with open(f"/tmp/agentrl-escape-{token}-{{i}}", "wb") as f:
            for _ in range(10):
                f.write(b"x" * (1 << 20))
                f.flush()
                written += 1
except OSError as e:
    print(type(e).__name__, e.strerror)
print(written)
"""

READ_SECRETS = """
for path in ["{secret}", "/etc/passwd", "/etc/hostname", "/root/.bash_history"]:
    try:
        print(open(path).read()[:200])
    except Exception as e:
        print(path, type(e).__name__)
"""

HOST_SHM = """
try:
    open("{shm}", "w").write("planted by the sandbox")
    print("written")
except Exception as e:
    print(type(e).__name__, e)
"""

TCP_LOOPBACK = """
import socket
for family, address in [(socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_INET6, ("::1", {port}))]:
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect(address)
        print("connected", address)
    except Exception as e:
        print(address, type(e).__name__)
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", {port}))
except Exception as e:
    print("udp", type(e).__name__)
"""

UNIX_SOCKETS = """
import socket
for address in [{abstract!r}, {unix_path!r}]:
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect(address)
        print("connected", repr(address))
    except Exception as e:
        print(repr(address), type(e).__name__)
"""

PROC_ENVIRON = """
import os
found = []
try:
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
except Exception as e:
    pids = []
    print("/proc", type(e).__name__)
for pid in ["1", "self", str(os.getppid())] + pids:
    try:
        env = open(f"/proc/{{pid}}/environ", "rb").read()
    except Exception:
        continue
    if b"AGENTRL_ESCAPE_SECRET" in env:
        found.append(env.split(b"AGENTRL_ESCAPE_SECRET=")[1].split(b"\\0")[0].decode())
print(sorted(set(found)) or "nothing")
print(os.environ.get("AGENTRL_ESCAPE_SECRET", "no env secret"))
"""

CTYPES = """
import ctypes, ctypes.util
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.open(b"{secret}", 0)
if fd >= 0:
    buf = ctypes.create_string_buffer(200)
    n = libc.read(fd, buf, 200)
    print(buf.raw[:n].decode())
else:
    print("open failed, errno", ctypes.get_errno())
print("setuid(0) ->", libc.setuid(0), ctypes.get_errno())
CLONE_NEWNS = 0x00020000
print("unshare(mount) ->", libc.unshare(CLONE_NEWNS), ctypes.get_errno())
"""

SUBCLASS_WALK = """
# No import of os: reach os.system through object.__subclasses__() and a function's globals.
wrap = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == "_wrap_close"][0]
system = wrap.__init__.__globals__["system"]
try:
    system("cat {secret} /etc/passwd")
except Exception as e:
    print("system:", type(e).__name__, e)
import gc
try:
    mods = [o for o in gc.get_objects() if type(o).__name__ == "module" and o.__name__ == "os"]
    print(mods[0].read(mods[0].open("{secret}", 0), 200).decode())
except Exception as e:
    print("gc:", type(e).__name__)
"""

SYMLINKS = """
import os
for i, target in enumerate(["{secret}", "/etc/passwd", "/proc/1/root{secret}"]):
    try:
        os.symlink(target, f"link{{i}}")
        print(open(f"link{{i}}").read()[:200])
    except Exception as e:
        print(target, type(e).__name__)
"""

DISK_FILL = """
import os
written = 0
try:
    for i in range(30):
        with open(f"fill{{i}}", "wb") as f:
            for _ in range(10):
                f.write(b"x" * (1 << 20))
                f.flush()
                written += 1
except OSError as e:
    print(type(e).__name__, e.strerror)
print(written)
"""

KILL_HOST_PROCESS = """
import os, signal
try:
    os.kill({victim}, signal.SIGKILL)
    print("sent")
except Exception as e:
    print(type(e).__name__)
"""


MEMFD = """
import os
filled = 0
try:
    fds = []
    for i in range(96):
        fd = os.memfd_create(f"m{{i}}")
        os.write(fd, b"x" * (16 << 20))
        fds.append(fd)
        filled += 1
        print(filled * 16, flush=True)
except OSError as e:
    print(type(e).__name__, e.strerror)
print(filled * 16)
"""

FORK_TREE = """
import os, time
r, w = os.pipe()

def spawn(depth):
    for _ in range(3):
        try:
            pid = os.fork()
        except OSError:
            return
        if pid == 0:
            os.write(w, b"x")
            if depth < 3:
                spawn(depth + 1)
            time.sleep(3)
            os._exit(0)

spawn(0)
time.sleep(1.5)
os.set_blocking(r, False)
try:
    print(1 + len(os.read(r, 1 << 16)))
except BlockingIOError:
    print(1)
"""

# Claims the memory its children hold *at once*: a child counts when it allocated and is still
# alive 2 s in. (Counting every child that ever allocated was a flake: the OOM killer may kill a
# child that had already reported, and the next one then allocates within the limit.)
MEMORY_ACROSS_PROCESSES = """
import os, time
r, w = os.pipe()
pids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        try:
            block = b"x" * (100 << 20)  # written: every page is charged
            os.write(w, b"x")
            time.sleep(3)
        finally:
            os._exit(0)
    pids.append(pid)
time.sleep(2)
os.set_blocking(r, False)
try:
    written = len(os.read(r, 100))
except BlockingIOError:
    written = 0
alive = sum(1 for p in pids if os.waitpid(p, os.WNOHANG) == (0, 0))
print(100 * min(written, alive))
"""

LIBC = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)

def result(value):
    return "ok" if value >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
"""

USER_NAMESPACE = (
    LIBC
    + """
print("unshare(user):", result(libc.unshare(0x10000000)))
print("unshare(user|net|mount):", result(libc.unshare(0x10000000 | 0x40000000 | 0x20000)))
"""
)

IO_URING = (
    LIBC
    + """
params = ctypes.create_string_buffer(120)
print("io_uring_setup:", result(libc.syscall(425, 8, params)))
"""
)

USERFAULTFD_ATTACK = (
    LIBC
    + """
for flags in (0o2000000, 0o2000000 | 1):  # O_CLOEXEC, then UFFD_USER_MODE_ONLY
    print("userfaultfd:", result(libc.syscall({userfaultfd}, flags)))
"""
)

PTRACE_PARENT = (
    LIBC
    + """
import time
parent = os.getppid()
attached = libc.ptrace(16, parent, 0, 0)  # PTRACE_ATTACH the supervisor
print("ptrace(attach):", result(attached))
if attached == 0:
    os.waitpid(parent, 0x40000000)  # __WALL: its attach-stop
    print("ptrace(detach):", result(libc.ptrace(17, parent, 0, 0)))
print("process_vm_readv:", result(libc.process_vm_readv(parent, 0, 0, 0, 0, 0)))
"""
)

STOP_SUPERVISOR = """
import os, signal, time
start = time.monotonic()
targets = [("supervisor", os.kill, os.getppid())]
if os.getppid() == 2:  # in the sandbox's PID namespace (on a host, pid 2 is kthreadd)
    targets += [("init", os.kill, 1), ("everyone", os.kill, -1), ("its group", os.killpg, 2)]
stopped = False
for name, send, target in targets:
    try:
        send(target, signal.SIGSTOP)
        print("stopped", name, flush=True)
        stopped = True
    except OSError as e:
        print("refused", name, e.strerror, flush=True)
# Run far past the wall limit; once the supervisor is stopped (the control), just long enough
# to show it, and then end (the unsandboxed parent waits for the code's output to close).
while time.monotonic() - start < (6 if stopped else 14):
    time.sleep(0.25)
    print(int(time.monotonic() - start), flush=True)
"""


def ran_past_the_wall(r: ToolResult, wall_s: float) -> bool:
    """Whole seconds the code counted beyond its wall limit and the parent's grace."""
    return last_int(r) > wall_s + OUTSIDE_GRACE_S


def _victim_killed(t: Target, r: ToolResult) -> bool:
    for _ in range(20):
        if t.victim.poll() is not None:
            return True
        time.sleep(0.05)
    return False


ATTACKS: dict[str, Attack] = {
    "hook-switch-off-then-read": Attack(HOOK_SWITCH_OFF, lambda t, r: leaked(t, r)),
    "dir-fd-path-bypass": Attack(DIR_FD, lambda t, r: leaked(t, r) or "root:" in r.content),
    "fork-bomb-past-the-cap": Attack(FORK_BOMB, lambda t, r: last_int(r) > MAX_PROCESSES),
    "300mb-to-host-tmp": Attack(
        HOST_TMP_300MB,
        lambda t, r: bool(glob.glob(t.host_tmp_glob)) or last_int(r) > DISK_MB,
    ),
    "read-etc-passwd-and-secret": Attack(
        READ_SECRETS, lambda t, r: leaked(t, r) or "root:x:0" in r.content
    ),
    "write-host-dev-shm": Attack(HOST_SHM, lambda t, r: os.path.exists(t.host_shm_path)),
    "tcp-to-loopback": Attack(TCP_LOOPBACK, lambda t, r: bool(t.connections)),
    "unix-and-abstract-sockets": Attack(UNIX_SOCKETS, lambda t, r: bool(t.connections)),
    "parent-environment-via-proc": Attack(PROC_ENVIRON, lambda t, r: leaked(t, r)),
    "ctypes-libc": Attack(CTYPES, lambda t, r: leaked(t, r)),
    "subclasses-gc-to-os-system": Attack(
        SUBCLASS_WALK, lambda t, r: leaked(t, r) or "root:x:0" in r.content
    ),
    "symlinks-out": Attack(SYMLINKS, lambda t, r: leaked(t, r) or "root:x:0" in r.content),
    "disk-fill": Attack(DISK_FILL, lambda t, r: last_int(r) > DISK_MB),
    "kill-a-host-process": Attack(KILL_HOST_PROCESS, _victim_killed),
    "memfd-past-memory-mb": Attack(MEMFD, lambda t, r: over_memory(r, last_int(r))),
    "fork-bomb-across-processes": Attack(FORK_TREE, lambda t, r: over_processes(r, last_int(r))),
    "memory-across-processes": Attack(
        MEMORY_ACROSS_PROCESSES, lambda t, r: over_memory(r, last_int(r))
    ),
    "user-namespace": Attack(USER_NAMESPACE, lambda t, r: ": ok" in r.content),
    "io-uring": Attack(IO_URING, lambda t, r: ": ok" in r.content),
    "userfaultfd": Attack(USERFAULTFD_ATTACK, lambda t, r: ": ok" in r.content),
    "ptrace-the-supervisor": Attack(PTRACE_PARENT, lambda t, r: "ptrace(attach): ok" in r.content),
    "sigstop-the-supervisor": Attack(
        STOP_SUPERVISOR,
        lambda t, r: "stopped" in r.content or ran_past_the_wall(r, SHORT_WALL_S),
        wall_time_s=SHORT_WALL_S,
    ),
}


@pytest.mark.parametrize("audit_hook", [True, False], ids=["with-hook", "hook-off"])
@pytest.mark.parametrize("name", list(ATTACKS))
async def test_attack_fails_in_the_sandbox(name: str, audit_hook: bool, target: Target):
    attack = ATTACKS[name]
    r = await sandboxed(audit_hook, attack.wall_time_s).run(target.fill(attack.code))
    assert not attack.succeeded(target, r), f"{name} escaped:\n{r.content}\n{r.metrics}"


@pytest.mark.parametrize("name", list(ATTACKS))
async def test_control_attack_succeeds_without_the_sandbox(name: str, target: Target):
    attack = ATTACKS[name]
    r = await unprotected(attack.wall_time_s).run(target.fill(attack.code))
    assert attack.succeeded(target, r), f"{name} did not work even unprotected:\n{r.content}"


async def test_the_hook_is_not_switched_off_by_a_class_property():
    """Defence in depth: the hook compares types without running user code."""
    r = await sandboxed(audit_hook=True).run(HOOK_SWITCH_OFF.format(secret="/nonexistent"))
    assert "switch-off failed" not in r.content  # the property never ran
    assert "/etc/passwd PermissionError" in r.content, r.content  # the hook still holds


def _argv(pid: int | str) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return [b""]


def _parent(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        pid = _parent(pid)
        if pid == ancestor:
            return True
    return False


def my_supervisors() -> list[int]:
    """Pids of the sandbox supervisors this test process started (other sessions on this host
    run theirs): interpreters with the supervisor's marker whose parent is bwrap (the code's
    processes share the command line, but their parent is the supervisor; bwrap's own command
    line holds the marker too)."""
    marker = SUPERVISOR_MARKER.encode()
    return [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit()
        and marker in _argv(p)
        and os.path.basename(_argv(p)[0]) != b"bwrap"
        and os.path.basename(_argv(_parent(p))[0]) == b"bwrap"
        and _descends_from(int(p), os.getpid())
    ]


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid``."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


async def test_the_wall_limit_holds_from_outside_when_the_supervisor_is_stopped():
    """The parent's clock. The code cannot stop its supervisor (seccomp: see the attack
    above), so the host does it here, standing in for any way a supervisor could hang: the
    call still ends at the wall limit plus the parent's grace, and nothing of it is left."""
    assert not my_supervisors()
    task = asyncio.ensure_future(
        sandboxed(audit_hook=False, wall_time_s=SHORT_WALL_S).run(
            "import time\nprint('running', flush=True)\nwhile True:\n    time.sleep(0.05)"
        )
    )
    await until(lambda: bool(my_supervisors()), "the supervisor to start", poll_s=0.02)
    (supervisor,) = my_supervisors()
    # Once the code runs (the supervisor's child): the parent's clock starts with the code.
    await until(lambda: bool(children(supervisor)), "the code to start", poll_s=0.02)
    code_seen = time.monotonic()
    os.kill(supervisor, signal.SIGSTOP)
    r = await task
    ran_s = time.monotonic() - code_seen
    assert r.error and r.metrics["timed_out"] == 1.0, r.content
    assert "timed out after 3 s" in r.content, r.content
    # The wall limit plus the parent's grace (plus slack for a loaded machine); a stopped
    # supervisor used to leave the call running to the hard deadline (wall + 5 s + disk/50 s).
    assert ran_s < SHORT_WALL_S + OUTSIDE_GRACE_S + 2.0, (ran_s, r.metrics)
    assert not my_supervisors(), "the call left its supervisor behind"


DAEMON = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1.5)
        open("survivor", "w").write("alive")
    os._exit(0)
print("parent exits")
"""


@pytest.mark.parametrize("protected", [True, False], ids=["sandbox", "control"])
async def test_a_daemon_does_not_outlive_its_call(protected: bool):
    tool = sandboxed(audit_hook=False) if protected else unprotected()
    state = await tool.create()
    try:
        first = await tool.execute(state, {"code": DAEMON})
        await asyncio.sleep(2.5)
        second = await tool.execute(state, {"code": "import os\nprint(os.listdir('.'))"})
    finally:
        await tool.release(state)
    assert first.content == "parent exits\n"
    # the sandbox kills the daemon with the call; without it, the daemon survives and writes
    assert second.content == ("[]\n" if protected else "['survivor']\n")


async def test_one_episode_cannot_read_another_episodes_files():
    tool = sandboxed(audit_hook=False)
    a, b = await tool.create(), await tool.create()
    try:
        await tool.execute(a, {"code": "open('mine.txt', 'w').write('A-PRIVATE')"})
        r = await tool.execute(
            b,
            {
                "code": f"import os\nprint(os.listdir('.'))\n"
                f"print(os.path.exists({str(Path(a) / 'state.tar')!r}))"
            },
        )
    finally:
        await tool.release(a)
        await tool.release(b)
    assert r.content == "[]\nFalse\n"


def test_the_sandbox_refuses_to_start_without_isolation():
    with pytest.raises(SandboxUnavailableError, match=r"tools\.python\.allow_unsandboxed"):
        PythonTool(bwrap="/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailableError, match="cannot create a sandbox"):
        PythonTool(bwrap="/bin/false")


@pytest.mark.skipif(os.geteuid() != 0, reason="emulates an unprivileged user; needs root")
def test_unprivileged_users_get_a_user_namespace_sandbox(tmp_path: Path):
    """As a normal user (no root), bwrap builds the same boundary in a user namespace."""
    from tools.sandbox import config as sc
    from tools.sandbox.command import bwrap_command, supervisor_argv
    from tools.sandbox.probe import python_paths
    from tools.sandbox.seccomp import filter_hex

    exe = "/usr/bin/python3"
    if not os.path.exists(exe):
        pytest.fail("this check needs the distribution's /usr/bin/python3 (readable by anyone)")
    bwrap = shutil.which("bwrap")
    assert bwrap, "bubblewrap is not installed (make setup installs it)"
    iso = sc.Isolation(bwrap=bwrap, mode="userns", bind_paths=python_paths(exe))
    state = tmp_path / "episode"
    state.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(state, 0o755)
    read_fd, write_fd = os.pipe()
    cfg = {
        "rlimits": {"RLIMIT_NPROC": MAX_PROCESSES + 2},
        "cwd": sc.WORKDIR,
        "write_root": sc.SCRATCH,
        "restore": sc.STATE_IN,
        "archive": False,
        "sandboxed": True,
        "status_fd": write_fd,
        "wall_time_s": 10,
        "audit": False,
        "max_forks": 0,
        "site_dirs": [],
        "read_roots": [],
        "seccomp": filter_hex(sc.PROTECTED_PIDS),
        "protect_pids": list(sc.PROTECTED_PIDS),
    }
    argv = supervisor_argv(exe, cfg, sandboxed=True)
    cmd = bwrap_command(iso, state, argv, disk_mb=8)
    secret = tmp_path / "secret.txt"
    secret.write_text("USER-SECRET")
    os.chmod(secret, 0o644)
    code = (
        FORK_BOMB
        + f"for p in ['{secret}', '/etc/passwd']:\n"
        + "    try:\n        print(open(p).read())\n"
        + "    except OSError as e:\n        print(p, type(e).__name__)\n"
        + "import signal\ntry:\n    os.kill(os.getppid(), signal.SIGSTOP)\n    print('stopped')\n"
        + "except OSError as e:\n    print('stop', type(e).__name__)\n"
    )
    out = subprocess.run(
        ["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", *cmd],
        input=code,
        capture_output=True,
        text=True,
        pass_fds=(write_fd,),
        env={},
        timeout=60,
        check=False,
    )
    os.close(write_fd)
    os.close(read_fd)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "fork failed: Resource temporarily unavailable" in lines
    assert str(MAX_PROCESSES) in lines
    assert "USER-SECRET" not in out.stdout and "root:x:0" not in out.stdout
    assert f"{secret} FileNotFoundError" in lines and "/etc/passwd FileNotFoundError" in lines
    assert "stop PermissionError" in lines  # the seccomp filter, in a user namespace too

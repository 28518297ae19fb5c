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

Success is judged on the host, never by the attacker's word alone: a planted secret found in
the output, a connection reaching a loopback listener, a file appearing in the host's /tmp or
/dev/shm, a host process killed, or more processes/bytes than the limits allow.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tools import ToolResult
from tools.python_sandbox import PythonTool, SandboxUnavailableError

pytestmark = pytest.mark.integration

MAX_PROCESSES = 8
DISK_MB = 64


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


def sandboxed(audit_hook: bool) -> PythonTool:
    return PythonTool(
        wall_time_s=8, max_processes=MAX_PROCESSES, disk_mb=DISK_MB, audit_hook=audit_hook
    )


def unprotected() -> PythonTool:
    """The control: no isolation, no audit hook (what the code could do on the bare host)."""
    return PythonTool(
        wall_time_s=8,
        bwrap="/nonexistent/bwrap",
        allow_unsandboxed=True,
        audit_hook=False,
    )


def leaked(t: Target, r: ToolResult) -> bool:
    return t.token in r.content


def last_int(r: ToolResult) -> int:
    lines = [line for line in r.content.splitlines() if line.strip().isdigit()]
    return int(lines[-1]) if lines else 0


@dataclass
class Attack:
    code: str
    succeeded: Callable[[Target, ToolResult], bool]


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
}


@pytest.mark.parametrize("audit_hook", [True, False], ids=["with-hook", "hook-off"])
@pytest.mark.parametrize("name", list(ATTACKS))
async def test_attack_fails_in_the_sandbox(name: str, audit_hook: bool, target: Target):
    attack = ATTACKS[name]
    r = await sandboxed(audit_hook).run(target.fill(attack.code))
    assert not attack.succeeded(target, r), f"{name} escaped:\n{r.content}"


@pytest.mark.parametrize("name", list(ATTACKS))
async def test_control_attack_succeeds_without_the_sandbox(name: str, target: Target):
    attack = ATTACKS[name]
    r = await unprotected().run(target.fill(attack.code))
    assert attack.succeeded(target, r), f"{name} did not work even unprotected:\n{r.content}"


async def test_the_hook_is_not_switched_off_by_a_class_property():
    """Defence in depth: the hook compares types without running user code."""
    r = await sandboxed(audit_hook=True).run(HOOK_SWITCH_OFF.format(secret="/nonexistent"))
    assert "switch-off failed" not in r.content  # the property never ran
    assert "/etc/passwd PermissionError" in r.content, r.content  # the hook still holds


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

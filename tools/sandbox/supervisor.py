# agentrl-sandbox-supervisor
"""The sandbox supervisor: the program the sandboxed interpreter runs, by path.

Why it exists: model code must not be able to outlive its deadline, keep processes running,
or hide what happened to it, and the parent cannot see inside the sandbox's PID namespace. So
the first process inside the sandbox is this supervisor, which the parent starts as::

    python -I -S /.agentrl/supervisor.py agentrl-sandbox-supervisor CONFIG_JSON

(bound read-only into the sandbox by :mod:`tools.sandbox.command`; the unsafe unsandboxed mode
runs the same file by its host path). It restores the episode's files, reads the code from
stdin, sets the resource limits and forks; the child installs the audit hook and runs the
code; the supervisor waits for it up to the deadline, kills everything the code left, then
writes a status line and (sandboxed) an archive of the working directory to the status pipe.

What it guarantees:

- it imports the standard library only (the sandbox holds nothing else), and importing it
  does nothing: tests import it like any module;
- the status pipe carries ``{"started": true}`` when the code is about to start (the parent
  times the wall limit from it, outside the sandbox), then one JSON line ``{"exit_code",
  "timed_out", "restore_error"}`` (``exit_code`` negative = killed by that signal), then,
  sandboxed, a tar stream of the working directory written after every process of the code
  is dead;
- with a ``seccomp`` program in the configuration, the code's process installs it (and
  ``no_new_privs``) before the code runs, and the code does not start if that fails; the
  supervisor first checks that it and its parent are the pids the filter protects;
- the code runs as ``__main__`` with the globals ``__name__`` and ``__builtins__`` only,
  compiled as ``<code>``: its tracebacks name ``<code>``, and the supervisor's own frames
  (this file) are hidden from it by the audit hook and cut from stderr by the parent;
- the audit hook (defence in depth; the boundary is bubblewrap) runs no user code: types are
  compared with ``type(x) is``, names must be plain ``str``, numbers are read with
  ``int.__int__``, and everything it uses is bound in its closure when it is installed.

The configuration (JSON, built by :func:`tools.sandbox.config.supervisor_config`):
``rlimits`` ({RLIMIT_* name: value}), ``cwd``, ``write_root``, ``restore`` (archive to unpack,
or ""), ``archive`` (write one), ``sandboxed``, ``status_fd``, ``wall_time_s``, ``audit``,
``max_forks``, ``site_dirs`` (appended to ``sys.path``), ``read_roots`` (readable under the
hook), ``seccomp`` (a BPF program as hex, or "") and ``protect_pids`` (the pids it protects).
"""

from __future__ import annotations

import builtins
import json
import os
import select
import signal
import sys

TYPE_CHECKING = False  # typing costs ~4 ms per call to import; annotations only need it here
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

MARKER = "agentrl-sandbox-supervisor"
"""The supervisor's first argument: in the command line of every sandboxed process."""
CHECK = "--check"
"""The first argument of a probe run: install the seccomp program given as the second (hex),
if any, print :data:`CHECK_OK` and exit."""
CHECK_OK = "agentrl-sandbox-ok"
STARTED_LINE = b'{"started": true}\n'
"""The status pipe's first line: the code is about to start (the parent's wall clock starts)."""

# The audit hook's policy, by event name (https://docs.python.org/3/library/audit_events.html).
READ_EVENTS = frozenset(
    {"os.listdir", "os.scandir", "glob.glob", "glob.glob/2", "os.getxattr", "os.listxattr"}
)
FS_EVENTS = READ_EVENTS | {
    "os.chdir", "os.mkdir", "os.remove", "os.rmdir", "os.rename", "os.link", "os.symlink",
    "os.chmod", "os.chown", "os.truncate", "os.utime", "os.chflags", "os.lchflags",
    "os.setxattr", "os.removexattr", "os.mkfifo", "os.mknod", "shutil.copyfile",
    "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.rmtree", "shutil.move",
    "shutil.chown", "shutil.make_archive", "shutil.unpack_archive", "tempfile.mkstemp",
    "tempfile.mkdtemp",
}  # fmt: skip
SPAWN_EVENTS = frozenset(
    {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "os.startfile",
     "pty.spawn", "os.forkpty"}
)  # fmt: skip
NET_EVENTS = frozenset(
    {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
     "socket.gethostbyname", "socket.gethostbyaddr", "socket.gethostbyname_ex",
     "socket.getnameinfo", "http.client.connect", "urllib.Request", "ftplib.connect",
     "smtplib.connect", "telnetlib.Telnet.open", "webbrowser.open"}
)  # fmt: skip
DENIED_EVENTS = frozenset(
    {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
     "sys.settrace", "sys.setprofile", "sys.addaudithook", "resource.setrlimit",
     "resource.prlimit", "os.setuid", "os.setgid"}
)  # fmt: skip
BLOCKED_IMPORTS = frozenset({"ctypes", "_ctypes", "_posixsubprocess"})
READABLE_DEVICES = ("/dev/null", "/dev/urandom", "/dev/zero", "/dev/random")


def main(argv: list[str]) -> None:
    """Supervise one run of the code on stdin, as ``argv[2]`` (the JSON config) says.

    Only the child returns from here, after the code ran; the supervisor exits in
    :func:`supervise`.
    """
    if argv[1:2] == [CHECK]:
        if len(argv) > 2:
            install_seccomp(argv[2])
        print(CHECK_OK)
        return
    if len(argv) != 3 or argv[1] != MARKER:
        raise SystemExit(f"usage: python -I -S supervisor.py {MARKER} CONFIG_JSON")
    cfg = json.loads(argv[2])
    sys.argv = ["<code>"]
    sys.dont_write_bytecode = True
    set_limits(cfg["rlimits"])
    os.chdir(cfg["cwd"])
    restore_error = restore_files(cfg["restore"])
    code = read_code()
    # Started with -S (no .pth processing, half the start-up): site-packages are added by hand.
    for path in cfg["site_dirs"]:
        if path not in sys.path:
            sys.path.append(path)
    if cfg["seccomp"] and sorted({os.getpid(), os.getppid()}) != sorted(cfg["protect_pids"]):
        raise SystemExit(
            f"sandbox: the supervisor is pid {os.getpid()} (parent {os.getppid()}), not one of "
            f"{cfg['protect_pids']} that the seccomp filter protects"
        )
    os.write(cfg["status_fd"], STARTED_LINE)
    child = os.fork()
    if child:
        supervise(child, cfg, restore_error)
    os.setsid()
    os.close(cfg["status_fd"])
    if cfg["seccomp"]:
        try:
            install_seccomp(cfg["seccomp"])
        except OSError as e:
            os.write(2, f"sandbox: the seccomp filter could not be installed: {e}\n".encode())
            os._exit(126)
    if cfg["audit"]:
        install_audit_hook(
            os.path.realpath(cfg["write_root"]),
            tuple(cfg["read_roots"]),
            cfg["max_forks"],
            cfg["sandboxed"],
        )
    run_code(code)


def install_seccomp(program_hex: str) -> None:
    """Install the classic-BPF seccomp program ``program_hex`` on this process (and its future
    children), after ``no_new_privs``; then forget ``ctypes`` (the code's import of it goes
    through the audit hook again).

    Raises:
        OSError: the kernel refused (no seccomp, or a malformed program).
    """
    import ctypes

    program = bytes.fromhex(program_hex)
    buffer = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program) // 8, ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    ulong = ctypes.c_ulong
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, ulong(1), ulong(0), ulong(0), ulong(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
    pointer = ctypes.cast(ctypes.pointer(fprog), ctypes.c_void_p).value
    if libc.prctl(
        pr_set_seccomp, ulong(seccomp_mode_filter), ulong(pointer or 0), ulong(0), ulong(0)
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]


def limit_pair(name: str, value: int, hard: int, infinity: int) -> tuple[int, int]:
    """The (soft, hard) pair that sets resource ``name`` to ``value`` under a ``hard`` cap.

    CPU gets a hard limit one second above the soft one: SIGXCPU at the soft limit (reported
    as such), SIGKILL a second later.
    """
    value = value if hard == infinity else min(value, hard)
    return value, value + 1 if name == "RLIMIT_CPU" else value


def set_limits(rlimits: dict[str, int]) -> None:
    """Apply ``{RLIMIT_* name: value}`` to this process (inherited by the code)."""
    import resource

    for name, value in rlimits.items():
        lim = getattr(resource, name)
        _, hard = resource.getrlimit(lim)
        resource.setrlimit(lim, limit_pair(name, value, hard, resource.RLIM_INFINITY))


def restore_files(archive_path: str) -> str:
    """Unpack the previous call's archive here; return why it failed ("" when it did not)."""
    if not archive_path or not os.path.exists(archive_path):
        return ""
    try:
        import tarfile

        with tarfile.open(archive_path) as archive:
            try:
                archive.extractall(".", filter="tar")
            except TypeError:  # Python < 3.11.4 has no extraction filters
                archive.extractall(".")
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def read_code() -> str:
    """The code, read from stdin to its end; stdin is then ``/dev/null`` for the code."""
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (stdin stays open for the code)
    return code


def supervise(pid: int, cfg: dict[str, Any], restore_error: str) -> None:
    """Wait for the code (process ``pid``) up to the deadline, kill what is left, report; exit."""
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], cfg["wall_time_s"])
    timed_out = not ready
    if timed_out:
        try:  # noqa: SIM105 (contextlib would cost the supervisor one more import)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    try:  # whatever the code left running (in the sandbox: every process but this one)
        if cfg["sandboxed"]:
            os.kill(-1, signal.SIGKILL)
        else:
            os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    head = {
        "exit_code": os.waitstatus_to_exitcode(status),
        "timed_out": timed_out,
        "restore_error": restore_error,
    }
    write_status(cfg["status_fd"], head, cfg["archive"])
    os._exit(0)


def write_status(fd: int, head: dict[str, Any], archive: bool) -> None:
    """The status line, then (``archive``) a tar stream of the working directory; closes ``fd``."""
    out = os.fdopen(fd, "wb")
    out.write(json.dumps(head).encode() + b"\n")
    if archive:
        import tarfile

        with tarfile.open(fileobj=out, mode="w|") as tar:
            for entry in sorted(os.listdir(".")):
                tar.add(entry)
    out.close()


def run_code(source: str) -> None:
    """Run ``source`` as the ``__main__`` module (which stops being this supervisor).

    An uncaught exception is printed by the interpreter's C code (exit status 1); the parent
    removes the supervisor's own frames from it.
    """
    module = type(sys)("__main__")
    namespace = module.__dict__
    namespace.clear()
    namespace.update({"__name__": "__main__", "__builtins__": builtins})
    sys.modules["__main__"] = module
    exec(compile(source, "<code>", "exec"), namespace)


def install_audit_hook(
    root: str, read_roots: tuple[str, ...], max_forks: int, pid_ns: bool
) -> None:
    """Install the audit hook: files only under ``root`` (reads also under ``read_roots``), no
    sockets but AF_UNIX, no spawning, at most ``max_forks`` forks (none in children), no
    ctypes, no rlimit changes, no frame or gc introspection reaching the hook.

    ``pid_ns``: the code has a PID namespace of its own (sandboxed), so signals are contained;
    otherwise signalling other processes is refused too.
    """
    import _posixsubprocess

    def no_spawn(*a: object, **k: object) -> None:
        """Stands in for ``fork_exec``: spawning is refused before any audit event."""
        raise PermissionError("sandbox: starting programs is disabled")

    _posixsubprocess.fork_exec = no_spawn  # type: ignore[attr-defined]  # a C function
    check = _path_checker(root, read_roots)
    state = {"forks": max_forks, "busy": False}
    os.register_at_fork(after_in_child=lambda: state.__setitem__("forks", 0))
    sys.addaudithook(_make_hook(check, state, max_forks, pid_ns))


def _path_checker(root: str, read_roots: tuple[str, ...]) -> Callable[[Any, bool], None]:
    """``check(path, write)``: raise ``PermissionError`` unless the hook allows that access."""
    import pathlib

    realpath, sep, fsdecode = os.path.realpath, os.sep, os.fsdecode
    path_types = (pathlib.PosixPath, pathlib.PurePosixPath)
    readable = READABLE_DEVICES

    def as_text(path: Any) -> str:
        """The path as ``str``, converted without running user code (no ``__fspath__``)."""
        t = type(path)
        if t is str:
            return path
        if t is bytes:
            return fsdecode(path)
        if t in path_types:
            return str(path)
        raise PermissionError(
            f"sandbox: pass file paths as str, bytes or pathlib paths, not {t.__name__}"
        )

    def check(path: Any, write: bool) -> None:
        """Allow ``path`` under ``root``, or (reading) a device or a path under ``read_roots``."""
        text = as_text(path)
        p = realpath(text)
        if p == root or p.startswith(root + sep):
            return
        if not write:
            if p in readable:
                return
            for r in read_roots:
                if p == r or p.startswith(r + sep):
                    return
        raise PermissionError(f"sandbox: access to {text!r} is outside the working directory")

    return check


def _make_hook(
    check: Callable[[Any, bool], None], state: dict[str, Any], max_forks: int, pid_ns: bool
) -> Callable[[str, tuple[Any, ...]], None]:
    """The audit hook itself (see :func:`install_audit_hook`); its policy is bound here."""
    import socket

    read_events, fs_events, spawn_events = READ_EVENTS, FS_EVENTS, SPAWN_EVENTS
    net_events, denied_events, blocked_imports = NET_EVENTS, DENIED_EVENTS, BLOCKED_IMPORTS
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    simple = {int, float, type(None), tuple, bool}
    af_unix, getpid, as_int = socket.AF_UNIX, os.getpid, int.__int__
    own_file = _make_hook.__code__.co_filename  # the supervisor's frames: hidden from the code

    def name_of(value: Any) -> str:
        """``value`` if it is a plain ``str`` (a subclass could run user code in the hook)."""
        if type(value) is not str:
            raise PermissionError("sandbox: names must be plain str")
        return value

    def hook(event: str, args: tuple[Any, ...]) -> None:
        """Refuse (raise) what the policy forbids; return for everything else."""
        if state["busy"]:
            return
        if event == "open":
            path, mode, flags = args
            if type(path) is int:
                return
            mode = "" if mode is None else name_of(mode)
            flags = 0 if flags is None else as_int(flags)
            check(path, any(c in mode for c in "wax+") or bool(flags & write_flags))
        elif event in fs_events:
            for a in args:
                if type(a) not in simple:
                    check(a, event not in read_events)
        elif event in spawn_events:
            raise PermissionError("sandbox: starting programs is disabled")
        elif event == "os.fork":
            if state["forks"] <= 0:
                raise PermissionError(
                    "sandbox: fork is disabled"
                    if max_forks == 0 or not pid_ns
                    else "sandbox: fork limit reached (children may not fork)"
                )
            state["forks"] -= 1
        elif event in ("os.kill", "os.killpg") and not pid_ns:
            if args and as_int(args[0]) not in (0, getpid()):
                raise PermissionError("sandbox: signalling other processes is disabled")
        elif event == "socket.__new__":
            if len(args) > 1 and as_int(args[1]) != af_unix:
                raise PermissionError("sandbox: network access is disabled")
        elif event in net_events:
            raise PermissionError("sandbox: network access is disabled")
        elif event == "import" and args and name_of(args[0]) in blocked_imports:
            raise ImportError(f"sandbox: module {args[0]!r} is disabled")
        elif event in denied_events or event.startswith("ctypes."):
            raise PermissionError(f"sandbox: {event} is disabled")
        elif event == "object.__setattr__" and len(args) > 1 and name_of(args[1]) == "__code__":
            raise PermissionError("sandbox: replacing a function's code is disabled")
        elif event == "object.__getattr__" and len(args) > 1 and name_of(args[1]) == "tb_frame":
            # A traceback through the hook must not hand out the hook's frames.
            state["busy"] = True
            try:
                name = args[0].tb_frame.f_code.co_filename
            finally:
                state["busy"] = False
            if name == own_file:
                raise PermissionError("sandbox: the sandbox's own frames are hidden")

    return hook


if __name__ == "__main__":
    main(sys.argv)

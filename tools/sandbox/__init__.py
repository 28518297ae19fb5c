"""The sandbox of the ``python`` tool (:mod:`tools.python_sandbox`): bubblewrap around a
supervisor process.

One noun per module, in the order a call uses them:

- :mod:`tools.sandbox.config`: the limits of a call (:class:`SandboxLimits`), the layout inside
  the sandbox, :class:`Isolation`, and the supervisor's configuration;
- :mod:`tools.sandbox.probe`: which isolation this machine offers (asked once per process) and
  the refusal (:class:`SandboxUnavailableError`) when there is none;
- :mod:`tools.sandbox.cgroup`: where per-call cgroups can be made (v2 or v1), and one call's
  cgroup (limits, kill, usage, removal);
- :mod:`tools.sandbox.seccomp`: the seccomp filter (a classic-BPF program) the code runs under;
- :mod:`tools.sandbox.command`: the bwrap command line, stage by stage (namespaces,
  environment, file system, privileges);
- :mod:`tools.sandbox.supervisor`: the program run by path inside the sandbox (stdlib only):
  limits, files, the deadline, the audit hook;
- :mod:`tools.sandbox.process`: the parent's side of one run (feed, read, kill, keep the
  archive).

Nothing here imports more than the standard library (the supervisor runs in a bare
interpreter); importing the package imports none of its modules.
"""

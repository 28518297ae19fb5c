"""Build, cache and load the fused C kernel of the correction pass (``_native.c``) via ctypes.

Why: on CPU the eager torch pass is ~20 elementwise/reduction kernels per cache block; the C loop
does them all in one pass per row (the full correction pass on B = 256, T = 8192 float32 takes
about half the CPU time of the torch path; see ``docs/correction.md``). It is plain C (no torch headers), so building takes about a second with the
system compiler and needs nothing beyond ``cc``/``gcc``.

Guarantees:
- Built once per source/flags/compiler version/CPU model into ``$AGENTRL_CACHE_DIR`` (default
  ``~/.cache/agentrl``) as ``correction_native_<hash>.so``: compiled to a temporary file in that
  directory, then atomically renamed, so concurrent processes never load a half-written library.
- ``AGENTRL_CORRECTION_NATIVE``: ``0`` never uses it; ``1`` requires it (``RuntimeError`` naming
  the cause if it cannot be built or loaded); unset uses it when it builds, else logs one warning
  per process and the torch path is used.
- Flags are ``-O3 -march=native -fno-math-errno`` (no ``-ffast-math``: IEEE rounding is kept; the
  loop is vectorized explicitly with GCC/Clang vector extensions).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["ENV_VAR", "NativeKernel", "kernel"]

ENV_VAR = "AGENTRL_CORRECTION_NATIVE"
COMPILERS: tuple[str, ...] = ("cc", "gcc")
"""Compiler names tried in order (``$CC`` first when set)."""
FLAGS: tuple[str, ...] = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-shared",
    "-fPIC",
)
SOURCE = Path(__file__).with_name("_native.c")

N_STATS = 12
"""Rows of the per-sequence statistics array (the ``S_*`` enum of ``_native.c``)."""
STAT_KEYS: tuple[str, ...] = (
    "neg_sum",
    "rollout_sum",
    "seq_len",
    "em1_sum",
    "k3_sum",
    "k2x2_sum",
    "neg_min",
    "neg_max",
    "kept/token_k1",
    "kept/token_k2",
    "kept/token_k3",
    "kept_token",
)
N_SUMS = 6
"""Per-call sums: Σw, Σw², #truncated, Σem1², max w, min w (the ``T_*`` enum)."""
N_PARAMS = 5
PARALLEL_MIN_ELEMENTS = 1 << 20
"""Below this many elements per thread the kernel runs on the calling thread only."""
_ABI = 1000 * N_STATS + 100 * N_SUMS + N_PARAMS

_log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}
"""The process's build outcome: ``{"kernel": NativeKernel}`` or ``{"error": str}``."""

_F32P = ctypes.POINTER(ctypes.c_float)
_F64P = ctypes.POINTER(ctypes.c_double)


class NativeKernel:
    """The loaded library. Methods take contiguous CPU tensors (the caller checks)."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls
        abi = lib.agentrl_correction_abi
        abi.restype = ctypes.c_int
        abi.argtypes = []
        if abi() != _ABI:
            raise RuntimeError(f"{path} has ABI {abi()}, expected {_ABI}: stale cached build")
        self._rows = lib.agentrl_correction_rows
        self._rows.restype = ctypes.c_int
        self._rows.argtypes = [ctypes.c_int64, ctypes.c_int64] + [_F32P] * 5 + [_F32P, _F32P]
        self._rows.argtypes += [_F64P, ctypes.c_int64, _F64P]
        self._exp = lib.agentrl_exp_neg
        self._exp.restype = None
        self._exp.argtypes = [_F32P, _F32P, ctypes.c_int64]
        self.path = path

    def rows(
        self,
        train: torch.Tensor | None,
        rollout: torch.Tensor | None,
        log_ratio: torch.Tensor | None,
        mask: torch.Tensor,
        params: torch.Tensor,
        weights: torch.Tensor | None,
        keep: torch.Tensor | None,
        stats: torch.Tensor,
        sums: torch.Tensor,
        threads: int = 1,
    ) -> int:
        """Run the kernel over all ``mask.shape[0]`` rows; returns its code (0 = ok, see
        ``_native.c``).

        Float32 ``[B, T]`` contiguous inputs/outputs (None = absent), ``params`` float32
        ``[N_PARAMS]``, ``stats`` float64 ``[N_STATS, B]`` (written), ``sums`` float64 ``[N_SUMS]``
        (accumulated into). With ``threads`` > 1 and at least ``PARALLEL_MIN_ELEMENTS`` elements,
        row ranges run on that many threads (ctypes releases the GIL), each with its own sums.
        """
        batch, length = mask.shape
        n_parts = min(threads, batch, max(1, batch * length // PARALLEL_MIN_ELEMENTS))
        if n_parts <= 1:
            return self._call(
                0, batch, train, rollout, log_ratio, mask, params, weights, keep, stats, sums
            )
        bounds = [batch * i // n_parts for i in range(n_parts + 1)]
        part_sums = [sums.clone() for _ in range(n_parts)]
        args = (train, rollout, log_ratio, mask, params, weights, keep, stats)
        with ThreadPoolExecutor(max_workers=n_parts) as pool:
            codes = list(
                pool.map(
                    lambda i: self._call(bounds[i], bounds[i + 1], *args, part_sums[i]),
                    range(n_parts),
                )
            )
        stacked = torch.stack(part_sums)
        sums[:4] = stacked[:, :4].sum(dim=0) - (n_parts - 1) * sums[:4]
        sums[4] = stacked[:, 4].max()
        sums[5] = stacked[:, 5].min()
        return next((c for c in codes if c), 0)

    def _call(
        self,
        r0: int,
        r1: int,
        train: torch.Tensor | None,
        rollout: torch.Tensor | None,
        log_ratio: torch.Tensor | None,
        mask: torch.Tensor,
        params: torch.Tensor,
        weights: torch.Tensor | None,
        keep: torch.Tensor | None,
        stats: torch.Tensor,
        sums: torch.Tensor,
    ) -> int:
        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            """Rows ``[r0, r1)`` of ``t`` (None stays None)."""
            return None if t is None else t[r0:r1]

        return int(
            self._rows(
                r1 - r0,
                mask.shape[1],
                _ptr(rows(train), _F32P),
                _ptr(rows(rollout), _F32P),
                _ptr(rows(log_ratio), _F32P),
                _ptr(rows(mask), _F32P),
                _ptr(params, _F32P),
                _ptr(rows(weights), _F32P),
                _ptr(rows(keep), _F32P),
                _ptr(stats[:, r0:r1], _F64P),
                stats.stride(0),
                _ptr(sums, _F64P),
            )
        )

    def exp_neg(self, x: torch.Tensor) -> torch.Tensor:
        """``exp(−clamp(x, ±20))`` with the kernel's float32 exp (for accuracy tests)."""
        x = x.detach().to(torch.float32).contiguous()
        out = torch.empty_like(x)
        self._exp(_ptr(x, _F32P), _ptr(out, _F32P), x.numel())
        return out


def _ptr(tensor: torch.Tensor | None, kind: type) -> object:
    return None if tensor is None else ctypes.cast(tensor.data_ptr(), kind)


def mode() -> str:
    """``"off"``, ``"required"`` or ``"auto"`` from ``AGENTRL_CORRECTION_NATIVE``."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value == "":
        return "auto"
    if value == "0":
        return "off"
    if value == "1":
        return "required"
    raise ValueError(
        f"{ENV_VAR}={value!r} is not understood; set it to 0 (torch path only), 1 (require the "
        "native kernel) or leave it unset (use it when it builds)"
    )


def cache_dir() -> Path:
    """Where built kernels are cached: ``$AGENTRL_CACHE_DIR``, else ``~/.cache/agentrl``."""
    return Path(os.environ.get("AGENTRL_CACHE_DIR") or Path.home() / ".cache" / "agentrl")


def kernel() -> NativeKernel | None:
    """The native kernel per ``AGENTRL_CORRECTION_NATIVE`` (see the module docstring), or None."""
    setting = mode()
    if setting == "off":
        return None
    with _LOCK:
        if not _STATE:
            try:
                _STATE["kernel"] = NativeKernel(_build())
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _STATE["error"] = str(exc)
                if setting == "auto":
                    _log.warning(
                        "correction: native CPU kernel unavailable, using the torch path "
                        "(about 3x slower on CPU): %s. Set %s=0 to silence this.",
                        exc,
                        ENV_VAR,
                    )
        found = _STATE.get("kernel")
    if isinstance(found, NativeKernel):
        return found
    if setting == "required":
        raise RuntimeError(
            f"{ENV_VAR}=1 requires the native correction kernel, but it could not be built or "
            f"loaded: {_STATE.get('error')}. Install a C compiler (cc or gcc) or unset {ENV_VAR}."
        )
    return None


def _compiler() -> str:
    names = ((os.environ["CC"],) if os.environ.get("CC") else ()) + COMPILERS
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError(f"no C compiler found (tried {', '.join(names)})")


def _cpu_identity() -> str:
    """The CPU's model and feature flags: ``-march=native`` builds must not be shared between
    different CPUs (e.g. a home directory mounted on several machines)."""
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    ident += line
                if line.strip() == "":  # first processor's block only
                    break
    except OSError:
        ident += platform.processor()
    return ident


def _build() -> Path:
    compiler = _compiler()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    source = SOURCE.read_bytes()
    key = "\0".join([*FLAGS, version, compiler, _cpu_identity()])
    digest = hashlib.sha256(source + key.encode()).hexdigest()[:20]
    directory = cache_dir()
    target = directory / f"correction_native_{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".correction_native_", suffix=".so", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{compiler} failed to build {SOURCE.name} (exit {result.returncode}): "
                f"{result.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, target)  # atomic: other processes see no file or the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target

"""Which backend and how many ranks a tray gets when the command line leaves them out."""

from __future__ import annotations

from tray.errors import UsageError

# NOTE: with no GPU visible, a 4-rank tray is what CI and the demo run.
HOST_DEFAULT_NPROCS = 4


def backend_and_nprocs(backend: str | None, nprocs: int | None) -> tuple[str, int]:
    """(backend, nprocs): `backend` or cuda when a GPU is visible (else host); `nprocs` or every visible GPU
    (host: HOST_DEFAULT_NPROCS). Raises UsageError for an unknown backend, no GPU on cuda, or nprocs < 1."""
    from tray.backend import BACKENDS, detect_backend

    chosen = backend or detect_backend()
    if chosen not in BACKENDS:
        raise UsageError(f"unknown backend {chosen!r}; expected one of {', '.join(BACKENDS)}")
    if nprocs is None:
        if chosen == "cuda":
            from tray.backend.cuda import visible_gpu_count

            nprocs = visible_gpu_count()
            if nprocs == 0:
                raise UsageError("--backend cuda but no GPU is visible; use --backend host")
        else:
            nprocs = HOST_DEFAULT_NPROCS
    if nprocs < 1:
        raise UsageError(f"-n must be at least 1, got {nprocs}")
    return chosen, nprocs

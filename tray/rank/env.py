"""The environment contract a rank is started with (docs/design.md section 4), parsed once."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from tray.envvars import barrier_timeout
from tray.errors import UsageError

_REQUIRED = ("TRAY_RANK", "TRAY_WORLD_SIZE", "TRAY_RDZV", "TRAY_JOB", "TRAY_TOKEN", "TRAY_BACKEND")


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    device: int
    endpoint: str
    job_dir: str
    token: str
    manifest: str
    backend: str
    vars: tuple[tuple[str, int], ...]
    t_spawn: float | None
    barrier_timeout_s: float | None = None  # TRAY_BARRIER_TIMEOUT_S: programs' barriers wait this long
    # a job of several trays: this rank's node and the ranks per node (rank // local_world_size = node)
    node_rank: int = 0
    nnodes: int = 1
    local_world_size: int = 0

    def barrier_wait_s(self, manifest_s: float | None) -> float:
        """How long barriers without a timeout of their own wait (rank.barrier(), programs' barrier ops, the
        host backend's collectives): the launch's or TRAY_BARRIER_TIMEOUT_S, else the manifest's, else 2 s."""
        from tray.backend.base import DEFAULT_BARRIER_TIMEOUT_S

        return self.barrier_timeout_s or manifest_s or DEFAULT_BARRIER_TIMEOUT_S

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "RankEnv":
        env = os.environ if environ is None else environ
        missing = [k for k in _REQUIRED if not env.get(k)]
        if missing:
            raise UsageError(
                f"tray.init() found no tray here ({', '.join(missing)} unset); start this program with "
                "`tray launch -n N -- python your_program.py`"
            )
        timeout_s = barrier_timeout(env.get("TRAY_BARRIER_TIMEOUT_S"))
        try:
            pairs = [kv.split("=", 1) for kv in env.get("TRAY_VARS", "").split(",") if kv]
            return cls(
                rank=int(env["TRAY_RANK"]), world_size=int(env["TRAY_WORLD_SIZE"]),
                local_rank=int(env.get("TRAY_LOCAL_RANK", env["TRAY_RANK"])),
                device=int(env.get("TRAY_DEVICE", env["TRAY_RANK"])), endpoint=env["TRAY_RDZV"],
                job_dir=env["TRAY_JOB"], token=env["TRAY_TOKEN"], manifest=env.get("TRAY_MANIFEST", ""),
                backend=env["TRAY_BACKEND"], vars=tuple((k, int(v)) for k, v in pairs),
                t_spawn=float(env["TRAY_T_SPAWN"]) if env.get("TRAY_T_SPAWN") else None,
                barrier_timeout_s=timeout_s,
                node_rank=int(env.get("TRAY_NODE_RANK", "0")), nnodes=int(env.get("TRAY_NNODES", "1")),
                local_world_size=int(env.get("TRAY_LOCAL_WORLD_SIZE") or env["TRAY_WORLD_SIZE"]),
            )
        except ValueError as exc:
            raise UsageError(f"malformed tray environment: {exc}") from None

"""A job of several trays: which node this head is, where the root listens, from the CLI or a scheduler.

Sources, in precedence order per field: the command line (torchrun's names and aliases), then one
scheduler's environment: Slurm (`--slurm`, or automatic inside an `srun` step with one task per node),
PyTorchJob (`PET_*`) or LeaderWorkerSet (`LWS_*`). Two scheduler environments at once, or two spellings
of one field on the command line that disagree, are usage errors naming both. Nothing here changes
`os.environ`: the environment is read from the mapping passed in.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from tray.errors import UsageError
from tray.launch.hostlist import first_host
from tray.launch.pick import MAX_NPROCS
from tray.text import is_digits

__all__ = ["JobArgs", "JobSpec", "TOKEN_VAR", "job_rank_env", "pytorchjob_nprocs", "resolve_job", "slurm_port"]

TOKEN_VAR = "TRAY_JOB_TOKEN"
# NOTE: the CURVE keys are derived from the token, so they are only as strong as it is; 16 characters
# is the floor (the sbatch script makes 64 hex characters).
MAX_NNODES = 1 << 16  # nodes of one job: the root holds a connection per node
MIN_TOKEN_CHARS = 16
# and its characters must vary: "aaaaaaaaaaaaaaaa" or sixteen spaces are guessed at once, and one HELLO captured on the
# wire lets guesses be checked offline (a random hex token of 16 has fewer than 6 distinct characters 1e-5 of the time)
MIN_TOKEN_DISTINCT = 6
# NOTE: torchrun's default master port; used where a scheduler names the root's host but no port (LWS).
# NOTE: the root and the heads say they are alive this often; each declares the other lost after its heartbeat
# timeout (default 5 s: ten missed beats). Here, not in tray.launch.root, so that checking --node-heartbeat-timeout-s
# of a one-host launch loads neither the root nor ZeroMQ.
HEARTBEAT_INTERVAL_S = 0.5
DEFAULT_PORT = 29500
RDZV_DEFAULT_PORT = 29400  # torchrun's port for an --rdzv-endpoint given without one
# NOTE: the Slurm port is derived from the job id so every node computes the same one without talking;
# 20000-29999 lies below Linux's ephemeral range (32768+), where outgoing connections take their ports.
SLURM_PORT_BASE = 20000
# NOTE: two ports per job, the root's and MASTER_PORT (the root's + 1), so consecutive jobs sharing a node never
# take each other's: the root at 20000 + 2 x (job id mod 5000)
SLURM_PORT_JOBS = 5000
# NOTE: step s of a job takes the slot s x 1009 further on (mod 5000), so two steps of one job running at once
# (each on its own GPUs of the nodes) never share a port, and step 0 is where the job id alone puts it; a prime
# stride keeps the steps of a job far from the slots of the jobs with neighbouring ids
SLURM_PORT_STEP_STRIDE = 1009
# NOTE: a lost node is named within this bound; heartbeats go every HEARTBEAT_INTERVAL_S (node.py).
DEFAULT_NODE_HEARTBEAT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class JobArgs:
    """What the command line said (None: not given)."""

    nnodes: int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc_per_node: int | None = None
    slurm: bool = False
    node_heartbeat_timeout_s: float = DEFAULT_NODE_HEARTBEAT_TIMEOUT_S
    standalone: bool = False  # torchrun's: one host, whatever a scheduler's environment says


@dataclass(frozen=True)
class JobSpec:
    """This head's place in a job of `nnodes` trays; the root (node 0's head) listens on
    `root_host`:`root_port` (TCP). `source` says where the values came from ("cli", "slurm",
    "pytorchjob", "lws"), `port_source` where the port did; `nproc_per_node` is None when no source said it (the CLI
    default applies)."""

    nnodes: int
    node_rank: int
    root_host: str
    root_port: int
    rdzv_id: str
    token: str
    source: str
    nproc_per_node: int | None = None
    node_heartbeat_timeout_s: float = DEFAULT_NODE_HEARTBEAT_TIMEOUT_S
    port_source: str = "cli"

    @property
    def endpoint(self) -> str:
        return f"{self.root_host}:{self.root_port}"

    @property
    def is_root(self) -> bool:
        return self.node_rank == 0


def slurm_port(job_id: str, step: str | None = None) -> int:
    """The root's port for step `step` of Slurm job `job_id` (same on every node): 20000 + 2 x ((id + 1009 x step)
    mod 5000); the program's MASTER_PORT is the next one. A step that is not a number counts as 0."""
    digits = job_id.split("_")[0]  # array jobs: "1234_7"
    if not is_digits(digits):
        raise UsageError(f"SLURM_JOB_ID {job_id!r} is not a number; give the port: --rdzv-endpoint HOST:PORT")
    s = int(step) if step is not None and is_digits(step) else 0
    return SLURM_PORT_BASE + 2 * ((int(digits) + SLURM_PORT_STEP_STRIDE * s) % SLURM_PORT_JOBS)


def _int(value: str, name: str, lo: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r}: expected an integer") from None
    if n < lo:
        raise UsageError(f"{name}={n}: expected an integer >= {lo}")
    return n


def _split_endpoint(endpoint: str, name: str) -> tuple[str, int | None]:
    """(host, port) of HOST:PORT; (host, None) of a HOST alone (torchrun's rdzv-endpoint then takes its port 29400)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep and port and not port.startswith("["):
        return port, None
    if not sep or not host or not port:
        raise UsageError(f"{name} {endpoint!r}: expected HOST:PORT, e.g. node001:29500")
    host = host.strip("[]")
    if ":" in host:
        raise UsageError(f"{name} {endpoint!r}: an IPv6 address; the heads reach the root over IPv4: give a host name "
                         "or an IPv4 address")
    if not is_digits(port) or int(port) > 65535:  # said of the whole endpoint: the port alone reads as the option's
        raise UsageError(f"{name} {endpoint!r}: its port {port!r} is no TCP port (1..65535); expected HOST:PORT, e.g. "
                         "node001:29500")
    return host, int(port)


def _port(value: str | int, name: str) -> int:
    n = _int(str(value), name, 1)
    if n > 65535:
        raise UsageError(f"{name}={n}: a TCP port is 1..65535")
    return n


@dataclass(frozen=True)
class _Found:
    """Fields one source gave (None: not given), and the source's name for messages."""

    source: str
    nnodes: int | None = None
    node_rank: int | None = None
    host: str | None = None
    port: int | None = None
    rdzv_id: str | None = None
    nproc_per_node: int | None = None


def _from_cli(args: JobArgs) -> _Found:
    host = port = None
    if args.rdzv_endpoint:
        host, port = _split_endpoint(args.rdzv_endpoint, "--rdzv-endpoint")
    if args.master_addr is not None:
        if host is not None and args.master_addr != host:
            raise UsageError(f"--rdzv-endpoint says host {host!r}, --master-addr says {args.master_addr!r}; "
                             "give one of them")
        host = args.master_addr
    if args.master_port is not None:
        mp = _port(args.master_port, "--master-port")
        if port is not None and mp != port:
            raise UsageError(f"--rdzv-endpoint says port {port}, --master-port says {mp}; give one of them")
        port = mp
    elif args.rdzv_endpoint and port is None:
        port = RDZV_DEFAULT_PORT  # `--rdzv-endpoint HOST`: torchrun's c10d rendezvous port
    return _Found("cli", nnodes=args.nnodes, node_rank=args.node_rank, host=host, port=port,
                  rdzv_id=args.rdzv_id, nproc_per_node=args.nproc_per_node)


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    """Inside an `srun` step that runs one task per node (the automatic case), or one over several nodes (whose
    tasks per node _from_slurm then refuses: several trays per node would each take every GPU of it, and tasks of
    one step on several nodes are no trays of one host each)."""
    if not (env.get("SLURM_JOB_ID") and env.get("SLURM_NODEID") and env.get("SLURM_STEP_ID")):
        return False
    tasks, nodes = env.get("SLURM_STEP_NUM_TASKS"), env.get("SLURM_STEP_NUM_NODES")
    return tasks is not None and (tasks == nodes or (nodes is not None and is_digits(nodes) and int(nodes) > 1))


def _from_slurm(env: Mapping[str, str]) -> _Found:
    missing = [k for k in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_JOB_NODELIST")
               if not env.get(k)]
    if missing:
        raise UsageError(f"--slurm: {', '.join(missing)} unset; run `tray launch --slurm` inside a Slurm job "
                         "step: srun --ntasks-per-node=1 tray launch --slurm ...")
    nnodes = _int(env["SLURM_JOB_NUM_NODES"], "SLURM_JOB_NUM_NODES", 1)
    tasks, step_nodes = env.get("SLURM_STEP_NUM_TASKS"), env.get("SLURM_STEP_NUM_NODES")
    if tasks is not None and step_nodes is not None and tasks != step_nodes:
        raise UsageError(f"this Slurm step runs {tasks} tasks on {step_nodes} nodes; tray needs one task per "
                         "node (its head spawns the ranks): srun --ntasks-per-node=1 tray launch ... (a job's "
                         "--ntasks-per-node is inherited by srun: give it there); --standalone runs a separate tray "
                         "of one host per task instead")
    if step_nodes is not None and _int(step_nodes, "SLURM_STEP_NUM_NODES", 1) != nnodes:
        raise UsageError(f"this Slurm step spans {step_nodes} of the job's {nnodes} nodes; run it on all of them "
                         f"(srun -N{nnodes} --ntasks-per-node=1); --standalone runs a tray of this node alone instead")
    job_id = env["SLURM_JOB_ID"]
    step = env.get("SLURM_STEP_ID")
    return _Found("slurm", nnodes=nnodes, node_rank=_int(env["SLURM_NODEID"], "SLURM_NODEID", 0),
                  host=first_host(env["SLURM_JOB_NODELIST"]), port=slurm_port(job_id, step),
                  rdzv_id=f"slurm-{job_id}" + (f".{step}" if step else ""))


def _from_pytorchjob(env: Mapping[str, str]) -> _Found:
    nnodes_text = env.get("PET_NNODES", "")
    low, sep, high = nnodes_text.partition(":")
    if sep and low.strip() == high.strip():  # an elasticPolicy's minReplicas = maxReplicas: "2:2", as --nnodes 2:2
        nnodes_text = low.strip()
    elif sep:
        raise UsageError(f"PET_NNODES={nnodes_text!r} is an elastic range; tray runs a fixed number of nodes "
                         "(set minReplicas = maxReplicas, or give --nnodes)")
    nproc = env.get("PET_NPROC_PER_NODE")
    return _Found(
        "pytorchjob",
        nnodes=_int(nnodes_text, "PET_NNODES", 1) if nnodes_text else None,
        node_rank=_int(env["PET_NODE_RANK"], "PET_NODE_RANK", 0) if env.get("PET_NODE_RANK") else None,
        host=env.get("PET_MASTER_ADDR") or None,
        port=_port(env["PET_MASTER_PORT"], "PET_MASTER_PORT") if env.get("PET_MASTER_PORT") else None,
        rdzv_id=env.get("PET_RDZV_ID") or None,
        nproc_per_node=_int(nproc, "PET_NPROC_PER_NODE", 1) if nproc and is_digits(nproc) else None,
    )


def _from_lws(env: Mapping[str, str]) -> _Found:
    return _Found(
        "lws",
        nnodes=_int(env["LWS_GROUP_SIZE"], "LWS_GROUP_SIZE", 1) if env.get("LWS_GROUP_SIZE") else None,
        node_rank=_int(env["LWS_WORKER_INDEX"], "LWS_WORKER_INDEX", 0) if env.get("LWS_WORKER_INDEX") else None,
        host=env.get("LWS_LEADER_ADDRESS") or None,
        rdzv_id=env.get("LWS_LEADER_ADDRESS") or None,  # one per group (LWS sets no name of its own)
    )


def pytorchjob_nprocs(env: Mapping[str, str]) -> int | str | None:
    """A PyTorchJob's PET_NPROC_PER_NODE (spec.nprocPerNode) as torchrun's --nproc-per-node: a number, or one of its
    words (auto, gpu, cpu), for -n when not given; None outside a PyTorchJob or when unset. One pod or several."""
    value = env.get("PET_NPROC_PER_NODE", "").strip()
    if not value or not (env.get("PET_NNODES") or env.get("PET_NODE_RANK")):
        return None
    if value in ("auto", "gpu", "cpu"):
        return value
    if not is_digits(value):
        raise UsageError(f"PET_NPROC_PER_NODE={value!r}: expected a number of ranks per node, or auto, gpu or cpu "
                         "(the PyTorchJob's nprocPerNode)")
    n = _int(value, "PET_NPROC_PER_NODE", 1)
    if n > MAX_NPROCS:  # said here: -n was never given
        raise UsageError(f"PET_NPROC_PER_NODE={value}: at most {MAX_NPROCS} ranks per node (the PyTorchJob's "
                         "nprocPerNode)")
    return n


def _scheduler(args: JobArgs, env: Mapping[str, str]) -> _Found | None:
    """The one scheduler environment to read, or None; two at once is a conflict."""
    present = []
    if args.slurm or _in_slurm_step(env):
        present.append(("Slurm (SLURM_*)", _from_slurm))
    if env.get("PET_NNODES") or env.get("PET_NODE_RANK"):
        present.append(("PyTorchJob (PET_*)", _from_pytorchjob))
    if env.get("LWS_LEADER_ADDRESS"):
        present.append(("LeaderWorkerSet (LWS_*)", _from_lws))
    elif is_digits(env.get("LWS_GROUP_SIZE", "")) and int(env["LWS_GROUP_SIZE"]) > 1:
        raise UsageError(f"LWS_GROUP_SIZE={env['LWS_GROUP_SIZE']} describes a LeaderWorkerSet group of several pods, "
                         "but LWS_LEADER_ADDRESS (the leader's address, where the root listens) is unset; set it, or "
                         "give --nnodes, --node-rank and --rdzv-endpoint")
    if len(present) > 1:
        names = " and ".join(name for name, _ in present)
        raise UsageError(f"the environment describes the job twice: {names}; unset one, or give --nnodes, "
                         "--node-rank and --rdzv-endpoint on the command line")
    return present[0][1](env) if present else None


def _note_a_job_not_found(env: Mapping[str, str]) -> None:
    """In a Kubernetes pod whose environment describes a torch job of several processes (an operator older than
    the PET_* variables: training-operator < 1.7) but no job tray reads, or in the batch script of a Slurm job of
    several nodes (not in an srun step): say that this runs one tray alone."""
    nodes = env.get("SLURM_JOB_NUM_NODES", "")
    if env.get("SLURM_JOB_ID") and not env.get("SLURM_STEP_ID") and is_digits(nodes) and int(nodes) > 1:
        print(f"tray: note: this Slurm job has {nodes} nodes, but this tray runs on this one alone (a batch script "
              "runs on the job's first node); run one per node: srun --ntasks-per-node=1 tray launch ..., or "
              "sbatch launch/slurm/tray.sbatch", file=sys.stderr, flush=True)
        return
    world = env.get("WORLD_SIZE", "")
    if "KUBERNETES_SERVICE_HOST" in env and env.get("MASTER_ADDR") and is_digits(world) and int(world) > 1:
        print(f"tray: note: WORLD_SIZE={world} and MASTER_ADDR={env['MASTER_ADDR']} are set, but no job of several "
              "nodes was found (no --nnodes, SLURM_*, PET_* or LWS_*): this pod runs one tray alone. A PyTorchJob "
              "needs training-operator 1.7 or later (PET_* variables)", file=sys.stderr, flush=True)


def is_this_host(host: str) -> bool:
    """Whether `host` names this machine: a loopback address, or one an address of this machine resolves to."""
    try:
        addrs = {str(info[4][0]) for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False
    for addr in addrs:
        if addr.startswith("127."):
            return True
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((addr, 0))  # only an address of this machine can be bound
                return True
            except OSError:
                continue
    return False


# what a scheduler gives each node, which a flag may repeat but not contradict: (the flag, the variable per source)
_SCHEDULER_DECIDES: dict[str, tuple[str, dict[str, str]]] = {
    "nnodes": ("--nnodes", {"slurm": "SLURM_JOB_NUM_NODES", "pytorchjob": "PET_NNODES", "lws": "LWS_GROUP_SIZE"}),
    "node_rank": ("--node-rank", {"slurm": "SLURM_NODEID", "pytorchjob": "PET_NODE_RANK", "lws": "LWS_WORKER_INDEX"}),
}
_SOURCE_NAMES = {"slurm": "Slurm", "pytorchjob": "the PyTorchJob", "lws": "the LeaderWorkerSet"}


def resolve_job(args: JobArgs, env: Mapping[str, str]) -> JobSpec | None:
    """The job this head belongs to, or None for a tray of one host (no source names more than one node).

    Raises UsageError for a missing or malformed field (naming the flag or variable that would set it),
    a node rank outside 0..nnodes-1, conflicting sources, or a missing TRAY_JOB_TOKEN."""
    if args.standalone:
        return None  # one host (cli.py refuses --standalone beside --nnodes N > 1)
    cli = _from_cli(args)
    sched = _scheduler(args, env)
    if sched is None and cli.nnodes is None:
        # torchrun's one-node forms (--master-addr localhost, --rdzv-endpoint localhost:29400) name this host: one
        # tray, as torchrun's default --nnodes 1 makes it
        if cli.node_rank not in (None, 0) or (cli.host is not None and not is_this_host(cli.host)):
            said = f"--node-rank {cli.node_rank}" if cli.node_rank not in (None, 0) else \
                f"host {cli.host!r} (--rdzv-endpoint/--master-addr), not this machine,"
            raise UsageError(f"{said} without --nnodes: a job of several trays needs --nnodes N --node-rank I "
                             "--rdzv-endpoint HOST:PORT; one tray on this host needs none of them")
        _note_a_job_not_found(env)
        return None
    s = sched or _Found("none")
    used: set[str] = set()

    def pick(name: str) -> tuple[object, str]:
        mine, theirs = getattr(cli, name), getattr(s, name)
        if mine is not None and theirs is not None and mine != theirs and name in _SCHEDULER_DECIDES and \
                ((s.nnodes or 1) > 1 or args.slurm):
            # the same command line runs on every node of a scheduler's job of several: a node count or node rank
            # written there is a mistake (every node the same rank; a job split into trays that never meet), not an
            # override. A step of one node (`srun -N1`, where tools start nodes of their own on it) leaves the flags be
            flag, var = _SCHEDULER_DECIDES[name][0], _SCHEDULER_DECIDES[name][1].get(s.source, s.source)
            by = _SOURCE_NAMES.get(s.source, s.source)
            raise UsageError(f"{flag} {mine} contradicts {var}={theirs}, set by {by} for this node: the scheduler "
                             f"gives each node its {name.replace('_', ' ')}; drop "
                             f"{flag}{' (--standalone runs a tray of each node alone)' if name == 'nnodes' else ''}")
        value, source = (mine, "cli") if mine is not None else (theirs, s.source)
        if value is not None:
            used.add(source)
        return value, source

    nnodes, nnodes_source = pick("nnodes")
    if nnodes is None:  # a scheduler's variables name the job, but not its size
        unset = {"pytorchjob": "PET_NODE_RANK is set but PET_NNODES (the job's nodes) is not",
                 "lws": "LWS_LEADER_ADDRESS is set but LWS_GROUP_SIZE (the pods of its group) is not"}.get(s.source)
        raise UsageError(f"{unset or s.source + ': the number of nodes is unknown'}; give --nnodes N")
    assert isinstance(nnodes, int)
    if not 1 <= nnodes <= MAX_NNODES:
        raise UsageError(f"--nnodes must be 1 to {MAX_NNODES}, got {nnodes}")
    node_rank, rank_source = pick("node_rank")
    if nnodes == 1:
        if node_rank not in (None, 0):  # a job of one node has node 0 alone: a node rank past it was run as node 0
            raise UsageError(f"node rank {node_rank} is outside 0..0 (a job of 1 node); drop --node-rank, or give "
                             "the job's --nnodes")
        return None
    host, _ = pick("host")
    port, port_source = pick("port")
    if node_rank is None and s.source == "pytorchjob":
        raise UsageError("PET_NNODES is set but PET_NODE_RANK is not: the training operator sets it (and "
                         "PET_MASTER_ADDR) only in a PyTorchJob with a Master replica, node 0 "
                         "(launch/kubernetes/pytorchjob.yaml); give the job a Master, or give --node-rank I and "
                         "--rdzv-endpoint HOST:PORT")
    if node_rank is None and s.source == "lws":
        raise UsageError("LWS_WORKER_INDEX is unset (this pod's index in its LeaderWorkerSet group, 0 on the leader); "
                         "give --node-rank I")
    if node_rank is None:
        raise UsageError("this node's rank is unknown; give --node-rank I (0 on the root's node)")
    if host is None:
        unset = "PET_MASTER_ADDR (set by the training operator in a PyTorchJob with a Master replica) is unset: " \
            if s.source == "pytorchjob" else ""
        raise UsageError(f"{unset}the root's address is unknown; give --rdzv-endpoint HOST:PORT (node 0's host)")
    if port is None:
        port = DEFAULT_PORT
    assert isinstance(node_rank, int) and isinstance(host, str) and isinstance(port, int)
    if port == 0:  # torchrun's HOST:0 (any free port) serves one node; the heads of several must know the root's
        raise UsageError(f"--rdzv-endpoint {host}:0: every node's head must reach the root at a port known before "
                         "the job starts; give one, e.g. 29400")
    if not 0 <= node_rank < nnodes:
        named = {name: _SCHEDULER_DECIDES[name][1].get(source, _SCHEDULER_DECIDES[name][0])
                 for name, source in (("node_rank", rank_source), ("nnodes", nnodes_source))}
        raise UsageError(f"node rank {node_rank} ({named['node_rank']}) is outside 0..{nnodes - 1} (a job of {nnodes} "
                         f"nodes: {named['nnodes']})")
    token = env.get(TOKEN_VAR, "")
    if not token:
        raise UsageError(f"a job of {nnodes} nodes needs a shared secret in {TOKEN_VAR} (the same on every node; "
                         "e.g. export TRAY_JOB_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')); "
                         "it is never read from the command line")
    if len(token) < MIN_TOKEN_CHARS:
        raise UsageError(f"{TOKEN_VAR} has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
                         "(e.g. secrets.token_hex(32))")
    if len(set(token)) < MIN_TOKEN_DISTINCT:
        raise UsageError(f"{TOKEN_VAR} has {len(token)} characters but only {len(set(token))} different ones: a token "
                         "that is guessed at once (the job's keys are derived from it); make a random one, e.g. "
                         "export TRAY_JOB_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')")
    rdzv_id, _ = pick("rdzv_id")
    nproc, _ = pick("nproc_per_node")
    return JobSpec(nnodes=nnodes, node_rank=node_rank, root_host=host, root_port=port,
                   rdzv_id=str(rdzv_id or "default"), token=token, source="+".join(sorted(used)),
                   nproc_per_node=nproc if isinstance(nproc, int) else None,
                   node_heartbeat_timeout_s=args.node_heartbeat_timeout_s, port_source=port_source)


def master_port_of(job: JobSpec) -> int:
    """The job's MASTER_PORT: the root's port + 1 (the one below for a root on 65535)."""
    return job.root_port + 1 if job.root_port < 65535 else job.root_port - 1


def job_rank_env(job: JobSpec, local_rank: int, local_world_size: int) -> dict[str, str]:
    """The variables that place local rank `local_rank` of this node in the job: global rank =
    node_rank * local_world_size + local_rank, and torchrun's contract describing the job (through
    spawn.torchrun_env, as for one host).

    MASTER_PORT is the root's port + 1: the root itself listens on the root port, so a program's own
    store (torch's TCPStore under init_process_group, on node 0) takes the next one."""
    from tray.launch.spawn import torchrun_env

    rank = job.node_rank * local_world_size + local_rank
    world = job.nnodes * local_world_size
    env = {
        "TRAY_RANK": str(rank),
        "TRAY_WORLD_SIZE": str(world),
        "TRAY_LOCAL_RANK": str(local_rank),
        "TRAY_LOCAL_WORLD_SIZE": str(local_world_size),
        "TRAY_NODE_RANK": str(job.node_rank),
        "TRAY_NNODES": str(job.nnodes),
    }
    env.update(torchrun_env(rank, world, master_port_of(job), job.rdzv_id, local_rank=local_rank,
                            local_world_size=local_world_size, group_rank=job.node_rank,
                            group_world_size=job.nnodes, master_addr=job.root_host))
    return env

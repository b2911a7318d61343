"""Multi-node job config: Slurm host lists, CLI and scheduler environments, CURVE keyed from the token."""

from __future__ import annotations

import time

import pytest
import zmq
from conftest import MANIFESTS

from tray.errors import UsageError
from tray.launch.curve import ZapHandler, job_keys, make_client, make_server
from tray.launch.hostlist import MAX_HOSTS, expand_hostlist, first_host
from tray.launch.job import JobArgs, job_rank_env, pytorchjob_nprocs, resolve_job, slurm_port

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("text, hosts", [
    ("node1", ["node1"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("a,b[1-2]", ["a", "b1", "b2"]),
    ("n[001-003]-ib", ["n001-ib", "n002-ib", "n003-ib"]),
    ("x[1-2],y[9-10],z", ["x1", "x2", "y9", "y10", "z"]),
    ("r[1-2]n[0-1]", ["r1n0", "r1n1", "r2n0", "r2n1"]),
    ("c[8-11]", ["c8", "c9", "c10", "c11"]),
    (" node[1-2] ", ["node1", "node2"]),
])
def test_hostlist_expands_like_slurm(text, hosts):
    assert expand_hostlist(text) == hosts
    assert first_host(text) == hosts[0]


@pytest.mark.parametrize("text, why", [
    ("", "empty"),
    ("gpu[01-04", "never closed"),
    ("gpu01-04]", r"without '\['"),
    ("gpu[[1]]", "nested"),
    ("gpu[4-1]", "backwards"),
    ("gpu[a-b]", "not NUM"),
    ("a,,b", "empty name"),
    ("gpu[]", "empty brackets"),
    (f"n[0-{MAX_HOSTS}]", "more than"),
])
def test_hostlist_errors_name_the_fault(text, why):
    with pytest.raises(UsageError, match=why):
        expand_hostlist(text)


def test_cli_job_and_aliases():
    env = {"TRAY_JOB_TOKEN": TOKEN}
    job = resolve_job(JobArgs(nnodes=2, node_rank=1, rdzv_endpoint="hostA:29400", rdzv_id="j7"), env)
    assert job is not None and (job.nnodes, job.node_rank, job.endpoint, job.rdzv_id) == (2, 1, "hostA:29400", "j7")
    assert job.source == "cli" and not job.is_root and job.token == TOKEN
    same = resolve_job(JobArgs(nnodes=2, node_rank=1, master_addr="hostA", master_port=29400, rdzv_id="j7"), env)
    assert same == job
    assert resolve_job(JobArgs(), env) is None                       # one host: no job
    assert resolve_job(JobArgs(nnodes=1, node_rank=0, rdzv_endpoint="h:1"), env) is None


def test_an_rdzv_endpoint_without_a_port_takes_torchruns():
    """torchrun's `--rdzv-endpoint HOST` (c10d's port 29400): it was refused as not HOST:PORT."""
    env = {"TRAY_JOB_TOKEN": TOKEN}
    job = resolve_job(JobArgs(nnodes=2, node_rank=1, rdzv_endpoint="hostA"), env)
    assert job is not None and (job.root_host, job.root_port) == ("hostA", 29400)
    job = resolve_job(JobArgs(nnodes=2, node_rank=1, rdzv_endpoint="hostA", master_port=29600), env)
    assert job is not None and (job.root_host, job.root_port) == ("hostA", 29600)


@pytest.mark.parametrize("args, why", [
    (JobArgs(nnodes=2, node_rank=0, rdzv_endpoint="h:1", master_addr="g"), "--master-addr says 'g'"),
    (JobArgs(nnodes=2, node_rank=0, rdzv_endpoint="h:1", master_port=2), "--master-port says 2"),
    (JobArgs(nnodes=2, node_rank=2, rdzv_endpoint="h:1"), "outside 0..1"),
    (JobArgs(nnodes=2, rdzv_endpoint="h:1"), "--node-rank"),
    (JobArgs(nnodes=2, node_rank=0), "--rdzv-endpoint"),
    (JobArgs(nnodes=2, node_rank=0, rdzv_endpoint="h:"), "HOST:PORT"),
    (JobArgs(nnodes=2, node_rank=0, rdzv_endpoint=":29400"), "HOST:PORT"),
    (JobArgs(nnodes=2, node_rank=0, rdzv_endpoint="h:70000"), "1..65535"),
    # the endpoint said whole: "--rdzv-endpoint='abc': expected an integer" read as if the option's value were abc
    (JobArgs(nnodes=2, node_rank=0, rdzv_endpoint="h:abc"),
     r"^--rdzv-endpoint 'h:abc': its port 'abc' is no TCP port \(1..65535\); expected HOST:PORT, e.g. node001:29500$"),
    (JobArgs(nnodes=2, node_rank=0, rdzv_endpoint="h:70000"), r"^--rdzv-endpoint 'h:70000': its port '70000' is no "),
    (JobArgs(nnodes=2, node_rank=0, rdzv_endpoint="[::1]:29500"), "an IPv6 address; the heads reach the root"),
    (JobArgs(node_rank=0, rdzv_endpoint="h:1"), "without --nnodes"),
    (JobArgs(nnodes=0), "--nnodes must be 1 to 65536, got 0"),
    (JobArgs(nnodes=10 ** 30, node_rank=0, rdzv_endpoint="h:1"), "--nnodes must be 1 to 65536"),
    # a job of one node has node 0 alone: node rank 5 of 1 ran as node 0, without a word
    (JobArgs(nnodes=1, node_rank=5), r"^node rank 5 is outside 0..0 \(a job of 1 node\)"),
    (JobArgs(nnodes=1, node_rank=-3), "outside 0..0"),
])
def test_cli_errors(args, why):
    with pytest.raises(UsageError, match=why):
        resolve_job(args, {"TRAY_JOB_TOKEN": TOKEN})


def test_token_only_from_the_environment():
    args = JobArgs(nnodes=2, node_rank=0, rdzv_endpoint="h:1")
    with pytest.raises(UsageError, match="TRAY_JOB_TOKEN"):
        resolve_job(args, {})
    with pytest.raises(UsageError, match="at least 16"):
        resolve_job(args, {"TRAY_JOB_TOKEN": "short"})
    for weak in (" " * 16, "a" * 40, "ab" * 8, "1234512345123451"):   # long enough, guessed at once
        with pytest.raises(UsageError, match=r"characters but only [1-5] different ones: a token that is guessed"):
            resolve_job(args, {"TRAY_JOB_TOKEN": weak})
    assert resolve_job(args, {"TRAY_JOB_TOKEN": "123456123456123456"}).token == "123456123456123456"


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "2",
         "SLURM_JOB_NODELIST": "gpu[07-09,11]", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4",
         "SLURM_STEP_NUM_NODES": "4", "TRAY_JOB_TOKEN": TOKEN}


def test_slurm_automatic_inside_a_one_task_per_node_step():
    job = resolve_job(JobArgs(), SLURM)
    assert job is not None
    assert (job.nnodes, job.node_rank, job.root_host, job.root_port) == (4, 2, "gpu07", slurm_port("4242"))
    assert job.root_port == 20000 + 2 * 4242 and job.source == "slurm" and job.rdzv_id == "slurm-4242.0"
    # consecutive jobs on one node: each job's root and MASTER_PORT (root + 1) never meet the next job's
    ports = {p for j in range(4240, 4250) for p in (slurm_port(str(j)), slurm_port(str(j)) + 1)}
    assert len(ports) == 20
    # steps of one job running at once (each on its own GPUs of the nodes): each its own port; step 0 the job id's
    assert slurm_port("4242", "0") == slurm_port("4242") and slurm_port("4242", "batch") == slurm_port("4242")
    steps = {p for s in range(8) for p in (slurm_port("4242", str(s)), slurm_port("4242", str(s)) + 1)}
    assert len(steps) == 16 and not steps & (ports - {slurm_port("4242"), slurm_port("4242") + 1})
    step1 = resolve_job(JobArgs(), {**SLURM, "SLURM_STEP_ID": "1"})
    assert step1 is not None and step1.root_port == slurm_port("4242", "1") != job.root_port
    # several tasks per node in a step over several nodes (a job's --ntasks-per-node=4 inherited by a plain srun):
    # refused, asked for or not (it ran 8 unrelated trays, two per node, and exited 0); --standalone asks for them
    for args in (JobArgs(), JobArgs(slurm=True)):
        with pytest.raises(UsageError, match="runs 8 tasks on 4 nodes; tray needs one task per node.*--standalone"):
            resolve_job(args, {**SLURM, "SLURM_STEP_NUM_TASKS": "8"})
    assert resolve_job(JobArgs(standalone=True), {**SLURM, "SLURM_STEP_NUM_TASKS": "8"}) is None
    # a step on one node of several tasks: each task may be its own tray (its own GPUs, --gpus-per-task)
    one_node = {**SLURM, "SLURM_JOB_NUM_NODES": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "4"}
    assert resolve_job(JobArgs(), one_node) is None
    # the command line wins over the environment
    job = resolve_job(JobArgs(rdzv_endpoint="gpu07:31000"), SLURM)
    assert job is not None and job.root_port == 31000 and job.source == "cli+slurm"


def test_slurm_errors():
    with pytest.raises(UsageError, match="SLURM_JOB_ID, SLURM_JOB_NUM_NODES"):
        resolve_job(JobArgs(slurm=True), {"TRAY_JOB_TOKEN": TOKEN})
    with pytest.raises(UsageError, match="spans 2 of the job's 4 nodes"):
        resolve_job(JobArgs(slurm=True), {**SLURM, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2"})
    # `srun -N1 tray launch ...` in an allocation of several nodes (a one-node tray meant): the way to one is named
    one_of_two = {**SLURM, "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NUM_NODES": "1"}
    with pytest.raises(UsageError, match="spans 1 of the job's 2 nodes.*--standalone runs a tray of this node alone"):
        resolve_job(JobArgs(), one_of_two)
    assert resolve_job(JobArgs(standalone=True), one_of_two) is None
    with pytest.raises(UsageError, match="host list"):
        resolve_job(JobArgs(slurm=True), {**SLURM, "SLURM_JOB_NODELIST": "gpu[07"})


def test_pytorchjob_and_lws():
    pet = {"PET_NNODES": "3", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456",
           "PET_NPROC_PER_NODE": "4", "TRAY_JOB_TOKEN": TOKEN}
    job = resolve_job(JobArgs(), pet)
    assert job is not None and (job.nnodes, job.node_rank, job.endpoint, job.nproc_per_node) == \
        (3, 1, "job-master-0:23456", 4)
    assert job.source == "pytorchjob"
    with pytest.raises(UsageError, match="elastic range"):
        resolve_job(JobArgs(), {**pet, "PET_NNODES": "1:3"})
    # an elasticPolicy with minReplicas = maxReplicas: the operator writes "MIN:MAX", a fixed size (torchrun's too)
    job = resolve_job(JobArgs(), {**pet, "PET_NNODES": "3:3"})
    assert job is not None and job.nnodes == 3
    lws = {"LWS_LEADER_ADDRESS": "lws-0.lws", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0",
           "TRAY_JOB_TOKEN": TOKEN}
    job = resolve_job(JobArgs(), lws)
    assert job is not None and (job.nnodes, job.node_rank, job.endpoint, job.is_root) == (2, 0, "lws-0.lws:29500", True)
    with pytest.raises(UsageError, match=r"PyTorchJob \(PET_\*\) and LeaderWorkerSet"):
        resolve_job(JobArgs(), {**pet, **lws})
    with pytest.raises(UsageError, match="LWS_WORKER_INDEX"):
        resolve_job(JobArgs(), {**lws, "LWS_WORKER_INDEX": "x"})
    # a group of several without the leader's address ran one tray alone; one pod's group is one host
    with pytest.raises(UsageError, match="LWS_GROUP_SIZE=2 describes .* LWS_LEADER_ADDRESS .* is unset"):
        resolve_job(JobArgs(), {k: v for k, v in lws.items() if k != "LWS_LEADER_ADDRESS"})
    assert resolve_job(JobArgs(), {"LWS_GROUP_SIZE": "1", "LWS_WORKER_INDEX": "0"}) is None
    # a PyTorchJob of Workers alone: the operator sets PET_NNODES but no node rank (a Master replica brings it)
    with pytest.raises(UsageError, match="PET_NODE_RANK is not: .* only in a PyTorchJob with a Master replica"):
        resolve_job(JobArgs(), {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "auto", "TRAY_JOB_TOKEN": TOKEN})
    with pytest.raises(UsageError, match="LWS_WORKER_INDEX is unset"):
        resolve_job(JobArgs(), {k: v for k, v in lws.items() if k != "LWS_WORKER_INDEX"})
    # the size unknown: the variable that gives it named (was "lws: the number of nodes is unknown")
    with pytest.raises(UsageError, match=r"^LWS_LEADER_ADDRESS is set but LWS_GROUP_SIZE \(the pods of its group\) is "
                                         r"not; give --nnodes N$"):
        resolve_job(JobArgs(), {k: v for k, v in lws.items() if k != "LWS_GROUP_SIZE"})
    with pytest.raises(UsageError, match=r"^PET_NODE_RANK is set but PET_NNODES \(the job's nodes\) is not; give "
                                         r"--nnodes N$"):
        resolve_job(JobArgs(), {k: v for k, v in pet.items() if k != "PET_NNODES"})


def test_a_pytorchjobs_nproc_per_node_is_torchruns_default_for_n():
    """PET_NPROC_PER_NODE is torchrun's --nproc-per-node in a PyTorchJob of one pod too, and its words (the operator's
    default is auto) mean what -n's do."""
    pet = {"PET_NNODES": "1", "PET_NODE_RANK": "0"}
    assert pytorchjob_nprocs({**pet, "PET_NPROC_PER_NODE": "2"}) == 2
    for word in ("auto", "gpu", "cpu"):
        assert pytorchjob_nprocs({**pet, "PET_NPROC_PER_NODE": word}) == word
    assert pytorchjob_nprocs({"PET_NPROC_PER_NODE": "2"}) is None          # no PyTorchJob around it
    assert pytorchjob_nprocs(pet) is None
    with pytest.raises(UsageError, match="PET_NPROC_PER_NODE='eight': expected a number of ranks per node"):
        pytorchjob_nprocs({**pet, "PET_NPROC_PER_NODE": "eight"})
    with pytest.raises(UsageError, match="PET_NPROC_PER_NODE=0: expected an integer >= 1"):
        pytorchjob_nprocs({**pet, "PET_NPROC_PER_NODE": "0"})
    # said as "-n must be at most ...", though no -n was given
    with pytest.raises(UsageError, match=r"^PET_NPROC_PER_NODE=10{30}: at most 1048576 ranks per node"):
        pytorchjob_nprocs({**pet, "PET_NPROC_PER_NODE": str(10 ** 30)})


def test_rank_env_describes_the_job():
    job = resolve_job(JobArgs(nnodes=3, node_rank=2, rdzv_endpoint="h0:29400"), {"TRAY_JOB_TOKEN": TOKEN})
    assert job is not None
    env = job_rank_env(job, local_rank=1, local_world_size=4)
    assert env["RANK"] == env["TRAY_RANK"] == "9" and env["WORLD_SIZE"] == "12"
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "4" and env["GROUP_RANK"] == "2"
    assert env["MASTER_ADDR"] == "h0" and env["MASTER_PORT"] == "29401"
    assert env["GROUP_WORLD_SIZE"] == "3" and env["ROLE_RANK"] == "9" and env["ROLE_WORLD_SIZE"] == "12"
    assert TOKEN not in env.values()  # the job token never reaches a rank


def test_torchruns_per_worker_variables_of_the_head_never_reach_a_rank(monkeypatch, tmp_path):
    """torchrun gives each worker its own TORCHELASTIC_ERROR_FILE and says whether an agent hosts the store; a head
    started where an outer launcher set them must not hand them down: every rank's @record would write one file
    (the last writer, not the root cause, wins) and every rank would wait for a store nobody hosts."""
    from tray.launch.spawn import rank_env
    from tray.launch.spec import TraySpec

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    env = rank_env(TraySpec(nprocs=2, cmd=("true",)), 1, job_dir=tmp_path, endpoint="ipc://x", token="t",
                   manifest="", t_spawn=0.0)
    assert "TORCHELASTIC_ERROR_FILE" not in env and "TORCHELASTIC_USE_AGENT_STORE" not in env
    assert env["RANK"] == "1" and env["TORCHELASTIC_RUN_ID"]


def test_keys_are_deterministic_per_token():
    a, b, c = job_keys(TOKEN), job_keys(TOKEN), job_keys(TOKEN + "x")
    assert a == b and a.server_public != c.server_public and a.client_public != c.client_public
    assert zmq.curve_public(a.server_secret) == a.server_public and len(a.server_public) == 40


def _serve(token: str, client_token: str, *, timeout_s: float = 1.0) -> tuple[bytes | None, list[str]]:
    ctx = zmq.Context()
    keys, other = job_keys(token), job_keys(client_token)
    zap = ZapHandler(ctx, keys)
    server = make_server(ctx, keys)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = make_client(ctx, other)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"tcp://127.0.0.1:{port}")
    client.send(b"hello")
    got = None
    poller = zmq.Poller()
    poller.register(server, zmq.POLLIN)
    poller.register(zap.socket, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    try:
        while got is None and time.monotonic() < deadline:
            for sock, _ in poller.poll(20):
                if sock is zap.socket:
                    zap.handle()
                else:
                    got = server.recv_multipart()[-1]
        return got, zap.refused
    finally:
        for s in (client, server):
            s.close()
        zap.close()
        ctx.term()


def test_curve_right_key_delivers_wrong_key_cannot():
    got, refused = _serve(TOKEN, TOKEN)
    assert got == b"hello" and refused == []
    got, _ = _serve(TOKEN, "another-token-of-the-same-length")
    assert got is None


def test_curve_client_knowing_the_server_key_but_not_the_token_is_refused():
    ctx = zmq.Context()
    keys = job_keys(TOKEN)
    zap = ZapHandler(ctx, keys)
    server = make_server(ctx, keys)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    intruder = ctx.socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    intruder.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    intruder.setsockopt(zmq.CURVE_PUBLICKEY, public)
    intruder.setsockopt(zmq.CURVE_SECRETKEY, secret)
    intruder.setsockopt(zmq.LINGER, 0)
    intruder.connect(f"tcp://127.0.0.1:{port}")
    intruder.send(b"let me in")
    deadline = time.monotonic() + 1.0
    delivered = False
    try:
        while time.monotonic() < deadline and not zap.refused:
            if zap.socket.poll(20, zmq.POLLIN):
                zap.handle()
            delivered = delivered or bool(server.poll(0, zmq.POLLIN))
        assert zap.refused and zap.refused[0] == "127.0.0.1"
        assert not delivered and not server.poll(100, zmq.POLLIN)
    finally:
        for s in (intruder, server):
            s.close()
        zap.close()
        ctx.term()


def test_ops_that_cannot_span_nodes_are_named():
    from tray.manifest import parse_manifest
    from tray.rank.executor import spanning_problems

    doc = {"format": 1, "name": "span", "vars": {"words": 4},
           "groups": [{"name": "world", "ranks": "all"}, {"name": "pairs", "size": 2}],
           "buffers": [{"name": "fill", "dtype": "u32", "shape": ["world_size * words"], "export": True}],
           "kernels": [{"name": "k", "source": "kernels/peer_fill.cu", "entry": "tray_peer_fill", "peers": True}],
           "programs": [{"name": "g", "graph": True, "ops": [{"op": "barrier", "group": "pairs"},
                                                            {"op": "barrier", "group": "world"}]},
                        {"name": "fill", "ops": [{"op": "launch", "kernel": "k", "grid": [1, 1, 1],
                                                  "block": [32, 1, 1], "args": ["peers:fill", 4]}]},
                        {"name": "staged", "ops": [{"op": "launch", "kernel": "k", "grid": [1, 1, 1],
                                                    "block": [32, 1, 1], "args": ["peers:fill", 4],
                                                    "stage": {"fill": {"buffer": "fill", "block": "words * 4"}}}]}]}
    resolved = parse_manifest(doc, "<test>", str(MANIFESTS)).resolve(4)
    problems = spanning_problems(resolved, local_world_size=2)
    # a captured barrier over a spanning group is fine (hierarchical); a peers kernel on its table is not
    # (nor one that stages the table for the other nodes)
    assert [path for path, _ in problems] == ["$.programs[1].ops[0]"], problems
    assert "whose group 'world' spans nodes" in problems[0][1]
    assert spanning_problems(resolved, local_world_size=4) == []   # one node: nothing spans
    # bound one program at a time: the barrier program over the spanning group alone has nothing to refuse
    assert spanning_problems(resolved, 2, (resolved.program("g"),)) == []


def test_an_old_pytorchjob_environment_is_noted_not_silently_a_lone_tray(capsys):
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "MASTER_ADDR": "tray-job-master-0", "MASTER_PORT": "23456",
           "WORLD_SIZE": "2", "RANK": "1"}
    assert resolve_job(JobArgs(), env) is None
    assert "this pod runs one tray alone. A PyTorchJob needs training-operator 1.7" in capsys.readouterr().err
    assert resolve_job(JobArgs(), {"WORLD_SIZE": "2", "MASTER_ADDR": "h"}) is None  # not in a pod: nothing said
    assert capsys.readouterr().err == ""


def test_lws_names_the_job_by_its_leader():
    env = {"LWS_LEADER_ADDRESS": "tray-job-0.tray-job.default", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1",
           "TRAY_JOB_TOKEN": TOKEN}
    job = resolve_job(JobArgs(nproc_per_node=4), env)
    assert job is not None and job.rdzv_id == "tray-job-0.tray-job.default" and job.node_rank == 1


@pytest.mark.parametrize("args", [JobArgs(master_addr="localhost", master_port=29513),
                                  JobArgs(rdzv_endpoint="127.0.0.1:29400"),
                                  JobArgs(node_rank=0, master_addr="localhost")])
def test_torchruns_one_node_forms_name_this_host_and_make_one_tray(args):
    """torchrun --master-addr localhost / --rdzv-endpoint localhost:0 without --nnodes (torchrun's default is one
    node): one tray, not a usage error."""
    assert resolve_job(args, {}) is None


def test_a_root_elsewhere_without_nnodes_is_named():
    with pytest.raises(UsageError, match=r"host '10\.255\.255\.1' \(--rdzv-endpoint/--master-addr\), not this machine, "
                                         "without --nnodes"):
        resolve_job(JobArgs(master_addr="10.255.255.1"), {})
    with pytest.raises(UsageError, match="--node-rank 1 without --nnodes"):
        resolve_job(JobArgs(node_rank=1), {})


def test_torchruns_any_port_serves_one_node_but_not_a_job():
    assert resolve_job(JobArgs(rdzv_endpoint="localhost:0"), {}) is None
    assert resolve_job(JobArgs(nnodes=1, rdzv_endpoint="localhost:0"), {}) is None
    with pytest.raises(UsageError, match="--rdzv-endpoint h:0: every node's head must reach the root at a port"):
        resolve_job(JobArgs(nnodes=2, node_rank=0, rdzv_endpoint="h:0"), {"TRAY_JOB_TOKEN": TOKEN})


def test_a_multi_node_slurm_jobs_batch_script_running_one_tray_is_told(capsys):
    """`sbatch -N2 --wrap "tray launch ..."`: the batch script runs on the first node only; the tray runs there
    alone and said nothing (the second node sat idle, the job COMPLETED)."""
    batch = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP")}
    assert resolve_job(JobArgs(), batch) is None
    err = capsys.readouterr().err
    assert "this Slurm job has 4 nodes, but this tray runs on this one alone" in err and "srun --ntasks-per-node=1" \
        in err, err
    assert resolve_job(JobArgs(), {**batch, "SLURM_JOB_NUM_NODES": "1"}) is None
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("yaml_name", ["pytorchjob.yaml", "lws.yaml"])
def test_the_kubernetes_secret_recipe_makes_the_secret_the_yaml_reads(yaml_name):
    """The YAML's comment says how to make the job's Secret: its command (kubectl as a client, --dry-run) gives a
    Secret of the name and key the YAML's secretKeyRef reads, holding 64 hex characters, with the token on no
    command line (it was `--from-literal=token=$(...)`: kubectl's argv, readable by every user of the machine)."""
    import base64
    import json
    import re
    import shutil
    import subprocess

    text = (MANIFESTS.parent / "launch" / "kubernetes" / yaml_name).read_text()
    recipe = " ".join(line[1:].strip().rstrip("\\").split("  # ")[0] for line in text.splitlines()
                      if line.startswith("#") and ("secrets.token_hex" in line or "kubectl create secret" in line))
    assert "--from-literal" not in recipe and "$(" not in recipe, recipe
    ref = re.search(r"secretKeyRef: \{name: ([\w-]+), key: (\w+)\}", text)
    assert ref and f"generic {ref.group(1)} --from-file={ref.group(2)}=/dev/stdin" in recipe, recipe
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (the client) is not installed: the recipe's command was not run")
    out = subprocess.run(["bash", "-c", recipe + " --dry-run=client -o json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    secret = json.loads(out.stdout)
    assert secret["metadata"]["name"] == ref.group(1)
    assert re.fullmatch(r"[0-9a-f]{64}", base64.b64decode(secret["data"][ref.group(2)]).decode())


def test_a_master_port_taken_on_node_0_is_named_with_where_it_lies_beside_the_roots(capsys):
    """MASTER_PORT is the root's port + 1, or - 1 for a root on 65535: the line for one taken said "+ 1" for both."""
    import socket
    from types import SimpleNamespace

    from tray.launch.node import NodeHead

    for port, root_port, said in ((None, None, "+ 1"), (65534, 65535, "- 1, the root's being the last one")):
        with socket.socket() as taken:
            try:
                taken.bind(("127.0.0.1", port or 0))
            except OSError:
                pytest.skip(f"port {port} is in use here")
            taken.listen()
            port = taken.getsockname()[1]
            head = SimpleNamespace(job=SimpleNamespace(is_root=True, root_port=root_port or port - 1),
                                   _root_address=f"tcp://127.0.0.1:{root_port or port - 1}")
            assert NodeHead._reserve_master_port(head, -1) is None  # type: ignore[arg-type]
        err = capsys.readouterr().err
        assert f"MASTER_PORT {port} (the root's port {said}) is taken on 127.0.0.1" in err, err


def test_a_root_host_that_is_no_address_here_is_not_said_to_have_its_master_port_taken(capsys):
    """Node 0 given a root host that is not this machine's: the MASTER_PORT hold said the port "is taken on 10.1.2.3
    (Cannot assign requested address)" before the root's own bind named the real cause; it now leaves that to it."""
    from types import SimpleNamespace

    from tray.launch.node import NodeHead

    head = SimpleNamespace(job=SimpleNamespace(is_root=True, root_port=29500),
                           _root_address="tcp://192.0.2.1:29500")  # TEST-NET-1: never an address of this machine
    assert NodeHead._reserve_master_port(head, -1) is None  # type: ignore[arg-type]
    assert "MASTER_PORT" not in capsys.readouterr().err


def test_a_flag_that_contradicts_the_schedulers_node_count_or_rank_is_refused_naming_the_variable():
    """`sbatch -N 2 tray.sbatch --nnodes 1 ...` ran two trays of one node that never met, each exiting 0; `--nnodes 3`
    on 2 nodes waited 30 s and blamed the network; `--node-rank 0` gave every node rank 0. The scheduler gives each
    node its count and rank: a flag may repeat them, not contradict them. The root's address may still be given."""
    env = {**SLURM, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "4",
           "TRAY_JOB_TOKEN": TOKEN}
    for args, said in ((JobArgs(slurm=True, nnodes=1), r"--nnodes 1 contradicts SLURM_JOB_NUM_NODES=4, set by Slurm"),
                       (JobArgs(nnodes=3), r"--nnodes 3 contradicts SLURM_JOB_NUM_NODES=4"),
                       (JobArgs(node_rank=0), r"--node-rank 0 contradicts SLURM_NODEID=2")):
        with pytest.raises(UsageError, match=said):
            resolve_job(args, env)
    job = resolve_job(JobArgs(nnodes=4, node_rank=2, rdzv_endpoint="elsewhere:4000"), env)
    assert job is not None and (job.nnodes, job.node_rank, job.root_host, job.root_port) == (4, 2, "elsewhere", 4000)
    # a step of one node (`srun -N1`: a bench or test starting nodes of its own on it) leaves the flags be, unless
    # --slurm says the job is Slurm's
    one = {**env, "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "1",
           "SLURM_STEP_NUM_NODES": "1"}
    job = resolve_job(JobArgs(nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:4000"), one)
    assert job is not None and (job.nnodes, job.node_rank) == (2, 1)
    with pytest.raises(UsageError, match=r"--nnodes 2 contradicts SLURM_JOB_NUM_NODES=1"):
        resolve_job(JobArgs(slurm=True, nnodes=2, node_rank=1), one)
    pet = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m", "TRAY_JOB_TOKEN": TOKEN}
    with pytest.raises(UsageError, match=r"--node-rank 0 contradicts PET_NODE_RANK=1, set by the PyTorchJob"):
        resolve_job(JobArgs(node_rank=0), pet)
    with pytest.raises(UsageError, match=r"node rank 3 \(LWS_WORKER_INDEX\) is outside 0..1 \(a job of 2 nodes: "
                                         r"LWS_GROUP_SIZE\)"):
        resolve_job(JobArgs(), {"LWS_LEADER_ADDRESS": "l", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "3",
                                "TRAY_JOB_TOKEN": TOKEN})
    with pytest.raises(UsageError, match=r"^PET_MASTER_ADDR \(set by the training operator .*\) is unset"):
        resolve_job(JobArgs(), {"PET_NNODES": "2", "PET_NODE_RANK": "1", "TRAY_JOB_TOKEN": TOKEN})


def test_a_node_is_named_by_slurms_node_name_under_slurm():
    """A lost node was named by its machine's host name ("vm" for both nodes of a cluster on one machine), not by the
    name Slurm shows (node2): under Slurm the node name comes first, the host's beside it when they differ."""
    import socket

    from tray.launch.node import node_name

    host = socket.gethostname()
    assert node_name("slurm", {"SLURMD_NODENAME": "node2"}) == (f"node2 on {host}" if host != "node2" else "node2")
    assert node_name("cli+slurm", {"SLURMD_NODENAME": host}) == host
    assert node_name("cli", {"SLURMD_NODENAME": "node2"}) == host   # no Slurm job: the variable is not this job's
    assert node_name("slurm", {}) == host

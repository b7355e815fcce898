"""`shardformer run` end to end: real torchrun jobs of 2 CPU processes (gloo) in subprocesses.

Each launch costs a few seconds (every process imports torch), so each test is one launch. `make test` runs the
plain launch; the failure paths and the two-node launch are marked `launch` and run with the examples
(`make examples`, which CI runs after `make test`), keeping `make test` within its ten minutes.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "all_reduce_job.py")
EXIT_JOB = os.path.join(HERE, "exit_job.py")  # every rank fails: rank 0 raises, rank 1 exits with status 3
CONFIG = os.path.join(HERE, "tiny_config.py")  # tensor_parallel_size = 2, BATCH_SIZE = 4
LIMIT_S = 120  # a hang fails the test instead of the suite
# A lost peer must end a collective long before the test's limit.
ENV = {**os.environ, "SHARDFORMER_TIMEOUT_S": "60", "PYTHONWARNINGS": "ignore"}


def launcher(*argv: str) -> list[str]:
    return [sys.executable, "-m", "shardformer.cli.main", "run", *argv]


def rank_lines(output: str) -> dict[int, str]:
    return {
        int(m.group(1)): m.group(0) for m in re.finditer(r"rank (\d+)/2 mode=\S+ tp=\d+ sum=\S+ batch_size=\d+", output)
    }


@pytest.mark.launch  # make test launches through `shardformer run` in the fine-tuning example
def test_two_processes_all_reduce():
    argv = launcher("--nproc_per_node", "2", JOB, "--config", CONFIG, "--mode", "train")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=LIMIT_S, env=ENV)
    assert result.returncode == 0, result.stderr
    lines = rank_lines(result.stdout)
    assert sorted(lines) == [0, 1], result.stdout
    for line in lines.values():
        # Config values reached the script (BATCH_SIZE, --mode), the mesh is tp=2, 1 + 2 = 3.
        assert "mode=train tp=2 sum=3 batch_size=4" in line


@pytest.mark.launch
def test_a_crashed_rank_ends_the_job_and_is_named():
    argv = launcher("--nproc_per_node", "2", JOB, "--config", CONFIG, "--mode", "train", "--set", "crash_rank=1")
    # rank 0 is left waiting in all_reduce; with a collective timeout far past LIMIT_S, only torchrun stopping it
    # ends the job before the test's limit (no wall-clock assertion: a loaded machine only slows it down)
    env = {**ENV, "SHARDFORMER_TIMEOUT_S": "3600"}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=LIMIT_S, env=env)
    assert result.returncode == 1, result.stderr
    summary = [line for line in result.stderr.splitlines() if line.startswith("shardformer run:")]
    assert summary[0] == "shardformer run: rank 1 of 2 failed (exit code 1): RuntimeError: deliberate failure on rank 1"
    assert len(summary) <= 4, result.stderr  # a summary, not torchrun's dump
    assert "ChildFailedError" not in result.stderr
    assert rank_lines(result.stdout) == {}


def _summary(*argv: str) -> tuple[int, list[str]]:
    result = subprocess.run(
        launcher("--nproc_per_node", "2", *argv), capture_output=True, text=True, timeout=LIMIT_S, env=ENV
    )
    return result.returncode, [line for line in result.stderr.splitlines() if line.startswith("shardformer run:")]


@pytest.mark.launch
def test_a_failed_run_exits_with_the_first_failed_ranks_own_status():
    """Every rank fails, rank 0 first (it raises); torchrun stops rank 0 during its (slow) teardown, after
    rank 1's failure (sys.exit(3)) reached it: rank 0 is named with its own status, 1, not torchrun's
    SIGTERM (143); rank 1's own status, 3, is recorded too."""
    result = subprocess.run(
        launcher("--nproc_per_node", "2", EXIT_JOB), capture_output=True, text=True, timeout=LIMIT_S, env=ENV
    )
    summary = [line for line in result.stderr.splitlines() if line.startswith("shardformer run:")]
    assert result.returncode == 1, result.stderr
    assert summary[0] == "shardformer run: rank 0 of 2 failed (exit code 1): RuntimeError: deliberate failure on rank 0"
    assert summary[1] == "shardformer run: rank 1 also failed (exit code 3): SystemExit: 3", summary


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_node(node_rank: int, port: int) -> subprocess.Popen:
    layout = ["--nnodes", "2", "--node_rank", str(node_rank), "--nproc_per_node", "1"]
    rendezvous = ["--master_addr", "127.0.0.1", "--master_port", str(port), "--rdzv_timeout", "60"]
    argv = launcher(*layout, *rendezvous, JOB, "--config", CONFIG, "--mode", "inference")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


@pytest.mark.launch
def test_two_nodes_on_localhost():
    port = free_port()
    nodes = [start_node(1, port), start_node(0, port)]  # node 1 first: it waits for node 0's store
    try:
        outputs = [node.communicate(timeout=LIMIT_S) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err
    # Global rank = node_rank * nproc_per_node + local rank: node 1 runs rank 1, node 0 rank 0.
    (out_1, _), (out_0, _) = outputs
    assert list(rank_lines(out_0)) == [0] and list(rank_lines(out_1)) == [1]
    assert "mode=inference tp=2 sum=3" in out_0 + out_1

"""`shardformer run` refuses a launch that cannot work, before starting any process.

These call the CLI in-process (each check is pure Python); one test runs the real command in a
subprocess to check the exit status end to end.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from shardformer.cli.main import main

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "all_reduce_job.py")
CONFIG = os.path.join(HERE, "tiny_config.py")  # tensor_parallel_size = 2


def run_cli(capsys, *argv):
    code = main(["run", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_missing_script(capsys):
    code, _, err = run_cli(capsys, "--nproc_per_node", "2", "no_such_script.py", "--mode", "train")
    assert code == 2
    assert "shardformer run: error: script 'no_such_script.py' not found" in err


def test_missing_config(capsys):
    code, _, err = run_cli(capsys, "--nproc_per_node", "2", JOB, "--config", "no_such_config.py", "--mode", "train")
    assert code == 2
    assert "config file 'no_such_config.py' (from --config) not found" in err


def test_port_in_use(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_cli(capsys, "--nproc_per_node", "2", "--master_port", str(port), JOB, "--config", CONFIG)
    assert code == 2
    assert f"port {port} is already in use" in err and "--master_port" in err


@pytest.mark.parametrize(
    "launch, script_args, expected",
    [
        (
            ["--nproc_per_node", "3"],
            [],
            "tensor_parallel_size=2 x pipeline_parallel_size=1 = 2, but --nproc_per_node 3 starts 3 processes, "
            "not a multiple of 2; use --nproc_per_node 2",
        ),
        (
            ["--nproc_per_node", "2"],
            ["--set", "data_parallel_size=2"],
            "x data_parallel_size=2 = 4 processes, but --nproc_per_node 2 starts 2 processes; use --nproc_per_node 4",
        ),
        (
            ["--nnodes", "2", "--nproc_per_node", "1"],
            ["--set", "pipeline_parallel_size=4"],
            "= 8, but --nnodes 2 x --nproc_per_node 1 start 2 processes, not a multiple of 8; use --nproc_per_node 4",
        ),
        (
            ["--nproc_per_node", "2"],
            ["--set", "tp=4"],
            "tiny_config.py with --set tp=4 sets tensor_parallel_size=4 x pipeline_parallel_size=1 = 4, but",
        ),
    ],
)
def test_nproc_must_fit_the_config_sizes(capsys, launch, script_args, expected):
    code, _, err = run_cli(capsys, *launch, JOB, "--config", CONFIG, "--mode", "train", *script_args)
    assert code == 2
    source = "tiny_config.py with --set " if script_args else "tiny_config.py sets"  # what gave the sizes
    assert expected in err and source in err


def test_bad_config_value_is_caught_before_start(capsys, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("tensor_parallel_size = '2'\nmy_own_key = 1  # the script's business, not the launcher's\n")
    code, _, err = run_cli(capsys, "--nproc_per_node", "2", JOB, "--config", str(bad), "--mode", "train")
    assert code == 2
    assert "tensor_parallel_size='2' has type str, expected int" in err


def test_config_that_exits_is_reported(capsys, tmp_path):
    bad = tmp_path / "exits.py"
    bad.write_text("import sys\ntensor_parallel_size = 2\nsys.exit(3)\n")
    code, _, err = run_cli(capsys, "--nproc_per_node", "2", JOB, "--config", str(bad), "--mode", "train")
    assert code == 2
    assert f"{bad}: the config file called sys.exit(3)" in err


def test_bad_process_counts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--nproc_per_node", "0", JOB])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--nproc_per_node" in err and "0 must be at least 1" in err
    code, _, err = run_cli(capsys, "--nnodes", "2", "--node_rank", "2", JOB)
    assert code == 2 and "--node_rank 2 must be in 0..1" in err


def test_dry_run_builds_torchrun_arguments(capsys):
    code, out, _ = run_cli(capsys, "--nproc_per_node", "2", "--dry-run", JOB, "--config", CONFIG, "--mode", "train")
    assert code == 0
    assert out.startswith("torchrun ") and "--standalone" in out and "--nproc-per-node 2" in out
    assert out.rstrip().endswith(f"--module shardformer.cli.rank_entry {JOB} --config {CONFIG} --mode train")

    argv = ["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port", "29999", "--dry-run"]
    code, out, _ = run_cli(capsys, *argv, JOB, "--nproc_per_node", "5")  # script args pass through untouched
    assert code == 0
    assert "--rdzv-backend static --master-addr 10.0.0.1 --master-port 29999 --node-rank 1" in out
    assert out.rstrip().endswith(f"{JOB} --nproc_per_node 5")


def test_help_and_real_command_exit_status():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-m", "shardformer", "run", "--nproc_per_node", "2", "missing.py"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2 and "script 'missing.py' not found" in result.stderr

    from shardformer.cli.main import build_parser

    run_help = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    for text in ("--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port", "examples:"):
        assert text in run_help


def _failure(exitcode, message="", time_ns=0):
    from types import SimpleNamespace

    data = {"message": {"message": message, "extraInfo": {"time_ns": str(time_ns)}}} if message else {}
    return SimpleNamespace(exitcode=exitcode, message=message, error_file_data=data, timestamp=time_ns // 10**9)


def test_a_timeout_names_the_stuck_rank_not_the_waiting_one():
    """Rank 0 timed out in a collective while ranks 1 and 3 were still running (torchrun stopped them):
    the summary names those, as torchrun's own first failure (the waiting rank) does not."""
    import signal
    from types import SimpleNamespace

    from shardformer.cli.run import summarize_failure

    timeout = "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"
    failures = {0: _failure(1, timeout, 5), 1: _failure(-signal.SIGTERM), 2: _failure(1, timeout, 9)}
    summary, code = summarize_failure(SimpleNamespace(failures=failures), 3)
    assert summary.splitlines()[0] == (
        f"shardformer run: rank 1 of 3 stopped making progress: rank 0 timed out waiting for it in a collective "
        f"({timeout})"
    ), summary
    assert code == 1
    failures[3] = _failure(-signal.SIGTERM)
    summary, _ = summarize_failure(SimpleNamespace(failures=failures), 4)
    assert summary.startswith("shardformer run: one of ranks 1, 3 of 4 stopped making progress"), summary
    # a rank stopped while exiting after its own exception failed when it recorded it, not last, and
    # with its own status (recorded, else 1), not torchrun's SIGTERM
    crashed = {0: _failure(1, "RuntimeError: Connection closed by peer", 9), 1: _failure(-signal.SIGTERM, "E: mine", 3)}
    summary, code = summarize_failure(SimpleNamespace(failures=crashed), 2)
    assert summary.startswith("shardformer run: rank 1 of 2 failed (exit code 1): E: mine"), summary
    assert code == 1
    crashed[1].error_file_data["message"]["extraInfo"]["exit_code"] = "3"
    assert summarize_failure(SimpleNamespace(failures=crashed), 2)[1] == 3
    # any other first failure is named as it is
    failures[0] = _failure(1, "ValueError: bad value", 5)
    summary, _ = summarize_failure(SimpleNamespace(failures=failures), 4)
    assert summary.startswith("shardformer run: rank 0 of 4 failed (exit code 1): ValueError: bad value"), summary


def test_ranks_that_finished_their_script_and_died_in_teardown_make_a_run_that_succeeded():
    """A rank aborted by a library's threads in the interpreter's teardown ("terminate called without an
    active exception", SIGABRT) after its script returned, its peer stopped by torchrun while exiting:
    the run's work is done, exit status 0, said in one line. A rank stopped before it finished: a failure."""
    import signal
    from types import SimpleNamespace

    from shardformer.cli.run import all_finished, finished_note

    def finished(exitcode):
        data = {"message": {"message": "", "extraInfo": {"finished_ns": "5"}}}
        return SimpleNamespace(exitcode=exitcode, message="", error_file_data=data, timestamp=0)

    done = SimpleNamespace(failures={0: finished(-signal.SIGTERM), 1: finished(-signal.SIGABRT)})
    assert all_finished(done)
    assert finished_note(done, 2) == (
        "shardformer run: every rank of 2 finished its script; rank 0 (killed by SIGTERM), rank 1 (killed by "
        "SIGABRT) then died in the interpreter's teardown, after its work was done: exit status 0"
    )
    assert not all_finished(SimpleNamespace(failures={0: _failure(-signal.SIGTERM), 1: finished(-signal.SIGABRT)}))
    assert not all_finished(SimpleNamespace(failures={1: finished(3)}))  # a status of its own: a failure

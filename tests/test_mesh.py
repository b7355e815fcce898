"""ProcessMesh at world sizes 1, 2 and 4, over every (pp, dp, tp) factorisation."""

import pytest
import torch
import torch.distributed as dist

from shardformer.core.mesh import ProcessMesh, resolve_sizes
from shardformer.tools.testing import run_on_ranks


def factorisations(n):
    return [(pp, dp, n // (pp * dp)) for pp in range(1, n + 1) for dp in range(1, n + 1) if n % (pp * dp) == 0]


def _group_ranks(group):
    """Global ranks in ``group``, found by a collective over it."""
    size = dist.get_world_size(group)
    out = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
    dist.all_gather(out, torch.tensor([dist.get_rank()]), group=group)
    return [int(t) for t in out]


def _check_all_meshes():
    world = dist.get_world_size()
    seen = {}
    for pp, dp, tp in factorisations(world):
        mesh = ProcessMesh(tp_size=tp, pp_size=pp, dp_size=None)
        assert (mesh.pp_size, mesh.dp_size, mesh.tp_size) == (pp, dp, tp)
        p, d, t = mesh.coords
        assert mesh.global_rank(p, d, t) == dist.get_rank()
        seen[(pp, dp, tp)] = {
            "coords": mesh.coords,
            "tp": _group_ranks(mesh.tp_group),
            "dp": _group_ranks(mesh.dp_group),
            "pp": _group_ranks(mesh.pp_group),
            "emb": None if mesh.embedding_group is None else _group_ranks(mesh.embedding_group),
            "first_last": (mesh.is_first_stage, mesh.is_last_stage),
        }
    # A size that does not fit is refused before any group is created (no collective to hang on).
    try:
        ProcessMesh(tp_size=world + 1)
    except ValueError as e:
        seen["error"] = str(e)
    return seen


@pytest.mark.parametrize("world", [2, 4])  # one process has one layout only
def test_every_factorisation(world):
    results = run_on_ranks(_check_all_meshes, world)
    for rank, seen in enumerate(results):
        assert "world size" in seen.pop("error")
        assert len(seen) == len(factorisations(world))
        for (pp, dp, tp), got in seen.items():
            p, rest = divmod(rank, dp * tp)
            d, t = divmod(rest, tp)
            assert got["coords"] == (p, d, t)
            # tp innermost: tensor-parallel peers are neighbours.
            assert got["tp"] == [(p * dp + d) * tp + i for i in range(tp)]
            assert got["dp"] == [(p * dp + i) * tp + t for i in range(dp)]
            assert got["pp"] == [(i * dp + d) * tp + t for i in range(pp)]
            ends = sorted({d * tp + t, ((pp - 1) * dp + d) * tp + t})
            assert got["emb"] == (ends if p in (0, pp - 1) else None)
            assert got["first_last"] == (p == 0, p == pp - 1)


def test_dp_is_inferred():
    assert resolve_sizes(8, tp=2, pp=2) == (2, 2, 2)
    assert resolve_sizes(4, tp=4) == (1, 1, 4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 4, "tp": 3}, r"world size 4 is not divisible by tensor_parallel_size=3"),
        ({"world_size": 4, "tp": 2, "pp": 1, "dp": 3}, r"= 6, but the world size is 4"),
        ({"world_size": 4, "tp": 0}, r"tensor_parallel_size=0 must be a positive integer"),
        ({"world_size": 4, "pp": -1}, r"pipeline_parallel_size=-1 must be a positive integer"),
        ({"world_size": 4, "dp": 0}, r"data_parallel_size=0 must be a positive integer"),
    ],
)
def test_bad_sizes_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_sizes(**kwargs)


def test_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_distributed"):
        ProcessMesh(tp_size=1)


def test_init_distributed_tears_its_process_group_down_at_exit(tmp_path):
    """A script that never calls destroy_process_group: the group is destroyed by the library's exit
    handler, before the interpreter's teardown (where its threads could end the process with SIGABRT)."""
    import os
    import socket
    import subprocess
    import sys

    plain = (
        "import atexit\nimport torch.distributed as dist\nfrom shardformer import init_distributed\n"
        "atexit.register(lambda: print('initialised at exit:', dist.is_initialized()))  # runs after ours\n"
        "init_distributed()\nprint('initialised:', dist.is_initialized())\n"
    )
    scripts = {
        "plain": plain,
        # after an uncaught exception it leaves the group alone: peers may wait on this rank, which must end now
        "raises": plain + "raise RuntimeError('deliberate')\n",
        # a group someone else started (accelerate's TrainingArguments does): torn down once a mesh uses it
        "foreign": plain.replace(
            "init_distributed()", "dist.init_process_group('gloo'); shardformer.ProcessMesh()"
        ).replace("import atexit", "import atexit\nimport shardformer"),
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's shardformer
    running = {}
    for name, text in scripts.items():  # the three at once: each is mostly its imports
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        (tmp_path / f"{name}.py").write_text(text)
        running[name] = subprocess.Popen(
            [sys.executable, str(tmp_path / f"{name}.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
    results = {name: (process, *process.communicate(timeout=120)) for name, process in running.items()}
    for name, at_exit, code in (("plain", False, 0), ("raises", True, 1), ("foreign", False, 0)):
        process, out, err = results[name]
        assert process.returncode == code, (name, err)
        assert out.split("\n")[:2] == ["initialised: True", f"initialised at exit: {at_exit}"], (name, out)
    assert "deliberate" in results["raises"][2]

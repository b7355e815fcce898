"""Checks ``shardformer run`` makes before starting any process, each failing with one clear message.

A bad launch found here costs a second; found by the ranks it costs a start-up, or a hang.
"""

from __future__ import annotations

import errno
import math
import os
import socket
from collections.abc import Sequence

from shardformer.cli.config_file import Config, ConfigError, load_config
from shardformer.cli.example_args import find_config_args
from shardformer.core.config import SIZE_NAMES


class LaunchError(Exception):
    """The launch cannot work; the message says why and what to change."""


def check_script(script: str) -> None:
    if not os.path.exists(script):
        raise LaunchError(f"script {script!r} not found (working directory: {os.getcwd()})")
    if not os.path.isfile(script):
        raise LaunchError(f"script {script!r} is not a file")


def check_layout(nproc_per_node: int, nnodes: int, node_rank: int) -> None:
    if nproc_per_node < 1:
        raise LaunchError(f"--nproc_per_node {nproc_per_node}: need at least 1 process per node")
    if nnodes < 1:
        raise LaunchError(f"--nnodes {nnodes}: need at least 1 node")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node_rank {node_rank} must be in 0..{nnodes - 1} for --nnodes {nnodes}")


def port_in_use(port: int) -> bool:
    """True if something on this machine holds ``port`` (any interface), so a rendezvous store cannot bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR: a port left in TIME_WAIT by a finished job is free to use, not "in use".
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def check_port(port: int, nnodes: int) -> None:
    """Node 0 hosts the rendezvous store on ``port``: fail now if that port is taken."""
    if not 0 < port < 65536:
        raise LaunchError(f"--master_port {port} is not a valid port (1..65535)")
    if port_in_use(port):
        hint = " or leave --master_port out to let a free one be picked" if nnodes == 1 else ""
        raise LaunchError(
            f"port {port} is already in use on this machine (another job still running?); "
            f"pick another --master_port{hint}"
        )


def load_script_config(script_args: Sequence[str]) -> Config | None:
    """Load the ``--config PATH`` found in the script's arguments (with its ``--set`` overrides), if any.

    Keys the launcher does not know are left for the script to check against its own schema.
    """
    try:
        path, overrides = find_config_args(script_args)
        if path is None:
            return None
        if not os.path.isfile(path):
            raise LaunchError(f"config file {path!r} (from --config) not found (working directory: {os.getcwd()})")
        return load_config(path, overrides=overrides, allow_unknown=True)
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None


def sizes_from_set(script_args: Sequence[str]) -> dict[str, str]:
    """The parallel sizes the script's ``--set`` overrides give: ``{long name: the KEY=VALUE as typed}``."""
    _, overrides = find_config_args(script_args)
    out = {}
    for key, value in overrides.items():
        long = SIZE_NAMES.get(key.lower(), key.lower())
        if long in SIZE_NAMES.values():
            out[long] = f"{key}={value}"
    return out


def _launched(nnodes: int, nproc_per_node: int) -> str:
    if nnodes == 1:
        return f"--nproc_per_node {nproc_per_node} starts {nproc_per_node} processes"
    return f"--nnodes {nnodes} x --nproc_per_node {nproc_per_node} start {nnodes * nproc_per_node} processes"


def check_sizes(config: Config, nnodes: int, nproc_per_node: int, from_set: dict[str, str] | None = None) -> None:
    """The config's parallel sizes must fit the number of processes: world = tp * cp * pp * dp.
    ``from_set``: sizes given by ``--set`` (`sizes_from_set`), named as the source of their values."""
    tp = config.get("tensor_parallel_size") or 1
    pp = config.get("pipeline_parallel_size") or 1
    cp = config.get("context_parallel_size") or 1
    dp = config.get("data_parallel_size")
    world = nnodes * nproc_per_node
    where = config.source or "the config"
    if from_set:
        where = f"{where} with --set {' --set '.join(from_set.values())}"
    sizes = f"tensor_parallel_size={tp} x " + (f"context_parallel_size={cp} x " if cp > 1 else "")
    sizes += f"pipeline_parallel_size={pp}"
    if dp is not None:
        need = tp * cp * pp * dp
        if world == need:
            return
        if need % nnodes == 0:
            fix = f"use --nproc_per_node {need // nnodes}"
        else:
            fix = f"no --nproc_per_node gives {need} processes on {nnodes} nodes; change the sizes or --nnodes"
        raise LaunchError(
            f"{where} sets {sizes} x data_parallel_size={dp} = {need} processes, "
            f"but {_launched(nnodes, nproc_per_node)}; {fix}"
        )
    block = tp * cp * pp
    if world % block == 0:
        return
    # The smallest per-node count whose total is a multiple of tp * pp.
    fits = block // math.gcd(block, nnodes)
    raise LaunchError(
        f"{where} sets {sizes} = {block}, but {_launched(nnodes, nproc_per_node)}, not a multiple "
        f"of {block}; use --nproc_per_node {fits} (or a multiple of it) or change the sizes"
    )

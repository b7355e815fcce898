"""`make install-check` (not part of `make test`): the built wheel, installed into a fresh venv with the
constraints file, runs the README's quickstarts.

    python tests/install_check.py dist/shardformer-0.1.0-py3-none-any.whl [--venv DIR]

The venv is new (no system site-packages) and gets the wheel with its `hf` extra through
`pip install -c constraints.txt`, as the README tells a user to; each python block of README.md that
runs in the snippet tests is then launched with that venv's `shardformer run --nproc_per_node 2`, in a
folder outside the clone and without PYTHONPATH, so what runs is the installed package and nothing
from the source tree. Exits non-zero naming the first step that failed. A few minutes: most of it is
pip installing torch and the rest into the venv.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_snippets import RUN  # noqa: E402 - the snippets the tests run, read the same way


def step(what: str, command: list[str], **kwargs) -> subprocess.CompletedProcess:
    start = time.time()
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    print(f"{what}: exit {result.returncode} in {time.time() - start:.0f} s", flush=True)
    if result.returncode != 0:
        sys.exit(
            f"install-check failed at: {what}\n$ {' '.join(command)}\n{result.stdout[-4000:]}{result.stderr[-4000:]}"
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-install-check")
    args = parser.parse_args()
    wheel, venv = args.wheel.resolve(), args.venv.resolve()
    shutil.rmtree(venv, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    step("fresh venv", [sys.executable, "-m", "venv", str(venv)], env=env)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt")]
    step("pip upgraded", [*pip, "--upgrade", "pip"], env=env)
    step(f"{wheel.name}[hf] installed", [*pip, f"{wheel}[hf]"], env=env)
    with tempfile.TemporaryDirectory(prefix="shardformer-install-check-") as work:
        found = step(
            "shardformer imported from the venv",
            [str(venv / "bin" / "python"), "-c", "import shardformer; print(shardformer.__file__)"],
            cwd=work, env=env,
        )  # fmt: skip
        if not found.stdout.strip().startswith(str(venv)):
            sys.exit(f"install-check: shardformer came from {found.stdout.strip()}, not from {venv}")
        quickstarts = [(name, code) for name, code in RUN if name.startswith("README.md")]
        for index, (name, code) in enumerate(quickstarts):
            folder = Path(work) / f"quickstart{index}"
            folder.mkdir()
            (folder / "quickstart.py").write_text(code)
            launch = [str(venv / "bin" / "shardformer"), "run", "--nproc_per_node", "2", "quickstart.py"]
            step(f"{name} on 2 processes", launch, cwd=folder, env=env, timeout=600)
    print(f"install-check passed: {wheel.name} in a fresh venv ran {len(quickstarts)} README quickstarts")


if __name__ == "__main__":
    main()

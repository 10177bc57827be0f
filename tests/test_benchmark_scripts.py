"""Every script in benchmarks/ is maintained: each answers `--help` with its usage (run in this process, so the
check costs no launch). A script that left the tree is cited, wherever a page, docstring or stage names it, as
"`benchmarks/X.py` (removed; it ran at commit SHA, `git show SHA:benchmarks/X.py`)" with a commit that holds it.
Scripts with a tiny CPU run are tested in their own files (test_bench_script.py, test_gpu_equality_script.py, ...)."""
import contextlib
import glob
import io
import os
import re
import runpy
import subprocess
import sys

import pytest

from helpers import REPO

SCRIPTS = sorted(glob.glob(os.path.join(REPO, "benchmarks", "*.py")))


def answers_help(path: str) -> bool:
    """Whether `python path --help` prints a usage and exits 0, run in this process."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        return stop.code in (0, None) and out.getvalue().startswith("usage:")
    finally:
        sys.argv = argv
    return False


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_every_benchmark_script_answers_help(script):
    assert answers_help(script)


def test_the_help_check_finds_a_script_without_usage(tmp_path):
    """Negative control: a script that runs its work instead of answering --help fails the check."""
    script = tmp_path / "one_off.py"
    script.write_text("print('timing something')\n")
    assert not answers_help(str(script))


CITED = re.compile(r"benchmarks/([A-Za-z0-9_]+\.(?:py|sh))")
REMOVED = re.compile(r"`benchmarks/([A-Za-z0-9_]+\.(?:py|sh))`\s+\(removed;\s+it\s+ran\s+at\s+commit\s+([0-9a-f]{7,40}),"
                     r"\s+`git\s+show\s+\2:benchmarks/\1`\)")  # a citation may wrap across lines


def citing_files() -> list:
    """The pages and sources that may name a benchmarks/ script (raw results under benchmarks/results/ excluded)."""
    patterns = ["README.md", "docs/*.md", "benchmarks/*.md", "benchmarks/*.sh", "benchmarks/*.py",
                "ulysses_train/**/*.py", "ulysses_train/**/*.md", "scripts/**/*.py", "scripts/**/*.sh", "tests/*.py",
                "configs/*.yaml"]
    found = {f for pattern in patterns for f in glob.glob(os.path.join(REPO, pattern), recursive=True)}
    return sorted(found - {os.path.abspath(__file__)})


def citation_problems(name: str, text: str) -> list:
    """Scripts `text` names that are gone without the commit that ran them, and present ones cited as removed."""
    removed = dict((script, sha) for script, sha in REMOVED.findall(text))
    problems = []
    for script in sorted(set(CITED.findall(text))):
        exists = os.path.exists(os.path.join(REPO, "benchmarks", script))
        if not exists and script not in removed:
            problems.append(f"{name}: benchmarks/{script} is gone; cite it with the commit that ran it")
        if exists and script in removed:
            problems.append(f"{name}: benchmarks/{script} exists but is cited as removed")
    return problems


def test_pages_cite_only_scripts_that_exist_or_the_commit_that_ran_them():
    problems = [p for f in citing_files() for p in citation_problems(os.path.relpath(f, REPO), open(f).read())]
    assert problems == []


def test_the_citation_check_finds_a_gone_script_and_a_wrong_removal():
    assert citation_problems("x.md", "ran `benchmarks/no_such.py --rows 8`") == [
        "x.md: benchmarks/no_such.py is gone; cite it with the commit that ran it"]
    assert citation_problems("x.md", "`benchmarks/no_such.py` (removed; it ran at commit abc1234, "
                                     "`git show abc1234:benchmarks/no_such.py`)") == []
    assert citation_problems("x.md", "`benchmarks/bench_data.py` (removed; it ran at commit abc1234, "
                                     "`git show abc1234:benchmarks/bench_data.py`)") == [
        "x.md: benchmarks/bench_data.py exists but is cited as removed"]


def removal_commits() -> set:
    return {pair for f in citing_files() for pair in REMOVED.findall(open(f).read())}


def commit_holds(sha: str, script: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{sha}:benchmarks/{script}"], cwd=REPO,
                          capture_output=True).returncode == 0


@pytest.mark.skipif(not os.path.exists(os.path.join(REPO, ".git")), reason="not a git checkout")
def test_each_removed_script_is_in_the_commit_cited_for_it():
    pairs = removal_commits()
    assert pairs, "no removed script is cited (the check would pass on nothing)"
    assert sorted(f"{script} at {sha}" for script, sha in pairs if not commit_holds(sha, script)) == []
    assert not commit_holds(next(iter(pairs))[1], "no_such_script.py")  # negative control

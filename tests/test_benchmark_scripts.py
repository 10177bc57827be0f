"""Every script in benchmarks/ is maintained: each answers `--help` with its usage (run in this process, so the
check costs no launch), and RESULTS.md cites only scripts that exist. Scripts with a tiny CPU run are tested in
their own files (test_bench_script.py, test_loss_forms_script.py, test_gpu_equality_script.py, ...)."""
import contextlib
import glob
import io
import os
import re
import runpy
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


def test_results_cite_only_scripts_that_exist():
    with open(os.path.join(REPO, "benchmarks", "RESULTS.md")) as fh:
        cited = set(re.findall(r"benchmarks/([A-Za-z0-9_]+\.(?:py|sh))", fh.read()))
    missing = sorted(name for name in cited if not os.path.exists(os.path.join(REPO, "benchmarks", name)))
    assert not missing, f"RESULTS.md cites scripts that are gone (keep the command and commit instead): {missing}"

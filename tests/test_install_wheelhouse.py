"""scripts/install_wheelhouse.sh prints an export line that makes ulysses_train importable from any folder (it
printed `PYTHONPATH=SITE:` whose empty entry meant "the current folder": the package imported only when started
from the repository). pip and the DeepSpeed build are stood in for by a `python3` that does nothing."""
import os
import stat
import subprocess
import sys
import tarfile

from helpers import REPO


def test_printed_pythonpath_imports_the_package_from_anywhere(tmp_path):
    wheels, fake_bin, elsewhere = tmp_path / "whl", tmp_path / "bin", tmp_path / "elsewhere"
    for folder in (wheels, fake_bin, elsewhere, tmp_path / "deepspeed-0"):
        folder.mkdir()
    with tarfile.open(wheels / "deepspeed-0.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "deepspeed-0", arcname="deepspeed-0")
    (fake_bin / "python3").write_text("#!/bin/sh\nexit 0\n")
    (fake_bin / "python3").chmod(stat.S_IRWXU)
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "install_wheelhouse.sh"), str(wheels),
                          str(tmp_path / "site")], env=env, capture_output=True, text=True, timeout=60, check=True)
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("export PYTHONPATH=")
    # -S: without site-packages, where an editable install of the package would hide the fault
    check = f'{line}; cd {elsewhere} && {sys.executable} -S -c "import ulysses_train.errors"'
    proc = subprocess.run(["bash", "-c", check], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (line, proc.stderr[-2000:])
    control = f'export PYTHONPATH={tmp_path / "site"}:; cd {elsewhere} && {sys.executable} -S -c "import ulysses_train"'
    assert subprocess.run(["bash", "-c", control], env=env, capture_output=True).returncode != 0

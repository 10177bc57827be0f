"""The `gpu` extra and the trainer's kernel checks read one definition (ulysses_train/kernel_pins.py): setup.py's
extra pins exactly the versions the checks accept, the checks' messages name the extra, and a version outside the
accepted range is caught (the negative control)."""
import ast
import glob
import re
import os

import pytest
from helpers import REPO

from ulysses_train import kernel_pins
from ulysses_train.config import ConfigError


def setup_extras() -> dict:
    """The extras setup.py declares, as setuptools would get them (run without installing anything)."""
    import setuptools

    seen = {}
    real = setuptools.setup
    setuptools.setup = lambda **kwargs: seen.update(kwargs)
    try:
        source = open(os.path.join(REPO, "setup.py")).read()
        exec(compile(ast.parse(source), "setup.py", "exec"), {"__file__": os.path.join(REPO, "setup.py"),
                                                              "__name__": "__main__"})
    finally:
        setuptools.setup = real
    return seen["extras_require"]


def test_the_gpu_extra_pins_every_kernel_at_a_version_the_checks_accept():
    extra = setup_extras()["gpu"]
    assert extra == kernel_pins.gpu_extra()
    assert {req.split("==")[0] for req in extra} >= {"flash-attn-4", "flash-linear-attention", "fla-core", "tilelang",
                                                      "flash-qla", "liger-kernel"}
    for requirement in extra:
        dist, version = requirement.split("==")
        assert kernel_pins.version_problem(dist, version) is None, requirement


def test_a_version_outside_the_accepted_range_is_named_with_the_extra():
    """Negative control: an older fla and a newer Liger than were measured."""
    old = kernel_pins.version_problem("fla-core", "0.5.2")
    assert old == ('fla-core 0.5.2 is installed, but fla\'s Triton kernels ran measured with 0.6.0 (accepted: '
                   '>=0.6,<0.7). Fix: pip install "ulysses-train[gpu]"')
    assert kernel_pins.version_problem("liger-kernel", "0.9.0") is not None
    assert kernel_pins.version_problem("flash-attn-4", "4.0.0b35") is not None
    assert kernel_pins.version_problem("tilelang", None) is None  # not installed: the presence checks say so


def test_installed_version_problems_reads_the_installed_versions(monkeypatch):
    versions = {"liger-kernel": "0.7.0", "fla-core": "0.6.0"}
    monkeypatch.setattr(kernel_pins, "installed_version", versions.get)
    assert [line.split(" is installed")[0] for line in kernel_pins.installed_version_problems()] == [
        "liger-kernel 0.7.0"]


def test_missing_kernel_messages_name_the_extra(monkeypatch):
    from transformers import Qwen3_5TextConfig

    from ulysses_train.model.mixers import gated_deltanet, recurrent

    monkeypatch.setattr(recurrent, "fla_available", lambda: False)
    with pytest.raises(ConfigError, match=r'Fix: pip install "ulysses-train\[gpu\]"'):
        gated_deltanet.check_linear_attention_kernels(Qwen3_5TextConfig(), 1_048_576, cuda=True)
    problem = recurrent.fla_backward_problem((9, 0), "3.6.0", tilelang_installed=False)
    assert kernel_pins.INSTALL_LINE in problem


# ---------------------------------------------------------------- every install line resolvable

PIP_INSTALL = re.compile(r"pip3? install((?:[ \t]+(?:-[-\w]+|\"[^\"\n]*\"|'[^'\n]*'|[\w.\[\]<>=!~-]+))+)")
PATH_LIKE = re.compile(r"^[.$/]|/|\*|\{")  # paths, globs, and an f-string's {placeholder} (checked by value)


def install_requirements(text: str) -> list:
    """The requirements of every `pip install ...` in `text` (options, paths, f-string placeholders and the
    `-e`/`-r`/`--target` values dropped; a sentence's closing full stop too)."""
    found = []
    for match in PIP_INSTALL.finditer(text):
        words = [w.strip("\"'").rstrip(".") for w in match.group(1).split()]
        for before, word in zip(["pip"] + words, words):
            if word.startswith("-") or before in ("-e", "-r", "-c", "--target") or not word or PATH_LIKE.search(word):
                continue
            found.append(word)
    return found


def install_line_problems(text: str) -> list:
    """Requirements that do not parse, and kernels with only pre-releases named without a pre-release version."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    prerelease_only = {canonicalize_name(p.dist) for p in kernel_pins.PINS if Version(p.measured).is_prerelease}
    problems = []
    for word in install_requirements(text):
        try:
            req = Requirement(word)
        except InvalidRequirement:
            problems.append(f"{word}: not a requirement pip parses")
            continue
        pinned = any(Version(spec.version).is_prerelease for spec in req.specifier)
        if canonicalize_name(req.name) in prerelease_only and not pinned:
            problems.append(f"{word}: {req.name} has only pre-releases; name one (pip resolves nothing else)")
    return problems


def install_texts() -> dict:
    """Every file a user reads an install line from: the package's and scripts' messages, README, docs."""
    paths = glob.glob(os.path.join(REPO, "ulysses_train", "**", "*.py"), recursive=True)
    paths += glob.glob(os.path.join(REPO, "scripts", "*.py")) + glob.glob(os.path.join(REPO, "docs", "*.md"))
    return {os.path.relpath(p, REPO): open(p).read() for p in paths + [os.path.join(REPO, "README.md")]}


def test_every_printed_and_documented_install_line_resolves():
    texts = install_texts()
    assert install_requirements(texts["ulysses_train/kernel_pins.py"]).count("ulysses-train[gpu]") == 1
    texts["the printed lines"] = f"{kernel_pins.INSTALL_LINE}; {kernel_pins.FA4_INSTALL_LINE}"  # f-strings' parts
    assert install_requirements(texts["the printed lines"]) == ["ulysses-train[gpu]", "flash-attn-4==4.0.0b36"]
    assert [f"{name}: {p}" for name, text in texts.items() for p in install_line_problems(text)] == []


def test_the_install_line_check_catches_an_unpinned_prerelease_kernel_and_a_broken_requirement():
    assert install_line_problems("install it (pip install flash-attn-4) or use sdpa") == [
        "flash-attn-4: flash-attn-4 has only pre-releases; name one (pip resolves nothing else)"]
    assert install_line_problems("`pip install 'triton>=>3'`") == ["triton>=>3: not a requirement pip parses"]
    assert install_line_problems('pip install -e ".[fa4]" && pip install "flash-attn-4==4.0.0b36" peft.') == []


def test_the_fa4_extra_is_pinned_like_the_gpu_extra():
    extra = setup_extras()["fa4"]
    assert extra == kernel_pins.fa4_extra() and "flash-attn-4==4.0.0b36" in extra
    assert set(extra) <= set(kernel_pins.gpu_extra())

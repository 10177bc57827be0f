"""The `gpu` extra and the trainer's kernel checks read one definition (ulysses_train/kernel_pins.py): setup.py's
extra pins exactly the versions the checks accept, the checks' messages name the extra, and a version outside the
accepted range is caught (the negative control)."""
import ast
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

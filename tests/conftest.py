"""Shared fixtures.

- ``specroll_home`` (session, autouse): a temporary ``SPECROLL_HOME`` so tests never touch the user's
  cache. Aliases such as ``tiny-llama`` resolved by tests are built there; its ``kernels`` links to the
  real cache's, so the C++ kernels compile once per machine rather than once per test run.
- ``smollm2`` (session): (Decoder, tokenizer, dir) of the real SmolLM2-135M-Instruct. It lives in the
  *real* cache (``$SPECROLL_HOME`` as set before pytest started, else ``~/.cache/specroll``), so it is
  pulled once per machine (about 40 s) and reloaded in about a second afterwards.
- ``keep_fast_bf16`` (autouse): SPECROLL_FAST_BF16 as it was before each test (an in-process resume sets it).
- ``tiny``: a function ``tiny(arch, seed=0, **config_overrides) -> (Decoder, tokenizer, hf_model)``;
  the decoder and the transformers model hold the same random weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REAL_HOME = Path(os.environ.get("SPECROLL_HOME") or Path.home() / ".cache" / "specroll").expanduser()


@pytest.fixture(scope="session", autouse=True)
def specroll_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("specroll_home")
    (REAL_HOME / "kernels").mkdir(parents=True, exist_ok=True)
    (home / "kernels").symlink_to(REAL_HOME / "kernels")  # built kernels are per machine: compile once, not per run
    old = os.environ.get("SPECROLL_HOME")
    os.environ["SPECROLL_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("SPECROLL_HOME", None)
    else:
        os.environ["SPECROLL_HOME"] = old


@pytest.fixture(autouse=True)
def keep_fast_bf16():
    """A resume run in-process (``main(["train", "--resume", ...])``) sets SPECROLL_FAST_BF16 to the decision its
    checkpoint recorded, as its process should (``run._keep_precision``); here the process is the test session,
    so the variable and ``device.fast_bf16``'s cached answer are put back after each test."""
    before = os.environ.get("SPECROLL_FAST_BF16")
    yield
    if os.environ.get("SPECROLL_FAST_BF16") != before:
        if before is None:
            os.environ.pop("SPECROLL_FAST_BF16", None)
        else:
            os.environ["SPECROLL_FAST_BF16"] = before
        from specroll import device

        device.fast_bf16.cache_clear()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from specroll.models import hub

    return hub.resolve("smollm2-135m", home=REAL_HOME)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from specroll.models import hub

    model, tok = hub.load(smollm2_dir)
    return model, tok, smollm2_dir


@pytest.fixture(scope="session")
def tiny():
    from specroll.models.tiny import tiny_models

    return tiny_models


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-tensor tests: faster, and far faster on shared cores.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_debug(monkeypatch):
    """SPECROLL_DEBUG unset: errors print their one line instead of raising (``pytest.mark.usefixtures``)."""
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)


@pytest.fixture
def no_work(monkeypatch):
    """Loading or resolving a model (the start of every command's work) fails the test."""
    from specroll.models import hub

    def work(*a, **k):
        raise AssertionError("the command started its work")

    monkeypatch.setattr(hub, "load", work)
    monkeypatch.setattr(hub, "resolve", work)

"""The C_peak profile cache (engine/profiler.py) and the JSON writer it uses (bench/common.py ``write_json``): a
file at a profile's cache path that is damaged, incomplete or another model's / machine's is refused in one line
naming the file and the fix (never a traceback, never used as is), ``--force`` replaces it, and a JSON write is
safe against a concurrent writer of the same file and never writes NaN."""

from __future__ import annotations

import json
import os
import re

import pytest
from helpers import cli_error

from specroll.bench.common import write_json
from specroll.engine import profiler

pytestmark = pytest.mark.usefixtures("one_thread")

ARGV = ["profile", "--model", "tiny-llama", "--dtype", "float32", "--max-tokens", "2", "--batches", "1",
        "--context", "2", "--repeats", "1", "--quiet"]


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """Profiles under ``tmp_path`` (the models and the built kernels stay in the session's home)."""
    monkeypatch.setattr(profiler, "profiles_dir", lambda: tmp_path / "profiles")
    return tmp_path


@pytest.fixture(scope="module")
def measured(tiny):
    """A real (tiny) profile of tiny-llama, as ``run_profile`` writes it."""
    from specroll.engine.engine import Engine

    model, _, _ = tiny("llama")
    return profiler.run_profile("tiny-llama", "float32", engine=Engine(model), max_tokens=4, batches=(1, 2),
                                context=2, repeats=1)


def cached_file(data) -> str:
    """Write ``data`` (JSON, or bytes as they are) at tiny-llama's float32 cache path; returns the path."""
    path = profiler.profile_path("tiny-llama", "float32")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    return str(path)


def refused(match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        profiler.load_profile("tiny-llama", "float32")
    assert "\n" not in str(e.value) and "delete it or rerun `specroll profile --model tiny-llama" in str(e.value)


@pytest.mark.parametrize("data", [[1], None, "c_peak", 8], ids=["list", "null", "string", "number"])
def test_json_that_is_not_an_object_is_not_a_profile(home, data):
    path = cached_file(data)
    refused(f"^{re.escape(path)}: .*not a specroll profile")
    with pytest.raises(ValueError, match=re.escape(path)):  # what `train draft.plan=adaptive` calls
        profiler.get_c_peak("tiny-llama", "float32", profile_if_missing=False)


def test_a_profile_that_is_not_utf8_names_its_file(home):
    path = cached_file(b'{"format": "\xff\xfe"}')
    refused(f"^{re.escape(path)}: unreadable profile")


def drop(data: dict, *keys) -> dict:
    """A deep copy of ``data`` without the field at ``keys`` (e.g. "points", 0, "latency_s")."""
    data = json.loads(json.dumps(data))
    inner = data
    for k in keys[:-1]:
        inner = inner[k]
    del inner[keys[-1]]
    return data


MISSING = [("points",), ("knee",), ("fingerprint",), ("batches",), ("delta",), ("model",), ("context",),
           ("c_peak_by_batch",), ("points", 0, "latency_s"), ("points", 1, "batch"), ("points", 0, "total_tokens"),
           ("points", 0, "median_s"), ("knee", "single_token_ms"), ("knee", "ratio")]


@pytest.mark.parametrize("keys", MISSING, ids=lambda k: ".".join(map(str, k)))
def test_a_profile_missing_a_field_the_code_reads_is_refused(home, measured, keys):
    cached_file(drop(measured, *keys))
    refused(f"'{re.escape(keys[0])}.*not a specroll profile")


@pytest.mark.parametrize("field, value", [("points", []), ("points", [7]), ("knee", [1.0]),
                                          ("delta", "0.5"), ("batches", 1), ("latency_s", 0.0), ("latency_s", None)])
def test_a_profile_with_a_malformed_field_is_refused(home, measured, field, value):
    data = json.loads(json.dumps(measured))
    if field == "latency_s":
        data["points"][0][field] = value
    else:
        data[field] = value
    cached_file(data)
    refused("not a specroll profile")


def test_the_profile_command_refuses_an_incomplete_profile_in_one_line(home, measured, capsys, no_debug):
    path = cached_file(drop(measured, "points"))
    line = cli_error(capsys, ARGV)
    assert line.startswith(f"specroll: error: {path}: ") and "--force" in line


@pytest.mark.parametrize("field, value", [("model", "smollm2-135m"), ("dtype", "bfloat16"),
                                          ("cpu", "Some Other CPU"), ("torch", "0.0.1")])
def test_a_profile_of_another_model_dtype_or_machine_is_refused(home, measured, field, value):
    data = json.loads(json.dumps(measured))
    if field in data:
        data[field] = value
    else:
        data["fingerprint"][field] = value
    path = cached_file(data)
    refused(f"^{re.escape(path)}: .*{field}.*{re.escape(value)}")
    cached_file(measured)
    assert profiler.load_profile("tiny-llama", "float32") == json.loads(json.dumps(measured))


def test_a_local_model_profile_is_found_from_another_directory(home, tiny, tmp_path, monkeypatch):
    """The model recorded in a profile is compared as the cache key names it: `profile --model ./m` in one
    directory and `train model.name=/abs/m` (a run's config) in another find and accept the same profile."""
    from specroll.engine.engine import Engine

    (tmp_path / "m").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    model, _, _ = tiny("llama")
    profiler.save_profile(profiler.run_profile("./m", "float32", engine=Engine(model), max_tokens=2, batches=(1,),
                                               context=2, repeats=1))
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert profiler.load_profile(str(tmp_path / "m"), "float32")["c_peak"] >= 1


@pytest.mark.parametrize("damage", [b"{not json", b"[1]", b"\xff"], ids=["json", "list", "utf8"])
def test_profile_force_replaces_a_damaged_profile(home, capsys, no_debug, damage):
    """The damaged-profile error says to rerun with --force: that must work, saying what it replaces."""
    path = cached_file(damage)
    capsys.readouterr()
    from specroll.cli import main

    assert main(ARGV + ["--force"]) == 0
    out = capsys.readouterr().out
    (note,) = [ln for ln in out.splitlines() if ln.startswith("--force: ")]
    assert note.startswith(f"--force: {path} is no usable profile (") and note.endswith("replace it")
    assert profiler.load_profile("tiny-llama", "float32")["mode"] == "full"


# --- write_json -------------------------------------------------------------------------------------

def test_write_json_survives_a_concurrent_writer_of_the_same_file(tmp_path, monkeypatch):
    """Two processes writing one file (two ranks caching one profile): each through its own temporary file, so
    neither's rename finds its temporary gone and a reader never sees a partial file. Another process's write is
    simulated between this one's write and its rename."""
    path = tmp_path / "p.json"
    real_replace, pid = os.replace, os.getpid()
    seen = []

    def replace(src, dst):
        if not seen:
            seen.append(src)
            monkeypatch.setattr(os, "getpid", lambda: pid + 1)
            write_json(path, {"who": "other"})
            monkeypatch.setattr(os, "getpid", lambda: pid)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    write_json(path, {"who": "me"})
    assert json.loads(path.read_text()) == {"who": "me"}
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary file left


def test_write_json_removes_its_temporary_file_on_any_failure(tmp_path, monkeypatch):
    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_json(tmp_path / "p.json", {"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_write_json_writes_non_finite_numbers_as_null(tmp_path):
    nan, inf = float("nan"), float("inf")
    write_json(tmp_path / "p.json", {"a": nan, "b": [1.5, inf, {"c": -inf}], "d": (nan, 2), "e": {"f": {"g": nan}}})

    def strict(name):
        raise AssertionError(f"{name} is not JSON")

    back = json.loads((tmp_path / "p.json").read_text(), parse_constant=strict)
    assert back == {"a": None, "b": [1.5, None, {"c": None}], "d": [None, 2], "e": {"f": {"g": None}}}

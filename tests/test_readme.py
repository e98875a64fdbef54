"""The README stays true: every `specroll ...` command it shows exists with the options it shows, every dotted
config key it names (`section.key`) is a real key, and every file path it links is in the repository."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from specroll.cli import build_parser
from specroll.config import SECTIONS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _code() -> list[str]:
    """Inline code spans and the lines of fenced blocks (where commands and keys are written)."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", README, flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", README, flags=re.S))
    return [line for b in blocks for line in b.splitlines()] + spans


def _commands() -> list[list[str]]:
    """Each shown command as words, table alternatives (``a\\|b``) expanded, comments and brackets dropped."""
    out = []
    for text in _code():
        text = text.split("#")[0].replace("\\|", "|")
        if not text.strip().startswith("specroll "):
            continue
        words = re.sub(r"[\[\]]", " ", text).split()[1:]
        out.append(words)
    return out


def _sub(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _resolve(words: list[str]) -> list[tuple[str, argparse.ArgumentParser, list[str]]]:
    """(command path, its parser, the rest of the words) for every alternative the words spell."""
    todo, found = [("specroll", build_parser(), words)], []
    while todo:
        path, p, rest = todo.pop()
        subs = _sub(p)
        if subs and rest:
            names = rest[0].split("|")
            assert all(n in subs for n in names), f"README: `{path} {rest[0]}`: no such command (have {sorted(subs)})"
            todo += [(f"{path} {n}", subs[n], rest[1:]) for n in names]
        else:
            found.append((path, p, rest))
    return found


def test_readme_shows_commands():
    assert len(_commands()) >= 15  # the test below has something to check


@pytest.mark.parametrize("words", _commands(), ids=lambda w: " ".join(w)[:60])
def test_every_command_and_option_the_readme_shows_exists(words):
    for path, parser, rest in _resolve(words):
        options = set(parser._option_string_actions)
        for w in rest:
            if w.startswith("-") and not re.fullmatch(r"-?\d[\d.,e-]*", w):
                flag = w.split("=")[0].rstrip(".,;:)")
                assert flag in options, f"README: `{path}` has no option {flag} (has {sorted(options)})"


def test_every_config_key_the_readme_names_exists():
    keys = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    key = re.compile(r"(?<![\w/.])(" + "|".join(SECTIONS) + r")\.([A-Za-z_0-9]+)\b(?!\.\w)")  # not a path
    named = {m for text in _code() for m in key.findall(text)}
    assert len(named) >= 10
    missing = sorted(f"{s}.{k}" for s, k in named if f"{s}.{k}" not in keys)
    assert not missing, f"README names config keys that do not exist: {missing}"


def test_every_linked_repository_file_exists():
    links = re.findall(r"\]\((?!https?://|#)([^)\s]+)\)", README)
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README links files that are not in the repository: {missing}"


def test_every_repository_path_the_readme_shows_exists():
    """Paths written as code (`specroll/kernels/draft.cpp`, `configs/*.yaml`) exist; none points outside."""
    paths = [s.strip() for s in _code() if re.fullmatch(r"(\.\./|configs/|scripts/|specroll/|benchmarks/|tests/)[\w.*/-]*",
                                                        s.strip())]
    assert len(paths) >= 5
    outside = [p for p in paths if p.startswith("../")]
    assert not outside, f"README points outside the repository: {outside}"
    missing = [p for p in paths if not list(ROOT.glob(p))]
    assert not missing, f"README shows paths that are not in the repository: {missing}"


def test_the_library_example_runs_as_shown(smollm2, monkeypatch):
    """The README's `## Library` block, run as written (the real model, from the machine's cache): 8 rollouts of
    the prompt, each with its completion, both kinds of log-probabilities and a finish reason."""
    home = next(p for p in Path(smollm2[2]).parents if p.name == "models").parent
    monkeypatch.setenv("SPECROLL_HOME", str(home))  # the cache the smollm2 fixture loaded from: no second pull
    block = re.search(r"## Library\n\n```python\n(.*?)```", README, flags=re.S).group(1)
    assert 'hub.load("smollm2-135m")' in block
    ns: dict = {}
    exec(compile(block, "README.md#library", "exec"), ns)  # noqa: S102 - our own README
    rollouts = ns["rollouts"]
    assert len(rollouts) == 8
    for r in rollouts:
        n = len(r.completion_ids)
        assert 1 <= n <= 32 and r.logprobs.shape == r.sample_logprobs.shape == (n,)
        assert (r.logprobs <= 0).all() and r.finish_reason in ("stop", "length")


def _metrics_table() -> set[str]:
    """The keys the README's "### Metrics" table names (``reward/<func>`` as a pattern)."""
    sec = README.split("### Metrics", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in sec.splitlines() if line.startswith("| `")]
    return {k for row in rows for k in re.findall(r"`([^`]+)`", row)}


def test_every_metric_a_run_writes_is_in_the_readme_table(tmp_path, capsys, monkeypatch):
    """Two tiny runs that between them write every step metric but --nproc's: reuse with KL and recomputed old
    log-probs, then an online draft head; each key of their metrics.jsonl must have a row in the table."""
    import json

    from specroll.cli import main

    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    tiny = ["model.name=tiny-llama", "rollout.max_new_tokens=4", "data.n_train=2", "data.n_eval=2",
            "train.prompts_per_step=2", "rollout.G=2", "model.rollout_dtype=float32", "train.eval_before=false",
            "train.steps=2", "train.save_every=1"]
    runs = {"reuse": ["reuse.mode=lenient", "reuse.lenience=inf", "loss.beta=0.01", "train.mu=2",
                      "reward.funcs=[accuracy,format]"],
            "draft": ["draft.head=random", "draft.online=true", "draft.update_after=1", "draft.w_tv=1"]}
    keys: set[str] = set()
    for name, extra in runs.items():
        assert main(["train", "--out", str(tmp_path / name), *tiny, *extra]) == 0
        for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines():
            keys |= set(json.loads(line))
    capsys.readouterr()
    table = _metrics_table()
    assert {"timing/grad_sync", "reward/<func>"} <= table
    documented = lambda k: k in table or (k.startswith("reward/") and k.count("/") == 1)  # noqa: E731
    missing = sorted(k for k in keys if not documented(k))
    assert not missing, f"metrics.jsonl keys without a row in the README's Metrics table: {missing}"
    # the runs wrote what the table describes for them (so the check above covered them)
    assert {"spec/reuse_ratio", "spec/skip_ratio", "actor/kl", "draft/tv", "draft/pairs", "eval/accuracy",
            "reward/accuracy", "reward/format", "timing/checkpoint", "spec/accept_length"} <= keys

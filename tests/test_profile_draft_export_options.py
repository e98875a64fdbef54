"""Options of `profile`, `draft train`, `export` and `models pull` that were measured, ignored or acted on wrongly:
a --batches / --context the knee rule cannot read is refused before measuring, a cached profile says which --repeats
it was measured with and keeps its PNG in step with its JSON, --draft-vocab with --init and a repeated or foreign
--extra-data cache are one-line errors (a valid cache is never called one to delete), --out . fills an empty
current directory in place instead of replacing it, and a pulled model is readable by others like an export."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import cli_error

from specroll.cli import main
from specroll.drafters import distill as D
from specroll.engine import profiler
from specroll.models import hub

pytestmark = pytest.mark.usefixtures("one_thread", "no_debug")


@pytest.fixture
def no_measuring(monkeypatch, tmp_path):
    """A profile cache of its own, and measuring fails the test."""
    monkeypatch.setattr(profiler, "profiles_dir", lambda: tmp_path / "profiles")
    monkeypatch.setattr(profiler, "run_profile", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr(profiler, "measure", lambda *a, **k: pytest.fail("measured"))


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield 0o644
    os.umask(old)


# --- profile ------------------------------------------------------------------------------------------

PROFILE = ["profile", "--model", "tiny-llama", "--dtype", "float32", "--force"]


@pytest.mark.parametrize("argv, msg", [
    (["--batches", "4,16", "--max-tokens", "2"],
     "--batches must include 1 (C_peak is read off the single-row curve, whose single-token latency is the baseline; "
     "other batch sizes check it), got 4,16"),
    (["--batches", "1,64", "--max-tokens", "16"],
     "--batches 1,64: batch size 64 is above --max-tokens 16 (the largest batch x tokens per forward measured); "
     "raise --max-tokens to at least 64 or drop it"),
    (["--batches", "1,4,16", "--max-tokens", "2"],
     "--batches 1,4,16: batch sizes 4,16 are above --max-tokens 2 (the largest batch x tokens per forward measured); "
     "raise --max-tokens to at least 16 or drop them"),
    (["--batches", "1,4,4"], "--batches lists a batch size twice, got 1,4,4; give each once"),
], ids=["no-batch-1", "batch-above-max-tokens", "batches-above-max-tokens", "repeated-batch"])
def test_profile_refuses_batches_the_knee_rule_cannot_read(capsys, no_work, no_measuring, argv, msg):
    """A batch above --max-tokens was measured anyway (C_peak = 4 "tokens per forward" from --batches 4,16
    --max-tokens 2, baseline 4 tokens) and cached as a full profile."""
    assert cli_error(capsys, [*PROFILE, *argv]) == f"specroll: error: {msg}"


def test_profile_refuses_a_context_beyond_the_models_positions(capsys, no_measuring):
    limit = hub.load("tiny-llama")[0].cfg.max_position  # 2048
    for context, max_tokens in ((100000, 512), (limit - 511, 512), (limit, 1)):
        line = cli_error(capsys, [*PROFILE, "--context", str(context), "--max-tokens", str(max_tokens), "--batches", "1"])
        assert line == (f"specroll: error: --context {context} + --max-tokens {max_tokens} = {context + max_tokens} "
                        f"positions per row, beyond the model's maximum position of {limit}; keep --context + "
                        f"--max-tokens <= {limit}")
    profiler.check_positions(limit - 512, 512, limit)  # the last position fits


def test_profile_says_it_prefills_before_the_prefill(tiny, monkeypatch):
    from specroll.engine.engine import Engine

    said = []
    real = profiler._prefilled_cache

    def prefill(engine, batch, context, tokens, gen):
        said.append(f"prefill {batch}")
        return real(engine, batch, context, tokens, gen)

    monkeypatch.setattr(profiler, "_prefilled_cache", prefill)
    profiler.measure(Engine(tiny("llama")[0]), max_tokens=2, batches=(1, 2), context=8, repeats=1, log=said.append)
    assert said[:4] == ["B=  1: prefilling 1 x 8 context tokens", "prefill 1",
                        "B=  2: prefilling 2 x 8 context tokens", "prefill 2"]


@pytest.fixture
def cached_profile(tmp_path, monkeypatch):
    """(argv, JSON path) of a full tiny-llama profile measured with --repeats 2 into a cache of its own; measuring
    again fails the test."""
    monkeypatch.setattr(profiler, "profiles_dir", lambda: tmp_path / "profiles")
    argv = ["profile", "--model", "tiny-llama", "--dtype", "float32", "--quiet", "--max-tokens", "4", "--batches", "1",
            "--context", "4"]
    assert main([*argv, "--repeats", "2"]) == 0
    monkeypatch.setattr(profiler, "run_profile", lambda *a, **k: pytest.fail("measured again"))
    return argv, profiler.profile_path("tiny-llama", "float32")


def test_a_cached_profile_names_the_repeats_it_was_measured_with(cached_profile, capsys):
    """--repeats other than the cached profile's was ignored silently."""
    argv, _ = cached_profile
    capsys.readouterr()
    assert main([*argv, "--repeats", "7"]) == 0
    assert "the cached grid is used (--repeats 2); --force measures --repeats 7" in capsys.readouterr().out
    assert main([*argv, "--repeats", "2"]) == 0
    assert "the cached grid is used" not in capsys.readouterr().out  # (not "grid": a noisy machine's warning has it)


def test_delta_on_a_cached_profile_redraws_the_png_beside_it(cached_profile, tmp_path, capsys):
    """--delta rewrote the cached JSON but, with --out-dir, left the PNG beside it drawn with the old delta."""
    argv, path = cached_profile
    png = path.with_suffix(".png")
    before = png.read_bytes()
    capsys.readouterr()
    out = tmp_path / "out"
    assert main([*argv, "--repeats", "2", "--delta", "0.05", "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--delta 0.05 applied to the cached points" in printed
    assert json.loads(path.read_text())["delta"] == 0.05
    assert png.read_bytes() != before  # redrawn with the JSON's new delta
    assert (out / png.name).read_bytes() == png.read_bytes()
    assert f"wrote {path}, {png}, {out / path.name} and {out / png.name}" in printed
    # nothing rewritten: only --out-dir's copies; --out-dir the cache's own folder: each file once
    assert main([*argv, "--repeats", "2", "--delta", "0.05", "--out-dir", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out / path.name} and {out / png.name}"
    assert main([*argv, "--repeats", "2", "--delta", "0.05", "--out-dir", str(path.parent)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {png}"


def test_a_cached_profile_without_a_batch_1_baseline_is_not_used(tmp_path, monkeypatch):
    """Profiles cached before --batches had to hold 1 read C_peak off a B-row curve: not a per-row budget."""
    monkeypatch.setattr(profiler, "profiles_dir", lambda: tmp_path)
    path = profiler.profile_path("tiny-llama", "float32")
    pts = [{"batch": 4, "tokens_per_row": 1, "total_tokens": 4, "latency_s": 1.5e-4, "median_s": 1.5e-4}]
    bad = {"format": profiler.FORMAT, "model": "tiny-llama", "dtype": "float32", "fingerprint": profiler.fingerprint(),
           "mode": "full", "delta": 0.5, "context": 4, "batches": [4, 16], **profiler.summarise(pts), "points": pts}
    assert (bad["c_peak"], bad["knee"]["base_tokens"]) == (4, 4)
    profiler.save_profile(bad, path)
    with pytest.raises(ValueError, match=r"--batches 4,16 lacks 1\), so its C_peak is no per-row budget; rerun "
                                         r"`specroll profile --model tiny-llama --dtype float32 --force`$"):
        profiler.get_c_peak("tiny-llama", "float32", profile_if_missing=False)
    profiler.save_profile({**bad, "batches": [1], "points": [{**pts[0], "batch": 1, "tokens_per_row": 4}],
                           "knee": {**bad["knee"], "base_tokens": 1}}, path)
    assert profiler.get_c_peak("tiny-llama", "float32", profile_if_missing=False) == 4


# --- draft train --------------------------------------------------------------------------------------

def fake_distill(seen):
    """``distill`` that records its arguments and returns the --init head (or a fresh one) untrained."""
    from specroll.drafters.eagle import head_for

    def run(policy, prompts, **kw):
        seen.update(kw)
        head = kw["init"] or head_for(policy)
        return head, {"draft_vocab": head.draft_vocab}

    return run


def test_draft_vocab_with_init_must_match_the_heads(tmp_path, capsys, monkeypatch):
    """--draft-vocab was ignored silently with --init (the head keeps its vocabulary); without --init it still
    defaults to 4096."""
    from specroll.drafters.eagle import head_for, save_head

    model, _ = hub.load("tiny-llama")
    V = model.cfg.vocab_size
    save_head(head_for(model, torch.arange(48)), tmp_path / "small")
    save_head(head_for(model), tmp_path / "full")
    seen = {}
    monkeypatch.setattr(D, "distill", fake_distill(seen))
    base = ["draft", "train", "--model", "tiny-llama", "--dtype", "float32", "--prompts", "2", "--steps", "1"]
    for head, vocab, size in (("small", "100", "48 tokens"), ("small", "0", "48 tokens"),
                              ("full", "48", f"{V} tokens (full)")):
        d = tmp_path / head
        line = cli_error(capsys, [*base, "--init", str(d), "--out", str(d), "--draft-vocab", vocab])
        assert line == (f"specroll: error: --draft-vocab {vocab} differs from the --init head's draft vocabulary of "
                        f"{size}, which continued training keeps; drop --draft-vocab, or train a new head without "
                        "--init")
        assert not seen
    for head, vocab in (("small", ["--draft-vocab", "48"]), ("small", []), ("full", ["--draft-vocab", "0"]),
                        ("full", ["--draft-vocab", str(V + 5)])):  # the same vocabulary, or none asked for
        d = tmp_path / head
        assert main([*base, "--init", str(d), "--out", str(d), *vocab]) == 0
        assert seen.pop("init").draft_vocab == (48 if head == "small" else V)
    assert main([*base, "--out", str(tmp_path / "new")]) == 0
    assert seen["init"] is None and seen["draft_vocab"] == D.DEFAULT_DRAFT_VOCAB == 4096


@pytest.mark.parametrize("argv, msg", [
    (["--extra-data", "c1.st,c1.st"],
     "--extra-data lists c1.st twice whose sequences would join the training data twice; drop the repeat"),
    (["--extra-data", "c2.st,c1.st,./c1.st"],
     "--extra-data lists c1.st and ./c1.st, the same file, whose sequences would join the training data twice; "
     "drop the repeat"),
    (["--data-cache", "c1.st", "--extra-data", "c2.st,sub/../c1.st"],
     "--extra-data sub/../c1.st is the --data-cache c1.st, whose sequences are already included; drop it from "
     "--extra-data"),
], ids=["listed-twice", "same-file", "the-data-cache"])
def test_an_extra_data_cache_already_included_is_refused(tmp_path, capsys, monkeypatch, no_work, argv, msg):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    line = cli_error(capsys, ["draft", "train", "--model", "tiny-llama", "--out", str(tmp_path / "head"), *argv])
    assert line == f"specroll: error: {msg}"
    with pytest.raises(ValueError, match="the same file"):  # the library too
        D.check_caches(None, ["c1.st", str(tmp_path / "c1.st")])


def test_an_extra_data_cache_of_another_model_is_to_be_dropped_not_deleted(tmp_path, capsys, monkeypatch):
    """A valid cache of another model got the --data-cache advice "delete it or pass another data cache path"."""
    seqs, hid = [torch.tensor([1, 2, 3])], [torch.randn(3, 8)]
    key = {"model": "smollm2-135m", "data": None, "n": 1, "max_new_tokens": 4, "temperature": 1.0,
           "dtype": str(torch.float32), "seed": 0, "prompts": "0" * 16}
    other = D.save_sequences(tmp_path / "other.st", seqs, hid, key, [2])
    monkeypatch.setattr(D, "generate_sequences", lambda *a, **k: pytest.fail("generated before checking extra data"))
    line = cli_error(capsys, ["draft", "train", "--model", "tiny-llama", "--dtype", "float32", "--prompts", "2",
                              "--extra-data", str(other), "--out", str(tmp_path / "head")])
    assert line == (f"specroll: error: extra data cache {other} belongs to another model or dtype (model differ: made "
                    "with model 'smollm2-135m', this run uses model 'tiny-llama'); its hidden states are not this "
                    "model's: drop it from --extra-data (keep the file, it is valid for its own model)")
    assert other.is_file() and not (tmp_path / "head").exists()
    with pytest.raises(ValueError, match=r"\(model, dtype differ: made with model 'smollm2-135m' and dtype "
                                         r"'torch.float32', this run uses model 'm' and dtype 'torch.bfloat16'\)"):
        D.load_extra(other, {**key, "model": "m", "dtype": str(torch.bfloat16)})
    assert len(D.load_extra(other, {**key, "seed": 3, "prompts": "x"})[0]) == 1  # other prompts and seeds: joined


def test_negative_noise_is_refused(tmp_path, capsys, no_work):
    """--noise -1 trained without noise (the loss adds it only when > 0)."""
    line = cli_error(capsys, ["draft", "train", "--model", "tiny-llama", "--noise", "-1", "--out", str(tmp_path / "h")])
    assert line == "specroll: error: --noise must be >= 0 (0 = off), got -1.0"
    assert list(tmp_path.iterdir()) == []


def recording_distill(seen):
    """``distill`` that records its arguments and returns the --init head (or a fresh one) untrained, with the info
    of a session of ``cfg.steps`` steps over 8 sequences."""
    from specroll.drafters.eagle import head_for

    def run(policy, prompts, **kw):
        seen.update(kw)
        head = kw["init"] or head_for(policy)
        return head, {"sequences": 8, "steps": kw["cfg"].steps, "final": {}, "draft_vocab": head.draft_vocab}

    return run


def test_a_head_of_another_architecture_is_refused_one_of_another_name_is_not(tmp_path, capsys):
    """tiny-llama's head drafted for tiny-qwen2 (same sizes and vocabulary) silently, accepting nothing: only the
    sizes were compared. The model's name is not: a head fits the same model under another name or path (a
    fine-tuned checkpoint of it, a run's own model)."""
    import shutil

    from specroll.drafters.build import DraftConfig, make_head
    from specroll.drafters.eagle import head_for, load_head, save_head

    llama, qwen2 = hub.load("tiny-llama")[0], hub.load("tiny-qwen2")[0]
    d = tmp_path / "head"
    save_head(head_for(llama), d, {"model": "tiny-llama"})
    msg = (f"{d / 'draft_head.json'}: policy.arch is 'llama' but the model has 'qwen2'; this head was trained for "
           "another model (tiny-llama): distil one for this model with `specroll draft train --model M`")
    with pytest.raises(ValueError) as e:
        load_head(d, qwen2)
    assert str(e.value) == msg
    with pytest.raises(ValueError) as e:  # a GRPO run's draft.head
        make_head(DraftConfig(head=str(d)), qwen2)
    assert str(e.value) == f"draft.head={d}: {msg}"
    line = cli_error(capsys, ["generate", "--model", "tiny-qwen2", "--dtype", "float32", "--draft", str(d),
                              "--prompt", "hi", "--max-new-tokens", "2"])
    assert line == f"specroll: error: --draft {d}: {msg}"
    # the same model under another name (a local copy of its directory), with changed weights: fits
    copy = tmp_path / "tuned"
    shutil.copytree(hub.resolve("tiny-llama", quiet=True), copy)
    (copy / hub.MARKER).unlink()
    tuned = hub.load(str(copy))[0]
    with torch.no_grad():
        tuned.lm_head.weight.mul_(1.01)
    assert load_head(d, tuned).draft_vocab == llama.cfg.vocab_size
    assert make_head(DraftConfig(head=str(d), online=True), tuned) is not None


def test_draft_train_records_the_tokenizer_and_every_loader_checks_it(tmp_path, capsys, monkeypatch):
    """A head of tiny-llama's sizes trained under another vocabulary loaded everywhere: --init, generate --draft,
    bench spec --draft (and a run's draft.head, test_online)."""
    from specroll.drafters.eagle import head_meta, tokenizer_fingerprint

    monkeypatch.setattr(D, "distill", recording_distill({}))
    d = tmp_path / "h"
    assert main(["draft", "train", "--model", "tiny-llama", "--dtype", "float32", "--prompts", "2", "--steps", "1",
                 "--out", str(d)]) == 0
    tok = hub.load("tiny-llama")[1]
    assert head_meta(d)["tokenizer"] == tokenizer_fingerprint(tok)
    capsys.readouterr()
    assert main(["generate", "--model", "tiny-llama", "--dtype", "float32", "--draft", str(d), "--prompt", "hi",
                 "--max-new-tokens", "2", "--draft-plan", "chain"]) == 0  # its own tokenizer: loads
    cfg_file = d / "draft_head.json"
    stored = json.loads(cfg_file.read_text())
    stored["meta"]["tokenizer"] = "0" * 16
    cfg_file.write_text(json.dumps(stored))
    msg = (f"{cfg_file}: meta.tokenizer is '{'0' * 16}' but the model's tokenizer is "
           f"'{tokenizer_fingerprint(tok)}' (a vocabulary fingerprint); this head was trained for another model "
           "(tiny-llama): distil one for this model with `specroll draft train --model M`")
    for argv, label in (
        (["draft", "train", "--model", "tiny-llama", "--dtype", "float32", "--prompts", "2", "--steps", "1",
          "--init", str(d), "--out", str(tmp_path / "h2")], "--init"),
        (["generate", "--model", "tiny-llama", "--dtype", "float32", "--draft", str(d), "--prompt", "hi",
          "--max-new-tokens", "2"], "--draft"),
        (["bench", "spec", "--model", "tiny-llama", "--draft", str(d), "--batch-sizes", "1", "--max-new-tokens", "2",
          "--out", str(tmp_path / "s.json")], "--draft"),
    ):
        assert cli_error(capsys, argv) == f"specroll: error: {label} {d}: {msg}", argv
    assert not (tmp_path / "h2").exists() and not (tmp_path / "s.json").exists()


def test_steps_0_without_a_data_cache_is_refused(tmp_path, capsys, no_work):
    """--steps 0 without --data-cache generated, trained nothing and saved an untrained head as "saved draft head"."""
    line = cli_error(capsys, ["draft", "train", "--model", "tiny-llama", "--steps", "0", "--out", str(tmp_path / "h")])
    assert line == ("specroll: error: --steps 0 trains nothing and only builds a --data-cache; pass --data-cache "
                    "FILE to keep the generations, or --steps N (N >= 1) to train a head")
    assert list(tmp_path.iterdir()) == []


def test_steps_0_with_a_data_cache_says_its_head_is_untrained(tmp_path, capsys, monkeypatch):
    seen = {}
    monkeypatch.setattr(D, "distill", recording_distill(seen))
    cache = tmp_path / "c.st"
    assert main(["draft", "train", "--model", "tiny-llama", "--dtype", "float32", "--prompts", "2", "--steps", "0",
                 "--data-cache", str(cache), "--out", str(tmp_path / "h")]) == 0
    assert seen["data_cache"] == str(cache) and seen["cfg"].steps == 0
    assert capsys.readouterr().out.splitlines()[-1] == (f"--steps 0: trained nothing; saved an untrained head to "
                                                        f"{tmp_path / 'h'} (the generations are in --data-cache {cache})")


def test_a_continued_head_keeps_its_history(tmp_path, monkeypatch, capsys):
    """--init X --out X overwrote the head's meta: steps and sequences became the last session's alone."""
    from specroll.drafters.eagle import head_meta

    monkeypatch.setattr(D, "distill", recording_distill({}))
    base = ["draft", "train", "--model", "tiny-llama", "--dtype", "float32", "--prompts", "2"]
    d, e = tmp_path / "h", tmp_path / "h2"
    assert main([*base, "--steps", "3", "--out", str(d)]) == 0
    first = head_meta(d)
    assert first["steps"] == first["total_steps"] == 3 and first["history"] == []
    assert main([*base, "--steps", "2", "--lr", "5e-4", "--init", str(d), "--out", str(d)]) == 0
    second = head_meta(d)
    assert (second["steps"], second["total_steps"], second["sequences"], second["init"]) == (2, 5, 8, str(d))
    assert second["config"]["lr"] == 5e-4  # the meta's own keys: the latest session
    assert second["history"] == [{k: v for k, v in first.items() if k != "history"}]
    assert main([*base, "--steps", "4", "--init", str(d), "--out", str(e)]) == 0  # into another directory
    third = head_meta(e)
    assert third["total_steps"] == 9 and [h["steps"] for h in third["history"]] == [3, 2]
    assert third["history"][1]["config"]["lr"] == 5e-4 and "history" not in third["history"][1]
    # a head saved before the history (its meta has steps only) or by a run's online updates (no steps)
    assert D.session_meta({"steps": 2}, {"steps": 7})["total_steps"] == 9
    assert D.session_meta({"steps": 2}, {"online": True, "updates": 3}) == {
        "steps": 2, "total_steps": 2, "history": [{"online": True, "updates": 3}]}


def test_the_recorded_eval_depth_is_the_one_scored(tmp_path, monkeypatch):
    """--unroll 4 --eval-depth 2 scored depths 1..4 (eval depth is at least --unroll) but recorded eval_depth 2."""
    assert D.DistillConfig(unroll=4, eval_depth=2).eval_depth == 4
    assert D.DistillConfig(unroll=2, eval_depth=5).eval_depth == 5
    seen = {}
    monkeypatch.setattr(D, "distill", recording_distill(seen))
    assert main(["draft", "train", "--model", "tiny-llama", "--dtype", "float32", "--prompts", "2", "--steps", "1",
                 "--unroll", "4", "--eval-depth", "2", "--out", str(tmp_path / "h")]) == 0
    from specroll.drafters.eagle import head_meta

    assert seen["cfg"].eval_depth == head_meta(tmp_path / "h")["config"]["eval_depth"] == 4


# --- export and models pull ---------------------------------------------------------------------------

@pytest.fixture
def fake_checkpoint(tmp_path, monkeypatch):
    """``export.checkpoint_policy`` returning tiny-llama itself (no training run needed to test where it writes)."""
    from specroll import export

    model, tok = hub.load("tiny-llama")
    base = hub.resolve("tiny-llama", quiet=True)
    monkeypatch.setattr(export, "checkpoint_policy", lambda ck, m=None: (tmp_path, model, tok, base))
    return export


@pytest.mark.parametrize("how", [".", "{cwd}/.", "{cwd}"])
def test_export_into_the_empty_current_directory_keeps_it(tmp_path, monkeypatch, fake_checkpoint, umask_022, how):
    """--out . failed ("PosixPath('.') has an empty name") and --out "$PWD/." removed the current directory and
    renamed a new one into its place, leaving the shell in a deleted directory."""
    cwd = tmp_path / "here"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    ino = os.stat(".").st_ino
    fake_checkpoint.export_checkpoint("ck", how.format(cwd=cwd))
    assert os.stat(".").st_ino == ino and cwd.stat().st_ino == ino and os.path.samefile(".", cwd)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in cwd.iterdir()}
    assert not [p for p in cwd.iterdir() if p.name.startswith(".")] and sorted(tmp_path.iterdir()) == [cwd]
    assert (cwd / "model.safetensors").stat().st_mode & 0o777 == umask_022
    hub.validate_hf_dir(cwd)


def test_a_failed_export_into_an_existing_empty_directory_leaves_it_empty(tmp_path, monkeypatch, fake_checkpoint):
    from specroll.models import decoder

    def full(*a, **k):
        raise OSError(28, "No space left on device", "model.safetensors")

    monkeypatch.setattr(decoder, "write_safetensors", full)
    out = tmp_path / "empty"
    out.mkdir()
    with pytest.raises(OSError, match="No space"):
        fake_checkpoint.export_checkpoint("ck", out)
    assert out.is_dir() and list(out.iterdir()) == []


def test_export_refuses_an_empty_out_or_a_non_empty_current_directory(tmp_path, capsys, monkeypatch, no_work):
    run = str(tmp_path / "run")
    line = cli_error(capsys, ["export", "--checkpoint", run, "--out", ""])
    assert line == "specroll: error: --out is empty; give the directory to write (a new one, or an existing empty one)"
    cwd = tmp_path / "here"
    cwd.mkdir()
    (cwd / "keep.txt").write_text("mine")
    monkeypatch.chdir(cwd)
    for out, where in ((".", "the current directory"), (f"{cwd}/.", "the current directory"),
                       ("..", "a folder holding the current directory")):
        line = cli_error(capsys, ["export", "--checkpoint", run, "--out", out])
        target = cwd if where == "the current directory" else tmp_path
        assert line == f"specroll: error: --out {out} is {where} ({target}), which is not empty; pick another --out"
    assert [p.name for p in cwd.iterdir()] == ["keep.txt"] and sorted(tmp_path.iterdir()) == [cwd]


def test_a_pulled_model_is_readable_by_others_like_an_export(tmp_path, umask_022):
    """safetensors writes 0600: `models pull` left the cached weights unreadable by others, while export fixed its
    own copy's mode."""
    d = hub.resolve("tiny-llama", home=tmp_path, quiet=True)
    assert (d / "model.safetensors").stat().st_mode & 0o777 == umask_022
    assert hub.cache_problem(d) is None


def test_share_mode_follows_the_umask_without_changing_it(tmp_path):
    """It read the umask by setting it to 0 and back: a file another thread made meanwhile was world-writable."""
    import os

    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x")
    os.chmod(f, 0o600)
    old = os.umask(0o027)
    try:
        seen = []
        real = os.umask
        os.umask = lambda m: seen.append(m) or real(m)  # noqa: E731 - any call would be a change, however brief
        try:
            hub.share_mode(f)
        finally:
            os.umask = real
        assert seen == [] and os.stat(f).st_mode & 0o777 == 0o640
    finally:
        os.umask(old)

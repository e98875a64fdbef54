"""`specroll generate`: what it prints is the engine's samples of the chat prompts it was given (one JSON line per
completion with its prompt, sample index, text, tokens, finish reason and log-prob; or a rich panel per sample under
its own prompt, with a summary line on stderr), the chat template renders the --system message and adds no special
tokens of the tokenizer's own, and bad options or text are one line naming what to change."""

from __future__ import annotations

import json
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch
from helpers import cli_error

from specroll.cli import main
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.generate import build_drafter, encode_chat
from specroll.models import hub

pytestmark = pytest.mark.usefixtures("one_thread", "no_debug")

PROMPTS = ["What is 2 + 3?", "Name a colour."]
SYSTEM = "Be brief."


@pytest.fixture(scope="module")
def llama():
    base = hub.resolve("tiny-llama", quiet=True)
    model, tok = hub.load(base, torch.float32)
    return model, tok, base


def prompt_args(prompts=PROMPTS) -> list[str]:
    return [a for p in prompts for a in ("--prompt", p)]


# --- encode_chat ------------------------------------------------------------------------------------

class AddsBos:
    """A tokenizer that puts a BOS before any text unless told not to (as Llama's does); ``template=False``: a
    base model's tokenizer, without a chat template."""

    BOS = 1

    def __init__(self, tok, template: bool = True):
        self.tok, self.chat_template = tok, tok.chat_template if template else None

    def apply_chat_template(self, *a, **k):
        return self.tok.apply_chat_template(*a, **k)

    def __call__(self, text, add_special_tokens=True):
        return SimpleNamespace(input_ids=[self.BOS] * add_special_tokens + self.tok(text, add_special_tokens=False).input_ids)


def test_encode_chat_renders_the_system_message_and_adds_no_special_tokens(llama):
    """The template already writes the special tokens the model expects: a tokenizer's own BOS on top of them would be
    a second one. Raw text (``raw``, or a tokenizer without a chat template) is tokenized as the tokenizer does."""
    _, tok, _ = llama
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    with_system = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    without = tok.apply_chat_template(messages[1:], add_generation_prompt=True, tokenize=False)
    assert SYSTEM in with_system and SYSTEM not in without
    plain = [tok(t, add_special_tokens=False).input_ids for t in (with_system, without)]
    bos = AddsBos(tok)
    assert encode_chat(bos, "hi", SYSTEM) == plain[0]
    assert encode_chat(bos, "hi") == encode_chat(bos, "hi", None) == plain[1]
    assert encode_chat(bos, "hi", SYSTEM, raw=True) == [AddsBos.BOS, *tok("hi", add_special_tokens=False).input_ids]
    assert encode_chat(AddsBos(tok, template=False), "hi") == [AddsBos.BOS, *tok("hi", add_special_tokens=False).input_ids]
    assert encode_chat(tok, "hi", SYSTEM) == plain[0]  # the real tokenizer


# --- what it prints ---------------------------------------------------------------------------------

def test_json_lines_are_the_engines_samples_of_each_chat_prompt(llama, capsys):
    """Row by row: the prompt it came from (not the first one), its sample index, the text without special tokens
    (a stopped row ends in the EOS), its token count, why it ended and its log-prob (the sum over its tokens), all
    of the prompts rendered with --system; an EOS of the model's ends a row."""
    model, tok, base = llama
    argv = ["generate", "--model", "tiny-llama", "--dtype", "float32", "--system", SYSTEM, "-n", "2",
            "--temperature", "1.5", "--max-new-tokens", "8", "--seed", "3", "--json", *prompt_args()]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ids = [encode_chat(tok, p, SYSTEM) for p in PROMPTS]
    outs = Engine(model, eos_ids=hub.eos_ids(tok, base), dtype=torch.float32).generate(
        ids, SamplingParams(temperature=1.5, max_new_tokens=8, seed=3), n=2)
    assert {o.finish_reason for o in outs} == {"stop", "length"}  # this seed stops a row: the EOS is no text
    want = [{"prompt": PROMPTS[o.prompt_index], "sample": o.sample_index,
             "completion": tok.decode(o.completion_ids, skip_special_tokens=True), "tokens": len(o.completion_ids),
             "finish_reason": o.finish_reason} for o in outs]
    assert [r["prompt"] for r in want] == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2 and [r["sample"] for r in want] == [0, 1] * 2
    assert [{k: r[k] for k in want[0]} for r in rows] == want
    assert all(set(r) == {*want[0], "logprob"} for r in rows)  # no draft counts without --draft
    for r, o in zip(rows, outs):
        assert r["logprob"] == pytest.approx(float(o.logprobs.sum()), abs=1e-4)


def test_panels_sit_under_their_own_prompt_and_stderr_sums_the_completions(capsys):
    """Without --json: a rule per prompt (with its text), then that prompt's panels only (sample index, token count
    and finish reason); stderr counts the completions (singular for one) and their tokens."""
    argv = ["generate", "--model", "tiny-llama", "--dtype", "float32", "-n", "2", "--max-new-tokens", "3",
            "--temperature", "0", *prompt_args()]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    first, second = out.split("prompt 1")
    assert "prompt 0" in first and PROMPTS[0] in first and PROMPTS[1] in second
    for part in (first, second):
        assert part.count("sample 0") == part.count("sample 1") == 1
        assert part.count("3 tokens, length") == 2
    assert "4 completions, 12 tokens in " in err and "tok/s, float32)" in err
    assert main([*argv[:6], "1", *argv[7:-2]]) == 0  # one prompt, -n 1
    assert "1 completion, 3 tokens in " in capsys.readouterr().err


def test_the_summary_counts_the_draft_heads_accepted_of_drafted_tokens(tmp_path, capsys):
    from specroll.drafters.eagle import head_for, save_head

    model, _ = hub.load("tiny-llama")
    save_head(head_for(model), tmp_path / "head")
    argv = ["generate", "--model", "tiny-llama", "--dtype", "float32", "-n", "3", "--max-new-tokens", "6",
            "--temperature", "1", "--draft", str(tmp_path / "head"), "--draft-plan", "chain", *prompt_args()]
    assert main([*argv, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    assert drafted > accepted  # so that the two cannot be swapped unseen
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"tokens per step, {accepted} of {drafted} drafted tokens accepted" in err, err


def test_the_draft_head_chains_6_tokens_unless_told(tmp_path, monkeypatch):
    """--draft-depth's default (6, as its help says) for both plans: the drafter's largest plan is a chain of 6
    drafts (7 tokens per step, the root included)."""
    from specroll.drafters.eagle import Plan, head_for, save_head
    from specroll.engine import profiler

    model, _ = hub.load("tiny-llama")
    save_head(head_for(model), tmp_path / "head")
    monkeypatch.setattr(profiler, "get_c_peak", lambda *a, **k: 100_000)
    for plan in ("chain", "adaptive"):
        d = build_drafter(Namespace(draft=str(tmp_path / "head"), draft_plan=plan, draft_depth=None), model,
                          Engine(model), "tiny-llama")
        assert d.sampled and d.max_plan == Plan(7, 1, 6), plan


# --- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, msg", [
    (["-n", "0"], "-n must be >= 1, got 0"),
    (["--raw", "--system", ""], "--system needs the chat template, which --raw skips: drop one of them (with --raw, "
                                "write the system text into the prompt itself)"),
    (["--draft-depth", "3"], "--draft-depth tunes speculation with a draft head: add --draft DIR, or drop it"),
    (["--prompt", "ok\udc41"], "--prompt 2 is not text: it holds an unpaired surrogate \\udc41 at character 3"),
    (["--system", "\ud83d!"], "--system is not text: it holds an unpaired surrogate \\ud83d at character 1"),
], ids=["n-0", "raw-empty-system", "depth-without-draft", "low-surrogate", "high-surrogate"])
def test_bad_options_and_text_are_refused_before_any_work(capsys, no_work, argv, msg):
    """A lone surrogate below U+DC80 is no byte Python kept from undecodable input: it is named as a surrogate."""
    assert cli_error(capsys, ["generate", "--model", "tiny-llama", "--prompt", "hi", *argv]) == f"specroll: error: {msg}"


def test_generate_that_cannot_allocate_names_the_longest_row(llama, capsys, monkeypatch):
    """The tokens a row may reach: the longest prompt's plus --max-new-tokens."""
    _, tok, _ = llama

    def oom(self, prompts, params, n=1, drafter=None):
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 78643200000 bytes.")

    monkeypatch.setattr(Engine, "generate", oom)
    prompts = ["hi", "a much longer prompt than the first one"]
    longest = max(len(tok(p).input_ids) for p in prompts)
    assert longest > min(len(tok(p).input_ids) for p in prompts)
    line = cli_error(capsys, ["generate", "--model", "tiny-llama", *prompt_args(prompts), "-n", "3",
                              "--max-new-tokens", "4", "--raw"])
    assert line == (f"specroll: error: not enough memory for 6 rows (2 prompts x -n 3) of up to {longest + 4} tokens "
                    "each; lower -n or --max-new-tokens")


def test_an_over_long_or_empty_prompt_is_named_as_given_with_the_cli_option(llama, capsys, monkeypatch):
    """The engine's errors named it by its 0-based index ("prompt 1") and the library's max_new_tokens."""
    import io

    _, tok, _ = llama
    long = "word " * 1500
    n = len(tok(long).input_ids)
    line = cli_error(capsys, ["generate", "--model", "tiny-llama", "--prompt", "hi", "--prompt", long, "--raw",
                              "--max-new-tokens", "100"])
    assert line == (f"specroll: error: --prompt 2 is {n} tokens; with --max-new-tokens 100 that is {n + 100}, over "
                    "the model's context of 2048 tokens: shorten it or lower --max-new-tokens")
    monkeypatch.setattr("sys.stdin", io.StringIO(f"a\n\nb\n{long}\n"))
    line = cli_error(capsys, ["generate", "--model", "tiny-llama", "--max-new-tokens", "100"])
    assert line.startswith("specroll: error: standard input line 4 is ") and " tokens with the chat template; " in line
    assert cli_error(capsys, ["generate", "--model", "tiny-llama", "--prompt", "hi", "--prompt", "", "--raw"]) == (
        "specroll: error: --prompt 2 tokenizes to no tokens at all; give some text")


def test_rows_the_memory_cannot_hold_are_refused_in_one_line_before_allocating(llama, capsys, monkeypatch):
    """-n 3000000 got the process killed by the OOM killer without a word (a cache the allocator grants but the
    machine cannot hold); checked here against a small stand-in figure for the free memory, never at full size."""
    from specroll.engine import engine as engine_mod

    _, tok, _ = llama
    monkeypatch.setattr(engine_mod, "available_memory", lambda: 2 ** 20, raising=False)
    monkeypatch.setattr(engine_mod.KVCache, "for_model", lambda *a: pytest.fail("allocated a cache too big"))
    n = len(tok("hi").input_ids)
    line = cli_error(capsys, ["generate", "--model", "tiny-llama", "--prompt", "hi", "--raw", "-n", "1000",
                              "--max-new-tokens", "3"])
    assert line == (f"specroll: error: not enough memory for 1000 rows (1 prompts x -n 1000) of up to {n + 3} tokens "
                    "each; lower -n or --max-new-tokens")

"""The benchmarks' own options are never silently ignored or beaten: a trailing ``key=value`` override of a key that
`bench e2e` / `bench online` set from an option (or fix by design) is refused naming the option; the overrides still
allowed are recorded (per row in `bench e2e`, which names the ones the TRL rows follow, as its --help says); an option
given for a plan (`bench spec`) or rows (`bench e2e`, `bench reuse`) that do not run is refused; options that become
config keys are checked before any work and named as the options (--draft-lr, --level)."""

from __future__ import annotations

import json

import pytest

from specroll.cli import CliError, build_parser, main

pytestmark = pytest.mark.usefixtures("one_thread", "no_debug")


def cli_error(capsys, argv: list[str]) -> tuple[str, str]:
    """Run the CLI, expect exit code 2; return its one error line and what it printed to stdout."""
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("specroll: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0].removeprefix("specroll: error: "), out


def starts_work(argv: list[str]) -> None:
    """The command accepted its arguments: it went on to load the model (which ``no_work`` refuses)."""
    with pytest.raises(AssertionError, match="started its work"):
        main(argv)


def help_text(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse's line wrapping undone


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    from specroll.drafters.eagle import head_for, save_head
    from specroll.models import hub

    d = tmp_path_factory.mktemp("head") / "head"
    save_head(head_for(hub.load("tiny-llama")[0]), d)
    return d


E2E = ["bench", "e2e", "--model", "tiny-llama", "--prompts", "2", "--prompts-per-step", "2", "--generations", "2",
       "--max-new-tokens", "4", "--steps", "1", "--dtype", "float32", "--warmup", "0"]
ONLINE = ["bench", "online", "--model", "tiny-llama", "--steps", "1", "--prompts", "2", "--prompts-per-step", "2",
          "-G", "2", "--max-new-tokens", "4", "--dtype", "float32"]
REUSE = ["bench", "reuse", "--model", "tiny-llama", "--epochs", "2", "--prompts", "2", "--prompts-per-step", "2",
         "-G", "2", "--max-new-tokens", "4"]

# --- 1. overrides of keys a benchmark sets itself -----------------------------------------------------------------

REFUSED_OVERRIDES = [
    (E2E + ["--systems", "specroll,trl", "model.name=smollm2-135m"],
     "model.name=smollm2-135m: use --model (bench e2e sets model.name from it)"),
    (E2E + ["--systems", "specroll,trl", "rollout.G=4"], "rollout.G=4: use --generations (bench e2e sets rollout.G from it)"),
    (E2E + ["rollout.max_new_tokens=8"], "rollout.max_new_tokens=8: use --max-new-tokens (bench e2e sets "
     "rollout.max_new_tokens from it)"),
    (E2E + ["train.steps=3"], "train.steps=3: use --steps or --epochs (bench e2e sets train.steps from it)"),
    (E2E + ["train.bf16=true"], "train.bf16=true: use --dtype (bench e2e sets train.bf16 from it)"),
    (E2E + ["--spec", "reuse", "reuse.mode=exact"],
     "reuse.mode=exact: use --spec and --reuse-mode (bench e2e sets reuse.mode from it)"),
    (E2E + ["--spec", "draft", "draft.head=random"],
     "draft.head=random: use --spec and --draft (bench e2e sets draft.head from it)"),
    (E2E + ["--spec", "reuse", "reuse.lenience=2"], "reuse.lenience=2: use --lenience (bench e2e sets reuse.lenience "
     "from it)"),
    (E2E + ["loss.beta=0.1"], "loss.beta=0.1: bench e2e fixes loss.beta (the TRL rows' beta = 0); drop it"),
    (E2E + ["model.dtype=bfloat16"], "model.dtype=bfloat16: bench e2e fixes model.dtype (fp32 master weights, as the "
     "TRL rows' model; --dtype bfloat16 adds bf16 autocast); drop it"),
    (ONLINE + ["draft.online=false"], "draft.online=false: bench online fixes draft.online (the online head learns, "
     "the frozen one does not); drop it"),
    (ONLINE + ["--plan", "adaptive", "draft.plan=static"], "draft.plan=static: use --plan (bench online sets draft.plan "
     "from it)"),
    (ONLINE + ["draft.head=random"], "draft.head=random: use --draft (bench online sets draft.head from it)"),
    (ONLINE + ["draft.lr=1e-3"], "draft.lr=1e-3: use --draft-lr (bench online sets draft.lr from it)"),
    (ONLINE + ["rollout.G=4"], "rollout.G=4: use -G (bench online sets rollout.G from it)"),
]


@pytest.mark.parametrize("argv, msg", REFUSED_OVERRIDES, ids=[f"{a[1]} {a[-1]}" for a, _ in REFUSED_OVERRIDES])
def test_an_override_of_a_key_the_benchmark_sets_is_refused_naming_the_option(tmp_path, capsys, no_work, argv, msg):
    line, out = cli_error(capsys, [*argv, "--out", str(tmp_path / "b.json")])
    assert line == msg
    assert out == "" and list(tmp_path.iterdir()) == []


def captured_overrides(monkeypatch, module) -> list[list[str]]:
    """The override lists ``module`` hands to ``load_bench_config``, captured as they go."""
    seen = []
    real = module.load_bench_config

    def load(overrides, options):
        seen.append(list(overrides))
        return real(overrides, options)

    monkeypatch.setattr(module, "load_bench_config", load)
    return seen


def test_every_key_a_benchmark_sets_is_refused_as_an_override(monkeypatch):
    """The refusal tables cover every key the commands set (a key added to their configs without an entry would be
    silently beaten by an override again); online keys are all its options' but the design's."""
    from specroll.bench import e2e, online
    from specroll.bench.common import override_key

    seen = captured_overrides(monkeypatch, e2e)
    args = build_parser().parse_args(E2E + ["--spec", "off,reuse,draft,reuse+draft", "--lenience", "2"])
    for spec in e2e.SPEC_MODES:
        e2e._config(args, spec)
    keys = {override_key(o) for over in seen for o in over}
    # draft.online=false goes to the rows without a head only, which follow no draft.* override (draft.online=true
    # lets the heads of the draft rows learn)
    assert not e2e.follows("draft.online", "specroll", "off") and not e2e.follows("draft.online", "specroll", "reuse")
    keys.discard("draft.online")
    assert keys <= set(e2e.OPTION_KEYS) | set(e2e.FIXED_KEYS), keys - set(e2e.OPTION_KEYS) - set(e2e.FIXED_KEYS)
    assert {"model.name", "rollout.G", "reuse.mode", "draft.head", "reuse.lenience", "loss.beta"} <= keys
    seen = captured_overrides(monkeypatch, online)
    args = build_parser().parse_args(ONLINE)
    online.bench_config(args, True)
    online.bench_config(args, False)
    keys = {override_key(o) for over in seen for o in over}
    assert keys <= set(online.OPTION_KEYS) | set(online.FIXED_KEYS), keys - set(online.OPTION_KEYS)
    assert {"draft.plan", "draft.online", "draft.head", "draft.lr"} <= keys


def test_bench_e2e_records_the_overrides_each_row_followed(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "e.json"
    over = ["train.lr=1e-4", "rollout.top_k=5", "draft.plan=static", "reuse.store_mb=64"]
    assert main(E2E + ["--systems", "specroll,trl,trl+specroll", "--spec", "off,draft", *over, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["overrides"] == over
    assert [(r["system"], r["overrides"]) for r in res["rows"]] == [
        ("specroll", ["train.lr=1e-4", "rollout.top_k=5"]),  # draft.*: the rows with a head; reuse.*: reusing rows
        ("specroll", ["train.lr=1e-4", "rollout.top_k=5", "draft.plan=static"]),
        ("trl", ["train.lr=1e-4", "rollout.top_k=5"]),  # GRPOConfig gets the learning rate and top_k
        ("trl+specroll", ["train.lr=1e-4", "rollout.top_k=5"]),  # reuse.store_mb only with --trl-reuse
    ]
    assert res["config"]["lr"] == 1e-4


def test_the_trl_rows_follow_exactly_the_overrides_help_names(tmp_path, monkeypatch, capsys):
    """``run_trl`` hands every key of ``TRL_KEYS`` (and the data section) to TRL's GRPOTrainer, rollout.top_k among
    them (the specroll rows sample with it: "x vs trl" must compare the same sampling), and not a key outside them
    (train.weight_decay); ``--help`` names those keys."""
    trl = pytest.importorskip("trl")
    from specroll.bench import e2e
    from specroll.models import hub

    class Built(Exception):
        pass

    got = {}

    def trainer(*a, args, train_dataset, **k):
        got["config"], got["prompts"] = args, list(train_dataset["prompt"])
        raise Built

    monkeypatch.setattr(trl, "GRPOTrainer", trainer)
    model_dir = hub.resolve("tiny-llama", quiet=True)

    def trl_config(*over):
        args = build_parser().parse_args(E2E + ["--systems", "trl", *over])
        with pytest.raises(Built):
            e2e.run_trl(e2e._config(args), model_dir)
        c = got["config"].to_dict()
        return {k: v for k, v in c.items() if "dir" not in k}, got["prompts"]  # output_dir: a fresh temporary one

    base, prompts = trl_config()
    fields = {"rollout.temperature": ("temperature", 0.5), "rollout.top_p": ("top_p", 0.5), "rollout.top_k": ("top_k", 5),
              "train.lr": ("learning_rate", 1e-3), "train.seed": ("seed", 7), "train.grad_clip": ("max_grad_norm", 0.5),
              "loss.eps_low": ("epsilon", 0.3)}
    assert set(fields) == set(e2e.TRL_KEYS)
    for key, (field, value) in fields.items():
        c, _ = trl_config(f"{key}={value}")
        assert c[field] == value != base[field], key
        assert {k for k in c if c[k] != base[k]} == {field}, key
    assert trl_config("train.weight_decay=0.1") == (base, prompts)  # a specroll-only key
    assert trl_config("data.level=3")[1] != prompts  # the data section reaches TRL's dataset
    text = help_text(["bench", "e2e"], capsys)
    for key in (*e2e.TRL_KEYS, *e2e.TRL_REUSE_KEYS, *(f"{s}.*" for s in e2e.TRL_SECTIONS)):
        assert key in text, key
    assert "each row's JSON lists the overrides it followed" in text


def test_config_errors_name_the_options_that_set_the_keys():
    """``load_bench_config``: an error about a key an option sets names the option; an error about an override the
    user typed keeps that override in front."""
    from specroll.bench.common import load_bench_config

    options = {"data.level": "--level", "train.prompts_per_step": "--prompts-per-step"}
    with pytest.raises(CliError, match=r"^--level must be one of \[1, 2, 3, 4, 5, 6\], got 0$"):
        load_bench_config(["data.level=0"], options)
    with pytest.raises(CliError, match=r"^override 'train.mini_batches=4': train.mini_batches \(4\) cannot exceed "
                                       r"--prompts-per-step \(2\)"):
        load_bench_config(["train.prompts_per_step=2", "train.mini_batches=4"], options)
    with pytest.raises(ValueError, match=r"^override 'rollout.G=1': rollout.G must be >= 2"):
        load_bench_config(["rollout.G=1"], options)


# --- 2. bench spec: options of plans that do not run --------------------------------------------------------------

PLAN_ERRORS = [
    (["--plan", "static", "--chain-stop", "0,0.15"], "--chain-stop applies to the chain, adaptive-chain and "
     "tuned-chain plans only, not to --plan static: add one of them to --plan or drop --chain-stop"),
    (["--plan", "static", "--verify", "token"], "--verify applies to the chain, adaptive-chain and tuned-chain plans "
     "only, not to --plan static: add one of them to --plan or drop --verify"),
    (["--plan", "static,adaptive", "--verify", "block"], "--verify applies to the chain, adaptive-chain and "
     "tuned-chain plans only, not to --plan static,adaptive: add one of them to --plan or drop --verify"),
    (["--plan", "static", "--c-peak", "7"], "--c-peak applies to the adaptive, adaptive-chain, tuned and tuned-chain "
     "plans only, not to --plan static: add one of them to --plan or drop --c-peak"),
    (["--plan", "chain", "--k", "3"], "--k applies to the static, adaptive and tuned plans only, not to --plan chain: "
     "add one of them to --plan or drop --k"),
    (["--plan", "chain", "--k", "4"], "--k applies to the static, adaptive and tuned plans only, not to --plan chain: "
     "add one of them to --plan or drop --k"),  # its default value, given: as ignored as any other
    (["--plan", "chain", "--n-verify", "8"], "--n-verify applies to the static plan only, not to --plan chain: add "
     "static to --plan or drop --n-verify"),
    (["--plan", "adaptive,tuned-chain", "--n-verify", "8"], "--n-verify applies to the static plan only, not to "
     "--plan adaptive,tuned-chain: add static to --plan or drop --n-verify"),
    (["--plan", "tuned-chain", "--k", "2"], "--k applies to the static, adaptive and tuned plans only, not to --plan "
     "tuned-chain: add one of them to --plan or drop --k"),
    (["--plan", "static", "--verify", "joint"], "--verify 'joint': choose from token, block"),  # the value first
    (["--plan", "chain", "--k", "0"], "--k must be >= 1, got 0"),
]


@pytest.mark.parametrize("extra, msg", PLAN_ERRORS, ids=[" ".join(e) for e, _ in PLAN_ERRORS])
def test_bench_spec_refuses_an_option_of_plans_that_do_not_run(tmp_path, capsys, no_work, extra, msg):
    line, _ = cli_error(capsys, ["bench", "spec", "--model", "tiny-llama", "--draft", str(tmp_path / "head"), *extra,
                                 "--out", str(tmp_path / "b.json")])
    assert line == msg
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra", [
    ["--plan", "static"], ["--plan", "chain"], ["--plan", "tuned-chain", "--c-peak", "8", "--chain-stop", "0.1"],
    ["--plan", "static,chain", "--n-verify", "4", "--k", "2", "--verify", "token"],
    ["--plan", "adaptive", "--k", "2", "--c-peak", "8"],
], ids=lambda e: " ".join(e))
def test_bench_spec_takes_the_options_of_its_plans(tmp_path, no_work, extra):
    starts_work(["bench", "spec", "--model", "tiny-llama", "--draft", str(tmp_path / "head"), *extra,
                 "--out", str(tmp_path / "b.json")])


def test_bench_spec_tree_rows_carry_no_chain_settings(tmp_path, head_dir, capsys):
    """A tree plan is run once per head-weights setting, whatever --chain-stop / --verify list the chain plans get,
    and its rows record no chain stop or verification; defaults not given still apply (n_verify 16, k 4)."""
    out = tmp_path / "s.json"
    assert main(["bench", "spec", "--model", "tiny-llama", "--draft", str(head_dir), "--batch-sizes", "1",
                 "--max-new-tokens", "4", "--dtype", "float32", "--plan", "static,chain", "--chain-stop", "0,0.15",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["plan"], r["chain_stop"], r["verify"]) for r in rows] == [
        ("static", None, None), ("chain", 0.0, "block"), ("chain", 0.15, "block")]
    assert rows[0]["plan_max"] == {"n_verify": 16, "k": 4, "depth": 5}
    printed = capsys.readouterr().out
    assert "static   vanilla" in printed and "static   stop" not in printed and "chain    stop 0.15" in printed


def test_bench_spec_help_states_the_defaults_of_its_plan_options(capsys):
    """The plan options' parser defaults are None (a given option is told apart from one left alone); --help states
    the values they take when not given (``PLAN_OPTIONS``)."""
    from specroll.bench.spec import PLAN_OPTIONS

    args = build_parser().parse_args(["bench", "spec", "--draft", "d"])
    assert all(getattr(args, name) is None for name, _, _ in PLAN_OPTIONS.values())
    text = help_text(["bench", "spec"], capsys)
    assert [PLAN_OPTIONS[o][2] for o in ("--n-verify", "--k", "--chain-stop", "--verify")] == [16, 4, "0", "block"]
    for said in ("static plan: tree nodes verified per row, root included (default 16)",
                 "static, adaptive and tuned plans: top-K expansion per level (default 4)",
                 "default 0 = full depth)", "block (jointly; the default)"):
        assert said in text, said


# --- 3. bench e2e / bench reuse: options of rows that do not run --------------------------------------------------

ROW_ERRORS = [
    (["--systems", "specroll", "--spec", "off", "--reuse-mode", "exact"],
     "--reuse-mode exact applies to the specroll reuse rows; add reuse or reuse+draft to --spec"),
    (["--systems", "specroll", "--spec", "off", "--reuse-mode", "lenient"],
     "--reuse-mode lenient applies to the specroll reuse rows; add reuse or reuse+draft to --spec"),
    (["--systems", "specroll", "--spec", "off,reuse", "--draft", "{head}"],
     "--draft {head} applies to the specroll draft rows; add draft or reuse+draft to --spec"),
    (["--systems", "trl", "--spec", "draft"], "--spec draft applies to the specroll rows; add specroll to --systems"),
    (["--systems", "trl", "--order", "sequential"],
     "--order sequential applies to the specroll rows; add specroll to --systems"),
    (["--systems", "trl", "--draft", "random"], "--draft random applies to the specroll draft rows; add specroll to "
     "--systems (and draft or reuse+draft to --spec)"),
    (["--systems", "specroll", "--spec", "reuse", "--reuse-mode", "exact", "--lenience", "3"],
     "--lenience 3.0 applies to lenient reuse (--spec reuse or reuse+draft with --reuse-mode lenient, or trl+specroll "
     "with --trl-reuse lenient); no row here reuses leniently: drop it"),
    (["--systems", "specroll,trl+specroll", "--trl-reuse", "exact", "--lenience", "3"],
     "--lenience 3.0 applies to lenient reuse (--spec reuse or reuse+draft with --reuse-mode lenient, or trl+specroll "
     "with --trl-reuse lenient); no row here reuses leniently: drop it"),
]


@pytest.mark.parametrize("extra, msg", ROW_ERRORS, ids=[" ".join(e) for e, _ in ROW_ERRORS])
def test_bench_e2e_refuses_an_option_of_rows_that_do_not_run(tmp_path, capsys, no_work, head_dir, extra, msg):
    line, _ = cli_error(capsys, E2E + [a.format(head=head_dir) for a in extra] + ["--out", str(tmp_path / "e.json")])
    assert line == msg.format(head=head_dir)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra", [
    ["--systems", "specroll", "--spec", "reuse", "--reuse-mode", "exact"],
    ["--systems", "specroll", "--spec", "reuse+draft", "--lenience", "2", "--draft", "random", "--order", "sequential"],
    ["--systems", "trl+specroll", "--trl-reuse", "lenient", "--lenience", "2"],
    ["--systems", "trl+specroll", "--trl-reuse", "off"],
], ids=lambda e: " ".join(e))
def test_bench_e2e_takes_the_options_of_its_rows(extra):
    from specroll.bench import e2e

    e2e.check_args(build_parser().parse_args(E2E + extra))


def test_bench_e2e_records_no_setting_for_rows_that_did_not_run(tmp_path):
    out = tmp_path / "e.json"
    assert main(E2E + ["--systems", "specroll", "--spec", "off", "--out", str(out)]) == 0
    c = json.loads(out.read_text())["config"]
    assert (c["spec"], c["order"], c["draft"], c["reuse_mode"], c["lenience"]) == (["off"], "interleaved", None, None,
                                                                                   None)
    assert main(E2E + ["--systems", "specroll", "--spec", "reuse", "--out", str(out)]) == 0
    c = json.loads(out.read_text())["config"]
    assert (c["spec"], c["draft"], c["reuse_mode"], c["lenience"]) == (["reuse"], None, "lenient", pytest.approx(1.6487,
                                                                                                               abs=1e-3))


def test_bench_reuse_refuses_lenience_without_the_lenient_mode(tmp_path, capsys, no_work):
    line, _ = cli_error(capsys, REUSE + ["--modes", "exact", "--lenience", "2", "--out", str(tmp_path / "r.json")])
    assert line == "--lenience 2 applies to the lenient mode; add lenient to --modes"
    starts_work(REUSE + ["--modes", "lenient", "--lenience", "2", "--out", str(tmp_path / "r.json")])
    starts_work(REUSE + ["--modes", "exact", "--out", str(tmp_path / "r.json")])  # the default l values: not given
    assert build_parser().parse_args(REUSE).lenience is None


# --- 4. options that become config keys, checked before any work --------------------------------------------------

@pytest.mark.parametrize("argv, msg", [
    (ONLINE + ["--draft-lr", "-1"], "--draft-lr must be a number > 0 or auto, got -1.0"),
    (ONLINE + ["--draft-lr", "fast"], "--draft-lr must be a number or auto, got 'fast'"),
    (ONLINE + ["--level", "0"], "--level must be one of [1, 2, 3, 4, 5, 6], got 0"),
    (REUSE + ["--level", "0"], "--level must be one of [1, 2, 3, 4, 5, 6], got 0"),
    (E2E + ["--model", ""], "--model must not be empty"),
], ids=["online-draft-lr", "online-draft-lr-text", "online-level", "reuse-level", "e2e-model"])
def test_options_that_become_config_keys_are_named_before_any_work(tmp_path, capsys, no_work, argv, msg):
    line, out = cli_error(capsys, [*argv, "--out", str(tmp_path / "b.json")])
    assert line == msg
    assert out == "" and list(tmp_path.iterdir()) == []  # no banner, no JSON


# --- 5. prompt counts and list options, checked before any work ---------------------------------------------------

@pytest.mark.parametrize("argv, msg", [
    (E2E + ["--prompts-per-step", "3"], "--prompts-per-step 3 exceeds --prompts 2: a step would repeat prompts and "
     "TRL's GRPOTrainer would take no step; give --prompts-per-step <= --prompts"),
    (E2E + ["--prompts-per-step", "3", "--systems", "specroll", "--epochs", "1"], "--prompts-per-step 3 exceeds "
     "--prompts 2: a step would repeat prompts and TRL's GRPOTrainer would take no step; give --prompts-per-step <= "
     "--prompts"),
    (REUSE + ["--prompts-per-step", "3"], "--prompts-per-step 3 exceeds --prompts 2: a step would repeat prompts, so "
     "an epoch would not be one pass over them; give --prompts-per-step <= --prompts"),
], ids=["e2e", "e2e-specroll-only", "reuse"])
def test_more_prompts_per_step_than_prompts_is_refused(tmp_path, capsys, no_work, argv, msg):
    """`bench e2e`: TRL's GRPOTrainer made no batch of 3 out of 2 prompts and took no step, after every specroll
    row had run; `bench reuse`: a step repeating prompts breaks its one pass over the prompts per epoch."""
    line, out = cli_error(capsys, [*argv, "--out", str(tmp_path / "b.json")])
    assert line == msg
    assert out == "" and list(tmp_path.iterdir()) == []


E2E_EPOCHS = [a for a in E2E if a not in ("--steps", "1")] + ["--epochs", "1"]
WHOLE_EPOCHS = ("--prompts 3 is not a multiple of --prompts-per-step 2: an epoch's last step would take prompts from "
                "the next epoch, so an epoch would not be one pass over them; give --prompts a multiple of "
                "--prompts-per-step (e.g. 2)")


@pytest.mark.parametrize("argv, msg", [
    (E2E_EPOCHS + ["--prompts", "3"], WHOLE_EPOCHS + " (or give --steps)"),
    (REUSE + ["--prompts", "3"], WHOLE_EPOCHS),
], ids=["e2e", "reuse"])
def test_epochs_of_prompts_not_divisible_by_prompts_per_step_are_refused(tmp_path, capsys, no_work, argv, msg):
    """The trainer draws prompts from one shuffled pass after another: with 3 prompts at 2 per step, an epoch of
    2 steps drew 4 prompts, one of them twice, and its last step took a prompt of the next pass, so the epochs
    compared were not passes over the prompts."""
    line, out = cli_error(capsys, [*argv, "--out", str(tmp_path / "b.json")])
    assert line == msg
    assert out == "" and list(tmp_path.iterdir()) == []


def test_bench_e2e_counts_steps_by_steps_for_any_prompt_count():
    from specroll.bench import e2e

    e2e.check_args(build_parser().parse_args(E2E + ["--prompts", "3"]))  # --steps 1: no epochs to keep whole
    assert e2e.n_steps(build_parser().parse_args(E2E_EPOCHS + ["--prompts", "4", "--epochs", "3"])) == 6


def test_bench_e2e_takes_as_many_prompts_per_step_as_prompts_or_the_whole_set():
    from specroll.bench import e2e

    e2e.check_args(build_parser().parse_args(E2E + ["--prompts-per-step", "2"]))
    e2e.check_args(build_parser().parse_args(E2E + ["--prompts", "0", "--prompts-per-step", "3"]))  # --steps 1 given


SPEC = ["bench", "spec", "--model", "tiny-llama", "--draft", "head"]
LIST_ERRORS = [
    (["bench", "engine", "--model", "tiny-llama", "--batch-sizes", "2,1,2"],
     "--batch-sizes lists a batch size twice, got 2,1,2; give each once"),
    (["bench", "engine", "--model", "tiny-llama", "--batch-sizes", "1,,2"],
     "--batch-sizes must be a comma-separated list of positive integers, got '1,,2'"),
    (["bench", "engine", "--model", "tiny-llama", "--batch-sizes", "1,2,"],
     "--batch-sizes must be a comma-separated list of positive integers, got '1,2,'"),
    (SPEC + ["--batch-sizes", "4,4"], "--batch-sizes lists a batch size twice, got 4,4; give each once"),
    (SPEC + ["--plan", "chain,chain"], "--plan lists a plan twice, got chain,chain; give each once"),
    (SPEC + ["--plan", "static,,chain"], "--plan '' is not available here; known plans: ['adaptive', "
     "'adaptive-chain', 'chain', 'static', 'tuned', 'tuned-chain']"),
    (SPEC + ["--head-weights", "bf16,bf16"], "--head-weights lists a setting twice, got bf16,bf16; give each once"),
    (SPEC + ["--plan", "chain", "--verify", "token,token"], "--verify lists a rule twice, got token,token; give each "
     "once"),
    (SPEC + ["--plan", "chain", "--chain-stop", "0,0.0"], "--chain-stop lists a stop twice, got 0,0; give each once"),
    (SPEC + ["--plan", "chain", "--chain-stop", "0,,0.15"], "--chain-stop must be a comma-separated list of numbers "
     "in [0, 1), e.g. 0,0.15, got '0,,0.15'"),
    (REUSE + ["--modes", "exact,exact"], "--modes lists a mode twice, got exact,exact; give each once"),
    (REUSE + ["--modes", "lenient,"], "--modes must be a comma-separated subset of ['lenient', 'exact', 'off'], got "
     "'lenient,'"),
    (REUSE + ["--lenience", "2,2"], "--lenience lists an l value twice, got 2,2; give each once"),
    (E2E + ["--spec", "off,,reuse"], "--spec must be a comma-separated list of distinct modes from ['off', 'reuse', "
     "'draft', 'reuse+draft'], got 'off,,reuse'"),
]


@pytest.mark.parametrize("argv, msg", LIST_ERRORS, ids=[" ".join(a[1:2] + a[-2:]) for a, _ in LIST_ERRORS])
def test_bench_list_options_refuse_a_repeated_or_empty_item(tmp_path, capsys, no_work, argv, msg):
    """As `specroll profile --batches 1,1` is refused: a value given twice would run (and record) its rows twice,
    and an empty item ("1,,2") is a typo, not "1,2"."""
    line, out = cli_error(capsys, [*argv, "--out", str(tmp_path / "b.json")])
    assert line == msg
    assert out == "" and list(tmp_path.iterdir()) == []



# --- 6. values out of range, checked before any work ----------------------------------------------------------------

ENGINE = ["bench", "engine", "--model", "tiny-llama"]
RANGE_ERRORS = [
    (ENGINE + ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (ENGINE + ["--batch-sizes", "1,0"], "--batch-sizes must be a comma-separated list of positive integers, got '1,0'"),
    (REUSE + ["--epochs", "1"], "--epochs must be >= 2 (epoch 1 has nothing to reuse), got 1"),
    (REUSE + ["--temperature", "inf"], "--temperature must be a finite number > 0, got inf"),
    (REUSE + ["--lenience", "0"], "--lenience must be a comma-separated list of numbers > 0 (inf allowed), got '0'"),
    (REUSE + ["--modes", "exact", "--lenience", "2,0"], "--lenience must be a comma-separated list of numbers > 0 "
     "(inf allowed), got '2,0'"),  # the bad value named first, before the mode it does not apply to
    (SPEC + ["--plan", "chain", "--chain-stop", "1"], "--chain-stop must be a comma-separated list of numbers in "
     "[0, 1), e.g. 0,0.15, got '1'"),
]


@pytest.mark.parametrize("argv, msg", RANGE_ERRORS, ids=[" ".join(a[1:2] + a[-2:]) for a, _ in RANGE_ERRORS])
def test_bench_values_out_of_range_are_refused_before_any_work(tmp_path, capsys, no_work, argv, msg):
    line, out = cli_error(capsys, [*argv, "--out", str(tmp_path / "b.json")])
    assert line == msg
    assert out == "" and list(tmp_path.iterdir()) == []

def test_bench_online_names_its_acceptance_conditions_without_internal_references():
    from specroll.bench.online import conditions_line

    c = {"never_below_start": True, "ends_at_target": False, "frozen_ends_lower": True, "all": False,
         "end_target": 3.0, "level": 0.05}
    line = conditions_line(c)
    assert line.startswith("acceptance conditions: online head never below its start yes, ends >= 3 no, ")
    assert "issue" not in line and line.endswith("not all met")

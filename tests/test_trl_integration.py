"""``specroll.integrations.trl``: specroll's engine as TRL GRPOTrainer's ``rollout_func``.

Against a plain HF forward (the returned log-probs are the model's own, or the sampling distribution's with
temperature / top-k / top-p), against TRL itself (its tokenization, a real two-step GRPO run with the default
fused AdamW, after whose optimizer steps the rollouts must use the new weights), and the one-line errors of
unsupported settings."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from specroll.integrations.trl import group_spans, specroll_rollout_func  # noqa: E402
from specroll.models.tiny import tiny_hf_model, tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

CHAT = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(3)]


def length_reward(completions, **kw):
    """Varies across a group, so GRPO's advantages (and the weight updates) are not zero."""
    return [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]


def make_trainer(tmp_path, arch="llama", prompts=CHAT, model=None, rollout_func=None, **kw):
    args = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                max_completion_length=10, max_steps=2, use_cpu=True, report_to="none", save_strategy="no",
                logging_steps=1, disable_tqdm=True, gradient_checkpointing=False, seed=3,
                bf16=False)  # TRL's default bf16 autocast would make the HF reference forward bf16
    args.update(kw)
    model = model if model is not None else tiny_hf_model(arch, seed=1).train()
    return GRPOTrainer(model=model, reward_funcs=[length_reward], args=GRPOConfig(**args),
                       train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                       processing_class=tiny_tokenizer(), rollout_func=rollout_func)


def repeat(prompts, G):
    return [p for p in prompts for _ in range(G)]


@torch.no_grad()
def hf_logits(model, prompt_ids, completion_ids):
    """The HF model's next-token logits at each completion position, from one plain forward."""
    ids = torch.tensor([prompt_ids + completion_ids])
    return model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()


def hf_token_logprobs(model, prompt_ids, completion_ids):
    lp = torch.log_softmax(hf_logits(model, prompt_ids, completion_ids), -1)
    return lp[torch.arange(len(completion_ids)), torch.tensor(completion_ids)]


def max_logprob_error(model, out):
    return max(float((hf_token_logprobs(model, p, c) - torch.tensor(lp)).abs().max())
               for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]))


# --- against a plain HF forward ----------------------------------------------------------------

@pytest.mark.parametrize("arch,chat", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_logprobs_are_the_models_own_and_prompts_tokenized_as_trl(tmp_path, arch, chat):
    prompts = CHAT if chat else [m[0]["content"] for m in CHAT]
    tr = make_trainer(tmp_path, arch, prompts)
    rf = specroll_rollout_func(dtype="float32")
    batch = repeat(prompts[:2], 2)
    out = rf(batch, tr)
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs"}  # other keys would reach the reward functions
    assert len(out["completion_ids"]) == len(out["logprobs"]) == len(out["prompt_ids"]) == len(batch)
    assert out["prompt_ids"] == tr._tokenize_prompts(batch)[0]  # exactly TRL's own tokens
    for c, lp in zip(out["completion_ids"], out["logprobs"]):
        assert 1 <= len(c) == len(lp) <= 10
    assert max_logprob_error(tr.model, out) < 1e-4


def test_logprobs_are_the_sampling_distributions_with_temperature_top_k_top_p(tmp_path):
    tr = make_trainer(tmp_path, temperature=0.7, top_p=0.8, top_k=40, max_completion_length=8)
    out = specroll_rollout_func(dtype="float32")(repeat(CHAT[:2], 2), tr)
    worst, gap = 0.0, 0.0
    for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        x = hf_logits(tr.model, p, c) / 0.7
        kth = x.topk(40, -1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
        probs, order = torch.softmax(x, -1).sort(-1, descending=True)
        drop = (probs.cumsum(-1) - probs) >= 0.8  # outside the nucleus: the mass before the token reached top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -math.inf)
        ref = torch.log_softmax(x, -1)[torch.arange(len(c)), torch.tensor(c)]
        assert torch.isfinite(ref).all()  # every sampled token is inside top-k and the nucleus
        worst = max(worst, float((ref - torch.tensor(lp)).abs().max()))
        gap = max(gap, float((hf_token_logprobs(tr.model, p, c) - torch.tensor(lp)).abs().max()))
    assert worst < 1e-4
    assert gap > 0.05  # not the policy's T = 1 log-probs


def test_completions_end_with_the_stop_token_as_trl_keeps_it(tmp_path):
    model = tiny_hf_model("llama", seed=1)
    tok = tiny_tokenizer()
    ids = tok.apply_chat_template(CHAT[0], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    likely = model(input_ids=torch.tensor([ids])).logits[0, -1].topk(3).indices.tolist()  # 28% of the first draw
    model.generation_config.eos_token_id = [2, *likely]  # TRL stops on the tokenizer's eos and these
    tr = make_trainer(tmp_path, model=model.train(), max_completion_length=12)
    assert set(likely) <= set(tr.eos_token_ids)
    out = specroll_rollout_func(dtype="float32")(repeat(CHAT[:1], 32), tr)
    stops = set(tr.eos_token_ids)
    ended = 0
    for c in out["completion_ids"]:
        assert not stops & set(c[:-1])  # nothing after a stop token
        if c[-1] in stops:
            ended += 1
        else:
            assert len(c) == 12
    assert ended > 0


def test_groups_seeds_and_eval_generations(tmp_path):
    assert group_spans(["a", "a", "b", "b"], 2) == [(0, 2), (2, 2)]
    assert group_spans(["a", "b", "b", "c"], 2) == [(0, 1), (1, 2), (3, 1)]  # a slice cutting two groups
    assert group_spans(["a"] * 5, 2) == [(0, 2), (2, 2), (4, 1)]
    tr = make_trainer(tmp_path, num_generations_eval=3)
    rf = specroll_rollout_func(dtype="float32")
    batch = repeat(CHAT[:2], 2)
    a, b = rf(batch, tr), rf(batch, tr)
    assert a["completion_ids"] != b["completion_ids"]  # a fresh seed per call
    assert len({tuple(c) for c in a["completion_ids"][:2]}) == 2  # and per sample within a group
    tr.model.eval()  # TRL's eval mode: each prompt repeated num_generations_eval times
    out = rf(repeat(CHAT[:1], 3) + CHAT[1:2], tr)  # the second group cut short, as at a slice's end
    assert len(out["completion_ids"]) == 4 and out["prompt_ids"][3] != out["prompt_ids"][0]
    assert max_logprob_error(tr.model, out) < 1e-4


def test_reuse_lenient_inf_reuses_every_token_with_current_logprobs(tmp_path):
    tr = make_trainer(tmp_path)
    rf = specroll_rollout_func(dtype="float32", reuse="lenient", lenience=math.inf)
    batch = repeat(CHAT[:2], 2)
    first = rf(batch, tr)
    assert rf.stats["spec/reuse_ratio"] == 0.0
    second = rf(batch, tr)
    assert second["completion_ids"] == first["completion_ids"] and rf.stats["spec/reuse_ratio"] == 1.0
    assert max_logprob_error(tr.model, second) < 1e-4
    tr.model.eval()  # no reuse when evaluating
    rf(batch, tr)
    assert "spec/reuse_ratio" not in rf.stats


@pytest.fixture
def trainer(tmp_path):
    return make_trainer(tmp_path)


# --- a real GRPO run -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """Two GRPO steps (TRL's default optimizer, fused AdamW) with the rollout function; each call records its
    prompts, output and the largest gap between the returned log-probs and a plain forward of the model *as it
    is at that call*."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("grpo")
    rf = specroll_rollout_func(dtype="float32", reuse="exact")
    calls = []

    def recorded(prompts, trainer):
        out = rf(prompts, trainer)
        calls.append({"prompts": prompts, "out": out, "step": trainer.state.global_step,
                      "err": max_logprob_error(trainer.model, out)})
        return out

    tr = make_trainer(tmp, prompts=CHAT[:2], rollout_func=recorded, learning_rate=3e-2)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    tr.train()
    return tr, rf, calls, before


def test_grpo_trainer_runs_two_steps_with_one_completion_per_prompt_entry(grpo_run):
    tr, rf, calls, _ = grpo_run
    assert tr.state.global_step == 2 and [c["step"] for c in calls] == [0, 1]
    for c in calls:
        prompts, out = c["prompts"], c["out"]
        assert len(prompts) == 4 and prompts[0] == prompts[1] and prompts[2] == prompts[3]  # TRL repeats, G = 2
        assert len(out["completion_ids"]) == len(out["logprobs"]) == len(out["prompt_ids"]) == len(prompts)
        assert out["prompt_ids"][0] == out["prompt_ids"][1] != out["prompt_ids"][2]
    logged = [h for h in tr.state.log_history if "reward" in h]
    assert len(logged) == 2 and all(h["num_tokens"] > 0 for h in logged)
    assert "specroll/rollout_s" in logged[0] and "specroll/reuse_ratio" in logged[1]


def test_rollouts_after_an_optimizer_step_use_the_new_weights(grpo_run):
    tr, rf, calls, before = grpo_run
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in tr.model.named_parameters())
    assert moved > 1e-3  # the steps changed the weights visibly
    assert calls[1]["err"] < 1e-4  # the rollout after step 1 sampled from the updated model
    out = rf(repeat(CHAT[:2], 2), tr)  # and after step 2
    assert max_logprob_error(tr.model, out) < 1e-4
    hf = tr.model.model.layers[0]
    assert torch.equal(rf.decoder.layers[0].qkv.weight[: hf.self_attn.q_proj.weight.shape[0]],
                       hf.self_attn.q_proj.weight.detach())
    assert rf.engine.policy_version == 3  # one sync per step seen: 0, 1, 2


def test_sync_picks_up_weights_changed_outside_an_optimizer_step(trainer):
    rf = specroll_rollout_func(dtype="float32")
    batch = repeat(CHAT[:2], 2)
    rf(batch, trainer)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.data.mul_(1.5)  # in place through .data: no version bump, and global_step has not moved
    assert max_logprob_error(trainer.model, rf(batch, trainer)) > 1e-3  # the documented limit: no step, no sync
    rf.sync(trainer)
    assert max_logprob_error(trainer.model, rf(batch, trainer)) < 1e-4


def test_weights_loaded_in_place_or_a_new_training_state_resync_without_a_step(trainer, monkeypatch):
    """Two ways the weights change while ``global_step`` stays put: an in-place load (transformers'
    ``load_best_model_at_end``, then ``evaluate()``) and a second ``train()``, whose new state restarts at the step
    the function last synced at. The decoder kept its fused q/k/v and gate/up copies from before (3-6 nats off)."""
    import copy

    rf = specroll_rollout_func(dtype="float32")
    batch = repeat(CHAT[:2], 2)
    rf(batch, trainer)
    best = {k: v * 1.5 for k, v in trainer.model.state_dict().items()}
    trainer.model.load_state_dict(best)  # in place (param.copy_): version counters move, global_step does not
    assert max_logprob_error(trainer.model, rf(batch, trainer)) < 1e-4
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.data.mul_(0.8)  # through .data: no version bump
    monkeypatch.setattr(trainer, "state", copy.deepcopy(trainer.state))  # a new train(): a new state, same step
    assert max_logprob_error(trainer.model, rf(batch, trainer)) < 1e-4


# --- errors ------------------------------------------------------------------------------------------

def one_line_error(rf, prompts, tr, match):
    with pytest.raises(ValueError, match=match) as e:
        rf(prompts, tr)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("specroll rollout_func: ")
    assert e.value.__cause__ is None and (e.value.__context__ is None or e.value.__suppress_context__)


@pytest.mark.parametrize("where,name,value,match", [
    ("args", "repetition_penalty", 1.2, "repetition_penalty"),
    ("args", "min_p", 0.1, "min_p"),
    ("args", "generation_kwargs", {"num_beams": 2}, "generation_kwargs"),
    ("args", "max_completion_length", None, "max_completion_length"),
    ("args", "top_p", 1.5, "top_p"),
    ("trainer", "use_vllm", True, "use_vllm"),
    ("trainer", "tools", [length_reward], "tools"),
    ("trainer", "environment_factories", {None: object}, "environment_factory"),
    ("args", "repetition_penalty", 0.8, "repetition_penalty"),  # below 1.0 is no more supported than above
    ("args", "max_completion_length", 0, "max_completion_length must be a positive integer"),
    ("args", "temperature", 0.0, "temperature must be > 0"),
    ("args", "temperature", math.inf, "temperature must be > 0"),
    ("args", "use_vllm", True, "use_vllm"),
    ("trainer", "is_fsdp_enabled", True, "DeepSpeed / FSDP"),
    ("trainer", "is_deepspeed_enabled", True, "DeepSpeed / FSDP"),
    ("trainer", "_is_vlm", True, "multimodal models"),
])
def test_unsupported_trl_settings_are_one_line_errors(trainer, monkeypatch, where, name, value, match):
    monkeypatch.setattr(trainer.args if where == "args" else trainer, name, value)
    one_line_error(specroll_rollout_func(dtype="float32"), repeat(CHAT[:2], 2), trainer, match)


def test_bad_inputs_are_one_line_errors(trainer, tmp_path, monkeypatch):
    rf = specroll_rollout_func(dtype="float32")
    image = [{"role": "user", "content": [{"type": "image", "image": None}, {"type": "text", "text": "hi"}]}]
    one_line_error(rf, [image, image], trainer, "multimodal")
    one_line_error(rf, [CHAT[0], "plain text"], trainer, "all strings or all")
    one_line_error(rf, "What is 1 + 1?", trainer, "prompts must be a list, got str")  # not one prompt per character
    one_line_error(rf, [[{"role": "user"}]] * 2, trainer, r"not a \{'role', 'content'\} dict")
    monkeypatch.setattr(trainer.processing_class, "image_processor", object(), raising=False)  # a multimodal processor
    one_line_error(rf, repeat(CHAT[:1], 2), trainer, "multimodal models are not supported")
    monkeypatch.undo()
    one_line_error(rf, repeat(CHAT[:1], 2), object(), "GRPOTrainer")
    monkeypatch.setattr(trainer.args, "max_completion_length", 2047)
    one_line_error(rf, repeat(CHAT[:1], 2), trainer, "exceeds the model's context")
    monkeypatch.undo()
    trainer.model.peft_config = {"default": None}
    one_line_error(rf, repeat(CHAT[:1], 2), trainer, "PEFT")
    del trainer.model.peft_config
    biased = make_trainer(tmp_path, model=tiny_hf_model("llama", mlp_bias=True).train())
    one_line_error(rf, repeat(CHAT[:1], 2), biased, "mlp_bias=true is not supported")
    mistral = make_trainer(tmp_path, model=tiny_hf_model_mistral().train())
    one_line_error(specroll_rollout_func(), repeat(CHAT[:1], 2), mistral, "'mistral' is not supported")
    for kw, match in [({"reuse": "yes"}, "reuse"), ({"dtype": "float16"}, "dtype"),
                      ({"reuse": "lenient", "lenience": 0.0}, "lenience"), ({"seed": "1"}, "seed"),
                      ({"seed": True}, "seed must be an int")]:
        with pytest.raises(ValueError, match=match):
            specroll_rollout_func(**kw)


@pytest.mark.parametrize("change,match", [
    ("meta", "specroll's engine runs on the CPU"),
    ("float16", "weights are torch.float16"),
    ("extra", r"parameters the specroll decoder does not model \(model\.extra\)"),
    ("shape", r"norm\.weight would be \[5\] but its config implies \[64\]"),
])
def test_models_the_decoder_cannot_mirror_are_one_line_errors(trainer, change, match):
    from torch import nn

    m = trainer.model.model
    h = m.norm.weight.shape[0]
    assert h == 64  # the hidden size the message names
    if change == "meta":
        m.norm.weight = nn.Parameter(torch.ones(h, device="meta"))
    elif change == "float16":
        m.norm.weight = nn.Parameter(torch.ones(h, dtype=torch.float16))
    elif change == "extra":
        m.register_parameter("extra", nn.Parameter(torch.zeros(3)))
    else:
        m.norm.weight = nn.Parameter(torch.ones(5))
    one_line_error(specroll_rollout_func(dtype="float32"), repeat(CHAT[:1], 2), trainer, match)


def test_an_empty_batch_returns_empty_lists_and_builds_nothing(trainer):
    rf = specroll_rollout_func(dtype="float32")
    assert rf([], trainer) == {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    assert rf.decoder is None and rf.engine is None


def test_stats_count_the_tokens_and_are_logged_in_the_mode_of_the_call(trainer):
    rf = specroll_rollout_func(dtype="float32")
    out = rf(repeat(CHAT[:2], 2), trainer)
    n = sum(len(c) for c in out["completion_ids"])
    assert rf.stats["tokens"] == n > 0 and rf.stats["rollout_s"] > 0
    metrics = trainer._metrics
    assert metrics["train"]["specroll/tokens"] == [float(n)] and "specroll/tokens" not in metrics["eval"]
    trainer.model.eval()
    out = rf(repeat(CHAT[:1], 2), trainer)
    assert metrics["eval"]["specroll/tokens"] == [float(sum(len(c) for c in out["completion_ids"]))]
    assert len(metrics["train"]["specroll/tokens"]) == 1  # an evaluation call is not logged as training


def test_eval_groups_are_cut_at_num_generations_eval(tmp_path, monkeypatch):
    tr = make_trainer(tmp_path, num_generations_eval=3)
    rf = specroll_rollout_func(dtype="float32")
    rf(repeat(CHAT[:1], 2), tr)  # builds the engine
    sizes = []
    real = rf.engine.generate

    def spy(prompts, params, n=1, **kw):
        sizes.append((len(prompts), n))
        return real(prompts, params, n=n, **kw)

    monkeypatch.setattr(rf.engine, "generate", spy)
    tr.model.eval()
    assert len(rf(repeat(CHAT[:2], 3), tr)["completion_ids"]) == 6
    assert sizes == [(2, 3)]  # two groups of three (not of num_generations=2), in one call
    tr.model.train()
    sizes.clear()
    rf(repeat(CHAT[:1], 4), tr)
    assert sizes == [(2, 2)]  # in training the same prompt four times is two groups of num_generations=2


def test_the_seed_argument_and_args_seed_make_rollouts_reproducible(trainer, monkeypatch):
    batch = repeat(CHAT[:2], 2)

    def draw(**kw):
        return specroll_rollout_func(dtype="float32", **kw)(batch, trainer)["completion_ids"]

    default = draw()
    assert draw() == default  # a fresh function (a rerun) draws the same samples
    assert draw(seed=trainer.args.seed) == default  # the default base is args.seed
    assert draw(seed=11) == draw(seed=11) != default
    monkeypatch.setattr(trainer.args, "seed", 4)
    assert draw() != default
    assert specroll_rollout_func(reuse="exact", seed=7).drafter.seed == 7  # and the reuse coins (mixed with each
    # call's sampling seed, which differs per process: ``reuse.coin_generator``)


def test_weights_loaded_with_new_storage_are_picked_up_without_sync(tmp_path):
    tr = make_trainer(tmp_path, "qwen2")  # untied: assign=True would untie a tied lm_head from the embeddings
    rf = specroll_rollout_func(dtype="float32")
    batch = repeat(CHAT[:2], 2)
    rf(batch, tr)
    state = {k: v * 1.5 for k, v in tr.model.state_dict().items()}
    tr.model.load_state_dict(state, assign=True)  # new tensors: no optimizer step, global_step unchanged
    assert max_logprob_error(tr.model, rf(batch, tr)) < 1e-4


def test_chat_template_kwargs_reach_the_template_as_in_trl(tmp_path):
    tr = make_trainer(tmp_path, chat_template_kwargs={"preamble": "Solve this. "})
    tr.processing_class.chat_template = (
        "{{ preamble | default('') }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    batch = repeat(CHAT[:2], 2)
    out = specroll_rollout_func(dtype="float32")(batch, tr)
    want = tr._tokenize_prompts(batch)[0]
    assert out["prompt_ids"] == want
    plain = tr.processing_class.apply_chat_template(CHAT[0], add_generation_prompt=True, tokenize=True)
    assert len(want[0]) > len(plain)  # the preamble is in TRL's tokens too


def test_the_trainers_stop_ids_are_the_ones_used(tmp_path):
    """TRL's ``trainer.eos_token_ids`` wins over what the tokenizer and generation config say."""
    model = tiny_hf_model("llama", seed=1)
    tok = tiny_tokenizer()
    ids = tok.apply_chat_template(CHAT[0], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    likely = model(input_ids=torch.tensor([ids])).logits[0, -1].topk(3).indices.tolist()
    tr = make_trainer(tmp_path, model=model.train(), max_completion_length=12)
    tr.eos_token_ids = [2, *likely]  # the generation config does not list these
    out = specroll_rollout_func(dtype="float32")(repeat(CHAT[:1], 32), tr)
    stops = set(tr.eos_token_ids)
    assert all(not stops & set(c[:-1]) for c in out["completion_ids"])
    assert any(c[-1] in set(likely) for c in out["completion_ids"])


def tiny_hf_model_mistral():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return MistralForCausalLM(cfg)


def test_stop_ids_when_the_trainer_lists_none():
    # the fallback of a trainer without eos_token_ids: the tokenizer's eos, then the generation config's, no repeats
    from types import SimpleNamespace

    from specroll.integrations.trl import eos_ids_of

    tok, hf = tiny_tokenizer(), tiny_hf_model("llama", seed=1)
    hf.generation_config.eos_token_id = [tok.eos_token_id, 5]
    assert eos_ids_of(SimpleNamespace(processing_class=tok), hf) == [tok.eos_token_id, 5]
    hf.generation_config.eos_token_id = None
    assert eos_ids_of(SimpleNamespace(processing_class=tok), hf) == [tok.eos_token_id]
    hf.generation_config.eos_token_id = 5  # one id, not a list
    assert eos_ids_of(SimpleNamespace(processing_class=tok), hf) == [tok.eos_token_id, 5]
    processor = SimpleNamespace(tokenizer=tok)  # a processor: its tokenizer's eos
    assert eos_ids_of(SimpleNamespace(processing_class=processor), hf) == [tok.eos_token_id, 5]


def test_seeds_differ_across_processes_and_steps(trainer, monkeypatch):
    """Each call's seed mixes in the process index and the step (module docstring): two processes handed the two
    halves of one group (a group straddling two slices) must not draw the same completions, and a fresh rollout
    function (a resumed run) at a later step must not replay the seeds of step 0."""
    batch = repeat(CHAT[:1], 2)
    outs = []
    for proc in (0, 1):
        monkeypatch.setattr(type(trainer.accelerator), "process_index", property(lambda self, p=proc: p))
        assert trainer.accelerator.process_index == proc
        outs.append(specroll_rollout_func(dtype="float32")(batch, trainer)["completion_ids"])
    assert outs[0] != outs[1]
    monkeypatch.undo()
    trainer.state.global_step = 5
    assert specroll_rollout_func(dtype="float32")(batch, trainer)["completion_ids"] != outs[0]

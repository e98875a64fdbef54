"""specroll's GRPO policy loss and its gradient against TRL's ``GRPOTrainer._compute_loss`` (TRL 1.16) as an
independent reference, for ``loss.type`` = grpo, dapo and dr_grpo, with and without the k3 KL term.

One tiny random Llama (tied embeddings), one padded batch: 6 rows, prompts of 2-6 tokens (TRL left-pads them),
completions of 1-7 tokens (right-padded to 7) with ``max_completion_length`` = ``rollout.max_new_tokens`` = 8, so
dr_grpo's constant denominator (rows x 8) is not the padded width (rows x 7). Advantages include 0 and negative
values; the old log-probs are the current ones shifted by -0.5 .. +0.5 per token, so the ratio sits above
1 + eps_high and below 1 - eps_low for tokens of both advantage signs (clipped and unclipped branches); with
beta > 0 the reference log-probs are the current ones plus 0.4 x N(0, 1) per token.

Three computations of the same loss:
- TRL: ``_compute_loss`` on the trainer's own (fused LM head) forward, in train mode;
- specroll, loss functions: ``token_weights`` over the batch + ``policy_loss`` on log-probs of a plain,
  unpadded HF forward of each row (so nothing is shared with TRL's forward, its padding or its LM head);
- specroll, trainer path: a specroll ``Decoder`` holding the same weights, ``completion_logprobs`` and
  ``policy_loss`` over micro-batches with weights computed once over the batch, skipping zero-advantage rows
  when beta = 0, as ``Trainer._optimizer_step`` does; its gradients are mapped to the HF layout (the mapping is
  a pure rearrangement: ``hf_to_decoder_state`` applied to the HF gradients).

Settings under which the two are meant to agree, and the documented differences:
- ``GRPOConfig.use_bias_correction_kl`` (default True in TRL 1.16, after DeepSeek-V3.2) multiplies the k3 KL
  by the differentiable ratio pi / pi_old; specroll's ``kl_k3`` is the plain k3 (README: "KL (k3)"), i.e.
  TRL with ``use_bias_correction_kl=False``, which is what these tests set. (With the correction on, the loss
  differs wherever the ratio is not 1, and the gradient even on-policy: d ratio = ratio * d logp.)
- grpo: TRL averages the per-sequence means over *all* rows (an all-padding row counts, with mean 0);
  specroll averages over the rows that have a token (``losses._w_grpo``). Equal when no row is empty; with
  ``k`` empty rows out of ``B``, specroll = TRL * B / (B - k) for the loss and the gradient
  (``test_an_empty_row_changes_only_grpo_by_rows_over_nonempty_rows``). dapo and dr_grpo agree with empty rows.
- dr_grpo: both divide the token sum by rows x the generation budget (TRL ``max_completion_length``,
  specroll ``rollout.max_new_tokens``).
- dapo: TRL divides by ``num_items_in_batch`` (the generation batch's completion tokens; with one process,
  one accumulation step and ``steps_per_generation`` = 1, the batch's token count), specroll by the batch's
  token count.
- temperature = 1: TRL divides the training logits by ``args.temperature``; specroll's training forward
  (``trainer.completion_logprobs``) takes none.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from specroll.models.decoder import hf_to_decoder_state  # noqa: E402
from specroll.models.tiny import decoder_from_hf, tiny_hf_model, tiny_tokenizer  # noqa: E402
from specroll.rl.losses import LossConfig, clipped_surrogate, policy_loss, token_weights  # noqa: E402
from specroll.rl.trainer import Batch, completion_logprobs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

EPS_LOW, EPS_HIGH = 0.2, 0.28
MAX_NEW = 8  # TRL max_completion_length == specroll rollout.max_new_tokens
PLEN = [3, 5, 4, 6, 2, 5]
CLEN = [5, 2, 7, 7, 1, 4]
ADV = [1.3, -0.7, 0.0, 2.1, -1.5, 0.4]
# log(pi / pi_old) per token (clip range: log 0.8 = -0.22, log 1.28 = 0.25); row 6 is for the empty-row test
DELTA = torch.tensor([
    [0.5, -0.5, 0.12, -0.12, 0.35, 0, 0],  # A > 0: clipped above; below the range (unclipped branch)
    [0.5, -0.35, 0, 0, 0, 0, 0],  # A < 0: above the range (unclipped branch); clipped below
    [0.4, -0.4, 0.1, -0.1, 0.3, -0.3, 0.2],  # A = 0
    [-0.05, 0.05, 0.3, -0.3, 0.6, -0.6, 0.2],
    [-0.5, 0, 0, 0, 0, 0, 0],  # A < 0: clipped below
    [0.2, -0.2, 0.45, -0.45, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0],
])
BETA = 0.05


def zero_reward(completions, **kw):
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """One GRPOTrainer per loss type over the same tiny model (TRL patches its fused LM head onto it once per
    trainer; the patched forward without ``fused_lm_head=True`` is the original one)."""
    model = tiny_hf_model("llama", seed=1).train()
    out = {}
    for kind in ("grpo", "dapo", "dr_grpo"):
        args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl") / "out"), per_device_train_batch_size=6,
                          num_generations=2, max_completion_length=MAX_NEW, use_cpu=True, report_to="none",
                          save_strategy="no", disable_tqdm=True, bf16=False, seed=3, loss_type=kind,
                          epsilon=EPS_LOW, epsilon_high=EPS_HIGH, temperature=1.0, beta=0.0,
                          use_bias_correction_kl=False)
        tr = GRPOTrainer(model=model, reward_funcs=[zero_reward], args=args, processing_class=tiny_tokenizer(),
                         train_dataset=Dataset.from_list([{"prompt": "hi"}] * 2))
        # set by Trainer.train() for each optimizer step; one micro-batch per step here
        tr.current_gradient_accumulation_steps = 1
        out[kind] = tr
    return out


@torch.no_grad()
def make_data(model, plen=PLEN, clen=CLEN, adv=ADV):
    """The batch in both layouts plus old / reference log-probs built around the model's current ones."""
    g = torch.Generator().manual_seed(0)
    B, P, C = len(plen), max(plen), max(clen)
    prompts = [torch.randint(3, 320, (n,), generator=g) for n in plen]
    comps = [torch.randint(3, 320, (n,), generator=g) for n in clen]
    cmask = (torch.arange(C)[None] < torch.tensor(clen)[:, None]).float()
    cur = plain_hf_logprobs(model, prompts, comps, C)
    delta = DELTA[:B, :C]
    old = (cur - delta) * cmask
    ref = (cur + 0.4 * torch.randn(B, C, generator=g)) * cmask
    d = {
        "prompts": prompts, "comps": comps, "cmask": cmask, "adv": torch.tensor(adv), "old": old, "ref": ref,
        "cur": cur,
        # TRL's layout: prompts left-padded, completions right-padded (pad id 0)
        "prompt_ids": torch.stack([torch.cat([torch.zeros(P - len(p), dtype=torch.long), p]) for p in prompts]),
        "prompt_mask": (torch.arange(P)[None] >= P - torch.tensor(plen)[:, None]).long(),
        "completion_ids": torch.stack([torch.cat([c, torch.zeros(C - len(c), dtype=torch.long)]) for c in comps]),
    }
    # specroll's layout (trainer.Batch): prompt + completion right-padded together
    L = max(a + b for a, b in zip(plen, clen))
    seq = torch.zeros(B, L, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        seq[i, : len(p) + len(c)] = torch.cat([p, c])
    d["batch"] = Batch(seq, torch.tensor(plen), torch.tensor(clen), d["completion_ids"], cmask, old,
                       torch.zeros(B, dtype=torch.bool))
    return d


def plain_hf_logprobs(model, prompts, comps, C):
    """(B, C) log p(completion token) from one unpadded HF forward per row, zeros past each completion."""
    rows = []
    for p, c in zip(prompts, comps):
        logits = model(input_ids=torch.cat([p, c])[None]).logits[0, len(p) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, c[:, None]).squeeze(-1)
        rows.append(torch.nn.functional.pad(lp, (0, C - len(c))))
    return torch.stack(rows)


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def trl_loss(tr, d, beta):
    tr.beta = beta  # read by _compute_loss; set after __init__, where beta > 0 would load a reference model
    model = tr.model
    model.zero_grad(set_to_none=True)
    inputs = {"prompt_ids": d["prompt_ids"], "prompt_mask": d["prompt_mask"],
              "completion_ids": d["completion_ids"], "completion_mask": d["cmask"].long(),
              "advantages": d["adv"], "old_per_token_logps": d["old"],
              "num_items_in_batch": d["cmask"].sum()}
    if beta:
        inputs["ref_per_token_logps"] = d["ref"]
    loss = tr._compute_loss(model, inputs)
    loss.backward()
    g = grads(model)
    model.zero_grad(set_to_none=True)
    return loss.detach(), g


def specroll_loss(model, d, kind, beta):
    """``token_weights`` + ``policy_loss`` on plain HF log-probs; gradients in the HF model."""
    cfg = LossConfig(type=kind, eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=beta)
    model.zero_grad(set_to_none=True)
    logp = plain_hf_logprobs(model, d["prompts"], d["comps"], d["cmask"].shape[1])
    w = token_weights(d["cmask"], kind, MAX_NEW)
    loss, _ = policy_loss(logp, d["old"], d["adv"], w, cfg, d["ref"] if beta else None)
    loss.backward()
    g = grads(model)
    model.zero_grad(set_to_none=True)
    return loss.detach(), g


def specroll_trainer_path_loss(hf_model, d, kind, beta, micro=2):
    """The update loop of ``Trainer._optimizer_step`` on a specroll Decoder with the same weights: batch-wide
    weights, micro-batches of ``micro`` rows, zero-advantage rows skipped when beta = 0. Returns the loss and the
    Decoder's gradients."""
    cfg = LossConfig(type=kind, eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=beta)
    dec = decoder_from_hf(hf_model)
    batch = d["batch"]
    rows = torch.arange(len(d["adv"]))
    w_all = token_weights(batch.cmask[rows], kind, MAX_NEW)
    live = d["adv"] != 0 if beta == 0 else torch.ones(len(rows), dtype=torch.bool)
    total = torch.zeros(())
    for chunk in live.nonzero().squeeze(1).split(micro):
        logp, _ = completion_logprobs(dec, batch, rows[chunk], with_entropy=True)
        loss, _ = policy_loss(logp.float(), d["old"][chunk], d["adv"][chunk], w_all[chunk], cfg,
                              d["ref"][chunk] if beta else None)
        loss.backward()
        total += loss.detach()
    return total, dec


def assert_grads_close(got, want, scale=1.0):
    assert got.keys() == want.keys()
    top = max(float(g.abs().max()) for g in want.values())
    assert top > 0
    for n in want:
        torch.testing.assert_close(got[n], want[n] * scale, rtol=1e-4, atol=3e-5 * top, msg=lambda m, n=n: f"{n}: {m}")


@pytest.fixture(scope="module")
def data(trainers):
    return make_data(trainers["grpo"].model)


def test_the_batch_exercises_both_clip_sides_and_padding(data, trainers):
    d = data
    ratio = (d["cur"] - d["old"]).exp()
    m = d["cmask"].bool()
    a = d["adv"][:, None].expand_as(ratio)
    _, clipped = clipped_surrogate(d["cur"], d["old"], d["adv"], EPS_LOW, EPS_HIGH)
    assert (clipped & m & (a > 0) & (ratio > 1 + EPS_HIGH)).any()  # clipped above (gradient cut)
    assert (clipped & m & (a < 0) & (ratio < 1 - EPS_LOW)).any()  # clipped below
    assert (~clipped & m & (a < 0) & (ratio > 1 + EPS_HIGH)).any()  # outside the range but unclipped branch
    assert (~clipped & m & (a > 0) & (ratio < 1 - EPS_LOW)).any()
    assert (d["prompt_mask"] == 0).any() and (d["cmask"] == 0).any()
    assert int(d["cmask"].sum(1).max()) < MAX_NEW  # dr_grpo's budget is not the padded width
    # TRL's padded forward gives the same log-probs as the unpadded one (RoPE is relative; padding masked)
    with torch.no_grad():
        ids = torch.cat([d["prompt_ids"], d["completion_ids"]], 1)
        am = torch.cat([d["prompt_mask"], d["cmask"].long()], 1)
        tr = trainers["grpo"]
        trl_lp, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, am, ids.shape[1] - d["prompt_ids"].shape[1])
    torch.testing.assert_close(trl_lp * d["cmask"], d["cur"], rtol=0, atol=2e-5)


@pytest.mark.parametrize("path", ["loss functions", "trainer path"])
@pytest.mark.parametrize("beta", [0.0, BETA])
@pytest.mark.parametrize("kind", ["grpo", "dapo", "dr_grpo"])
def test_loss_and_gradient_match_trl(trainers, data, kind, beta, path):
    """Through the loss functions on HF log-probs (gradients in the HF model), and through the trainer's update
    loop on a specroll Decoder (its gradients mapped to the HF layout)."""
    tr = trainers[kind]
    want, g_trl = trl_loss(tr, data, beta)
    assert abs(float(want)) > 1e-3
    if path == "loss functions":
        got, g_sr = specroll_loss(tr.model, data, kind, beta)
    else:
        got, dec = specroll_trainer_path_loss(tr.model, data, kind, beta)
        g_sr, g_trl = {n: p.grad for n, p in dec.named_parameters() if p.grad is not None}, \
            hf_to_decoder_state(g_trl, dec.cfg)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert_grads_close(g_sr, g_trl)


@pytest.mark.parametrize("kind,factor", [("grpo", 7 / 6), ("dapo", 1.0), ("dr_grpo", 1.0)])
def test_an_empty_row_changes_only_grpo_by_rows_over_nonempty_rows(trainers, kind, factor):
    # a 7th row with no completion token: TRL's grpo mean counts it, specroll's does not (losses._w_grpo)
    tr = trainers[kind]
    d = make_data(tr.model, PLEN + [3], CLEN + [0], ADV + [0.9])
    want, g_trl = trl_loss(tr, d, BETA)
    got, g_sr = specroll_loss(tr.model, d, kind, BETA)
    torch.testing.assert_close(got, want * factor, rtol=1e-5, atol=1e-7)
    assert_grads_close(g_sr, g_trl, scale=factor)

"""Helpers shared by several test modules (imported as ``helpers``: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch

from specroll.analysis import lenient_bias as lb
from specroll.engine.sampling import SamplingParams, processed_logprobs
from specroll.models.decoder import Decoder, DecoderConfig


def bf16_rounded(model: Decoder) -> Decoder:
    """A new ``Decoder`` with ``model``'s weights, every linear's (the lm_head untied from the embedding)
    rounded to bf16 in fp32 storage; the embedding lookup stays fp32. Built from the config and the state
    dict rather than deep-copied, so it works after forwards have packed the model's weights for oneDNN."""
    from specroll.models.decoder import FastLinear

    rounded = Decoder(model.cfg).eval()
    rounded.load_state_dict(model.state_dict())
    rounded.lm_head.weight = torch.nn.Parameter(rounded.lm_head.weight.detach().clone())  # untie
    with torch.no_grad():
        for mod in rounded.modules():
            if isinstance(mod, FastLinear):
                mod.weight.copy_(mod.weight.bfloat16().float())
    return rounded


def tiny_decoder(vocab: int, seed: int, scale: float = 3.0) -> Decoder:
    """A 2-layer random Llama-style decoder; ``scale`` sharpens its logits."""
    torch.manual_seed(seed)
    cfg = DecoderConfig(arch="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, max_position=256)
    m = Decoder(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return m


@torch.no_grad()
def extreme_sequence(model, params: dict, most: bool) -> list[int]:
    """Greedy path of the most (or least) likely token under the sampling distribution."""
    ids = list(lb.PROMPT)
    for _ in range(lb.MAX_NEW):
        h = model(torch.tensor([ids]), torch.arange(len(ids))[None])
        lp = processed_logprobs(model.logits(h[0, -1]), SamplingParams(**params))
        ids.append(int(lp.argmax() if most else lp.argmin()))
    return ids[len(lb.PROMPT):]


def draft_sets(model, engine, params: dict, n_rows: int, seed: int) -> dict[str, list]:
    """Three kinds of previous-epoch drafts for ``n_rows`` rows of ``lb.PROMPT``: random (ragged, some
    rows without a draft, stop tokens mid-draft: cuts everywhere), adversarial (the least likely
    path) and likely (the most likely path or a real sample)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, lb.MAX_NEW + 1, (n_rows,), generator=g)
    rand = [torch.randint(0, lb.VOCAB, (int(n),), generator=g).tolist() if n else None for n in lens]
    likely = extreme_sequence(model, params, most=True)
    sampled = engine.generate([lb.PROMPT], SamplingParams(**params, max_new_tokens=lb.MAX_NEW, seed=seed + 1),
                              n=n_rows // 2)
    return {
        "random": rand,
        "adversarial": [extreme_sequence(model, params, most=False)] * n_rows,
        "likely": [likely if i % 2 else sampled[i // 2].completion_ids.tolist() for i in range(n_rows)],
    }


def put_drafts(store, drafts: list, prompt=lb.PROMPT, seed: int = 0) -> None:
    """Store ``drafts[i]`` (a token list, or None for no draft) as sample i's previous completion of
    ``prompt``, with a realistic p_old: sampling log-probs drawn uniformly from [-3, 0). Exact mode's rule
    must not read p_old at all; storing p_old = 1 (log-prob 0) would hide a rule that divides by it, since
    min(1, p_new / p_old) is then p_new, exact mode's acceptance probability."""
    g = torch.Generator().manual_seed(seed)
    for i, d in enumerate(drafts):
        if d is not None:
            store.put(prompt, i, d, -3 * torch.rand(len(d), generator=g))


def chi2_gof(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value of observed ``counts`` against ``probs`` over the same
    cells (the expected counts are ``probs * counts.sum()``). Cells expecting fewer than 5 are pooled into
    one. An observation in a cell of zero probability gives p = 0."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if bool((counts[probs <= 0] > 0).any()):
        return 0.0
    exp, obs = probs * counts.sum(), counts
    small = exp < 5
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    obs = torch.cat([obs[~small], obs[small].sum()[None]])
    keep = exp > 0  # the pooled cell is empty when no cell is small
    exp, obs = exp[keep], obs[keep]
    x2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x2 / 2)))


def chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    """``chi2_gof`` over outcomes as dict keys: ``counts`` {outcome: count} (``n`` in all) against
    ``probs`` {outcome: probability}. An observed outcome missing from ``probs`` has zero probability."""
    if any(probs.get(k, 0.0) <= 0 for k in counts):
        return 0.0
    cells = list(probs)
    assert sum(counts.values()) == n, f"counts sum to {sum(counts.values())}, not {n}"
    return chi2_gof(torch.tensor([counts.get(k, 0) for k in cells]), torch.tensor([probs[k] for k in cells]))


def random_chains(B: int, L: int, V: int, temperature: float, seed: int = 0):
    """(tree, logits, params): B sampled chains of L drafts over a draft vocabulary of every third token, for
    checking a chain rule's kernel against its PyTorch reference. Rows cycle through q = p, q near p and q
    unrelated to p (p the policy restricted to the draft vocabulary); in two rows of three the policy has
    almost no mass outside the draft vocabulary."""
    from specroll.drafters.eagle import DraftTree

    torch.manual_seed(seed)
    params = SamplingParams(temperature=temperature)
    logits = torch.randn(B, L + 1, V) * 2
    ids = torch.arange(1, V, 3)
    outside = torch.ones(V, dtype=torch.bool).index_fill_(0, ids, False)
    logits[0::3, :, outside] -= 30
    logits[1::3, :, outside] -= 30
    p = processed_logprobs(logits[:, :L, ids], params)
    kind = torch.arange(B)[:, None, None] % 3
    near = torch.log_softmax(p + 0.3 * torch.randn_like(p), -1)
    q = torch.where(kind == 0, p, torch.where(kind == 1, near, torch.log_softmax(torch.randn_like(p), -1)))
    toks = torch.cat([torch.zeros(B, 1, dtype=torch.long), ids[torch.multinomial(q.exp().flatten(0, 1), 1).view(B, L)]], 1)
    ar = torch.arange(L + 1)
    tree = DraftTree.build(toks, (ar - 1).clamp(min=0).expand(B, L + 1), ar.expand(B, L + 1))
    tree.q_logp, tree.q_vocab = q, ids
    return tree, logits, params


def cli_error(capsys, argv: list[str]) -> str:
    """Run the CLI, expect exit code 2 and return its one error line."""
    from specroll.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("specroll: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


class KernelSpy:
    """Stands in for ``kernels.skinny()`` (``monkeypatch.setattr(kernels, "skinny", lambda: spy)``): every
    attribute is the real extension's, and the calls of the functions named in ``watch`` are counted in
    ``calls``, so a test of a kernel against its reference can assert that the kernel ran at all."""

    def __init__(self, ext, *watch: str):
        self._ext, self._watch, self.calls = ext, set(watch), {w: 0 for w in watch}

    def __getattr__(self, name):
        f = getattr(self._ext, name)
        if name not in self._watch:
            return f

        def counted(*a, **k):
            self.calls[name] += 1
            return f(*a, **k)

        return counted


def full_disk_torch_save(real_save, hits, write_partial: bool = False):
    """A ``torch.save`` stand-in that fails, on the paths for which ``hits(path)`` is true, the way torch's does on
    a full disk: a RuntimeError raised while handling another, with no errno. ``write_partial`` first writes the
    real file (a partial file left in the temporary directory)."""

    def save(obj, f, *a, **k):
        if hits(str(f)):
            if write_partial:
                real_save(obj, f, *a, **k)
            try:
                raise RuntimeError("basic_ios::clear: iostream error")
            except RuntimeError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 85632 vs 85520")  # noqa: B904 (torch chains it so)
        return real_save(obj, f, *a, **k)

    return save

"""Tree verification as pure functions: the sampler-match walk, tree tensors, emission truncation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specroll import kernels
from specroll.drafters.eagle import DraftTree, EagleDrafter, ancestor_mask, emit_run
from specroll.drafters.verify import match_walk, sampler_match
from specroll.engine.sampling import SamplingParams

# One tree per row, N = 6:      0 (root)
#                              /        \
#                          1 (t=5)    2 (t=7)
#                          /    \         \
#                      3 (t=1) 4 (t=2)   5 (t=3)
PARENTS = torch.tensor([0, 0, 0, 1, 1, 2])
TOKENS = torch.tensor([9, 5, 7, 1, 2, 3])
DEPTH = torch.tensor([0, 1, 1, 2, 2, 2])


def tree(B: int) -> DraftTree:
    return DraftTree.build(TOKENS.expand(B, 6).clone(), PARENTS.expand(B, 6).clone(), DEPTH.expand(B, 6).clone())


def test_walk_ragged_acceptance_in_one_batch():
    t = tree(4)
    # samples[b, node] = what the policy drew at that node
    samples = torch.tensor([
        [5, 2, 0, 0, 0, 0],  # root -> 5 (node 1) -> 2 (node 4): 2 accepted
        [7, 0, 3, 0, 0, 0],  # root -> 7 (node 2) -> 3 (node 5): 2 accepted
        [4, 2, 0, 0, 0, 0],  # root drew 4: nothing accepted
        [5, 8, 0, 0, 0, 0],  # root -> 5 (node 1), then 8 is no child: 1 accepted
    ])
    path, n = match_walk(t.tokens, t.parents, t.valid, samples, t.max_depth)
    assert n.tolist() == [2, 2, 0, 1]
    assert path.tolist() == [[0, 1, 4], [0, 2, 5], [0, 0, 0], [0, 1, 1]]


def test_walk_ignores_invalid_nodes_and_takes_first_duplicate():
    t = tree(2)
    t.valid[0, 1] = False  # padding node in row 0
    t.tokens[1, 2] = 5  # duplicate sibling token in row 1
    samples = torch.tensor([[5, 1, 0, 0, 0, 0], [5, 1, 0, 0, 0, 0]])
    path, n = match_walk(t.tokens, t.parents, t.valid, samples, t.max_depth)
    assert n.tolist() == [0, 2]
    assert path[1].tolist() == [0, 1, 3]


def test_sampler_match_emits_policy_samples_greedy():
    B, N, V = 3, 6, 10
    logits = torch.randn(B, N, V)
    t = tree(B)
    v = sampler_match(t, logits, SamplingParams(temperature=0), None)
    arg = logits.argmax(-1)
    assert torch.equal(v.tokens, arg.gather(1, v.path))  # every emitted token is the policy's own pick
    for b in range(B):  # each accepted node's token is the policy's pick at its parent
        for j in range(1, int(v.n_accept[b]) + 1):
            node, par = int(v.path[b, j]), int(v.path[b, j - 1])
            assert int(t.tokens[b, node]) == int(arg[b, par]) and int(PARENTS[node]) == par
    logp = torch.log_softmax(logits, -1)
    want = torch.stack([logp[b, v.path[b], v.tokens[b]] for b in range(B)])
    torch.testing.assert_close(v.policy_lp, want)


def test_ancestor_mask_and_paths():
    t = tree(1)
    m = t.mask[0]
    assert m[4].tolist() == [True, True, False, False, True, False]
    assert m[5].tolist() == [True, False, True, False, False, True]
    assert torch.equal(ancestor_mask(t.parents, 2), t.mask)
    p = t.paths()[0]
    assert p[4].tolist() == [0, 1, 4] and p[2].tolist() == [0, 2, -1] and p[0].tolist() == [0, -1, -1]


def selected_tree(B: int, K: int, L: int, n_verify: int, logq, gen):
    """Candidates of a tree grown like ``EagleDrafter._grow`` (``logq(n_parents)``: each frontier node's K children's
    draft log-probs, (B, n_parents, K); scores by ``child_scores``), then ``_select``'s tree of ``n_verify`` nodes.
    Checks on the way that every child scores strictly below its parent."""
    from specroll.drafters.eagle import child_scores

    toks, scores, pars, deps = [], [], [], []
    front, front_idx, c = torch.zeros(B, 1), torch.full((B, 1), -1), 0
    for d in range(1, L + 1):
        n_par = front.shape[1]
        s = child_scores(front[:, :, None], logq(n_par))
        assert bool((s < front[:, :, None]).all())  # strictly below the parent, always
        s = s.flatten(1)
        toks.append(torch.randint(50, (B, n_par * K), generator=gen))
        scores.append(s)
        pars.append(front_idx[:, :, None].expand(B, n_par, K).flatten(1))
        deps.append(torch.full((B, n_par * K), d))
        top = s.topk(K, dim=-1)
        front, front_idx = top.values, c + top.indices
        c += n_par * K
    t = EagleDrafter._select(torch.zeros(B, dtype=torch.long), torch.cat(toks, 1), torch.cat(scores, 1),
                             torch.cat(pars, 1), torch.cat(deps, 1), n_verify)
    assert t.tokens.shape == (B, n_verify)
    idx = torch.arange(n_verify)
    assert bool((t.parents[:, 1:] < idx[1:]).all())  # parents precede children
    assert torch.equal(t.depth[:, 1:], t.depth.gather(1, t.parents)[:, 1:] + 1)  # at their parent's depth + 1
    return t


def test_select_is_ancestor_closed_and_ordered():
    gen = torch.Generator().manual_seed(0)
    selected_tree(5, 3, 4, 12, lambda n: -torch.rand(5, n, 3, generator=gen) * 3, gen)


@pytest.mark.parametrize("extreme", [-3e4, float("-inf")])
def test_select_stays_ancestor_closed_for_a_diverged_heads_scores(extreme):
    """Draft log-probs of a diverged head (-3e4, or -inf): a child scored parent + log q - SCORE_EPS tied its parent
    once |score| passed ~2e4 (float32's spacing there exceeds SCORE_EPS) or at -inf, and top-k could keep the child
    without its parent, which ``_select`` then hung under the root at the wrong depth."""
    gen = torch.Generator().manual_seed(1)
    selected_tree(4, 3, 6, 16, lambda n: torch.where(torch.rand(4, n, 3, generator=gen) < 0.2, 0.0, extreme), gen)


def test_chain_is_k1_tree():
    par = torch.tensor([[0, 0, 1, 2]])
    t = DraftTree.build(torch.tensor([[1, 2, 3, 4]]), par, torch.tensor([[0, 1, 2, 3]]))
    assert torch.equal(t.mask[0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_sampled_chain_tree_equals_general_build():
    """``EagleDrafter._chain_tree`` builds a chain's tree directly (causal mask, no ancestor gathers): the same
    tree as ``DraftTree.build`` over the chain's parents and depths."""
    B, L = 3, 5
    gen = torch.Generator().manual_seed(0)
    d = SimpleNamespace(head=SimpleNamespace(vocab_ids=torch.arange(7)), _chains={})
    for _ in range(2):  # the second call reuses the shape tensors of the first (``_chains``)
        root, toks = torch.randint(7, (B,), generator=gen), torch.randint(7, (B, L), generator=gen)
        q = torch.log_softmax(torch.randn(B, L, 7, generator=gen), -1)
        t = EagleDrafter._chain_tree(d, root, toks, q)
        ar = torch.arange(L + 1)
        ref = DraftTree.build(torch.cat([root[:, None], toks], 1), (ar - 1).clamp(min=0).expand(B, L + 1),
                              ar.expand(B, L + 1))
        for f in ("tokens", "parents", "depth", "mask", "valid"):
            assert torch.equal(getattr(t, f), getattr(ref, f)), f
    assert list(d._chains) == [(B, L)]
    assert t.max_depth == ref.max_depth == L and t.q_logp is q and torch.equal(t.q_vocab, torch.arange(7))


def _state(n_gen, M, min_new=0):
    B = len(n_gen)
    p = SamplingParams(max_new_tokens=M, min_new_tokens=min_new)
    return SimpleNamespace(row_ids=torch.arange(B), n_gen=torch.tensor(n_gen), tokens=torch.zeros(B, M, dtype=torch.long),
                           policy_lp=torch.zeros(B, M), sample_lp=torch.zeros(B, M), params=p)


@pytest.mark.parametrize("fast", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("min_new", [0, 4])
def test_emit_run_truncates_at_first_stop_and_max_new(min_new, fast):
    st = _state([1, 1, 5], 8, min_new=min_new)
    toks = torch.tensor([[4, 0, 5, 0], [4, 4, 4, 4], [1, 2, 3, 4]])
    lp = -torch.arange(12.0).view(3, 4)
    fin, stopped = emit_run(st, toks, lp, lp * 2, torch.tensor([4, 2, 4]), torch.tensor([0]), fast=fast)
    if min_new == 0:  # row 0 stops at its first 0; row 1 emits its 2; row 2 fills max_new with 3 of 4
        assert st.n_gen.tolist() == [3, 3, 8]
        assert st.tokens[0, 1:3].tolist() == [4, 0]
    else:  # the first 0 would end the row before min_new_tokens = 4, so the second one stops it
        assert st.n_gen.tolist() == [5, 3, 8]
        assert st.tokens[0, 1:5].tolist() == [4, 0, 5, 0]
    assert fin.tolist() == [True, False, True] and stopped.tolist() == [True, False, False]
    assert st.tokens[2, 5:].tolist() == [1, 2, 3]
    assert st.policy_lp[1, 1:3].tolist() == [-4.0, -5.0] and st.sample_lp[1, 1:3].tolist() == [-8.0, -10.0]


@pytest.mark.skipif(kernels.skinny() is None, reason="the kernels are not available here")
@pytest.mark.parametrize("seed", range(6))
def test_emit_run_kernel_equals_the_tensor_ops(seed):
    """``emit_rows`` (one kernel call) against ``emit_run``'s tensor ops: random live rows in random order, runs
    of 0-E tokens with stop tokens anywhere (also at the last column, and before ``min_new_tokens``), rows near
    ``max_new_tokens``, several stop ids or none: the same buffers, counts and masks."""
    g = torch.Generator().manual_seed(seed)
    R, M, E = 9, 12, 5
    for trial in range(40):
        n_gen = torch.randint(0, M, (R,), generator=g)
        min_new = int(torch.randint(0, 6, (1,), generator=g))
        rows = torch.randperm(R, generator=g)[: int(torch.randint(1, R + 1, (1,), generator=g))]
        B = rows.numel()
        toks = torch.randint(0, 6, (B, E), generator=g)
        count = torch.randint(0, E + 1, (B,), generator=g)
        stop = [torch.tensor([0]), torch.tensor([0, 3]), torch.tensor([], dtype=torch.long)][trial % 3]
        plp, slp = torch.randn(B, E, generator=g), torch.randn(B, E, generator=g)
        sts = []
        for fast in (False, True):
            st = _state(n_gen.tolist(), M, min_new=min_new)
            st.row_ids = rows
            st.tokens[:] = -1
            sts.append((st, emit_run(st, toks, plp, slp, count, stop, fast=fast)))
        (a, (fa, sa)), (b, (fb, sb)) = sts
        assert torch.equal(fa, fb) and torch.equal(sa, sb), trial
        for f in ("n_gen", "tokens", "policy_lp", "sample_lp"):
            assert torch.equal(getattr(a, f), getattr(b, f)), (trial, f)


@pytest.mark.skipif(kernels.skinny() is None, reason="the kernels are not available here")
def test_engine_emit_kernel_equals_the_tensor_ops():
    """``Engine.emit`` (one token per live row) through ``emit_rows`` against its tensor ops: stop ids met before and
    after ``min_new_tokens``, rows reaching ``max_new_tokens``, live rows in any order."""
    from specroll.engine.engine import Engine

    g = torch.Generator().manual_seed(0)
    R, M = 7, 6
    for trial in range(60):
        n_gen = torch.randint(0, M, (R,), generator=g)
        min_new = int(torch.randint(0, 4, (1,), generator=g))
        rows = torch.randperm(R, generator=g)[: int(torch.randint(1, R + 1, (1,), generator=g))]
        tok = torch.randint(0, 4, (rows.numel(),), generator=g)
        plp, slp = torch.randn(rows.numel(), generator=g), torch.randn(rows.numel(), generator=g)
        outs = []
        for fast in (False, True):
            st = _state(n_gen.tolist(), M, min_new=min_new)
            st.row_ids = rows
            outs.append((st, Engine.emit(None, st, tok, plp, slp, torch.tensor([0, 2]), fast=fast)))
        (a, (fa, sa)), (b, (fb, sb)) = outs
        assert torch.equal(fa, fb) and torch.equal(sa, sb), trial
        for f in ("n_gen", "tokens", "policy_lp", "sample_lp"):
            assert torch.equal(getattr(a, f), getattr(b, f)), (trial, f)

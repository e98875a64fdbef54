"""`specroll bench engine`: the engine against HF ``generate``, side by side in one process.

Both sample at T = 1 from the same prompts with every row forced to the same length, so tokens/s
compare like for like. HF ``generate`` always runs in fp32 (the baseline the issue names); the
engine runs in ``--dtype``. In bf16 mode the fp32 engine is measured too, giving the bf16/fp32 ratio
from the same run. The roofline bound uses ceilings measured in this run:
``bound_tok_s = batch / max(weight_bytes / read_bw, 2 * params * batch / matmul_rate)``, with the
weights' bytes in the bench's dtype, the matmul rate in the dtype of the engine's arithmetic (fp32 in
the bf16 weight mode of CPUs without native bf16, ``Engine.bf16_weights``) and the read bandwidth from
an fp32 reduction: a bf16 ``sum`` read 18.1 GB/s on a Xeon whose skinny kernel streamed 540 MB of fp32
weights at 27-33 GB/s, so the bf16 engine read 99-107% of its "bound" at batch 1 (2026-11-24,
benchmarks/engine_s13). Weights that stay in a large L3 between steps can still beat a DRAM bound.
"""

from __future__ import annotations

import torch

from ..engine.engine import Engine
from ..engine.sampling import SamplingParams
from .common import (
    DTYPE_NAME,
    DTYPES,
    chat_prompts,
    machine_info,
    measure_matmul_rate,
    measure_read_bandwidth,
    median_time,
    parse_int_list,
    write_json,
)


def weight_bytes(model, dtype: torch.dtype) -> int:
    """Bytes streamed per decode step: every parameter once (a tied lm_head counts once)."""
    return model.num_params() * torch.tensor([], dtype=dtype).element_size()


def hf_runner(hf, tokenizer, prompts: list[list[int]], M: int):
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF generate expects
        ids[i, T - len(p):] = torch.tensor(p)
        att[i, T - len(p):] = 1

    def run():
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=1.0, top_k=0,
                              top_p=1.0, max_new_tokens=M, min_new_tokens=M, pad_token_id=pad)
        assert out.shape[1] == T + M
    return run


def engine_runner(engine: Engine, prompts, M: int):
    params = SamplingParams(temperature=1.0, max_new_tokens=M, min_new_tokens=M, seed=0)

    def run():
        outs = engine.generate(prompts, params)
        assert all(len(o.completion_ids) == M for o in outs)
    return run


def run_bench(model_name: str, batch_sizes: list[int], M: int, dtype_name: str, repeats: int,
              with_hf: bool = True, log=print) -> dict:
    from ..models import hub

    dtype = DTYPES[dtype_name]
    model, tok = hub.load(model_name, torch.float32)
    eos = hub.eos_ids(tok, hub.resolve(model_name))
    hf = None
    if with_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hub.resolve(model_name), dtype=torch.float32).eval()
    systems = {"engine": Engine(model, eos_ids=eos, dtype=dtype)}
    # the bf16 weight mode (no native bf16) streams bf16 bytes but does its arithmetic in fp32
    arith = torch.float32 if systems["engine"].bf16_weights else dtype
    log(f"measuring ceilings (read bandwidth, matmul {DTYPE_NAME[arith]}) ...")
    bw, mm = measure_read_bandwidth(torch.float32), measure_matmul_rate(arith)
    wb, params = weight_bytes(model, dtype), model.num_params()
    if dtype != torch.float32:
        systems["engine_fp32"] = Engine(model, eos_ids=eos, dtype=torch.float32)
    rows = []
    for B in batch_sizes:
        prompts = chat_prompts(tok, B)
        runs = {k: engine_runner(e, prompts, M) for k, e in systems.items()}
        if hf is not None:
            runs["hf"] = hf_runner(hf, tok, prompts, M)
        for r in runs.values():  # warm-up (packing, allocator, first-call overheads)
            r()
        # interleave systems repeat by repeat so drift on a shared machine hits all alike
        times = {k: [] for k in runs}
        for _ in range(repeats):
            for k, r in runs.items():
                times[k].append(median_time(r, 1))
        tps = {k: B * M / sorted(v)[len(v) // 2] for k, v in times.items()}
        bound = B / max(wb / (bw * 1e9), 2 * params * B / (mm * 1e9))
        row = {"batch": B, "hf_tok_s": tps.get("hf"), "engine_tok_s": tps["engine"],
               "speedup": tps["engine"] / tps["hf"] if "hf" in tps else None,
               "bound_tok_s": bound, "fraction_of_bound": tps["engine"] / bound}
        if "engine_fp32" in tps:
            row["engine_fp32_tok_s"] = tps["engine_fp32"]
            row["over_fp32_engine"] = tps["engine"] / tps["engine_fp32"]
        rows.append(row)
        log("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return {"model": model_name, "dtype": dtype_name, "bf16_weight_mode": systems["engine"].bf16_weights,
            "max_new_tokens": M, "repeats": repeats,
            "machine": machine_info(),
            "roofline": {"weight_bytes": wb, "params": params, "read_GBps": bw, "matmul_GFLOPs": mm},
            "rows": rows}


def cli(args) -> int:
    from ..cli import CliError, check_output

    batch_sizes = parse_int_list(args.batch_sizes, "--batch-sizes", distinct="a batch size")
    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be >= 1")
    if args.repeats < 1:
        raise CliError(f"--repeats must be >= 1, got {args.repeats}")
    check_output(args.out, "--out")
    res = run_bench(args.model, batch_sizes, args.max_new_tokens, args.dtype, args.repeats, not args.no_hf)
    write_json(args.out, res)
    print(f"wrote {args.out}")
    return 0

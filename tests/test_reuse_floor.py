"""benchmarks/reuse_floor.py: the FLOP count behind the GFLOP/s it reports (BENCHMARKS.md, session 20)."""
import importlib.util
from pathlib import Path

from helpers import tiny_decoder

_spec = importlib.util.spec_from_file_location("reuse_floor", Path(__file__).parents[1] / "benchmarks" / "reuse_floor.py")
reuse_floor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reuse_floor)


def test_linear_flops_count_every_layer_weight_and_the_lm_head():
    model = tiny_decoder(vocab=50, seed=0)
    c = model.cfg
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    stack, head = reuse_floor.linear_flops_per_token(model)
    assert stack == 2 * c.num_layers * per_layer
    assert head == 2 * c.vocab_size * c.hidden_size

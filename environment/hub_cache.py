"""The models in huggingface_hub's local cache: which files a model needs,
whether a repo's snapshot holds all of them, which cached repos can be
served, and deleting one. No network: the pull itself is
environment/hub_pull.py.

huggingface_hub finds its cache itself (HF_HOME, HF_HUB_CACHE); nothing here
passes a folder of ours. A reference is `REPO[:FILE][@REVISION]`: FILE names
one .gguf file of a GGUF repo (its name or its quantization, `:Q4_0`).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

from environment.model_folder import ModelError, missing_part, model_kind

# Top-level files a model needs (fnmatch patterns on the name): weights,
# config, tokenizer, chat template, a VLM's processor configs, an embedding
# model's sentence-transformers description. Not: README, other weight
# formats (*.bin, *.pth, *.onnx), training files, code.
MODEL_FILES = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "*.tiktoken", "tekken.json",
    "chat_template.json", "chat_template.jinja", "*processor_config.json",
    "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json",
)
# A sentence-transformers module's folder (1_Pooling, 2_Dense, 3_Normalize).
MODULE_FILE = re.compile(r"\d+_[A-Za-z]+/[^/]+\.(?:json|safetensors)")
# "Foo.Q4_1", "Foo-q8_0", "Foo.F16", "Foo-Q4_K_M": the quantization ends a GGUF file's name.
QUANT_SUFFIX = re.compile(r"[.-](?:[QqIi][QqNn]?\d\w*|[Ff]16|[Ff]32|[Bb][Ff]16)$")


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str | None = None  # None: the default branch
    file: str | None = None      # a GGUF repo's file, by name or quantization

    def __str__(self) -> str:
        return self.repo + (f":{self.file}" if self.file else "") + (f"@{self.revision}" if self.revision else "")


def parse_ref(spec: str) -> HubRef:
    """`owner/name[:FILE][@REVISION]`; ModelError when it names no repo."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    rest, at, revision = spec.partition("@")
    repo, colon, file = rest.partition(":")
    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise ModelError(f"{spec}: neither a local path nor a valid Hugging Face repo id") from None
    if (at and not revision) or (colon and not file):
        raise ModelError(f"{spec}: expected REPO[:FILE][@REVISION], e.g. owner/name@main or owner/name-GGUF:Q8_0")
    return HubRef(repo, revision or None, file or None)


def select_files(paths: list[str], ref: HubRef) -> list[str]:
    """What a pull of `ref` takes from a repo holding `paths`: one .gguf file
    (named by ref.file, or the repo's only one) from a GGUF repo, else the
    files of MODEL_FILES. ModelError when neither is there to take."""
    ggufs = [p for p in paths if p.lower().endswith(".gguf")]
    weights = [p for p in paths if "/" not in p and p.endswith(".safetensors")]
    if ref.file or (ggufs and not weights):
        return [_pick_gguf(ggufs, ref)]
    wanted = sorted(p for p in paths if MODULE_FILE.fullmatch(p)
                    or ("/" not in p and any(fnmatch.fnmatchcase(p, pat) for pat in MODEL_FILES)))
    if not weights or "config.json" not in wanted:
        sample = ", ".join(sorted(paths)[:6]) + (", ..." if len(paths) > 6 else "")
        raise ModelError(f"{ref.repo}: neither a model with safetensors weights and a config.json nor a GGUF repo "
                         f"(it holds {sample or 'no files'}); mlx_lm.convert converts other formats")
    return wanted


def gguf_tag(path: str) -> str:
    """How `REPO:TAG` names a GGUF file: its quantization, else its name."""
    name = Path(path).name
    m = QUANT_SUFFIX.search(name[: -len(".gguf")])
    return m.group(0)[1:] if m else name


def _pick_gguf(ggufs: list[str], ref: HubRef) -> str:
    # llama.cpp's vision projectors (mmproj-*.gguf) are not models of their own
    choices = [p for p in ggufs if not Path(p).name.lower().startswith("mmproj")]
    if ref.file:
        named = [p for p in ggufs if ref.file in (p, Path(p).name) or gguf_tag(p).lower() == ref.file.lower()]
        if len(named) == 1:
            return named[0]
        if len(named) > 1:
            raise ModelError(f"{ref}: {ref.file!r} names {len(named)} files ({', '.join(named[:4])}); "
                             "Tandem converts one whole GGUF file, not a split one")
    elif len(choices) == 1:
        return choices[0]
    if not choices:
        raise ModelError(f"{ref}: the repo holds no .gguf file to take")
    tags = ", ".join(f"{ref.repo}:{gguf_tag(p)}" for p in choices[:8]) + (", ..." if len(choices) > 8 else "")
    if ref.file:
        raise ModelError(f"{ref}: no GGUF file {ref.file!r} in the repo; it holds {tags}")
    raise ModelError(f"{ref.repo}: holds {len(choices)} GGUF files; name one: {tags}")


def cached(ref: HubRef) -> Path | None:
    """The local model of `ref` (its snapshot folder, or its .gguf file) if
    the cache holds every file a pull of it takes; None otherwise (not
    pulled, or a pull cut short). No network."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RevisionResolutionError

    try:
        commit = HfApi().resolve_revision(ref.repo, revision=ref.revision, local_files_only=True).resolved
    except RevisionResolutionError:
        return None
    folder = repo_folder(ref.repo) / "snapshots" / commit
    if not folder.is_dir():
        return None
    path, lacks = _inspect(ref, commit, folder)
    return None if lacks else path


def repo_folder(repo: str) -> Path:
    """Where huggingface_hub keeps `repo` (its HF_HUB_CACHE, read now)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")


def _inspect(ref: HubRef, commit: str, folder: Path) -> tuple[Path, str | None]:
    """(the model's path, what it lacks or None). The files a pull selects
    from the repo's tree as the Hub listed it (huggingface_hub caches the
    listing), or from the snapshot's own files when another tool fetched it."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        paths = [f.path for f in get_cached_repo_tree(ref.repo, revision=commit)]
    except CachedRepoTreeNotFoundError:
        paths = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    if ref.file is None and any(p.lower().endswith(".gguf") for p in paths) and not any(
            "/" not in p and p.endswith(".safetensors") for p in paths):
        # a GGUF repo of several files, named without one: the one pulled, if one was
        paths = [p for p in paths if (folder / p).is_file()] or paths
    wanted = select_files(paths, ref)
    absent = [p for p in wanted if not (folder / p).is_file()]
    if absent:
        return folder, f"no {absent[0]}" + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else "")
    if wanted[0].lower().endswith(".gguf"):
        return folder / wanted[0], None
    return folder, missing_part(folder)


@dataclass(frozen=True)
class DownloadedModel:
    name: str          # how --model names it: REPO[:FILE][@REF]
    path: Path         # the snapshot folder, or the .gguf file
    size: int          # bytes on disk of the revision's files
    kind: str          # chat, vision, embedding
    format: str        # mlx (safetensors) or gguf (converted on first use)
    lacks: str | None  # None when whole; else what a cut-short pull left out


def downloaded_models() -> list[DownloadedModel]:
    """The servable models in the cache, whole or not: each revision of each
    model repo with a config.json or a .gguf file (incomplete ones are those
    with `lacks` set; a repo that was never a model, e.g. a tokenizer, is left out)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = scan_cache_dir().repos
    except CacheNotFound:
        return []
    out = []
    for repo in sorted(repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: -r.last_modified):
            out += _servable(repo.repo_id, rev)
    return out


def _servable(repo: str, rev) -> list[DownloadedModel]:
    # the default branch's revision is the repo itself; another is named by its ref, else by its commit
    at = "" if "main" in rev.refs else f"@{min(rev.refs)}" if rev.refs else f"@{rev.commit_hash}"
    folder = Path(rev.snapshot_path)
    ggufs = sorted((f for f in rev.files if f.file_name.lower().endswith(".gguf")
                    and not f.file_name.lower().startswith("mmproj")), key=lambda f: f.file_name)
    if ggufs and not (folder / "config.json").exists():
        return [DownloadedModel(f"{repo}:{gguf_tag(f.file_name)}{at}" if len(ggufs) > 1 else f"{repo}{at}",
                                Path(f.file_path), rev.size_on_disk, "chat", "gguf", None) for f in ggufs]
    if not (folder / "config.json").exists():
        return []
    try:
        path, lacks = _inspect(HubRef(repo), rev.commit_hash, folder)
    except ModelError as e:  # not a model Tandem can serve (e.g. PyTorch weights only)
        path, lacks = folder, str(e).split(": ", 1)[-1]
    return [DownloadedModel(f"{repo}{at}", path, rev.size_on_disk, model_kind(folder), "mlx", lacks)]


def remove(ref: HubRef) -> tuple[int, list[str]]:
    """Delete `ref.repo` from the cache (all its revisions, or ref.revision's
    only) through huggingface_hub's cache API. Returns (bytes freed, the
    sha256 of each .gguf file deleted: its conversion is named by it)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except CacheNotFound:
        raise ModelError(f"{ref.repo}: not downloaded (there is no Hugging Face cache yet)") from None
    repo = next((r for r in info.repos if r.repo_id == ref.repo and r.repo_type == "model"), None)
    if repo is None:
        raise ModelError(f"{ref.repo}: not downloaded (`tandem list` shows what is)")
    revs = [r for r in repo.revisions if ref.revision is None or ref.revision in r.refs
            or r.commit_hash.startswith(ref.revision)]
    if not revs:
        held = ", ".join(sorted({n for r in repo.revisions for n in r.refs} | {r.commit_hash[:12] for r in repo.revisions}))
        raise ModelError(f"{ref}: no such revision downloaded (there are: {held})")
    strategy = info.delete_revisions(*(r.commit_hash for r in revs))
    ggufs = {f.blob_path for r in revs for f in r.files if f.file_name.lower().endswith(".gguf")}
    strategy.execute()
    return strategy.expected_freed_size, sorted(p.name for p in ggufs if not p.exists())  # a kept revision's stay


def size_text(n: int) -> str:
    """Bytes as people read them: 1.5 GiB, 820.3 MiB."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"

"""Reading the contracts folder as outside input (docs/explanation/receive.md, "Contracts are outside input").

Other teams write to the contracts folder, so every file and every ``$ref`` in it is
hostile until checked: only regular files inside the folder are read (never a FIFO, a
device, ``/proc``, a symlink out of the folder, an absolute path, a ``..`` escape or a
URL), each at most :data:`MAX_FILE_BYTES`, opened without blocking; a parsed document
may hold at most :data:`MAX_NODES` values, nested at most :data:`MAX_DEPTH` deep (YAML
aliases count once per use, so a "billion laughs" ends here); one schema may pull in at
most :data:`MAX_REF_FILES` files. Anything else is a :class:`ContractError` naming the
file or the ref, never a wait or a crash.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

from framework.errors import ContractError

MAX_FILE_BYTES = 1 << 20  # a contract or schema file; real ones are a few kB
MAX_NODES = 100_000  # values in one parsed document, YAML aliases expanded
MAX_DEPTH = 64  # nesting of one parsed document
MAX_REF_FILES = 64  # distinct files one payload schema may pull in through `$ref`
MAX_FOLDER_ENTRIES = 10_000  # files and folders looked at under the contracts folder
CONTRACT_SUFFIXES = (".yml", ".yaml", ".json")


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def inside(root: Path, path: Path) -> Path:
    """``path`` with every symlink resolved, if that is a regular file inside ``root``.

    Raises ContractError otherwise, saying what it is instead. Checked with ``os.stat``
    before anything opens it: opening a FIFO would wait for a writer.
    """
    top = root.resolve()
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop on older Pythons
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ContractError(f"{path}: cannot be resolved ({why})") from None
    if real != top and top not in real.parents:
        raise ContractError(f"{path}: resolves to {real}, outside the contracts folder {top}")
    mode = os.stat(real).st_mode
    if not stat.S_ISREG(mode):
        raise ContractError(f"{path}: is {_kind(mode)}; only regular files are read from the contracts folder")
    return real


def read_bytes(root: Path, path: Path) -> bytes:
    """The content of ``path``, a regular file inside ``root``, at most MAX_FILE_BYTES."""
    real = inside(root, path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(real, flags)
    except OSError as exc:
        raise ContractError(f"{path}: cannot be opened: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        # Checked again on what was opened: the file may have been swapped since the stat.
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ContractError(f"{path}: is not a regular file")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ContractError(f"{path}: larger than {MAX_FILE_BYTES} bytes; a contract or schema file is far smaller")
    return data


def parse(data: bytes, *, is_json: bool, label: str) -> Any:
    """The document in ``data`` (JSON or YAML), checked by :func:`check_size`.

    Raises ContractError (not valid UTF-8, JSON or YAML, too large or too deep)."""
    try:
        text = data.decode("utf-8")
        doc = json.loads(text) if is_json else yaml.safe_load(text)
    except RecursionError:
        raise ContractError(f"{label}: nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, yaml.YAMLError) as exc:  # UnicodeDecodeError is a ValueError
        what = "JSON" if is_json else "YAML"
        raise ContractError(f"{label}: not valid {what}: {str(exc)[:300]}") from None
    check_size(doc, label)
    return doc


def check_size(doc: Any, label: str) -> None:
    """Raise ContractError if ``doc`` holds more than MAX_NODES values or nests deeper than MAX_DEPTH.

    Iterative, and counting a shared (YAML alias) value each time it is used, so a
    self-referencing or exponentially aliased document ends here in bounded time.
    """
    stack: list[tuple[Any, int]] = [(doc, 0)]
    count = 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise ContractError(f"{label}: more than {MAX_NODES} values (YAML aliases count each time they are used)")
        if depth > MAX_DEPTH:
            raise ContractError(f"{label}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            for key, value in node.items():
                if not isinstance(key, str | int | float | bool) and key is not None:
                    raise ContractError(f"{label}: a mapping key of type {type(key).__name__}; keys are strings")
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)


def ref_target(root: Path, base: Path, ref: str) -> Path:
    """The file a ``$ref``'s file part names, relative to ``base`` (a folder inside ``root``).

    Only relative paths are taken: a URL (``http:``, ``file:``...), an absolute path, or a
    path that leaves the contracts folder is a ContractError naming the ref.
    """
    shown = repr(ref[:200])
    if len(ref) > 1000 or "\x00" in ref:
        raise ContractError(f"$ref {shown}: not a relative file path")
    parts = urlsplit(ref)
    if parts.scheme or parts.netloc:
        raise ContractError(
            f"$ref {shown}: a URL ({parts.scheme or '//'}); only files inside the contracts folder can be referenced"
        )
    file_part = unquote(parts.path)
    if file_part.startswith(("/", "\\")) or os.path.isabs(file_part):
        raise ContractError(f"$ref {shown}: an absolute path; give it relative to the file that refers to it")
    target = base / file_part
    lexical = Path(os.path.abspath(target))  # abspath normalises `..` without following symlinks
    top = Path(os.path.abspath(root))
    if lexical != top and top not in lexical.parents:
        raise ContractError(f"$ref {shown}: leaves the contracts folder")
    try:
        return inside(root, target)
    except ContractError as exc:
        raise ContractError(f"$ref {shown}: {exc}") from None


def from_file_uri(uri: str) -> Path:
    """The path of a ``file:`` URI the schema validators built from our own base URIs."""
    parts = urlsplit(uri)
    if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
        raise ContractError(f"$ref {uri[:200]!r}: only files inside the contracts folder can be referenced")
    return Path(unquote(parts.path))


def contract_files(root: Path) -> Iterator[Path]:
    """Every file under ``root`` with a contract suffix, sorted, symlinked folders not entered.

    Hidden files and folders (a leading ``.``) are not contracts: they hold tools'
    settings, such as the ``.spectral.yaml`` of Mosaic's schema lint beside its contracts.
    A folder with more than MAX_FOLDER_ENTRIES entries is a ContractError: the walk ends.
    """
    seen = 0
    found: list[Path] = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        seen += len(dirs) + len(files)
        if seen > MAX_FOLDER_ENTRIES:
            raise ContractError(
                f"{root}: more than {MAX_FOLDER_ENTRIES} files and folders; is it the contracts folder?"
            )
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [
            Path(folder) / name for name in files if name.endswith(CONTRACT_SUFFIXES) and not name.startswith(".")
        ]
    yield from sorted(found)


class SchemaFiles:
    """The schema files one payload schema pulls in through ``$ref``, read once each.

    Both validators (the reference one for the lint, jsonschema-rs for payloads) fetch
    referenced files through :meth:`retrieve`: it reads only regular files inside the
    contracts folder, at most MAX_REF_FILES of them, and answers a repeated URI (a ref
    cycle across files) from memory, so a payload check never touches the disk.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.documents: dict[str, Any] = {}

    def load(self, path: Path, label: str) -> Any:
        """The JSON document at ``path`` (inside the folder, checked), cached under its URI."""
        uri = path.as_uri()
        if uri in self.documents:
            return self.documents[uri]
        if len(self.documents) >= MAX_REF_FILES:
            raise ContractError(f"{label}: pulls in more than {MAX_REF_FILES} schema files through $ref")
        doc = parse(read_bytes(self.root, path), is_json=True, label=label)
        self.documents[uri] = doc
        return doc

    def retrieve(self, uri: str) -> Any:
        """The document at a ``file:`` URI, for the validators' ``$ref`` lookups."""
        if uri in self.documents:
            return self.documents[uri]
        path = from_file_uri(uri)
        try:
            real = inside(self.root, path)
        except ContractError as exc:
            raise ContractError(f"$ref {uri[:200]!r}: {exc}") from None
        return self.load(real, f"$ref {uri[:200]!r}")

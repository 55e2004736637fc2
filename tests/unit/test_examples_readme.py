"""The README's configuration reference lists every ``TXBOX_*`` setting of every part.

Settings are frozen dataclasses whose fields name their variable (framework.settings);
this test finds them all, so a new setting without documentation fails here. Print the
generated section with ``python -m tests.unit.test_examples_readme``.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path

import framework
from framework.settings import Seconds, describe

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
# Modules that need optional extras (Spark, the web stack) are still documented when
# importable; a missing extra just skips them here.
_EXTRAS = {"pyspark", "pyarrow", "starlette", "uvicorn", "jinja2", "multipart", "python_multipart"}
_TITLES = {
    "Settings": "Every command: which service, where its database and broker are",
    "RelayConfig": "`txbox publisher`",
    "PublisherConfig": "Direct sends (`Publisher.publish`)",
    "ReceiverConfig": "`txbox receiver`",
    "WorkerConfig": "`txbox worker`",
    "CollectorConfig": "`txbox collector`",
    "AnalyzeSettings": "`txbox analyze`",
    "ArchiveSettings": "`txbox archive`",
    "RetentionSettings": "Retention: `txbox publisher` prunes the outbox, `txbox worker` the inbox",
    "SigningConfig": "Event signing: `txbox publisher` signs events, `txbox receiver` verifies them",
    "JwtSettings": "The permission guard: tokens of messages whose handler declares `permissions`",
}


def settings_classes() -> list[type]:
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(framework.__path__, "framework."):
        if ".migrations" in info.name:
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            # Only a missing optional extra may hide a module; `make test` installs them all.
            if (exc.name or "").split(".")[0] not in _EXTRAS:
                raise
            continue
        for obj in vars(module).values():
            if not (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__):
                continue
            fields = dataclasses.fields(obj)
            if fields and all("env" in f.metadata for f in fields):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    settings = found.pop("framework.settings.Settings")
    return [settings, *(found[k] for k in sorted(found))]


def _default(cls: type, name: str, raw: str) -> str:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default is dataclasses.MISSING:
        return "*required*"
    value = field.default
    if isinstance(value, Seconds) or (field.type in ("Seconds", Seconds)):
        seconds = float(value)  # type: ignore[arg-type]
        return f"`{seconds * 1000:g}ms`" if 0 < seconds < 1 else f"`{seconds:.15g}s`"
    return f"`{raw}`" if raw and raw != "None" else "(none)"


def render() -> str:
    parts = [START]
    for cls in settings_classes():
        doc = (cls.__doc__ or "").strip()
        if doc.startswith(f"{cls.__name__}("):  # the signature dataclasses put there
            doc = ""
        title = _TITLES.get(cls.__name__) or (doc.splitlines()[0] if doc else cls.__name__)
        parts.append(f"\n**{title}** (`{cls.__module__}.{cls.__qualname__}`)\n")
        parts.append("| variable | default | meaning (example) |\n|---|---|---|")
        names = [f.name for f in dataclasses.fields(cls)]
        for name, (env, raw, example, help_) in zip(names, describe(cls), strict=True):
            parts.append(f"| `{env}` | {_default(cls, name, raw)} | {help_} (`{example}`) |")
    parts.append(END)
    return "\n".join(parts)


def test_readme_documents_every_setting() -> None:
    readme = (ROOT / "README.md").read_text()
    documented = set(re.findall(r"`(TXBOX_[A-Z0-9_]+)`", readme))
    missing = [env for cls in settings_classes() for env, *_ in describe(cls) if env not in documented]
    assert not missing, (
        f"README.md does not document {', '.join(missing)}; regenerate the configuration reference "
        "with `python -m tests.unit.test_examples_readme` and paste it between the markers"
    )


def test_readme_keeps_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme
    assert "make test" in readme


if __name__ == "__main__":
    print(render())
